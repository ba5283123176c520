"""Run an example script inside a rank of the warm pool, as ``torchrun`` would run it.

Under ``torchrun`` each example costs fresh interpreters that import torch; here the script
runs as ``__main__`` (``runpy``, its command line in ``sys.argv``) in a rank of
``harness.py``'s pool, whose process group already exists: the script must join it with
``fully_shard.init_distributed()`` (which keeps an existing group), ``init_process_group`` is
refused and ``destroy_process_group`` is a no-op. Used by test_docs and by the tests of the
larger examples (2-D, 3-D, per-parameter meshes).
"""

from __future__ import annotations

import contextlib
import io
import runpy
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

import fully_shard

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(script: str, argv: list[str]) -> str:
    """Inside a rank: run ``examples/<script>`` as ``__main__``; return what it printed."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # as torchrun does: the script's folder first
    torch._dynamo.reset()  # compile.py: no graphs cached from an earlier job on this worker
    out = io.StringIO()
    refuse = AssertionError(f"{script} calls init_process_group; join with init_distributed()")
    joined = mock.Mock(wraps=fully_shard.init_distributed)
    with (
        mock.patch.object(sys, "argv", [str(EXAMPLES / script), *argv]),
        mock.patch.object(dist, "init_process_group", side_effect=refuse),
        mock.patch.object(dist, "destroy_process_group"),  # the pool's group stays up
        mock.patch.object(fully_shard, "init_distributed", joined),
        contextlib.redirect_stdout(out),
    ):
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    if not joined.called:
        raise AssertionError(f"{script} never called fully_shard.init_distributed()")
    return out.getvalue()
