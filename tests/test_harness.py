"""The multi-rank harness: results by rank, errors with their rank, timeouts, a warm pool."""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import harness
from harness import RankError, fresh_pool, mesh_1d, run_distributed


def _all_reduce_rank() -> tuple[float, int, str, int]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item(), dist.get_rank(), os.environ["RANK"], torch.get_num_threads()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_all_reduce_on_every_world_size(world_size: int) -> None:
    results = run_distributed(_all_reduce_rank, world_size)
    total = world_size * (world_size + 1) / 2
    assert results == [(total, r, str(r), 1) for r in range(world_size)]


def _mesh_is_cached(scale: int, *, offset: int) -> tuple[int, int, bool]:
    mesh = mesh_1d()
    return dist.get_rank() * scale + offset, mesh.size(), mesh is mesh_1d()


def test_args_kwargs_and_mesh() -> None:
    assert run_distributed(_mesh_is_cached, 2, 10, offset=1) == [(1, 2, True), (11, 2, True)]


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("bad value on rank one")
    return dist.get_rank()


def test_exception_names_rank_and_traceback() -> None:
    with pytest.raises(RankError) as info:
        run_distributed(_raise_on_rank_one, 3)
    message = str(info.value)
    assert "rank(s) 1 of world size 3" in message
    assert "ValueError: bad value on rank one" in message
    assert "Traceback (most recent call last)" in message
    assert "in _raise_on_rank_one" in message
    assert sorted(info.value.failures) == [1]


def _fail_then_others_wait() -> None:
    if dist.get_rank() == 0:
        raise RuntimeError("rank zero gives up")
    dist.barrier()  # never completes: rank 0 is gone


def test_failure_does_not_wait_for_stuck_ranks() -> None:
    fresh_pool(2)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_distributed(_fail_then_others_wait, 2, timeout=30.0)
    assert time.monotonic() - start < 10.0
    assert info.value.killed == [1]
    assert "rank zero gives up" in str(info.value)


def _skip_collective_on_last_rank() -> None:
    if dist.get_rank() != dist.get_world_size() - 1:
        dist.all_reduce(torch.ones(1))


def test_hang_is_stopped_by_timeout_and_pool_rebuilt() -> None:
    fresh_pool(3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_skip_collective_on_last_rank.*world size 3.*3\.0 s"):
        run_distributed(_skip_collective_on_last_rank, 3, timeout=3.0)
    assert time.monotonic() - start < 10.0
    assert run_distributed(_all_reduce_rank, 3) == [(6.0, r, str(r), 1) for r in range(3)]


def _exit_abruptly() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def test_dead_process_is_reported() -> None:
    fresh_pool(2)
    with pytest.raises(RankError, match="exited with code 3"):
        run_distributed(_exit_abruptly, 2)
    assert run_distributed(_all_reduce_rank, 2)[0][0] == 3.0


def _dtensor_sum() -> float:
    return distribute_tensor(torch.ones(4), mesh_1d(), [Shard(0)]).full_tensor().sum().item()


def test_ranks_leave_with_status_zero_after_dtensor_work() -> None:
    # DTensor's caches keep the process groups alive past destroy_process_group; a process
    # that then finalized the interpreter could abort (fully_shard.demo.leave_rank). A
    # forkserver child never does, and this checks it. A fresh pool: the codes are its own.
    pool = harness._Pool(2)
    try:
        payload = pickle.dumps((_dtensor_sum, (), {}))
        assert pool.run("_dtensor_sum", payload, 60.0) == [4.0, 4.0]
    finally:
        codes = pool.shutdown()
    assert codes == [0, 0]


def test_unpicklable_function_is_rejected_in_the_parent() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_distributed(lambda: None, 2)


def _tiny(i: int) -> int:
    return i + dist.get_rank()


def test_hundred_tiny_jobs_on_a_warm_pool() -> None:
    run_distributed(_tiny, 2, 0)  # make sure the pool is warm
    start = time.perf_counter()
    for i in range(100):
        assert run_distributed(_tiny, 2, i) == [i, i + 1]
    elapsed = time.perf_counter() - start
    print(f"100 tiny jobs on W=2: {elapsed:.3f} s ({elapsed * 10:.2f} ms per job)")
