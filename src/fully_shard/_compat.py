"""Every private torch API ``fully_shard`` uses, in one place, each with why and where tried.

Nothing else in the package touches a torch name that starts with an underscore (apart from
``nn.Module._parameters``, which every module wrapper reads). Where the entries were run (CPU,
gloo, the test suite; each entry says which releases it has run on):

- torch 2.13.0, CI's pin: every entry, on every CI run.
- torch 2.14.1, the newest release: every entry (the whole suite, 2026-12-06).
- torch 2.6.0, the oldest supported release: the test files of the engine, parity with an
  unsharded model, properties, validation, checkpoints, 2-D and 3-D meshes, ``dp_mesh_dims``,
  the planner and the policies (2026-12-06); not pipelining or ``torch.compile``, whose tests
  also run torch's FSDP2 (which 2.6 cannot run on CPU). Two probes answer "no" there by
  design: :func:`can_concatenate_meshes` (``dp_mesh_dims`` that flatten or
  reorder dims raise ``FullyShardNotImplementedError``) and
  :func:`strided_shard_handles_uneven` (an uneven TP + FSDP layout raises).
- torch 2.11.0 with CUDA (an H200, 2026-12-04, an earlier engine): the entries up to
  :func:`dtensor_from_spec`.
- The graph path's entries (``funcol_*``, :func:`assume_constant_result`,
  :func:`forward_hooks`, :func:`has_backward_or_global_hooks`) and
  :func:`torch_newton_schulz` (``fully_shard.Muon``) came later: run on 2.13.0 and 2.14.1;
  ``torch_newton_schulz`` falls back to our copy of the arithmetic where torch has no Muon.
- :func:`forward_hook_ids` and :func:`cache_region_schemas` (the graph path's regions): run
  on 2.13.0 and 2.14.1 (tests/test_regions.py, inductor too).
- :func:`calls_only_these_hooks` (the eager hooks called without ``nn.Module._call_impl``):
  run on 2.13.0 and 2.14.1; where ``_has_any_global_hook`` is missing it answers no, and
  every call takes ``nn.Module.__call__`` as before.

Releases in between have not been run. An entry whose API may be missing falls back (a probe,
``getattr``) or raises ``FullyShardNotImplementedError`` naming the torch version; the others
are present, under the same name, in every release listed above.
"""

from __future__ import annotations

import importlib
import operator
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

# -- the planner's (fully_shard.plan.activations) ------------------------------------------
# A dispatch mode is the only way to see every tensor an op creates (autograd's backward ops
# included); torch's own memory tools (torch.distributed._tools.mem_tracker) are built on it.
# Fake tensors rather than plain meta ones: a fake tensor keeps its device ("cpu"), so ops
# pick that device's kernels (scaled_dot_product_attention saves a logsumexp on CPU but
# materializes the attention weights on meta: 20% more activation memory in a small
# transformer). The FLOP formulas are torch's FlopCounterMode table. Run on 2.6.0, 2.13.0
# and 2.14.1.
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .errors import FullyShardNotImplementedError

__all__ = ["FakeTensorMode", "TorchDispatchMode", "flop_registry"]  # re-exported for the planner


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished.

    No public API says "backward is over": a hook on the inputs misses backward passes whose
    inputs need no grad, and a hook on the last gradient misses unused parameters.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def inside_backward() -> bool:
    """Whether an autograd backward pass is running in this thread (-1: none is).

    Tells a recomputation under activation checkpointing (a forward inside backward) from a
    forward that finds the flags of an earlier backward which raised before its end-of-backward
    callback could clear them.
    """
    return bool(torch._C._current_graph_task_id() != -1)


# profiler_enabled() -> bool: whether a torch profiler (Kineto, the legacy one, NVTX or ITT
# ranges) is recording now. A ``record_function`` label costs two dispatcher calls and a
# ``torch.classes`` object even when nothing records it (about 6 µs a label, against 0.2 µs for
# this check; CPU, torch 2.13); the profiler labels ask this first. torch's own fast labels
# (``_RecordFunctionFast``, what compiled graphs emit) make the same check in C++. Bound to the
# C function itself, not wrapped: the engine asks it at every span of every group (13 per group
# per step), and a Python wrapper doubled the calls (bench_overhead).
# ``torch._C._autograd._profiler_enabled``: run on 2.6.0, 2.13.0 and 2.14.1.
profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled

