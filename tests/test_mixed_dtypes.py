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


# -- torch 2.15's param_dtype_override_fn: fp32 parameters inside a bf16 group -----------------

MIX_DIM, MIX_ROWS = 6, 3


class Mixer(nn.Module):
    """A linear-attention-like block: a bf16 projection and fp32 ``A_log`` / ``dt_bias``."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(MIX_DIM, MIX_DIM)
        self.A_log = nn.Parameter(torch.randn(MIX_DIM) * 0.1)
        self.dt_bias = nn.Parameter(torch.randn(MIX_DIM) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x)  # bf16 in, bf16 weight
        return x + (h.float() * torch.exp(self.A_log) + self.dt_bias).to(h.dtype)


class MixerLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Mixer() for _ in range(2))
        self.lm_head = nn.Linear(MIX_DIM, 2)  # kept in fp32 inside the bf16 root group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x.float())  # type: ignore[no-any-return]


def _compute_dtype(name: str) -> torch.dtype:
    """What the model computes ``name`` in: fp32 for A_log, dt_bias and the head, else bf16."""
    kept = name.endswith(("A_log", "dt_bias")) or name.startswith("lm_head.")
    return torch.float32 if kept else torch.bfloat16


def _train_mixed_compute(compiled: bool) -> dict[str, Any]:
    """Two AdamW steps of a bf16 model that keeps A_log, dt_bias and lm_head in fp32, beside an
    unsharded replica holding each parameter in that compute dtype, run on the same rows, its
    fp32 gradients averaged over the ranks (what the reduce-scatter computes)."""
    from fully_shard import MixedPrecisionPolicy

    world, rank = dist.get_world_size(), dist.get_rank()
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MixerLM()
    reference = copy.deepcopy(model)
    for name, p in reference.named_parameters():
        p.data = p.data.to(_compute_dtype(name))
    kept = {id(p) for n, p in model.named_parameters() if _compute_dtype(n) == torch.float32}
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=lambda p: p.dtype if id(p) in kept else None,
    )
    for layer in model.layers:
        fully_shard(layer, mesh=mesh_1d(), mp_policy=mp)
    fully_shard(model, mesh=mesh_1d(), mp_policy=mp)
    comm = CountingComm()
    if not compiled:  # the graph path traces torch's collectives, not a Python Comm
        model.set_comm(comm)  # type: ignore[operator]
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    diffs: list[float] = []
    for _ in range(2):
        x = torch.randn(world * MIX_ROWS, MIX_DIM, generator=gen)
        mine = x[rank * MIX_ROWS : (rank + 1) * MIX_ROWS]
        run(mine).square().mean().backward()
        reference(mine.to(torch.bfloat16)).square().mean().backward()
        for name, p in model.named_parameters():
            ref_grad = reference.get_parameter(name).grad
            assert ref_grad is not None and p.grad is not None, name
            avg = ref_grad.float()
            dist.all_reduce(avg)
            diffs.append((p.grad.full_tensor() - avg / world).abs().max().item())  # type: ignore[attr-defined]
            assert p.grad.dtype == torch.float32, name  # the sharded grad: the master's dtype
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # the replica computes with the stepped masters' casts
            for name, p in reference.named_parameters():
                p.copy_(model.get_parameter(name).full_tensor().to(p.dtype))  # type: ignore[operator]
                p.grad = None
    gathers = {str(r.dtype) for r in comm.records if r.op == "all_gather"}
    sharded = [model, *model.layers]
    for m in sharded:
        m.unshard()  # type: ignore[operator]
    shown = {n: str(model.get_parameter(n).dtype) for n, _ in reference.named_parameters()}
    for m in sharded:
        m.reshard()  # type: ignore[operator]
    return {"diffs": diffs, "shown": shown, "gathers": gathers}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
def test_fp32_params_inside_a_bf16_group_train_like_the_reference(compiled: bool) -> None:
    got = run_distributed(_train_mixed_compute, 2, compiled, timeout=300)
    for rank in got:
        assert max(rank["diffs"]) < 1e-6, rank["diffs"]
    shown = got[0]["shown"]
    assert shown["layers.0.A_log"] == shown["lm_head.weight"] == "torch.float32", shown
    assert shown["layers.0.in_proj.weight"] == "torch.bfloat16", shown
    if not compiled:  # eager: one all-gather per group, a block's bf16 and fp32 bytes in one
        # uint8 buffer; the root (lm_head alone, kept fp32) in fp32
        assert got[0]["gathers"] == {"torch.uint8", "torch.float32"}, got[0]["gathers"]


def _refused_overrides() -> list[tuple[str, str, bool]]:
    """(error class, message, module unchanged) for each bad override, on one rank."""
    from fully_shard import FullyShardError, MixedPrecisionPolicy

    bf16 = torch.bfloat16
    cases = [
        MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=lambda p: torch.float16),
        MixedPrecisionPolicy(param_dtype=bf16, param_dtype_override_fn=lambda p: "fp32"),  # type: ignore[arg-type,return-value]
    ]
    out = []
    for i in range(3):
        model = Mixer()
        mp = (
            cases[i]
            if i < 2
            else MixedPrecisionPolicy(
                # A_log keeps fp32 beside bf16 ones, and no reduce_dtype gives the group one
                param_dtype=bf16,
                param_dtype_override_fn=lambda p, m=model: p.dtype if p is m.A_log else None,
            )
        )
        before = {n: p for n, p in model.named_parameters()}
        try:
            fully_shard(model, mesh=mesh_1d(), mp_policy=mp)
        except FullyShardError as e:
            after = dict(model.named_parameters())
            unchanged = type(model) is Mixer and all(after[n] is p for n, p in before.items())
            out.append((type(e).__name__, str(e), unchanged))
        else:
            out.append(("", "no error", False))
    return out


def test_bad_param_dtype_override_is_refused_before_the_module_changes() -> None:
    from fully_shard import MixedPrecisionPolicy

    got = run_distributed(_refused_overrides, 1)[0]
    (cls0, msg0, same0), (cls1, msg1, same1), (cls2, msg2, same2) = got
    assert cls0 == "FullyShardValueError" and "torch.float16" in msg0 and "'A_log'" in msg0
    assert cls1 == "FullyShardArgumentTypeError" and "'fp32'" in msg1
    assert cls2 == "FullyShardValueError" and "reduce_dtype" in msg2, msg2
    assert same0 and same1 and same2
    with pytest.raises(TypeError, match="param_dtype_override_fn must be a callable"):
        MixedPrecisionPolicy(param_dtype_override_fn=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # keyword-only, as torch's
        MixedPrecisionPolicy(None, None, None, True, lambda p: None)  # type: ignore[call-arg,misc]
