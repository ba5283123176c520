"""Train a Llama-style model with HSDP + tensor parallel on a 3-D (replicate, shard, tp) mesh.

    torchrun --standalone --nproc-per-node 8 examples/train_llama_3d.py            # 2 x 2 x 2
    torchrun --standalone --nproc-per-node 4 examples/train_llama_3d.py            # 2 x 1 x 2
    torchrun --standalone --nproc-per-node 4 examples/train_llama_3d.py --shape 1 2 2

Runs on CPU with gloo (NCCL on GPUs). Tensor parallel inside each group of ``tp`` ranks,
fully_shard over the ``shard`` dim, replicas over the ``replicate`` dim. Every rank also
trains an unsharded replica on the whole global batch, and the script ends by printing the
largest difference between the two models' parameters (``--no-check`` skips it); it exits
non-zero if they drift apart. With ``--checkpoint DIR`` it saves a DCP checkpoint at the end,
which any other layout (1-D FSDP, a plain model) can load.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from llama import Llama, apply_tensor_parallel
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from fully_shard import fully_shard, init_distributed

VOCAB, SEQ = 64, 16


def batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences with a random start: the next token is the current one plus one."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=gen)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def default_shape(world: int) -> tuple[int, int, int]:
    """TP over 2 ranks, then 2 replicas if that divides, the rest sharded: 8 -> 2 x 2 x 2."""
    tp = 2 if world % 2 == 0 else 1
    rest = world // tp
    replicate = 2 if rest % 2 == 0 else 1
    return replicate, rest // replicate, tp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, metavar=("REPLICATE", "SHARD", "TP"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="rows per data-parallel rank")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--checkpoint", default=None, help="save a DCP checkpoint here")
    args = parser.parse_args()

    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    device, world, rank = job.device, job.world_size, job.rank
    shape = tuple(args.shape) if args.shape else default_shape(world)
    if shape[0] * shape[1] * shape[2] != world:
        raise SystemExit(
            f"--shape {shape} needs {shape[0] * shape[1] * shape[2]} ranks, got {world}"
        )

    root = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh = root["replicate", "shard"]  # the 2-D (replicate, shard) HSDP mesh
    # The data-parallel rank: TP peers (same replicate and shard index) see the same rows.
    dp_size = shape[0] * shape[1]
    dp_rank = root["replicate"].get_local_rank() * shape[1] + root["shard"].get_local_rank()

    torch.manual_seed(0)
    model = Llama().to(device)
    reference = copy.deepcopy(model) if args.check else None
    apply_tensor_parallel(model, root["tp"])  # first TP, as with torch's fully_shard
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)

    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=3e-3) if reference else None
    step_times = []
    for step in range(args.steps):
        tokens, targets = batch(step, dp_size * args.batch)
        lo = dp_rank * args.batch
        start = time.perf_counter()
        logits = model(tokens[lo : lo + args.batch].to(device))
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets[lo : lo + args.batch].flatten().to(device)
        )
        loss.backward()
        # one mesh for every parameter (the TP plan makes even the norms DTensors)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        step_times.append(time.perf_counter() - start)
        if reference is not None and ref_optim is not None:
            ref_logits = reference(tokens.to(device))
            ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten().to(device))
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
            ref_optim.step()
            ref_optim.zero_grad()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    if rank == 0:
        print(f"mesh {root}")
        for name in ("layers.0.attention.wq.weight", "layers.0.attention.wo.weight"):
            p = model.get_parameter(name)
            assert isinstance(p, DTensor)
            print(f"{name}: {p.placements}, local {tuple(p.to_local().shape)} of {tuple(p.shape)}")
        last = step_times[len(step_times) // 2 :]
        print(f"{1000 * sum(last) / len(last):.1f} ms/step (mean of the last {len(last)})")
    if reference is not None:
        ref_params = dict(reference.named_parameters())
        diff = max(
            (p.full_tensor() - ref_params[n]).abs().max().item()
            for n, p in model.named_parameters()
        )
        if rank == 0:
            print(f"max |3-D - unsharded| over all parameters: {diff:.2e}")
        if diff > 1e-4:
            raise SystemExit(f"the 3-D model drifted from the unsharded replica by {diff:.2e}")
    if args.checkpoint:
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint)
        if rank == 0:
            print(f"saved a DCP checkpoint to {args.checkpoint}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