# set_grad_enabled(mode: bool) -> None: autograd's thread-local switch itself, the C function
# that torch.no_grad() and torch.set_grad_enabled() call. The engine's copies into and out of
# communication buffers switch it off around a block (try / finally, restoring what
# torch.is_grad_enabled() said): torch.no_grad() costs 5 Python calls per use, and a group
# used it 7 times per step (bench_overhead). ``torch._C._set_grad_enabled``: run on 2.6.0,
# 2.13.0 and 2.14.1.
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled


def post_accumulate_grad_hooks(t: torch.Tensor) -> list[Callable[[torch.Tensor], None]]:
    """The hooks ``t.register_post_accumulate_grad_hook`` registered, in registration order.

    A sharded parameter never takes part in autograd (the unsharded one does), so autograd
    never runs these hooks: the engine runs them itself once the sharded gradient is in
    place, as torch's FSDP2 does (optimizer-in-backward depends on it). Registration is
    public, listing is not: the dict lives at ``Tensor._post_accumulate_grad_hooks`` (``None``
    until one is registered) since the hooks came in 2.1; run on 2.6.0, 2.13.0 and 2.14.1.
    """
    hooks = getattr(t, POST_ACCUMULATE_GRAD_HOOKS, None)
    return list(hooks.values()) if hooks else []


# Where those hooks live: hot callers test ``getattr(t, POST_ACCUMULATE_GRAD_HOOKS, None)``
# (a C call) before calling post_accumulate_grad_hooks, once per parameter per step.
POST_ACCUMULATE_GRAD_HOOKS = "_post_accumulate_grad_hooks"


