"""Run the engine on an accelerator and check it there: every option against a reference.

The test suite runs on CPU with gloo (CI has no GPU). This script is what to run on a GPU
machine: one command (``--all``) that trains bench_train.py's Llama (a small size) for a few
AdamW steps under each option, at W = 1 (NCCL), 2 and 4 (gloo, ranks sharing the GPU), on the
device, and compares every step's loss, every gradient and the final parameters with a
reference on the same device:

* ``unsharded``: a replica that runs all data-parallel ranks' micro-batches itself (loss / W
  each, the same matrix shapes as the ranks) and steps once; for the int8 all-gather the
  replica computes with each weight as the W-rank quantized gather rebuilds it (the masters,
  the gradients and the optimizer stay fp32, straight-through, as in the engine); on 2-D and
  3-D meshes the sharded side is compared through ``full_tensor()``;
* ``torch``: torch's own ``fully_shard`` with the same options on the same ranks (the
  reference for bf16 compute, whose rounding an unsharded replica does not share);
* ``saved``: for DCP, the model that was saved (loaded values and the next loss, exactly);
* ``measured``: for the planner, the peak the device's allocator reports for the step.

Then it times what the int8 all-gather adds on the device (quantize before, dequantize after,
against the plain copy-in and copy-out they replace) and turns it into the link bandwidth
below which the saved bytes are worth more than the added work.

``--table-out FILE`` writes the rows of the "verified where" table (docs/index.md): feature,
check, setup (ranks, backend, device, mesh), result, torch version, date and commit, as
markdown; the JSON (``--json-out``, and the last line printed) has every number.

Two checks are hooks for features built beside this script: ``compile-fullgraph``
(``torch.compile(model, fullgraph=True)`` on a sharded model, the graph path:
:func:`graph_path_available`) and ``muon`` (``fully_shard.Muon`` against
``torch.optim.Muon``: :func:`check_muon`). Where the feature is not in the installed
``fully_shard`` their rows say "not available in this build".

Example:
    $ python benchmarks/device_check.py --all --table-out device_rows.md   # every run, rows
    $ python benchmarks/device_check.py --device cuda                # NCCL, one rank per GPU
    $ python benchmarks/device_check.py --device cuda --backend gloo --nproc 2
    $ python benchmarks/device_check.py --device cpu --nproc 2       # the same checks on CPU

``--backend gloo`` with ``--device cuda`` lets several ranks share one GPU: gloo stages every
collective through host memory, a link much slower than the device's own memory. The exit
code is 1 if a check of ours failed or raised.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_train import Llama, ModelConfig, _free_port, init_rank, make_batches
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import spawn
from torch.utils.checkpoint import checkpoint

import fully_shard as fs
from fully_shard.quantize import (
    Int8BlockGather,
    dequantize_blocks,
    dequantize_into,
    int8_gather_nbytes,
    quantize_blocks,
)

# Uneven on purpose: 130 and 176 rows split 44/44/42 and 59/59/58 over 3 ranks, 65/65 and
# 88/88 over 2; every weight holds at least one full int8 block per rank at block_size 64.
# dim and ffn_hidden are multiples of 16 (float8 matmuls); the head (130) stays in fp32.
MODEL = ModelConfig(vocab=130, dim=64, n_layers=3, n_heads=4, ffn_hidden=176, seq_len=32, batch=2)
BLOCK = 64  # int8 block size of the check (the default 256 would leave the norms alone anyway)
NOT_AVAILABLE = "N/A"  # a status: the feature is not in this build (or its package is missing)
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Scenario:
    """One option set, and what it is compared with (picklable: it goes to every rank).

    ``kind`` is ``"parity"`` (train beside a reference), or one of the checks with a reference
    of their own: ``"dcp"`` (save and load), ``"plan"`` (predicted vs measured peak),
    ``"muon"`` (the optimizer hook). ``feature`` is the row of the verified-where table.
    """

    name: str
    feature: str
    what: str
    kind: str = "parity"
    reference: str = "unsharded"  # or "torch"
    mesh: str = "1d"  # "1d", "hsdp" (replicate, shard), "tp" (dp, tp), "3d" (replicate, shard, tp)
    reshard: bool = True
    bf16: bool = False
    int8: bool = False
    offload: bool = False
    checkpointing: bool = False
    accum: int = 1
    prefetch: bool = False
    compiled: str = ""  # "default": torch.compile with our hooks; "fullgraph": the graph path
    float8: bool = False
    checker: bool = False
    atol: float = 2e-5
    rtol: float = 1e-4


SCENARIOS = (
    Scenario("fp32", "core training", "every block, then the root; default options"),
    Scenario("no-reshard", "core training", "reshard_after_forward=False", reshard=False),
    Scenario(
        "prefetch",
        "core training",
        "explicit forward/backward prefetch, two blocks ahead",
        prefetch=True,
    ),
    Scenario(
        "accum",
        "gradient accumulation",
        "2 micro-batches, no gradient sync on the first",
        accum=2,
    ),
    Scenario(
        "checkpoint",
        "activation checkpointing",
        "activation checkpointing of every block",
        checkpointing=True,
    ),
    Scenario("offload", "CPU offload", "CPUOffloadPolicy (pinned on an accelerator)", offload=True),
    Scenario(
        "int8",
        "int8 all-gather",
        f"QuantizationPolicy(all_gather='int8', block_size={BLOCK})",
        int8=True,
    ),
    Scenario(
        "torch-fp32",
        "same results as torch's fully_shard",
        "defaults, vs torch's fully_shard",
        reference="torch",
    ),
    Scenario(
        "torch-bf16",
        "mixed precision",
        "MixedPrecisionPolicy(bf16 params, fp32 reduce), vs torch's fully_shard",
        reference="torch",
        bf16=True,
        atol=1e-3,
        rtol=1e-2,
    ),
    Scenario("hsdp", "HSDP", "2-D mesh (replicate, shard), full_tensor() compared", mesh="hsdp"),
    Scenario("tp", "TP + FSDP", "SwiGLU column/row-parallel on tp, fully_shard on dp", mesh="tp"),
    Scenario("3d", "3-D (HSDP + TP)", "(replicate, shard, tp): HSDP over TP'd blocks", mesh="3d"),
    Scenario(
        "compile",
        "torch.compile (eager hooks)",
        "torch.compile(model): compiled blocks, our hooks outside the graphs",
        compiled="default",
        atol=1e-4,
        rtol=1e-3,
    ),
    Scenario(
        "compile-fullgraph",
        "torch.compile fullgraph (graph path)",
        "torch.compile(model, fullgraph=True): gathers and reduce-scatters in the graph",
        compiled="fullgraph",
        atol=1e-4,
        rtol=1e-3,
    ),
    Scenario(
        "float8",
        "float8 (torchao)",
        "torchao Float8Linear blocks, weights all-gathered in float8",
        float8=True,
        atol=1e-4,
        rtol=1e-3,
    ),
    Scenario("checker", "debug checker", "fully_shard.debug.check_collectives() on", checker=True),
    Scenario(
        "dcp",
        "DCP checkpoints",
        "dcp.save, then dcp.load into a fresh sharded model",
        kind="dcp",
        reference="saved",
    ),
    Scenario(
        "plan",
        "planner",
        "plan(mesh=...).peak_bytes vs the allocator's peak of a step",
        kind="plan",
        reference="measured",
    ),
    Scenario(
        "muon",
        "Muon",
        "fully_shard.Muon on sharded blocks vs torch.optim.Muon unsharded",
        kind="muon",
    ),
)


@dataclass(frozen=True)
class Options:
    """What every rank runs (picklable)."""

    device: str
    backend: str
    world: int
    steps: int
    seed: int
    scenarios: tuple[Scenario, ...]
    compile_backend: str
    tmpdir: str


@dataclass(frozen=True)
class Layout:
    """Where one scenario's ranks sit: the mesh ``fully_shard`` gets, TP's, and the data split.

    Ranks that differ only in their TP coordinate train on the same data, so the global batch
    has ``data_world`` parts and this rank computes part ``data_rank``.
    """

    shard_mesh: DeviceMesh
    tp_mesh: DeviceMesh | None
    shape: tuple[int, ...]
    data_rank: int
    data_world: int

    @property
    def multi_dim(self) -> bool:
        return len(self.shape) > 1


def build_layout(kind: str, device_type: str, world: int) -> Layout:
    """The meshes of ``kind`` on ``world`` ranks (dims of 1 where ``world`` is too small).

    ``hsdp``: (2, W/2) from W = 4, (1, W) below; ``tp``: (W/2, 2) for even W; ``3d``: (2,
    W/4, 2) from W = 8, (1, W/2, 2) for even W. A dim of size 1 still runs its code path (the
    HSDP all-reduce, the TP DTensors); the table says the shape.
    """
    rank = dist.get_rank()
    tp = 2 if world % 2 == 0 else 1
    if kind == "1d":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        return Layout(mesh, None, (world,), rank, world)
    if kind == "hsdp":
        rep = 2 if world % 2 == 0 and world >= 4 else 1
        shape: tuple[int, ...] = (rep, world // rep)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
        return Layout(mesh, None, shape, rank, world)
    if kind == "tp":
        shape = (world // tp, tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))
        return Layout(mesh["dp"], mesh["tp"], shape, rank // tp, world // tp)
    if kind == "3d":
        rest = world // tp
        rep = 2 if rest % 2 == 0 and rest >= 4 else 1
        shape = (rep, rest // rep, tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard", "tp"))
        return Layout(mesh["replicate", "shard"], mesh["tp"], shape, rank // tp, rest)
    raise ValueError(f"unknown mesh kind {kind!r}; choose 1d, hsdp, tp or 3d")


def _commit() -> str:
    """The checked-out commit (``FULLY_SHARD_COMMIT`` where the tree came without ``.git``)."""
    if os.environ.get("FULLY_SHARD_COMMIT"):
        return os.environ["FULLY_SHARD_COMMIT"]
    with contextlib.suppress(Exception):
        out = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    return "unknown"


# ---------------------------------------------------------------------------------------------
# One scenario on one rank
# ---------------------------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return checkpoint(self.block, x, cos, sin, use_reentrant=False)  # type: ignore[no-any-return]


def _apply_tp(model: Llama, tp_mesh: DeviceMesh) -> None:
    """SwiGLU of every block Megatron-style over ``tp_mesh``: w1, w3 by rows, w2 by columns.

    w1 and w3 are then sharded on dim 0 by TP *and* by us (the strided layout); w2 on dim 1 by
    TP and dim 0 by us. Attention stays replicated: bench_train's attention reshapes to the
    full width, which column-parallel projections would not give it.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    for block in model.layers:
        parallelize_module(block.feed_forward, tp_mesh, plan)  # type: ignore[union-attr,arg-type]


