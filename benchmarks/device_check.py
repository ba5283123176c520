"""Run the engine on an accelerator and check it there: every option against a reference.

The test suite runs on CPU with gloo (CI has no GPU). This script is what to run on a GPU
machine: it trains bench_train.py's Llama (a small size) for a few AdamW steps under each
option, on the device, and compares every step's loss, every gradient shard and the final
parameter shards with a reference on the same device:

* ``unsharded``: a replica that runs all W ranks' micro-batches itself (loss / W each, the
  same matrix shapes as the ranks) and steps once; for the int8 all-gather the replica
  computes with each weight as the W-rank quantized gather rebuilds it (the masters, the
  gradients and the optimizer stay fp32, straight-through, as in the engine);
* ``torch``: torch's own ``fully_shard`` with the same options on the same ranks (the
  reference for bf16 compute, whose rounding an unsharded replica does not share).

Then it times what the int8 all-gather adds on the device (quantize before, dequantize after,
against the plain copy-in and copy-out they replace) and turns it into the link bandwidth
below which the saved bytes are worth more than the added work.

Example:
    $ python benchmarks/device_check.py --device cuda                # NCCL, one rank per GPU
    $ python benchmarks/device_check.py --device cuda --backend gloo --nproc 2
    $ python benchmarks/device_check.py --device cpu --nproc 2       # the same checks on CPU

``--backend gloo`` with ``--device cuda`` lets several ranks share one GPU: gloo stages every
collective through host memory, a link much slower than the device's own memory. The last
line printed is one JSON object with every number; the exit code is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_train import Llama, ModelConfig, _free_port, init_rank, make_batches
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
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
MODEL = ModelConfig(vocab=130, dim=64, n_layers=3, n_heads=4, ffn_hidden=176, seq_len=32, batch=2)
BLOCK = 64  # int8 block size of the check (the default 256 would leave the norms alone anyway)


@dataclass(frozen=True)
class Scenario:
    """One option set, and what it is compared with (picklable: it goes to every rank)."""

    name: str
    what: str
    reference: str = "unsharded"  # or "torch"
    reshard: bool = True
    bf16: bool = False
    int8: bool = False
    offload: bool = False
    checkpointing: bool = False
    accum: int = 1
    prefetch: bool = False
    atol: float = 2e-5
    rtol: float = 1e-4


SCENARIOS = (
    Scenario("fp32", "every block, then the root; default options"),
    Scenario("no-reshard", "reshard_after_forward=False", reshard=False),
    Scenario("prefetch", "explicit forward/backward prefetch, two blocks ahead", prefetch=True),
    Scenario("accum", "2 micro-batches, no gradient sync on the first", accum=2),
    Scenario("checkpoint", "activation checkpointing of every block", checkpointing=True),
    Scenario("offload", "CPUOffloadPolicy (pinned on an accelerator)", offload=True),
    Scenario("int8", f"QuantizationPolicy(all_gather='int8', block_size={BLOCK})", int8=True),
    Scenario("torch-fp32", "defaults, vs torch's fully_shard", reference="torch"),
    Scenario(
        "torch-bf16",
        "MixedPrecisionPolicy(bf16 params, fp32 reduce), vs torch's fully_shard",
        reference="torch",
        bf16=True,
        atol=1e-3,
        rtol=1e-2,
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


def _shard(model: Llama, sc: Scenario, mesh: DeviceMesh, impl: str) -> None:
    """Wrap every block, then the root, with ours (``impl="ours"``) or torch's fully_shard."""
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


