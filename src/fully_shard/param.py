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

Under ``reshard_after_forward=n`` one more tensor lives between forward and backward::

    post-forward    (rows'_k, *rest)  the rows that rank k of its group of n consecutive shard
    piece                             ranks keeps after forward: P split like torch.chunk over
                                      n (c' = ceil(d0 / n) rows each); shown to the module as
                                      DTensor(piece, (replicate, shard) mesh of the n-rank
                                      groups, (Replicate(), Shard(0))), as torch's is; backward
                                      all-gathers the pieces, padded to c', within the group
                                      into the front n*c' (<= W*c) rows of the storage

The geometry of each split is one frozen :class:`~fully_shard.layout.ShardLayout` (W ranks;
or n ranks for the post-forward piece), so the two splits are two objects of one kind.

The dtypes are read when they matter, never copied at construction: the sharded dtype is the
local shard's (``model.to(torch.float64)`` changes it), the compute dtype is the policy's answer
for it at each unshard, and the storage is reallocated when that answer changes.

``storage`` and everything the all-gather does to it belong to the parameter's *unsharded
side* (:mod:`fully_shard.storage`): a :class:`~fully_shard.storage.DenseStorage` written
through the parameter's gather format (:mod:`fully_shard.quantize`: the shard in the compute
dtype, copied in, or int8 values plus fp32 block scales, dequantized), or a tensor subclass's
own all-gather (:mod:`fully_shard.extensions`: torchao's float8 weights; the local shard
keeps its subclass, and the hooks' outputs take the place of ``storage``). The tensors above
and their lifetimes are the same either way.

Sharding on another dim ``d`` works the same way with ``c = ceil(P.size(d) / W)`` and the
padding along ``d``; the unsharded parameter is then a (possibly non-contiguous) narrow view.

A tensor-parallel parameter (a DTensor on ``root["tp"]``) is handled as its TP-local tensor:
``P`` above is that local tensor, the sharded DTensor lives on the mesh of the dp dims and the
TP dim (``TPLayout.spmd``, see :mod:`fully_shard.spmd`) with the placements of
:func:`~fully_shard.spmd.combined_placements`, and the unsharded parameter is a DTensor on the
TP mesh again (``DTensor.from_local`` of the storage view), which is what the TP modules expect.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ._compat import (
    POST_ACCUMULATE_GRAD_HOOKS,
    dtensor_from_spec,
    dtensor_spec,
    grad_dtype,
    local_tensor,
    new_dtensor,
    post_accumulate_grad_hooks,
    set_grad_dtype,
)
from .extensions import SubclassGather, check_extension_plan, has_extension
from .layout import ShardLayout
from .mesh import MeshInfo, SubgroupInfo, contiguous_stride
from .packing import GatherInput
from .policies import MixedPrecisionPolicy, QuantizationPolicy
from .quantize import PLAIN, GatherFormat, gather_format
from .spmd import TPLayout, combined_placements
from .storage import DenseStorage, UnshardedSide, WholeShard


def _as_dtensor(t: torch.Tensor, fqn: str) -> DTensor:
    if not isinstance(t, DTensor):
        raise RuntimeError(f"{fqn}: the sharded parameter is not a DTensor (internal error)")
    return t


def module_parameter(
    slots: list[tuple[nn.Module, str]], ours: nn.Parameter, requires_grad: bool
) -> nn.Parameter:
    """The sharded parameter the module holds now: ``Module._apply`` (``to()``,
    ``to_empty()``) either swaps the tensor inside ``ours`` or puts a new DTensor in the
    module's slot, which becomes ours (a bare DTensor wrapped as a parameter).

    Example:
        >>> p.sharded_param = module_parameter(p.slots, p.sharded_param, True)  # doctest: +SKIP
    """
    module, name = slots[0]
    current: object = module._parameters[name]
    # cast: a Parameter can wrap a DTensor, which mypy cannot see
    if not isinstance(current, DTensor) or current is cast(object, ours):
        return ours
    if not isinstance(current, nn.Parameter):
        current = nn.Parameter(current, requires_grad=requires_grad)
    return current


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
        tp: TPLayout | None = None,
        *,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        self.fqn = fqn
        # The group's mixed precision as it applies to this parameter, decided once by
        # fully_shard (MixedPrecisionPolicy.for_param: param_dtype_override_fn folded in).
        self.mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
        # The sharded gradient's dtype: the grad_dtype the parameter had before fully_shard
        # (None: the shard's own dtype, read when the gradient arrives).
        self.sharded_grad_dtype = grad_dtype(param)
        # Every (module, attribute) that refers to this parameter: a tied weight has several.
        self.slots = slots
        self.shard_dim = shard_dim
        self.info = info
        self.tp = tp
        # What we shard: the parameter itself, or its TP-local tensor.
        source = param.to_local() if isinstance(param, DTensor) else param
        self.orig_size = source.size()
        self.global_size = param.size()
        self.shard_device = shard_device
        self.layout = ShardLayout.chunked(
            self.orig_size, shard_dim, info.shard_size, info.shard_rank
        )
        # The layout is frozen: its derived sizes, read at every reduction, are read once.
        self._padded_shard_size = self.layout.padded_shard_size
        # Elements of one padded shard: what every rank sends for this parameter.
        self.padded_numel: int = self._padded_shard_size.numel()
        # Split on dim 0, this rank's rows are the first elements of its padded shard: its
        # gradient is one as_strided view of the reduce-scatter's output (local_grad_from).
        local_size = self.layout.local_size
        self._grad_view = (local_size, contiguous_stride(local_size)) if shard_dim == 0 else None

        # The DTensor layout of the shard and its gradient, per dtype (model.to(dtype) adds one).
        self._spec: dict[torch.dtype, object] = {}
        with torch.no_grad():
            if has_extension(source):
                # The rows keep their subclass (its own narrow and clone), so its hooks and
                # its __torch_dispatch__ see every later op, as with torch's FSDP2.
                local = source.detach().narrow(
                    shard_dim, self.layout.offset, self.layout.local_rows
                )
                local = local.clone(memory_format=torch.contiguous_format)
                if local.device.type != "meta" and local.device != shard_device:
                    local = local.to(shard_device)
            elif param.device.type == "meta":
                local = torch.empty(self.layout.local_size, dtype=param.dtype, device="meta")
            else:
                local = source.detach().narrow(
                    shard_dim, self.layout.offset, self.layout.local_rows
                )
                local = torch.empty(
                    self.layout.local_size,
                    dtype=param.dtype,
                    device=shard_device,
                    pin_memory=pin_memory and shard_device.type == "cpu",
                ).copy_(local)
            dt = self._dtensor_from_local(local)
        self.sharded_param = nn.Parameter(dt, requires_grad=param.requires_grad)
        self._keep_grad_dtype()
        self._local: torch.Tensor = local

        self.unsharded_param: nn.Parameter | None = None
        # The dtype of the all-gather and of the unsharded parameter: the group's mixed
        # precision policy's answer for the shard's dtype, asked again at lazy init and at every
        # all-gather (the group owns the policy; until its lazy init, the shard's own dtype).
        self.compute_dtype: torch.dtype = local.dtype
        # Where the gathered bytes go and how they become unsharded_param (storage.py): chosen
        # at lazy init (sync_with_module), when the module's tensors and the group's
        # quantization policy are final.
        self.unsharded_side: UnshardedSide = DenseStorage()
        # reshard_after_forward=n: this rank's rows of its n-rank group's split, between a
        # forward and the backward's all-gather (which hands them over and drops them)...
        self._post_forward: tuple[torch.Tensor, ShardLayout] | None = None
        # ... and those rows as a DTensor on the n-rank mesh, shown until backward's gather
        # (ParamGroup tests it before registering a tensor inline: None, nothing to clear).
        self.post_forward_shown: nn.Parameter | None = None
        # Gradients kept unreduced across backward passes with gradient sync off.
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        # The graph path's shard (ensure_graph_shard), made at its first trace.
        self.graph_shard: torch.Tensor | None = None

    @property
    def requires_grad(self) -> bool:
        """Trainable now: read off the sharded parameter, which ``requires_grad_()`` changes."""
        return self.sharded_param.requires_grad

    def __repr__(self) -> str:
        names = self.info.mesh.mesh_dim_names
        dim_name = names[self.info.shard_mesh_dim] if names else f"dim{self.info.shard_mesh_dim}"
        state = "UNSHARDED" if self.is_registered_unsharded() else "SHARDED"
        return (
            f"ShardedParam({self.fqn}, global={tuple(self.orig_size)}, "
            f"local={tuple(self._local.shape)}, Shard({self.shard_dim})@{dim_name}, {state})"
        )

    # -- geometry and dtypes, read when needed --------------------------------------------------

    @property
    def orig_dtype(self) -> torch.dtype:
        """The sharded parameter's dtype now (``model.to(dtype)`` changes it)."""
        return self._local.dtype

    def gather_format(self, policy: QuantizationPolicy) -> GatherFormat:
        """How the shard travels in its all-gather (plain or int8): ``policy`` (its group's)
        asked now, for the dtype the shard has now."""
        return gather_format(policy, self.orig_size, self.orig_dtype, self.padded_numel)

    @property
    def padded_shard_size(self) -> torch.Size:
        return self.layout.padded_shard_size

    @property
    def padded_full_size(self) -> torch.Size:
        """Shape of the padded unsharded storage."""
        return self.layout.padded_full_size

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def chunk(self) -> int:
        return self.layout.chunk

    # -- the sharded side ---------------------------------------------------------------------

    @property
    def local_shard(self) -> torch.Tensor:
        """The local rows of the sharded DTensor (``(rows_r, *rest)`` for dim 0)."""
        return self._local

    def sync_with_module(self, policy: QuantizationPolicy) -> None:
        """Pick up a sharded parameter that ``Module._apply`` (e.g. ``to_empty``) replaced, and
        choose the unsharded side for it, its group's quantization ``policy`` and its own
        mixed precision (:attr:`mp_policy`).

        ``_apply`` either swaps the tensor inside our ``nn.Parameter`` or puts a new parameter
        in the module; either way the module's current one becomes ours again. A post-forward
        piece is dropped: it has the old dtype and device.
        """
        self.drop_post_forward()
        self.sharded_param = module_parameter(self.slots, self.sharded_param, self.requires_grad)
        with torch.no_grad():
            local = _as_dtensor(self.sharded_param, self.fqn).to_local()
            if self.shard_device.type == "cpu" and local.device.type not in ("cpu", "meta"):
                # e.g. to_empty(device="cuda") on a CPU-offloaded module: shards stay on CPU
                local = local.cpu()
                self.sharded_param = nn.Parameter(
                    self._dtensor_from_local(local), requires_grad=self.requires_grad
                )
            self._local = local
            self._keep_grad_dtype()  # a new parameter, or one _apply swapped, has none
            if self.graph_shard is not None:  # a compiled graph reads the new shard
                self.graph_shard = None
                self.ensure_graph_shard()
        self.compute_dtype = self.mp_policy.compute_dtype(self.orig_dtype)
        self._choose_unsharded_side(policy)
        self.register(self.sharded_param)

    def _keep_grad_dtype(self) -> None:
        """Give the sharded parameter the ``grad_dtype`` the parameter had before
        ``fully_shard``: autograd refuses to set a ``.grad`` of another dtype than a tensor's
        ``grad_dtype``, and :meth:`accumulate_sharded_grad` sets one in that dtype."""
        if self.sharded_grad_dtype is not None:
            set_grad_dtype(self.sharded_param, self.sharded_grad_dtype)

    def _choose_unsharded_side(self, policy: QuantizationPolicy) -> None:
        """Gather through the local shard's hooks if it has them (asked again at lazy init:
        ``_apply`` may have replaced it, or the hooks were patched on after ``fully_shard``).

        Patched hooks sit on the sharded DTensor's own ``_local_tensor`` (what torch's tests
        and docs patch, an instance attribute: "the extension works without a subclass"),
        which is not the tensor ``to_local()`` gives an ``nn.Parameter(DTensor)``: ask both.
        """
        side = self.unsharded_side
        own = local_tensor(self.sharded_param)
        if has_extension(self._local) or has_extension(own):
            if not isinstance(side, SubclassGather):
                # Patched on since fully_shard checked the plan: check it now.
                check_extension_plan(own, self.fqn, self.shard_dim, self.tp is not None, None)
                module = self.slots[0][0]
                self.unsharded_side = SubclassGather(self.fqn, self.orig_size, module, self.info)
        elif self._shard_is_unsharded(policy):
            if not isinstance(side, WholeShard):
                self.unsharded_side = WholeShard()
        elif not isinstance(side, DenseStorage):
            self.unsharded_side = DenseStorage()

    def _shard_is_unsharded(self, policy: QuantizationPolicy) -> bool:
        """One shard rank holds the whole parameter, in the dtype and on the device forward
        computes with, and it travels plain: forward can use the shard's storage itself."""
        local = self._local
        return (
            self.layout.world == 1
            and self.tp is None
            and local.device.type != "meta"
            and local.device == self.info.device
            and self.compute_dtype == local.dtype
            and self.gather_format(policy) is PLAIN
        )

    def _dtensor_from_local(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's rows, on its own device: an offloaded shard stays on the CPU
        of a CUDA mesh) as the sharded DTensor; the spec is built once per dtype."""
        spec = self._spec.get(local.dtype)
        if spec is None:
            if self.tp is None:
                mesh, placements = self.info.mesh, self.info.placements(self.shard_dim)
            else:
                mesh, placements = self.tp.spmd, combined_placements(self.tp, self.shard_dim)
            size = self.global_size
            spec = dtensor_spec(mesh, tuple(placements), size, contiguous_stride(size), local.dtype)
            self._spec[local.dtype] = spec
        return dtensor_from_spec(local, spec)

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Add ``local_grad`` (this rank's reduced rows) into the sharded DTensor's ``.grad``."""
        local = self._local
        dtype = self.sharded_grad_dtype or local.dtype  # (orig_dtype, read inline)
        if local_grad.dtype is not dtype or local_grad.device != local.device:
            local_grad = local_grad.to(dtype=dtype, device=local.device)
        sharded = self.sharded_param
        grad = sharded.grad
        if grad is None:
            spec = self._spec.get(dtype)  # (_dtensor_from_local's first step, read inline)
            if spec is None:
                sharded.grad = self._dtensor_from_local(local_grad)
            else:
                sharded.grad = new_dtensor(
                    DTensor, local_grad, spec, requires_grad=local_grad.requires_grad
                )
        else:
            # Under no_grad, to_local() is the DTensor's own local tensor: add in place.
            _as_dtensor(grad, self.fqn).to_local().add_(local_grad)
        # A user's register_post_accumulate_grad_hook (optimizer-in-backward): once per
        # reduction, after the sharded gradient is in place (None: none was ever registered).
        if getattr(sharded, POST_ACCUMULATE_GRAD_HOOKS, None):
            for hook in post_accumulate_grad_hooks(sharded):
                hook(sharded)

    # -- the graph path's shard ------------------------------------------------------------------

    def ensure_graph_shard(self) -> None:
        """Make :attr:`graph_shard` if this parameter can be trained and has none: the shard
        the traced code (:mod:`fully_shard.graph`) reads while the sharded parameter requires
        a gradient (a frozen one's is read as :attr:`local_shard`), a leaf that requires a
        gradient over the local shard's storage and version counter.

        Why not ``sharded_param.to_local()``: a DTensor input of the compiled graph makes
        AOTAutograd wrap its gradient back into a DTensor in Python at every step
        (``__tensor_unflatten__``, a ``DTensorSpec`` built and checked: 9 µs a parameter
        against 0.7 µs for the constructor ``accumulate_sharded_grad`` calls, torch 2.13,
        CPU), and autograd then accumulates it through DTensor dispatch. A plain leaf's
        gradient is accumulated in C++, and its hook (:meth:`_take_graph_grad`) moves it onto
        the sharded DTensor's ``.grad`` as the eager engine's reduction does. What keeps the
        alias true: the optimizer steps the DTensor in place (the same storage); ``_apply``
        replacing the shard makes the leaf again (:meth:`sync_with_module`).

        The leaf requires a gradient exactly when the sharded parameter does, as of this call
        (made at every trace): the traced code reads the trainable flag off the leaf, whose
        guard dynamo keeps anyway (it is a graph input), instead of off the DTensor, which
        dynamo would wrap and guard only to read one flag (see :func:`fully_shard.graph._local`;
        :meth:`_take_graph_grad` turns it off when the parameter was frozen since).
        """
        local = self._local
        if self.graph_shard is None and (local.is_floating_point() or local.is_complex()):
            leaf = local.detach().requires_grad_(True)  # (a hook needs it; set below)
            # Public since torch 2.1; torch's stubs leave it untyped.
            leaf.register_post_accumulate_grad_hook(self._take_graph_grad)  # type: ignore[no-untyped-call]
            self.graph_shard = leaf
        trainable = self.sharded_param.requires_grad
        if self.graph_shard is not None and self.graph_shard.requires_grad != trainable:
            self.graph_shard.requires_grad_(trainable)

    def _take_graph_grad(self, leaf: torch.Tensor) -> None:
        """A compiled backward's gradient of this rank's rows, moved onto the sharded
        parameter; dropped if the parameter was frozen since the graph was traced, as eager
        leaves a frozen parameter without one, and the leaf frozen too, so that the next call
        fails the leaf's guard and traces the parameter frozen (one step late: the graph
        that computed this gradient has run)."""
        grad = leaf.grad
        leaf.grad = None
        if self.sharded_param.requires_grad:
            if grad is not None:
                self.accumulate_sharded_grad(grad)
        else:
            leaf.requires_grad_(False)

    # -- the all-gather seam: what this parameter sends, and how it is rebuilt ---------------------
    #
    # The group asks each parameter for its inputs, packs them into one flat buffer, gathers,
    # and hands each parameter its blocks of the output back. Everything between the shard
    # and the unsharded tensor (what is sent, where the gathered bytes land, how they become
    # the unsharded tensor, and freeing it) is this parameter's *unsharded side*, one object
    # (storage.py): a padded dense storage written through a gather format (plain or int8).

    def all_gather_inputs(self, policy: QuantizationPolicy) -> list[GatherInput]:
        """What this rank sends in the next all-gather of its group.

        Normally its local rows of the W-rank split, in the format the quantization policy
        gives it (plain in the compute dtype, or int8 values and scales). After a forward
        that kept a post-forward piece (``reshard_after_forward=n``), that piece, plain, for
        a gather within the n-rank group: it holds the rows forward computed with (already
        dequantized), and it is handed over here; this parameter keeps no reference to it.
        ``policy`` is the group's; :attr:`mp_policy`'s answer for the dtype the shard has now
        becomes :attr:`compute_dtype`.
        """
        mp = self.mp_policy
        self.compute_dtype = mp.compute_dtype(self.orig_dtype)
        piece, self._post_forward = self._post_forward, None
        return self.unsharded_side.inputs(self, piece, policy, mp)

    def all_gather_destinations(self) -> list[torch.Tensor] | None:
        """``(world, numel)`` views the gathered blocks can be copied straight into, one per
        input; ``None`` when they must be rebuilt from the blocks instead."""
        return self.unsharded_side.destinations()

    def finish_all_gather(self, blocks: list[torch.Tensor] | None) -> None:
        """Rebuild the unsharded tensor from this parameter's ``(world, numel)`` output blocks
        (``None``: they were already copied into :meth:`all_gather_destinations`)."""
        self.unsharded_side.finish(self, blocks)

    # -- the post-forward piece (reshard_after_forward=n) -------------------------------------

    def reshard_to_post_forward(self, sub: SubgroupInfo, *, free: bool = True) -> None:
        """Keep this rank's rows of the parameter split like ``torch.chunk`` over its group of
        ``sub.size`` ranks, free the rest (``free``), and show those rows as a DTensor on
        ``sub.mesh`` until backward gathers them (what torch's module shows then)."""
        side = self.unsharded_side
        alias = side.alias if isinstance(side, DenseStorage) else None
        if alias is None or not self.storage_allocated():
            raise RuntimeError(f"{self.fqn}: post-forward reshard while sharded (internal error)")
        layout = ShardLayout.chunked(self.orig_size, self.shard_dim, sub.size, sub.rank)
        rows = alias.narrow(self.shard_dim, layout.offset, layout.local_rows)
        piece = rows.clone(memory_format=torch.contiguous_format)
        self._post_forward = (piece, layout)
        if free:  # not under set_keep_unsharded_storage(True)
            self.free_storage()
        shown = DTensor.from_local(
            piece,
            sub.mesh,
            (Replicate(), Shard(self.shard_dim)),
            run_check=False,
            shape=self.orig_size,
            stride=contiguous_stride(self.orig_size),
        )
        self.post_forward_shown = nn.Parameter(shown, requires_grad=self.requires_grad)
        self.register(self.post_forward_shown)

    def has_post_forward(self) -> bool:
        return self._post_forward is not None

    def drop_post_forward(self) -> None:
        """Forget the post-forward piece; the sharded DTensor is shown again if it was."""
        self._post_forward = None
        shown, self.post_forward_shown = self.post_forward_shown, None
        module, name = self.slots[0]
        if shown is not None and module._parameters[name] is shown:
            self.register(self.sharded_param)

    def post_forward_nbytes(self) -> int:
        """Bytes of the post-forward piece held now (0 without one)."""
        if self._post_forward is None:
            return 0
        data = self._post_forward[0]
        return data.numel() * data.element_size()

    # -- the unsharded side -------------------------------------------------------------------

    def alloc_storage(self) -> None:
        """Allocate (first time: create) the unsharded bytes and the unsharded parameter."""
        self.unsharded_side.alloc(self)

    def set_unsharded_grad_dtype(self) -> None:
        """Have autograd produce and accumulate the unsharded gradient in the reduce dtype
        (torch 2.15's ``reduce_dtype``), where it differs from the compute dtype and this
        torch has ``Tensor.grad_dtype``; elsewhere the gradient is cast when it is kept or
        packed. Plain, dense parameters only: a TP DTensor's or a subclass's gradient keeps
        the cast."""
        param = self.unsharded_param
        reduce = self.mp_policy.reduce_dtype_for(self.orig_dtype)
        if (
            param is not None
            and self.tp is None
            and not isinstance(self.unsharded_side, SubclassGather)
            and (reduce != self.compute_dtype or grad_dtype(param) is not None)
        ):
            set_grad_dtype(param, reduce)

    def free_storage(self) -> None:
        """Free the unsharded bytes; the tensor objects (and autograd's references) stay."""
        self.unsharded_side.free()

    def storage_allocated(self) -> bool:
        return self.unsharded_side.allocated()

    def register(self, tensor: torch.Tensor) -> None:
        """Make every slot (module attribute) that refers to this parameter show ``tensor``."""
        if tensor is not self.post_forward_shown:
            self.post_forward_shown = None  # its rows are no longer needed once unshown
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
            grad = grad.to_local() if self.tp is None else self.tp.local_grad(grad)
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

    def local_grad_from(self, output: torch.Tensor, at: int) -> torch.Tensor:
        """This rank's rows of the gradient, out of the contiguous reduce-scatter ``output``
        whose storage holds this parameter's ``padded_numel`` elements from offset ``at``."""
        view = self._grad_view
        if view is not None:  # one C call, against four for the slice, view and narrow below
            return output.as_strided(view[0], view[1], at)
        start = at - output.storage_offset()
        rows = (
            output[start : start + self.padded_numel]
            .view(self._padded_shard_size)
            .narrow(self.shard_dim, 0, self.layout.local_rows)
        )
        return rows if rows.is_contiguous() else rows.contiguous()
