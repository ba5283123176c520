"""fully_shard.plan: predicted peak vs MemTracker's measurement, the choice, the errors, the CLI.

The yardstick is ``torch.distributed._tools.mem_tracker.MemTracker`` on CPU: every rank runs
two training steps (forward, backward, AdamW step, ``zero_grad``) of the planned model under
it; the peak over both steps is the second step's (the first holds no optimizer state and
does not prefetch). MemTracker hooks the gradient of every parameter of every module it sees
run, and refuses frozen ones; :class:`_Tracker` turns those hooks off, which only changes how
it labels gradients, not what it counts.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributed._tools.mem_tracker import MemTracker

from fully_shard import (
    FSDPModule,
    FullyShardTypeError,
    FullyShardValueError,
    MixedPrecisionPolicy,
    PlanInfeasibleError,
    fully_shard,
    plan,
)
from fully_shard.plan import CheckpointedBlock, Plan, parse_bytes
from fully_shard.plan import _trace_shortened as trace_shortened
from fully_shard.plan.activations import fake_mode, fake_replica, run_trace, to_fake
from fully_shard.plan.schedule import adam_temporaries
from harness import mesh_1d, run_distributed
from matrix import thinned
from models import ModelArgs, Transformer

TOLERANCE = 0.10  # the bar: prediction within 10% of the measurement
T = TypeVar("T")


class _Tracker(MemTracker):
    """MemTracker without its per-parameter gradient hooks (which refuse frozen parameters)."""

    def _track_module_params_and_buffers(
        self, module: nn.Module, install_grad_hooks: bool = True
    ) -> tuple[int, int]:
        return super()._track_module_params_and_buffers(module, install_grad_hooks=False)


def loss_fn(out: Tensor) -> Tensor:
    """Cross-entropy against class 0, built on the output's device (meta-safe)."""
    target = torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)
    return F.cross_entropy(out.float().flatten(0, -2), target.flatten())


class PreNormMLP(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))``: a block with no attention."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return out


class MLPModel(nn.Module):
    """Embedding -> pre-norm MLP blocks -> final norm -> head (tied to the embedding or not).

    With a narrow hidden width the head outweighs the blocks, so the planner's default groups
    are the Linears (the head, untied, one of them) rather than the blocks.
    """

    def __init__(self, vocab: int, dim: int, layers: int, hidden: int, tie: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(PreNormMLP(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.output(self.norm(h))
        return out


def _build(spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module
    if spec.get("kind", "transformer") == "mlp":
        model = MLPModel(spec["vocab"], spec["dim"], spec["layers"], spec["ffn"], spec["tie"])
    else:
        model = _transformer(spec)
    if spec["frozen"] == "embedding":
        model.tok_embeddings.requires_grad_(False)
    elif spec["frozen"] == "block":
        model.layers[0].requires_grad_(False)
    return model


def _transformer(spec: dict[str, Any]) -> Transformer:
    args = ModelArgs(
        vocab_size=spec["vocab"],
        dim=spec["dim"],
        n_layers=spec["layers"],
        n_heads=2,
        ffn_hidden=spec["ffn"],
        max_seq_len=max(16, spec.get("seq", 16)),
        tie_embeddings=spec["tie"],
    )
    return Transformer(args)


def _tokens(spec: dict[str, Any], step: int) -> Tensor:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, spec["vocab"], (spec["batch"], spec.get("seq", 16)), generator=gen)


def _mp(spec: dict[str, Any]) -> MixedPrecisionPolicy | None:
    if not spec["mp"]:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _plan(spec: dict[str, Any], budget: int | str, **kw: Any) -> Plan:
    return plan(
        _build(spec),
        budget=budget,
        example_inputs=(_tokens(spec, 0),),
        mesh=mesh_1d(),
        mp_policy=_mp(spec),
        loss_fn=loss_fn,
        **kw,
    )


def _train(model: nn.Module, spec: dict[str, Any], steps: int) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = loss_fn(model(_tokens(spec, step)))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _on_rank_0(make: Callable[[], T]) -> T:
    """``make()`` on rank 0, sent to every rank. A plan reads only the mesh's sizes, the same on
    every rank, and the ranks share the cores: one rank plans, the others wait."""
    box: list[Any] = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return cast(T, box[0])  # what rank 0 made, unpickled


def _budgets(spec: dict[str, Any], wheres: Sequence[float], **kw: Any) -> list[int]:
    """Budgets each ``where`` of the way from the feasible minimum to the unconstrained peak
    (two plans, each traced anew, however many budgets). Both are the largest over the ranks,
    the same on every rank."""
    try:
        _plan(spec, 1, **kw)
    except PlanInfeasibleError as e:
        low = e.minimum_bytes
    high = _plan(spec, "1TiB", **kw).peak_bytes
    return [int(low + where * (high - low)) for where in wheres]


def _planned_between(spec: dict[str, Any], where: float, **kw: Any) -> tuple[Plan, int]:
    """On every rank: (the plan, its budget) for the budget ``where`` of the way from the
    feasible minimum to the unconstrained peak, planned on rank 0."""

    def make() -> tuple[Plan, int]:
        (budget,) = _budgets(spec, [where], **kw)
        return _plan(spec, budget, **kw), budget

    return _on_rank_0(make)


def _measure(spec: dict[str, Any], where: float, **kw: Any) -> tuple[int, int, int, str]:
    """On each rank: (predicted peak, measured peak, budget, the plan's table); ``kw``: more
    arguments of ``plan``."""
    p, budget = _planned_between(spec, where, **kw)
    model = p.apply(_build(spec), mesh_1d())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = _Tracker()
    tracker.track_external(model)
    with tracker:
        for step in range(2):
            loss = loss_fn(model(_tokens(spec, step)))
            loss.backward()
            optim.step()
            optim.zero_grad()
            del loss
            tracker.reset_mod_stats()  # MemTracker keeps one iteration's module stats
    measured = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    return p.rank_peaks[dist.get_rank()], measured, budget, str(p)


specs = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["transformer", "mlp"]),
        "vocab": st.sampled_from([16, 37, 230]),
        "dim": st.sampled_from([8, 12, 16, 48]),
        "layers": st.integers(1, 6),
        "ffn": st.sampled_from([8, 21, 40]),
        "tie": st.booleans(),
        "frozen": st.sampled_from(["none", "embedding", "block"]),
        "mp": st.booleans(),
        "batch": st.sampled_from([1, 4]),
        "seq": st.sampled_from([8, 16, 33]),
    }
)


