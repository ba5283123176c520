"""Checkpoints: sharded save/load with ``torch.distributed.checkpoint`` (DCP), and one full,
unsharded state dict for inference or export with ``get_model_state_dict``.

    torchrun --standalone --nproc-per-node 2 examples/checkpoint.py --dir /tmp/ckpt

A DCP checkpoint stores each rank's shards plus the global shapes, so it loads at another
world size or mesh shape too.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from toy import ToyLM, batch, log, loss_fn

from fully_shard import fully_shard, init_distributed


def build(mesh: DeviceMesh, device: torch.device, seed: int) -> tuple[ToyLM, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = ToyLM().to(device)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: ToyLM, optim: torch.optim.Optimizer, steps: range, device: torch.device) -> None:
    for step in steps:
        tokens, targets = batch(step, device=device)
        loss_fn(model(tokens), targets).backward()
        optim.step()
        optim.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None, help="default: a new temporary dir")
    args = parser.parse_args()
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    where = [str(args.dir) if args.dir else tempfile.mkdtemp(prefix="fully_shard_ckpt_")]
    dist.broadcast_object_list(where)  # every rank writes to rank 0's directory
    root = Path(where[0])

    # 1. Train, then save sharded model and optimizer state: every rank writes its shards.
    model, optim = build(mesh, job.device, seed=0)
    train(model, optim, range(2), job.device)
    model_sd, optim_sd = get_state_dict(model, optim)  # DTensor values, no gathering
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root / "dcp")
    tokens, _ = batch(100, device=job.device)
    with torch.no_grad():
        want = model(tokens)

    # 2. Resume: a fresh model (other weights) loads the checkpoint in place.
    resumed, resumed_optim = build(mesh, job.device, seed=1)
    model_sd, optim_sd = get_state_dict(resumed, resumed_optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=root / "dcp")
    set_state_dict(
        resumed, resumed_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    with torch.no_grad():
        got = resumed(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    log("resumed from DCP: outputs identical")
    train(resumed, resumed_optim, range(2, 3), job.device)  # training goes on from the loaded state

    # 3. One full state dict (gathered, on CPU, rank 0 only) for a plain unsharded model on
    # the CPU, where a single-process consumer (an evaluation job, an export) would load it.
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        torch.save(full, root / "full.pt")
        plain = ToyLM()
        plain.load_state_dict(torch.load(root / "full.pt"))
        with torch.no_grad():
            # 1e-5: on a GPU the sharded model's kernels are not the CPU's
            torch.testing.assert_close(plain(tokens.cpu()), want.cpu(), rtol=1e-5, atol=1e-5)
        log(f"full state dict ({len(full)} tensors) loads into an unsharded ToyLM")
    job.shutdown()


if __name__ == "__main__":
    main()
