"""``QuantizationPolicy(all_gather="int8")``: the block-quantized all-gather, end to end.

What the policy promises, each checked here:

- parity: gradients, losses and parameters after several AdamW steps equal those of an
  unsharded reference that computes with the same quantize-dequantize of each rank's padded
  shard (blocks within the flat shard) and keeps fp32 masters (1e-6); at W = 2 and W = 3
  (uneven shards), ``reshard_after_forward`` True / False / 2 (W = 4), bf16 compute, Shard(1),
  HSDP, prefetch, gradient accumulation and activation checkpointing;
- the error bound inside the engine: every gathered element is within half its block's step
  of its fp32 master, on adversarial blocks (zeros, one outlier, tiny and subnormal values),
  in fp32 and in bf16 compute;
- bytes: ``CountingComm`` counts exactly int8 values + 4 bytes per block scale (+ the plain
  parameters' bytes), and at block 256 that is <= 0.27 of the fp32 all-gather's;
- the small and 1-D parameters, integer and float8 frozen ones, travel unquantized;
- checkpoints hold the fp32 masters only;
- bad inputs raise our errors before anything changes.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from fully_shard import (
    CountingComm,
    FSDPModule,
    FullyShardTypeError,
    FullyShardValueError,
    MixedPrecisionPolicy,
    QuantizationPolicy,
    fully_shard,
)
from fully_shard.quantize import (
    PLAIN,
    dequantize_blocks,
    int8_gather_nbytes,
    quantize_blocks,
)
from harness import device_mesh, mesh_1d, run_distributed
from models import MLPStack

DIMS = [24, 40, 33, 8]  # over 3 ranks: 14/14/12 and 3/3/2 rows, blocks straddle rows
FP32_EPS = torch.finfo(torch.float32).eps


# -- the reference: what every rank's gathered parameter must be -------------------------------


def gathered_reference(
    full: Tensor, world: int, dim: int, policy: QuantizationPolicy, dtype: torch.dtype
) -> Tensor:
    """``full`` as a ``world``-rank int8 all-gather rebuilds it, derived independently.

    Split like ``torch.chunk`` on ``dim`` into ``ceil(d / world)``-row chunks, each padded with
    zero rows, flattened, quantized block by block, dequantized to ``dtype``, put back.
    """
    d = full.size(dim)
    chunk = math.ceil(d / world)
    padded_shape = list(full.shape)
    padded_shape[dim] = chunk
    if not policy.quantizes(full.shape, full.dtype, math.prod(padded_shape)):
        return full.to(dtype)
    pieces = []
    for r in range(world):
        start = min(r * chunk, d)
        rows = full.narrow(dim, start, min(chunk, d - start))
        padded = full.new_zeros(padded_shape)
        padded.narrow(dim, 0, rows.size(dim)).copy_(rows)
        q, s = quantize_blocks(padded.flatten(), policy.block_size)
        pieces.append(dequantize_blocks(q, s, policy.block_size, dtype).view(padded_shape))
    return torch.cat(pieces, dim).narrow(dim, 0, d)


@dataclass(frozen=True)
class Case:
    """One configuration of the parity run (picklable: it goes to every rank)."""

    block: int = 16
    reshard: bool | int = True
    bf16: bool = False
    shard_dim: int = 0
    hsdp: bool = False
    grad_accum: int = 1
    prefetch: bool = False
    activation_checkpointing: bool = False
    steps: int = 4


def _mesh(case: Case) -> DeviceMesh:
    if case.hsdp:
        return device_mesh((2, dist.get_world_size() // 2), ("replicate", "shard"))
    return mesh_1d()


def _policy(case: Case) -> QuantizationPolicy:
    return QuantizationPolicy(all_gather="int8", block_size=case.block)


def _checkpointed(block: nn.Module) -> None:
    inner = block.forward

    def forward(x: Tensor) -> Tensor:
        out: Tensor = checkpoint(inner, x, use_reentrant=False)
        return out

    block.forward = forward  # type: ignore[method-assign]  # the instance's own forward


def _shard(model: MLPStack, case: Case, mesh: DeviceMesh) -> None:
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if case.bf16
        else MixedPrecisionPolicy()
    )
    placement = None if case.shard_dim == 0 else (lambda p: Shard(1) if p.dim() > 1 else None)
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp,
        "quantization_policy": _policy(case),
        "shard_placement_fn": placement,
    }
    for block in model.layers:
        if case.activation_checkpointing:
            _checkpointed(block)
        fully_shard(block, reshard_after_forward=case.reshard, **options)
    fully_shard(model, **options)
    if case.prefetch:
        layers = list(model.layers)
        for i, block in enumerate(layers):
            block.set_modules_to_forward_prefetch(layers[i + 1 : i + 2])  # type: ignore[operator]
            block.set_modules_to_backward_prefetch(layers[max(0, i - 1) : i])  # type: ignore[operator]


def _batch(step: int, rows: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, DIMS[0], generator=gen), torch.randn(rows, DIMS[-1], generator=gen)


def _mse(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out.float(), target)


def _parity_run(case: Case) -> dict[str, float]:
    """Train sharded (int8 gathers) and the reference side by side; the worst differences."""
    mesh = _mesh(case)
    data_world, data_rank = dist.get_world_size(), dist.get_rank()  # every rank: its own rows
    shard_world = mesh.size(mesh.ndim - 1)
    compute = torch.bfloat16 if case.bf16 else torch.float32
    policy = _policy(case)
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    reference = copy.deepcopy(model)  # fp32 masters; computes with gathered_reference(...)
    _shard(model, case, mesh)
    quantized = sum(
        p.gather_format(m._fsdp_state.group.config.quantization_policy) is not PLAIN
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for p in m._fsdp_state.group.params
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    b, k = 2, case.grad_accum
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0, "quantized": float(quantized), "moved": 0.0}
    for step in range(case.steps):
        x, y = _batch(step, data_world * k * b)

        # Sharded: this rank's k micro-batches; gradient sync only on the last.
        loss = torch.zeros((), dtype=torch.float64)
        for micro in range(k):
            model.set_requires_gradient_sync(micro == k - 1)  # type: ignore[operator]
            lo = (data_rank * k + micro) * b
            micro_loss = _mse(model(x[lo : lo + b]), y[lo : lo + b]) / k
            micro_loss.backward()
            loss += micro_loss.detach().double()
        dist.all_reduce(loss)
        loss /= data_world

        # Reference: per data rank, a copy computing with the gathered weights; the ranks'
        # gradients (summed over micro-batches in fp32 first, as the engine keeps them)
        # averaged in fp32.
        ref_loss = 0.0
        grads = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
        for r in range(data_world):
            low = copy.deepcopy(reference)
            with torch.no_grad():
                for n, p in low.named_parameters():
                    master = dict(reference.named_parameters())[n]
                    dim = case.shard_dim if master.dim() > 1 else 0
                    p.data = gathered_reference(master, shard_world, dim, policy, compute)
                    worst["moved"] = max(worst["moved"], (p.float() - master).abs().max().item())
            per_rank = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
            for micro in range(k):
                lo = (r * k + micro) * b
                out = low(x[lo : lo + b].to(compute))
                micro_loss = _mse(out, y[lo : lo + b]) / k
                micro_loss.backward()
                ref_loss += micro_loss.item() / data_world
                for n, p in low.named_parameters():
                    assert p.grad is not None
                    per_rank[n] += p.grad.float()
                    p.grad = None
            for n in grads:
                grads[n] += per_rank[n]
        for n, p in reference.named_parameters():
            p.grad = grads[n] / data_world

        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss))
        for (n, p), ref_p in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert isinstance(p, DTensor) and p.dtype == torch.float32, n
            assert isinstance(p.grad, DTensor) and p.grad.dtype == torch.float32, n
            assert ref_p.grad is not None
            diff = (p.grad.full_tensor() - ref_p.grad).abs().max().item()
            assert diff <= 1e-6, f"step {step}: grad of {n} differs by {diff:.3e}"
            worst["grad"] = max(worst["grad"], diff)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (n, p), ref_p in zip(model.named_parameters(), reference.parameters(), strict=True):
        diff = (p.full_tensor() - ref_p).abs().max().item()
        assert diff <= 1e-6, f"after {case.steps} steps: {n} differs by {diff:.3e}"
        worst["param"] = max(worst["param"], diff)
    return worst


def _check_parity(world: int, case: Case) -> None:
    for worst in run_distributed(_parity_run, world, case, timeout=120):
        assert worst["loss"] <= 1e-6 and worst["grad"] <= 1e-6 and worst["param"] <= 1e-6, worst
        # The comparison is not vacuous: the three weights are quantized, and the weights
        # computed with are not the masters.
        assert worst["quantized"] == 3 and worst["moved"] > 1e-4, worst


@pytest.mark.parametrize(
    ("world", "case"),
    [
        (2, Case(reshard=True)),
        (2, Case(reshard=False, block=7)),
        (3, Case(reshard=True)),
        (3, Case(reshard=False)),
        (2, Case(bf16=True)),
        (3, Case(shard_dim=1)),
    ],
    ids=["W2-reshard", "W2-keep-block7", "W3-reshard", "W3-keep", "W2-bf16", "W3-shard1"],
)
def test_parity_with_the_quantized_reference(world: int, case: Case) -> None:
    _check_parity(world, case)


@pytest.mark.parametrize(
    "case",
    [
        Case(reshard=2),
        Case(hsdp=True),
        Case(prefetch=True, grad_accum=2, activation_checkpointing=True),
    ],
    ids=["reshard-int-2", "hsdp-2x2", "prefetch-accum-checkpointing"],
)
def test_parity_composes_at_world_4(case: Case) -> None:
    _check_parity(4, case)


# -- the error bound, inside the engine -----------------------------------------------------------

BOUND_BLOCK = 64  # one row of the (16, 64) weight below: each row is a block


def _adversarial_weight() -> Tensor:
    """(16, 64), each row one block: zeros, an outlier, tiny, subnormal, constant, random."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=gen)
    for base in (0, 8):  # the same cases in both ranks' shards (W = 2: rows 0-7 and 8-15)
        w[base + 0] = 0.0
        w[base + 1, 5] = 1e6  # coarsens this block only
        w[base + 2] *= 1e-38  # near fp32's smallest normal
        w[base + 3] = torch.randint(-20, 21, (64,), generator=gen) * 2.0**-149  # subnormals
        w[base + 4] = -3.5
        w[base + 5] = torch.tensor([(-1.0) ** i * 127.5 for i in range(64)])
    return w