def _mlp(vocab: int, dim: int, layers: int, frozen: str, batch: int, seq: int, **kw: Any) -> Any:
    spec = {"kind": "mlp", "vocab": vocab, "dim": dim, "layers": layers, "frozen": frozen}
    return spec | {"batch": batch, "seq": seq, "ffn": 4 * dim, "tie": True, "mp": False} | kw


# Tied embedding and head, pre-norm MLP blocks, the planner's own groups (W=2): the shapes
# of the tied draws that were reported over budget. The suite runs the first (the feasible
# minimum, a frozen block: the tighter of the two); the second, the same kind of model half
# way up, only in ``nox -s soak`` (tests/matrix.py).
_TIED_DRAWS = [
    {"spec": _mlp(640, 48, 5, "block", 3, 28), "world": 2, "where": 0.0},
    {"spec": _mlp(705, 80, 5, "none", 3, 47), "world": 2, "where": 0.5},
]


def _tied_draws(test: Callable[..., None]) -> Callable[..., None]:
    """``test`` with an ``@example`` for each of ``_TIED_DRAWS`` that this run keeps."""
    for kwargs in reversed(thinned(_TIED_DRAWS, _TIED_DRAWS[:1])):
        test = example(**kwargs)(test)
    return test


# The suite runs the explicit cases below plus two drawn ones, the same two every run; the
# soak session draws 60 new ones (FULLY_SHARD_PLAN_EXAMPLES=60).
@settings(
    max_examples=int(os.environ.get("FULLY_SHARD_PLAN_EXAMPLES", "2")),
    derandomize="FULLY_SHARD_PLAN_EXAMPLES" not in os.environ,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=(Phase.explicit, Phase.reuse, Phase.generate),  # shrinking re-runs ranks for minutes
)
@_tied_draws
# A vocabulary-sized head as a group of its own (narrow blocks: the Linears are the groups),
# its gradient packed last: the engine kept it alive through the reduce-scatter's output
# allocation, which the replay did not (measured 6.6% over the budget); the engine now frees
# it first, as the replay assumes.
@example(spec=_mlp(640, 80, 5, "block", 3, 11, ffn=48, tie=False, mp=True), world=2, where=0.65)
# A frozen embedding, the first block checkpointed (the feasible minimum): the block's input
# needs no gradient, so nothing but the checkpoint keeps it, until the block's backward. The
# replay freed it after the block's forward, as in the plain run (measured one hidden state,
# 896 B, over the budget).
@example(
    spec={"kind": "transformer", "vocab": 37, "dim": 16, "layers": 2, "ffn": 24, "tie": False}
    | {"frozen": "embedding", "mp": False, "batch": 2, "seq": 8},
    world=1,
    where=0.0,
)
@given(spec=specs, world=st.integers(1, 4), where=st.floats(0.0, 1.0))
def test_predicted_peak_matches_memtracker_and_fits(
    spec: dict[str, Any], world: int, where: float
) -> None:
    for predicted, measured, budget, table in run_distributed(
        _measure, world, spec, where, timeout=120
    ):
        assert abs(predicted - measured) <= TOLERANCE * measured, (
            f"predicted {predicted}, measured {measured}\n{table}"
        )
        assert measured <= budget, f"measured {measured} > budget {budget}\n{table}"


