"""Mixed precision: all-gather and compute in bfloat16, reduce gradients and step in float32.

torchrun --standalone --nproc-per-node 2 examples/mixed_precision.py
"""

from __future__ import annotations

import torch
from toy import ToyLM, batch, log, loss_fn

from fully_shard import CountingComm, MixedPrecisionPolicy, fully_shard, init_distributed


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = ToyLM().to(job.device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # The root also casts the logits back to fp32 for the loss.
    fully_shard(
        model,
        mesh=mesh,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        ),
    )
    comm = CountingComm()
    model.set_comm(comm)

    seen: set[torch.dtype] = set()
    model.layers[0].up.register_forward_hook(lambda mod, args, out: seen.add(mod.weight.dtype))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens, targets = batch(step, device=job.device)
        logits = model(tokens)
        loss = loss_fn(logits, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f} (logits {logits.dtype})")

    dtypes = {r.op: r.dtype for r in comm.records}
    master = {p.dtype for p in model.parameters()}
    log(
        f"compute {seen}, all-gather {dtypes['all_gather']}, reduce-scatter "
        f"{dtypes['reduce_scatter']}, sharded (master) parameters {master}"
    )
    if seen != {torch.bfloat16} or master != {torch.float32}:
        raise RuntimeError(f"unexpected dtypes: compute {seen}, master {master}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
