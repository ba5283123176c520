"""Tensor-subclass all-gather extensions: ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``.

A parameter whose data is a tensor subclass defining both methods (torchao's float8 training
weights, a hand-written quantized weight) is not gathered as its own elements: the subclass
says what goes over the wire and how the unsharded tensor is rebuilt. The protocol is torch
FSDP2's, so a subclass written for it works unchanged::

    local shard (subclass, (rows, *rest))
      .fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)
          -> (inputs: tuple[Tensor, ...], metadata)       # what this rank sends
    inputs, padded to (chunk, *rest_i) each  --all-gather-->  outputs (W * chunk, *rest_i)
    local shard.fsdp_post_all_gather(outputs, metadata, param_dtype)
          -> (unsharded tensor, inner tensors to free)    # first gather
    local shard.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded)
          -> None                                         # every later gather: fill in place

- ``mesh`` is the shard dim's 1-D mesh; ``outer_size`` / ``outer_stride`` the full
  parameter's shape and contiguous strides; ``module`` the module that holds the parameter;
  ``mp_policy`` the group's :class:`~fully_shard.MixedPrecisionPolicy`. A hook that takes only
  ``mesh`` (older torch's signature, still torchao's) is called with ``mesh`` alone.
- ``param_dtype`` is the policy's compute dtype for the parameter (its own dtype without one).
- The outputs are one buffer per input that lives as long as the parameter: freeing means
  resizing its storage (and the inner tensors') to 0, and the next gather writes into the same
  storage before calling the post hook with ``out=``. That is what lets a post hook keep
  views of the outputs (torchao's float8 tensor holds the gathered bytes as its data) and only
  refresh what changed (the scale). A new input size or dtype (``model.to(dtype)``) allocates
  new outputs and rebuilds without ``out=``.
- Uneven sharding on dim 0: torch requires the pre hook to return inputs of the padded size
  ``(chunk, *rest)`` on ranks whose shard is short. We accept those, and also inputs of the
  local rows ``(rows, *rest)``, which we pad with zeros (torchao's float8 weights return
  these; torch's FSDP2 fails on them). The post hook sees ``W * chunk`` rows and the
  unsharded parameter is its result cut to the parameter's shape, as in torch.

Not supported (checked by :func:`check_extension_plan` before ``fully_shard`` changes
anything): sharding such a parameter on a dim other than 0, ``reshard_after_forward=<int>``
(torch's FSDP2 cannot either), and a tensor-parallel DTensor whose local tensor is such a
subclass.

Example:
    >>> class MyWeight(torch.Tensor):  # doctest: +SKIP
    ...     def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    ...         return (quantize(self._data),), None
    ...     def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
    ...         if out is not None:
    ...             out.copy_(dequantize(outputs[0]))
    ...             return None
    ...         full = dequantize(outputs[0]).to(param_dtype)
    ...         return full, (full,)
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ._compat import local_tensor
from .errors import FullyShardNotImplementedError, FullyShardTypeError, FullyShardValueError
from .layout import ParamView, ShardLayout
from .mesh import MeshInfo, contiguous_stride
from .packing import GatherInput, typed_block
from .policies import MixedPrecisionPolicy, QuantizationPolicy

# How many arguments (after self) torch's fsdp_pre_all_gather takes: the old form (mesh) and
# the current one (mesh, outer_size, outer_stride, module, mp_policy).
_PRE_ARITIES = (1, 5)


def has_extension(t: object) -> bool:
    """Whether ``t`` (a parameter's local data) defines the all-gather extension hooks."""
    return hasattr(t, "fsdp_pre_all_gather") or hasattr(t, "fsdp_post_all_gather")


def _pre_arity(t: object, fqn: str) -> int:
    """The number of arguments ``t.fsdp_pre_all_gather`` takes, after checking both hooks."""
    missing = [n for n in ("fsdp_pre_all_gather", "fsdp_post_all_gather") if not hasattr(t, n)]
    if missing:
        raise FullyShardTypeError(
            f"parameter {fqn!r} is a {type(t).__name__} that defines only one of "
            f"fsdp_pre_all_gather / fsdp_post_all_gather (missing {missing[0]}); an all-gather "
            "extension needs both, or neither"
        )
    pre = t.fsdp_pre_all_gather  # type: ignore[attr-defined]  # checked just above
    try:
        params = inspect.signature(pre).parameters
    except (TypeError, ValueError):  # a builtin or C method: nothing to count, trust it
        return 5
    # *args / **kwargs: the hook takes whatever it is given; call it with every argument.
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return 5
    if len(params) not in _PRE_ARITIES:
        raise FullyShardTypeError(
            f"parameter {fqn!r}: {type(t).__name__}.fsdp_pre_all_gather{inspect.signature(pre)} "
            "takes neither torch's arguments (mesh, outer_size, outer_stride, module, "
            "mp_policy) nor the older (mesh) alone; give it one of these signatures"
        )
    return len(params)


def check_extension_plan(
    local: torch.Tensor, fqn: str, shard_dim: int, tensor_parallel: bool, post_forward: int | None
) -> None:
    """Refuse, before anything changes, what an extension parameter cannot do here."""
    if not has_extension(local):
        return
    _pre_arity(local, fqn)
    kind = type(local).__name__
    if tensor_parallel:
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a tensor-parallel DTensor whose local tensor is a {kind} "
            "with an all-gather extension (fsdp_pre_all_gather); that combination is not "
            "supported yet: apply fully_shard without tensor parallelism on these modules, or "
            "keep the weight a plain tensor"
        )
    if shard_dim != 0:
        raise FullyShardNotImplementedError(
            f"parameter {fqn!r} is a {kind} with an all-gather extension "
            f"(fsdp_pre_all_gather), which is sharded on dim 0 only, but shard_placement_fn "
            f"chose Shard({shard_dim}); return None or Shard(0) for it"
        )
    if post_forward is not None:
        raise FullyShardNotImplementedError(
            f"reshard_after_forward={post_forward} with parameter {fqn!r}, a {kind} with an "
            "all-gather extension (fsdp_pre_all_gather), is not supported (torch's "
            "fully_shard cannot do it either: the post-forward piece would have to be "
            "gathered without the extension); pass reshard_after_forward=True or False for "
            "this module"
        )


