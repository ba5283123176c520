"""Resumable training with fully_shard: checkpoint every k steps, survive a rank dying.

Run it under torchrun with restarts; when any rank dies, torchrun stops the others and starts
the group again, and every rank resumes from the newest *complete* checkpoint::

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/train_resumable.py --steps 20 --ckpt-every 5 --ckpt-dir /tmp/ckpt

What a checkpoint holds, so that a resumed run continues bit for bit where it stopped:

- model and optimizer state (sharded DTensors, saved with ``torch.distributed.checkpoint``, so
  a checkpoint also loads at another world size);
- the step and the data position (how many samples of the deterministic stream were used);
- each rank's torch RNG state (dropout draws differ per rank; the GPU's too on a GPU), in
  ``rank<r>.pt``.

A checkpoint is written into ``step_<n>.partial/`` and renamed to ``step_<n>/`` by rank 0 only
after every rank has finished writing, so a kill in the middle of a save leaves a ``.partial``
directory that is never loaded (and is deleted at the next start). ``os.rename`` of a directory
is atomic on POSIX file systems.

``--crash ATTEMPT:RANK:STEP:WHEN`` makes a rank kill itself (``os._exit``) on a given torchrun
attempt, at ``STEP`` either mid-step (``WHEN=step``, after backward, before the optimizer
step) or mid-save (``WHEN=save``, after its shards are written, before the rename): the test
suite uses it to check that the final parameters equal an uninterrupted run's exactly.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from fully_shard import Distributed, fully_shard, init_distributed

_DONE = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Crash:
    """Kill ``rank`` on torchrun attempt ``attempt`` at ``step``, mid-``when`` (step or save)."""

    attempt: int
    rank: int
    step: int
    when: str

    @classmethod
    def parse(cls, text: str) -> Crash:
        attempt, rank, step, when = text.split(":")
        if when not in ("step", "save"):
            raise argparse.ArgumentTypeError(f"--crash WHEN must be step or save, got {when!r}")
        return cls(int(attempt), int(rank), int(step), when)


@dataclass(frozen=True)
class Config:
    """One training run. ``ckpt_dir=None`` trains without checkpoints (the reference run)."""

    steps: int = 12
    ckpt_every: int = 3
    ckpt_dir: str | None = None
    batch: int = 4  # rows per rank per step
    seed: int = 0
    crashes: tuple[Crash, ...] = field(default_factory=tuple)


class Net(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 16, 16, 4)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Dropout(0.1))
            for a, b in itertools.pairwise(dims)
        )

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _batch(cfg: Config, samples_seen: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """This rank's rows of the global batch that starts at sample ``samples_seen``.

    The stream is a pure function of the position, so a resumed run reads the same data.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + samples_seen)
    x = torch.randn(world * cfg.batch, 8, generator=gen)
    y = torch.randn(world * cfg.batch, 4, generator=gen)
    rows = slice(rank * cfg.batch, (rank + 1) * cfg.batch)
    return x[rows].to(device), y[rows].to(device)


def _maybe_crash(cfg: Config, step: int, when: str) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for c in cfg.crashes:
        if (c.attempt, c.rank, c.step, c.when) == (attempt, dist.get_rank(), step, when):
            print(f"[rank {c.rank}] crashing at step {step} during {when}", flush=True)
            os._exit(1)


