"""``python -m fully_shard.demo``: train a tiny character-level transformer on local gloo ranks.

The demo launches its own ranks (``--nproc``, default 2) on this machine, shards every block
and then the root with :func:`fully_shard`, trains for ``--steps`` AdamW steps on a short
public-domain text, and prints each step's loss, the per-rank parameter memory against what an
unsharded replica would hold, and the bytes each collective moved per step.

Example:
    $ python -m fully_shard.demo --nproc 2 --steps 20
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.multiprocessing.spawn import spawn

from . import CountingComm, fully_shard

# The opening of "The Adventures of Sherlock Holmes" (A. Conan Doyle, 1892; public domain).
TEXT = (
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under any "
    "other name. In his eyes she eclipses and predominates the whole of her sex. It was not "
    "that he felt any emotion akin to love for Irene Adler. All emotions, and that one "
    "particularly, were abhorrent to his cold, precise but admirably balanced mind. He was, I "
    "take it, the most perfect reasoning and observing machine that the world has seen, but as "
    "a lover he would have placed himself in a false position. He never spoke of the softer "
    "passions, save with a gibe and a sneer. They were admirable things for the observer, "
    "excellent for drawing the veil from men's motives and actions. "
)


@dataclass(frozen=True)
class DemoConfig:
    """Model and run sizes for the demo."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 32
    batch_per_rank: int = 8
    steps: int = 20
    lr: float = 3e-3
    reshard_after_forward: bool = True


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a SwiGLU MLP."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        hidden = 4 * dim * 2 // 3
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # (b, s, 3d) -> 3 x (b, heads, s, d / heads)
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.n_heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        out: torch.Tensor = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return out


class TinyLM(nn.Module):
    """A character-level language model with tied input and output embeddings."""

    def __init__(self, vocab: int, cfg: DemoConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.02)
        self.layers = nn.ModuleList(Block(cfg.dim, cfg.n_heads) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # tied: keep the initial logits small

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def _param_bytes(model: nn.Module, local: bool) -> int:
    total = 0
    for p in model.parameters():
        t = p.to_local() if local and hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def _worker(rank: int, world: int, port: int, cfg: DemoConfig) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        _train(rank, world, cfg)
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, cfg: DemoConfig) -> None:
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    torch.manual_seed(0)
    model = TinyLM(len(chars), cfg)
    unsharded_bytes = _param_bytes(model, local=False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mesh=mesh)
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]  # FSDPModule method after the class swap
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sharded_bytes = _param_bytes(model, local=True)
    gen = torch.Generator().manual_seed(1234)
    if rank == 0:
        print(
            f"fully_shard demo: {world} gloo ranks, {sum(p.numel() for p in model.parameters())}"
            f" parameters, {cfg.n_layers} blocks + root = {cfg.n_layers + 1} groups"
        )
    for step in range(cfg.steps):
        # The same global batch on every rank; rank r trains on its slice.
        starts = torch.randint(
            0, len(data) - cfg.seq_len - 1, (world * cfg.batch_per_rank,), generator=gen
        )
        mine = starts[rank * cfg.batch_per_rank : (rank + 1) * cfg.batch_per_rank]
        x = torch.stack([data[s : s + cfg.seq_len] for s in mine.tolist()])
        y = torch.stack([data[s + 1 : s + cfg.seq_len + 1] for s in mine.tolist()])
        comm.reset()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch's stubs
        optim.step()
        optim.zero_grad()
        elapsed = time.perf_counter() - t0
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        if rank == 0:
            moved = comm.bytes_by_op()
            print(
                f"step {step + 1:3d}  loss {mean_loss.item():.4f}  {elapsed * 1e3:7.1f} ms  "
                f"all-gather {moved.get('all_gather', 0) / 1024:7.1f} KiB  "
                f"reduce-scatter {moved.get('reduce_scatter', 0) / 1024:7.1f} KiB"
            )
    memory = torch.tensor([sharded_bytes], dtype=torch.float64)
    per_rank = [torch.zeros_like(memory) for _ in range(world)]
    dist.all_gather(per_rank, memory)
    if rank == 0:
        print(f"initial loss would be ~ln({len(chars)}) = {math.log(len(chars)):.4f}")
        for r, b in enumerate(per_rank):
            print(
                f"rank {r}: sharded parameters {b.item() / 1024:8.1f} KiB   "
                f"unsharded replica {unsharded_bytes / 1024:8.1f} KiB   "
                f"({b.item() / unsharded_bytes:.0%})"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and launch the demo's ranks.

    Example:
        >>> main(["--nproc", "2", "--steps", "5"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(prog="python -m fully_shard.demo", description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="number of local ranks (gloo)")
    parser.add_argument("--steps", type=int, default=DemoConfig.steps)
    parser.add_argument("--layers", type=int, default=DemoConfig.n_layers)
    parser.add_argument("--dim", type=int, default=DemoConfig.dim)
    parser.add_argument(
        "--reshard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="free each block's parameters after its forward (default) or keep them",
    )
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    cfg = DemoConfig(
        dim=args.dim, n_layers=args.layers, steps=args.steps, reshard_after_forward=args.reshard
    )
    spawn(_worker, args=(args.nproc, _free_port(), cfg), nprocs=args.nproc)  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