def grad_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autograd gives ``t``'s gradient (``Tensor.grad_dtype``), or ``None`` where
    this torch has no such attribute or it is ``t``'s own dtype.

    ``Tensor.grad_dtype`` is public where it exists (2.13.0 and 2.14.1 have it, tried); it is
    read with ``getattr`` so that a release without it answers ``None`` (gradients in the
    parameter's dtype, which is what such a release gives).
    """
    dtype = getattr(t, "grad_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) and dtype != t.dtype else None


def set_grad_dtype(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Make autograd produce and accumulate ``t``'s gradient in ``dtype``; ``False`` where
    this torch has no ``Tensor.grad_dtype`` (the caller then casts the gradient itself).

    torch 2.15's FSDP2 sets its unsharded parameters' ``grad_dtype`` to ``reduce_dtype``; the
    attribute is public in the releases that have it (set on 2.13.0 and 2.14.1).
    """
    if not hasattr(t, "grad_dtype"):
        return False
    if t.grad_dtype != dtype:
        t.grad_dtype = dtype
    return True


# version(t) -> int: ``t``'s version counter, which every in-place write (``optimizer.step()``)
# bumps. Public in spirit (autograd's saved-tensor check uses it) but named with an
# underscore. An attrgetter, not a Python function: groups read it for each parameter several
# times per step, and a C call costs a fraction of a Python one (bench_overhead).
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``mesh`` was sliced from (``root["dp"]`` -> ``root``), or ``mesh`` itself.

    A parameter sharded by both tensor parallelism (on ``root["tp"]``) and by us (on
    ``root["dp"]``) must be one DTensor on the mesh holding both dims, so that ``full_tensor``
    and DCP see the whole layout. DeviceMesh keeps that parent but only exposes it privately:
    as ``mesh._get_root_mesh()`` in recent releases (2.13), through the module-level mesh
    registry ``_mesh_resources.get_root_mesh`` before that (2.6).
    """
    get_root = getattr(mesh, "_get_root_mesh", None)
    if get_root is not None:
        root: DeviceMesh = get_root()
        return root
    from torch.distributed.device_mesh import _mesh_resources

    registry_root: DeviceMesh = _mesh_resources.get_root_mesh(mesh)
    return registry_root


def strided_shard(dim: int, split_factor: int) -> Placement:
    """The placement of a dim that tensor parallelism sharded *before* us on an inner mesh dim.

    DTensor applies placements outer mesh dim first. When TP (inner dim) shards tensor dim
    ``d`` and we then shard TP's local rows of ``d`` again over the outer data-parallel dim,
    the layout is "TP first, then DP", which plain ``Shard(d)`` on both dims cannot say:
    ``_StridedShard(d, split_factor=tp_size)`` on the DP dim does. torch's own FSDP2 uses the
    same placement for the same reason; there is no public equivalent yet.
    """
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        raise FullyShardNotImplementedError(
            f"torch {torch.__version__} has no _StridedShard placement, which a parameter that "
            "tensor parallelism sharded on the same dim as fully_shard needs; use torch 2.6 or "
            "newer, or a TP plan that shards another dim"
        ) from None
    return _StridedShard(dim, split_factor=split_factor)


def strided_shard_handles_uneven() -> bool:
    """Whether this torch's ``_StridedShard`` can describe a dim that does not split evenly.

    torch 2.6 has only ``_split_tensor`` / ``_to_replicate_tensor`` on it, which assert an even
    split: ``full_tensor()``, ``redistribute`` and DCP fail on an uneven strided layout (even
    ones work). torch 2.13 computes each rank's uneven size and offset
    (``local_shard_size_and_offset``). Releases in between were not tried; the probe looks for
    that method rather than at the version number.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    return hasattr(_StridedShard, "local_shard_size_and_offset") or hasattr(
        _StridedShard, "_local_shard_size_and_offset"
    )


def will_run_in_this_backward(node: object) -> bool:
    """Whether autograd's current backward pass will execute ``node`` (a ``grad_fn``).

    Tells a group's post-backward whether another of its module calls still has to run its
    backward in *this* pass (F1 F2 then ``(l1 + l2).backward()``) or only in a later one
    (F1 F2 B1 B2), so that the group is freed as soon as this pass is done with it. The engine
    knows (activation checkpointing asks it the same way) but says so only privately:
    ``torch._C._will_engine_execute_node``, on 2.6 and 2.13. Where it is missing we answer
    "yes", which keeps the group gathered until the end of the backward pass: correct, more
    memory.
    """
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return True
    return bool(will_execute(node))


def gradient_edge_node(t: torch.Tensor) -> object:
    """The autograd node that receives ``t``'s gradient (a leaf's ``AccumulateGrad``).

    ``torch.autograd.graph.get_gradient_edge`` is public (2.2+); with
    :func:`will_run_in_this_backward` it tells whether this backward pass accumulates a
    parameter's gradient at all.
    """
    from torch.autograd.graph import get_gradient_edge

    return get_gradient_edge(t).node


def backend_allocate(
    group: object, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """A ``(numel,)`` buffer from ``group``'s backend allocator, or ``None`` if it has none.

    ``set_allocate_memory_from_process_group_for_comm``: NCCL can hand out memory registered
    for zero-copy transfers. The process group exposes its per-device backend only as
    ``ProcessGroup._get_backend(device)`` (2.13; torch's FSDP2 uses the same call);
    ``supports_tensor_alloc`` / ``allocate_tensor`` on it are public. gloo has no allocator,
    and a torch without these methods (older releases) gets ``None`` too.
    """
    get_backend = getattr(group, "_get_backend", None)
    if get_backend is None:
        return None
    try:
        backend = get_backend(device)
    except RuntimeError:  # no backend registered for this device type
        return None
    supports = getattr(backend, "supports_tensor_alloc", None)
    if supports is None or not supports(device):
        return None
    out: torch.Tensor = backend.allocate_tensor(numel, dtype=dtype, device=device)
    return out


def flatten_mesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The dims ``names`` of ``mesh`` flattened into one 1-D mesh, named ``"_".join(names)``.

    ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(shard=("dp_shard", "cp")))`` shards
    over those dims as one (torch 2.13's semantics). Only ``DeviceMesh._flatten`` builds that
    dim (and its process group, a collective; torch caches it, so a second call with the same
    names returns the same mesh); torch's FSDP2 calls the same method. 2.6 and 2.13 have it.
    """
    sub = mesh[names]
    if not callable(getattr(sub, "_flatten", None)):
        raise FullyShardNotImplementedError(
            f"torch {torch.__version__} cannot flatten the mesh dims {names} into one "
            "(DeviceMesh._flatten is missing); use torch 2.6 or newer, or pass a mesh whose "
            "shard dim is a single dim"
        )
    flattened: DeviceMesh = sub._flatten("_".join(names))
    return flattened


def can_concatenate_meshes() -> bool:
    """Whether :func:`concatenate_meshes` works on this torch (2.13 has it; 2.6 does not)."""
    return callable(getattr(DeviceMesh, "_concatenate", None))


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of ``meshes`` (sub-meshes of one root, some flattened).

    The sharded DTensors of ``dp_mesh_dims`` with a tuple of dims live on the full mesh with
    that tuple replaced by its flattened dim; no slicing of the root names such a mesh (slicing
    a flattened dim from the root is deprecated in 2.13). ``DeviceMesh._concatenate`` (2.13;
    torch's FSDP2 builds the same meshes with it) reuses the dims' process groups and creates
    none. Check :func:`can_concatenate_meshes` first.
    """
    concatenated: DeviceMesh = DeviceMesh._concatenate(meshes)
    return concatenated


def local_tensor(dt: torch.Tensor) -> torch.Tensor:
    """The tensor a DTensor holds for this rank: the very object, not a view of it.

    A tensor subclass's all-gather hooks are called on it, and what a user sets on it between
    steps must reach them: torchao's ``precompute_float8_dynamic_scale_for_fsdp`` stores the
    next scale as an attribute of ``weight._local_tensor``. ``to_local()`` returns that object
    only for a plain DTensor under no_grad; for an ``nn.Parameter(DTensor)`` torch 2.13
    returns a fresh ``view_as`` (a new subclass wrapper, without the attribute). torch's FSDP2
    reads ``_local_tensor`` for the same reason; 2.6 has it too.
    """
    local: torch.Tensor = dt._local_tensor  # type: ignore[attr-defined]
    return local


def dtensor_spec(
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    shape: torch.Size,
    stride: tuple[int, ...],
    dtype: torch.dtype,
) -> object:
    """The layout of a sharded DTensor, built once and reused by :func:`dtensor_from_spec`:
    one object per layout, shared by every parameter and gradient laid out alike.

    ``torch.distributed.tensor._dtensor_spec.DTensorSpec`` (private): see
    :func:`dtensor_from_spec` for why. Run on 2.6.0, 2.11.0, 2.13.0 and 2.14.1.
    """
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    key = (id(mesh), tuple(placements), tuple(shape), tuple(stride), dtype)
    spec = _SPECS.get(key)
    if spec is None:
        spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, dtype))
        _SPECS[key] = spec
    return spec


