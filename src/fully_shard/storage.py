"""A parameter's unsharded side: what it sends, where the gathered bytes land, and freeing them.

Between a parameter's local shard and the tensor the module computes with sits one object,
chosen per parameter (:class:`UnshardedSide`); :class:`~fully_shard.param.ShardedParam`
hands its whole all-gather seam to it::

    inputs(p, piece, q, mp)  what this rank sends (GatherInputs)  all_gather_inputs
    alloc(p)           make the bytes the gather lands in         alloc_storage
    destinations()     (W, numel) views to copy straight into     all_gather_destinations
    finish(p, blocks)  build / refill p.unsharded_param           finish_all_gather
    free()             resize those bytes to 0                    free_storage
    allocated()        whether they are there now                 storage_allocated

Three kinds exist:

- :class:`DenseStorage`, every plain parameter: one padded tensor of the full shape in the
  compute dtype, written through the parameter's gather format (plain copy or int8
  dequantize, :mod:`fully_shard.quantize`); ``unsharded_param`` is a narrow view of it.
- :class:`WholeShard`, a plain parameter whose shard is the whole tensor (one shard rank: W=1,
  or HSDP with shard size 1) and already what forward computes with (its dtype, its device):
  ``unsharded_param`` shares the shard's storage, so there is nothing to send, copy or free.
- :class:`~fully_shard.extensions.SubclassGather`, a tensor subclass with
  ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: the subclass says what is sent and
  builds the unsharded tensor from the gathered outputs, which it keeps as its storage.

Example:
    >>> side = DenseStorage()
    >>> side.allocated(), side.destinations()
    (False, None)
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .layout import ParamView, ShardLayout
from .packing import GatherInput
from .policies import MixedPrecisionPolicy, QuantizationPolicy
from .quantize import PLAIN, GatherFormat


class UnshardedSide(Protocol):
    """The all-gather seam of one parameter; see the module docstring for who calls what."""

    def inputs(
        self,
        p: ParamView,
        piece: tuple[torch.Tensor, ShardLayout] | None,
        policy: QuantizationPolicy,
        mp: MixedPrecisionPolicy,
    ) -> list[GatherInput]:
        """What to send; ``piece``: a post-forward piece to gather instead of the shard;
        ``policy``: the group's quantization policy, for the shard's gather format; ``mp``:
        its mixed precision policy (``p.compute_dtype`` is already its answer), which a
        subclass's own pre-all-gather hook receives."""
        ...

    def alloc(self, p: ParamView) -> None: ...

    def destinations(self) -> list[torch.Tensor] | None: ...

    def finish(self, p: ParamView, blocks: list[torch.Tensor] | None) -> None: ...

    def free(self) -> None: ...

    def allocated(self) -> bool: ...