def _gathered_against_master(bf16: bool) -> dict[str, float]:
    mesh = mesh_1d()
    master = _adversarial_weight()
    lin = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(master)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    policy = QuantizationPolicy(all_gather="int8", block_size=BOUND_BLOCK)
    fully_shard(lin, mesh=mesh, mp_policy=mp, quantization_policy=policy)
    assert isinstance(lin, FSDPModule)
    lin.unshard()
    got = lin.weight
    assert not isinstance(got, DTensor) and got.dtype == (torch.bfloat16 if bf16 else torch.float32)
    # Each row is one block of one rank's shard: its step is max |x| / 127 (the engine's scale
    # may be one ulp larger, where the division rounded down).
    step = (master.abs().amax(dim=1, keepdim=True) / 127).expand_as(master)
    bound = step * (1 + 2 * FP32_EPS) / 2 + master.abs() * 2 * FP32_EPS
    if bf16:
        # bf16's rounding of the result: half an ulp, relative, or absolute below its normals.
        bound = bound + got.float().abs() * 2.0**-8 + 2.0**-134
    err = (got.float() - master).abs()
    excess = (err - bound).max().item()
    zeros_exact = bool((got[0] == 0).all() and (got[8] == 0).all())
    others = torch.cat([got[1:2, 6:], got[1:2, :5]], dim=1).float()  # the outlier's neighbours
    result = {
        "excess": excess,
        "zeros_exact": float(zeros_exact),
        "outlier_kept": abs(got[1, 5].float().item() - 1e6) / 1e6,
        "neighbours_flushed": others.abs().max().item(),
        "subnormal_err": err[3].max().item(),
    }
    lin.reshard()
    return result


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gathered_elements_are_within_half_a_step_of_the_master(bf16: bool) -> None:
    for got in run_distributed(_gathered_against_master, 2, bf16):
        assert got["excess"] <= 0.0, got
        assert got["zeros_exact"] == 1.0, got  # an all-zero block is exact
        assert got["outlier_kept"] <= 1e-2, got
        # The outlier's step is 1e6 / 127: its block's ordinary values round to zero (the cost
        # of one scale per block); the other blocks keep their own fine scale (checked above).
        assert got["neighbours_flushed"] == 0.0, got
        if not bf16:
            assert got["subnormal_err"] == 0.0, got  # integer multiples of the scale: exact


