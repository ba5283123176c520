"""Container and copy behaviours of a sharded model, side by side with torch's ``fully_shard``.

- Slicing a sharded ``nn.Sequential`` (``model[1:]``) gives a plain ``nn.Sequential`` of the
  same (sharded) children, as torch's does; indexing (``model[0]``) gives the child itself.
  The slice runs: its output and gradients equal the unsharded slice's (and ours then still
  runs the whole model; torch's refuses that, its slice's first block having become a root).
- ``copy.deepcopy`` of a sharded module is refused (torch refuses it too, with an
  ``AssertionError``): ours raises ``FullyShardCopyError``, also an ``AssertionError``, and
  leaves the model usable.
- ``fully_shard(nn.ModuleList(...))``: a container whose forward never runs would never be
  gathered; torch raises ``ValueError``, ours ``FullyShardValueError`` (a ``ValueError``).
- A non-contiguous parameter (a transposed view made a ``Parameter``): torch raises
  ``NotImplementedError``; ours accepts it, so it must train at parity with an unsharded
  reference (``check_parity``: initial values exact, losses, gradients and parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, tests only

from fully_shard import FSDPModule, FullyShardCopyError, FullyShardValueError, fully_shard
from harness import mesh_1d, run_distributed
from parity import check_parity, make_float_batch, needs_torch_fsdp2_on_cpu

pytestmark = needs_torch_fsdp2_on_cpu

IMPLS: dict[str, Callable[..., Any]] = {"ours": fully_shard, "torch": torch_fully_shard}


def _sequential(impl: str) -> tuple[nn.Sequential, nn.Sequential]:
    """(sharded, unsharded copy) of a 3-block Sequential: each block, then the root."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])
    reference = copy.deepcopy(model)
    for block in model:
        IMPLS[impl](block, mesh=mesh_1d())
    IMPLS[impl](model, mesh=mesh_1d())
    return model, reference


def _slicing(impl: str) -> None:
    model, reference = _sequential(impl)
    tail = model[1:]
    assert type(tail) is nn.Sequential, f"{impl}: model[1:] is a {type(tail).__mro__}"
    assert list(tail) == [model[1], model[2]]  # the same sharded children, not copies
    assert model[0] is model._modules["0"]
    assert isinstance(model[0], FSDPModule) == (impl == "ours")  # torch's FSDPModule differs
    x = torch.randn(4, 6)
    out, want = tail(x), reference[1:](x)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.sum().backward()
    want.sum().backward()
    for (name, p), ref in zip(tail.named_parameters(), reference[1:].parameters(), strict=True):
        assert p.grad is not None, f"{impl}: {name} got no gradient"
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6)
    if impl == "ours":
        # Ours still runs the whole model after its slice did; torch's refuses ("FSDP state
        # has already been lazily initialized"): the slice's first block became a root.
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_slicing_a_sharded_sequential_gives_a_plain_sequential(impl: str) -> None:
    run_distributed(_slicing, 2, impl)


def _deepcopy(impl: str) -> None:
    model, reference = _sequential(impl)
    holder = nn.ModuleDict({"inner": model})  # a plain module holding a sharded one
    for target in (model, model[0], holder):
        with pytest.raises(AssertionError) as info:
            copy.deepcopy(target)
        if impl == "ours":
            assert isinstance(info.value, FullyShardCopyError)
            assert "load_state_dict" in str(info.value)
    # Refusing changed nothing: the model trains as before.
    x = torch.randn(4, 6)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["ours", "torch"])
def test_deepcopy_of_a_sharded_module_is_refused_like_torch(impl: str) -> None:
    run_distributed(_deepcopy, 2, impl)


def _module_list() -> None:
    for container in (
        nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]),
        nn.ModuleDict({"a": nn.Linear(4, 4)}),
    ):
        with pytest.raises(ValueError) as theirs:
            torch_fully_shard(copy.deepcopy(container), mesh=mesh_1d())
        before = [p for p in container.parameters()]
        with pytest.raises(FullyShardValueError, match="forward is never called") as ours:
            fully_shard(container, mesh=mesh_1d())
        assert isinstance(ours.value, type(theirs.value))
        assert not isinstance(container, FSDPModule)
        assert list(container.parameters()) == before  # nothing was sharded
        # The fix the message gives: shard each module.
        for m in container.values() if isinstance(container, nn.ModuleDict) else container:
            fully_shard(m, mesh=mesh_1d())
            m(torch.randn(2, 4)).sum().backward()


def test_a_container_without_forward_is_refused_like_torch() -> None:
    run_distributed(_module_list, 2)


class Transposed(nn.Module):
    """Two layers whose weights are transposed views (non-contiguous) made Parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 7)
        self.first.weight = nn.Parameter(torch.randn(5, 7).t())  # (7, 5), strides (1, 7)
        self.layers = nn.ModuleList([nn.Linear(7, 3)])
        self.layers[0].weight = nn.Parameter(torch.randn(7, 3).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers[0](torch.tanh(self.first(x)))
        return out


def _non_contiguous(world: int) -> None:
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        torch_fully_shard(Transposed(), mesh=mesh_1d())
    model = Transposed()
    assert not model.first.weight.is_contiguous()

    def shard(m: nn.Module, mesh: Any) -> None:
        fully_shard(m.layers[0], mesh=mesh)
        fully_shard(m, mesh=mesh)

    check_parity(
        Transposed,
        shard,
        partial(make_float_batch, in_dim=5, out_dim=3),
        mesh_1d(),
        optimizer="adamw",
        steps=3,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_a_non_contiguous_parameter_trains_at_parity(world: int) -> None:
    run_distributed(_non_contiguous, world, world)
