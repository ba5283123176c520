"""Prefetch: the next group's all-gather is in flight before it is needed, numbers unchanged.

From the second iteration on, a group that starts its forward issues the next group's
all-gather (recorded order), and a group that starts its backward issues the one before it.
These tests observe that (a group's state at a moment inside another group's work), check
the explicit ``set_modules_to_*_prefetch`` lists and their validation, check that a group
prefetched but skipped by control flow is freed, and run parity with prefetching on, off
and explicit.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from fully_shard import (
    CountingComm,
    FSDPModule,
    FullyShardTypeError,
    FullyShardValueError,
    fully_shard,
)
from fully_shard.group import GroupState
from harness import mesh_1d, run_distributed
from models import MLPStack, ModelArgs, Transformer
from parity import check_parity, make_float_batch, make_token_batch, wrap_layers_then_root

DIMS = [6, 9, 5, 7, 4]


def _model() -> MLPStack:
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    wrap_layers_then_root(fully_shard)(model, mesh_1d())
    return model


def _state(module: nn.Module) -> GroupState:
    assert isinstance(module, FSDPModule)
    return module._fsdp_state.group.state


def _mode(model: nn.Module, mode: str) -> None:
    """Set the prefetch mode on every block: implicit (default), off, or two ahead."""
    layers = list(model.get_submodule("layers"))
    for i, block in enumerate(layers):
        assert isinstance(block, FSDPModule)
        if mode == "off":
            block.set_modules_to_forward_prefetch([])
            block.set_modules_to_backward_prefetch([])
        elif mode == "two-ahead":
            block.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
            block.set_modules_to_backward_prefetch(layers[max(0, i - 2) : i][::-1])


class _StateSpy(CountingComm):
    """Records every group's state at the moment each reduce-scatter is issued."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = layers
        self.at_reduce: list[list[GroupState]] = []

    def reduce_scatter(
        self, output: Tensor, input: Tensor, group: Any, reduction: Any, async_op: bool
    ) -> Any:
        self.at_reduce.append([_state(m) for m in self.layers])
        return super().reduce_scatter(output, input, group, reduction, async_op)


def _observe(mode: str) -> dict[str, Any]:
    model = _model()
    layers = list(model.layers)
    _mode(model, mode)
    seen_forward: list[list[GroupState]] = []
    for block in layers:
        # runs inside the block's forward, after its own all-gather was waited for
        block.linear.register_forward_pre_hook(
            lambda *_: seen_forward.append([_state(m) for m in layers])
        )
    x = torch.randn(3, DIMS[0])
    model(x).sum().backward()  # first iteration records the order
    seen_forward.clear()
    spy = _StateSpy(layers)
    assert isinstance(model, FSDPModule)
    model.set_comm(spy)
    model(x).sum().backward()
    after = [_state(m) for m in layers]
    return {
        "forward": [[s.name for s in row] for row in seen_forward],
        "reduce": [[s.name for s in row] for row in spy.at_reduce],
        "after": [s.name for s in after],
        "counts": spy.count_by_op(),
    }


def _in_flight(name: str) -> bool:
    return name in ("UNSHARDING", "UNSHARDED")


@pytest.mark.parametrize("mode", ["implicit", "off", "two-ahead"])
def test_prefetch_issues_the_next_all_gather_early(mode: str) -> None:
    n = len(DIMS) - 1
    ahead = {"implicit": 1, "off": 0, "two-ahead": 2}[mode]
    for seen in run_distributed(_observe, 2, mode):
        # same number of collectives whatever the mode: prefetch moves them, adds none
        assert seen["counts"] == {"all_gather": 2 * n, "reduce_scatter": n}
        assert seen["after"] == ["SHARDED"] * n
        for i, row in enumerate(seen["forward"]):
            for j in range(i + 1, n):
                assert _in_flight(row[j]) == (j - i <= ahead), (mode, i, j, row)
        # reduce-scatters come in backward order: block n-1 first
        for k, row in enumerate(seen["reduce"]):
            i = n - 1 - k
            for j in range(i):
                assert _in_flight(row[j]) == (i - j <= ahead), (mode, i, j, row)


def _skipped_block_is_freed() -> list[str]:
    model = _model()
    x = torch.randn(3, DIMS[0])
    model(x).sum().backward()
    # layers[2] is prefetched by layers[1] but does not run: replace the model's forward
    layers = list(model.layers)

    def skip_two(inp: Tensor) -> Tensor:
        for i, block in enumerate(layers):
            if i != 2:
                inp = block(inp) if i != 3 else block(torch.zeros(inp.size(0), DIMS[3]))
        return inp

    with torch.no_grad():
        model.forward = skip_two  # type: ignore[method-assign]
        out = model(x)
    assert out.shape == (3, DIMS[-1])
    return [_state(m).name for m in layers]


def test_a_prefetched_group_that_does_not_run_is_freed_after_forward() -> None:
    for states in run_distributed(_skipped_block_is_freed, 2):
        assert states == ["SHARDED"] * (len(DIMS) - 1)


def _bad_prefetch_lists() -> list[str]:
    model = _model()
    block = model.layers[0]
    assert isinstance(block, FSDPModule)
    messages = []
    for bad, error in (
        (model.layers[1], FullyShardTypeError),  # not a list
        ([nn.Linear(2, 2)], FullyShardTypeError),  # not sharded
        ([block], FullyShardValueError),  # itself
    ):
        with pytest.raises(error) as info:
            block.set_modules_to_forward_prefetch(bad)  # type: ignore[arg-type]
        messages.append(str(info.value))
        with pytest.raises(error):
            block.set_modules_to_backward_prefetch(bad)  # type: ignore[arg-type]
    assert block._fsdp_state.forward_prefetch is None  # nothing was set by a bad call
    return messages


def test_bad_prefetch_lists_are_rejected() -> None:
    messages = run_distributed(_bad_prefetch_lists, 1)[0]
    assert "list of FSDPModules" in messages[0]
    assert "not a module fully_shard was applied to" in messages[1]
    assert "its own group" in messages[2]


def _parity(mode: str, model_name: str) -> dict[str, Any]:
    def shard(model: nn.Module, mesh: Any) -> None:
        wrap_layers_then_root(fully_shard)(model, mesh)
        _mode(model, mode)

    if model_name == "mlp":
        build = functools.partial(MLPStack, DIMS, activation="tanh")
        batch = functools.partial(make_float_batch, in_dim=DIMS[0], out_dim=DIMS[-1])
    else:
        args = ModelArgs(n_layers=3, tie_embeddings=True)
        build = functools.partial(Transformer, args)
        batch = functools.partial(make_token_batch, vocab_size=args.vocab_size)
    return dict(check_parity(build, shard, batch, mesh_1d(), steps=5))


@pytest.mark.parametrize("model_name", ["mlp", "transformer"])
@pytest.mark.parametrize("mode", ["implicit", "off", "two-ahead"])
def test_parity_with_prefetch_on_off_and_explicit(mode: str, model_name: str) -> None:
    for stats in run_distributed(_parity, 2, mode, model_name):
        assert stats["max_loss_diff"] <= 1e-5 and stats["max_param_diff"] <= 1e-5
