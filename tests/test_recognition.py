"""Recognised as an FSDP2 module by the code that checks for one, without delegating to it.

Libraries test ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (torch's pipelining,
Accelerate's ``fsdp2_prepare_model``, torch's ``FSDPMemTracker``, code written against torch
such as torch's ``test_old_import_training``). Ours passes once torch's FSDP package is loaded,
every method staying ours; importing and using ``fully_shard`` never loads torch's package.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

import fully_shard as ours
from fully_shard import FullyShardNotImplementedError, fully_shard
from harness import mesh_1d, run_distributed

# Plain class plumbing every class has; the rest of torch's FSDPModule must be shadowed.
_PLUMBING = {"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__", "__firstlineno__"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    fully_shard(model[0], mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    return model


def _recognised() -> dict[str, Any]:
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed._composable.fsdp import FSDPModule as OldImport
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    model = _model()
    got: dict[str, Any] = {
        "isinstance": [isinstance(m, torch_fsdp.FSDPModule) for m in (model, model[0])],
        "old_import": isinstance(model, OldImport),
        # torch's class last, after the module's own (nn.Sequential, nn.Module): no super()
        # call of ours (``_apply``) or of the module's reaches torch's code.
        "ours_first": type(model).__mro__[-2:] == (torch_fsdp.FSDPModule, object)
        and type(model).__mro__[1:3] == (ours.FSDPModule, nn.Sequential),
        "plain_child": isinstance(model[1], torch_fsdp.FSDPModule),
        # Accelerate keeps a model that already is an FSDP2 module (no accelerator is read).
        "accelerate_keeps": fsdp2_prepare_model(None, model) is model,
        # torch's pipelining reads the reduction entry points off fully_shard.state(...).
        "state_view": type(torch_fsdp.fully_shard.state(model)).__name__,  # type: ignore[attr-defined]
    }
    try:
        with FSDPMemTracker(model, torch.optim.SGD(model.parameters(), lr=0.1)):
            pass
    except FullyShardNotImplementedError as e:
        got["mem_tracker"] = str(e)
    # Still trains after all that (one step, the gradients reduced over both ranks), also
    # after to() (our _apply, which calls nn.Module's).
    model.to(torch.float32)
    model(torch.randn(2, 4)).sum().backward()
    got["grads"] = [p.grad is not None for p in model.parameters()]
    return got


def test_recognised_by_torch_pipelining_accelerate_and_old_imports() -> None:
    for got in run_distributed(_recognised, 2):
        assert got["isinstance"] == [True, True]
        assert got["old_import"] and got["ours_first"] and got["accelerate_keeps"]
        assert not got["plain_child"]
        assert got["state_view"] == "TorchStateView"
        assert "MemTracker" in got["mem_tracker"] and "fully_shard" in got["mem_tracker"]
        assert got["grads"] == [True] * 4


# What a library that imported torch's names at import time holds: torch's own objects.
TORCH_FSDP_MODULE, TORCH_FULLY_SHARD = torch_fsdp.FSDPModule, torch_fsdp.fully_shard


def _library_shards(model: nn.Sequential) -> list[bool]:
    """A library that imports torch's FSDP2 names when it runs (after the user's redirect)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import fully_shard as shard

    shard(model[0], mesh=mesh_1d())
    shard(model, mesh=mesh_1d())
    return [isinstance(m, FSDPModule) for m in (model, model[0], model[1])]


def _redirected() -> dict[str, Any]:
    torch_fsdp.fully_shard, torch_fsdp.FSDPModule = ours.fully_shard, ours.FSDPModule
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
        got: dict[str, Any] = {"late_import": _library_shards(model)}
        got["early_import"] = isinstance(model, TORCH_FSDP_MODULE)
        got["bases"] = type(model).__mro__.count(ours.FSDPModule)
        model(torch.randn(2, 4)).sum().backward()
        got["grads"] = [p.grad is not None for p in model.parameters()]
        # torch's pipelining reduces a stage through `fully_shard.state(stage)` of the
        # fully_shard it imported: with the names rebound, ours must answer it.
        model.zero_grad()
        model.set_requires_gradient_sync(False)
        model(torch.randn(2, 4)).sum().backward()
        got["kept"] = [p.grad is None for p in model.parameters()]
        model.set_requires_gradient_sync(True)
        view = torch_fsdp.fully_shard.state(model)
        for state in view._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        view._root_post_backward_final_callback()
        got["reduced"] = [p.grad is not None for p in model.parameters()]
    finally:
        torch_fsdp.fully_shard, torch_fsdp.FSDPModule = TORCH_FULLY_SHARD, TORCH_FSDP_MODULE
    return got


def test_a_library_redirected_to_ours_shards_with_it() -> None:
    """``torch.distributed.fsdp.fully_shard = fully_shard.fully_shard`` (and ``FSDPModule``):
    a library that imports the names when it runs gets ours and recognises the result, one
    that imported torch's before the redirect still recognises it as torch's FSDPModule."""
    for got in run_distributed(_redirected, 2):
        assert got["late_import"] == [True, True, False]
        assert got["early_import"] and got["bases"] == 1
        assert got["grads"] == [True] * 4
        assert got["kept"] == [True] * 4 and got["reduced"] == [True] * 4


def test_no_method_of_torch_fsdp_module_is_reached() -> None:
    """Every name torch's FSDPModule defines is defined by ours, which comes first in the MRO,
    so being recognised never runs torch's code."""
    theirs = set(vars(torch_fsdp.FSDPModule)) - _PLUMBING - {"_orig_cls_mro_index"}
    missing = sorted(theirs - set(vars(ours.FSDPModule)))
    assert missing == [], f"torch's FSDPModule names ours does not shadow: {missing}"


def test_fully_shard_never_imports_torch_fsdp() -> None:
    """Rule 1: no module of ours imports torch's FSDP package, and importing ours loads none of
    it. (Sharding does load it on torch 2.13, through torch itself: ``torch.compiler.disable``
    on our hooks imports dynamo, which imports torch's FSDP to recognise its hooks. So ours is
    recognised whatever the user imported, in whichever order.)"""
    src = Path(ours.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+torch\.distributed\.(fsdp|_composable)", re.M)
    # every module, the subpackages' (plan/, optim/) too
    offenders = [
        str(p.relative_to(src)) for p in src.rglob("*.py") if pattern.search(p.read_text())
    ]
    assert offenders == []
    script = "import sys, fully_shard; print('torch.distributed.fsdp' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False"], out.stdout + out.stderr
