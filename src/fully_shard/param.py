"""``ShardedParam``: one parameter's life — its shard, its DTensor, its unsharded tensor, its grad.

The tensors of one parameter ``P`` of global shape ``(d0, *rest)``, sharded on dim 0 over W
ranks with ``c = ceil(d0 / W)`` rows per rank (like ``torch.chunk``; trailing ranks may hold
fewer rows, or none)::

    local shard     (rows_r, *rest)   rank r's rows [r*c, r*c + rows_r); lives on the shard
                                      device; ``sharded_param`` wraps it as a DTensor
    sharded_param   nn.Parameter(DTensor(local shard, Shard(0), shape=(d0, *rest)))
                                      what the module, the optimizer and state_dict see
                                      outside forward and backward
    storage         (W*c, *rest)      the padded unsharded tensor in the compute dtype; its
                                      bytes are allocated for forward/backward and freed
                                      (``resize_(0)``) after, the tensor object itself lives on
    unsharded_param nn.Parameter(storage[:d0])
                                      what the module sees during forward and backward; one
                                      object for the parameter's whole life, so tensors that
                                      autograd saved in forward are still valid after the
                                      storage is freed and refilled for backward

Writes into ``storage`` go through ``storage.data`` (an alias with its own version counter),
so refilling it for backward does not trip autograd's saved-tensor version check.

Sharding on another dim ``d`` works the same way with ``c = ceil(P.size(d) / W)`` and the
padding along ``d``; the unsharded parameter is then a (possibly non-contiguous) narrow view.

A tensor-parallel parameter (a DTensor on ``root["tp"]``) is handled as its TP-local tensor:
``P`` above is that local tensor, the sharded DTensor lives on ``root`` with the placements of
:func:`~fully_shard.mesh.combined_placements`, and the unsharded parameter is a DTensor on the
TP mesh again (``DTensor.from_local`` of the storage view), which is what the TP modules expect.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .mesh import MeshInfo, TPLayout, combined_placements, contiguous_stride


def _as_dtensor(t: torch.Tensor, fqn: str) -> DTensor:
    if not isinstance(t, DTensor):
        raise RuntimeError(f"{fqn}: the sharded parameter is not a DTensor (internal error)")
    return t


class ShardedParam:
    """One managed parameter: how it is split, where its pieces live, which one is registered.

    Example:
        >>> sp = group.params[0]  # doctest: +SKIP
        >>> sp  # doctest: +SKIP
        ShardedParam(layers.0.w1, global=(16, 15), local=(4, 15), Shard(0)@dp, SHARDED)
    """

    def __init__(
        self,
        param: nn.Parameter,
        slots: list[tuple[nn.Module, str]],
        fqn: str,
        shard_dim: int,
        info: MeshInfo,
        shard_device: torch.device,
        pin_memory: bool,
        compute_dtype: torch.dtype,
        tp: TPLayout | None = None,
    ) -> None:
        self.fqn = fqn
        # Every (module, attribute) that refers to this parameter: a tied weight has several.
        self.slots = slots
        self.shard_dim = shard_dim
        self.info = info
        self.tp = tp
        # What we shard: the parameter itself, or its TP-local tensor.
        source = param.to_local() if isinstance(param, DTensor) else param
        self.orig_size = source.size()
        self.global_size = param.size()
        self.orig_dtype = param.dtype
        self.compute_dtype = compute_dtype
        self.shard_device = shard_device

        world, rank = info.shard_size, info.shard_rank
        dim_size = self.orig_size[shard_dim]
        self.chunk = math.ceil(dim_size / world)
        self.offset = min(rank * self.chunk, dim_size)
        self.local_rows = max(0, min(self.offset + self.chunk, dim_size) - self.offset)
        padded = list(self.orig_size)
        padded[shard_dim] = self.chunk
        self.padded_shard_size = torch.Size(padded)
        self.padded_numel = self.padded_shard_size.numel()
        padded[shard_dim] = self.chunk * world
        self.padded_full_size = torch.Size(padded)
        self.world = world

        with torch.no_grad():
            if param.device.type == "meta":
                local = torch.empty(self._local_size(), dtype=param.dtype, device="meta")
            else:
                local = source.detach().narrow(shard_dim, self.offset, self.local_rows)
                local = torch.empty(
                    self._local_size(),
                    dtype=param.dtype,
                    device=shard_device,
                    pin_memory=pin_memory and shard_device.type == "cpu",
                ).copy_(local)
            dt = self._dtensor_from_local(local)
        self.sharded_param = nn.Parameter(dt, requires_grad=param.requires_grad)
        self._local: torch.Tensor = local

        self.unsharded_param: nn.Parameter | None = None
        self._storage: torch.Tensor | None = None
        self._storage_alias: torch.Tensor | None = None
        # Gradients kept unreduced across backward passes with gradient sync off.
        self.unsharded_accumulated_grad: torch.Tensor | None = None

    @property
    def requires_grad(self) -> bool:
        """Trainable now: read off the sharded parameter, which ``requires_grad_()`` changes."""
        return self.sharded_param.requires_grad

    def _local_size(self) -> torch.Size:
        size = list(self.orig_size)
        size[self.shard_dim] = self.local_rows
        return torch.Size(size)

    def __repr__(self) -> str:
        names = self.info.mesh.mesh_dim_names
        dim_name = names[self.info.shard_mesh_dim] if names else f"dim{self.info.shard_mesh_dim}"
        state = "UNSHARDED" if self.is_registered_unsharded() else "SHARDED"
        return (
            f"ShardedParam({self.fqn}, global={tuple(self.orig_size)}, "
            f"local={tuple(self._local.shape)}, Shard({self.shard_dim})@{dim_name}, {state})"
        )

    # -- the sharded side ---------------------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        """The local rows of the sharded DTensor (``(rows_r, *rest)`` for dim 0)."""
        return self._local

    def sync_with_module(self) -> None:
        """Pick up a sharded parameter that ``Module._apply`` (e.g. ``to_empty``) replaced.

        ``_apply`` either swaps the tensor inside our ``nn.Parameter`` or puts a new parameter
        in the module; either way the module's current one becomes ours again.
        """
        module, name = self.slots[0]
        current: object = module._parameters[name]
        # cast: a Parameter can wrap a DTensor, which mypy cannot see
        if isinstance(current, DTensor) and current is not cast(object, self.sharded_param):
            if not isinstance(current, nn.Parameter):
                current = nn.Parameter(current, requires_grad=self.requires_grad)
            self.sharded_param = current
        with torch.no_grad():
            local = _as_dtensor(self.sharded_param, self.fqn).to_local()
            if self.shard_device.type == "cpu" and local.device.type not in ("cpu", "meta"):
                # e.g. to_empty(device="cuda") on a CPU-offloaded module: shards stay on CPU
                local = local.cpu()
                self.sharded_param = nn.Parameter(
                    self._dtensor_from_local(local), requires_grad=self.requires_grad
                )
            self._local = local
        self.register(self.sharded_param)

    def _dtensor_from_local(self, local: torch.Tensor) -> DTensor:
        if self.tp is None:
            mesh, placements = self.info.mesh, self.info.placements(self.shard_dim)
        else:
            mesh, placements = self.tp.root, combined_placements(self.tp, self.shard_dim)
        return DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=self.global_size,
            stride=contiguous_stride(self.global_size),
        )

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Add ``local_grad`` (this rank's reduced rows) into the sharded DTensor's ``.grad``."""
        local_grad = local_grad.to(dtype=self.orig_dtype, device=self._local.device)
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = self._dtensor_from_local(local_grad)
        else:
            # Under no_grad, to_local() is the DTensor's own local tensor: add in place.
            _as_dtensor(grad, self.fqn).to_local().add_(local_grad)

    # -- the unsharded side -------------------------------------------------------------------

    def all_gather_slot(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's place inside a rank's all-gather input ``flat`` (padded_numel,)."""
        return flat.view(self.padded_shard_size).narrow(self.shard_dim, 0, self.local_rows)

    def alloc_storage(self) -> None:
        """Allocate (first time: create) the padded unsharded storage and the unsharded param."""
        if self._storage is None:
            storage = torch.empty(
                self.padded_full_size, dtype=self.compute_dtype, device=self.info.device
            )
            self._storage = storage
            self._storage_alias = storage.data
            view = storage.narrow(self.shard_dim, 0, self.orig_size[self.shard_dim])
            if self.tp is not None:
                # The TP modules compute with DTensors on the TP mesh; it wraps the same bytes.
                view = DTensor.from_local(
                    view,
                    self.tp.mesh,
                    self.tp.placements,
                    run_check=False,
                    shape=self.tp.size,
                    stride=self.tp.stride,
                )
            self.unsharded_param = nn.Parameter(view, requires_grad=self.requires_grad)
            return
        untyped = self._storage.untyped_storage()
        nbytes = self._storage.numel() * self._storage.element_size()
        if untyped.size() != nbytes:
            untyped.resize_(nbytes)

    def free_storage(self) -> None:
        """Free the unsharded bytes; the tensor objects (and autograd's references) stay."""
        if self._storage is not None:
            self._storage.untyped_storage().resize_(0)

    def storage_allocated(self) -> bool:
        return self._storage is not None and self._storage.untyped_storage().size() > 0

    def copy_out_view(self) -> torch.Tensor | None:
        """A ``(W, padded_numel)`` view of the storage, when one exists (dim-0 sharding)."""
        if self.shard_dim != 0 or self._storage_alias is None:
            return None
        return self._storage_alias.view(self.world, -1)

    def copy_out(self, block: torch.Tensor) -> None:
        """Fill the storage from this parameter's column block ``(W, padded_numel)``."""
        alias = self._storage_alias
        if alias is None:
            raise RuntimeError(f"{self.fqn}: copy_out before alloc_storage (internal error)")
        d, size = self.shard_dim, self.padded_full_size
        # (.., W*c, ..) seen as (W, .., c, ..): rank r's padded shard lands at rows [r*c, (r+1)*c)
        ranked = alias.view(*size[:d], self.world, self.chunk, *size[d + 1 :]).movedim(d, 0)
        ranked.copy_(block.view(self.world, *self.padded_shard_size))

    def register(self, tensor: torch.Tensor) -> None:
        """Make every slot (module attribute) that refers to this parameter show ``tensor``."""
        for module, name in self.slots:
            module._parameters[name] = tensor  # type: ignore[assignment]  # a Parameter or DTensor Parameter

    def is_registered_unsharded(self) -> bool:
        module, name = self.slots[0]
        return self.unsharded_param is not None and module._parameters[name] is self.unsharded_param

    # -- gradients ------------------------------------------------------------------------------

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """This backward's gradient plus any kept from unsynced passes; clears both."""
        param = self.unsharded_param
        grad = None if param is None else param.grad
        if param is not None:
            param.grad = None
        if isinstance(grad, DTensor):
            # A TP gradient can be Partial (e.g. a SequenceParallel norm's weight): sum it over
            # the TP ranks first, so that what we reduce-scatter is this rank's TP-local grad.
            if self.tp is not None and tuple(grad.placements) != self.tp.placements:
                grad = grad.redistribute(placements=self.tp.placements)
            grad = grad.to_local()
        kept = self.unsharded_accumulated_grad
        self.unsharded_accumulated_grad = None
        if kept is None:
            return grad
        if grad is None:
            return kept
        return kept.add_(grad)

    def keep_unsharded_grad(self, dtype: torch.dtype) -> None:
        """Gradient sync is off: move this backward's gradient into the kept accumulator.

        The sum is kept in ``dtype`` (the reduce dtype), so accumulating many bf16 micro-batch
        gradients does not round at every step when the reduction is in fp32.
        """
        grad = self.take_unsharded_grad()
        self.unsharded_accumulated_grad = None if grad is None else grad.to(dtype)

    def reduce_scatter_view(self, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``grad`` (full shape) as ``(W, padded_numel)`` in ``dtype``: rank r's chunk in row r."""
        d, n = self.shard_dim, self.orig_size[self.shard_dim]
        if n == self.chunk * self.world and d == 0:
            return grad.to(dtype).reshape(self.world, -1)
        padded = torch.zeros(self.padded_full_size, dtype=dtype, device=grad.device)
        padded.narrow(d, 0, n).copy_(grad)
        if d == 0:
            return padded.view(self.world, -1)
        size = self.padded_full_size
        ranked = padded.view(*size[:d], self.world, self.chunk, *size[d + 1 :]).movedim(d, 0)
        return ranked.reshape(self.world, -1)

    def local_grad_from(self, reduced: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the gradient out of its reduce-scatter slice ``(padded_numel,)``."""
        rows = reduced.view(self.padded_shard_size).narrow(self.shard_dim, 0, self.local_rows)
        return rows if rows.is_contiguous() else rows.contiguous()