def _latest(ckpt_dir: Path) -> Path | None:
    done = [p for p in ckpt_dir.glob("step_*") if _DONE.match(p.name) and p.is_dir()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def save(cfg: Config, model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """Write checkpoint ``step`` to ``step_<n>.partial/``, then rename it complete."""
    if cfg.ckpt_dir is None:
        raise ValueError("save needs a ckpt_dir")
    final = Path(cfg.ckpt_dir) / f"step_{step:06d}"
    partial = final.with_name(final.name + ".partial")
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    extra = {"step": step, "samples_seen": step * cfg.batch * dist.get_world_size()}
    rng = {"rng": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # dropout on a GPU draws from the GPU's generator
        rng["cuda_rng"] = torch.cuda.get_rng_state()
    torch.save({**extra, **rng}, partial / f"rank{dist.get_rank()}.pt")
    _maybe_crash(cfg, step, "save")
    dist.barrier()  # every rank's files are written before the checkpoint becomes complete
    if dist.get_rank() == 0:
        os.rename(partial, final)
    dist.barrier()


def load(cfg: Config, model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Resume from the newest complete checkpoint; return the last step it holds (0: none)."""
    if cfg.ckpt_dir is None:
        return 0
    ckpt_dir = Path(cfg.ckpt_dir)
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob("step_*.partial"):
            print(f"[rank 0] ignoring incomplete checkpoint {stale.name}", flush=True)
            shutil.rmtree(stale)
    dist.barrier()
    latest = _latest(ckpt_dir)
    if latest is None:
        return 0
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(latest))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(latest / f"rank{dist.get_rank()}.pt", weights_only=True)
    torch.set_rng_state(extra["rng"])
    if "cuda_rng" in extra:
        torch.cuda.set_rng_state(extra["cuda_rng"])
    step = int(extra["step"])
    if extra["samples_seen"] != step * cfg.batch * dist.get_world_size():
        raise RuntimeError(f"{latest}: data position does not match step {step}")
    if dist.get_rank() == 0:
        print(f"[rank 0] resumed from {latest.name}", flush=True)
    return step


def train(cfg: Config, job: Distributed) -> dict[str, Tensor]:
    """Train ``cfg.steps`` steps (resuming if a checkpoint exists); return the full params."""
    torch.manual_seed(cfg.seed)  # identical initial parameters on every rank
    model = Net().to(job.device)
    mesh = job.mesh
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(cfg.seed + 1 + dist.get_rank())  # dropout differs per rank
    start = load(cfg, model, optim)
    for step in range(start + 1, cfg.steps + 1):
        x, y = _batch(cfg, (step - 1) * cfg.batch * dist.get_world_size(), job.device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        _maybe_crash(cfg, step, "step")
        optim.step()
        optim.zero_grad()
        if cfg.ckpt_dir is not None and step % cfg.ckpt_every == 0:
            save(cfg, model, optim, step)
    full = {}
    for name, p in model.named_parameters():
        full[name] = (p.full_tensor() if isinstance(p, DTensor) else p.detach()).cpu()
    return full


def _join() -> Distributed:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return init_distributed()
    # Under torchrun every attempt meets in the same rendezvous store. Seen on torch 2.13: a
    # restarted group sometimes hangs in gloo's connect, finding keys the dead attempt left;
    # a prefix per attempt keeps each attempt's keys apart.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The agent hosts the store (the default) or, with the agent store off, rank 0 does.
    host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(  # type: ignore[attr-defined]  # public, not in __all__
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=host
    )
    prefixed = dist.PrefixStore(f"train_resumable/attempt{attempt}", store)
    # No backend named: torch makes one per device type (gloo for CPU tensors, NCCL for CUDA
    # ones), and init_distributed() keeps this group and picks the device.
    dist.init_process_group(store=prefixed, rank=rank, world_size=world)
    return init_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ckpt-every", type=int, default=3)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--out", help="rank 0 saves the final full parameters here")
    parser.add_argument("--crash", type=Crash.parse, action="append", default=[])
    args = parser.parse_args()
    torch.set_num_threads(1)  # bitwise reproducible CPU kernels, whatever the core count
    job = _join()
    cfg = Config(args.steps, args.ckpt_every, args.ckpt_dir, crashes=tuple(args.crash))
    full = train(cfg, job)
    if args.out and dist.get_rank() == 0:
        torch.save(full, args.out)
        print(f"[rank 0] finished {cfg.steps} steps", flush=True)
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
