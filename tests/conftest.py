"""Shared pytest configuration: hypothesis profiles, crash stacks, the harness's pool shutdown."""

from __future__ import annotations

import os

import pytest
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

# Every process a test starts (torchrun ranks, examples, the harness's workers) inherits this:
# a rank that dies of a signal prints its Python stacks, so a crash in CI says where it was.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_pools()