def _measure_kept(spec: dict[str, Any], threshold: int) -> tuple[int, int, int, int, int, str]:
    """Kept-whole parameters: the default configuration under a budget that is its predicted
    peak exactly. On each rank: (predicted, predicted without the threshold, measured,
    budget, kept-whole parameters in the engine, the table)."""

    def make() -> tuple[int, list[int], Plan]:
        budget = _plan(spec, "1TiB", allow=(), param_persistence_threshold=threshold).peak_bytes
        blind = _plan(spec, "1TiB", allow=()).rank_peaks
        return budget, blind, _plan(spec, budget, allow=(), param_persistence_threshold=threshold)

    budget, blind, p = _on_rank_0(make)
    model = p.apply(_build(spec), mesh_1d())
    kept = sum(
        len(g.persistent)
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._fsdp_state.groups  # type: ignore[union-attr]
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = _Tracker()
    tracker.track_external(model)
    with tracker:
        for step in range(2):
            loss = loss_fn(model(_tokens(spec, step)))
            loss.backward()
            optim.step()
            optim.zero_grad()
            del loss
            tracker.reset_mod_stats()
    measured = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    rank = dist.get_rank()
    return p.rank_peaks[rank], blind[rank], measured, budget, kept, str(p)


@pytest.mark.parametrize(
    ("spec", "world", "threshold", "blind_misses"),
    [
        # Pre-norm MLP blocks (W=2): every norm weight and bias (at most 4 * 48 elements) kept
        # whole, the matrices sharded.
        (_mlp(640, 48, 5, "none", 2, 16, tie=False), 2, 200, False),
        # The same with every block parameter (48 x 192 at most) kept whole: the blocks gather
        # and reduce-scatter nothing; only the embedding and the head are sharded.
        (_mlp(640, 48, 5, "none", 2, 16, tie=False), 2, 10_000, True),
        # Llama-style blocks in bf16 (W=4): the RMSNorm weights kept whole, each with its
        # bf16 copy; a tied head. Two blocks: MemTracker's cost grows with the tensors it
        # tracks times the ops it sees, and four blocks keep nothing more whole.
        (
            {"kind": "transformer", "vocab": 37, "dim": 16, "layers": 2, "ffn": 40, "tie": True}
            | {"frozen": "none", "mp": True, "batch": 2, "seq": 8},
            4,
            17,
            False,
        ),
    ],
)
def test_predicted_peak_with_kept_whole_params_matches_memtracker_and_fits(
    spec: dict[str, Any], world: int, threshold: int, blind_misses: bool
) -> None:
    small = [n for n, p in _build(spec).named_parameters() if p.numel() < threshold]
    for predicted, blind, measured, budget, kept, table in run_distributed(
        _measure_kept, world, spec, threshold, timeout=120
    ):
        assert kept == len(small), table  # the plan passed the threshold to fully_shard
        assert abs(predicted - measured) <= TOLERANCE * measured, (
            f"predicted {predicted}, measured {measured}\n{table}"
        )
        assert measured <= budget, f"measured {measured} > budget {budget}\n{table}"
        assert predicted > blind  # the kept-whole memory is in the prediction
        if blind_misses:  # ... and a prediction without it would fail the tolerance
            assert abs(blind - measured) > TOLERANCE * measured, (blind, measured)


def test_candidate_thresholds_take_the_largest_that_fits() -> None:
    spec = _mlp(640, 48, 5, "none", 2, 16, tie=False)
    tokens = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]))

    def planned(threshold: Any, budget: int | str = "1TiB") -> Plan:
        return plan(
            _build(spec),
            budget=budget,
            world_size=2,
            example_inputs=(tokens,),
            loss_fn=loss_fn,
            allow=(),
            param_persistence_threshold=threshold,
        )

    none, norms, blocks = (planned(t) for t in (None, 200, 10_000))
    assert none.peak_bytes < norms.peak_bytes < blocks.peak_bytes
    assert blocks.step_bytes < none.step_bytes  # the blocks gather nothing
    for budget, taken, like in [
        (blocks.peak_bytes, 10_000, blocks),
        (blocks.peak_bytes - 1, 200, norms),
        (norms.peak_bytes - 1, None, none),
    ]:
        p = planned((200, 10_000), budget)
        assert p.param_persistence_threshold == taken, str(p)
        assert (p.peak_bytes, p.step_bytes) == (like.peak_bytes, like.step_bytes)


