"""Mixed dtypes in one group: frozen parameters of another dtype beside trainable fp32 ones.

A group whose gathered dtypes differ (a frozen float8 or bf16 weight, an int8 buffer-like
parameter, next to fp32 ones) is all-gathered as one ``uint8`` buffer, each parameter's shard
viewed as its bytes, as torch 2.13 does; float8 travels as ``uint8`` even alone (gloo has no
float8). A group of one dtype keeps gathering in that dtype.

Parity: W = 2 and 3, AdamW, against an unsharded replica, and against torch's ``fully_shard``
where it runs. The frozen weights' shapes are uneven over the ranks and their byte sizes odd,
so the fp32 parameters after them start at byte offsets no fp32 tensor can start at.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fully_shard import CountingComm, fully_shard
from harness import mesh_1d, run_distributed
from parity import needs_torch_fsdp2_on_cpu, step_beside_reference

DIM = 5
LOCAL_ROWS = 2
FROZEN_DTYPES = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}


class MixedBlock(nn.Module):
    """``tanh(linear(x)) + 0.1 * x @ frozen^T * scale``: a frozen weight of another dtype
    (registered first, so the fp32 ones follow it in the group) and an int8 frozen scale."""

    def __init__(self, frozen_dtype: torch.dtype) -> None:
        super().__init__()
        frozen = torch.randn(DIM, DIM)  # 25 elements: an odd byte count in any 1-byte dtype
        if not frozen_dtype.is_floating_point:
            frozen = frozen.mul(4).round()
        self.frozen = nn.Parameter(frozen.to(frozen_dtype), requires_grad=False)
        self.scale = nn.Parameter(torch.tensor([1, 2, 3], dtype=torch.int8), requires_grad=False)
        self.linear = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.frozen.to(x.dtype)
        s = self.scale.to(x.dtype).mean()
        return torch.tanh(self.linear(x)) + 0.1 * s * (x @ w.T)


class MixedModel(nn.Module):
    def __init__(self, frozen_dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MixedBlock(frozen_dtype) for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # type: ignore[no-any-return]


def _placement_fn(dim: int) -> Any:
    return None if dim == 0 else (lambda p: Shard(dim) if p.dim() == 2 else None)


def _shard(model: MixedModel, impl: str, shard_dim: int) -> None:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard_fn
    else:
        shard_fn = fully_shard
    for block in model.layers:
        shard_fn(block, mesh=mesh_1d(), shard_placement_fn=_placement_fn(shard_dim))
    shard_fn(model, mesh=mesh_1d())


def _portable(t: torch.Tensor) -> torch.Tensor:
    """A copy that pickles to the test process: float8 tensors (which do not) as their bytes."""
    t = t.detach()
    if t.dtype.is_floating_point and t.dtype.itemsize == 1:
        return t.contiguous().view(torch.uint8).clone()
    return t.clone()


def _gathered_values(model: nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """Every block parameter's (dtype, full value), read from the unsharded module."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, block in model.named_modules():
        if hasattr(block, "frozen"):
            block.unshard()  # type: ignore[operator]
            for pname, p in block.named_parameters(recurse=False):
                out[f"{name}.{pname}"] = (str(p.dtype), _portable(p))
            block.reshard()  # type: ignore[operator]
    return out


def _train(impl: str, frozen: str, shard_dim: int, steps: int) -> dict[str, Any]:
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MixedModel(FROZEN_DTYPES[frozen])
    reference = copy.deepcopy(model)
    _shard(model, impl, shard_dim)
    comm = CountingComm()
    if impl == "ours":
        model.set_comm(comm)  # type: ignore[operator]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    losses, ref_losses = [], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(world * LOCAL_ROWS, DIM, generator=gen)
        y = torch.randn(world * LOCAL_ROWS, 3, generator=gen)
        loss, ref_loss = step_beside_reference(model, opt, reference, ref_opt, (x, y), LOCAL_ROWS)
        losses.append(loss)
        ref_losses.append(ref_loss)
    params = dict(model.named_parameters())
    out: dict[str, Any] = {
        "losses": torch.stack(losses),
        "ref_losses": torch.stack(ref_losses),
        # full_tensor() of a float8 DTensor would need a float8 all-gather, which gloo lacks
        "trainable": {
            n: p.full_tensor()  # type: ignore[attr-defined]
            for n, p in params.items()
            if p.requires_grad
        },
        "frozen_local": {
            n: _portable(p.to_local())  # type: ignore[attr-defined]
            for n, p in params.items()
            if not p.requires_grad
        },
        "ref": {n: _portable(p) for n, p in reference.named_parameters()},
        "ref_dtypes": {n: str(p.dtype) for n, p in reference.named_parameters()},
        "records": [(r.op, str(r.dtype), r.nbytes) for r in comm.records],
    }
    if impl == "ours":
        out["gathered"] = _gathered_values(model)
        out["placements"] = {n: tuple(p.placements) for n, p in params.items()}  # type: ignore[attr-defined]
    return out


