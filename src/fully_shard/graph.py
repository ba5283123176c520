"""The graph path: the same state run by operations ``torch.compile`` can trace.

``hooks.py`` runs a ``fully_shard`` state from Python: each hook issues its collectives and
swaps tensors in and out of the modules, and dynamo is kept out of it. This module runs the
same state as traceable operations, so that ``torch.compile(model, fullgraph=True)`` of a
sharded model captures the whole step, collectives included:

- gather: per group, each parameter's local shard, cast to the compute dtype, padded to its
  layout's ``chunk`` rows, packed into one flat buffer; one functional all-gather; the output
  split rank by rank into each parameter's full tensor (:class:`_GatherGroup`). A group whose
  parameters compute in several dtypes (``param_dtype_override_fn``) gathers one such buffer
  per dtype: one more collective per extra dtype, no byte more (the eager engine sends one
  ``uint8`` buffer instead, which the traced graph does not reinterpret).
- its backward is the reduction: the full gradients packed rank by rank in the reduce dtype,
  one reduce-scatter (on gloo an all-to-all and a sum, :func:`_reduce`; for HSDP then the
  all-reduce over the replicas), with the divisions of
  :func:`~fully_shard.collectives.plan_reduction`; each rank's rows flow on to a plain leaf
  over the shard (:meth:`~fully_shard.param.ShardedParam.ensure_graph_shard`), whose hook adds
  them into the sharded DTensor's ``.grad``, where the eager engine puts them too.
- reshard after forward: the gather is recomputed in backward (a checkpointed region around
  it), so no gathered parameter is kept from forward to backward; without resharding the
  gathered tensors are saved like any activation.

A parameter kept whole (``param_persistence_threshold``) is never gathered: the module is
shown its local tensor, and the backward all-reduces the group's kept-whole gradients
(:class:`_KeptWholeCast`).

A tensor-parallel parameter is gathered as its TP-local tensor (its layout is that tensor's,
as in the eager engine) and shown as a DTensor on its TP mesh (:func:`_on_tp_mesh`).

The module sees the gathered tensors through its instance ``__dict__``: an entry there shadows
``nn.Module.__getattr__``'s lookup in ``_parameters``, so forward computes with the gathered
tensor while ``_parameters``, ``state_dict()``, the optimizer and every ``FSDPModule`` method
keep the sharded DTensors. The post-forward of the module whose call started the traced
forward (the root's) removes the entries again.

Where the paths part: ``FSDPModule.__call__``. When dynamo traces it (``torch.compile(model)``,
or a sharded block compiled on its own after ``fully_shard``) it calls :func:`graph_call`,
which runs the module's forward hooks with ``fully_shard``'s replaced by
:func:`graph_pre_forward` / :func:`graph_post_forward`; everywhere else ``nn.Module.__call__``
runs the eager hooks, unchanged. The per-block orders that compile ``_call_impl`` or a module
before sharding never trace that call, so they keep the eager hooks.

Each sharded block called inside the traced root forward is a nested compile region
(``torch.compiler.nested_compile_region``): its gather, its forward and its reduction are
traced and compiled once per block structure and called again for every block of that
structure (:func:`_region_call`; what makes a structure: :mod:`fully_shard.regions`), so the
first step's compilation grows little with the depth. ``set_compile_region(False)`` traces a
block inline instead.

With ``set_bucket_cap_mb`` on the root, runs of consecutive groups gather with one all-gather
and reduce with one reduce-scatter in the graph, as the eager engine's buckets do
(:class:`_GatherBucket`; the rules, and how buckets meet regions, are in the section "buckets
in the graph" at the end of this module).

Python facts (the options, the layouts, the process groups) are read once, when dynamo
traces, by functions it calls as constants (:func:`_plan_for`); dynamo guards on the options
they depend on, so ``set_requires_gradient_sync`` and the other setters recompile once per
value. An option the graph cannot hold raises there (:func:`check_traceable`).

Example:
    >>> for block in model.layers:  # doctest: +SKIP
    ...     fully_shard(block)
    >>> fully_shard(model)  # doctest: +SKIP
    >>> compiled = torch.compile(model, fullgraph=True)  # doctest: +SKIP
    >>> compiled(tokens).sum().backward()  # collectives in the graphs  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.fx.experimental.symbolic_shapes import has_static_value
from torch.utils.checkpoint import checkpoint

from ._compat import (
    assume_constant_result,
    cache_region_schemas,
    compile_region,
    forward_hook_ids,
    forward_hooks,
    funcol_all_gather,
    funcol_all_reduce,
    funcol_all_to_all,
    funcol_reduce_scatter,
    has_backward_or_global_hooks,
    has_compile_regions,
)

# The eager engine's bucket rules (which groups may share a collective, the cut under a cap).
from .bucket import gather_bytes, gather_key, reduce_bytes, reduce_key, runs_of

# What the graph path takes from the eager engine's communication module, in one place (the
# graph path packs its own buffers, out of place, so that they trace as pure operations).
from .collectives import Reduction, TorchComm
from .description import GroupDescription, ParamSlot
from .errors import FullyShardNotImplementedError, FullyShardStateError
from .observer import JOB_WIDE, ProfilerLabels
from .policies import OffloadPolicy
from .quantize import PLAIN
from .regions import block_structure
from .storage import DenseStorage, WholeShard

if TYPE_CHECKING:
    from .group import GroupConfig, ParamGroup
    from .hooks import FSDPState
    from .spmd import TPLayout


# -- the plan of one group's gather, read when dynamo traces ---------------------------------

# On gloo the traced reduce-scatter is an all-to-all and a local sum (see _reduce). A test sets
# this False to trace the backend's own reduce-scatter, the one NCCL runs, on CPU as well.
_EXCHANGE_ON_GLOO = True


def _padded(t: torch.Tensor, p: ParamSlot) -> torch.Tensor:
    """``t`` (this rank's rows) with zero rows appended up to ``p.chunk``."""
    missing = p.chunk - p.local_rows
    if missing == 0:
        return t
    size = list(t.shape)
    size[p.dim] = missing
    return torch.cat([t, t.new_zeros(size)], dim=p.dim)


def _unranked(block: torch.Tensor, p: ParamSlot) -> torch.Tensor:
    """A parameter's ``(W, padded_numel)`` block of the gathered buffer as its full tensor."""
    d, size = p.dim, p.size
    ranked = block.view(p.world, *p.padded_shard)  # (W, *size[:d], chunk, *size[d+1:])
    if d != 0:
        ranked = ranked.movedim(0, d)
    full = ranked.reshape(*size[:d], p.world * p.chunk, *size[d + 1 :])
    return full if p.world * p.chunk == size[d] else full.narrow(d, 0, size[d])


def _ranked(grad: torch.Tensor, p: ParamSlot) -> torch.Tensor:
    """A full gradient as ``(W, padded_numel)``: row r holds rank r's rows, zero-padded."""
    d, world, chunk = p.dim, p.world, p.chunk
    missing = world * chunk - grad.size(d)
    if missing:
        size = list(grad.shape)
        size[d] = missing
        grad = torch.cat([grad, grad.new_zeros(size)], dim=d)
    size = list(grad.shape)
    ranked = grad.reshape(*size[:d], world, chunk, *size[d + 1 :])
    if d != 0:
        ranked = ranked.movedim(d, 0)
    return ranked.reshape(world, -1)


def _reduce(
    t: torch.Tensor, reduction: Reduction, group: str, size: int, plan: GroupDescription, op: str
) -> torch.Tensor:
    """One gradient collective (``op``: reduce-scatter or all-reduce) with its divisions.

    On gloo the reduce-scatter is an all-to-all of the rank chunks and a sum here: gloo's
    ``reduce_scatter_tensor`` clones its input and all-reduces all of it (twice a
    reduce-scatter's bytes), while the all-to-all moves what a reduce-scatter moves, as the
    eager engine's exchange does (``TorchComm.reduce_scatter``). Two gloo ranks on 2 CPU
    cores, 4 MiB of gradients: 5.5 ms against 10.2 ms a call; the medium model's compiled
    backward 282 against 322 ms (``benchmarks/bench_train.py``, torch 2.14.1).
    """
    native_avg = plan.native_avg
    if reduction.pre_divide is not None:
        t = t / reduction.pre_divide
    if reduction.factor is not None:  # PREMUL_SUM: scale every input, then sum
        t = t * (1.0 / reduction.factor)
    name = "avg" if reduction.op == "avg" and native_avg else "sum"
    if op == "rs" and not native_avg and _EXCHANGE_ON_GLOO:
        out = funcol_all_to_all(t, size, group).view(size, -1).sum(0)
    elif op == "rs":
        out = funcol_reduce_scatter(t, name, size, group)
    else:
        out = funcol_all_reduce(t, name, group)
    after = reduction.post_divide or 1.0
    if reduction.op == "avg" and not native_avg:
        after *= size
    return out if after == 1.0 else out / after


def _pack_grads(
    plan: GroupDescription, grads: tuple[torch.Tensor | None, ...], members: list[int]
) -> torch.Tensor:
    """The full gradients of ``members`` as one ``(W * total,)`` buffer, rank by rank, in the
    reduce dtype (zeros for a member without a gradient), as the eager engine packs them."""
    return _pack(_ranked_grads(plan, grads, members), plan.world, plan.reduce_dtype)


def _ranked_grads(
    plan: GroupDescription, grads: tuple[torch.Tensor | None, ...], members: list[int]
) -> list[torch.Tensor]:
    """Each of ``members``' full gradients as ``(W, padded_numel)`` (zeros for a member
    without one): :func:`_pack_grads`'s parts."""
    cols = []
    for i in members:
        g, p = grads[i], plan.slots[i]
        if g is None:
            shape = (p.world, p.padded_numel)
            cols.append(torch.zeros(shape, dtype=plan.reduce_dtype, device=plan.device))
        else:
            cols.append(_ranked(g, p))
    return cols


def _pack(parts: list[torch.Tensor], world: int, dtype: torch.dtype) -> torch.Tensor:
    """``parts``, each viewed as ``(world, -1)`` and cast to ``dtype``, side by side in one
    flat ``(world * total,)`` buffer, rank by rank: the gather's input (``world`` 1) and the
    reduction's packed gradients (``world`` W). One part already in ``dtype`` is only
    flattened, as before (a view where its layout allows)."""
    if len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0].reshape(world, -1).reshape(-1)
    return torch.ops.fully_shard.pack(parts, world, dtype)  # type: ignore[no-any-return]