def _measure_buckets(
    spec: dict[str, Any], caps: tuple[float, ...]
) -> tuple[int, int, int, int, float | None, Any, Any, str]:
    """Buckets on: the default configuration (every block reshards after forward, so both
    gather directions and the reductions are bucketed), under a budget that is its predicted
    peak with the smallest of ``caps`` exactly. On each rank: (predicted, predicted without
    buckets, measured, budget, the chosen cap, the planned and the engine's bucket sizes,
    the table)."""

    def make() -> tuple[int, list[int], Plan]:
        budget = _plan(spec, "1TiB", allow=(), bucket_caps=caps[-1:]).peak_bytes
        blind = _plan(spec, "1TiB", allow=()).rank_peaks
        return budget, blind, _plan(spec, budget, allow=(), bucket_caps=caps)

    budget, blind, p = _on_rank_0(make)
    model = p.apply(_build(spec), mesh_1d())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = _Tracker()
    tracker.track_external(model)
    with tracker:
        for step in range(2):  # the first records the order and runs unbucketed
            loss = loss_fn(model(_tokens(spec, step)))
            loss.backward()
            optim.step()
            optim.zero_grad()
            del loss
            tracker.reset_mod_stats()
    measured = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    buckets = model._fsdp_state.root.buckets  # type: ignore[union-attr]
    rank = dist.get_rank()
    engine = None if buckets is None else buckets.sizes()
    return (
        p.rank_peaks[rank],
        blind[rank],
        measured,
        budget,
        p.bucket_cap_mb,
        p.buckets,
        engine,
        str(p),
    )


@pytest.mark.parametrize(
    ("spec", "world", "caps", "blind_misses"),
    [
        # Pre-norm MLP blocks (W=2): 1 MiB would hold the whole model, which does not fit the
        # budget; 0.25 MiB merges three blocks at most.
        (_mlp(640, 48, 5, "none", 2, 16, tie=False), 2, (1.0, 0.25), False),
        # Llama-style blocks in bf16 (W=4, uneven rows), a frozen embedding (the first
        # block's backward ends with the root's), a tied head: one bucket each way. Three
        # blocks, not fewer: with two, the buckets' memory is within 10% of the rest, and a
        # prediction without it would pass too.
        (
            {"kind": "transformer", "vocab": 37, "dim": 16, "layers": 3, "ffn": 40, "tie": True}
            | {"frozen": "embedding", "mp": True, "batch": 2, "seq": 8},
            4,
            (0.25,),
            True,
        ),
    ],
)
def test_predicted_peak_with_buckets_matches_memtracker_and_fits(
    spec: dict[str, Any], world: int, caps: tuple[float, ...], blind_misses: bool
) -> None:
    for predicted, blind, measured, budget, cap, planned, engine, table in run_distributed(
        _measure_buckets, world, spec, caps, timeout=120
    ):
        # The largest cap that fits: the smallest, as the budget was its peak.
        assert cap == caps[-1], table
        assert planned == engine, f"planned buckets {planned}, the engine's {engine}"
        assert engine is not None and max(max(v, default=1) for v in engine.values()) > 1
        assert abs(predicted - measured) <= TOLERANCE * measured, (
            f"predicted {predicted}, measured {measured}\n{table}"
        )
        assert measured <= budget, f"measured {measured} > budget {budget}\n{table}"
        assert predicted > blind  # the buckets' memory is in the prediction
        if blind_misses:  # ... and a prediction without it would fail the tolerance
            assert abs(blind - measured) > TOLERANCE * measured, (blind, measured)