def _to_float8(model: nn.Module) -> None:
    """Every block's Linear a torchao ``Float8Linear`` gathered in float8 (the head stays)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda m, fqn: "layers" in fqn
    )


def _shard(model: Llama, sc: Scenario, lay: Layout, impl: str) -> None:
    """Wrap every block, then the root, with ours (``impl="ours"``) or torch's fully_shard."""
    mesh = lay.shard_mesh
    if impl == "ours":
        kwargs: dict[str, Any] = {"reshard_after_forward": sc.reshard}
        if sc.bf16:
            kwargs["mp_policy"] = fs.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        if sc.int8:
            kwargs["quantization_policy"] = fs.QuantizationPolicy("int8", block_size=BLOCK)
        if sc.offload:
            kwargs["offload_policy"] = fs.CPUOffloadPolicy()
        shard: Callable[..., Any] = fs.fully_shard
    else:
        from torch.distributed import fsdp

        kwargs = {"reshard_after_forward": sc.reshard}
        if sc.bf16:
            kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        if sc.offload:
            kwargs["offload_policy"] = fsdp.CPUOffloadPolicy()
        shard = fsdp.fully_shard
    if lay.tp_mesh is not None:
        _apply_tp(model, lay.tp_mesh)
    for block in model.layers:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    if sc.prefetch:
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])  # type: ignore[operator]
            block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0) : i][::-1])  # type: ignore[operator]


