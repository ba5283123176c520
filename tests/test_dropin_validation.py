"""The catalogue of bad inputs to torch 2.13's ``FSDPModule`` methods and new names.

Each case wraps a fresh model, records every group's ``GroupConfig``, makes the bad call and
checks the exception type (ours, and the builtin torch raises for it) and message, then that
no group's configuration changed and that the model still trains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from fully_shard import (
    DataParallelMeshDims,
    FSDPModule,
    FullyShardError,
    FullyShardNotImplementedError,
    FullyShardTypeError,
    FullyShardValueError,
    fully_shard,
)
from harness import device_mesh, mesh_1d, run_distributed
from models import SmallNet


class _NoAllocate:
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _NotCallable:
    def allocate(self, size: Any, *, dtype: Any, device: Any) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _GoodComm(_NotCallable):
    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def _with_custom_all_gather(model: Any) -> None:
    model.set_custom_all_gather(_GoodComm())


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[Any], object]  # gets the wrapped root
    error: type[FullyShardError]
    builtin: type[Exception]
    match: str
    setup: Callable[[Any], None] | None = None
    hsdp: bool = False


CASES = [
    Case(
        "all_reduce hook not callable",
        lambda m: m.set_all_reduce_hook(3),
        FullyShardTypeError,
        TypeError,
        "callable hook",
    ),
    Case(
        "all_reduce hook stream not a stream",
        lambda m: m.set_all_reduce_hook(print, stream="s"),
        FullyShardTypeError,
        TypeError,
        "torch.Stream",
    ),
    Case(
        "all_reduce hook stream with HSDP",
        lambda m: m.set_all_reduce_hook(print, stream=torch.cpu.Stream()),
        FullyShardValueError,
        ValueError,
        "native HSDP",
        hsdp=True,
    ),
    Case(
        "requires_all_reduce not a bool",
        lambda m: m.set_requires_all_reduce(1),
        FullyShardTypeError,
        TypeError,
        "requires_all_reduce must be a bool",
    ),
    Case(
        "requires_all_reduce recurse not a bool",
        lambda m: m.set_requires_all_reduce(True, recurse="yes"),
        FullyShardTypeError,
        TypeError,
        "recurse must be a bool",
    ),
    Case(
        "divide factor a string",
        lambda m: m.set_gradient_divide_factor("2"),
        FullyShardTypeError,
        TypeError,
        "needs a number",
    ),
    Case(
        "divide factor a bool",
        lambda m: m.set_gradient_divide_factor(True),
        FullyShardTypeError,
        TypeError,
        "needs a number",
    ),
    Case(
        "divide factor zero",
        lambda m: m.set_gradient_divide_factor(0),
        FullyShardValueError,
        ValueError,
        "finite number > 0",
    ),
    Case(
        "divide factor negative",
        lambda m: m.set_gradient_divide_factor(-2.0),
        FullyShardValueError,
        ValueError,
        "finite number > 0",
    ),
    Case(
        "divide factor inf",
        lambda m: m.set_gradient_divide_factor(float("inf")),
        FullyShardValueError,
        ValueError,
        "finite number > 0",
    ),
    Case(
        "deprecated divide factor nan",
        lambda m: m.set_reduce_scatter_divide_factor(float("nan")),
        FullyShardValueError,
        ValueError,
        "finite number > 0",
    ),
    Case(
        "force sum not a bool",
        lambda m: m.set_force_sum_reduction_for_comms(None),
        FullyShardTypeError,
        TypeError,
        "must be a bool",
    ),
    Case(
        "unused params not a bool",
        lambda m: m.set_reduce_scatter_unused_params("no"),
        FullyShardTypeError,
        TypeError,
        "reduce_scatter_unused_params must be a bool",
    ),
    Case(
        "max buffers a float",
        lambda m: m.set_reduce_scatter_max_input_buffers(2.0),
        FullyShardTypeError,
        TypeError,
        "must be an int, got float",
    ),
    Case(
        "max buffers a bool",
        lambda m: m.set_reduce_scatter_max_input_buffers(True),
        FullyShardTypeError,
        TypeError,
        "must be an int, got bool",
    ),
    Case(
        "max buffers zero",
        lambda m: m.set_reduce_scatter_max_input_buffers(0),
        FullyShardValueError,
        ValueError,
        "positive int",
    ),
    Case(
        "separate group not a bool",
        lambda m: m.set_separate_reduce_scatter_group(1),
        FullyShardTypeError,
        TypeError,
        "must be a bool",
    ),
    Case(
        "pg allocation not a bool",
        lambda m: m.set_allocate_memory_from_process_group_for_comm("on"),
        FullyShardTypeError,
        TypeError,
        "must be a bool",
    ),
    Case(
        "pg allocation with a custom all-gather",
        lambda m: m.set_allocate_memory_from_process_group_for_comm(True),
        FullyShardValueError,
        ValueError,
        "cannot be combined with set_custom_all_gather",
        setup=_with_custom_all_gather,
    ),
    Case(
        "symm mem backend not NCCL",
        lambda m: m.set_symm_mem_for_comm("GLOO"),
        FullyShardValueError,
        ValueError,
        "only 'NCCL'",
    ),
    Case(
        "symm mem on gloo",
        lambda m: m.set_symm_mem_for_comm(),
        FullyShardNotImplementedError,
        NotImplementedError,
        "needs an NCCL process group",
    ),
    Case(
        "symm mem with a custom all-gather",
        lambda m: m.set_symm_mem_for_comm(),
        FullyShardValueError,
        ValueError,
        "cannot be combined",
        setup=_with_custom_all_gather,
    ),
    Case(
        "custom all-gather without allocate",
        lambda m: m.set_custom_all_gather(_NoAllocate()),
        FullyShardTypeError,
        TypeError,
        "has no allocate",
    ),
    Case(
        "custom all-gather not callable",
        lambda m: m.set_custom_all_gather(_NotCallable()),
        FullyShardTypeError,
        TypeError,
        "has no __call__",
    ),
    Case(
        "custom reduce-scatter a function",
        lambda m: m.set_custom_reduce_scatter(print),
        FullyShardTypeError,
        TypeError,
        "ReduceScatter",
    ),
    Case(
        "unshard_in_backward not a bool",
        lambda m: m.set_unshard_in_backward(0),
        FullyShardTypeError,
        TypeError,
        "unshard_in_backward must be a bool",
    ),
    Case(
        "post-optim event not an event",
        lambda m: m.set_post_optim_event("event"),
        FullyShardTypeError,
        TypeError,
        "needs a torch.Event",
    ),
]


def _configs(model: nn.Module) -> list[Any]:
    return [m._fsdp_state.group.config for m in model.modules() if isinstance(m, FSDPModule)]


def _run_case(index: int) -> None:
    case = CASES[index]
    mesh = device_mesh((2, 2), ("replicate", "shard")) if case.hsdp else mesh_1d()
    torch.manual_seed(0)
    model = SmallNet()
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if case.setup is not None:
        case.setup(model)
    before = _configs(model)
    with pytest.raises(case.error, match=case.match) as info:
        case.call(model)
    assert isinstance(info.value, case.builtin), f"{case.name}: not a {case.builtin.__name__}"
    after = _configs(model)
    assert after == before, f"{case.name}: a group's configuration changed before the error"
    model(torch.randn(2, 5)).sum().backward()  # still trains


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_bad_method_input(index: int) -> None:
    run_distributed(_run_case, 4 if CASES[index].hsdp else 2, index)


def _dp_mesh_dims_cases() -> None:
    for value, error, builtin, match in (
        # mesh_1d() has no dim names to look "dp" up in (tests/test_dp_mesh_dims.py: the rest)
        (DataParallelMeshDims(shard="dp"), FullyShardValueError, ValueError, "mesh_dim_names"),
        ("dp", FullyShardTypeError, TypeError, "DataParallelMeshDims or None"),
    ):
        model = SmallNet()
        classes = [type(m) for m in model.modules()]
        params = [id(p) for p in model.parameters()]
        with pytest.raises(error, match=match) as info:
            fully_shard(model, mesh=mesh_1d(), dp_mesh_dims=value)  # type: ignore[arg-type]
        assert isinstance(info.value, builtin)
        assert [type(m) for m in model.modules()] == classes
        assert [id(p) for p in model.parameters()] == params
    fully_shard(SmallNet(), mesh=mesh_1d(), dp_mesh_dims=None)


def test_dp_mesh_dims_is_refused_before_any_change() -> None:
    run_distributed(_dp_mesh_dims_cases, 2)


def test_data_parallel_mesh_dims_validation() -> None:
    with pytest.raises(FullyShardValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims(shard=None, replicate=None)
    with pytest.raises(FullyShardTypeError, match="non-empty tuple"):
        DataParallelMeshDims(shard=())
    with pytest.raises(FullyShardTypeError, match="mesh dim name"):
        DataParallelMeshDims(replicate=("a", 1))  # type: ignore[arg-type]