def _hand_vs_plan(spec: dict[str, Any]) -> tuple[list[float], list[float], bool, bool]:
    """Train the planned model and the same configuration written by hand; compare."""
    p, _ = _planned_between(spec, 0.3)
    mesh = mesh_1d()
    planned = p.apply(_build(spec), mesh)
    by_hand = _build(spec)
    options: dict[str, Any] = {"mesh": mesh, "offload_policy": p.offload_policy()}
    if _mp(spec) is not None:
        options["mp_policy"] = _mp(spec)
    for g in p.groups:
        if not g.fqn:
            continue
        index = int(g.fqn.split(".")[1])
        block: nn.Module = by_hand.layers[index]
        if g.checkpoint:
            block = CheckpointedBlock(block)
            by_hand.layers[index] = block
        fully_shard(block, reshard_after_forward=g.reshard_after_forward, **options)
    fully_shard(by_hand, reshard_after_forward=False, **options)
    a, b = _train(planned, spec, 3), _train(by_hand, spec, 3)
    same = all(
        torch.equal(x.full_tensor(), y.full_tensor())  # type: ignore[attr-defined]
        for x, y in zip(planned.parameters(), by_hand.parameters(), strict=True)
    )
    return a, b, same, any(g.checkpoint for g in p.groups)


def test_apply_trains_exactly_like_the_same_calls_by_hand() -> None:
    # Two blocks: at this budget the plan still checkpoints a block, as with three.
    spec = {"vocab": 37, "dim": 16, "layers": 2, "ffn": 40, "tie": False, "frozen": "none"}
    spec |= {"mp": False, "batch": 4}
    for a, b, same, _ in run_distributed(_hand_vs_plan, 2, spec):
        assert a == b
        assert same


def _choices(spec: dict[str, Any]) -> list[tuple[int, float, float | None, float | None]]:
    out: list[tuple[int, float, float | None, float | None]] = []
    if dist.get_rank() != 0:
        return out  # a plan reads only the mesh's sizes, the same on every rank: rank 0 plans
    for budget in _budgets(spec, (0.0, 0.5, 1.0)):
        chosen = _plan(spec, budget)
        simpler = []
        for allow in ((), ("reshard",)):
            try:
                simpler.append(_plan(spec, budget, allow=allow).step_cost)
            except PlanInfeasibleError:
                simpler.append(None)
        out.append((budget, chosen.step_cost, simpler[0], simpler[1]))
    return out


def test_chosen_configuration_never_costs_more_than_a_simpler_one_that_fits() -> None:
    # Two blocks: eleven plans, each a trace of the model; with three the simpler ones fit
    # at the same budgets (the unconstrained peak only) and the chosen costs fall the same way.
    spec = {"vocab": 37, "dim": 16, "layers": 2, "ffn": 40, "tie": True, "frozen": "none"}
    spec |= {"mp": False, "batch": 4}
    rows = run_distributed(_choices, 2, spec)[0]
    for _, chosen, default, reshard_only in rows:
        for other in (default, reshard_only):
            if other is not None:
                assert chosen <= other
    # Unconstrained, it keeps every block gathered: the cheapest of all.
    assert rows[-1][1] <= min(c for _, c, _, _ in rows)


def _infeasible(spec: dict[str, Any]) -> tuple[int, int, int] | None:
    if dist.get_rank() != 0:
        return None  # a plan reads only the mesh's sizes, the same on every rank: rank 0 plans
    try:
        _plan(spec, 1)
    except PlanInfeasibleError as e:
        minimum = e.minimum_bytes
        assert isinstance(e.plan, Plan) and e.plan.peak_bytes == minimum
    with pytest.raises(PlanInfeasibleError) as info:
        _plan(spec, minimum - 1)
    at_minimum = _plan(spec, minimum)
    return minimum, info.value.minimum_bytes, at_minimum.peak_bytes