def _chunk(t: torch.Tensor, dim: int, world: int, rank: int) -> torch.Tensor:
    pieces = torch.chunk(t, world, dim=dim)
    return pieces[rank] if rank < len(pieces) else t.narrow(dim, 0, 0)


def _check_against_reference(results: list[dict[str, Any]], shard_dim: int) -> None:
    world = len(results)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["losses"], got["ref_losses"], atol=1e-6, rtol=1e-5)
        for name, p in got["trainable"].items():
            torch.testing.assert_close(p, got["ref"][name], atol=1e-6, rtol=1e-5, msg=name)
        for name, local in got["frozen_local"].items():
            ref = got["ref"][name]
            dim = shard_dim if ref.dim() == 2 else 0
            assert torch.equal(local, _chunk(ref, dim, world, rank)), name
        for name, (dtype, full) in got.get("gathered", {}).items():
            # bit-exact: the values went through the byte buffer and back
            assert dtype == got["ref_dtypes"][name], name
            assert torch.equal(full, got["ref"][name]), name


@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("frozen", sorted(FROZEN_DTYPES))
@pytest.mark.parametrize("world", [2, 3])
def test_frozen_params_of_another_dtype_train_like_the_reference(
    world: int, frozen: str, shard_dim: int
) -> None:
    results = run_distributed(_train, world, "ours", frozen, shard_dim, 3)
    _check_against_reference(results, shard_dim)


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("frozen", ["bfloat16", "int8"])
def test_mixed_group_matches_torch_fully_shard(frozen: str) -> None:
    ours = run_distributed(_train, 2, "ours", frozen, 0, 3)[0]
    ref = run_distributed(_train, 2, "torch", frozen, 0, 3)[0]
    torch.testing.assert_close(ours["losses"], ref["losses"], atol=1e-6, rtol=1e-5)
    for name, p in ref["trainable"].items():
        torch.testing.assert_close(ours["trainable"][name], p, atol=1e-6, rtol=1e-5, msg=name)


def _padded_bytes(shape: tuple[int, ...], dtype: torch.dtype, world: int) -> int:
    rows = math.ceil(shape[0] / world)
    return rows * math.prod(shape[1:]) * dtype.itemsize


def test_a_mixed_group_gathers_bytes_and_a_plain_group_its_own_dtype() -> None:
    world = 2
    got = run_distributed(_train, world, "ours", "float8_e4m3fn", 0, 1)[0]
    gathers = [(dtype, nbytes) for op, dtype, nbytes in got["records"] if op == "all_gather"]
    block = (
        _padded_bytes((DIM, DIM), torch.float8_e4m3fn, world)
        + _padded_bytes((3,), torch.int8, world)
        + _padded_bytes((DIM, DIM), torch.float32, world)
        + _padded_bytes((DIM,), torch.float32, world)
    )
    head = _padded_bytes((3, DIM), torch.float32, world) + _padded_bytes((3,), torch.float32, world)
    # forward: the root (head), block 0, block 1; backward: block 1, block 0 (the root keeps
    # its copy). Each block: one uint8 all-gather of every parameter's padded bytes; the
    # root's plain fp32 group gathers in fp32.
    assert gathers == [
        ("torch.float32", head),
        ("torch.uint8", block),
        ("torch.uint8", block),
        ("torch.uint8", block),
        ("torch.uint8", block),
    ]


def _float8_only() -> dict[str, Any]:
    torch.manual_seed(0)
    lin = nn.Linear(DIM, 3)
    lin.weight = nn.Parameter(lin.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    lin.bias = nn.Parameter(lin.bias.detach().to(torch.float8_e4m3fn), requires_grad=False)
    want = {n: p.detach().clone() for n, p in lin.named_parameters()}
    fully_shard(lin, mesh=mesh_1d())
    comm = CountingComm()
    lin.set_comm(comm)  # type: ignore[operator]
    lin.unshard()  # type: ignore[operator]
    exact = all(
        not isinstance(p, DTensor)
        and p.dtype == torch.float8_e4m3fn
        and torch.equal(p.view(torch.uint8), want[n].view(torch.uint8))
        for n, p in lin.named_parameters()
    )
    return {"exact": exact, "dtypes": [str(r.dtype) for r in comm.records]}


def test_a_float8_only_group_travels_as_bytes() -> None:
    for got in run_distributed(_float8_only, 2):
        assert got == {"exact": True, "dtypes": ["torch.uint8"]}