class DenseStorage:
    """The padded unsharded tensor ``(W * chunk, *rest)`` of a parameter, in the compute dtype.

    Its bytes are allocated for forward/backward and freed (``resize_(0)``) after; the tensor
    object lives on, and so does ``unsharded_param`` (a narrow view of it), so tensors that
    autograd saved in forward stay valid after it is freed and refilled for backward. Writes
    go through ``alias`` (``storage.data``: its own version counter), so refilling it for
    backward does not trip autograd's saved-tensor version check.

    Example:
        >>> DenseStorage().alias is None
        True
    """

    def __init__(self) -> None:
        self.storage: torch.Tensor | None = None
        self.alias: torch.Tensor | None = None
        # The layout and format of the all-gather in flight (set by inputs), for the copy-out.
        self._gathering: tuple[ShardLayout, GatherFormat] | None = None

    def inputs(
        self,
        p: ParamView,
        piece: tuple[torch.Tensor, ShardLayout] | None,
        policy: QuantizationPolicy,
        mp: MixedPrecisionPolicy,
    ) -> list[GatherInput]:
        if piece is not None:  # already dequantized rows: they travel plain
            data, layout = piece
            fmt: GatherFormat = PLAIN
        else:
            data, layout = p.local_shard, p.layout
            fmt = p.gather_format(policy)
        self._gathering = (layout, fmt)
        return fmt.inputs(data, layout.padded_shard_size, layout.dim, p.compute_dtype)

    def alloc(self, p: ParamView) -> None:
        """Allocate (first time: create) the storage and point ``p.unsharded_param`` at it.

        The storage is in the compute dtype of now: if that changed since the last unshard
        (``model.to(dtype)``), it is allocated anew and the unsharded parameter (the same
        ``nn.Parameter`` object, so hooks on it stay) is pointed at it.
        """
        dtype, device = p.compute_dtype, p.info.device
        if self.storage is not None and self.storage.dtype == dtype:
            untyped = self.storage.untyped_storage()
            nbytes = self.storage.numel() * self.storage.element_size()
            if untyped.size() != nbytes:
                untyped.resize_(nbytes)
            return
        storage = torch.empty(p.layout.padded_full_size, dtype=dtype, device=device)
        self.storage = storage
        self.alias = storage.data
        view = storage.narrow(p.shard_dim, 0, p.orig_size[p.shard_dim])
        if p.tp is not None:
            # The TP modules compute with DTensors on the TP mesh; it wraps the same bytes.
            view = DTensor.from_local(
                view,
                p.tp.mesh,
                p.tp.placements,
                run_check=False,
                shape=p.tp.size,
                stride=p.tp.stride,
            )
        if p.unsharded_param is None:
            p.unsharded_param = nn.Parameter(view, requires_grad=p.requires_grad)
        else:
            p.unsharded_param.data = view

    def destinations(self) -> list[torch.Tensor] | None:
        """``None`` when the storage has no ``(world, numel)`` view (sharded on a dim > 0) or
        the blocks must be unpacked first (int8)."""
        gathering, alias = self._gathering, self.alias
        if gathering is None or alias is None or gathering[0].dim != 0 or not gathering[1].direct:
            return None
        return [_gathered_rows(alias, gathering[0]).view(gathering[0].world, -1)]

    def finish(self, p: ParamView, blocks: list[torch.Tensor] | None) -> None:
        gathering, alias = self._gathering, self.alias
        self._gathering = None
        if blocks is None:
            return
        if gathering is None or alias is None:
            raise RuntimeError(f"{p.fqn}: all-gather output before its input (internal error)")
        layout, fmt = gathering
        # rank r's padded shard lands at rows [r*chunk, (r+1)*chunk) of dim `shard_dim`
        fmt.rebuild(blocks, layout.ranked(_gathered_rows(alias, layout)))

    def free(self) -> None:
        if self.storage is not None:
            self.storage.untyped_storage().resize_(0)

    def allocated(self) -> bool:
        return self.storage is not None and self.storage.untyped_storage().size() > 0


def _gathered_rows(storage: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The rows of ``storage`` (``W * chunk`` on the split dim) that a gather split like
    ``layout`` fills: all of them, or the front ``n * chunk'`` for a post-forward piece's."""
    rows = layout.world * layout.chunk
    # The W-rank split (every gather but a post-forward piece's) fills all of it: no view.
    return storage if rows == storage.size(layout.dim) else storage.narrow(layout.dim, 0, rows)


class WholeShard:
    """The unsharded side of a parameter whose one shard rank holds all of it, as computed.

    ``unsharded_param`` is a leaf over the local shard's own storage: the gather sends
    nothing (its group then issues no collective), nothing is copied in or out, and freeing
    frees nothing (the bytes are the shard's). The optimizer's in-place step on the shard is
    what the next forward sees. Chosen by :meth:`ShardedParam._choose_unsharded_side` only
    for a plain gather format in the shard's own dtype, on the compute device, without tensor
    parallelism; a parameter that needs a cast, an offloaded shard or int8 keeps
    :class:`DenseStorage` (its group still skips the one-rank collective).

    Example:
        >>> WholeShard().allocated(), WholeShard().destinations()
        (True, [])
    """

    def inputs(
        self,
        p: ParamView,
        piece: tuple[torch.Tensor, ShardLayout] | None,
        policy: QuantizationPolicy,
        mp: MixedPrecisionPolicy,
    ) -> list[GatherInput]:
        return []

    def alloc(self, p: ParamView) -> None:
        local = p.local_shard
        param = p.unsharded_param
        if param is None:
            p.unsharded_param = nn.Parameter(local.detach(), requires_grad=p.requires_grad)
        elif param.untyped_storage().data_ptr() != local.untyped_storage().data_ptr() or (
            param.dtype != local.dtype or param.shape != local.shape
        ):
            # _apply replaced the shard (to_empty, to): the same Parameter object over it.
            param.data = local.detach()

    def destinations(self) -> list[torch.Tensor] | None:
        return []

    def finish(self, p: ParamView, blocks: list[torch.Tensor] | None) -> None:
        return None

    def free(self) -> None:
        return None

    def allocated(self) -> bool:
        return True
