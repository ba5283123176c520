"""The timeline recorder: what ``fully_shard.trace`` records, merges, exports and plots.

One distributed job (``_record_steps``, 2 ranks) shards a ``Transformer`` (root + 2 blocks),
records one training step with each ``reshard_after_forward`` setting and returns rank 0's
gathered recordings; the tests below read them. Expected bytes are computed here from the
model's parameter shapes and DESIGN.md's sharding rule (``ceil(d0 / W)`` rows per rank, fp32),
never from the engine.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fully_shard import CountingComm, FullyShardStateError, FullyShardValueError, fully_shard, trace
from fully_shard.trace import MemorySample, Recording, TraceEvent
from harness import mesh_1d, run_distributed
from models import ModelArgs, Transformer

WORLD = 2
ELEM = 4  # fp32
ARGS = ModelArgs(vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_hidden=40, max_seq_len=8)
GROUPS = ("root", "layers.0", "layers.1")
KINDS = ("forward", "backward", "unshard", "reshard", "all_gather", "reduce_scatter")


def _padded_numel(shape: torch.Size, world: int) -> int:
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def _expected_shard_bytes(world: int) -> dict[str, int]:
    """Each group's all-gather input on one rank: the padded shards of its parameters."""
    model = Transformer(ARGS)
    out = {g: 0 for g in GROUPS}
    for name, p in model.named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        out[group] += _padded_numel(p.shape, world) * ELEM
    return out


def _step(model: nn.Module, gen: torch.Generator) -> None:
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len + 1), generator=gen)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def _record_steps() -> dict[str, Any]:
    """Rank 0: gathered recordings of one step per reshard setting, and the off-path checks."""
    results: dict[str, Any] = {}
    for reshard in (True, False):
        torch.manual_seed(0)
        model = Transformer(ARGS)
        with pytest.raises(FullyShardValueError, match="no fully_shard group"):
            trace.record(model)
        mesh = mesh_1d()
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        comm = CountingComm()
        model.set_comm(comm)  # type: ignore[operator]  # FSDPModule method
        gen = torch.Generator().manual_seed(dist.get_rank())
        _step(model, gen)  # lazy init outside the recording
        groups = [m._fsdp_state.group for m in [model, *model.layers]]
        observers = [g.observers for g in groups]
        with trace.record(model) as rec:
            with pytest.raises(FullyShardStateError, match="already being recorded"):
                trace.record(model).__enter__()
            _step(model, gen)
        # Off again: the groups have their observers and Comm of before, and nothing is added.
        n_events = len(rec.events)
        _step(model, gen)
        results[f"off_{reshard}"] = (
            [g.observers for g in groups] == observers
            and all(g.comm is comm for g in groups)
            and len(rec.events) == n_events
        )
        results[f"reshard_{reshard}"] = trace.gather(rec)
    return results


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    per_rank = run_distributed(_record_steps, WORLD, timeout=120)
    assert all(r[f"reshard_{flag}"] == [] for r in per_rank[1:] for flag in (True, False))
    return per_rank[0]  # type: ignore[no-any-return]


def test_every_rank_records_every_kind_for_every_group(recorded: dict[str, Any]) -> None:
    recordings: list[Recording] = recorded["reshard_True"]
    assert [r.rank for r in recordings] == list(range(WORLD))
    for rec in recordings:
        assert rec.groups == GROUPS
        for group in GROUPS:
            for kind in KINDS:
                events = rec.events_of(kind, group)
                assert events, f"rank {rec.rank}: no {kind} of {group}"
                assert all(e.end_ns >= e.start_ns for e in events)
        # Blocks gather for forward and again for backward; the root stays gathered.
        assert len(rec.events_of("all_gather", "layers.0")) == 2
        assert len(rec.events_of("all_gather", "root")) == 1


def test_collective_bytes_match_the_padded_shards(recorded: dict[str, Any]) -> None:
    expected = _expected_shard_bytes(WORLD)
    for rec in recorded["reshard_True"]:
        for group in GROUPS:
            assert {e.nbytes for e in rec.events_of("all_gather", group)} == {expected[group]}
            # The reduce-scatter input is the whole padded gradient: W shards.
            rs = rec.events_of("reduce_scatter", group)
            assert [e.nbytes for e in rs] == [WORLD * expected[group]]
            assert {e.nbytes for e in rec.events_of("unshard", group)} == {WORLD * expected[group]}


