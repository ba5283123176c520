"""Two patterns that cut a training step's peak memory, with ``fully_shard``: a loss computed
in chunks (the full ``(tokens, vocab)`` logits never exist) and the optimizer stepped inside
backward (no parameter's full gradient outlives its reduction).

    torchrun --standalone --nproc-per-node 2 examples/low_memory_step.py

Chunked loss: the norm and the head are one group (``fully_shard([model.norm, model.head])``).
The model's forward stops after the norm; the head is called on its own, once per chunk of
tokens, after the root forward returned. Each call gathers the group's parameters and frees
them again; backward reaches the head once per chunk.

Optimizer in backward: one optimizer per parameter, stepped from the parameter's
``register_post_accumulate_grad_hook``. ``fully_shard`` runs the hook once the parameter's
sharded gradient is in place (after its reduce-scatter), as torch's FSDP2 does; the hook
steps and drops the gradient, so no ``optimizer.step()`` follows ``backward()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from toy import ToyLM, batch, log

from fully_shard import fully_shard, init_distributed

CHUNKS = 4


def chunked_loss(model: ToyLM, hidden: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy; the head runs on a quarter of the tokens at a time."""
    flat, flat_targets = hidden.flatten(0, 1), targets.flatten()
    total = hidden.new_zeros(())
    for h, t in zip(flat.chunk(CHUNKS), flat_targets.chunk(CHUNKS), strict=True):
        total = total + F.cross_entropy(model.head(h), t, reduction="sum")
    return total / flat_targets.numel()


class HiddenToyLM(ToyLM):
    """``ToyLM`` whose forward stops after the final norm: the loss applies the head."""

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        out: Tensor = self.norm(h)
        return out


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = HiddenToyLM().to(job.device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)  # one group; its forward skips the head
    fully_shard(model, mesh=mesh)

    optims = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}
    steps_taken = {p: 0 for p in optims}

    def step_in_backward(p: Tensor) -> None:  # p: the sharded parameter, p.grad in place
        optims[p].step()
        optims[p].zero_grad(set_to_none=True)
        steps_taken[p] += 1

    for p in optims:
        p.register_post_accumulate_grad_hook(step_in_backward)

    for step in range(3):
        tokens, targets = batch(step, device=job.device)
        loss = chunked_loss(model, model(tokens), targets)
        loss.backward()  # every parameter's optimizer has stepped when this returns
        stepped = sum(1 for p in optims if steps_taken[p] == step + 1)
        log(f"step {step}: loss {loss.item():.4f}, {stepped} of {len(optims)} parameters stepped")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
