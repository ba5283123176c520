"""``fully_shard()``: validate every argument, then shard the parameters and install the hooks.

Nothing is changed until every check has passed, so a call that raises leaves the module
exactly as it was and can be retried with valid arguments.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar, cast, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ._compat import register_with_torch_composable, torch_fsdp_module_class
from .collectives import TorchComm
from .errors import (
    FullyShardArgumentTypeError,
    FullyShardAssertionError,
    FullyShardNotImplementedError,
    FullyShardTypeError,
    FullyShardValueError,
)
from .extensions import check_extension_plan, has_extension
from .group import GroupConfig, ParamGroup
from .hooks import FSDPState
from .interop import TorchStateView
from .mesh import (
    MeshInfo,
    MeshResolver,
    ShardPlacementResult,
    default_mesh,
    mesh_info,
    post_forward_subgroup,
)
from .module import FSDPModule
from .observer import JOB_WIDE
from .param import ShardedParam
from .persist import PersistentParam, is_persistent
from .policies import (
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizationPolicy,
)
from .spmd import (
    SPMDMesh,
    SPMDPlan,
    TPLayout,
    build_spmd_mesh,
    check_dp_mesh_dims,
    check_spmd_param,
    check_strided_split,
    spmd_layout,
    tp_layout,
    tp_sharded_dims,
)

M = TypeVar("M", bound=nn.Module)
ShardPlacement = Shard | ShardPlacementResult | None
"""What ``shard_placement_fn`` returns (torch 2.13's ``ShardPlacementResult`` works too)."""


@dataclass(frozen=True)
class _ParamPlan:
    """What the checks decided for one parameter, before anything is changed."""

    param: nn.Parameter
    fqn: str
    slots: list[tuple[nn.Module, str]]
    shard_dim: int
    tp: TPLayout | None  # set for a parameter that already is a DTensor
    info: MeshInfo  # the mesh of the group it joins (shard_placement_fn may choose one)
    # The call's mixed precision as it applies to this parameter: param_dtype_override_fn
    # asked once, here, before anything changes (MixedPrecisionPolicy.for_param).
    mp_policy: MixedPrecisionPolicy
    # Kept whole on every rank (param_persistence_threshold): Replicate, never gathered.
    persistent: bool = False


@functools.cache
def _fsdp_class(cls: type, torch_base: type | None) -> type:
    # One FSDP subclass per original class (cached, so repeated calls share it), with the
    # original as a base so isinstance(m, cls) still holds, and torch's FSDPModule last when
    # torch's FSDP is loaded, so that libraries recognise an FSDP2 module (interop.py): after
    # the original class, no super() call of ours or of the module's reaches torch's code.
    # _fsdp_original_class: what FSDPModule.__new__ builds when a container (Sequential
    # slicing) constructs a new instance of the swapped class.
    namespace = {"__module__": cls.__module__, "_fsdp_original_class": cls}
    if torch_base is not None and issubclass(torch_base, FSDPModule):
        torch_base = None  # torch's name rebound to ours (or a subclass): no second base
    bases = (FSDPModule, cls) if torch_base is None else (FSDPModule, cls, torch_base)
    return type(f"FSDP{cls.__name__}", bases, namespace)


@overload
def fully_shard(
    module: M,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], ShardPlacement] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    quantization_policy: QuantizationPolicy = ...,
    param_persistence_threshold: int | None = ...,
) -> M: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], ShardPlacement] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    quantization_policy: QuantizationPolicy = ...,
    param_persistence_threshold: int | None = ...,
) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], ShardPlacement] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen, shared
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen, shared
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    quantization_policy: QuantizationPolicy = QuantizationPolicy(),  # noqa: B008 - frozen, shared
    param_persistence_threshold: int | None = None,
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters over ``mesh`` (ZeRO-3), in place, and return it.

    Call it on each block first, then on the root: each call owns the parameters of its
    module(s) that no earlier call owns, and becomes one communication group (one all-gather
    before its forward and backward, one reduce-scatter of its gradients). Afterwards every
    owned parameter is an ``nn.Parameter`` wrapping a ``DTensor`` placed ``Shard(0)`` (the
    rows split like ``torch.chunk``); during forward and backward the module sees plain full
    tensors. The module's class becomes a subclass of :class:`FSDPModule`.

    Args:
        module: a module, or a list of modules that form one group.
        mesh: a 1-D mesh (shard) or 2-D mesh (replicate, shard: HSDP). ``None``: a 1-D mesh
            over the default process group. Parameters that are already tensor-parallel
            DTensors on ``root["tp"]`` need the data-parallel dims of the same named mesh:
            ``mesh=root["dp"]`` (2-D root) or ``mesh=root["replicate", "shard"]`` (HSDP + TP
            on a 3-D root); they become DTensors on the mesh of those dims and ``"tp"``
            (see docs/recipes/2d-meshes.md and docs/recipes/3d-meshes.md).
        reshard_after_forward: ``True`` frees the gathered parameters after forward and
            gathers them again for backward (less memory, one more all-gather); ``False``
            keeps them until after backward; ``None``: ``False`` for the root, ``True`` for
            the others. An int ``n`` (a divisor of the shard world size W, e.g. the ranks per
            node) reshards after forward to groups of ``n`` consecutive shard ranks (ZeRO++'s
            hpZ): each rank keeps ``1/n`` of the padded parameters from forward to backward
            (instead of ``1/W``), and backward all-gathers within those ``n`` ranks, moving
            ``1/n`` of the padded group per rank instead of ``1/W``, over the fast local
            links. ``n == W`` means ``True``; ``n == 1`` means ``False`` (with a warning), as
            in torch. Between forward and backward the module shows, as torch's does, each
            rank's piece as a DTensor on the ``(W/n, n)`` mesh of those groups with
            ``(Replicate(), Shard(d))``, ``d`` its shard dim (``torch.chunk`` pieces over
            ``n``; its ``full_tensor()`` is the parameter). Creates the process groups of the
            ``n``-rank groups, once per mesh: call it on every rank. Not with
            tensor-parallel parameters (nor in torch).
        shard_placement_fn: maps a parameter to the ``Shard(dim)`` to use, or ``None`` for
            the default (``Shard(0)``; for a DTensor parameter the first dim its own
            placements leave whole), or a :class:`ShardPlacementResult` ``(placement,
            mesh)`` to shard it over a mesh of its own: the parameters naming one mesh form
            one more group of this call (per-parameter meshes, e.g. the experts of a
            mixture of experts; see docs/recipes/per-param-meshes.md).
        mp_policy: mixed precision (see :class:`MixedPrecisionPolicy`).
        offload_policy: where sharded state lives (see :class:`CPUOffloadPolicy`).
        ignored_params: parameters to leave alone: plain tensors, never gathered or reduced.
            Parameters of other modules in it are skipped (as in torch), so one set can be
            passed to every call of a bottom-up wrap.
        dp_mesh_dims: torch 2.13's full-SPMD-mesh mode (a :class:`DataParallelMeshDims`):
            ``mesh`` is then the whole mesh, every parameter already a DTensor on it with
            ``Replicate()`` on the dims named here; we shard over ``shard`` and replicate over
            ``replicate`` (a tuple of dims is flattened into one), keeping the parameters'
            own placements on the other dims (see docs/recipes/3d-meshes.md). Not with an
            int ``reshard_after_forward`` (nor in torch).
        quantization_policy: all-gather this group's large weights as block-quantized int8
            (see :class:`QuantizationPolicy`; not in torch's FSDP2). The default changes
            nothing.
        param_persistence_threshold: keep every parameter of fewer than this many elements
            (norm weights, biases, gates, scalars) whole on every rank: a ``Replicate()``
            DTensor on the group's mesh (its optimizer state replicated too), never
            gathered (the module computes with it directly, cast to ``param_dtype``), its
            gradient all-reduced with every other kept-whole gradient of the model in one
            flat all-reduce at the end of backward (two on HSDP), divided as the group's
            sharded gradients are (DeepSpeed's ``stage3_param_persistence_threshold``; not
            in torch's FSDP2). Costs each such parameter's full size (and its optimizer
            state's) on every rank instead of ``1/W`` of it; saves its share of the
            all-gather and the reduce-scatter, and a group whose parameters are all kept
            whole issues no all-gather at all. A 0-dim parameter (a scalar) is kept whole
            when the threshold is above 1. A tensor-parallel parameter (a DTensor on
            ``root["tp"]``) kept whole keeps its TP placements and is ``Replicate()`` on the
            dp dims; DTensors on the whole SPMD mesh (``dp_mesh_dims``) and tensor
            subclasses with their own all-gather are sharded as usual; the graph path
            (``torch.compile`` of the whole model) all-reduces their gradients in its
            backward graph, one all-reduce per group. ``None``
            (the default) or 0 keeps nothing whole. See
            docs/recipes/fewer-collectives.md.

    Returns:
        ``module``, its class swapped to an ``FSDPModule`` subclass.

    Example:
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> mesh = init_device_mesh("cpu", (world_size,))  # doctest: +SKIP
        >>> for block in model.layers:  # doctest: +SKIP
        ...     fully_shard(block, mesh=mesh)
        >>> fully_shard(model, mesh=mesh)  # doctest: +SKIP
        >>> optim = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
        >>> fully_shard(model, mesh=mesh, param_persistence_threshold=4096)  # doctest: +SKIP
    """
    call = _check_arguments(
        module,
        mesh,
        reshard_after_forward,
        shard_placement_fn,
        mp_policy,
        offload_policy,
        ignored_params,
        dp_mesh_dims,
        quantization_policy,
        param_persistence_threshold,
    )
    planned = _plan_groups(call, shard_placement_fn, reshard_after_forward)
    # -- every check passed: from here on the module changes --------------------------------
    JOB_WIDE.switch_on_from_environment()  # e.g. FULLY_SHARD_CHECK_COLLECTIVES=1, job-wide
    groups = _build_groups(call, planned)
    _install_runtime(call.modules, groups, [plan for g in planned for plan in g.plans])
    return module


@dataclass(frozen=True)
class _Call:
    """The arguments of one ``fully_shard`` call, checked (nothing is changed yet)."""

    modules: tuple[nn.Module, ...]
    info: MeshInfo  # the call's own mesh (with dp_mesh_dims: the flattened SPMD mesh's)
    spmd: SPMDMesh | None
    reshard_flag: bool | None
    post_forward_size: int | None  # reshard_after_forward=<int>: the n-rank group size
    mp_policy: MixedPrecisionPolicy
    offload_policy: OffloadPolicy
    quantization_policy: QuantizationPolicy
    found: list[_Found]  # the parameters this call owns
    persistence_threshold: int | None  # param_persistence_threshold, checked


@dataclass(frozen=True)
class _GroupPlan:
    """One group to build: its mesh, its parameters' plans, its post-forward group size."""

    info: MeshInfo
    plans: list[_ParamPlan]
    post_forward_size: int | None


def _check_arguments(
    module: object,
    mesh: object,
    reshard_after_forward: object,
    shard_placement_fn: object,
    mp_policy: object,
    offload_policy: object,
    ignored_params: object,
    dp_mesh_dims: object,
    quantization_policy: object,
    param_persistence_threshold: object = None,
) -> _Call:
    """Step 1: check every argument and find the parameters the call owns."""
    threshold = _check_persistence_threshold(param_persistence_threshold)
    spmd_plan = _check_dp_mesh_dims(dp_mesh_dims, mesh, reshard_after_forward)
    modules = _check_modules(module)
    info: MeshInfo | None = None
    if spmd_plan is None:
        info = _resolve_mesh(mesh)
        shard_size = info.shard_size
    else:
        shard_size = spmd_plan.shard_size
    reshard_flag, post_forward_size = _check_reshard_after_forward(
        reshard_after_forward, shard_size
    )
    _check_policies(shard_placement_fn, mp_policy, offload_policy, quantization_policy)
    ignored = _check_ignored(ignored_params, modules)
    found = _collect_params(modules, ignored)
    spmd: SPMDMesh | None = None
    if spmd_plan is not None:
        for param, fqn, _ in found:
            check_spmd_param(spmd_plan, param, fqn)
        # Flattening a tuple of dims creates process groups (collective). What is checked
        # after this depends only on the model and the arguments, the same on every rank.
        spmd = build_spmd_mesh(spmd_plan)
        info = spmd.info
    if info is None:
        raise RuntimeError("fully_shard resolved no mesh (internal error)")
    return _Call(
        modules,
        info,
        spmd,
        reshard_flag,
        post_forward_size,
        cast(MixedPrecisionPolicy, mp_policy),  # checked by _check_policies
        cast(OffloadPolicy, offload_policy),
        cast(QuantizationPolicy, quantization_policy),
        found,
        threshold,
    )


def _check_persistence_threshold(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise FullyShardTypeError(
            f"param_persistence_threshold must be an int (a number of elements) or None, got "
            f"{value!r} ({type(value).__name__}); e.g. param_persistence_threshold=4096 keeps "
            "parameters of fewer than 4096 elements whole on every rank"
        )
    if value < 0:
        raise FullyShardValueError(
            f"param_persistence_threshold={value} is negative; pass a number of elements >= 0 "
            "(parameters with fewer elements are kept whole on every rank), or None for none"
        )
    return value


def _check_policies(
    shard_placement_fn: object, mp_policy: object, offload_policy: object, quantization: object
) -> None:
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise FullyShardTypeError(
            f"shard_placement_fn must be a callable (param -> Shard | ShardPlacementResult | "
            f"None), got "
            f"{type(shard_placement_fn).__name__}"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise FullyShardTypeError(
            f"mp_policy must be a MixedPrecisionPolicy (or a subclass), got "
            f"{type(mp_policy).__name__}; e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
        )
    if not isinstance(offload_policy, OffloadPolicy):
        raise FullyShardTypeError(
            f"offload_policy must be an OffloadPolicy (or a subclass such as CPUOffloadPolicy), "
            f"got {type(offload_policy).__name__}"
        )
    if not isinstance(quantization, QuantizationPolicy):
        raise FullyShardTypeError(
            f"quantization_policy must be a QuantizationPolicy (or a subclass), got "
            f"{type(quantization).__name__}; e.g. "
            "QuantizationPolicy(all_gather='int8', block_size=256)"
        )


def _plan_groups(
    call: _Call,
    shard_placement_fn: Callable[[nn.Parameter], ShardPlacement] | None,
    reshard_after_forward: bool | int | None,
) -> list[_GroupPlan]:
    """Step 2: decide each parameter's placement and mesh, and split them into groups."""
    plans = _plan_params(
        call.found,
        shard_placement_fn,
        call.info,
        call.spmd,
        call.mp_policy,
        call.persistence_threshold,
    )
    planned = []
    for group_info, group_plans in _group_plans(plans, call.info):
        _check_params(group_plans, group_info)
        size = call.post_forward_size
        if group_info is not call.info:  # a mesh of its own: reshard_after_forward=n must divide it
            _, size = _check_reshard_after_forward(
                reshard_after_forward, group_info.shard_size, warn=False
            )
        _check_post_forward_plans(size, group_plans)
        _check_extension_plans(size, group_plans)
        planned.append(_GroupPlan(group_info, group_plans, size))
    return planned


def _build_groups(call: _Call, planned: list[_GroupPlan]) -> list[ParamGroup]:
    """Step 3: shard every parameter (the module changes) and build its group."""
    pin = call.offload_policy.use_pinned_memory() and torch.cuda.is_available()
    groups = []
    for group in planned:
        # Creating process groups is collective: only now, when no rank can still refuse.
        size = group.post_forward_size
        post_forward = None if size is None else post_forward_subgroup(group.info, size)
        shard_device = call.offload_policy.shard_device(group.info.device)
        persistent = [
            PersistentParam(plan.param, plan.slots, plan.fqn, group.info, plan.mp_policy, plan.tp)
            for plan in group.plans
            if plan.persistent
        ]
        params = [
            ShardedParam(
                plan.param,
                plan.slots,
                plan.fqn,
                plan.shard_dim,
                group.info,
                shard_device,
                pin,
                plan.tp,
                mp_policy=plan.mp_policy,
            )
            for plan in group.plans
            if not plan.persistent
        ]
        for p in params:
            p.register(p.sharded_param)
        for pp in persistent:
            pp.register(pp.sharded_param)
        config = GroupConfig(
            reshard_after_forward=call.reshard_flag,
            mp_policy=call.mp_policy,
            quantization_policy=call.quantization_policy,
            offload_policy=call.offload_policy,
            post_forward=post_forward,
        )
        groups.append(ParamGroup(params, call.modules, group.info, config, TorchComm(), persistent))
    return groups


def _install_runtime(
    modules: tuple[nn.Module, ...], groups: list[ParamGroup], plans: list[_ParamPlan]
) -> None:
    """Step 4: the runtime: hooks, state-dict hooks, the class swap, torch's registries."""
    owner = type(modules[0]).__name__
    for plan in plans:
        setattr(plan.param, _SHARDED_BY, (owner, plan.fqn))
    state = FSDPState(tuple(groups), modules)
    state.install()
    _install_state_dict_hooks(state)
    torch_base = torch_fsdp_module_class()
    for m in modules:
        m._fsdp_state = state  # type: ignore[assignment]  # nn.Module stores it in __dict__
        # type objects are hashable; torch's stubs declare Module.__hash__ oddly for mypy
        m.__class__ = _fsdp_class(type(m), torch_base)  # type: ignore[arg-type]
        # torch's replicate() above it leaves our parameters alone; its pipelining reduces
        register_with_torch_composable(m, TorchStateView(state))


def _state(module: nn.Module) -> TorchStateView:
    """``fully_shard.state(module)``: the entry points torch's code reads off a sharded module.

    torch's ``fully_shard`` carries this attribute (its composable-API contract), and torch's
    pipelining calls it on the ``fully_shard`` it imported to reduce a stage's gradients
    (:mod:`fully_shard.interop`). A trainer that rebinds torch's names to ours hands it ours.

    Example:
        >>> fully_shard.state(model)._root_post_backward_final_callback()  # doctest: +SKIP
    """
    state = getattr(module, "_fsdp_state", None)
    if not isinstance(state, FSDPState):
        raise FullyShardTypeError(
            f"fully_shard.state() got a {type(module).__name__} that fully_shard was not "
            "called on; pass a module returned by fully_shard"
        )
    return TorchStateView(state)


fully_shard.state = _state  # type: ignore[attr-defined]  # as torch's fully_shard has it


def _check_dp_mesh_dims(
    dp_mesh_dims: object, mesh: object, reshard_after_forward: object
) -> SPMDPlan | None:
    if dp_mesh_dims is None:
        return None
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise FullyShardTypeError(
            f"dp_mesh_dims must be a fully_shard.DataParallelMeshDims or None, got "
            f"{type(dp_mesh_dims).__name__}"
        )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise FullyShardNotImplementedError(
            f"reshard_after_forward={reshard_after_forward} (an int) with dp_mesh_dims is not "
            "supported (nor by torch's fully_shard); pass True or False"
        )
    _check_mesh_device(mesh)
    return check_dp_mesh_dims(mesh, dp_mesh_dims)


def _install_state_dict_hooks(state: FSDPState) -> None:
    """Show the sharded DTensors to ``state_dict()`` and ``load_state_dict()``.

    After a forward that keeps the parameters gathered (the root, or ``unshard()``) the module
    holds plain full tensors; a state dict of those would not be a sharded checkpoint, and
    loading one would copy into storage the next reshard frees. As in torch, both reshard
    first (outside backward, where the gathered parameters are still needed); the next
    forward or backward gathers again.
    """

    def to_sharded(*args: object, **kwargs: object) -> None:
        if state.root is None or not state.root.in_backward:
            for group in state.groups:
                group.reshard()

    slots = [s for p in state.params for s in p.slots]
    slots += [s for p in state.persistent for s in p.slots]
    modules = {id(m): m for m, _ in slots}
    for m in modules.values():
        # Both public since torch 2.5; torch's stubs leave them untyped.
        m.register_state_dict_pre_hook(to_sharded)  # type: ignore[no-untyped-call]
        m.register_load_state_dict_pre_hook(to_sharded)  # type: ignore[no-untyped-call]


# Containers without a forward of their own (a subclass may add one).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def _check_modules(module: object) -> tuple[nn.Module, ...]:
    if isinstance(module, type) and issubclass(module, nn.Module):
        raise FullyShardTypeError(
            f"fully_shard got the class {module.__name__}, not a module; construct it first, "
            f"e.g. fully_shard({module.__name__}(...))"
        )
    if isinstance(module, nn.Module):
        modules: tuple[nn.Module, ...] = (module,)
    elif isinstance(module, (list, tuple)):
        if not module:
            raise FullyShardValueError(
                "fully_shard got an empty list of modules; pass a module or a non-empty list"
            )
        for i, m in enumerate(module):
            if not isinstance(m, nn.Module):
                raise FullyShardTypeError(
                    f"fully_shard got a list whose item {i} is a {type(m).__name__}, not an "
                    "nn.Module; every item of the list must be a module"
                )
        modules = tuple(module)
        if len({id(m) for m in modules}) != len(modules):
            raise FullyShardValueError("fully_shard got the same module twice in one list")
    else:
        raise FullyShardTypeError(
            f"fully_shard expects an nn.Module or a list of nn.Modules, got {type(module).__name__}"
        )
    for m in modules:
        if isinstance(m, _CONTAINERS) and type(m).forward is nn.Module.forward:
            # Nothing calls a container's forward, so its hooks would never gather its
            # parameters and its modules would meet sharded DTensors (torch refuses it too).
            raise FullyShardValueError(
                f"fully_shard got a {type(m).__name__}, a container whose forward is never "
                "called, so its parameters would never be gathered; shard each of its modules "
                f"instead (for block in model.layers: fully_shard(block)), or the module that "
                f"holds the {type(m).__name__}"
            )
        if isinstance(m, FSDPModule):
            raise FullyShardAssertionError(
                f"fully_shard was already applied to this {type(m).__name__}; each module can "
                "be sharded once (to change options use the set_* methods)"
            )
    return modules


def _resolve_mesh(mesh: object) -> MeshInfo:
    _check_mesh_device(mesh)
    return mesh_info(default_mesh() if mesh is None else mesh)


def _check_mesh_device(mesh: object) -> None:
    if isinstance(mesh, DeviceMesh) and mesh.device_type != "cpu":
        # Checked here: reading the compute device of such a mesh fails inside torch with a
        # message that does not mention the mesh.
        kind = mesh.device_type
        is_available = getattr(getattr(torch, kind, None), "is_available", None)
        if not callable(is_available) or not is_available():
            raise FullyShardValueError(
                f"the mesh is on device type {kind!r}, which this process cannot use "
                f"(torch.{kind}.is_available() is not True); build the mesh with "
                "init_device_mesh('cpu', ...) to run on CPU with gloo, or start the ranks on a "
                f"machine with {kind} devices"
            )


def _check_reshard_after_forward(
    value: object, world: int, *, warn: bool = True
) -> tuple[bool | None, int | None]:
    """(the bool flag, the post-forward group size or None) that ``value`` means for a shard
    world of ``world`` ranks (``warn``: about ``n == 1``, once per call).

    As in torch: an int n reshards after forward to groups of n shard ranks; n == 1 keeps
    the parameters whole (``False``, with a warning), n == the shard world is ``True``.
    """
    if value is None or isinstance(value, bool):
        return value, None
    if not isinstance(value, int):
        raise FullyShardArgumentTypeError(
            f"reshard_after_forward must be a bool, an int or None, got {value!r} "
            f"({type(value).__name__})"
        )
    if value < 1 or value > world or world % value != 0:
        raise FullyShardValueError(
            f"reshard_after_forward={value} must divide the shard world size {world} "
            f"(1 <= n <= {world}); pass True, False or a divisor of {world}"
        )
    if value == 1:
        if not warn:
            return False, None
        warnings.warn(
            "reshard_after_forward=1 (an int) reshards to groups of 1 rank, which keeps every "
            "parameter whole after forward, like reshard_after_forward=False; pass False to "
            "say so, or True to free the parameters after forward",
            stacklevel=3,
        )
        return False, None
    if value == world:
        return True, None
    return True, value


def _check_post_forward_plans(size: int | None, plans: list[_ParamPlan]) -> None:
    if size is None:
        return
    for plan in plans:
        if plan.tp is not None:
            raise FullyShardNotImplementedError(
                f"reshard_after_forward={size} with tensor-parallel parameter {plan.fqn!r} is "
                "not supported (nor by torch's fully_shard); pass True or False for the "
                "modules with tensor-parallel parameters"
            )


def _check_extension_plans(size: int | None, plans: list[_ParamPlan]) -> None:
    """Tensor-subclass parameters with all-gather hooks: what they cannot do, refused now."""
    with torch.no_grad():
        for plan in plans:
            p = plan.param
            local = p.to_local() if isinstance(p, DTensor) else p
            check_extension_plan(local, plan.fqn, plan.shard_dim, plan.tp is not None, size)


def _check_ignored(ignored_params: object, modules: tuple[nn.Module, ...]) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor) or not isinstance(ignored_params, Iterable):
        raise FullyShardTypeError(
            f"ignored_params must be a set of nn.Parameters, got {type(ignored_params).__name__}"
        )
    ignored = set()
    owned = {id(p) for m in modules for p in m.parameters()}
    for p in ignored_params:
        if not isinstance(p, nn.Parameter):
            raise FullyShardTypeError(
                f"ignored_params must hold nn.Parameters, got a {type(p).__name__}"
            )
        # One set for every call of a post-order wrap, as torch allows: a parameter outside
        # these modules has nothing to be left alone from here.
        if id(p) in owned:
            ignored.add(p)
    return ignored


def _owned_elsewhere(modules: tuple[nn.Module, ...]) -> set[int]:
    """Parameters that earlier ``fully_shard`` calls on submodules own (sharded or gathered)."""
    owned: set[int] = set()
    for top in modules:
        for m in top.modules():
            if isinstance(m, FSDPModule):
                state = m._fsdp_state
                both: list[ShardedParam | PersistentParam] = [*state.params, *state.persistent]
                for p in both:
                    owned.add(id(p.sharded_param))
                    if p.unsharded_param is not None:
                        owned.add(id(p.unsharded_param))
    return owned


# The attribute set on a parameter once a fully_shard call has sharded it: (the class of the
# call's first module, the parameter's name there). The module then holds a new DTensor
# parameter; another module still holding the original (a tied weight wrapped in another
# call, a sibling this call cannot see from its module) meets it here and is refused,
# instead of sharding a second, untied copy.
_SHARDED_BY = "_fully_shard_sharded_by"


_Found = tuple[nn.Parameter, str, list[tuple[nn.Module, str]]]
"""A parameter to shard: (the parameter, its qualified name, every (module, name) holding it)."""


def _collect_params(modules: tuple[nn.Module, ...], ignored: set[nn.Parameter]) -> list[_Found]:
    """The parameters this call owns: not ignored, not owned by an earlier call."""
    owned = _owned_elsewhere(modules)
    ignored_ids = {id(p) for p in ignored}
    found: dict[int, tuple[nn.Parameter, str, list[tuple[nn.Module, str]]]] = {}
    seen_slots: set[tuple[int, str]] = set()
    for i, top in enumerate(modules):
        prefix = f"[{i}]." if len(modules) > 1 else ""
        for mod_name, m in top.named_modules(remove_duplicate=False):
            for name, p in m._parameters.items():
                if p is None or id(p) in owned or id(p) in ignored_ids:
                    continue
                if (id(m), name) in seen_slots:
                    continue
                seen_slots.add((id(m), name))
                fqn = prefix + (f"{mod_name}.{name}" if mod_name else name)
                sharded_by = getattr(p, _SHARDED_BY, None)
                if sharded_by is not None:
                    owner, name_there = sharded_by
                    raise FullyShardValueError(
                        f"parameter {fqn!r} is tied to {name_there!r} of the {owner} that an "
                        "earlier fully_shard call already sharded (one tensor in two modules, "
                        "e.g. an embedding shared with the output head); sharding it again "
                        "would untie them. Tied parameters must be in one group: shard the "
                        "modules that hold it in one call (fully_shard([model.tok_embeddings, "
                        "model.output])), or leave them to the call on their common parent "
                        "(do not wrap them separately)"
                    )
                if id(p) not in found:
                    found[id(p)] = (p, fqn, [])
                found[id(p)][2].append((m, name))
    return list(found.values())


def _plan_params(
    found: list[_Found],
    shard_placement_fn: Callable[[nn.Parameter], object] | None,
    info: MeshInfo,
    spmd: SPMDMesh | None,
    mp_policy: MixedPrecisionPolicy,
    threshold: int | None = None,
) -> list[_ParamPlan]:
    resolver = MeshResolver(info)
    chosen: list[tuple[object, MeshInfo]] = []
    # Small enough to keep whole, before its layout is known (a DTensor on the whole SPMD
    # mesh never is: is_persistent); decided below once it is.
    whole = [
        spmd is None and is_persistent(p, threshold, None) and not has_extension(p)
        for p, _, _ in found
    ]
    for (p, fqn, _), persistent in zip(found, whole, strict=True):
        if p.dim() == 0 and not persistent:
            raise FullyShardValueError(
                f"parameter {fqn!r} is 0-dimensional (a scalar) and cannot be sharded; reshape "
                "it to (1,), keep it whole on every rank (param_persistence_threshold=2 or "
                "more) or pass it in ignored_params"
            )
        result = None if shard_placement_fn is None else shard_placement_fn(p)
        placement, param_info = resolver.resolve(result, fqn)
        if spmd is not None and param_info is not info:
            raise FullyShardNotImplementedError(
                f"shard_placement_fn returned a mesh of its own for parameter {fqn!r} and "
                "dp_mesh_dims is set; per-parameter meshes work with a data-parallel mesh= "
                "(without dp_mesh_dims) only"
            )
        chosen.append((placement, param_info))
    by_mesh: dict[int, list[tuple[nn.Parameter, str]]] = {}
    for (p, fqn, _), (_, param_info) in zip(found, chosen, strict=True):
        by_mesh.setdefault(id(param_info), []).append((p, fqn))
    for members in by_mesh.values():
        _check_one_dtensor_mesh(members)
    plans = []
    for (p, fqn, slots), (placement, param_info), small in zip(found, chosen, whole, strict=True):
        tp: TPLayout | None = None
        if spmd is not None and isinstance(p, DTensor):
            tp = spmd_layout(spmd, p)
        elif isinstance(p, DTensor):
            tp = tp_layout(param_info, p, fqn)
        if small and is_persistent(p, threshold, tp):
            # No shard dim to choose: the mesh is all shard_placement_fn decides for it.
            mp = mp_policy.for_param(p, repr(fqn))
            plans.append(_ParamPlan(p, fqn, slots, 0, tp, param_info, mp, persistent=True))
            continue
        dim = _shard_dim(p, fqn, placement, tp)
        if tp is not None:
            check_strided_split(tp, dim, param_info.shard_size, fqn)
        mp = mp_policy.for_param(p, repr(fqn))
        plans.append(_ParamPlan(p, fqn, slots, dim, tp, param_info, mp))
    return plans


def _group_plans(
    plans: list[_ParamPlan], default: MeshInfo
) -> list[tuple[MeshInfo, list[_ParamPlan]]]:
    """One group per mesh: the call's own first (kept even if empty when it is the only one),
    then the meshes ``shard_placement_fn`` chose, in the order their parameters came."""
    by_mesh: dict[int, tuple[MeshInfo, list[_ParamPlan]]] = {id(default): (default, [])}
    for plan in plans:
        by_mesh.setdefault(id(plan.info), (plan.info, []))[1].append(plan)
    grouped = list(by_mesh.values())
    if len(grouped) > 1 and not grouped[0][1]:
        grouped = grouped[1:]
    return grouped


def _check_one_dtensor_mesh(members: list[tuple[nn.Parameter, str]]) -> None:
    # One group is gathered by one collective: its DTensor parameters must share one mesh.
    meshes: dict[DeviceMesh, str] = {}
    for p, fqn in members:
        if isinstance(p, DTensor):
            meshes.setdefault(p.device_mesh, fqn)
    if len(meshes) > 1:
        (first_mesh, first_fqn), (other_mesh, other_fqn) = list(meshes.items())[:2]
        raise FullyShardValueError(
            f"the DTensor parameters of one fully_shard group are on different meshes: "
            f"{first_fqn!r} on {first_mesh} and {other_fqn!r} on {other_mesh}; parallelize "
            "the modules of one group on one tensor-parallel mesh, or shard them in separate "
            "fully_shard calls"
        )


def _shard_dim(p: nn.Parameter, fqn: str, placement: object, tp: TPLayout | None) -> int:
    if placement is None:
        if tp is None or tp.torch_order:
            return 0
        # The first dim TP leaves whole: plain Shard placements then describe the layout
        # exactly. A 1-D parameter TP shards (a colwise bias) shares dim 0 with TP. On a
        # concatenated mesh (torch's order) dim 0, as torch: the layouts are then torch's.
        free = [d for d in range(p.dim()) if d not in tp_sharded_dims(tp)]
        return free[0] if free else 0
    if not isinstance(placement, Shard):
        raise FullyShardArgumentTypeError(
            f"shard_placement_fn returned {placement!r} for parameter {fqn!r}; it must return "
            "a torch.distributed.tensor.Shard(dim), a fully_shard.ShardPlacementResult or None"
        )
    dim = placement.dim
    if not -p.dim() <= dim < p.dim():
        raise FullyShardAssertionError(
            f"shard_placement_fn returned Shard({dim}) for parameter {fqn!r} of shape "
            f"{tuple(p.shape)}; the dim must be in [{-p.dim()}, {p.dim() - 1}]"
        )
    return dim % p.dim()


def _check_params(plans: list[_ParamPlan], info: MeshInfo) -> None:
    devices = {plan.param.device for plan in plans}
    if len(devices) > 1:
        listing = ", ".join(f"{plan.fqn}@{plan.param.device}" for plan in plans[:6])
        raise FullyShardValueError(
            f"the parameters of one fully_shard group are on different devices ({listing}); "
            "move the module to one device (or the meta device) first"
        )
    for device in devices:
        if device.type not in ("meta", "cpu", info.device.type):
            raise FullyShardValueError(
                f"parameters are on {device} but the mesh is on {info.mesh.device_type}; "
                f"build the mesh on '{device.type}' or move the module to {info.device}"
            )
    # Frozen parameters of any dtype can share a group (it gathers as bytes then); one
    # reduce-scatter still needs its trainable parameters' gradients in one dtype.
    trainable = [plan for plan in plans if plan.param.requires_grad]
    reduce_dtypes = {plan.mp_policy.reduce_dtype_for(plan.param.dtype) for plan in trainable}
    if len(reduce_dtypes) > 1:
        listing = ", ".join(
            f"{plan.fqn}:{plan.mp_policy.reduce_dtype_for(plan.param.dtype)}"
            for plan in trainable[:6]
        )
        raise FullyShardValueError(
            f"the trainable parameters of one fully_shard group would reduce their gradients "
            f"in different dtypes ({listing}) and one reduce-scatter needs one gradient dtype; "
            "set MixedPrecisionPolicy(reduce_dtype=...) (e.g. torch.float32, as torch 2.15 "
            "asks when param_dtype_override_fn keeps some parameters in their own dtype), "
            "freeze the odd ones (frozen parameters of any dtype can share a group), convert "
            "the module to one dtype, or shard them in separate calls"
        )