def test_infeasible_budget_raises_with_the_minimum_that_fits() -> None:
    spec = {"vocab": 16, "dim": 8, "layers": 2, "ffn": 21, "tie": False, "frozen": "embedding"}
    spec |= {"mp": True, "batch": 4}
    on_rank_0 = run_distributed(_infeasible, 2, spec)[0]
    assert on_rank_0 is not None
    minimum, raised, peak = on_rank_0
    assert raised == minimum  # one byte less than the minimum: infeasible, same minimum
    assert peak == minimum  # the minimum itself: feasible, and that is its peak


def _mesh_disagrees() -> str:
    spec = {"vocab": 16, "dim": 8, "layers": 1, "ffn": 8, "tie": False, "frozen": "none"}
    spec |= {"mp": False, "batch": 1}
    with pytest.raises(FullyShardValueError) as info:
        _plan(spec, "1GiB", world_size=3)
    return str(info.value)


def test_world_size_disagreeing_with_the_mesh_is_refused() -> None:
    assert "world_size=3 disagrees with the mesh" in run_distributed(_mesh_disagrees, 2)[0]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"budget": -5}, FullyShardValueError, "budget must be positive"),
        ({"budget": "lots"}, FullyShardValueError, "is not a size"),
        ({"budget": 1.5}, FullyShardTypeError, "budget must be an int"),
        ({"world_size": 0}, FullyShardValueError, "world_size must be a positive int"),
        ({"world_size": None}, FullyShardValueError, "needs mesh= "),
        ({"allow": ("wrap",)}, FullyShardValueError, "unknown options ['wrap']"),
        ({"optimizer": "lion"}, FullyShardValueError, "optimizer='lion' is not a known layout"),
        ({"example_inputs": (torch.zeros(2, 5),)}, FullyShardValueError, "did not run"),
        ({"example_inputs": [1]}, FullyShardTypeError, "example_inputs must be a tuple"),
        ({"bucket_caps": 25}, FullyShardTypeError, "bucket_caps must be a sequence"),
        ({"bucket_caps": (25, 0)}, FullyShardValueError, "positive, finite size in MiB"),
        ({"param_persistence_threshold": 1.5}, FullyShardTypeError, "must be an int"),
        ({"param_persistence_threshold": -1}, FullyShardValueError, "is negative"),
        ({"param_persistence_threshold": (64, None)}, FullyShardTypeError, "holds None"),
    ],
)
def test_bad_arguments_are_refused_before_anything_changes(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    call: dict[str, Any] = {
        "budget": "1GiB",
        "world_size": 2,
        "example_inputs": (torch.zeros(2, 8),),
    }
    with pytest.raises(error) as info:
        plan(model, **(call | kwargs))
    assert message in str(info.value)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(m).__module__.startswith("torch") for m in model.modules())


def _sharded_rank() -> str:
    model = _model()
    fully_shard(model, mesh=mesh_1d())
    with pytest.raises(FullyShardValueError) as info:
        plan(model, budget="1GiB", world_size=1, example_inputs=(torch.zeros(2, 8),))
    return str(info.value)


def test_sharded_model_is_refused() -> None:
    assert "already sharded" in run_distributed(_sharded_rank, 1)[0]


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_step_temporaries_are_what_torchs_adamw_allocates(foreach: bool) -> None:
    sizes = [100, 300, 50, 7, 300]
    params = [nn.Parameter(torch.randn(n)) for n in sizes]
    optim = torch.optim.AdamW(params, lr=1e-2, foreach=foreach)
    for p in params:
        p.grad = torch.randn_like(p)
    optim.step()  # the state exists from here on, as in every step the planner replays
    tracker = MemTracker()
    tracker.track_external(*params, optim)
    with tracker:
        before = sum(d["Total"] for d in tracker.get_tracker_snapshot().values())
        optim.step()
    peak = max(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())
    assert peak - before == adam_temporaries([(4, 4 * n) for n in sizes], foreach)


def test_parse_bytes() -> None:
    assert parse_bytes("20GiB") == 20 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes(1234) == 1234


