"""Train a Llama-style model on a 2-D mesh: tensor parallel + fully_shard, or HSDP.

    torchrun --standalone --nproc-per-node 4 examples/train_llama_2d.py              # TP 2 x DP 2
    torchrun --standalone --nproc-per-node 4 examples/train_llama_2d.py --mode hsdp  # 2 x 2 HSDP
    torchrun --standalone --nproc-per-node 4 examples/train_llama_2d.py --compile aot_eager

Runs on CPU with gloo (NCCL on GPUs). Every rank also trains an unsharded replica on the whole
global batch and the script ends by printing the largest difference between the two models'
parameters (``--no-check`` skips it), so the run shows that the 2-D layout computes exactly
what one process would. With ``--checkpoint DIR`` it saves a DCP checkpoint at the end. With
``--compile BACKEND`` the sharded model is compiled whole (``torch.compile(model,
fullgraph=True)``): its gathers, reductions and the TP collectives are in one forward and one
backward graph, and the printed difference is the same.
"""

from __future__ import annotations

import argparse
import copy

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["tp", "hsdp"], default="tp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="rows per data-parallel rank")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--checkpoint", default=None, help="save a DCP checkpoint here")
    parser.add_argument(
        "--compile", default=None, metavar="BACKEND", help="compile the whole model (inductor, ...)"
    )
    args = parser.parse_args()

    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    device, world, rank = job.device, job.world_size, job.rank
    if world % 2:
        raise SystemExit(f"a 2-D mesh needs an even number of ranks, got {world}")

    torch.manual_seed(0)
    model = Llama().to(device)
    reference = copy.deepcopy(model) if args.check else None
    if args.mode == "tp":
        # dp x tp = (world / 2) x 2: TP inside each pair of ranks, FSDP across the pairs.
        root = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, root["tp"])
        dp_mesh = root["dp"]
        dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    else:
        # replicate x shard = 2 x (world / 2): gradients reduce-scattered inside each half,
        # all-reduced across the halves; all ranks are data parallel.
        dp_mesh = init_device_mesh(
            device.type, (2, world // 2), mesh_dim_names=("replicate", "shard")
        )
        dp_size, dp_rank = world, rank
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    run = (
        model
        if args.compile is None
        else torch.compile(model, backend=args.compile, fullgraph=True)
    )

    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=3e-3) if reference else None
    for step in range(args.steps):
        tokens, targets = batch(step, dp_size * args.batch)
        lo = dp_rank * args.batch
        logits = run(tokens[lo : lo + args.batch].to(device))
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets[lo : lo + args.batch].flatten().to(device)
        )
        loss.backward()
        # one mesh for every parameter (the TP plan makes even the norms DTensors)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
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
        name, p = next(iter(model.named_parameters()))
        assert isinstance(p, DTensor)
        print(f"{name}: {p.device_mesh} {p.placements}, local {tuple(p.to_local().shape)}")
    if reference is not None:
        ref_params = dict(reference.named_parameters())
        diff = max(
            (p.full_tensor() - ref_params[n]).abs().max().item()
            for n, p in model.named_parameters()
        )
        if rank == 0:
            print(f"max |2-D - unsharded| over all parameters: {diff:.2e}")
        if diff > 1e-4:
            raise SystemExit(f"the 2-D model drifted from the unsharded replica by {diff:.2e}")
    if args.checkpoint:
        model_sd, optim_sd = get_state_dict(model, optim)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint)
        if rank == 0:
            print(f"saved a DCP checkpoint to {args.checkpoint}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
