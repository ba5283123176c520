"""``TorchComm`` on gloo: W broadcasts for an all-gather, an in-place all-reduce (over two
ranks: one exchange of halves) for a reduce-scatter; both must give exactly what torch's own
collectives give, for a sum and an average.

Each case gathers and reduce-scatters rank-dependent data with ``TorchComm`` and with
``torch.distributed``'s ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` and compares
the results bit for bit, over world sizes, sizes (0 and 1 included), dtypes, sync and async,
an input that is (as in the engine) or is not the caller's slice of the output, and the
sub-groups of a 2-D mesh (whose group ranks differ from the global ranks).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fully_shard import TorchComm
from fully_shard.collectives import SUM, Reduction
from harness import device_mesh, run_distributed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _data(n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    return torch.randn(n, generator=g).to(dtype)


def _torch_reference(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup,
    op: str,
    reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    with warnings.catch_warnings():  # the 2.13 deprecation of the *_tensor names
        warnings.simplefilter("ignore", FutureWarning)
        if op == "all_gather":
            dist.all_gather_into_tensor(out, inp, group=group)
        else:
            dist.reduce_scatter_tensor(out, inp, op=reduce_op, group=group)


def _compare(n: int, dtype_name: str, async_op: bool, in_place: bool, mesh_dim: int | None) -> None:
    dtype = DTYPES[dtype_name]
    if mesh_dim is None:
        group = dist.group.WORLD
    else:
        group = device_mesh((2, 2), ("replicate", "shard")).get_group(mesh_dim)
    assert group is not None
    world, rank = group.size(), group.rank()
    comm = TorchComm()

    shard = _data(n, dtype, salt=1)
    ours = torch.full((world * n,), float("nan"), dtype=dtype)
    inp = ours.narrow(0, rank * n, n) if in_place else shard.clone()
    inp.copy_(shard)
    work = comm.all_gather(ours, inp, group, async_op)
    assert (work is None) != async_op, "a handle exactly when async_op"
    if work is not None:
        work.wait()
    want = torch.empty(world * n, dtype=dtype)
    _torch_reference(want, shard, group, "all_gather")
    assert torch.equal(ours, want), f"all_gather differs on rank {dist.get_rank()}"

    full = _data(world * n, dtype, salt=2)
    for reduction, torch_op in ((SUM, dist.ReduceOp.SUM), (Reduction("avg"), dist.ReduceOp.AVG)):
        out = torch.full((n,), float("nan"), dtype=dtype)
        work = comm.reduce_scatter(out, full.clone(), group, reduction, async_op)
        if work is not None:
            work.wait()
        want = torch.empty(n, dtype=dtype)
        _torch_reference(want, full, group, "reduce_scatter", torch_op)
        assert torch.equal(out, want), (
            f"reduce_scatter ({reduction.op}) differs on rank {dist.get_rank()}"
        )


@settings(max_examples=24)
@given(
    world=st.integers(1, 4),
    n=st.sampled_from([0, 1, 7, 1000, 65_537]),
    dtype_name=st.sampled_from(sorted(DTYPES)),
    async_op=st.booleans(),
    in_place=st.booleans(),
)
def test_gloo_collectives_match_torch_exactly(
    world: int, n: int, dtype_name: str, async_op: bool, in_place: bool
) -> None:
    run_distributed(_compare, world, n, dtype_name, async_op, in_place, None)


def test_gloo_collectives_on_2d_mesh_subgroups() -> None:
    # On (replicate, shard) = (2, 2) the shard groups are {0, 1}, {2, 3} and the replicate
    # groups {0, 2}, {1, 3}: broadcast sources must be translated to global ranks.
    for mesh_dim in (0, 1):
        for async_op in (False, True):
            run_distributed(_compare, 4, 333, "float32", async_op, True, mesh_dim)


def test_torch_comm_calls_what_torch_distributed_holds_at_call_time(monkeypatch: Any) -> None:
    # What patches torch.distributed after fully_shard (torch's FSDP2 tests delay and inspect
    # collectives by patching all_gather_single / reduce_scatter_single) reaches ours too.
    calls: list[str] = []
    comm = TorchComm()  # created first, patched after, as a model is sharded before a test
    name_ag = (
        "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    )
    name_rs = (
        "reduce_scatter_single"
        if hasattr(dist, "reduce_scatter_single")
        else "reduce_scatter_tensor"
    )
    monkeypatch.setattr(dist, name_ag, lambda *a, **k: calls.append(name_ag))
    monkeypatch.setattr(dist, name_rs, lambda *a, **k: calls.append(name_rs))
    out, inp = torch.empty(4), torch.empty(2)
    comm._all_gather(out, inp, group=None, async_op=False)
    comm._reduce_scatter(inp, out, op=dist.ReduceOp.SUM, group=None, async_op=False)
    assert calls == [name_ag, name_rs]
