"""Plan the memory of a step, apply the plan, and check the plan against the step.

    torchrun --standalone --nproc-per-node 2 examples/plan_memory.py

``fully_shard.plan`` predicts the peak memory per rank of one training step for the
configurations it may choose, picks the cheapest that fits the budget, and applies it.
Here the budget is set between the smallest and the largest peak, so that the plan has to
give something up; the script prints the plan's table and the step's losses.
"""

from __future__ import annotations

import torch
from toy import ToyLM, batch, log, loss_fn

from fully_shard import PlanInfeasibleError, init_distributed, plan


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM().to(job.device)
    tokens, targets = batch(0, device=job.device)

    def step_loss(output: torch.Tensor) -> torch.Tensor:
        # The loss the training loop computes (the planner runs it on fake tensors).
        return loss_fn(output, targets)

    common = {"example_inputs": (tokens,), "mesh": mesh, "loss_fn": step_loss}
    roomy = plan(model, budget="1GiB", **common)
    try:
        plan(model, budget=1, **common)
    except PlanInfeasibleError as e:
        smallest = e.minimum_bytes
    budget = (smallest + roomy.peak_bytes) // 2
    chosen = plan(model, budget=budget, **common)
    log(str(chosen))
    chosen.apply(model, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f}, planned peak {chosen.peak_bytes} bytes")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