def _unpack(flat: torch.Tensor, world: int, numels: list[int]) -> list[torch.Tensor]:
    """The gathered ``(world * total,)`` buffer cut into each parameter's ``(world, numel)``
    block: views where a block is contiguous (one rank, or one parameter), else each block
    copied out whole by ``fully_shard::unpack`` (see :func:`_register_pack`)."""
    if world == 1 or len(numels) == 1:
        return list(torch.split(flat.view(world, -1), numels, dim=1))
    return torch.ops.fully_shard.unpack(flat, world, numels)  # type: ignore[no-any-return]


@functools.cache
def _register_pack() -> None:
    """``fully_shard::pack`` (:func:`_pack`): the packing copies as one opaque operator, which
    inductor calls (``torch.cat`` in eager) instead of generating code for.

    Why: inductor lowers a ``torch.cat`` on CPU into copy loops that it fuses with whatever
    sits next to them, and every distinct fusion is a C++ kernel of its own to build (about
    a second of a compile worker's CPU each on 2 cores, whatever its size). The gather's and
    the reduction's packing made 4 of the 8 kernels of the blocks model's step
    (``benchmarks/bench_compile.py --model blocks``: the forward's pack inside the region and,
    apart, in the first block traced inline; the backward's recomputed pack fused with the
    ReLU's gradient; the gradients' pack fused with the bias gradient's sum); torch's
    per-block order builds 3. With the operator: 4 (torch 2.13.0, W=1); the small Llama at
    W=2 (``--model llama``) 17 with ``unpack`` too, 28 before, torch's order 12. The copies
    are the same ones (ATen's ``cat`` instead of inductor's loops), at the price of a Python
    call each (about 20 us for two tiny parameters against 4 us for ``torch.cat``): one shard
    rank without replicas therefore packs nothing at all (:class:`_GatherGroup`). Registered
    once, when the first group's description is read in a trace (not at import).
    """
    name = "fully_shard::pack"
    torch.library.define(name, "(Tensor[] parts, int world, ScalarType dtype) -> Tensor")

    def pack(parts: list[torch.Tensor], world: int, dtype: torch.dtype) -> torch.Tensor:
        if all([t.dtype is dtype and t.ndim == 2 and t.shape[0] == world for t in parts]):
            # The gradients, ranked (W, padded_numel) already: no reshape and no cast a part
            # (two dispatcher calls each, against attribute reads; a list, not a generator
            # resumed once a part).
            return torch.cat(parts, dim=1).reshape(-1)
        return torch.cat([t.reshape(world, -1).to(dtype) for t in parts], dim=1).reshape(-1)

    def fake(parts: list[torch.Tensor], world: int, dtype: torch.dtype) -> torch.Tensor:
        return parts[0].new_empty(sum(t.numel() for t in parts), dtype=dtype)

    torch.library.impl(name, "default", func=pack)
    torch.library.register_fake(name, fake)

    name = "fully_shard::unpack"
    torch.library.define(name, "(Tensor flat, int world, int[] numels) -> Tensor[]")

    def unpack(flat: torch.Tensor, world: int, numels: list[int]) -> list[torch.Tensor]:
        # One ATen call for every block (contiguous copies), not a clone per block: 0.35 against
        # 0.56 ms for the 96 parameters of a 48-block bucket (W=2, CPU, torch 2.13.0).
        blocks: list[torch.Tensor] = torch.ops.aten.split_with_sizes_copy.default(
            flat.view(world, -1), numels, 1
        )
        return blocks

    def unpack_fake(flat: torch.Tensor, world: int, numels: list[int]) -> list[torch.Tensor]:
        return [flat.new_empty(world, n) for n in numels]

    torch.library.impl(name, "default", func=unpack)
    torch.library.register_fake(name, unpack_fake)


def _one_rank_grads(
    plan: GroupDescription, grads: tuple[torch.Tensor | None, ...], members: list[int]
) -> list[torch.Tensor | None]:
    """One shard rank and no replicas: the reduction is its divisions alone, so each of
    ``members``' gradients is divided where it is, in the reduce dtype (zeros for one without
    a gradient): the numbers :func:`_pack_grads` and :func:`_reduce_flat` give, without the
    packing's copy."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    divisor, post_divide = plan.one_rank_divisor, plan.reduction.post_divide
    for i in members:
        g, p = grads[i], plan.slots[i]
        if g is None:
            g = torch.zeros(p.padded_shard, dtype=plan.reduce_dtype, device=plan.device)
        g = g.to(plan.reduce_dtype)
        g = g if divisor == 1 else g / divisor
        if post_divide is not None and post_divide != 1:
            g = g / post_divide
        out[i] = g.to(p.orig_dtype)
    return out


def _reduce_flat(plan: GroupDescription, flat: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter, the HSDP all-reduce, the last division: this rank's ``(total,)``."""
    if plan.world > 1:
        rs = plan.reduction.reduce_scatter
        flat = _reduce(flat, rs, plan.reduce_group_name, plan.world, plan, "rs")
    else:
        divisor = plan.one_rank_divisor  # a number: dynamo cannot call a constant's method
        flat = flat if divisor == 1 else flat / divisor
    if plan.replicate_group_name is not None:
        ar, replicas = plan.reduction.all_reduce, plan.replicate_size
        flat = _reduce(flat, ar, plan.replicate_group_name, replicas, plan, "ar")
    post_divide = plan.reduction.post_divide
    if post_divide is not None and post_divide != 1:
        flat = flat / post_divide
    return flat