def run_scenario(
    sc: Scenario, opts: Options, mesh: DeviceMesh, device: torch.device
) -> dict[str, Any]:
    """Train ours and the reference side by side; the largest differences over all ranks."""
    world, rank = mesh.size(), mesh.get_local_rank()
    torch.manual_seed(opts.seed)
    model = Llama(MODEL).to(device)
    if sc.checkpointing:
        model.layers = nn.ModuleList(Checkpointed(b) for b in model.layers)
    reference = copy.deepcopy(model)
    _shard(model, sc, mesh, "ours")
    if sc.reference == "torch":
        _shard(reference, sc, mesh, "torch")
    policy = fs.QuantizationPolicy("int8", block_size=BLOCK)
    params = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref_params.values(), lr=3e-3)
    b = MODEL.batch
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0}

    def diff(got: Tensor, want: Tensor) -> float:
        got, want = got.detach().to(device).double(), want.detach().to(device).double()
        if got.shape != want.shape:
            raise AssertionError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
        return 0.0 if got.numel() == 0 else float((got - want).abs().max())

    def mine(t: Tensor) -> Tensor:
        """The reference's counterpart of this rank's shard of ``t``."""
        return _local(t) if sc.reference == "torch" else _rows(t, world, rank)

    def train(m: nn.Module, tokens: Tensor, ranks: range, sync: bool) -> Tensor:
        """Each of ``ranks``' micro-batches; the summed loss, each divided by W * accum."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for r in ranks:
            for k in range(sc.accum):
                if sync and sc.accum > 1:
                    m.set_requires_gradient_sync(k == sc.accum - 1)  # type: ignore[operator]
                lo = (r * sc.accum + k) * b
                micro = tokens[lo : lo + b]
                logits = m(micro[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), micro[:, 1:].flatten())
                (loss / sc.accum / (len(ranks) if len(ranks) > 1 else 1)).backward()
                total += loss.detach().double() / sc.accum
        return total

    batches = make_batches(replace(MODEL, batch=b * sc.accum), world, opts.steps, opts.seed)
    for tokens in batches:
        tokens = tokens.to(device)
        loss = train(model, tokens, range(rank, rank + 1), sync=True)
        dist.all_reduce(loss, group=mesh.get_group())
        if sc.reference == "torch":
            ref_loss = train(reference, tokens, range(rank, rank + 1), sync=True)
            dist.all_reduce(ref_loss, group=mesh.get_group())
            ref_loss /= world
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
        diffs["loss"] = max(diffs["loss"], diff(loss / world, ref_loss))
        for n, p in params.items():
            ref_p = ref_params[n]
            if p.grad is None or ref_p.grad is None:
                raise AssertionError(f"{n}: no gradient (ours {p.grad is not None})")
            if sc.offload and _local(p.grad).device.type != "cpu":
                raise AssertionError(f"{n}: offloaded gradient on {_local(p.grad).device}")
            diffs["grad"] = max(diffs["grad"], diff(_local(p.grad), mine(ref_p.grad)))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=True)
    for n, p in params.items():
        diffs["param"] = max(diffs["param"], diff(_local(p), mine(ref_params[n])))
    _check_the_optimizer_holds_the_module_params(model, params, sc)
    group = mesh.get_group()
    result = {k: _max(v, group, device) for k, v in diffs.items()}
    scale = max(abs(float(ref_loss)), 1.0)
    ok = all(
        math.isfinite(v) and v <= sc.atol + sc.rtol * (scale if k == "loss" else 1.0)
        for k, v in result.items()
    )
    return {**result, "status": "PASS" if ok else "FAIL"}


# ---------------------------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------------------------


def _rank_main(rank: int, opts: Options, port: int, out_path: str) -> None:
    timeout = timedelta(seconds=120)
    job = init_rank(rank, opts.world, opts.device, opts.backend, port, timeout)
    device, mesh = job.device, job.mesh
    results: dict[str, Any] = {}
    try:
        for sc in opts.scenarios:
            t0 = time.perf_counter()
            try:
                results[sc.name] = run_scenario(sc, opts, mesh, device)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs, or 2)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--quant-sizes", default="401408,4194304,33554432")
    parser.add_argument("--quant-worlds", default="2,8")
    parser.add_argument("--quant-reps", type=int, default=20)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if args.device == "cuda" else "gloo"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    world = args.nproc or (gpus if backend == "nccl" else 2)
    if backend == "nccl" and world > gpus:
        parser.error(f"NCCL needs a GPU per rank: {world} ranks, {gpus} GPU(s); try --backend gloo")
    names = [s for s in args.only.split(",") if s]
    unknown = sorted(set(names) - {s.name for s in SCENARIOS})
    if unknown:
        parser.error(f"unknown scenarios {unknown}; choose from {[s.name for s in SCENARIOS]}")
    scenarios = tuple(s for s in SCENARIOS if not names or s.name in names)
    opts = Options(args.device, backend, world, args.steps, args.seed, scenarios)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")

    print(f"== device_check: {world} rank(s), {backend} on {args.device}, {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        spawn(_rank_main, args=(opts, _free_port(), out), nprocs=world)  # type: ignore[no-untyped-call]
        results = json.loads(Path(out).read_text())
    failed = False
    print(f"{'scenario':<12} {'reference':<10} {'max|dloss|':>11} {'max|dgrad|':>11} "
          f"{'max|dparam|':>11} {'status':>7}  what")  # fmt: skip
    for sc in scenarios:
        r = results[sc.name]
        if r["status"] == "ERROR":
            print(f"{sc.name:<12} {sc.reference:<10} {'':>35} {'ERROR':>7}  {r['error']}")
            failed |= r["side"] == "ours"
            continue
        failed |= r["status"] != "PASS"
        print(f"{sc.name:<12} {sc.reference:<10} {r['loss']:>11.2e} {r['grad']:>11.2e} "
              f"{r['param']:>11.2e} {r['status']:>7}  {sc.what}")  # fmt: skip

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
    summary = {
        "environment": _environment(device),
        "options": {**asdict(opts), "scenarios": [s.name for s in scenarios]},
        "results": results,
        "quant_costs": costs,
        "ok": not failed,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
