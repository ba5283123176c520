"""Small parameters kept whole: the third placement beside ``Shard`` (DeepSpeed's persistence).

``fully_shard(..., param_persistence_threshold=n)`` keeps every parameter of fewer than ``n``
elements (norm weights, biases, gates, scalars) whole on every rank instead of sharding it.
Gathering such a parameter costs a collective's latency for a handful of bytes, and its
shard saves almost nothing; kept whole it costs its full size on every rank (and its
optimizer state, replicated) and is never gathered. The tensors of one such parameter ``P``::

    local           P's shape        the whole tensor, on the compute device, in the
                                     parameter's dtype; what the optimizer steps (through
                                     sharded_param, whose local tensor it is)
    sharded_param   nn.Parameter(DTensor(local, Replicate() on every dp mesh dim; a TP
                                     parameter's own placements on its TP dims))
                                     what the module, the optimizer, state_dict() and DCP
                                     see outside forward and backward (the name is the
                                     group's: it is the registered, not the gathered, side)
    unsharded_param nn.Parameter, P's shape, in the compute dtype
                                     what the module sees during forward and backward: a
                                     leaf over local's own storage when the compute dtype is
                                     local's (nothing copied, ever), else a cast copy
                                     refreshed when local changed (an optimizer step);
                                     a TP parameter's is a DTensor on its TP mesh over it

Gradients are never reduce-scattered. At its group's post-backward each gradient moves
(cast to the reduce dtype) into ``pending_grad``, a local unreduced sum that gradient
accumulation with sync off keeps adding to; with sync on the group marks itself ready, and
at the end of backward :func:`all_reduce_kept_whole` flattens the pending gradients of every
ready group of the model, per process groups, dtype and divisor, into one buffer: one
all-reduce (two on HSDP: the shard dim, then the replicas) per step for all of them. The
result, divided as the group's reduction divides (the data-parallel size, or
``gradient_divide_factor``), becomes ``sharded_param.grad``, a ``Replicate`` DTensor, so
``clip_grad_norm_`` counts it once. The graph path (:mod:`fully_shard.graph`) does the same in
the backward graph instead, one all-reduce per group, into the same ``.grad``
(:meth:`PersistentParam.ensure_graph_local`).

Example:
    >>> fully_shard(model, param_persistence_threshold=4096)  # doctest: +SKIP
    >>> model._fsdp_state.groups[0].persistent  # doctest: +SKIP
    [PersistentParam(norm.weight, (64,), (Replicate())@dp, SHARDED)]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate

from ._compat import (
    grad_dtype,
    post_accumulate_grad_hooks,
    set_grad_dtype,
    set_grad_enabled,
    version,
)
from .collectives import SUM, comm_key, divide_
from .mesh import MeshInfo, contiguous_stride
from .observer import CollectiveCall, issue_observed
from .param import module_parameter
from .policies import MixedPrecisionPolicy
from .spmd import TPLayout

if TYPE_CHECKING:
    from .group import ParamGroup


def is_persistent(param: nn.Parameter, threshold: int | None, tp: TPLayout | None) -> bool:
    """Whether ``param`` (``tp``: its layout, if it is a DTensor) stays whole under
    ``param_persistence_threshold=threshold``: fewer elements, counted globally (a
    tensor-parallel parameter keeps its TP placement and is whole on the dp dims).

    A DTensor on the whole SPMD mesh (``dp_mesh_dims``) keeps being sharded: its gradient's
    placements on the dp dims are the batch's, which this placement does not reduce.

    Example:
        >>> is_persistent(nn.Parameter(torch.ones(8)), 16, None)
        True
    """
    if threshold is None or param.numel() >= threshold:
        return False
    return tp is None or not tp.dp_dims


@dataclass(frozen=True)
class KeptWhole:
    """What a group's persistent parameters need of the end-of-backward all-reduce (part of
    its :class:`~fully_shard.description.GroupDescription`).

    Attributes:
        fqns: the persistent parameters, in group order.
        groups: the process groups the gradients are summed over, in order: the shard group,
            then (HSDP) the replicate group; together every data-parallel rank.
        pre_divide, post_divide: the divisions before the sums (part of it where the
            reduce dtype could overflow, as the group's reduce-scatter splits it) and after,
            so that the result is the sum over the data-parallel ranks divided by
            ``gradient_divide_factor`` (default: their number), as the group's sharded
            gradients are.

    Example:
        >>> group.description.kept_whole.post_divide  # doctest: +SKIP
        2.0
    """

    fqns: tuple[str, ...]
    groups: tuple[dist.ProcessGroup, ...]
    pre_divide: float | None
    post_divide: float | None


class PersistentParam:
    """One parameter kept whole on every rank (``param_persistence_threshold``).

    Example:
        >>> pp = group.persistent[0]  # doctest: +SKIP
        >>> pp  # doctest: +SKIP
        PersistentParam(norm.weight, (64,), (Replicate())@dp, SHARDED)
    """

    def __init__(
        self,
        param: nn.Parameter,
        slots: list[tuple[nn.Module, str]],
        fqn: str,
        info: MeshInfo,
        mp_policy: MixedPrecisionPolicy,
        tp: TPLayout | None = None,
    ) -> None:
        self.fqn = fqn
        self.slots = slots
        self.info = info
        self.mp_policy = mp_policy
        self.tp = tp
        self.sharded_grad_dtype = grad_dtype(param)
        # Replicate on every dp dim; a tensor-parallel parameter keeps its own placements on
        # its dims (TPLayout.base), and its local tensor is its TP-local one.
        self.placements: tuple[Placement, ...]
        if tp is None:
            self.mesh, self.placements = info.mesh, tuple(Replicate() for _ in info.mesh.shape)
        else:
            self.mesh, self.placements = tp.spmd, tp.base
        self.global_size = param.size()
        with torch.no_grad():
            source = param.to_local() if isinstance(param, DTensor) else param
            if source.device.type == "meta":
                local = torch.empty_like(source, device="meta")
            else:
                # A copy: the module's own tensor is left to the caller, as a sharded one is.
                local = source.detach().to(info.device, copy=True)
            dt = self._dtensor(local)
        self.sharded_param = nn.Parameter(dt, requires_grad=param.requires_grad)
        self._local = self._own_local()
        self.unsharded_param: nn.Parameter | None = None
        # The plain tensor the module computes with (a TP parameter: the local tensor of the
        # DTensor it is shown as): local itself, or its cast copy; the copy's .data (its own
        # version counter: refreshing it between forward and backward does not trip
        # autograd's check of the tensors forward saved); and the (id, version) of the
        # sharded parameter it was copied from.
        self._compute: torch.Tensor | None = None
        self._alias: torch.Tensor | None = None
        self._copied: tuple[int, int] = (0, -1)
        # This rank's unreduced gradient sum, in the reduce dtype, until an all-reduce takes it.
        self.pending_grad: torch.Tensor | None = None
        # The graph path's leaf over local (ensure_graph_local), made at its first trace.
        self.graph_local: torch.Tensor | None = None

    def _dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` as the registered DTensor (or its gradient): Replicate on the dp dims."""
        size = self.global_size
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=size,
            stride=contiguous_stride(size),
        )

    def __repr__(self) -> str:
        names = self.mesh.mesh_dim_names
        where = "x".join(names) if names else f"{self.mesh.ndim}-D mesh"
        module, name = self.slots[0]
        state = "UNSHARDED" if module._parameters[name] is self.unsharded_param else "SHARDED"
        shape = tuple(self._local.shape)
        placed = ", ".join(repr(p) for p in self.placements)
        return f"PersistentParam({self.fqn}, {shape}, ({placed})@{where}, {state})"

    @property
    def requires_grad(self) -> bool:
        return self.sharded_param.requires_grad

    @property
    def orig_dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def local(self) -> torch.Tensor:
        """The whole tensor the optimizer steps (the DTensor's local tensor)."""
        return self._local

    def _own_local(self) -> torch.Tensor:
        with torch.no_grad():
            # cast: nn.Parameter hides that it wraps a DTensor
            return cast(DTensor, self.sharded_param).to_local()

    def sync_with_module(self) -> None:
        """Adopt a parameter ``Module._apply`` replaced (``to_empty()``, ``to(dtype)``)."""
        self.sharded_param = module_parameter(self.slots, self.sharded_param, self.requires_grad)
        self._local = self._own_local()
        if self.graph_local is not None:  # a compiled graph reads the new tensor
            self.graph_local = None
            self.ensure_graph_local()
        self.register(self.sharded_param)

    def ensure_graph_local(self) -> None:
        """Make :attr:`graph_local` if it is missing: what the traced code
        (:mod:`fully_shard.graph`) reads while the parameter requires a gradient, a leaf over
        the local tensor's storage and version counter whose gradient (already all-reduced in
        the graph) its hook adds into ``sharded_param.grad``; a plain leaf for the reasons
        :meth:`~fully_shard.param.ShardedParam.ensure_graph_shard` gives, which also says why
        the leaf's ``requires_grad`` follows the parameter's."""
        local = self._local
        if self.graph_local is None and (local.is_floating_point() or local.is_complex()):
            leaf = local.detach().requires_grad_(True)  # (a hook needs it; set below)
            # Public since torch 2.1; torch's stubs leave it untyped.
            leaf.register_post_accumulate_grad_hook(self._take_graph_grad)  # type: ignore[no-untyped-call]
            self.graph_local = leaf
        trainable = self.sharded_param.requires_grad
        if self.graph_local is not None and self.graph_local.requires_grad != trainable:
            self.graph_local.requires_grad_(trainable)

    def _take_graph_grad(self, leaf: torch.Tensor) -> None:
        """A compiled backward's all-reduced gradient, moved onto the ``Replicate`` parameter;
        dropped, and the leaf frozen, if the parameter was frozen since the trace (as
        :meth:`~fully_shard.param.ShardedParam._take_graph_grad`)."""
        grad = leaf.grad
        leaf.grad = None
        if self.sharded_param.requires_grad:
            if grad is not None:
                self.accumulate_grad(grad)
        else:
            leaf.requires_grad_(False)

    def register(self, tensor: torch.Tensor) -> None:
        """Make every slot (a tied parameter has several) show ``tensor``."""
        for module, name in self.slots:
            module._parameters[name] = tensor  # type: ignore[assignment]  # a Parameter or DTensor Parameter

    def show(self) -> None:
        """Show the module the whole tensor in its compute dtype (the group's unshard)."""
        local = self._local
        dtype = self.mp_policy.compute_dtype(local.dtype)
        compute = self._compute
        # The DTensor's own version counter: in-place ops on it (the optimizer's) bump it, not
        # its local tensor's.
        sharded = self.sharded_param
        stamp = (id(sharded), version(sharded))
        if (
            compute is None
            or compute.dtype != dtype
            or compute.shape != local.shape
            or (dtype == local.dtype and compute.data_ptr() != local.data_ptr())
        ):
            self._make_compute(local, dtype, stamp)
        elif stamp != self._copied and self._alias is not None:
            with torch.no_grad():
                self._alias.copy_(local)  # the optimizer stepped since the last copy
            self._copied = stamp
        param = self.unsharded_param
        if param is None:
            raise RuntimeError(f"{self.fqn}: no unsharded parameter after show (internal error)")
        param.requires_grad_(sharded.requires_grad)
        self.register(param)

    def _make_compute(
        self, local: torch.Tensor, dtype: torch.dtype, stamp: tuple[int, int]
    ) -> None:
        """(Re)make what the module computes with: the first time, and when ``_apply``
        replaced the local tensor or the compute dtype changed (``model.to``)."""
        with torch.no_grad():
            if dtype == local.dtype:  # local's own storage: nothing copied, ever
                compute, self._alias = local.detach(), None
            else:
                compute = local.to(dtype)
                self._alias = compute.data
        self._compute, self._copied = compute, stamp
        tp = self.tp
        shown = (
            compute
            if tp is None
            else DTensor.from_local(
                compute, tp.mesh, tp.placements, run_check=False, shape=tp.size, stride=tp.stride
            )
        )
        param = self.unsharded_param
        if param is None:
            param = self.unsharded_param = nn.Parameter(shown)
            if tp is None:
                # Gradients accumulate in the reduce dtype (as the sharded ones' do), where this
                # torch has Tensor.grad_dtype; else they are cast as they are kept.
                reduce = self.mp_policy.reduce_dtype_for(local.dtype)
                if reduce != dtype:
                    set_grad_dtype(param, reduce)
        else:
            param.data = shown  # the same Parameter object: hooks on it stay

    def hide(self) -> None:
        """Show the ``Replicate`` DTensor again (the group's reshard)."""
        self.register(self.sharded_param)

    def keep_grad(self, reduce_dtype: torch.dtype, *, unused: bool = False) -> bool:
        """Move this backward's gradient into :attr:`pending_grad`; whether one is pending.
        ``unused`` (``reduce_scatter_unused_params``): zeros where none came, so that every
        rank packs the same parameters."""
        param = self.unsharded_param
        grad = None if param is None else param.grad
        if param is not None:
            param.grad = None
        if isinstance(grad, DTensor):
            grad = grad.to_local() if self.tp is None else self.tp.local_grad(grad)
        if grad is not None:
            grad = grad.detach()
            if self.pending_grad is None:
                self.pending_grad = grad.to(reduce_dtype)  # ours now: param.grad let it go
            else:
                self.pending_grad.add_(grad)
        elif unused and self.pending_grad is None:
            self.pending_grad = torch.zeros_like(self._local, dtype=reduce_dtype)
        return self.pending_grad is not None

    def accumulate_grad(self, reduced: torch.Tensor) -> None:
        """Add ``reduced`` (the all-reduced gradient, P's shape) into ``sharded_param.grad``."""
        local = self._local
        reduced = reduced.to(dtype=self.sharded_grad_dtype or local.dtype, device=local.device)
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = self._dtensor(reduced)
        else:
            cast(DTensor, grad).to_local().add_(reduced)
        for hook in post_accumulate_grad_hooks(self.sharded_param):
            hook(self.sharded_param)


