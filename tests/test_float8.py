"""torchao float8 training through the all-gather extension: about 1 byte per weight element.

``convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=
True))`` makes every ``nn.Linear`` a ``Float8Linear`` whose weight is torchao's
``WeightWithDynamicFloat8CastTensor``: its ``fsdp_pre_all_gather`` casts this rank's rows to
float8 (the scale from the amax over all ranks, or the one
``precompute_float8_dynamic_scale_for_fsdp`` stored), and the post hook wraps the gathered
bytes as the ``Float8TrainingTensor`` the matmul uses. So the sharded model computes with the
same float8 weight an unsharded float8 model casts for itself.

The reference is an unsharded copy of the converted model that runs every rank's batch
separately and averages the gradients (what the reduce-scatter computes): float8 scales the
activations per tensor, so one pass over the global batch would quantize them differently.
W = 2 (even) and 3 (uneven: torchao returns this rank's rows, which we pad; torch's FSDP2
refuses them). Bytes counted with ``CountingComm``.

On gloo, which has no float8 type, the bytes travel as ``uint8``; torch's own FSDP2 sends a
group of float8 weights as float8 and gloo raises "Invalid scalar type" (shown below).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fully_shard import CountingComm, fully_shard
from harness import mesh_1d, run_distributed
from parity import needs_torch_fsdp2_on_cpu

pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install -e '.[test]')")

DIMS = (32, 64, 32, 16)  # float8 matmuls want multiples of 16
ROWS = 4  # batch rows per rank


class MLP(nn.Module):
    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(DIMS[0], DIMS[1], bias=bias), nn.Linear(DIMS[1], DIMS[2], bias=bias)]
        )
        self.head = nn.Linear(DIMS[2], DIMS[3], bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)  # type: ignore[no-any-return]


def _float8_model(bias: bool = True) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = MLP(bias)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config)


def _shard(model: nn.Module, shard_fn: Any) -> None:
    for layer in model.layers:  # type: ignore[union-attr]
        shard_fn(layer, mesh=mesh_1d())
    shard_fn(model, mesh=mesh_1d())


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t``'s global value (torchao's weight subclass unwrapped)."""
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    inner = getattr(t, "_tensor", None)  # WeightWithDynamicFloat8CastTensor's fp32 data
    return (inner if isinstance(inner, torch.Tensor) else t).clone()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def _train(steps: int, precompute: bool) -> dict[str, Any]:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    world, rank = dist.get_world_size(), dist.get_rank()
    model = _float8_model()
    reference = copy.deepcopy(model)
    _shard(model, fully_shard)
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    scales_ok: list[bool] = []  # precompute found our weight and stored the right scale
    scales_used: list[bool] = []  # and the next forward computed with that very scale
    precomputed: dict[str, torch.Tensor] = {}
    used: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if hasattr(m, "weight") and name:
            m.register_forward_pre_hook(
                lambda m, args, name=name: used.__setitem__(f"{name}.weight", m.weight._scale)
            )
    params, ref_params = dict(model.named_parameters()), dict(reference.named_parameters())
    for step in range(steps):
        x = torch.randn(world * ROWS, DIMS[0], generator=gen)
        y = torch.randn(world * ROWS, DIMS[3], generator=gen)
        mine = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = F.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        scales_used += [used[name] is scale for name, scale in precomputed.items()]
        ref_losses = []
        for r in range(world):  # every rank's batch on its own, then the average gradient
            rows = slice(r * ROWS, (r + 1) * ROWS)
            ref_loss = F.mse_loss(reference(x[rows]), y[rows])
            ref_loss.backward()
            ref_losses.append(ref_loss.detach())
        for p in ref_params.values():
            p.grad.div_(world)  # type: ignore[union-attr]
        diffs["loss"] = max(diffs["loss"], _max_diff(loss.detach(), ref_losses[rank]))
        for name, p in params.items():
            grad = _full(p.grad)  # type: ignore[arg-type]
            diffs["grad"] = max(diffs["grad"], _max_diff(grad, ref_params[name].grad))  # type: ignore[arg-type]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if precompute and step < steps - 1:
            precompute_float8_dynamic_scale_for_fsdp(model)
            for name, p in params.items():
                if not name.endswith("weight"):
                    continue
                local = p._local_tensor  # type: ignore[attr-defined]  # where torchao puts it
                want = torch.finfo(torch.float8_e4m3fn).max / ref_params[name].detach().abs().max()
                scale = getattr(local, "_precomputed_scale", None)
                scales_ok.append(
                    isinstance(local, WeightWithDynamicFloat8CastTensor)
                    and scale is not None
                    and torch.allclose(scale, want.float(), rtol=1e-6, atol=0)
                )
                if scale is not None:
                    precomputed[name] = scale
    for name, p in params.items():
        diffs["param"] = max(diffs["param"], _max_diff(_full(p), ref_params[name].detach()))
    return {
        "diffs": diffs,
        "scales_ok": scales_ok,
        "scales_used": scales_used,
        "gathers": [(str(r.dtype), r.nbytes) for r in comm.records if r.op == "all_gather"],
    }