# -- bytes --------------------------------------------------------------------------------------

BIG = [256, 512, 512, 256]  # weights of 2^17 elements: the params are mostly large


def _gather_bytes(block: int | None, world_dims: list[int]) -> dict[str, int]:
    torch.manual_seed(0)
    model = MLPStack(world_dims, activation="tanh")
    policy = QuantizationPolicy() if block is None else QuantizationPolicy("int8", block_size=block)
    mesh = mesh_1d()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, quantization_policy=policy)
    root = fully_shard(model, mesh=mesh, quantization_policy=policy)
    assert isinstance(root, FSDPModule)
    comm = CountingComm()
    root.set_comm(comm)
    x = torch.randn(4, world_dims[0])
    model(x).square().mean().backward()
    return comm.bytes_by_op() | {"all_gather_calls": comm.count_by_op()["all_gather"]}


def _formula(dims: list[int], world: int, block: int) -> int:
    """int8 values + 4 B per block scale for the weights, 4 B per element for the biases, x2
    gathers (forward, and again for backward) per block."""
    total = 0
    for a, b in itertools.pairwise(dims):
        chunk = math.ceil(b / world)
        total += 2 * (int8_gather_nbytes(chunk * a, block) + 4 * chunk)
    return total


@pytest.mark.parametrize("world", [2, 3])
def test_int8_bytes_are_counted_exactly_and_are_a_quarter(world: int) -> None:
    plain = run_distributed(_gather_bytes, world, None, BIG)
    int8 = run_distributed(_gather_bytes, world, 256, BIG)
    for p, q in zip(plain, int8, strict=True):
        assert q["all_gather"] == _formula(BIG, world, 256), (q, _formula(BIG, world, 256))
        assert q["all_gather_calls"] == p["all_gather_calls"] == 2 * (len(BIG) - 1)
        assert q["all_gather"] / p["all_gather"] <= 0.27, (q, p)
        assert q["reduce_scatter"] == p["reduce_scatter"]  # gradients are not quantized
    # 1 + 4/256 bytes per weight element against 4; the biases (4 B) nudge it up a little.
    assert int8[0]["all_gather"] / plain[0]["all_gather"] > 0.25


