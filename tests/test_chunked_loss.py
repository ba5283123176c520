"""The chunked-loss pattern, side by side with torch's ``fully_shard`` and an unsharded model.

Large-vocabulary training computes the loss in chunks so that the full ``(tokens, vocab)``
logits never exist at once: the model's forward stops at the final norm, and the output
projection is called on its own, once per chunk, after the root forward has returned. With
FSDP2 the norm and the head are one group (``fully_shard([norm, head])``), so the group's
forward is cut in two: the norm runs inside the root forward, the head several times outside
it, and backward reaches the head once per chunk before it reaches the norm.

Variants: weight tying (the head's weight is the embedding's, so the head is left in the root
group, called per chunk after the root forward), bf16 mixed precision, activation
checkpointing of the blocks. Each step compares the loss and every gradient with torch's and
the reference's (1e-5 in fp32; bf16 against torch only, which rounds the same way), and the
parameters after three AdamW steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, tests only
from torch.utils.checkpoint import checkpoint

from fully_shard import MixedPrecisionPolicy, fully_shard
from harness import mesh_1d, run_distributed
from parity import needs_torch_fsdp2_on_cpu, train_beside_torch

pytestmark = needs_torch_fsdp2_on_cpu

VOCAB, DIM, SEQ, ROWS, CHUNKS = 32, 8, 6, 2, 3  # ROWS sequences per rank, CHUNKS loss chunks


class Block(nn.Module):
    def __init__(self, use_checkpoint: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.use_checkpoint = use_checkpoint

    def _run(self, h: Tensor) -> Tensor:
        return h + torch.tanh(self.fc(h))

    def forward(self, h: Tensor) -> Tensor:
        if self.use_checkpoint:
            out: Tensor = checkpoint(self._run, h, use_reentrant=False)
            return out
        return self._run(h)


class ChunkedLM(nn.Module):
    """``forward`` returns the normed hidden states; :func:`chunked_loss` applies the head."""

    def __init__(self, tie: bool, use_checkpoint: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(use_checkpoint) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.norm(h)
        return out


def chunked_loss(model: ChunkedLM, hidden: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over all tokens, the head applied to one chunk of tokens at a time."""
    flat, flat_targets = hidden.reshape(-1, DIM), targets.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(flat.chunk(CHUNKS), flat_targets.chunk(CHUNKS), strict=True):
        total = total + F.cross_entropy(model.head(h).float(), t, reduction="sum")
    return total / flat_targets.numel()


def _wrap(model: ChunkedLM, shard: Callable[..., Any], tie: bool, **options: Any) -> None:
    mesh = mesh_1d()
    for layer in model.layers:
        shard(layer, mesh=mesh, **options)
    if not tie:
        # The pattern: one group whose forward skips the head.
        shard([model.norm, model.head], mesh=mesh, **options)
    # Tied: the shared weight belongs to the root group with the embedding and the head.
    shard(model, mesh=mesh, **options)


def _chunked_side_by_side(tie: bool, use_checkpoint: bool, mixed: bool) -> int:
    torch.manual_seed(0)
    base = ChunkedLM(tie, use_checkpoint)
    models: dict[str, ChunkedLM] = {
        "ours": copy.deepcopy(base),
        "torch": copy.deepcopy(base),
        "ref": base,
    }
    ours_opts: dict[str, Any] = {}
    torch_opts: dict[str, Any] = {}
    if mixed:
        ours_opts["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        torch_opts["mp_policy"] = TorchMixedPrecisionPolicy(torch.bfloat16, torch.float32)
    _wrap(models["ours"], fully_shard, tie, **ours_opts)
    _wrap(models["torch"], torch_fully_shard, tie, **torch_opts)
    # bf16 compute: the fp32 reference differs by rounding; torch computes what we compute.
    pairs = [("torch", "ours")] + ([] if mixed else [("ref", "ours")])
    atol = 2e-3 if mixed else 1e-5
    world = dist.get_world_size()

    def batch(step: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (world * ROWS, SEQ), generator=gen)
        targets = torch.randint(0, VOCAB, (world * ROWS, SEQ), generator=gen)
        return ids, targets

    def loss(m: Any, x: Tensor, t: Tensor) -> Tensor:  # m: a ChunkedLM
        return chunked_loss(m, m(x), t)

    return train_beside_torch(models, batch, loss, ROWS, pairs=pairs, atol=atol)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_chunked_loss_trains_like_torch_and_the_unsharded_model(world: int, tie: bool) -> None:
    counts = run_distributed(_chunked_side_by_side, world, tie, False, False, timeout=240)
    assert counts[0] > 0  # every gradient of every step was compared


@pytest.mark.parametrize(
    ("tie", "use_checkpoint", "mixed"),
    [(False, True, False), (True, True, False), (False, False, True), (True, True, True)],
    ids=["untied-ac", "tied-ac", "untied-bf16", "tied-ac-bf16"],
)
def test_chunked_loss_with_checkpointing_and_mixed_precision(
    tie: bool, use_checkpoint: bool, mixed: bool
) -> None:
    counts = run_distributed(_chunked_side_by_side, 2, tie, use_checkpoint, mixed, timeout=240)
    assert counts[0] > 0