def _rows(t: Tensor, world: int, rank: int) -> Tensor:
    """Rank ``rank``'s dim-0 chunk of a full tensor, as ``torch.chunk`` (and Shard(0)) cut it."""
    c = math.ceil(t.size(0) / world)
    lo = min(rank * c, t.size(0))
    return t[lo : min(lo + c, t.size(0))]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _quantized_like_the_gather(full: Tensor, world: int, policy: fs.QuantizationPolicy) -> Tensor:
    """``full`` as a ``world``-rank int8 all-gather rebuilds it, derived on its own.

    Each rank's ``ceil(d0 / W)``-row chunk, zero-padded, flattened, quantized block by block
    and dequantized; the pieces put back together and the padding dropped.
    """
    d0, c = full.size(0), math.ceil(full.size(0) / world)
    padded_shape = (c, *full.shape[1:])
    if not policy.quantizes(full.shape, full.dtype, math.prod(padded_shape)):
        return full
    pieces = []
    for r in range(world):
        padded = full.new_zeros(padded_shape)
        rows = _rows(full, world, r)
        padded[: rows.size(0)] = rows
        q, s = quantize_blocks(padded.flatten(), policy.block_size)
        pieces.append(dequantize_blocks(q, s, policy.block_size, full.dtype).view(padded_shape))
    return torch.cat(pieces)[:d0]


def _check_the_optimizer_holds_the_module_params(
    model: nn.Module, params: dict[str, nn.Parameter], sc: Scenario
) -> None:
    """The parameters the optimizer was built with are still the module's, and (offload) on
    the CPU, pinned where an accelerator is: a replaced parameter would never get a gradient."""
    for n, p in model.named_parameters():
        if p is not params[n]:
            raise AssertionError(f"{n}: the module's parameter is not the one the optimizer holds")
        if sc.offload:
            local = _local(p)
            pinned = local.is_pinned() or not torch.cuda.is_available()
            if local.device.type != "cpu" or not pinned:
                raise AssertionError(
                    f"{n}: offloaded shard on {local.device} (pinned {local.is_pinned()})"
                )


