"""Muon for the hidden matrices, AdamW for the rest, on a sharded model: exactly torch's Muon.

    torchrun --standalone --nproc-per-node 2 examples/muon.py

``fully_shard.Muon`` takes ``torch.optim.Muon``'s arguments. It orthogonalizes each hidden
matrix once in the whole job, whole, on an owner rank, and sends the rows back, so given the
same gradients it steps exactly like ``torch.optim.Muon`` on the unsharded model (which, run
on the shards directly, would multiply sharded bf16 matrices and drift). The script trains
the sharded model and, beside it, an unsharded replica that steps on the very same gradients
(the sharded ones, gathered), then prints the largest parameter difference (zero) and how
many Newton-Schulz runs the whole job made (one per matrix per step); it exits non-zero
otherwise.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from toy import ToyLM, batch, log, loss_fn

import fully_shard
from fully_shard import fully_shard as shard

STEPS = 3


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's: the blocks' 2-D weights, AdamW's: embedding, head, norms, biases)."""
    matrices, rest = [], []
    for name, p in model.named_parameters():
        hidden = name.startswith("layers.") and p.ndim == 2
        (matrices if hidden else rest).append(p)
    return matrices, rest


def optimizers(model: nn.Module, muon: type[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    matrices, rest = split(model)
    return [muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


def main() -> None:
    job = fully_shard.init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM().to(job.device)
    reference = copy.deepcopy(model)  # unsharded, with torch.optim.Muon: what we must equal
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    ours, theirs = optimizers(model, fully_shard.Muon), optimizers(reference, torch.optim.Muon)

    calls = [0]  # only to show the work: every matrix is orthogonalized once per step
    orthogonalize = fully_shard.optim.muon.orthogonalize

    def counted(*args: object) -> torch.Tensor:
        calls[0] += 1
        return orthogonalize(*args)  # type: ignore[arg-type]

    fully_shard.optim.muon.orthogonalize = counted  # type: ignore[assignment]
    for step in range(STEPS):
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            q.grad = p.grad.full_tensor()  # type: ignore[union-attr]  # the same gradients
        for opt in (*ours, *theirs):
            opt.step()
            opt.zero_grad()
        log(f"step {step}: loss {loss.item():.4f}")
    fully_shard.optim.muon.orthogonalize = orthogonalize

    total = torch.tensor([calls[0]], device=job.device)
    dist.all_reduce(total)
    (ours_muon, ours_adamw), (ref_muon, ref_adamw) = split(model), split(reference)
    muon_diff, adamw_diff = (
        max((p.full_tensor() - q).abs().max().item() for p, q in zip(a, b, strict=True))  # type: ignore[attr-defined]
        for a, b in ((ours_muon, ref_muon), (ours_adamw, ref_adamw))
    )
    log(
        f"max |sharded - unsharded| after {STEPS} steps: Muon's matrices {muon_diff:.1e}, "
        f"AdamW's parameters {adamw_diff:.1e}; {int(total)} Newton-Schulz runs in the job "
        f"for {len(ours_muon)} matrices x {STEPS} steps"
    )
    if muon_diff != 0.0 or adamw_diff != 0.0 or int(total) != len(ours_muon) * STEPS:
        raise SystemExit("fully_shard.Muon drifted from torch.optim.Muon")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
