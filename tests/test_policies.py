"""Mixed precision and offload policies: what is cast where, what moves, what it costs.

The sharded parameters stay fp32 master weights; shards are cast to ``param_dtype`` before the
all-gather; gradients are reduced in ``reduce_dtype`` and land in fp32. A bf16 run is compared
twice: loosely against a pure fp32 reference, and tightly (1e-6) against an unsharded
reference that applies the same casts by hand, rank slice by rank slice.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fully_shard import (
    CountingComm,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from harness import mesh_1d, run_distributed
from models import MLPStack
from parity import needs_torch_fsdp2_on_cpu

DIMS = [8, 24, 24, 6]
BF16_FP32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _build() -> MLPStack:
    torch.manual_seed(0)
    return MLPStack(DIMS, activation="tanh")


def _shard(
    model: MLPStack,
    block_mp: MixedPrecisionPolicy,
    root_mp: MixedPrecisionPolicy,
    offload: OffloadPolicy | None = None,
) -> FSDPModule:
    mesh = mesh_1d()
    kw = {} if offload is None else {"offload_policy": offload}
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=block_mp, **kw)
    root = fully_shard(model, mesh=mesh, mp_policy=root_mp, **kw)
    assert isinstance(root, FSDPModule)
    return root


def _batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world, DIMS[0], generator=gen), torch.randn(
        4 * world, DIMS[-1], generator=gen
    )


def _mine(t: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).square().mean()


def _mixed_precision_run(steps: int) -> dict[str, float]:
    world = dist.get_world_size()
    model = _build()
    fp32_ref = copy.deepcopy(model)
    cast_ref = copy.deepcopy(model)  # fp32 masters, bf16 compute applied by hand
    root = _shard(
        model,
        BF16_FP32,
        MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        ),
    )

    seen: list[tuple[torch.dtype, bool]] = []

    def record(module: nn.Module, args: object) -> None:
        w = module.linear.weight
        seen.append((w.dtype, isinstance(w, DTensor)))

    model.layers[1].register_forward_pre_hook(record)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fp32_opt = torch.optim.AdamW(fp32_ref.parameters(), lr=1e-3)
    cast_opt = torch.optim.AdamW(cast_ref.parameters(), lr=1e-3)
    worst = {"vs_fp32_loss": 0.0, "vs_cast_loss": 0.0, "vs_cast_param": 0.0}
    for step in range(steps):
        x, y = _batch(step, world)
        out = root(_mine(x))
        assert out.dtype == torch.float32  # output_dtype
        loss = _mse(out, _mine(y))
        loss.backward()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world

        fp32_loss = _mse(fp32_ref(x), y)
        fp32_loss.backward()

        # The same casts by hand: each rank's slice through a bf16 copy, fp32 grads averaged.
        n = x.shape[0] // world
        cast_loss = torch.zeros(())
        grads = {name: torch.zeros_like(p) for name, p in cast_ref.named_parameters()}
        for r in range(world):
            low = copy.deepcopy(cast_ref).to(torch.bfloat16)
            loss_r = _mse(low(x[r * n : (r + 1) * n].bfloat16()), y[r * n : (r + 1) * n])
            loss_r.backward()
            cast_loss += loss_r.detach() / world
            for name, p in low.named_parameters():
                grads[name] += p.grad.float()
        for name, p in cast_ref.named_parameters():
            p.grad = grads[name] / world

        worst["vs_fp32_loss"] = max(
            worst["vs_fp32_loss"], abs(mean_loss.item() - fp32_loss.item()) / fp32_loss.item()
        )
        worst["vs_cast_loss"] = max(worst["vs_cast_loss"], abs(mean_loss.item() - cast_loss.item()))
        for (name, p), rp in zip(model.named_parameters(), cast_ref.parameters(), strict=True):
            assert isinstance(p, DTensor) and p.dtype == torch.float32, name
            assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32, name
            torch.testing.assert_close(p.grad.full_tensor(), rp.grad, atol=1e-6, rtol=0)
        for o in (opt, fp32_opt, cast_opt):
            o.step()
            o.zero_grad()
    for p, rp in zip(model.parameters(), cast_ref.parameters(), strict=True):
        diff = (p.full_tensor() - rp).abs().max().item()
        worst["vs_cast_param"] = max(worst["vs_cast_param"], diff)
    assert seen and all(s == (torch.bfloat16, False) for s in seen), seen
    return worst


def test_bf16_compute_fp32_reduce_tracks_references() -> None:
    for worst in run_distributed(_mixed_precision_run, 2, 20):
        assert worst["vs_cast_loss"] <= 1e-6, worst
        assert worst["vs_cast_param"] <= 1e-6, worst
        # bf16 keeps ~3 significant digits; the loss stays within 2% of the fp32 run.
        assert worst["vs_fp32_loss"] <= 2e-2, worst


def _all_gather_bytes(param_dtype: torch.dtype | None) -> dict[str, int]:
    model = _build()
    root = _shard(
        model,
        MixedPrecisionPolicy(param_dtype=param_dtype),
        MixedPrecisionPolicy(param_dtype=param_dtype),
    )
    comm = CountingComm()
    root.set_comm(comm)
    x, y = _batch(0, dist.get_world_size())
    _mse(root(_mine(x)), _mine(y)).backward()
    dtypes = {r.dtype for r in comm.records if r.op == "all_gather"}
    assert dtypes == {param_dtype or torch.float32}, dtypes
    return comm.bytes_by_op()


def test_bf16_halves_all_gather_bytes() -> None:
    fp32 = run_distributed(_all_gather_bytes, 3, None)[0]
    bf16 = run_distributed(_all_gather_bytes, 3, torch.bfloat16)[0]
    assert bf16["all_gather"] * 2 == fp32["all_gather"]
    assert bf16["reduce_scatter"] * 2 == fp32["reduce_scatter"]  # reduce_dtype follows


def _grad_error(reduce_dtype: torch.dtype) -> float:
    """L2 distance of one backward's bf16-computed gradients from the fp32 gradients."""
    world = dist.get_world_size()
    model = _build()
    ref = copy.deepcopy(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    root = _shard(model, mp, mp)
    x, y = _batch(7, world)
    _mse(root(_mine(x)), _mine(y)).backward()
    _mse(ref(x), y).backward()
    err = 0.0
    for p, rp in zip(model.parameters(), ref.parameters(), strict=True):
        err += (p.grad.full_tensor() - rp.grad).square().sum().item()
    return err**0.5


def test_fp32_reduction_is_closer_than_bf16() -> None:
    err_fp32 = run_distributed(_grad_error, 4, torch.float32)[0]
    err_bf16 = run_distributed(_grad_error, 4, torch.bfloat16)[0]
    assert err_fp32 < err_bf16, (err_fp32, err_bf16)


def _per_group_policies() -> None:
    # bf16 for the blocks, fp32 (no policy) for the root's own parameters.
    model = _build()
    model.head = nn.Linear(DIMS[-1], 3)
    orig_forward = model.forward
    model.forward = lambda x: model.head(orig_forward(x).float())  # type: ignore[method-assign]
    mesh = mesh_1d()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=BF16_FP32)
    fully_shard(model, mesh=mesh)
    dtypes: dict[str, torch.dtype] = {}
    model.layers[0].register_forward_pre_hook(
        lambda m, a: dtypes.__setitem__("block", m.linear.weight.dtype)
    )
    model.head.register_forward_pre_hook(lambda m, a: dtypes.__setitem__("head", m.weight.dtype))
    model(torch.randn(4, DIMS[0])).sum().backward()
    assert dtypes == {"block": torch.bfloat16, "head": torch.float32}
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad.full_tensor()).all(), name