def all_reduce_kept_whole(groups: Sequence[ParamGroup]) -> None:
    """The end of backward: all-reduce the pending gradients of every ready group's persistent
    parameters, one flat buffer per (process groups, reduce dtype, divisor, comm), and add the
    results into their ``Replicate`` gradients.

    Every rank sees the same groups ready in the same order (the post-backwards ran on
    every rank), and packs the same parameters as long as the same ones got a gradient, the
    rule the sharded gradients' layouts follow too.

    Example:
        >>> all_reduce_kept_whole(model._fsdp_state.groups)  # doctest: +SKIP
    """
    buckets: dict[tuple[object, ...], list[tuple[ParamGroup, PersistentParam]]] = {}
    for group in groups:
        if not group.persistent_ready:
            continue
        group.persistent_ready = False
        desc = group.description
        kept = desc.kept_whole
        if kept is None:
            continue
        # One collective: one set of process groups, one dtype and division, one comm.
        key: tuple[object, ...] = (*kept.groups, desc.reduce_dtype, kept.pre_divide)
        key = (*key, kept.post_divide, comm_key(group.comm))
        members = buckets.setdefault(key, [])
        members.extend((group, p) for p in group.persistent if p.pending_grad is not None)
    grad_was = torch.is_grad_enabled()
    set_grad_enabled(False)  # data, as every reduction: never recorded
    try:
        for members in buckets.values():
            if members:
                _all_reduce_one(members)
    finally:
        set_grad_enabled(grad_was)


def _all_reduce_one(members: list[tuple[ParamGroup, PersistentParam]]) -> None:
    owner = members[0][0]
    desc = owner.description
    kept = desc.kept_whole
    if kept is None:
        raise RuntimeError("a kept-whole bucket without a plan (internal error)")
    grads = [p.pending_grad for _, p in members if p.pending_grad is not None]
    # (sum of numels,) in the reduce dtype; a new buffer even for one gradient, which the
    # results are read back out of while the pending sums are dropped.
    flat = torch.cat([g.reshape(-1) for g in grads])
    divide_(flat, kept.pre_divide)
    comm = owner.comm
    for pg in kept.groups:
        if pg.size() > 1:
            issue_observed(
                owner,
                CollectiveCall("all_reduce", flat, pg),
                functools.partial(comm.all_reduce, flat, pg, SUM, async_op=False),
            )
    divide_(flat, kept.post_divide)
    start = 0
    for _, p in members:
        grad = p.pending_grad
        p.pending_grad = None
        if grad is None:
            continue
        n = grad.numel()
        p.accumulate_grad(flat[start : start + n].view(grad.shape))
        start += n