def _shard_mesh(info: MeshInfo) -> DeviceMesh:
    """The 1-D mesh of the shard dim, which the pre hook is given (as in torch)."""
    mesh = info.mesh
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is not None:
        return mesh[names[info.shard_mesh_dim]]
    return DeviceMesh.from_group(info.shard_group, mesh.device_type)


class SubclassGather:
    """One extension parameter's all-gather: its hooks, its output buffers, its inner tensors.

    The :class:`~fully_shard.storage.UnshardedSide` of such a parameter: per unshard,
    :meth:`inputs` (pre hook), :meth:`alloc` and :meth:`destinations` (the buffers the
    gathered bytes land in), :meth:`finish` (post hook); and :meth:`free` at reshard.

    Example:
        >>> gather = SubclassGather("w", torch.Size([4, 3]), module, info)  # doctest: +SKIP
        >>> q, mp = QuantizationPolicy(), MixedPrecisionPolicy()
        >>> gather.inputs(sharded_param, None, q, mp)  # doctest: +SKIP
        [GatherInput(data=..., dtype=torch.int8, padded_size=torch.Size([2, 3]), dim=0), ...]
    """

    def __init__(self, fqn: str, outer_size: torch.Size, module: nn.Module, info: MeshInfo) -> None:
        self.fqn = fqn
        self.outer_size = outer_size
        self.outer_stride = contiguous_stride(outer_size)
        self.module = module
        self.info = info
        self._mesh: DeviceMesh | None = None  # made at the first gather (may create a group)
        # What the last pre hook returned, until its gather is finished.
        self._metadata: Any = None
        self._sizes: list[torch.Size] = []  # (chunk, *rest_i): every rank's input i
        self._dtypes: list[torch.dtype] = []
        self._world = 0
        # The all-gather outputs, one flat (W * numel_i,) buffer per input, kept across
        # iterations (freed by resize); the aliases are what we write through.
        self._outputs: list[torch.Tensor] = []
        self._aliases: list[torch.Tensor] = []
        # What the post hook said to free at reshard, with their byte sizes to restore.
        self._inner: list[tuple[torch.Tensor, int]] = []
        self._built = False  # the post hook built the unsharded tensor from these outputs
        self._local: torch.Tensor | None = None  # the shard whose pre hook ran, until finish

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            self._mesh = _shard_mesh(self.info)
        return self._mesh

    def inputs(
        self,
        p: ParamView,
        piece: tuple[torch.Tensor, ShardLayout] | None,
        policy: QuantizationPolicy,
        mp: MixedPrecisionPolicy,
    ) -> list[GatherInput]:
        """Call the pre hook of this rank's rows and describe what it returned."""
        if piece is not None:
            raise RuntimeError(f"{self.fqn}: a post-forward piece of a subclass (internal error)")
        # The DTensor's own local tensor now: what was set on it since (torchao's
        # precomputed float8 scale) is what the hook reads.
        local = self._local = local_tensor(p.sharded_param)
        world, chunk = p.layout.world, p.layout.chunk
        return self._pre_all_gather(local, world, chunk, mp)

    def _pre_all_gather(
        self, local: torch.Tensor, world: int, chunk: int, mp_policy: MixedPrecisionPolicy
    ) -> list[GatherInput]:
        arity = _pre_arity(local, self.fqn)
        if local.device != self.info.device:  # offloaded shards: the hook runs on the device
            local = local.to(self.info.device, non_blocking=True)
        pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]  # checked by _pre_arity
        with torch.no_grad():  # what is sent is data, never part of a graph (as in torch)
            if arity == 1:
                result = pre(self.mesh)
            else:
                result = pre(self.mesh, self.outer_size, self.outer_stride, self.module, mp_policy)
        tensors, metadata = self._pair(
            result,
            local,
            "fsdp_pre_all_gather",
            "it must return (all_gather_inputs, metadata), a tuple of tensors and any object",
        )
        rows = local.size(0)
        # Every rank knows whether the split is uneven, so every rank applies the same rule
        # (and raises alike) instead of one rank failing while the others wait to gather.
        even = chunk * world == self.outer_size[0]
        gathered = []
        for i, t in enumerate(_as_tensors(tensors, self.fqn, type(local).__name__)):
            what = f"all-gather input {i} of {type(local).__name__}.fsdp_pre_all_gather"
            if t.dim() == 0:
                raise FullyShardValueError(
                    f"parameter {self.fqn!r}: {what} is 0-dimensional; return it with shape (1,)"
                )
            if not even and t.size(0) not in (rows, chunk):
                raise FullyShardValueError(
                    f"parameter {self.fqn!r}: {what} has shape {tuple(t.shape)}; the parameter "
                    f"of shape {tuple(self.outer_size)} splits unevenly over {world} ranks, so "
                    f"on dim 0 every input needs this rank's {rows} rows (padded here) or the "
                    f"padded {chunk} rows that every rank sends"
                )
            padded = t.shape if even else torch.Size([chunk, *t.shape[1:]])
            gathered.append(GatherInput(t, t.dtype, padded, 0))
        self._metadata = metadata
        self._sizes = [gi.padded_size for gi in gathered]
        self._dtypes = [gi.dtype for gi in gathered]
        self._world = world
        return gathered

    def _pair(self, result: object, local: torch.Tensor, hook: str, rule: str) -> tuple[Any, Any]:
        """``result`` as the 2-tuple a hook must return, or an error naming the hook."""
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise FullyShardTypeError(
                f"parameter {self.fqn!r}: {type(local).__name__}.{hook} returned a "
                f"{type(result).__name__}; {rule}"
            )
        return result[0], result[1]

    def alloc(self, p: ParamView) -> None:
        """Make the output buffers of the pending gather: resized back, or new if its input
        sizes or dtypes differ from the buffers'."""
        device = self.info.device
        same = len(self._outputs) == len(self._sizes) and all(
            o.dtype == d and o.numel() == self._world * s.numel()
            for o, s, d in zip(self._outputs, self._sizes, self._dtypes, strict=True)
        )
        if not same:
            self._outputs = [
                torch.empty(self._world * s.numel(), dtype=d, device=device)
                for s, d in zip(self._sizes, self._dtypes, strict=True)
            ]
            # Written through .data aliases: the outputs' own version counters do not move,
            # so views of them that autograd saved in forward stay valid for backward.
            self._aliases = [o.data for o in self._outputs]
            self._inner = []
            self._built = False
            return
        for t in self._outputs:
            _resize_to(t, t.numel() * t.element_size())
        for t, nbytes in self._inner:
            _resize_to(t, nbytes)

    def destinations(self) -> list[torch.Tensor]:
        """``(W, numel_i)`` views of the output buffers, one per input, for the copy-out."""
        return [a.view(self._world, -1) for a in self._aliases]

    def finish(self, p: ParamView, blocks: list[torch.Tensor] | None) -> None:
        """Run the post hook on the gathered outputs (``blocks``: this parameter's ``(W, n_i)``
        column blocks of the group's buffer, or ``None`` when they were copied into
        :meth:`destinations` already). The first time, and after new output buffers, the
        unsharded parameter is the new tensor it builds; later, the hook refills it in place
        (``out=``)."""
        if self._local is None:
            raise RuntimeError(f"{self.fqn}: all-gather output before its input (internal error)")
        local, self._local = self._local, None
        built = self._post_all_gather(local, blocks, p.compute_dtype, p.unsharded_param)
        if built is not None:
            p.unsharded_param = nn.Parameter(built, requires_grad=p.requires_grad)

    def _post_all_gather(
        self,
        local: torch.Tensor,
        blocks: Sequence[torch.Tensor] | None,
        param_dtype: torch.dtype,
        out: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """The post hook on the gathered outputs: the new unsharded tensor (cut to the
        parameter's shape), or ``None`` when ``out`` (built from these outputs) was filled."""
        if blocks is not None:
            for alias, block in zip(self._aliases, blocks, strict=True):
                alias.view(self._world, -1).copy_(typed_block(block, alias.dtype))
        outputs = tuple(o.view(-1, *s[1:]) for o, s in zip(self._outputs, self._sizes, strict=True))
        metadata, self._metadata = self._metadata, None
        post = local.fsdp_post_all_gather  # type: ignore[attr-defined]  # an extension's
        if self._built and out is not None:
            post(outputs, metadata, param_dtype, out=out)
            return None
        result = post(outputs, metadata, param_dtype)
        unsharded, inner = self._pair(
            result,
            local,
            "fsdp_post_all_gather",
            "without out= it must return (unsharded_tensor, inner_tensors_to_free)",
        )
        if not isinstance(unsharded, torch.Tensor):
            raise FullyShardTypeError(
                f"parameter {self.fqn!r}: fsdp_post_all_gather returned a "
                f"{type(unsharded).__name__} as the unsharded tensor; it must be a tensor"
            )
        inner_tensors = _as_tensors(inner, self.fqn, type(local).__name__)
        self._inner = [(t, t.untyped_storage().size()) for t in inner_tensors]
        self._built = True
        size = self.outer_size
        if unsharded.size() == size:
            return unsharded
        if unsharded.shape[1:] == size[1:] and unsharded.size(0) >= size[0]:
            # The hook built all W * chunk rows: the parameter is the first rows of them
            # (narrow: right for a non-contiguous result too).
            return unsharded.narrow(0, 0, size[0])
        # Any other shape (a flat result): its first elements, read contiguously, as torch.
        return torch.as_strided(unsharded, size, self.outer_stride, 0)

    def free(self) -> None:
        """Free the output buffers and the inner tensors; the tensor objects stay."""
        for t in self._outputs:
            t.untyped_storage().resize_(0)
        for t, _ in self._inner:
            t.untyped_storage().resize_(0)

    def allocated(self) -> bool:
        return any(t.untyped_storage().size() > 0 for t in self._outputs)


def _as_tensors(value: object, fqn: str, kind: str) -> list[torch.Tensor]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in value):
        raise FullyShardTypeError(
            f"parameter {fqn!r}: an all-gather hook of {kind} returned {type(value).__name__} "
            "where a tuple of tensors was expected"
        )
    return list(value)


def _resize_to(t: torch.Tensor, nbytes: int) -> None:
    storage = t.untyped_storage()
    if storage.size() != nbytes:
        storage.resize_(nbytes)