def test_different_policies_per_group() -> None:
    run_distributed(_per_group_policies, 2)


@dataclass(frozen=True)
class GatherFp16ReduceFp32(MixedPrecisionPolicy):
    """A custom policy: answers the engine's questions in code instead of fields."""

    def compute_dtype(self, orig_dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if orig_dtype == torch.float32 else orig_dtype

    def reduce_dtype_for(self, orig_dtype: torch.dtype) -> torch.dtype:
        return torch.float32

    def forward_input_dtype(self) -> torch.dtype | None:
        return torch.float16


def _custom_policy() -> None:
    model = _build()
    policy = GatherFp16ReduceFp32()
    root = _shard(model, policy, policy)
    comm = CountingComm()
    root.set_comm(comm)
    seen = []
    model.layers[0].register_forward_pre_hook(
        lambda m, args: seen.append((m.linear.weight.dtype, args[0].dtype))
    )
    _mse(root(torch.randn(4, DIMS[0])), torch.randn(4, DIMS[-1])).backward()
    assert seen == [(torch.float16, torch.float16)]
    assert {r.dtype for r in comm.records if r.op == "all_gather"} == {torch.float16}
    assert {r.dtype for r in comm.records if r.op == "reduce_scatter"} == {torch.float32}
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_custom_policy_changes_answers() -> None:
    run_distributed(_custom_policy, 2)


def _default_policy_is_free() -> None:
    model = _build()
    root = _shard(model, MixedPrecisionPolicy(), MixedPrecisionPolicy())
    comm = CountingComm()
    root.set_comm(comm)
    x = torch.randn(4, DIMS[0])
    received = []
    model.layers[0].register_forward_pre_hook(lambda m, args: received.append(args[0]))
    root(x).sum().backward()
    assert received[0] is x  # no cast, not even a copy
    assert {r.dtype for r in comm.records} == {torch.float32}


def test_default_policy_casts_nothing() -> None:
    run_distributed(_default_policy_is_free, 2)


def _offload_run(offload: bool) -> dict[str, torch.Tensor]:
    model = _build()
    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    root = _shard(model, MixedPrecisionPolicy(), MixedPrecisionPolicy(), offload=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = dist.get_world_size()
    for step in range(3):
        x, y = _batch(step, world)
        _mse(root(_mine(x)), _mine(y)).backward()
        if step < 2:
            opt.step()
            opt.zero_grad()
    for p in model.parameters():
        assert p.to_local().device.type == "cpu"
        assert p.grad.to_local().device.type == "cpu"
        for value in opt.state[p].values():
            if isinstance(value, DTensor):
                assert value.to_local().device.type == "cpu"
    out = {f"p{i}": p.full_tensor() for i, p in enumerate(model.parameters())}
    out.update({f"g{i}": p.grad.full_tensor() for i, p in enumerate(model.parameters())})
    return out


def test_cpu_offload_matches_no_offload() -> None:
    # On this CPU-only machine the compute device is the CPU too: what is checked is that the
    # policy keeps every piece of sharded state on the CPU and changes no number.
    plain = run_distributed(_offload_run, 2, False)[0]
    offloaded = run_distributed(_offload_run, 2, True)[0]
    for key, value in plain.items():
        torch.testing.assert_close(offloaded[key], value, rtol=0, atol=0, msg=key)


def _offloaded_dtensor_on_an_accelerator_mesh() -> dict[str, object]:
    # A mesh of device type "cuda" over the gloo group: building it needs no GPU, and it is
    # what an offloaded shard meets on a GPU machine (CPU local tensor, CUDA mesh).
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    from fully_shard._compat import dtensor_from_spec, dtensor_spec

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
    rank = dist.get_rank()
    local = torch.full((3, 4), float(rank))  # this rank's rows of a (6, 4) parameter
    spec = dtensor_spec(mesh, (Shard(0),), torch.Size([6, 4]), (4, 1), torch.float32)
    dt = dtensor_from_spec(local, spec)
    param = nn.Parameter(dt)
    param.grad = dtensor_from_spec(torch.ones(3, 4), spec)
    torch.optim.SGD([param], lr=0.5).step()  # local arithmetic only: no device is touched
    try:  # from_local tries local.to("cuda"): it moves the shard where CUDA exists, else fails
        moved = DTensor.from_local(local, mesh, [Shard(0)], run_check=False).to_local().device.type
    except (AssertionError, RuntimeError) as e:
        moved = str(e)
    return {
        "device": dt.device.type,
        "same_storage": dt.to_local().data_ptr() == local.data_ptr(),
        "shape": tuple(dt.shape),
        "placements": dt.placements,
        "mesh_type": dt.device_mesh.device_type,
        "after_step": param.to_local().tolist(),
        "from_local": moved,
    }


def test_an_offloaded_shard_stays_on_the_cpu_on_an_accelerator_mesh() -> None:
    # The bug a GPU found (torch 2.11, H200): DTensor.from_local moved CPUOffloadPolicy's
    # shards to the mesh's device, so nothing was offloaded, and lazy init then replaced the
    # parameters the optimizer held: they never got a gradient.
    from torch.distributed.tensor import Shard

    for rank, got in enumerate(run_distributed(_offloaded_dtensor_on_an_accelerator_mesh, 2)):
        assert got["device"] == "cpu" and got["same_storage"], got
        assert got["shape"] == (6, 4) and got["placements"] == (Shard(0),), got
        assert got["mesh_type"] == "cuda", got
        assert got["after_step"] == [[rank - 0.5] * 4] * 3, got
        # what the engine must not call on such a shard: it moves it to the GPU (or, on a
        # machine without CUDA such as CI's, fails trying: "...CUDA..." on 2.13, "Found no
        # NVIDIA driver" on a CUDA build of 2.6)
        moved = got["from_local"]
        assert moved == "cuda" or "CUDA" in str(moved) or "NVIDIA" in str(moved), got


class _RecordingLinear(nn.Linear):
    """Records the dtype of every input its forward sees (after the hooks' casts)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.inputs: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(str(x.dtype))
        return super().forward(x)


class _CheckpointedCall(nn.Module):
    """Calls a sharded linear under non-reentrant activation checkpointing and records the
    dtype it returns (after the hooks' casts): once in forward, once in the recomputation."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = _RecordingLinear()
        self.outputs: list[str] = []
        self.dtype = dtype  # what the checkpointed call gets, whatever the root's hooks did

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.outputs.append(str(out.dtype))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        # early_stop=False: the recomputation runs to the end, so its output is recorded too
        return checkpoint(self._inner, x, use_reentrant=False, early_stop=False)  # type: ignore[no-any-return]


def _recompute_dtypes(impl: str, cast: str) -> dict[str, list[str]]:
    shard: Any = fully_shard
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
    if cast == "inputs":  # fp32 inputs cast to bf16, as the parameters
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        dtype = torch.float32
    else:  # bf16 inputs left as they are, outputs cast to fp32
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, output_dtype=torch.float32, cast_forward_inputs=False
        )
        dtype = torch.bfloat16
    torch.manual_seed(0)
    model = _CheckpointedCall(dtype)
    x = torch.randn(2, 4)
    shard(model.linear, mesh=mesh_1d(), mp_policy=policy)
    shard(model, mesh=mesh_1d(), mp_policy=policy)
    model(x).float().sum().backward()
    return {"inputs": model.linear.inputs, "outputs": model.outputs}


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("cast", ["inputs", "outputs"])
def test_checkpoint_recomputation_casts_as_forward_did(cast: str) -> None:
    # forward and its recomputation in backward see and return the same dtypes (torch's
    # test_checkpoint_recompute_casts_*): without the casts the recomputation computes
    # something else, or fails on mixed dtypes
    out = "torch.bfloat16" if cast == "inputs" else "torch.float32"
    want = {"inputs": ["torch.bfloat16"] * 2, "outputs": [out] * 2}
    for impl in ("ours", "torch"):
        for seen in run_distributed(_recompute_dtypes, 2, impl, cast):
            assert seen == want, (impl, seen)


class _TwoStages(nn.Module):
    """Two linears called one after the other, an fp32 op between them (a grouped head)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).float() * 2)  # type: ignore[no-any-return]


def _grouped_input_dtypes() -> dict[str, str]:
    model = _TwoStages()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard([model.a, model.b], mesh=mesh_1d(), mp_policy=mp)
    fully_shard(model, mesh=mesh_1d())
    seen: dict[str, str] = {}
    for name in ("a", "b"):
        model.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, str(args[0].dtype))
        )
    model(torch.randn(2, 4)).sum().backward()
    return seen


def test_grouped_fully_shard_casts_each_modules_inputs() -> None:
    # torch 2.15 documents it: with fully_shard([a, b]) the cast runs before each module's
    # forward, so b's fp32 input (made between the two) is cast too
    got = run_distributed(_grouped_input_dtypes, 1)[0]
    assert got == {"a": "torch.bfloat16", "b": "torch.bfloat16"}, got