def _padded(shape: tuple[int, ...], itemsize: int, world: int) -> int:
    return math.ceil(shape[0] / world) * math.prod(shape[1:]) * itemsize


@pytest.mark.parametrize("precompute", [False, True], ids=["amax-all-reduce", "precomputed"])
@pytest.mark.parametrize("world", [2, 3])
def test_float8_trains_like_an_unsharded_float8_model(world: int, precompute: bool) -> None:
    steps = 3
    results = run_distributed(_train, world, steps, precompute, timeout=180)

    def group(d_in: int, d_out: int) -> tuple[int, int]:
        """(bytes, elements) one rank sends for a Float8Linear: float8 weight, fp32 bias."""
        nbytes = _padded((d_out, d_in), 1, world) + _padded((d_out,), 4, world)
        return nbytes, _padded((d_out, d_in), 1, world) + _padded((d_out,), 1, world)

    head, l0, l1 = group(DIMS[2], DIMS[3]), group(DIMS[0], DIMS[1]), group(DIMS[1], DIMS[2])
    order = [head, l0, l1, l1, l0]  # forward: root, layers; backward: layers in reverse
    for got in results:
        assert got["diffs"]["loss"] <= 1e-5, got["diffs"]
        assert got["diffs"]["grad"] <= 1e-5, got["diffs"]
        assert got["diffs"]["param"] <= 1e-5, got["diffs"]
        assert got["scales_ok"] == ([True] * 3 * (steps - 1) if precompute else [])
        assert got["scales_used"] == got["scales_ok"]
        # every gather is one uint8 buffer of float8 weight bytes and fp32 bias bytes
        assert got["gathers"] == [("torch.uint8", nbytes) for nbytes, _ in order] * steps
        per_element = sum(b for b, _ in order) / sum(e for _, e in order)
        assert per_element < 1.25, per_element


def _forward_backward(impl: str) -> str:
    """float8 weights without biases: a group whose only gathered dtype is float8."""
    model = _float8_model(bias=False)
    reference = copy.deepcopy(model)
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        _shard(model, torch_fully_shard)
    else:
        _shard(model, fully_shard)
    x = torch.randn(ROWS, DIMS[0])
    try:
        out = model(x)
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    out.sum().backward()
    return f"max |sharded - unsharded| = {_max_diff(out.detach(), reference(x).detach())}"


@needs_torch_fsdp2_on_cpu
def test_on_gloo_float8_travels_as_bytes_where_torch_fsdp2_fails() -> None:
    assert run_distributed(_forward_backward, 2, "ours") == ["max |sharded - unsharded| = 0.0"] * 2
    # torch's FSDP2 all-gathers an all-float8 group in float8, which gloo has no type for
    assert (
        run_distributed(_forward_backward, 2, "torch") == ["RuntimeError: Invalid scalar type"] * 2
    )