def test_budget_shrinking_gives_up_gathered_blocks_first_then_activations() -> None:
    spec = {"vocab": 37, "dim": 16, "layers": 3, "ffn": 40, "tie": False, "frozen": "none"}
    spec |= {"mp": False, "batch": 4}

    model = _build(spec)
    tokens = torch.zeros(4, 16, dtype=torch.long)
    common: dict[str, Any] = {"world_size": 4, "example_inputs": (tokens,), "loss_fn": loss_fn}
    roomy = plan(model, budget="1GiB", **common)
    blocks = [g for g in roomy.groups if g.fqn]
    assert all(g.reshard_after_forward is False and not g.checkpoint for g in blocks)
    try:
        plan(model, budget=1, **common)
    except PlanInfeasibleError as e:
        minimum = e.minimum_bytes
    tight = plan(model, budget=minimum, **common)
    assert tight.peak_bytes < roomy.peak_bytes
    assert tight.step_cost > roomy.step_cost
    assert any(g.checkpoint for g in tight.groups) or tight.offload


def _traces(model: nn.Module, tokens: Tensor, shortened: bool) -> Any:
    """Both traces of ``model`` (plain, checkpointed) as plan() takes them, from the whole
    model or from the replica cut to four blocks of its run of identical ones."""
    names = [f"layers.{i}" for i in range(len(model.layers))]  # type: ignore[arg-type]
    mode = fake_mode()
    replica, mapping = fake_replica(model, lambda d: d, mode)
    owner = {id(p): b for b, n in enumerate(names, 1) for p in model.get_submodule(n).parameters()}
    params = list(model.parameters())
    owners = [owner.get(id(p), 0) for p in params]
    fake_params = [mapping[id(p)] for p in params]
    (args, kwargs) = to_fake(((tokens,), {}), mode)
    trace = partial(run_trace, replica, args, kwargs, loss_fn, mode, None)
    if shortened:
        return trace_shortened(trace, model, replica, names, fake_params, owners, True)
    blocks = [replica.get_submodule(n) for n in names]
    return trace(blocks, fake_params, owners, False), trace(blocks, fake_params, owners, True)


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "transformer", "layers": 7, "frozen": "block", "tie": True, "mp": False},
        {"kind": "mlp", "layers": 6, "frozen": "none", "tie": False, "mp": False},
    ],
)
def test_a_run_of_identical_blocks_is_traced_once_and_gives_the_whole_trace(
    spec: dict[str, Any],
) -> None:
    spec |= {"vocab": 37, "dim": 16, "ffn": 24, "batch": 2, "seq": 8}
    model = _build(spec)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    short = _traces(model, tokens, shortened=True)
    assert short is not None  # the run was found and cut: 4 of its blocks ran, not all
    assert short == _traces(model, tokens, shortened=False)


def test_llama_8b_on_meta_plans_without_allocating() -> None:
    args = ModelArgs(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=4096,
    )
    with torch.device("meta"):
        model = Transformer(args)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 7e9
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    p = plan(
        model,
        budget="80GiB",
        world_size=64,
        example_inputs=(torch.zeros(1, 4096, dtype=torch.long, device="meta"),),
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        loss_fn=loss_fn,
    )
    print(f"planned Llama-3-8B on meta in {time.perf_counter() - start:.1f} s")  # no threshold
    # The parameters alone are 30 GiB in fp32: any real allocation of them shows in the peak
    # RSS. (This test also bounded Python's heap with tracemalloc once, tighter but at four
    # times the run time; planning holds only fake tensors and bookkeeping.)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert rss_growth < 1024 * 2**20
    assert p.peak_bytes <= 80 * 2**30 and len(p.groups) == 33
    assert sum(g.param_count for g in p.groups) == n_params


def test_cli_plans_a_hugging_face_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    # The CLI's main() in this process (`python -m fully_shard.plan` calls just that): a
    # fresh interpreter would add the import of torch and transformers to what it tests.
    from fully_shard.plan.__main__ import main

    argv = ["--config", str(path), "--world-size", "4", "--budget", "64MiB", "--batch", "2"]
    argv += ["--seq", "32", "--mixed-precision", "bf16", "--param-persistence-threshold", "33"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "kept whole on every rank (param_persistence_threshold=33)" in out
    assert "model.layers.2" in out
    assert "predicted peak" in out