# Shared across models too (a reference model beside the policy, EMA weights): DTensor's
# sharding-propagation cache (C++, torch 2.13) compares the specs of a hit with the ones it
# stored in Python (DTensorSpec.__eq__) unless they are the same objects, which cost a second
# model of the 48-block benchmark 288 Python calls per optimizer.step() (537 against 249).
# Weak values: an entry lives while a DTensor holds its spec, and the spec holds the mesh,
# so the mesh's id in a key is not reused while the entry exists.
_SPECS: weakref.WeakValueDictionary[tuple[Any, ...], Any] = weakref.WeakValueDictionary()


def dtensor_from_spec(local: torch.Tensor, spec: object) -> DTensor:
    """A DTensor over ``local`` (the very tensor, on its own device) laid out as ``spec``.

    Why not ``DTensor.from_local``: it moves the local tensor to the mesh's device type, so a
    CPU-offloaded shard (``CPUOffloadPolicy``) on a CUDA mesh was copied back to the GPU,
    nothing was offloaded, and lazy init then replaced the sharded parameters the optimizer
    held, which never got a gradient again (found on an H200 with torch 2.11). No public call
    builds a DTensor whose local tensor stays on another device than its mesh's. It is also
    an autograd function that checks and normalises its arguments on every call: 69 µs per
    call against 4 µs for the constructor with a spec built once (CPU, torch 2.13), paid for
    every parameter's gradient on every step (on a GPU this was the largest item of our
    post-backward). torch's FSDP2 builds its sharded parameters and gradients the same way.
    Run on 2.6.0, 2.13.0 and 2.14.1 (CPU; a CUDA-typed mesh needs no GPU to exist) and on
    2.11.0 with CUDA.
    """
    dt: DTensor = new_dtensor(DTensor, local, spec, requires_grad=local.requires_grad)
    return dt


# DTensor's constructor without its ``__init__``: ``DTensor.__new__`` (torch 2.13.0 and 2.14.1:
# the C function ``torch.Tensor._dtensor__new__``) builds the whole tensor and sets ``_spec``
# and ``_local_tensor``; ``__init__`` then only calls ``object.__init__`` through a
# ``torch._disable_dynamo`` wrapper and an export marker that acts under ``torch.export``
# alone (6 Python frames: ``inner``, ``_fn``, ``_callback_from_stance``, ``wrapper``,
# ``__init__``, ``is_exporting``), paid for every sharded gradient at every step (2 per group
# per step in bench_overhead). The engine builds DTensors eagerly only, never under
# torch.export (its hooks are kept out of traced code). Run on 2.13.0 and 2.14.1; not run
# on 2.6.0 (no environment for it here): check there that ``DTensor.__new__`` alone sets
# ``_spec`` and ``_local_tensor``. ``ShardedParam.accumulate_sharded_grad`` calls it itself
# with a spec it built once: ``new_dtensor(DTensor, local, spec, requires_grad=...)``.
new_dtensor: Callable[..., Any] = DTensor.__new__


