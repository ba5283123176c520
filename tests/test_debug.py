"""The collective checker (``fully_shard.debug``): divergence raises on every rank, never hangs.

Each scenario makes one rank diverge inside ``check_collectives`` and asserts that every rank
that reaches the check raises ``FullyShardDesyncError`` within the timeout plus a few seconds,
that the message names the diverging groups, and that after ``reset_iter_state()`` the model
trains again. Every job has a hard timeout (the harness's), so no test can hang. Without a
divergence, training with checking on is bit-identical to checking off.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from fully_shard import FullyShardDesyncError, FullyShardValueError, debug, fully_shard
from fully_shard.observer import JOB_WIDE
from harness import mesh_1d, run_distributed
from models import MLPBlock

DIMS = (6, 8, 8, 8, 8)  # equal widths: a block can be skipped, and equal sizes pair up
ROWS = 2
TIMEOUT = 3.0  # the checker's, seconds
JOB_TIMEOUT = 60.0  # the harness's hard limit per job


class Net(nn.Module):
    """A root that owns ``stem``; one group per block. ``skip`` blocks are not run."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIMS[0], DIMS[1])
        self.layers = nn.ModuleList(
            MLPBlock(a, b, activation="tanh") for a, b in itertools.pairwise(DIMS[1:])
        )
        self.skip: set[int] = set()
        self.raise_in: int | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.stem(x))
        for i, layer in enumerate(self.layers):
            if i in self.skip:
                continue
            h = layer(h)
            if i == self.raise_in:
                raise ValueError(f"rank {dist.get_rank()} fails in layers.{i}")
        return h