def _max(x: float, group: dist.ProcessGroup | None, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(got: Tensor, want: Tensor, device: torch.device) -> float:
    got, want = got.detach().to(device).double(), want.detach().to(device).double()
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    return 0.0 if got.numel() == 0 else float((got - want).abs().max())


def _verdict(
    sc: Scenario, diffs: dict[str, float], ref_loss: float, device: torch.device
) -> dict[str, Any]:
    """The largest differences over all ranks, and PASS or FAIL against the tolerances."""
    result = {k: _max(v, None, device) for k, v in diffs.items()}
    scale = max(abs(ref_loss), 1.0)
    ok = all(
        math.isfinite(v) and v <= sc.atol + sc.rtol * (scale if k == "loss" else 1.0)
        for k, v in result.items()
    )
    return {**result, "status": "PASS" if ok else "FAIL"}


def graph_path_available() -> bool:
    """HOOK (graph path): whether this build of ``fully_shard`` traces its gathers into graphs.

    The graph path lives beside ``hooks.py`` (``fully_shard/graph.py``); adjust this probe if it
    lands under another name. Without it ``compile-fullgraph`` reports "not available in this
    build" instead of the graph break it would hit.
    """
    return importlib.util.find_spec("fully_shard.graph") is not None


def run_scenario(sc: Scenario, opts: Options, device: torch.device) -> dict[str, Any]:
    """One scenario on this rank: a result dict with ``status`` (and the numbers)."""
    if sc.kind == "dcp":
        return check_dcp(sc, opts, device)
    if sc.kind == "plan":
        return check_plan(sc, opts, device)
    if sc.kind == "muon":
        return check_muon(sc, opts, device)
    if sc.compiled == "fullgraph" and not graph_path_available():
        return {"status": NOT_AVAILABLE, "note": "not available in this build (no graph path)"}
    if sc.float8 and importlib.util.find_spec("torchao") is None:
        return {"status": NOT_AVAILABLE, "note": "torchao is not installed"}
    return check_parity(sc, opts, device)


def check_parity(sc: Scenario, opts: Options, device: torch.device) -> dict[str, Any]:
    """Train ours and the reference side by side; the largest differences over all ranks."""
    lay = build_layout(sc.mesh, device.type, opts.world)
    torch.manual_seed(opts.seed)
    model = Llama(MODEL).to(device)
    if sc.checkpointing:
        model.layers = nn.ModuleList(Checkpointed(b) for b in model.layers)
    if sc.float8:
        _to_float8(model)
    reference = copy.deepcopy(model)
    _shard(model, sc, lay, "ours")
    if sc.reference == "torch":
        _shard(reference, sc, lay, "torch")
    run: Callable[[Tensor], Tensor] = model
    if sc.compiled:
        run = torch.compile(
            model, backend=opts.compile_backend, fullgraph=sc.compiled == "fullgraph"
        )
    policy = fs.QuantizationPolicy("int8", block_size=BLOCK)
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref_params.values(), lr=3e-3)
    b, world, rank = MODEL.batch, lay.data_world, lay.data_rank
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0}

    def ours_side(t: Tensor) -> Tensor:
        return _full(t) if lay.multi_dim else _local(t)

    def ref_side(t: Tensor) -> Tensor:
        """The reference's counterpart of what :func:`ours_side` returns."""
        if lay.multi_dim:
            return t
        return _local(t) if sc.reference == "torch" else _rows(t, world, rank)

    def train(m: Callable[[Tensor], Tensor], tokens: Tensor, ranks: range, sync: bool) -> Tensor:
        """Each of ``ranks``' micro-batches; the summed loss, each divided by W * accum."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for r in ranks:
            for k in range(sc.accum):
                if sync and sc.accum > 1:
                    m.set_requires_gradient_sync(k == sc.accum - 1)  # type: ignore[attr-defined]
                lo = (r * sc.accum + k) * b
                micro = tokens[lo : lo + b]
                logits = m(micro[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten())
                (loss / sc.accum / (len(ranks) if len(ranks) > 1 else 1)).backward()
                total += loss.detach().double() / sc.accum
        return total

    checking = fs.debug.check_collectives() if sc.checker else contextlib.nullcontext()
    batches = make_batches(replace(MODEL, batch=b * sc.accum), world, opts.steps, opts.seed)
    with checking:
        for tokens in batches:
            tokens = tokens.to(device)
            loss = train(run, tokens, range(rank, rank + 1), sync=True)
            dist.all_reduce(loss)  # every rank's loss; TP ranks of one data part agree
            loss /= dist.get_world_size()
            if sc.reference == "torch":
                ref_loss = train(reference, tokens, range(rank, rank + 1), sync=True)
                dist.all_reduce(ref_loss)
                ref_loss /= dist.get_world_size()
            else:
                masters = {n: p.detach().clone() for n, p in ref_params.items()}
                if sc.int8:
                    with torch.no_grad():
                        for p in ref_params.values():
                            p.copy_(_quantized_like_the_gather(p, world, policy))
                ref_loss = train(reference, tokens, range(world), sync=False) / world
                with torch.no_grad():  # straight-through: the gradients land on the masters
                    for n, p in ref_params.items():
                        p.copy_(masters[n])
            diffs["loss"] = max(diffs["loss"], _diff(loss, ref_loss, device))
            for n, p in params.items():
                ref_p = ref_params[n]
                if p.grad is None or ref_p.grad is None:
                    raise AssertionError(f"{n}: no gradient (ours {p.grad is not None})")
                if sc.offload and _local(p.grad).device.type != "cpu":
                    raise AssertionError(f"{n}: offloaded gradient on {_local(p.grad).device}")
                got, want = ours_side(p.grad), ref_side(ref_p.grad)
                diffs["grad"] = max(diffs["grad"], _diff(got, want, device))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad(set_to_none=True)
            if sc.float8:
                from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

                precompute_float8_dynamic_scale_for_fsdp(model)
    for n, p in params.items():
        diffs["param"] = max(diffs["param"], _diff(ours_side(p), ref_side(ref_params[n]), device))
    _check_the_optimizer_holds_the_module_params(model, params, sc)
    return {**_verdict(sc, diffs, float(ref_loss), device), "mesh": list(lay.shape)}


def _train_steps(
    model: nn.Module, opt: torch.optim.Optimizer, batches: list[Tensor], device: torch.device
) -> list[float]:
    """Plain training steps on this rank's part of each global batch; the local losses."""
    rank, b, losses = dist.get_rank(), MODEL.batch, []
    for tokens in batches:
        micro = tokens[rank * b : (rank + 1) * b].to(device)
        loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1), micro[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def check_dcp(sc: Scenario, opts: Options, device: torch.device) -> dict[str, Any]:
    """Train, ``dcp.save`` model and optimizer, ``dcp.load`` into a fresh sharded model built
    from another seed: every parameter and the next step's loss must equal the saved run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    lay = build_layout("1d", device.type, opts.world)
    batches = make_batches(MODEL, opts.world, opts.steps + 1, opts.seed)
    built = []
    for seed in (opts.seed, opts.seed + 1):
        torch.manual_seed(seed)
        model = Llama(MODEL).to(device)
        _shard(model, sc, lay, "ours")
        built.append((model, torch.optim.AdamW(model.parameters(), lr=3e-3)))
    (saved, saved_opt), (loaded, loaded_opt) = built
    _train_steps(saved, saved_opt, batches[:-1], device)
    where = os.path.join(opts.tmpdir, f"dcp-{opts.backend}-{opts.world}")
    model_sd, optim_sd = get_state_dict(saved, saved_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=where)
    _train_steps(loaded, loaded_opt, batches[:1], device)  # optimizer state to overwrite
    model_sd, optim_sd = get_state_dict(loaded, loaded_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(
        loaded, loaded_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    mine = dict(loaded.named_parameters())
    diffs = {
        "param": max(_diff(_local(p), _local(mine[n]), device) for n, p in saved.named_parameters())
    }
    next_saved = _train_steps(saved, saved_opt, batches[-1:], device)
    next_loaded = _train_steps(loaded, loaded_opt, batches[-1:], device)
    diffs["loss"] = abs(next_saved[0] - next_loaded[0])
    exact = replace(sc, atol=0.0, rtol=0.0)
    return {**_verdict(exact, diffs, next_saved[0], device), "mesh": list(lay.shape)}


def check_plan(sc: Scenario, opts: Options, device: torch.device) -> dict[str, Any]:
    """``fully_shard.plan``'s predicted peak of a step against the CUDA allocator's peak.

    Planned with nothing to choose (``allow=()``: the defaults), applied, trained three steps;
    the third step's ``max_memory_allocated`` over what was allocated before the model was
    built. Within 10% passes (what tests/test_plan.py holds on CPU against MemTracker). On
    CPU there is no allocator peak to read: reported as not applicable.
    """
    if device.type != "cuda":
        return {"status": NOT_AVAILABLE, "note": "the peak is read from the CUDA allocator"}
    lay = build_layout("1d", device.type, opts.world)
    batches = make_batches(MODEL, opts.world, 3, opts.seed)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.manual_seed(opts.seed)
    model = Llama(MODEL).to(device)
    example = batches[0][: MODEL.batch, :-1].to(device)

    def loss_fn(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), example.flatten())

    planned = fs.plan(
        model,
        budget="1TiB",
        mesh=lay.shard_mesh,
        example_inputs=(example,),
        allow=(),
        loss_fn=loss_fn,
    )
    planned.apply(model, lay.shard_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _train_steps(model, opt, batches[:2], device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    _train_steps(model, opt, batches[2:], device)
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device) - base
    ratio = planned.peak_bytes / max(measured, 1)
    worst = _max(abs(ratio - 1.0), None, device)
    return {
        "predicted_bytes": planned.peak_bytes,
        "measured_bytes": measured,
        "ratio": ratio,
        "status": "PASS" if worst <= 0.10 else "FAIL",
        "mesh": list(lay.shape),
    }


def check_muon(sc: Scenario, opts: Options, device: torch.device) -> dict[str, Any]:
    """HOOK (Muon): ``fully_shard.Muon`` on the blocks' matrices against ``torch.optim.Muon``.

    Assumes ``fully_shard.Muon`` takes ``torch.optim.Muon``'s arguments (params, lr, ...);
    the other parameters (embedding, head, norms) step with AdamW on both sides. Where the
    class is missing the row says "not available in this build".
    """
    muon = getattr(fs, "Muon", None)
    if muon is None:
        with contextlib.suppress(ImportError):
            from fully_shard.optim import Muon as muon  # type: ignore[no-redef]
    if muon is None or not hasattr(torch.optim, "Muon"):
        what = "fully_shard.Muon" if muon is None else "torch.optim.Muon"
        return {"status": NOT_AVAILABLE, "note": f"not available in this build ({what})"}
    lay = build_layout("1d", device.type, opts.world)
    world, rank = opts.world, dist.get_rank()
    torch.manual_seed(opts.seed)
    model = Llama(MODEL).to(device)
    reference = copy.deepcopy(model)
    _shard(model, sc, lay, "ours")

    def split(m: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        named = list(m.named_parameters())
        mats = [p for n, p in named if n.startswith("layers.") and p.ndim == 2]
        return mats, [p for n, p in named if not (n.startswith("layers.") and p.ndim == 2)]

    mats, rest = split(model)
    ref_mats, ref_rest = split(reference)
    opts_ours = [muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]
    opts_ref = [torch.optim.Muon(ref_mats, lr=0.02), torch.optim.AdamW(ref_rest, lr=3e-3)]
    b, diffs = MODEL.batch, {"loss": 0.0, "param": 0.0}
    for tokens in make_batches(MODEL, world, opts.steps, opts.seed):
        tokens = tokens.to(device)
        micro = tokens[rank * b : (rank + 1) * b]
        loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1), micro[:, 1:].flatten())
        loss.backward()
        total = loss.detach().double()
        dist.all_reduce(total)
        ref_loss = torch.zeros((), dtype=torch.float64, device=device)
        for r in range(world):
            micro = tokens[r * b : (r + 1) * b]
            out = reference(micro[:, :-1]).flatten(0, 1)
            step_loss = F.cross_entropy(out, micro[:, 1:].flatten())
            (step_loss / world).backward()
            ref_loss += step_loss.detach().double() / world
        diffs["loss"] = max(diffs["loss"], _diff(total / world, ref_loss, device))
        for o in (*opts_ours, *opts_ref):
            o.step()
            o.zero_grad(set_to_none=True)
    ref_params = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        diffs["param"] = max(
            diffs["param"], _diff(_local(p), _rows(ref_params[n], world, rank), device)
        )
    return {
        **_verdict(replace(sc, atol=1e-4, rtol=1e-3), diffs, float(ref_loss), device),
        "mesh": list(lay.shape),
    }


# ---------------------------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, opts: Options, port: int, out_path: str) -> None:
    timeout = timedelta(seconds=120)
    job = init_rank(rank, opts.world, opts.device, opts.backend, port, timeout)
    device = job.device
    results: dict[str, Any] = {}
    try:
        for sc in opts.scenarios:
            t0 = time.perf_counter()
            try:
                results[sc.name] = run_scenario(sc, opts, device)
            except Exception as e:  # reported; every rank raises alike, none is left waiting
                frames = traceback.extract_tb(e.__traceback__)
                in_torch = any("torch/distributed/fsdp" in f.filename for f in frames)
                side = "reference" if in_torch else "ours"
                results[sc.name] = {
                    "status": "ERROR",
                    "side": side,
                    "error": f"{type(e).__name__}: {e}".splitlines()[0][:300],
                    "trace": traceback.format_exc()[-1500:],
                }
            results[sc.name]["seconds"] = time.perf_counter() - t0
        if rank == 0:
            Path(out_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see bench_train._rank_main: skip C++ static destructors after gloo


# ---------------------------------------------------------------------------------------------
# What the int8 all-gather adds on the device
# ---------------------------------------------------------------------------------------------


def _time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after two warm-ups (device-synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gather_ends(device: torch.device, n: int, reps: int) -> tuple[float, float]:
    """Seconds to put an ``n``-element fp32 shard into a gather buffer: plain, and as int8."""
    fmt, size, nq = Int8BlockGather(256), torch.Size([n]), int8_gather_nbytes(n, 256)
    shard = torch.randn(n, device=device)
    buf32 = torch.empty(n, device=device)
    buf8 = torch.empty(nq, dtype=torch.uint8, device=device)

    def int8_in() -> None:  # what Int8BlockGather.inputs and copy-in do
        values, scales = fmt.inputs(shard, size, 0, torch.float32)
        buf8[:n].view(torch.int8).copy_(values.data)
        buf8[n:].view(torch.float32).copy_(scales.data)

    return _time(lambda: buf32.copy_(shard), device, reps), _time(int8_in, device, reps)


def _gather_outs(device: torch.device, n: int, world: int, reps: int) -> tuple[float, float]:
    """Seconds to write ``world`` gathered shards of ``n`` elements out: copy, and dequantize."""
    gathered = torch.randn(world, n, device=device)
    out = torch.empty(world, n, device=device)
    q, s = quantize_blocks(gathered[0], 256)
    values, scales = q.expand(world, n).contiguous(), s.expand(world, -1).contiguous()
    plain = _time(lambda: out.copy_(gathered), device, reps)
    return plain, _time(lambda: dequantize_into(out, values, scales, 256), device, reps)


def quant_costs(
    device: torch.device, sizes: list[int], worlds: list[int], reps: int
) -> list[dict[str, Any]]:
    """Per shard size and world: time added by int8 over fp32, bytes saved, break-even link.

    The plain gather copies the fp32 shard into the gather buffer and copies the W gathered
    shards out; the int8 gather quantizes the shard into int8 values and fp32 scales in the
    buffer (what ``Int8BlockGather.inputs`` + copy-in do) and dequantizes the W shards out
    (``dequantize_into``). Each rank receives ``(W - 1)`` shards: ``4 n`` bytes each plain,
    ``n + 4 ceil(n / 256)`` as int8. Break-even: saved bytes / added seconds, the link speed
    (per rank, receiving) below which int8 makes the gather faster.
    """
    rows = []
    for n in sizes:
        plain_in, int8_in = _gather_ends(device, n, reps)
        for world in worlds:
            plain_out, int8_out = _gather_outs(device, n, world, reps)
            added = (int8_in - plain_in) + (int8_out - plain_out)
            saved = (world - 1) * (4 * n - int8_gather_nbytes(n, 256))
            rows.append(
                {
                    "shard_elems": n,
                    "world": world,
                    "plain_in_us": plain_in * 1e6,
                    "int8_in_us": int8_in * 1e6,
                    "plain_out_us": plain_out * 1e6,
                    "int8_out_us": int8_out * 1e6,
                    "added_us": added * 1e6,
                    "saved_bytes": saved,
                    "break_even_GBps": saved / added / 1e9 if added > 0 else math.inf,
                }
            )
    return rows


# ---------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------


def _environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpus"] = torch.cuda.device_count()
        with contextlib.suppress(Exception):
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _setup(device: str, backend: str, world: int) -> str:
    """The verified-where table's column for one run, e.g. ``GPU W=2 gloo (ranks share 1 GPU)``."""
    if device == "cpu":
        return f"CPU gloo W={world}"
    gpus = torch.cuda.device_count()
    shared = f" (ranks share {gpus} GPU{'s' if gpus > 1 else ''})" if world > gpus else ""
    return f"GPU W={world} {backend.upper() if backend == 'nccl' else backend}{shared}"


def _result_text(r: dict[str, Any]) -> str:
    if r["status"] == NOT_AVAILABLE:
        return str(r.get("note", "not available in this build"))
    if r["status"] == "ERROR":
        return f"ERROR ({r['side']}): {r['error'][:120]}"
    if "ratio" in r:
        return (
            f"{r['status']}: predicted {r['predicted_bytes'] / 2**20:.2f} MiB, measured "
            f"{r['measured_bytes'] / 2**20:.2f} MiB ({r['ratio']:.3f}x)"
        )
    numbers = ", ".join(f"max|d{k}| {r[k]:.1e}" for k in ("loss", "grad", "param") if k in r)
    return f"{r['status']} ({numbers})"


def table_rows(
    runs: list[dict[str, Any]], scenarios: tuple[Scenario, ...], env: dict[str, Any]
) -> list[dict[str, str]]:
    """One row per run and scenario: feature, check, setup, mesh, result, torch, date, commit."""
    rows = []
    for run in runs:
        for sc in scenarios:
            r = run["results"][sc.name]
            mesh = "x".join(map(str, r.get("mesh", []))) or "-"
            rows.append(
                {
                    "feature": sc.feature,
                    "check": f"{sc.name}: {sc.what} (vs {sc.reference})",
                    "setup": run["setup"],
                    "mesh": mesh,
                    "result": _result_text(r),
                    "torch": env["torch"],
                    "date": env["date"],
                    "commit": env["commit"],
                }
            )
    return rows


def write_table(path: Path, rows: list[dict[str, str]], env: dict[str, Any]) -> None:
    """The rows as a markdown table, under a line that names the machine."""
    where = env.get("gpu", "CPU")
    head = (
        f"device_check on {where}, torch {env['torch']}, {env['date']}, commit {env['commit']}\n\n"
    )
    cols = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(row[c].replace("|", "\\|") for c in cols) + " |" for row in rows]
    path.write_text(head + "\n".join(lines) + "\n")


