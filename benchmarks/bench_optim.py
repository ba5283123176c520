"""The Muon optimizer step on sharded parameters: ours, torch's on the shards, torch's unsharded.

For each world size of ``--nprocs`` (default ``2,4``) one command spawns that many local
ranks (``init_distributed``: gloo on CPU, or NCCL and a GPU each with ``--device cuda``),
builds ``bench_train.py``'s Llama-style model (``--size``, default ``medium``) from one seed
three times and times only the optimizer step over its hidden matrices (attention and
feed-forward weights; embeddings, head and norms would go to AdamW):

* ``ours``: :class:`fully_shard.Muon` on the model sharded by :func:`fully_shard.fully_shard`;
* ``torch-sharded``: ``torch.optim.Muon`` on the same sharded model (its Newton-Schulz
  matmuls run as DTensor matmuls over the shards);
* ``torch-unsharded``: ``torch.optim.Muon`` on an unsharded replica, on rank 0 alone while the
  other ranks wait: the step one process would take.

Every model gets the same gradients (one backward on the same global batch, copied), then one
checked step: the largest difference of each sharded model's parameters from the unsharded
one's. Then the timed steps run interleaved (rotating order), each step's time the slowest
rank's (wall clock, and CPU seconds of all the rank's threads, which a machine whose cores
are busy with other work inflates less). It prints the median step time of each, the ratios,
the bytes ``all_to_all_single`` sent per step by ours against the exchange's theory (each
matrix's rows gathered to its owner once and sent back once, bf16 both ways), and, last, one
JSON object with every number.

Example:
    $ python benchmarks/bench_optim.py --size medium --nprocs 2,4 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from bench_train import SIZES, Llama, _free_port, init_rank, make_batches
from torch import nn
from torch.distributed.tensor import DTensor

import fully_shard
from fully_shard.optim import muon as muon_module
from fully_shard.optim.exchange import assign_owners, row_bounds

IMPLS = ("ours", "torch-sharded", "torch-unsharded")


def hidden(model: nn.Module) -> list[nn.Parameter]:
    """The matrices Muon is for: every 2-D weight but the embedding and the output head."""
    return [
        p
        for n, p in model.named_parameters()
        if p.ndim == 2 and not n.startswith(("tok_embeddings", "output"))
    ]


def theory_bytes(shapes: list[tuple[int, int]], world: int) -> int:
    """Bytes all ranks send per step: each row off its owner goes there and back in bf16."""
    owners = assign_owners([muon_module.newton_schulz_flops(s, 5) for s in shapes], world)
    total = 0
    for (rows, cols), owner in zip(shapes, owners, strict=True):
        start, stop = row_bounds(rows, world, owner)
        total += (rows - (stop - start)) * cols * 2 * 2
    return total


def _models(size: str, mesh: Any, device: torch.device) -> dict[str, nn.Module]:
    out = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        model = Llama(SIZES[size]).to(device)
        if impl != "torch-unsharded":
            for block in model.layers:
                fully_shard.fully_shard(block, mesh=mesh)
            fully_shard.fully_shard(model, mesh=mesh)
        out[impl] = model
    return out


def _same_gradients(models: dict[str, nn.Module], size: str, device: torch.device) -> None:
    """One backward of ``ours`` on this rank's rows; the others get the very same gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = SIZES[size]
    tokens = make_batches(cfg, world, 1, seed=0)[0].to(device)
    mine = tokens[rank * cfg.batch : (rank + 1) * cfg.batch]
    logits = models["ours"](mine[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()
    named = {k: dict(m.named_parameters()) for k, m in models.items()}
    for name, p in named["ours"].items():
        grad = p.grad
        assert isinstance(grad, DTensor)
        named["torch-sharded"][name].grad = grad.clone()
        named["torch-unsharded"][name].grad = grad.full_tensor()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    diffs = [
        (p.full_tensor() - q).abs().max().item()  # type: ignore[attr-defined]
        for p, q in zip(hidden(a), hidden(b), strict=True)
    ]
    return max(diffs)


def _rank_main(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    job = init_rank(rank, world, args.device, "auto", port, timeout=timedelta(minutes=10))
    device, mesh = job.device, job.mesh
    models = _models(args.size, mesh, device)
    _same_gradients(models, args.size, device)
    optims = {
        "ours": fully_shard.Muon(hidden(models["ours"]), lr=0.02),
        "torch-sharded": torch.optim.Muon(hidden(models["torch-sharded"]), lr=0.02),
        "torch-unsharded": torch.optim.Muon(hidden(models["torch-unsharded"]), lr=0.02),
    }
    sent = [0]
    all_to_all = dist.all_to_all_single

    def counting(o: Any, i: torch.Tensor, os_: Any, is_: Any, **kw: Any) -> Any:
        sent[0] += (i.numel() - is_[dist.get_rank(kw["group"])]) * i.element_size()
        return all_to_all(o, i, os_, is_, **kw)

    dist.all_to_all_single = counting  # type: ignore[assignment]  # this process only
    times: dict[str, list[float]] = {k: [] for k in IMPLS}
    cpu: dict[str, list[float]] = {k: [] for k in IMPLS}
    for step in range(args.warmup + args.steps + 1):
        order = IMPLS[step % 3 :] + IMPLS[: step % 3]
        sent[0] = 0
        for impl in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if impl != "torch-unsharded" or rank == 0:
                optims[impl].step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            spent = [time.perf_counter() - t0, time.process_time() - c0]
            elapsed = torch.tensor(spent, dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step > args.warmup:
                times[impl].append(elapsed[0].item())
                cpu[impl].append(elapsed[1].item())
        if step == 0:  # the checked step: all three from the same state, same gradients
            first = {
                "ours": _max_diff(models["ours"], models["torch-unsharded"]),
                "torch-sharded": _max_diff(models["torch-sharded"], models["torch-unsharded"]),
                "bytes_sent": sent[0],
            }
    sent_all = torch.tensor([first["bytes_sent"]], dtype=torch.int64)
    dist.all_reduce(sent_all)
    shapes = [tuple(p.shape) for p in hidden(models["ours"])]
    result = {
        "world": world,
        "matrices": len(shapes),
        "median_s": {k: statistics.median(v) for k, v in times.items()},
        "median_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "max_diff_vs_unsharded": {k: first[k] for k in ("ours", "torch-sharded")},
        "bytes_per_step": int(sent_all.item()),
        "theory_bytes_per_step": theory_bytes(shapes, world),  # type: ignore[arg-type]
    }
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    job.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--nprocs", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    results = []
    for world in (int(w) for w in args.nprocs.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            mp.spawn(_rank_main, args=(world, args, _free_port(), out), nprocs=world)
            results.append(json.loads(Path(out).read_text()))
    print(f"Muon step over the hidden matrices of --size {args.size} ({args.device})")
    for r in results:
        med = r["median_s"]
        print(
            f"W={r['world']}: {r['matrices']} matrices; step ours {med['ours'] * 1e3:.1f} ms, "
            f"torch.optim.Muon sharded {med['torch-sharded'] * 1e3:.1f} ms, "
            f"unsharded {med['torch-unsharded'] * 1e3:.1f} ms; ours / unsharded "
            f"{med['ours'] / med['torch-unsharded']:.2f}, ours / torch sharded "
            f"{med['ours'] / med['torch-sharded']:.2f}"
        )
        cpu = r["median_cpu_s"]
        print(
            f"    CPU seconds of the busiest rank (all its threads): ours {cpu['ours']:.3f}, "
            f"torch sharded {cpu['torch-sharded']:.3f}, unsharded {cpu['torch-unsharded']:.3f}; "
            f"ours / unsharded {cpu['ours'] / cpu['torch-unsharded']:.2f}"
        )
        diff = r["max_diff_vs_unsharded"]
        print(
            f"    max |param - unsharded| after one step: ours {diff['ours']:.1e}, torch "
            f"sharded {diff['torch-sharded']:.1e}; bytes per step {r['bytes_per_step']} "
            f"(theory {r['theory_bytes_per_step']})"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
