"""Shared pytest configuration: hypothesis profiles, crash stacks, the harness's pool shutdown."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from harness import shutdown_pools

# "ci" (the default) is reproducible: the same examples on every run, no deadline, since a
# distributed example's time depends on the machine more than on the code.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
# "dev" explores new examples each run; select it with HYPOTHESIS_PROFILE=dev.
settings.register_profile(
    "dev",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    max_examples=50,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# One intra-op thread in the test processes too, as in every rank: the pytest workers, their
# ranks and the scripts they launch share 2 cores, and OpenMP threads that spin while waiting
# for work take the cores the ranks wait for. (One run each: 278 s of pytest and 431 s of user
# CPU without, 223 s and 344 s with; later runs with it read 237-275 s, so how much it saves is
# within this box's run-to-run noise.)
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

# Every process a test starts (torchrun ranks, examples, the harness's workers) inherits this:
# a rank that dies of a signal prints its Python stacks, so a crash in CI says where it was.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