def _runs_to_make(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> list[tuple[str, int]]:
    """(backend, world) of each run. ``--all``: W = 1 on NCCL (gloo on CPU), W = 2 and 4 on
    gloo (ranks sharing the GPUs), and NCCL over every GPU where there are several."""
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.all:
        first = "nccl" if args.device == "cuda" else "gloo"
        runs = [(first, 1), ("gloo", 2), ("gloo", 4)]
        return runs + ([("nccl", gpus)] if gpus > 1 else [])
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if args.device == "cuda" else "gloo"
    world = args.nproc or (gpus if backend == "nccl" else 2)
    if backend == "nccl" and world > gpus:
        parser.error(f"NCCL needs a GPU per rank: {world} ranks, {gpus} GPU(s); try --backend gloo")
    return [(backend, world)]


def _print_run(run: dict[str, Any], scenarios: tuple[Scenario, ...]) -> bool:
    """Print one run's table; whether a check of ours failed or raised."""
    failed = False
    print(f"\n== {run['setup']}")
    print(f"{'scenario':<18} {'reference':<10} {'max|dloss|':>11} {'max|dgrad|':>11} "
          f"{'max|dparam|':>11} {'status':>7}  what")  # fmt: skip
    for sc in scenarios:
        r = run["results"][sc.name]
        if r["status"] in ("ERROR", NOT_AVAILABLE):
            print(f"{sc.name:<18} {sc.reference:<10} {'':>35} {r['status']:>7}  {_result_text(r)}")
            failed |= r["status"] == "ERROR" and r["side"] == "ours"
            continue
        failed |= r["status"] != "PASS"
        cells = " ".join(
            f"{r[k]:>11.2e}" if k in r else f"{'':>11}" for k in ("loss", "grad", "param")
        )
        print(f"{sc.name:<18} {sc.reference:<10} {cells} {r['status']:>7}  {sc.what}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2)")
    parser.add_argument("--all", action="store_true", help="W = 1 (NCCL), 2 and 4 (gloo), ...")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--compile-backend", default=None, help="inductor on GPU, else aot_eager")
    parser.add_argument("--quant-sizes", default="401408,4194304,33554432")
    parser.add_argument("--quant-worlds", default="2,8")
    parser.add_argument("--quant-reps", type=int, default=20)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--table-out", type=Path, default=None, help="verified-where rows (.md)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    names = [s for s in args.only.split(",") if s]
    unknown = sorted(set(names) - {s.name for s in SCENARIOS})
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {[s.name for s in SCENARIOS]}")
    scenarios = tuple(s for s in SCENARIOS if not names or s.name in names)
    compile_backend = args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    env = {
        **_environment(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "commit": _commit(),
    }

    runs, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for backend, world in _runs_to_make(args, parser):
            opts = Options(
                args.device, backend, world, args.steps, args.seed, scenarios, compile_backend, tmp
            )
            what = f"{world} rank(s), {backend} on {args.device}, {args.steps} steps"
            print(f"== device_check: {what}", flush=True)  # fmt: skip
            out = os.path.join(tmp, f"results-{backend}-{world}.json")
            t0 = time.perf_counter()
            spawn(_rank_main, args=(opts, _free_port(), out), nprocs=world)  # type: ignore[no-untyped-call]
            run = {
                "backend": backend,
                "world": world,
                "setup": _setup(args.device, backend, world),
                "seconds": time.perf_counter() - t0,
                "results": json.loads(Path(out).read_text()),
            }
            failed |= _print_run(run, scenarios)
            runs.append(run)

    sizes = [int(x) for x in args.quant_sizes.split(",") if x]
    worlds = [int(x) for x in args.quant_worlds.split(",") if x]
    costs = quant_costs(device, sizes, worlds, args.quant_reps)
    print("\nint8 all-gather on this device: what quantize + dequantize add, per gather and rank")
    print(f"{'shard elems':>12} {'W':>3} {'copy-in us':>11} {'quant us':>9} "
          f"{'copy-out us':>12} {'dequant us':>11} {'added us':>9} {'saved MB':>9} "
          f"{'break-even GB/s':>16}")  # fmt: skip
    for c in costs:
        print(f"{c['shard_elems']:>12,} {c['world']:>3} {c['plain_in_us']:>11.1f} "
              f"{c['int8_in_us']:>9.1f} {c['plain_out_us']:>12.1f} {c['int8_out_us']:>11.1f} "
              f"{c['added_us']:>9.1f} {c['saved_bytes'] / 1e6:>9.2f} "
              f"{c['break_even_GBps']:>16.1f}")  # fmt: skip
    rows = table_rows(runs, scenarios, env)
    if args.table_out:
        write_table(args.table_out, rows, env)
    summary = {
        "environment": env,
        "options": {
            "device": args.device,
            "steps": args.steps,
            "seed": args.seed,
            "compile_backend": compile_backend,
            "scenarios": [s.name for s in scenarios],
        },
        "runs": runs,
        "rows": rows,
        "quant_costs": costs,
        "ok": not failed,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