def test_memory_timeline_follows_resharding(recorded: dict[str, Any]) -> None:
    expected = _expected_shard_bytes(WORLD)
    unsharded = {g: WORLD * b for g, b in expected.items()}
    replica = sum(unsharded.values())
    for rec in recorded["reshard_True"]:
        assert rec.replica_bytes == replica
        assert rec.memory[0].unsharded_bytes == 0  # sharded before the step
        assert rec.memory[-1].unsharded_bytes == 0  # and after it
        # The root stays gathered while one block at a time is gathered and freed.
        peak = rec.peak_unsharded_bytes()
        assert unsharded["root"] + unsharded["layers.0"] <= peak < replica
    for rec in recorded["reshard_False"]:
        assert rec.peak_unsharded_bytes() == replica  # everything gathered after forward
        assert rec.memory[-1].unsharded_bytes == 0


def test_recorder_off_leaves_the_engine_as_it_was(recorded: dict[str, Any]) -> None:
    assert recorded["off_True"] and recorded["off_False"]


def _check_nesting(spans: list[tuple[float, float]]) -> None:
    """Spans on one Chrome thread must be disjoint or nested (a stack)."""
    stack: list[float] = []
    for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
        while stack and stack[-1] <= start:
            stack.pop()
        assert not stack or end <= stack[-1], f"span {start}..{end} overlaps its parent"
        stack.append(end)


def test_chrome_trace_is_valid_json_with_ranks_as_processes(
    recorded: dict[str, Any], tmp_path: Any
) -> None:
    path = trace.write_chrome_trace(tmp_path / "trace.json", recorded["reshard_True"])
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(WORLD)}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["ts"] >= 0 and e["dur"] >= 0
    for rank in range(WORLD):
        for group in GROUPS:
            seen = {e["cat"] for e in spans if e["pid"] == rank and e["args"]["group"] == group}
            assert seen >= set(KINDS), f"rank {rank} {group}: {sorted(seen)}"
        tids = {e["tid"] for e in spans if e["pid"] == rank}
        threads = {e["tid"] for e in events if e["name"] == "thread_name" and e["pid"] == rank}
        assert tids == threads  # every track is named
        for tid in tids:
            _check_nesting(
                [
                    (e["ts"], e["ts"] + e["dur"])
                    for e in spans
                    if e["pid"] == rank and e["tid"] == tid
                ]
            )
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["pid"] for e in counters} == set(range(WORLD))


def _event(start: int, end: int) -> TraceEvent:
    return TraceEvent("all_gather", "g", start, end)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=30))
def test_lanes_hold_only_nested_or_disjoint_spans(raw: list[tuple[int, int]]) -> None:
    events = sorted((_event(s, s + d) for s, d in raw), key=lambda e: (e.start_ns, -e.end_ns))
    lanes = trace._lanes(events)
    assert len(lanes) == len(events)
    for lane in set(lanes):
        _check_nesting(
            [(e.start_ns, e.end_ns) for e, i in zip(events, lanes, strict=True) if i == lane]
        )


def test_overlapping_spans_get_a_second_lane() -> None:
    events = [_event(0, 10), _event(2, 4), _event(5, 15), _event(20, 30)]
    assert trace._lanes(events) == [0, 0, 1, 0]


def test_plot_memory_writes_a_png(recorded: dict[str, Any], tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    path = trace.plot_memory(tmp_path / "memory.png", recorded["reshard_True"])
    header = path.read_bytes()[:8]
    assert header == b"\x89PNG\r\n\x1a\n"


def test_plot_memory_without_matplotlib_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    rec = Recording(0, ("root",), (), (MemorySample(0, 0),), replica_bytes=0)
    how = r"pip install matplotlib .*pip install -e '\.\[plot\]'"  # both install ways
    with pytest.raises(ModuleNotFoundError, match=how):
        trace.plot_memory(tmp_path / "memory.png", [rec])
    assert not (tmp_path / "memory.png").exists()