def torch_fsdp_module_class() -> type | None:
    """torch's own ``FSDPModule`` class, if this process has imported ``torch.distributed.fsdp``.

    torch's pipelining schedules, Accelerate and torch's memory tools recognise an FSDP2 module
    by ``isinstance(m, torch.distributed.fsdp.FSDPModule)``. Our modules are recognised when
    their class has torch's as a base (every method is ours: tests/test_recognition.py checks
    that nothing of torch's class is reachable). This reads the class off ``sys.modules`` and
    never imports the package (rule 1): code that asks ``isinstance`` against torch's class has
    imported it, and so have ``torch.distributed.pipelining``, ``torch.distributed.checkpoint``
    and ``torch.distributed._tools``; on 2.13 so has ``torch._dynamo``, which our hooks'
    ``keep_out_of_graphs`` loads before the class swap, so in practice every module is
    recognised whatever the user imported first. Public name, private lookup; run on 2.6.0,
    2.13.0 and 2.14.1.

    Users who make a library call ours rebind torch's names
    (``torch.distributed.fsdp.FSDPModule = fully_shard.FSDPModule``); the public name then is
    our own class, and adding it as a base again would fail (``duplicate base class``). So
    the class is read first where torch defines it, the private
    ``torch.distributed.fsdp._fully_shard._fully_shard`` (run on 2.13; the public name is the
    fallback where that module differs), which users do not rebind, and a class that is not
    torch's (ours, or a subclass of ours) is never returned: the ``__module__`` of torch's
    starts with ``torch.`` (2.13 sets it to ``torch.distributed.fsdp``).
    """
    for where in ("torch.distributed.fsdp._fully_shard._fully_shard", "torch.distributed.fsdp"):
        cls = getattr(sys.modules.get(where), "FSDPModule", None)
        if isinstance(cls, type) and cls.__module__.startswith("torch."):
            return cls
    return None


class _StateRegistry(dict[Any, Any]):
    """torch's per-module registry of composable-API states, answering ``view`` for torch's
    ``fully_shard`` (see :func:`register_with_torch_composable`); other APIs (torch's composable
    ``checkpoint``, ``replicate``) store and find their own states in it as usual."""

    def __init__(self, view: object) -> None:
        super().__init__()
        self.view = view

    def get(self, key: Any, default: Any = None) -> Any:
        if key in self:
            return self[key]
        if getattr(key, "__name__", None) == "fully_shard":
            return self.view
        return default


def register_with_torch_composable(module: torch.nn.Module, view: object) -> None:
    """Enter our sharded ``module`` in torch's composable-API registries as ``fully_shard``.

    Two private per-module dicts of ``torch.distributed._composable.contract`` (read in torch
    2.13's ``contract.py``; run with pipelining on 2.13.0 and 2.14.1, registered but never
    read on 2.6.0), both keyed by a per-process name in the module's ``__dict__``:

    - ``REGISTRY_KEY``: name -> ``RegistryItem``. torch's ``replicate()`` leaves the
      parameters of a module registered as ``"fully_shard"`` alone; on one it does not see as
      sharded it turns every DTensor parameter into a plain local one and all-reduces it with
      DDP, which breaks ours (torch's ``test_unshard_async``: a ``replicate``'d root above
      ``fully_shard`` blocks). Only membership of the name is read.
    - ``STATE_KEY``: function -> state, what ``fully_shard.state(module)`` returns. torch's
      pipelining (``_PipelineStageBase.perform_reduce_grad``, the REDUCE_GRAD action of every
      schedule) reduces an FSDP stage through
      ``fully_shard.state(stage)._state_ctx.all_states[i]._fsdp_param_groups[j]
      .post_backward()`` and ``._root_post_backward_final_callback()``; ``view`` answers those
      names (:mod:`fully_shard.interop`), put in a registry that answers it when asked for a
      function named ``fully_shard``.

    The module is read off ``sys.modules``, never imported: torch's FSDP package loads it,
    and so does ``torch._dynamo`` on 2.13, before our class swap (see
    :func:`torch_fsdp_module_class`). Without it nothing of torch's can ask.
    """
    contract = sys.modules.get("torch.distributed._composable.contract")
    registry_key = getattr(contract, "REGISTRY_KEY", None)
    item = getattr(contract, "RegistryItem", None)
    if isinstance(registry_key, str) and item is not None:
        registry = module.__dict__.setdefault(registry_key, {})
        if isinstance(registry, dict):
            registry.setdefault("fully_shard", item())
    state_key = getattr(contract, "STATE_KEY", None)
    if isinstance(state_key, str):
        states = _StateRegistry(view)
        states.update(module.__dict__.get(state_key) or {})
        module.__dict__[state_key] = states