class _GatherGroup(torch.autograd.Function):
    """Local shards in, full tensors out, in one all-gather; backward: one reduce-scatter.

    ``extra``: with gradient sync off, the group's accumulator leaf, whose gradient becomes
    the packed unreduced gradients (autograd sums them over backward passes); with sync on,
    what such passes kept (added before the reduction), or ``None``.
    """

    @staticmethod
    def forward(
        ctx: Any, plan: GroupDescription, extra: torch.Tensor | None, *shards: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.kept = extra is not None and plan.sync
        if ctx.kept:
            ctx.save_for_backward(extra)
        fulls: list[torch.Tensor | None] = [None] * len(shards)
        for piece in plan.pieces:  # one all-gather per compute dtype, in its own dtype
            if plan.world == 1:  # nothing to gather: each shard is its full tensor, cast
                for i in piece:
                    fulls[i] = shards[i].to(plan.slots[i].compute_dtype)
                continue
            dtype = plan.slots[piece[0]].compute_dtype
            flat = _pack([_padded(shards[i], plan.slots[i]) for i in piece], 1, dtype)
            if plan.world > 1:
                flat = funcol_all_gather(flat, plan.world, plan.shard_group_name)
            blocks = _unpack(flat, plan.world, [plan.slots[i].padded_numel for i in piece])
            for i, block in zip(piece, blocks, strict=True):
                fulls[i] = _unranked(block, plan.slots[i])
        return tuple(t for t in fulls if t is not None)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: GroupDescription = ctx.plan
        none: list[torch.Tensor | None] = [None] * len(grads)
        trainable = [i for i in range(len(grads)) if ctx.needs_input_grad[i + 2]]
        if not plan.sync:  # kept unreduced, in the accumulator's gradient
            return (None, _pack_grads(plan, grads, trainable), *none)
        if ctx.kept or plan.reduce_unused:
            members = trainable  # the layout the kept buffer has: every trainable parameter
        else:
            members = [i for i in trainable if grads[i] is not None]
        if not members:
            return (None, None, *none)
        if plan.world == 1 and plan.replicate_group_name is None and not ctx.kept:
            return (None, None, *_one_rank_grads(plan, grads, members))
        flat = _pack_grads(plan, grads, members)
        if ctx.kept:
            (kept,) = ctx.saved_tensors
            flat = flat + kept
        flat = _reduce_flat(plan, flat)
        pieces = torch.split(flat, [plan.slots[i].padded_numel for i in members])
        out = list(none)
        for i, piece in zip(members, pieces, strict=True):
            p = plan.slots[i]
            rows = piece.view(p.padded_shard).narrow(p.dim, 0, p.local_rows)
            out[i] = rows.to(p.orig_dtype)
        return (None, None, *out)


# -- the hooks' graph side ---------------------------------------------------------------------


@dataclass
class GraphRun:
    """One traced forward: which states are gathered and what the modules show."""

    owner: int  # id() of the state whose module call started it (the root, or a block
    # compiled on its own) and whose post-forward ends it
    gathered: set[int]  # id() of the states whose groups were gathered in this forward
    shown: list[tuple[nn.Module, str]]  # (module, name) entries put in module.__dict__
    # set_bucket_cap_mb: each group's run (_graph_buckets, by place); the gathered tensors of
    # the groups whose run gathered them before their module was called; the places a run
    # gathered.
    bucket_of: BucketPlan = ()
    pending: dict[Place, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    taken: set[Place] = field(default_factory=set)


def _refuse(group: ParamGroup, what: str, instead: str) -> None:
    raise FullyShardNotImplementedError(
        f"torch.compile of the whole sharded model (the graph path) cannot trace group "
        f"{group.label!r}: {what}. {instead}"
    )


_PER_BLOCK = (
    "Compile each block instead (torch.compile(block) or block.compile() per fully_shard "
    "block, the root run eagerly): the hooks then run outside the compiled code"
)


def check_traceable(group: ParamGroup) -> None:
    """Raise, naming the option, if ``group`` uses something the graph path cannot trace."""
    config = group.config
    if type(config.offload_policy) is not OffloadPolicy:
        _refuse(group, "CPU offload moves shards between host and device in Python", _PER_BLOCK)
    if config.post_forward is not None:
        _refuse(
            group,
            "reshard_after_forward=<int> keeps pieces between forward and backward",
            "Use reshard_after_forward=True or False, or " + _PER_BLOCK[0].lower() + _PER_BLOCK[1:],
        )
    if config.all_gather_comm is not None or config.reduce_scatter_comm is not None:
        _refuse(
            group, "set_custom_all_gather / set_custom_reduce_scatter are Python calls", _PER_BLOCK
        )
    if config.all_reduce_hook is not None:
        _refuse(
            group, "the all-reduce hook is a Python callback on the gradient buffer", _PER_BLOCK
        )
    if (
        config.requires_gradient_sync
        and not config.requires_all_reduce
        and group.info.replicate_group is not None
    ):
        _refuse(
            group,
            "set_requires_all_reduce(False) keeps partial sums between backward passes",
            _PER_BLOCK,
        )
    if not isinstance(group.comm, TorchComm):
        _refuse(group, "set_comm() replaced the collectives with Python objects", _PER_BLOCK)
    if JOB_WIDE.observers or any(not isinstance(o, ProfilerLabels) for o in group.observers):
        _refuse(
            group,
            "a tool watches its collectives (fully_shard.debug's checker, a trace recorder)",
            "Turn the tool off for the compiled run, or " + _PER_BLOCK[0].lower() + _PER_BLOCK[1:],
        )
    quant = config.quantization_policy
    for p in group.params:
        if p.gather_format(quant) is not PLAIN:
            _refuse(group, f"{p.fqn!r} all-gathers int8 (QuantizationPolicy)", _PER_BLOCK)
        if not isinstance(p.unsharded_side, (DenseStorage, WholeShard)):
            _refuse(group, f"{p.fqn!r} is a tensor subclass with its own all-gather", _PER_BLOCK)
        if p.tp is not None and p.tp.dp_dims:
            _refuse(
                group,
                f"{p.fqn!r} is a DTensor on the whole SPMD mesh (dp_mesh_dims): its gradient "
                "keeps the placement the batch gives it on the data-parallel dims, which the "
                "graph cannot fix ahead of time",
                _PER_BLOCK,
            )
        if p.local_shard.device.type == "meta":
            raise FullyShardStateError(
                f"parameter {p.fqn!r} is still on the meta device; call "
                "module.to_empty(device=...) and initialise the parameters first"
            )
    dtypes = {p.mp_policy.compute_dtype(p.orig_dtype) for p in group.params}
    odd = sorted(str(d) for d in dtypes if d.itemsize == 1 or not d.is_floating_point)
    if len(dtypes) > 1 and odd:
        # Several floating dtypes of 2 bytes or more gather as one piece each; a 1-byte or
        # integer dtype (float8 has no gloo type, an int8 weight no traced cast back) does not.
        _refuse(
            group,
            f"its parameters gather in several dtypes, among them {', '.join(odd)}",
            "Give them one dtype, or " + _PER_BLOCK[0].lower() + _PER_BLOCK[1:],
        )
    if config.keep_unsharded_storage:
        _refuse(
            group,
            "set_keep_unsharded_storage(True) keeps the eager engine's unsharded storage and "
            "its addresses, while the traced gather makes fresh tensors",
            "Call set_keep_unsharded_storage(False) before compiling, or "
            + _PER_BLOCK[0].lower()
            + _PER_BLOCK[1:],
        )


# How the graph path treats every GroupConfig field; tests/test_graph.py walks
# dataclasses.fields(GroupConfig) against this table, so that a new field cannot be left to
# one runtime:
# - "described": part of the group's description (fully_shard.description), which both
#   runtimes execute;
# - "honoured": read by the graph path elsewhere (when it traces a forward);
# - "refused": a value other than the default raises in check_traceable, naming the option;
# - "no effect": it changes how the eager engine holds memory or buffers, never what is
#   computed, and the traced graph has no such thing to change.
CONFIG_FIELDS: dict[str, str] = {
    "reshard_after_forward": "honoured",  # the gather recomputed in backward, or kept
    "reshard_after_backward": "no effect",  # every traced forward gathers anew
    "requires_gradient_sync": "described",
    # the input cast is in the description; the output cast is read when a forward is traced;
    # the dtypes each parameter gathers and reduces in are its own policy's, fixed by
    # fully_shard, and in the description
    "mp_policy": "described",
    "quantization_policy": "refused",  # int8 gathers
    "offload_policy": "refused",
    "post_forward": "refused",  # reshard_after_forward=<int>
    "requires_all_reduce": "refused",  # False on HSDP with sync on (partial sums kept)
    "all_reduce_hook": "refused",
    "gradient_divide_factor": "described",
    "force_sum_reduction_for_comms": "described",
    "unshard_in_backward": "described",  # False: nothing is gathered again in backward
    "all_gather_comm": "refused",
    "reduce_scatter_comm": "refused",
    "reduce_scatter_unused_params": "described",
    "reduce_scatter_max_input_buffers": "no effect",  # reduce inputs eager keeps in flight
    "reduce_scatter_group": "described",
    "allocate_from_process_group": "no effect",  # who allocates eager's buffers
    "symm_mem_backend": "no effect",  # recorded
    "keep_unsharded_storage": "refused",
    "compile_region": "honoured",  # the graph path's own: a block traced as a region or inline
}


@assume_constant_result
def _plan_for(group: ParamGroup, *guarded: Any) -> GroupDescription:
    """The group's description (:mod:`fully_shard.description`), read for real when dynamo
    traces and kept as a constant.

    ``guarded`` (the config, the comm, the observer counts) is passed only so that dynamo
    guards on it: a ``set_*`` call recompiles with the new value, a tool attached later is
    refused at that recompile.

    The config is guarded by identity, one guard per group: the setters replace it with an
    equal object the group had before where there is one (``FSDPModule._update_config``), so
    that an option flipped back and forth (``set_requires_gradient_sync`` per micro-batch)
    recompiles once per value, not at every flip. Guarding the fields the graph depends on
    one by one (as before) cost about 15 guards per group and as many values for dynamo to
    build per block, at every trace; identity also recompiles for a field with no effect on
    the graph (``set_reshard_after_backward``), once per value.
    """
    check_traceable(group)
    _register_pack()  # before the first gather is traced
    for p in group.params:  # the leaves _shards reads, their flags the parameters' now
        p.ensure_graph_shard()
    plan = group.description
    if not plan.sync:
        _ensure_accumulator(group, plan)
    return plan


def _ensure_accumulator(group: ParamGroup, plan: GroupDescription) -> None:
    """The leaf whose gradient keeps the packed gradients of unsynced compiled backwards."""
    numel = plan.world * sum(
        p.padded_numel for p, sp in zip(plan.slots, group.params, strict=True) if sp.requires_grad
    )
    group.graph_grads = _fitting_accumulator(
        group, group.graph_grads, numel, plan.reduce_dtype, "parameters"
    )


def _fitting_accumulator(
    group: ParamGroup, acc: torch.Tensor | None, numel: int, dtype: torch.dtype, what: str
) -> torch.Tensor:
    """``acc`` while it still holds ``numel`` elements of ``dtype``, else a new zero leaf; a
    kept unreduced sum of another layout cannot be carried over, so that raises."""
    if acc is not None and acc.numel() == numel and acc.dtype == dtype:
        return acc
    if acc is not None and acc.grad is not None:
        raise FullyShardStateError(
            f"group {group.label!r}: the trainable {what} changed while compiled backward "
            "passes with gradient sync off had kept gradients; run a backward with sync on "
            "first"
        )
    return torch.zeros(numel, dtype=dtype, device=group.info.device, requires_grad=True)


def _shards(group: ParamGroup) -> list[torch.Tensor]:
    """The group's shards as the traced code reads them: plain tensors over the sharded
    DTensors' local tensors, so that the graph's inputs and gradients are plain tensors.
    Read after :func:`_plan_of` in the same trace, which makes the leaves."""
    return [_local(p) for p in group.params]


def _local(p: Any) -> torch.Tensor:
    """A trainable parameter's graph shard (a leaf whose gradient goes on to the sharded
    DTensor, :meth:`~fully_shard.param.ShardedParam.ensure_graph_shard`), a frozen one's local
    shard. Also the kept-whole parameters' (``graph_local``, ``local``).

    The trainable flag is read off the leaf, which :func:`_plan_for` has just made
    agree with the sharded parameter: the leaf is a graph input, guarded with its
    ``requires_grad`` anyway. Reading the DTensor's flag instead made dynamo wrap each
    sharded DTensor as a fake one and guard its spec and mesh (two Python guard functions a
    parameter), for one bit: the blocks model at 48 blocks built its guards in 1.4 s with
    the read and 0.6 s without (one run each, torch 2.13). Only a frozen parameter's DTensor
    is read, so that ``requires_grad_(True)`` recompiles; ``requires_grad_(False)`` leaves
    the leaf requiring a gradient, which the next backward drops and then turns off (the
    call after it recompiles; ``ShardedParam._take_graph_grad``): exact gradients, one step
    of wasted work.
    """
    leaf = p.graph_shard
    if leaf is not None and leaf.requires_grad:
        return leaf  # type: ignore[no-any-return]
    _frozen(p)
    return p.local_shard  # type: ignore[no-any-return]


def _kept_local(pp: Any) -> torch.Tensor:
    """:func:`_local` for a kept-whole parameter (its leaf ``graph_local``, or ``local``)."""
    leaf = pp.graph_local
    if leaf is not None and leaf.requires_grad:
        return leaf  # type: ignore[no-any-return]
    _frozen(pp)
    return pp.local  # type: ignore[no-any-return]


def _frozen(p: Any) -> None:
    """Read a frozen parameter's flag, so that dynamo guards on it (see :func:`_local`)."""
    if p.sharded_param.requires_grad:
        raise FullyShardStateError(f"{p.fqn!r}: graph leaf frozen on a trainable parameter")


def _plan_of(group: ParamGroup) -> GroupDescription:
    return _plan_for(  # type: ignore[no-any-return]
        group, group.config, group.comm, len(group.observers), len(JOB_WIDE.observers)
    )


def _extra_of(group: ParamGroup, plan: GroupDescription) -> torch.Tensor | None:
    """The gather's ``extra`` input (see :class:`_GatherGroup`)."""
    acc = group.graph_grads
    if not plan.sync:
        return acc
    if acc is not None and acc.grad is not None:
        # The sums of the unsynced passes go into this reduction; the accumulator starts over.
        extra = acc.grad
        acc.grad = None
        return extra
    return None


def _gather(group: ParamGroup, reshard: bool) -> tuple[torch.Tensor, ...]:
    plan = _plan_of(group)
    return _gather_shards(plan, _extra_of(group, plan), tuple(_shards(group)), reshard)


def _gather_shards(
    plan: GroupDescription,
    extra: torch.Tensor | None,
    shards: tuple[torch.Tensor, ...],
    reshard: bool,
) -> tuple[torch.Tensor, ...]:
    gather = functools.partial(_GatherGroup.apply, plan)
    if not reshard or not plan.unshard_in_backward:
        # Kept: saved like any activation, what backward uses of it. unshard_in_backward=False
        # says backward needs none of the parameters (an embedding's), so nothing is saved
        # and nothing is gathered again, as in the eager engine.
        return gather(extra, *shards)  # type: ignore[no-any-return]
    # Recomputed in backward (a non-reentrant checkpoint of the gather alone, which dynamo
    # and AOTAutograd turn into recompute tags): no gathered parameter is kept from forward
    # to backward, and the backward graph all-gathers again.
    return checkpoint(gather, extra, *shards, use_reentrant=False, preserve_rng_state=False)  # type: ignore[no-any-return]


# -- parameters kept whole (param_persistence_threshold) ------------------------------------------
#
# Never gathered: the module is shown each one's local tensor, cast to its compute dtype, and
# the backward of that cast all-reduces the group's kept-whole gradients in one flat buffer,
# with the divisions of the eager engine's end-of-backward all-reduce (KeptWhole). The eager
# engine merges the buffers of every group into one per step; the graph keeps one per group,
# the sums being the same element by element. A block holding such parameters is traced
# inline, never as a region (the region's body gathers sharded parameters only).


@dataclass(frozen=True)
class _KeptPlan:
    """What the traced code needs of a group's kept-whole parameters, read when dynamo traces
    (process groups by name, as the functional collectives take them)."""

    names: tuple[str, ...]  # the process groups summed over, in order, those of one rank left out
    pre_divide: float | None
    post_divide: float | None
    reduce_dtype: torch.dtype
    shapes: tuple[tuple[int, ...], ...]  # each parameter's local shape (TP-local for TP)
    compute_dtypes: tuple[torch.dtype, ...]
    orig_dtypes: tuple[torch.dtype, ...]
    sync: bool
    reduce_unused: bool
    device: torch.device


@assume_constant_result
def _kept_plan_for(group: ParamGroup, *guarded: Any) -> _KeptPlan:
    """The group's :class:`_KeptPlan` (``guarded``: as :func:`_plan_for`'s); makes the
    parameters' graph leaves and, with gradient sync off, the accumulator."""
    check_traceable(group)
    desc = group.description
    kept = desc.kept_whole
    if kept is None:
        raise FullyShardStateError("kept-whole parameters without a plan (internal error)")
    persistent = group.persistent
    for pp in persistent:
        pp.ensure_graph_local()
    plan = _KeptPlan(
        names=tuple(pg.group_name for pg in kept.groups if pg.size() > 1),
        pre_divide=kept.pre_divide,
        post_divide=kept.post_divide,
        reduce_dtype=desc.reduce_dtype,
        shapes=tuple(tuple(pp.local.shape) for pp in persistent),
        compute_dtypes=tuple(pp.mp_policy.compute_dtype(pp.orig_dtype) for pp in persistent),
        orig_dtypes=tuple(pp.orig_dtype for pp in persistent),
        sync=desc.sync,
        reduce_unused=desc.reduce_unused,
        device=desc.device,
    )
    if not plan.sync:
        numel = sum(pp.local.numel() for pp in persistent if pp.requires_grad)
        group.graph_kept_grads = _fitting_accumulator(
            group, group.graph_kept_grads, numel, plan.reduce_dtype, "kept-whole parameters"
        )
    return plan


def _show_kept(group: ParamGroup) -> tuple[torch.Tensor, ...]:
    """The group's kept-whole parameters as the module computes with them (plain tensors)."""
    plan: _KeptPlan = _kept_plan_for(
        group, group.config, group.comm, len(group.observers), len(JOB_WIDE.observers)
    )
    acc = group.graph_kept_grads
    extra = acc if not plan.sync else None
    if plan.sync and acc is not None and acc.grad is not None:
        extra = acc.grad  # the unsynced passes' sums join this all-reduce
        acc.grad = None
    locals_ = [_kept_local(pp) for pp in group.persistent]
    return _KeptWholeCast.apply(plan, extra, *locals_)  # type: ignore[no-untyped-call,no-any-return]


def _pack_kept(
    plan: _KeptPlan, grads: tuple[torch.Tensor | None, ...], members: list[int]
) -> torch.Tensor:
    """The gradients of ``members`` flat, side by side, in the reduce dtype (zeros for one
    without a gradient), as ``all_reduce_kept_whole`` packs them."""
    parts = []
    for i in members:
        g = grads[i]
        if g is None:
            n = 1
            for d in plan.shapes[i]:
                n *= d
            parts.append(torch.zeros(n, dtype=plan.reduce_dtype, device=plan.device))
        else:
            parts.append(g.to(plan.reduce_dtype).reshape(-1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class _KeptWholeCast(torch.autograd.Function):
    """Local tensors in, their compute-dtype copies out; backward: one all-reduce of their
    gradients over the data-parallel ranks, divided as the eager engine divides them, cast back
    to each parameter's dtype.

    ``extra``: as :class:`_GatherGroup`'s (the accumulator with sync off, what it kept with
    sync on, or ``None``).
    """

    @staticmethod
    def forward(
        ctx: Any, plan: _KeptPlan, extra: torch.Tensor | None, *locals_: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.kept = extra is not None and plan.sync
        if ctx.kept:
            ctx.save_for_backward(extra)
        # A copy even in the same dtype: the output is the module's, never the optimizer's
        # tensor under another name (a handful of elements each).
        return tuple(
            t.to(dtype, copy=True) for t, dtype in zip(locals_, plan.compute_dtypes, strict=True)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: _KeptPlan = ctx.plan
        none: list[torch.Tensor | None] = [None] * len(grads)
        trainable = [i for i in range(len(grads)) if ctx.needs_input_grad[i + 2]]
        if not plan.sync:  # kept unreduced, in the accumulator's gradient
            return (None, _pack_kept(plan, grads, trainable), *none)
        if ctx.kept or plan.reduce_unused:
            members = trainable
        else:
            members = [i for i in trainable if grads[i] is not None]
        if not members:
            return (None, None, *none)
        flat = _pack_kept(plan, grads, members)
        if ctx.kept:
            (kept,) = ctx.saved_tensors
            flat = flat + kept
        if plan.pre_divide is not None and plan.pre_divide != 1:
            flat = flat / plan.pre_divide
        for name in plan.names:
            flat = funcol_all_reduce(flat, "sum", name)
        if plan.post_divide is not None and plan.post_divide != 1:
            flat = flat / plan.post_divide
        out = list(none)
        start = 0
        for i in members:
            shape = plan.shapes[i]
            n = 1
            for d in shape:
                n *= d
            out[i] = flat[start : start + n].view(shape).to(plan.orig_dtypes[i])
            start += n
        return (None, None, *out)


def _on_tp_mesh(full: torch.Tensor, tp: TPLayout) -> torch.Tensor:
    """A tensor-parallel parameter's gathered TP-local tensor as the DTensor its TP modules
    compute with, as the eager engine shows it (:class:`~fully_shard.storage.DenseStorage`).

    Its gradient comes back through ``from_local``'s backward, which brings a ``Partial`` TP
    gradient (a sequence-parallel norm's weight) to the parameter's own placements, summing
    it over the TP ranks as the eager engine's ``TPLayout.grad_placements`` does; the gather's
    backward then gets this rank's TP-local gradient.
    """
    return DTensor.from_local(
        full, tp.mesh, tp.placements, run_check=False, shape=tp.size, stride=tp.stride
    )


def _show(run: GraphRun, state: FSDPState, reshard: bool) -> None:
    for j, group in enumerate(state.groups):
        if group.params:
            fulls = _bucket_gathered(run, state, j, reshard)
            if fulls is None:
                fulls = _gather(group, reshard)
            for p, full in zip(group.params, fulls, strict=True):
                shown = full if p.tp is None else _on_tp_mesh(full, p.tp)
                for module, name in p.slots:
                    module.__dict__[name] = shown
                    run.shown.append((module, name))
        if group.persistent:
            for pp, whole in zip(group.persistent, _show_kept(group), strict=True):
                shown = whole if pp.tp is None else _on_tp_mesh(whole, pp.tp)
                for module, name in pp.slots:
                    module.__dict__[name] = shown
                    run.shown.append((module, name))
    run.gathered.add(id(state))


def graph_pre_forward(
    state: FSDPState, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward pre-hook inside a traced root forward: gather (once per forward), cast."""
    ctx = state.root
    if ctx is None:
        raise FullyShardStateError("graph path without a root (internal error)")
    run = ctx.graph_run
    if run is None:  # the outermost sharded module of the traced frame starts the run
        _check_root_options(state, ctx.manual_finalization)
        caps = tuple(s.bucket_cap for s in ctx.states)  # guarded: a new cap recompiles
        run = GraphRun(id(state), set(), [], _graph_buckets(state, *caps))
        ctx.graph_run = run
    if id(state) not in run.gathered:
        _show(run, state, state.reshard_after_forward)
    return state._cast_inputs(args, kwargs)


def graph_post_forward(state: FSDPState, module: nn.Module, output: Any) -> Any:
    """The forward post-hook: the run's owner ends it and shows the shards again."""
    ctx = state.root
    if ctx is not None and ctx.graph_run is not None and ctx.graph_run.owner == id(state):
        for mod, name in ctx.graph_run.shown:
            mod.__dict__.pop(name, None)
        ctx.graph_run = None
    return state._cast_output(output)


# -- one compiled region per block structure ----------------------------------------------------
#
# A block called inside the traced root forward (not the root, not a block compiled on its
# own) runs as a nested compile region: its gather, its forward and, through the gather's
# backward, its reduction are traced once per block structure and called again for every
# block of the same structure, so dynamo, AOTAutograd and inductor handle one block instead
# of all of them. The region's key (:func:`_region_key`) stands in for torch's guards: the
# block's structure (:func:`fully_shard.regions.block_structure`), its groups' gather plans
# and the inputs' metadata. Anything the key cannot vouch for (an input that is not a tensor
# or a plain value, a tensor subclass or a symbolic size, hooks besides ours, a sharded module
# inside the block, tensor-parallel or kept-whole parameters) keeps the block inline.


def _region_reuse_key(key: int, *rest: Any) -> int:
    """What torch compares to reuse a region, in place of guards: the key computed outside it
    (:func:`_region_key`) and passed first."""
    return key


def _region_body(
    key: int, module: nn.Module, reshard: bool, n_args: int, n_kwargs: int, *flat: Any
) -> Any:
    """One block's call: gather its groups, show the module the gathered tensors, forward.

    Traced once per ``key``. The arguments come flat (torch's reuse check flattens anything
    else with a traced pytree, which costs more than the rest of the call): the keyword
    names, each gathering group's ``extra``, every group's shards, the positional arguments,
    the keyword values. The gathered tensors leave the module's ``__dict__`` before the region
    ends, so a reused region leaves nothing behind that the trace would have to replay.
    """
    state: FSDPState = module._fsdp_state  # type: ignore[assignment]
    groups = [g for g in state.groups if g.params]
    names, rest = flat[:n_kwargs], flat[n_kwargs:]
    extras, rest = rest[: len(groups)], rest[len(groups) :]
    shown: list[tuple[nn.Module, str]] = []
    for group, extra in zip(groups, extras, strict=True):
        shards, rest = rest[: len(group.params)], rest[len(group.params) :]
        fulls = _gather_shards(_plan_of(group), extra, shards, reshard)
        for p, full in zip(group.params, fulls, strict=True):
            for mod, name in p.slots:
                mod.__dict__[name] = full
                shown.append((mod, name))
    # The block's own copy of each tensor argument (see _register_region_input).
    rest = tuple(map(_owned, rest))
    output = module.forward(*rest[:n_args], **dict(zip(names, rest[n_args:], strict=True)))
    for mod, name in shown:
        del mod.__dict__[name]
    return _owned_output(output)


_block_region = compile_region(_region_body, _region_reuse_key)


class _RegionInput(torch.autograd.Function):
    """``fully_shard::region_input`` with its backward (the same copy of the gradient), as a
    Function dynamo traces rather than the op's own autograd registration: the compiled step
    then calls the op with no Python autograd kernel in front of it (4 against 10 us a call,
    four calls a block; torch 2.13.0)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fully_shard.region_input(x)  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.ops.fully_shard.region_input(grad)  # type: ignore[no-any-return]


def _owned(x: Any) -> Any:
    return _RegionInput.apply(x) if isinstance(x, torch.Tensor) else x  # type: ignore[no-untyped-call]


def _owned_output(output: Any) -> Any:
    """The block's output as tensors of its own (see :func:`_register_region_input`): a
    tensor, or a tuple, list or dict of them (a region's outputs are tensors or plain values;
    other containers are returned as they are)."""
    if isinstance(output, torch.Tensor):
        return _owned(output)
    if isinstance(output, (tuple, list)):
        return type(output)(map(_owned, output))
    if isinstance(output, dict):
        return {k: _owned(v) for k, v in output.items()}
    return output


@functools.cache
def _register_region_input() -> None:
    """``fully_shard::region_input``: a copy that AOTAutograd's partitioner saves rather than
    recomputes (it recomputes no op it does not know), taken of each tensor a region receives
    and of each tensor it returns, so that a region's caller never holds a buffer the region's
    backward reads.

    Why: inductor lowers a region's outputs as fresh buffers of the calling graph, unaware
    that one may alias an input or another output, and reuses the caller's buffers
    accordingly. Two ways a block's backward then reads overwritten data: it saved a view of
    its input (``x.view(...)`` for a matmul) and the caller reuses the input's buffer for
    later work (``tests/test_graph.py``'s model: the second block's weight gradients 2e-2
    apart after one AdamW step; torch 2.13.0 and 2.14.1); or it returns a tensor it also
    saved (``tanh``'s output) and the caller computes in place on the returned one
    (``tests/test_regions.py``'s ``_Between``: gradients 1 to 4 apart; torch 2.13.0, 2.14.1
    not yet run). Both exact with
    ``allow_buffer_reuse=False``, which would cost every graph its reuse. The copies cost one
    pass over each activation a block takes and returns, in forward and in backward (the
    backward copies the gradient, for the same reason in the backward graph). Registered
    once, when the first region is traced (not at import).
    """

    # Defined with torch.library.define rather than custom_op, and differentiated by
    # _RegionInput rather than register_autograd: the compiled step calls it four times a
    # block, and each wrapper runs Python at every call (custom_op's 4 us more, the autograd
    # kernel's 6 us more, for a (4, 16) tensor; torch 2.13.0).
    name = "fully_shard::region_input"
    torch.library.define(name, "(Tensor x) -> Tensor")
    torch.library.impl(name, "default", func=torch.clone)
    torch.library.register_fake(name, torch.empty_like)
    cache_region_schemas()


@assume_constant_result
def _in_regions(
    state: FSDPState, config: GroupConfig, pre_hooks: tuple[int, ...], post_hooks: tuple[int, ...]
) -> bool:
    """Whether ``state``'s block may run as a region: the facts that do not change per call,
    in one constant call per block. ``config`` (the state's, for its ``compile_region``
    option; guarded by identity, see :func:`_plan_for`) and the ids of the module's forward
    hooks (it has only ``fully_shard``'s two) are passed so that dynamo guards on them."""
    module = state.modules[0]
    ours = {handle.id for handle in state._module_hooks}
    regional = (
        config.compile_region
        and has_compile_regions()
        and len(pre_hooks) == 1
        and len(post_hooks) == 1
        and pre_hooks[0] in ours
        and post_hooks[0] in ours
        and len(state.modules) == 1
        and not state.is_root
        and any(g.params for g in state.groups)
        and not any(g.persistent for g in state.groups)
        and all(p.tp is None for g in state.groups for p in g.params)
        and not any("_fsdp_state" in vars(m) for m in module.modules() if m is not module)
    )
    if regional:
        _register_region_input()  # before the first region is traced
    return regional


@assume_constant_result
def _region_key(state: FSDPState, reshard: bool, inputs: tuple[Any, ...]) -> int:
    """The region's key: equal for two calls that trace to the same region.

    ``inputs``: the metadata of the call's own arguments (:func:`_input_meta`) and the keyword
    names. The rest is read here, once per call while dynamo traces: the block's structure, its
    groups' descriptions and what the gather takes as inputs: which
    ``extra`` (none, the accumulator or its gradient, as :func:`_extra_of` picks) and the
    shards' metadata.
    """
    gathers = []
    for group in state.groups:
        if not group.params:
            continue
        plan = group.description  # pure: the accumulator is _plan_for's
        acc = group.graph_grads
        kept = acc is not None and acc.grad is not None
        extra = "acc" if not plan.sync else "grad" if kept else None
        shards = tuple(
            (tuple(t.shape), t.stride(), t.dtype, t.requires_grad)
            for t in (_local(p) for p in group.params)
        )
        gathers.append((plan, extra, shards))
    return hash((block_structure(state.modules[0]), tuple(gathers), reshard, inputs))


def _input_meta(x: Any) -> Any:
    """What the region's trace assumes about one argument, or ``False`` if the key cannot hold
    it (a tensor subclass, a symbolic size, an object). Loop-free: each loop dynamo traces
    costs it an exception at its end, per block."""
    # A symbolic size (dynamo made a dimension dynamic after seeing it change) is an int to
    # type() and isinstance() while dynamo traces: has_static_value is what tells them apart.
    if isinstance(x, torch.Tensor):
        if type(x) is not torch.Tensor or not has_static_value(x.numel()):
            return False
        return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
    if x is None or type(x) is str:
        return (type(x), x)
    if type(x) in (bool, int, float) and has_static_value(x):
        return (type(x), x)
    return False


def _inside_run(state: FSDPState) -> bool:
    """Whether ``state``'s module is called inside another module's traced forward, its groups
    not gathered yet in it."""
    ctx = state.root
    run = None if ctx is None else ctx.graph_run
    return run is not None and run.owner != id(state) and id(state) not in run.gathered


def _region_call(
    module: nn.Module,
    state: FSDPState,
    config: GroupConfig,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[bool, Any]:
    """``(True, output)`` of ``module``'s call as a region, or ``(False, None)`` to run it
    inline. Reads each group's plan here too, so that dynamo guards on every block's options
    (the region's own guards are those of the block first traced). ``config``: the state's
    (its groups share one); what runs here is traced once per block, so it reads each fact
    once and loops little (each loop dynamo traces ends in an exception it handles)."""
    reshard, cast_inputs, cast_output = _region_options(state, config)
    if cast_inputs:
        args, kwargs = state._cast_inputs(args, kwargs)
    user = (*args, *kwargs.values())
    metas = tuple(map(_input_meta, user))
    if False in metas:
        return False, None
    if _in_bucket(state):
        if reshard and config.unshard_in_backward:
            return False, None  # inline: see "buckets in the graph" below
        return True, state._cast_output(_gathered_region_call(module, state, kwargs, user, metas))
    # The gather's inputs: each group's extra, then its shards (their metadata is read off the
    # parameters by _region_key, which also reads each group's plan).
    extras: list[torch.Tensor | None] = []
    shards: list[torch.Tensor] = []
    for group in state.groups:
        if group.params:
            extras.append(_extra_of(group, _plan_of(group)))
            shards.extend(_shards(group))
    names = tuple(kwargs)
    # int(): a plain constant (what dynamo keeps for the constant function's result has a
    # source that torch's reuse check cannot guard on).
    key = int(_region_key(state, reshard, (*metas, *names)))
    flat = (*names, *extras, *shards, *user)
    output = _block_region(key, module, reshard, len(args), len(names), *flat)
    return True, state._cast_output(output) if cast_output else output


@assume_constant_result
def _region_options(state: FSDPState, config: GroupConfig) -> tuple[bool, bool, bool]:
    """What a block's call reads of its options, in one constant call (``config``, the
    state's, is passed so that dynamo guards on it, by identity, as :func:`_plan_for`'s):
    whether it reshards after forward, casts its inputs, casts its output. Read field by
    field in the traced code, each is a value for dynamo to build and guard, per block."""
    policy = config.mp_policy
    casts_inputs = policy.forward_input_dtype() is not None
    return state.reshard_after_forward, casts_inputs, policy.output_dtype is not None


# The releases the graph path has run on start here (2.13.0, 2.14.1). On 2.6.0 dynamo cannot
# call the functions it keeps as constants (_plan_for, _initialized) with our state as argument;
# the releases in between have not been tried.
_GRAPH_PATH_SINCE = (2, 13)


def _check_torch() -> bool:
    """Refuse, with the alternatives, a torch the graph path has not run on."""
    release = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if release < _GRAPH_PATH_SINCE:
        since = ".".join(map(str, _GRAPH_PATH_SINCE))
        raise FullyShardNotImplementedError(
            f"torch.compile of a sharded module (the graph path: the module's own call traced) "
            f"needs torch {since} or newer; this is torch {torch.__version__}. Compile each "
            "block instead, in an order that keeps the eager hooks: torch.compile(block) "
            "before fully_shard (torchtitan's order) or block.compile() before or after it"
        )
    return True


@assume_constant_result
def _check_root_options(state: FSDPState, manual_finalization: bool) -> bool:
    """Refuse the model-wide options the graph cannot hold (``manual_finalization`` is passed
    so that dynamo guards on it: turning it on later recompiles, and is refused then)."""
    if manual_finalization:
        raise FullyShardNotImplementedError(
            "torch.compile of the whole sharded model (the graph path) cannot run with "
            "set_manual_backward_finalization(True): the compiled backward reduces each "
            "group's gradients inside the graph, with no end of backward to defer to "
            "finalize_backward(). Call set_manual_backward_finalization(False) before the "
            f"compiled forward, or {_PER_BLOCK[0].lower()}{_PER_BLOCK[1:]}"
        )
    return True


@assume_constant_result
def _initialized(state: FSDPState) -> bool:
    """Run the root's lazy init eagerly, once, when dynamo first traces (a constant), after
    checking the torch release (here rather than in a constant call of its own: this one is
    traced at every sharded module's call, and each constant call is a step for dynamo)."""
    _check_torch()
    state.ensure_initialized()
    return True


def takes_graph_path(state: FSDPState) -> bool:
    """Inside a traced frame: whether this state's module call runs on the graph path.

    Always, once the root exists: a sharded module's call is traced only when the whole model
    is compiled (``torch.compile(model)``: the root's call, and every block's inside it) or
    when a sharded block is compiled on its own (``torch.compile(block)`` after
    ``fully_shard``, its root eager): then the block's own gather and reduction are in its
    graph. The other per-block orders (``block.compile()``, compiling before sharding) never
    trace this call and keep the eager hooks.
    """
    _initialized(state)
    return state.root is not None


@assume_constant_result
def _is_ours(state: FSDPState, hook_id: int) -> bool:
    """Whether ``hook_id`` is a forward hook ``fully_shard`` installed (handles are not
    traceable, so the question is answered outside the trace, once)."""
    return any(handle.id == hook_id for handle in state._module_hooks)


def graph_call(
    module: nn.Module, state: FSDPState, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``module(*args, **kwargs)`` inside a traced root forward: its forward hooks in order,
    ``fully_shard``'s replaced by their graph side, then its forward.

    ``FSDPModule.__call__`` calls this instead of ``nn.Module.__call__`` there, because the
    eager hooks must not be traced at all (a ``torch.compiler.disable``d call breaks the graph).
    """
    if has_backward_or_global_hooks(module):
        raise FullyShardNotImplementedError(
            f"torch.compile of the whole sharded model cannot run {type(module).__name__}: it "
            "has backward hooks or global module hooks, which the graph path does not call. "
            "Remove them, or compile each block instead (torch.compile(block) per fully_shard "
            "block)"
        )
    config = state.groups[0].config
    if _inside_run(state) and _in_regions(state, config, *forward_hook_ids(module)):
        done, output = _region_call(module, state, config, args, kwargs)
        if done:
            return output
    pre_hooks, post_hooks = forward_hooks(module)
    for hook_id, hook, with_kwargs in pre_hooks:
        if _is_ours(state, hook_id):
            args, kwargs = graph_pre_forward(state, module, args, kwargs)
        elif with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    output = module.forward(*args, **kwargs)
    for hook_id, hook, with_kwargs in post_hooks:
        if _is_ours(state, hook_id):
            output = graph_post_forward(state, module, output)
        else:
            result = (
                hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
            )
            output = output if result is None else result
    return output


# -- buckets in the graph (set_bucket_cap_mb) ----------------------------------------------------
#
# With a cap, a run of consecutive groups (fully_shard.bucket's runs_of, over the groups in
# forward order) gathers with one all-gather and reduces with one reduce-scatter in the traced
# graph too, so the compiler is not left to find the buckets. The run's first group to be
# called gathers the whole run (_GatherBucket), in the root graph; the others take their
# gathered tensors from the run (GraphRun.pending) when their module is called. The bucket's
# backward is its reduction: autograd runs it once every member's gradients exist, that is
# after the run's last group in backward order (its first in forward order), as the eager
# bucket's reduce-scatter waits for the run's last group. Which groups and in which order:
#
# - the order the eager engine recorded, if an eager iteration ran before the first trace;
#   otherwise the module tree's pre-order (the root first, then the blocks as registered),
#   which is the forward order of a model that calls its blocks in registration order. In
#   another order a run still gathers once, at its first member called: the buckets are then
#   less useful (gathered early), never wrong.
# - one run serves both collectives, so its groups must agree on both (bucket.gather_key and
#   bucket.reduce_key), gather in one dtype (no param_dtype_override_fn mix), and reshard
#   alike (reshard_after_forward, unshard_in_backward: the run's gather is recomputed in
#   backward, or kept, as a whole). A buffer counts the larger of its all-gather and its
#   reduce-scatter bytes against the cap. The eager engine cuts its reductions from the other
#   end (runs in backward order), so where the groups do not divide into full buckets the two
#   runtimes may split the last bucket differently; the numbers agree all the same.
# - regions: the run's gather sits in the root graph, before its first block, and a block in
#   a run of several that keeps its parameters after forward (reshard_after_forward=False)
#   is a region that takes its gathered tensors as inputs (_gathered_region_body; blocks of
#   one structure still share it). One that reshards after forward is traced inline instead:
#   a region saves the tensors it takes for its backward, so the run's gathered parameters
#   would be kept from forward to backward instead of gathered again (the backward graph's
#   all-gather vanishes). Blocks outside every run keep their regions as before.
#
# The caps are read in the traced code, so dynamo guards on them: set_bucket_cap_mb after the
# first compiled step recompiles once, and the new graph has the new buckets.


def _graph_key(group: ParamGroup, reshard: bool) -> Any:
    """What must agree for two groups to share a bucket in the graph; ``None``: never."""
    gather, reduce = gather_key(group), reduce_key(group)
    if gather is None or reduce is None or len(group.description.pieces) != 1:
        return None
    return (gather, reduce, reshard, group.config.unshard_in_backward)


def _graph_bytes(group: ParamGroup) -> int:
    d = group.description
    return max(gather_bytes(d), reduce_bytes(d))


Place = tuple[int, int]
"""A group under the root: its state's index in ``RootContext.states``, its index there."""
BucketPlan = tuple[tuple[tuple[Place, ...], ...], ...]
"""Per state under the root, per group: the places of its run, or ``()`` (no bucket)."""


@assume_constant_result
def _graph_buckets(state: FSDPState, *caps: int | None) -> BucketPlan:
    """For each state under ``state``'s root, for each of its groups: its run, if it is in a
    run of several, else ``()`` (``caps``, every state's ``bucket_cap``, is passed so that
    dynamo guards on each). Places, not groups: a group held by a constant has no source for
    the guards that reading its options installs, so the traced code looks the groups up."""
    ctx = state.root
    if ctx is None or not state.is_root or not any(caps):
        return ()  # a block compiled on its own: the rest of its bucket is not in its graph
    order = ctx.forward_order if ctx.order_recorded else ctx.states
    place = {g: (i, j) for i, s in enumerate(ctx.states) for j, g in enumerate(s.groups)}
    owner = {g: s for s in ctx.states for g in s.groups}
    groups = [g for s in order for g in s.groups if g.params]
    for g in groups:
        check_traceable(g)  # refused by name before its description is read

    def key(g: ParamGroup) -> Any:
        return _graph_key(g, owner[g].reshard_after_forward)

    runs = runs_of(groups, key, _graph_bytes, lambda g: owner[g].bucket_cap)
    run_of = {g: tuple(place[m] for m in run) for run in runs if len(run) > 1 for g in run}
    return tuple(tuple(run_of.get(g, ()) for g in s.groups) for s in ctx.states)


@assume_constant_result
def _state_index(state: FSDPState) -> int:
    ctx = state.root
    return -1 if ctx is None else ctx.states.index(state)


def _in_bucket(state: FSDPState) -> bool:
    """Whether one of ``state``'s groups is in a run of several in this traced forward."""
    ctx = state.root
    run = None if ctx is None else ctx.graph_run
    if run is None or not run.bucket_of:
        return False
    return any(run.bucket_of[_state_index(state)])


def _bucket_gathered(
    run: GraphRun, state: FSDPState, j: int, reshard: bool
) -> tuple[torch.Tensor, ...] | None:
    """The gathered tensors of ``state``'s group ``j`` if its run gathers it (now, if it is
    the first of its run to be called in this forward, with the others not gathered yet; or
    earlier), else ``None``: it gathers alone."""
    if not run.bucket_of:
        return None
    me = (_state_index(state), j)
    fulls = run.pending.pop(me, None)
    if fulls is not None:
        return fulls
    bucket = run.bucket_of[me[0]][j]
    members = [m for m in bucket if m == me or m not in run.taken]
    if len(members) < 2:
        return None
    states = state.root.states  # type: ignore[union-attr]
    groups = [states[i].groups[k] for i, k in members]
    plans = tuple(_plan_of(g) for g in groups)
    extras = [_extra_of(g, p) for g, p in zip(groups, plans, strict=True)]
    shards = [t for g in groups for t in _shards(g)]
    gather = functools.partial(_GatherBucket.apply, plans, len(groups))
    if reshard and state.groups[j].config.unshard_in_backward:  # as _gather_shards
        out = checkpoint(gather, *extras, *shards, use_reentrant=False, preserve_rng_state=False)
    else:
        out = gather(*extras, *shards)
    start = 0
    mine: tuple[torch.Tensor, ...] = ()
    for m, g in zip(members, groups, strict=True):
        run.taken.add(m)
        fulls = tuple(out[start : start + len(g.params)])
        if m == me:
            mine = fulls
        else:
            run.pending[m] = fulls
        start += len(g.params)
    return mine


class _GatherBucket(torch.autograd.Function):
    """:class:`_GatherGroup` for a run of groups: one all-gather of their shards side by side
    in every rank's row (each group's layout as it gathers alone, in run order), and in
    backward one reduce-scatter of their packed gradients, side by side the same way.

    Inputs: the groups' descriptions, their count ``n``, each group's ``extra`` (see
    :class:`_GatherGroup`), then every group's shards in order.
    """

    @staticmethod
    def forward(
        ctx: Any, plans: tuple[GroupDescription, ...], n: int, *tensors: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        extras, shards = tensors[:n], tensors[n:]
        ctx.plans = plans
        ctx.kept = [e is not None and p.sync for p, e in zip(plans, extras, strict=True)]
        ctx.save_for_backward(*(e for e, k in zip(extras, ctx.kept, strict=True) if k))
        slots = [s for p in plans for s in p.slots]
        parts = []
        for shard, slot in zip(shards, slots, strict=True):
            if shard is None:
                raise FullyShardStateError("bucket gather without a shard (internal error)")
            parts.append(_padded(shard.to(slot.compute_dtype), slot).reshape(-1))
        first = plans[0]
        flat = funcol_all_gather(torch.cat(parts), first.world, first.shard_group_name)
        blocks = _unpack(flat, first.world, [s.padded_numel for s in slots])
        return tuple(_unranked(b, s) for b, s in zip(blocks, slots, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plans: tuple[GroupDescription, ...] = ctx.plans
        n, first = len(plans), plans[0]
        kept = iter(ctx.saved_tensors)
        extras: list[torch.Tensor | None] = [None] * n
        out: list[torch.Tensor | None] = [None] * len(grads)
        # Each group's ranked gradients (W, padded_numel) and what its earlier passes kept;
        # where the reduced rows go.
        parts: list[tuple[list[torch.Tensor], torch.Tensor | None]] = []
        landing = []
        start = 0
        for j, plan in enumerate(plans):
            mine = grads[start : start + len(plan.slots)]
            trainable = [i for i in range(len(mine)) if ctx.needs_input_grad[2 + n + start + i]]
            if not plan.sync:  # kept unreduced, in the accumulator's gradient
                extras[j] = _pack_grads(plan, mine, trainable)
            else:
                k = next(kept) if ctx.kept[j] else None
                whole = k is not None or plan.reduce_unused
                members = trainable if whole else [i for i in trainable if mine[i] is not None]
                if members:
                    parts.append((_ranked_grads(plan, mine, members), k))
                    landing.append((plan, start, members))
            start += len(plan.slots)
        if parts:
            world, dtype = first.world, first.reduce_dtype  # alike in a run (reduce_key)
            if all(k is None for _, k in parts):
                # One packing call for the whole run: each is a Python call at every step.
                packed = _pack([c for cols, _ in parts for c in cols], world, dtype)
            else:
                columns = []
                for cols, k in parts:
                    flat = _pack(cols, world, dtype)
                    columns.append((flat if k is None else flat + k).view(world, -1))
                packed = torch.cat(columns, dim=1).reshape(-1)
            flat = _reduce_flat(first, packed)
            sizes = [plan.slots[i].padded_numel for plan, _, members in landing for i in members]
            pieces = iter(torch.split(flat, sizes))
            for plan, at, members in landing:
                for i in members:
                    p = plan.slots[i]
                    rows = next(pieces).view(p.padded_shard).narrow(p.dim, 0, p.local_rows)
                    out[at + i] = rows.to(p.orig_dtype)
        return (None, None, *extras, *out)


def _gathered_region_body(
    key: int, module: nn.Module, n_args: int, n_kwargs: int, *flat: Any
) -> Any:
    """A bucketed block's call as a region: its parameters come gathered (by its bucket, in
    the calling graph), so the region is its forward alone. ``flat``: the keyword names, every
    group's gathered tensors, the positional arguments, the keyword values."""
    state: FSDPState = module._fsdp_state  # type: ignore[assignment]
    names, rest = flat[:n_kwargs], flat[n_kwargs:]
    shown: list[tuple[nn.Module, str]] = []
    for group in state.groups:
        for p in group.params:
            # Copied in as the arguments are (_register_region_input): a block saves its weights
            # for backward as it saves views of its input. Not reproduced with gathered weights
            # (tests/test_buckets.py's net, inductor, torch 2.13: exact without the copy); kept
            # because the mechanism is the same.
            full, rest = _owned(rest[0]), rest[1:]
            for mod, name in p.slots:
                mod.__dict__[name] = full
                shown.append((mod, name))
    rest = tuple(map(_owned, rest))
    output = module.forward(*rest[:n_args], **dict(zip(names, rest[n_args:], strict=True)))
    for mod, name in shown:
        del mod.__dict__[name]
    return _owned_output(output)  # as _region_body's, for the same reason


_gathered_region = compile_region(_gathered_region_body, _region_reuse_key)


@assume_constant_result
def _gathered_key(state: FSDPState, metas: tuple[Any, ...]) -> int:
    """The key of a bucketed block's region: its structure and what it takes (the gathered
    tensors' and the arguments' metadata, the keyword names)."""
    return hash(("gathered", block_structure(state.modules[0]), metas))


def _gathered_region_call(
    module: nn.Module,
    state: FSDPState,
    kwargs: dict[str, Any],
    user: tuple[Any, ...],
    metas: tuple[Any, ...],
) -> Any:
    """Gather the block's groups (their buckets, in the calling graph), call its region."""
    run: GraphRun = state.root.graph_run  # type: ignore[union-attr]
    reshard = state.reshard_after_forward
    fulls: list[torch.Tensor] = []
    for j, group in enumerate(state.groups):
        if group.params:
            mine = _bucket_gathered(run, state, j, reshard)
            fulls.extend(_gather(group, reshard) if mine is None else mine)
    names = tuple(kwargs)
    key = int(_gathered_key(state, (*map(_input_meta, fulls), *metas, *names)))
    n_args = len(user) - len(names)
    return _gathered_region(key, module, n_args, len(names), *names, *fulls, *user)
