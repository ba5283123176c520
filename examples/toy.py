"""The small model and data the example scripts share (imported by bare name: torchrun puts
the script's folder on ``sys.path``).

``ToyLM`` is a tiny pre-norm language model: ``embed`` -> ``layers`` (residual MLP blocks) ->
``norm`` -> ``head``. Its blocks sit in ``self.layers``, the usual place for per-block wrapping.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB = 64
SEQ = 16


class Block(nn.Module):
    """``x + mlp(norm(x))``: (B, S, dim) -> (B, S, dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        self.up.reset_parameters()
        self.down.reset_parameters()


class ToyLM(nn.Module):
    """tokens (B, S) int64 -> logits (B, S, VOCAB)."""

    def __init__(self, dim: int = 32, n_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        logits: Tensor = self.head(self.norm(h))
        return logits

    def reset_parameters(self) -> None:
        self.embed.reset_parameters()
        for layer in self.layers:
            layer.reset_parameters()  # type: ignore[operator]
        self.norm.reset_parameters()
        self.head.reset_parameters()


def batch(
    step: int, rows: int = 4, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """This rank's (tokens, targets) for ``step`` on ``device``: different data on every rank.

    Drawn on the CPU, then moved, so every device sees the same numbers.
    """
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    seq = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen).to(device)
    return seq[:, :-1], seq[:, 1:]


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def log(message: str) -> None:
    """Print on rank 0 only."""
    if dist.get_rank() == 0:
        print(message, flush=True)