def torch_newton_schulz() -> Callable[..., torch.Tensor] | None:
    """torch's own Newton-Schulz orthogonalization of ``torch.optim.Muon``, if it has one.

    ``fully_shard.Muon`` promises the numbers of ``torch.optim.Muon`` on the unsharded model,
    so it runs torch's arithmetic itself rather than a copy that could drift:
    ``torch.optim._muon._zeropower_via_newtonschulz(grad, ns_coefficients, ns_steps, eps)``
    (private; read and run on torch 2.13, where ``torch.optim.Muon`` is). A torch without it
    (2.6 has no Muon) gets ``None`` and ``fully_shard.optim.muon.newton_schulz``, the same
    arithmetic written out, which tests/test_muon.py checks bit for bit against torch's.
    """
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz
    except ImportError:
        return None
    fn: Callable[..., torch.Tensor] = _zeropower_via_newtonschulz
    return fn


# -- the graph path's (fully_shard.graph) --------------------------------------------------
# Functional collectives as the ops dynamo and AOTAutograd trace: ``_c10d_functional``'s
# ops (present with these names and signatures since torch 2.2; run on 2.13.0) and their
# wait. The public wrappers in torch.distributed._functional_collectives changed names in
# 2.13 (all_gather_tensor -> all_gather_single) and warn under the old ones; the ops did not.