def _model() -> Net:
    torch.manual_seed(0)
    model = Net()
    for block in model.layers:
        fully_shard(block, mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    return model


def _batch(step: int) -> Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(world * ROWS, DIMS[0], generator=torch.Generator().manual_seed(step))
    return x[rank * ROWS : (rank + 1) * ROWS]


def _step(model: nn.Module, step: int, micro_batches: int = 1) -> None:
    for i in range(micro_batches):
        model.set_requires_gradient_sync(i == micro_batches - 1)  # type: ignore[operator]
        model(_batch(step)).pow(2).mean().backward()


def _full_params(model: nn.Module) -> list[Tensor]:
    return [
        p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for p in model.parameters()
    ]


def _diverge(scenario: str) -> dict[str, Any]:
    """Run one step with ``scenario`` on the last rank; return what this rank saw."""
    model = _model()
    odd = dist.get_rank() == dist.get_world_size() - 1
    _step(model, 0)  # a clean step first: lazy init, the recorded prefetch order
    error: str | None = None
    raised_after = 0.0
    with debug.check_collectives(timeout=TIMEOUT):
        start = time.monotonic()
        try:
            if scenario == "skip_block":
                model.skip = {1} if odd else set()
                _step(model, 1)
            elif scenario == "frozen":
                if odd:
                    model.layers[0].linear.weight.requires_grad_(False)
                _step(model, 1)
            elif scenario == "leaves_step":
                # The odd rank raises in a forward, catches it and goes on to the next step.
                model.raise_in = 1 if odd else None
                try:
                    _step(model, 1)
                except ValueError:
                    model.reset_iter_state()  # type: ignore[operator]
                    model.raise_in = None
                    _step(model, 2)
            elif scenario == "micro_batches":
                _step(model, 1, micro_batches=1 if odd else 2)
            elif scenario == "stays_out":
                # The odd rank raises and then does nothing until well past the timeout.
                model.raise_in = 1 if odd else None
                try:
                    _step(model, 1)
                except ValueError:
                    time.sleep(TIMEOUT + 3)
                    error = "left"
            else:
                raise AssertionError(scenario)
        except FullyShardDesyncError as e:
            error = str(e)
            raised_after = time.monotonic() - start
    model.reset_iter_state()  # type: ignore[operator]
    model.skip, model.raise_in = set(), None
    for p in model.parameters():
        p.requires_grad_(True)
        p.grad = None
    dist.barrier()
    _step(model, 3)  # usable again: a clean step on every rank
    return {"error": error, "after": raised_after, "params": _full_params(model)}


def _labels(message: str) -> list[str]:
    return [part.split("'")[1] for part in message.split(" of '")[1:]]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scenario", ["skip_block", "frozen", "leaves_step", "micro_batches"])
def test_a_diverging_rank_makes_every_rank_raise(scenario: str, world: int) -> None:
    results = run_distributed(_diverge, world, scenario, timeout=JOB_TIMEOUT)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not raise in {scenario}"
        assert r["after"] < TIMEOUT + 5, r
        assert f"rank {rank}: collectives diverged" in r["error"]
        labels = _labels(r["error"])  # this rank's call, then every other rank's
        assert len(labels) == world, r["error"]
        assert len(set(labels)) > 1 or "shape" in r["error"], r["error"]
    if scenario == "skip_block":
        # The odd rank is at layers.2 where the others are at layers.1.
        assert "'layers.1'" in results[0]["error"] and "'layers.2'" in results[0]["error"]
    if scenario == "frozen":
        assert "reduce_scatter of 'layers.0'" in results[0]["error"]
    # After reset_iter_state() every rank trains the same clean step again.
    for r in results[1:]:
        for a, b in zip(r["params"], results[0]["params"], strict=True):
            torch.testing.assert_close(a, b)


def test_a_rank_that_stays_away_is_named_with_its_last_call() -> None:
    results = run_distributed(_diverge, 2, "stays_out", timeout=JOB_TIMEOUT)
    waiting, away = results
    assert away["error"] == "left"
    message = waiting["error"]
    assert message is not None and waiting["after"] < TIMEOUT + 5
    assert f"did not arrive within {TIMEOUT:g} s (its last call: #" in message
    # It raised in layers.1's forward, after that forward had prefetched layers.2.
    assert "(its last call: #4 all_gather of 'layers.2'" in message


def _bit_identical() -> tuple[list[Tensor], list[Tensor]]:
    runs = []
    for checked in (False, True):
        model = _model()
        with debug.check_collectives(timeout=TIMEOUT) if checked else _null():
            for step in range(3):
                _step(model, step, micro_batches=2)
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p -= 0.1 * p.grad
                        p.grad = None
        runs.append(_full_params(model))
    assert JOB_WIDE.observers == ()
    return runs[0], runs[1]


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def test_training_with_checking_on_is_bit_identical_to_checking_off() -> None:
    for off, on in run_distributed(_bit_identical, 3, timeout=JOB_TIMEOUT):
        for a, b in zip(off, on, strict=True):
            assert torch.equal(a, b)


def test_bad_timeouts_are_refused_before_anything_is_switched_on() -> None:
    for bad in (0, -1.0, "5", True):
        with (
            pytest.raises(FullyShardValueError, match="timeout"),
            debug.check_collectives(timeout=bad),  # type: ignore[arg-type]
        ):
            pass
    assert JOB_WIDE.observers == ()


def _diverge_with_checking_from_the_environment() -> tuple[str, bool]:
    """A job whose checking the environment switched on: what this rank saw, and whether
    checking was off before the job's first ``fully_shard`` call.

    On a warm pool worker the variable is set in the rank (as a launcher sets it for every
    rank of a job), and the checker that ``fully_shard`` installs is taken out again after.
    """
    env = {debug.ENV_ON: "1", debug.ENV_TIMEOUT: str(TIMEOUT)}
    off_before = JOB_WIDE.observers == ()
    try:
        with mock.patch.dict(os.environ, env):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
            for layer in model:
                fully_shard(layer, mesh=mesh_1d())
            fully_shard(model, mesh=mesh_1d())  # the first call switches checking on
        x = torch.randn(2, 4)
        try:
            if dist.get_rank() == 1:
                model[1](model[0](x))  # a different call sequence than rank 0's
            else:
                model(x)
            seen = "no error"
        except FullyShardDesyncError as e:
            seen = f"desync: {e}"
    finally:
        for observer in JOB_WIDE.observers:
            if isinstance(observer, debug.CollectiveChecker):
                observer.close()
        JOB_WIDE.observers = ()
    return seen, off_before


def test_the_environment_variable_turns_checking_on_for_a_whole_job() -> None:
    results = run_distributed(_diverge_with_checking_from_the_environment, 2, timeout=JOB_TIMEOUT)
    for rank, (seen, off_before) in enumerate(results):
        assert off_before, f"rank {rank}: checking was on before the job"
        assert seen.startswith(f"desync: rank {rank}: collectives diverged"), seen