def test_int8_gather_bytes_formula() -> None:
    assert int8_gather_nbytes(256, 256) == 256 + 4
    assert int8_gather_nbytes(257, 256) == 257 + 8
    assert int8_gather_nbytes(0, 256) == 0


# -- what travels unquantized ---------------------------------------------------------------------


class _Mixed(nn.Module):
    """One group with every kind of parameter the quantization rule tells apart."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.big = nn.Linear(64, 64)  # weight: int8; bias: 1-D, plain
        self.small = nn.Parameter(torch.randn(2, 3, generator=gen))  # < one block per rank
        self.table = nn.Parameter(
            torch.randint(-100, 100, (64, 64), dtype=torch.int8, generator=gen),
            requires_grad=False,
        )
        self.frozen_bf16 = nn.Parameter(
            torch.randn(64, 64, generator=gen).bfloat16(), requires_grad=False
        )  # frozen, but 16-bit and large: int8 too
        self.frozen_fp8 = nn.Parameter(
            torch.randn(64, 64, generator=gen).to(torch.float8_e4m3fn), requires_grad=False
        )  # 8-bit already: plain

    def forward(self, x: Tensor) -> Tensor:
        y = self.big(x) + x @ self.frozen_bf16.float() + x @ self.frozen_fp8.float()
        return y + 1e-3 * (x @ self.table.float()) + self.small.sum()


def _mixed_group() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Mixed()
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    fully_shard(
        model, mesh=mesh_1d(), quantization_policy=QuantizationPolicy("int8", block_size=64)
    )
    assert isinstance(model, FSDPModule)
    group = model._fsdp_state.group
    formats = {
        p.fqn: type(p.gather_format(group.config.quantization_policy)).__name__
        for p in group.params
    }
    group_repr = repr(group)
    model.unshard()
    exact = {n: bool(torch.equal(getattr_path(model, n), m)) for n, m in masters.items()}
    dtypes = {n: str(getattr_path(model, n).dtype) for n in masters}
    model.reshard()
    x = torch.randn(3, 64)
    model(x).square().mean().backward()
    grads = {n: p.grad is not None for n, p in model.named_parameters()}
    return {
        "formats": formats,
        "exact": exact,
        "dtypes": dtypes,
        "grads": grads,
        "group_repr": group_repr,
    }


def getattr_path(module: nn.Module, name: str) -> Tensor:
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    t: Tensor = getattr(module, leaf)
    return t


def test_small_1d_integer_and_float8_parameters_travel_unquantized() -> None:
    got = run_distributed(_mixed_group, 2)[0]
    assert got["formats"] == {
        "big.weight": "Int8BlockGather",
        "big.bias": "PlainGather",
        "small": "PlainGather",
        "table": "PlainGather",
        "frozen_bf16": "Int8BlockGather",
        "frozen_fp8": "PlainGather",
    }
    # The plain ones come back bit for bit, each in its own dtype; the int8 ones do not.
    assert got["exact"] == {
        "big.weight": False,
        "big.bias": True,
        "small": True,
        "table": True,
        "frozen_bf16": False,
        "frozen_fp8": True,
    }
    assert got["dtypes"]["table"] == "torch.int8"
    assert got["dtypes"]["frozen_fp8"] == "torch.float8_e4m3fn"
    assert got["dtypes"]["frozen_bf16"] == "torch.bfloat16"
    assert got["grads"] == {
        "big.weight": True,
        "big.bias": True,
        "small": True,
        "table": False,
        "frozen_bf16": False,
        "frozen_fp8": False,
    }
    # the group says which of its parameters travel as int8, in blocks of how many
    assert "big.weight (int8/64)" in got["group_repr"], got["group_repr"]
    assert "table (int8" not in got["group_repr"], got["group_repr"]


# -- checkpoints hold the fp32 masters ----------------------------------------------------------


def _checkpoint_masters(path: str) -> dict[str, float]:
    case = Case()
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    _shard(model, case, mesh_1d())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _batch(step, 4)
        _mse(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model(_batch(9, 4)[0])  # the root keeps its parameters gathered after forward
    state = model.state_dict()
    worst = {"state_vs_master": 0.0, "master_vs_gathered": 0.0, "loaded_vs_master": 0.0}
    masters = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, v in state.items():
        assert isinstance(v, DTensor) and v.dtype == torch.float32, n
        worst["state_vs_master"] = max(
            worst["state_vs_master"], (v.full_tensor() - masters[n]).abs().max().item()
        )
    for m in masters.values():
        gathered = gathered_reference(m, dist.get_world_size(), 0, _policy(case), torch.float32)
        worst["master_vs_gathered"] = max(
            worst["master_vs_gathered"], (gathered - m).abs().max().item()
        )
    dcp.save({"model": state}, checkpoint_id=path)

    torch.manual_seed(1)  # different values, unquantized: what was saved must come back
    fresh = MLPStack(DIMS, activation="tanh")
    _shard(fresh, replace(case, block=10**6), mesh_1d())
    fresh_state = {"model": fresh.state_dict()}
    dcp.load(fresh_state, checkpoint_id=path)
    fresh.load_state_dict(fresh_state["model"])
    for n, p in fresh.named_parameters():
        worst["loaded_vs_master"] = max(
            worst["loaded_vs_master"], (p.full_tensor() - masters[n]).abs().max().item()
        )
    return worst


def test_checkpoints_hold_the_fp32_masters(tmp_path: Any) -> None:
    for got in run_distributed(_checkpoint_masters, 2, str(tmp_path / "ckpt")):
        assert got["state_vs_master"] == 0.0 and got["loaded_vs_master"] == 0.0, got
        assert got["master_vs_gathered"] > 1e-4, got  # so the masters are not what was gathered


# -- bad inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"all_gather": "int8", "block_size": 0}, FullyShardValueError, "block_size=0 must be"),
        ({"all_gather": "int8", "block_size": -4}, FullyShardValueError, "block_size=-4 must be"),
        ({"all_gather": "int8", "block_size": 2.5}, FullyShardTypeError, "must be an int"),
        ({"all_gather": "int8", "block_size": "256"}, FullyShardTypeError, "must be an int"),
        ({"all_gather": "int8", "block_size": True}, FullyShardTypeError, "must be an int"),
        ({"all_gather": "int4"}, FullyShardValueError, "'int4' is not supported"),
        ({"all_gather": "INT8"}, FullyShardValueError, "'INT8' is not supported"),
        ({"all_gather": torch.int8}, FullyShardTypeError, "must be a string or None"),
        ({"all_gather": 8}, FullyShardTypeError, "must be a string or None"),
    ],
)
def test_bad_policy_values_are_refused(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as info:
        QuantizationPolicy(**kwargs)
    # Our classes, and the builtins torch would raise for the case.
    assert isinstance(info.value, ValueError if error is FullyShardValueError else TypeError)
    # ... that say what would do instead.
    assert "'int8'" in str(info.value) or "block_size=256" in str(info.value)


def _wrong_policy_type() -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLPStack(DIMS)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    errors = []
    for bad in ("int8", QuantizationPolicy, {"all_gather": "int8"}, MixedPrecisionPolicy()):
        with pytest.raises(FullyShardTypeError, match="quantization_policy must be a") as info:
            fully_shard(model, mesh=mesh_1d(), quantization_policy=bad)  # type: ignore[arg-type]
        errors.append(str(info.value))
    unchanged = not isinstance(model, FSDPModule) and all(
        model.get_parameter(n) is p and torch.equal(p, v) for n, (p, v) in before.items()
    )
    return {"errors": errors, "unchanged": unchanged}


def test_a_wrong_policy_type_is_refused_before_anything_changes() -> None:
    got = run_distributed(_wrong_policy_type, 2)[0]
    assert got["unchanged"], got
    assert all("QuantizationPolicy(all_gather='int8'" in e for e in got["errors"]), got