def funcol_all_gather(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """All-gather ``t`` (1-D) over the named group: ``(world * numel,)``, rank by rank."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_gather_into_tensor(t, world, group_name))  # type: ignore[no-any-return]


def funcol_reduce_scatter(t: torch.Tensor, op: str, world: int, group_name: str) -> torch.Tensor:
    """Reduce-scatter ``t`` (1-D, ``world`` chunks) with ``op`` ("sum" / "avg")."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.reduce_scatter_tensor(t, op, world, group_name))  # type: ignore[no-any-return]


def funcol_all_to_all(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Send chunk r of ``t`` (1-D, ``world`` equal chunks) to rank r; return the chunks the
    ranks sent us, rank by rank (the shape of ``t``)."""
    ops = torch.ops._c10d_functional
    split = [t.numel() // world] * world
    return ops.wait_tensor(ops.all_to_all_single(t, split, split, group_name))  # type: ignore[no-any-return]


def funcol_all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """All-reduce ``t`` over the named group with ``op`` ("sum" / "avg")."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(t, op, group_name))  # type: ignore[no-any-return]


def keep_out_of_graphs(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` (a function or a bound method) marked so that dynamo never traces it nor
    anything it calls, with no wrapper frame around it; returns ``hook`` itself.

    What ``torch.compiler.disable(fn, recursive=True)`` gives, without its wrapper, whose
    ``_fn`` costs 3 Python frames and 4 eval-frame switches per call (2 calls per group per
    step: the forward hooks) and dwarfed a small block's own hook. Two marks make the same:

    - ``fn._torchdynamo_disable``: what dynamo reads (``inspect.getattr_static``) when a
      traced frame reaches a call of ``fn`` (``block.compile()`` tracing ``_call_impl`` and
      its hooks): it does not inline it and breaks the graph there, as for a disabled
      function (the same frames and graph breaks, tests/test_compile.py);
    - the frame strategy of ``fn.__code__``, ``(SKIP, SKIP)`` (``set_code_exec_strategy``
      of ``torch._C._dynamo.eval_frame``, as ``torch._dynamo.eval_frame`` has it): when
      ``fn`` then runs under an active compile callback, dynamo's frame evaluator runs its
      frame and every frame it calls without converting them, which is what the wrapper's
      ``set_eval_frame(None)`` did. It is kept in the code object's extra state, which
      ``torch._dynamo.reset()`` clears only for codes dynamo compiled (torch marks its own
      non-recursive disable wrapper the same way, once at import).

    Private (``torch._dynamo``); run on 2.13.0 and 2.14.1. Where the strategy API is missing
    (releases before it) the public wrapper is returned instead, so the hooks stay out of
    graphs at the old cost. Importing ``torch._dynamo`` takes a second: called when hooks
    are installed, never at import.
    """
    # Loaded as torch.compiler.disable loaded it (on 2.13 it loads torch's FSDP package,
    # which torch_fsdp_module_class reads).
    importlib.import_module("torch._dynamo")
    try:  # the C module that torch._dynamo.eval_frame and torch._dynamo.types re-export
        from torch._C._dynamo.eval_frame import _FrameAction as FrameAction
        from torch._C._dynamo.eval_frame import _FrameExecStrategy as FrameExecStrategy
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
    except ImportError:
        disabled: Callable[..., Any] = torch.compiler.disable(hook, recursive=True)  # type: ignore[no-untyped-call]  # public, unannotated
        return disabled
    fn: Any = getattr(hook, "__func__", hook)  # a method's marks go on its function
    if not getattr(fn, "_torchdynamo_disable", False):
        set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        fn._torchdynamo_disable = True
    return hook


def assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Dynamo runs ``fn`` for real when it traces a call and bakes the result in as a constant.

    The graph path's one use: the root's lazy init (Python bookkeeping and eager tensor
    allocation) must run once before the traced forward, and fullgraph allows no break to run
    it in. ``torch._dynamo.assume_constant_result`` only sets the attribute below, which
    dynamo's function variables read (read in torch 2.6.0, 2.13.0 and 2.14.1); it is set here
    directly because importing ``torch._dynamo`` at our import time would cost a second and, on
    2.13, load torch's own FSDP package (``import fully_shard`` must do neither).
    """
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def forward_hooks(
    module: torch.nn.Module,
) -> tuple[list[tuple[int, Callable[..., Any], bool]], list[tuple[int, Callable[..., Any], bool]]]:
    """``(id, hook, with_kwargs)`` of ``module``'s forward pre-hooks and forward hooks, in the
    order ``nn.Module.__call__`` runs them.

    The graph path calls a sharded module's hooks itself (its own replaced by their traceable
    side); nn.Module keeps them in private dicts (2.13.0; the same names since 2.0).
    """
    pre = [
        (i, h, i in module._forward_pre_hooks_with_kwargs)
        for i, h in module._forward_pre_hooks.items()
    ]
    post = [
        (i, h, i in module._forward_hooks_with_kwargs) for i, h in module._forward_hooks.items()
    ]
    return pre, post


def forward_hook_ids(module: torch.nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids of ``module``'s forward pre-hooks and forward hooks: what the graph path's
    region check reads per block (two tuples of a dict's keys, which dynamo traces in a few
    steps and guards as the dicts' keys; the private dicts :func:`forward_hooks` reads, run
    with this function on 2.13.0 and 2.14.1)."""
    return tuple(module._forward_pre_hooks), tuple(module._forward_hooks)


# nn.Module's own test for global module hooks (torch.nn.modules.module, private; run on
# 2.13.0 and 2.14.1). Where it is missing, every call takes nn.Module.__call__.
_has_any_global_hook: Callable[[], Any] = getattr(
    importlib.import_module("torch.nn.modules.module"), "_has_any_global_hook", lambda: True
)


# nn.Module.__call__ as torch defines it: a tool that patches it (torch.fx's symbolic tracer)
# must see every call, so a sharded module's call goes through it while it is patched.
_MODULE_CALL = torch.nn.Module.__call__


def calls_only_these_hooks(module: torch.nn.Module, pre_id: int, post_id: int) -> bool:
    """Whether ``nn.Module.__call__`` of ``module`` would run forward pre-hook ``pre_id``
    (with kwargs), ``module.forward`` and forward hook ``post_id`` (with kwargs) and nothing
    else: no other hook of the module, no backward or global module hook, no compiled call
    (``module.compile()``), no JIT trace, no patched ``nn.Module.__call__`` (``torch.fx``).

    Then ``FSDPModule.__call__`` makes those three calls itself: the same calls in the same
    order, without ``_call_impl``'s slow path, which cost 20 us per module call on the 2-core
    CI box (two empty hooks made a ``Linear``'s call 3x dearer). nn.Module keeps its hooks in
    private dicts, the ones ``_call_impl`` reads (the names since torch 2.0; run on 2.13.0 and
    2.14.1).
    """
    pre, post = module._forward_pre_hooks, module._forward_hooks
    return (
        len(pre) == 1
        and pre_id in pre
        and len(post) == 1
        and post_id in post
        and not module._backward_hooks
        and not module._backward_pre_hooks
        and module.__dict__.get("_compiled_call_impl") is None
        and not _has_any_global_hook()
        and not torch._C._get_tracing_state()
        and torch.nn.Module.__call__ is _MODULE_CALL
    )


def has_backward_or_global_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has hooks the graph path does not call: backward hooks on the module
    or any global module hook (nn.Module's private state, 2.13.0)."""
    from torch.nn.modules import module as nn_module

    return bool(
        module._backward_hooks or module._backward_pre_hooks or nn_module._has_any_global_hook()  # type: ignore[no-untyped-call]
    )


def compile_region(fn: Callable[..., Any], reuse_key: Callable[..., int]) -> Callable[..., Any]:
    """``fn`` as a nested compile region: traced once per ``reuse_key`` value, called again.

    The graph path puts each sharded block's call (its gather, its forward and, through the
    gather's backward, its reduce-scatter) in one region, so that dynamo traces and inductor
    compiles a repeated block once (``fully_shard.graph``). ``reuse_key`` is traced with the
    call's arguments and returns an int; a call whose key was seen before in the same trace
    reuses that region without tracing ``fn`` (torch's guard-based reuse refuses a region with
    side effects, and the block is shown its gathered tensors through its ``__dict__``).
    ``torch.compiler.nested_compile_region`` is public, its ``reuse_hash_fn`` and
    ``max_reuse_entries`` arguments are new: present in 2.13.0 and 2.14.1. Where they are
    missing (2.6.0 has no regions), ``fn`` is returned as it is and the blocks are traced
    inline. Outside a compiled frame the region calls ``fn``.
    """
    if not has_compile_regions():
        return fn
    # One entry per distinct block structure in a traced step; torch raises past the limit
    # (default 8), which a model with many kinds of blocks could reach.
    region = torch.compiler.nested_compile_region
    return region(fn, reuse_hash_fn=reuse_key, max_reuse_entries=1 << 16)  # type: ignore[no-any-return]


def has_compile_regions() -> bool:
    """Whether :func:`compile_region` makes regions on this torch (2.13.0, 2.14.1: yes)."""
    import inspect

    region = getattr(torch.compiler, "nested_compile_region", None)
    return region is not None and "reuse_hash_fn" in inspect.signature(region).parameters


def cache_region_schemas() -> None:
    """Make torch's ``invoke_subgraph`` compute a region call's schema once per region and
    operand metadata instead of once per call.

    Why: AOTAutograd's autograd step for every ``invoke_subgraph`` call whose operands need
    gradients calls the operator's ``gen_schema`` (only to refuse a region that mutates its
    inputs), and ``gen_schema`` re-traces the whole region body with ``make_fx`` each time,
    three times per call (metadata, joint trace, partition). With one region called by every
    block that is the largest cost that grows with the depth: 48 tiny blocks, ``aot_eager``,
    4.3 of 11.9 s of a profiled first step (torch 2.13.0). The schema depends only on the
    body and the operands' metadata, so it is kept per body (weakly: a body that goes away
    takes its entries along) and per metadata; anything the key cannot hold (a symbolic size,
    an operand that is neither a tensor nor an int) goes to torch's own ``gen_schema``.
    ``torch.ops.higher_order.invoke_subgraph`` and its ``gen_schema`` are private; the call in
    ``HigherOrderOperator``'s autograd step goes through the instance, so an instance
    attribute replaces it (torch 2.13.0; torch has since cached the same schema for its
    functionalization check, a path this one does not take). Installed once, when the graph path
    traces its first region; a no-op where the operator or its ``gen_schema`` is missing.
    """
    import weakref

    hop = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    inner = getattr(hop, "gen_schema", None)
    if hop is None or inner is None or getattr(inner, "_fully_shard_cached", False):
        return
    kept: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()

    def meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            sizes = (*x.shape, *x.stride())
            if not all(type(s) is int for s in sizes):
                raise TypeError("symbolic size")
            return (type(x), sizes, x.dtype, x.device, x.requires_grad)
        if x is None or type(x) is int:
            return x
        raise TypeError(type(x).__name__)

    def gen_schema(subgraph: Any, identifier: Any, *operands: Any) -> Any:
        try:
            key = (identifier, tuple(map(meta, operands)))
            per_body = kept.setdefault(subgraph, {})
        except TypeError:  # unhashable, symbolic or not weakly referable: torch's own
            return inner(subgraph, identifier, *operands)
        schema = per_body.get(key)
        if schema is None:
            schema = per_body[key] = inner(subgraph, identifier, *operands)
        return schema

    gen_schema._fully_shard_cached = True  # type: ignore[attr-defined]
    hop.gen_schema = gen_schema
