"""float8 training with torchao, its weights all-gathered as float8 (about 1 byte per element).

    pip install torchao              # or: pip install -e '.[test]'
    torchrun --standalone --nproc-per-node 2 examples/float8.py

``convert_to_float8_training`` makes each ``nn.Linear`` a ``Float8Linear`` whose weight is a
tensor subclass with ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: ``fully_shard``
gathers it through them, so what travels is the float8 cast of each rank's rows and the
matmul gets the float8 weight it would have cast itself. After ``optimizer.step()``,
``precompute_float8_dynamic_scale_for_fsdp`` computes every weight's next scale in one
all-reduce instead of one per weight. On gloo (CPU) the float8 bytes travel as uint8.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)
from toy import log

from fully_shard import CountingComm, fully_shard, init_distributed

DIM, HIDDEN = 64, 128  # float8 matmuls want multiples of 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)]).to(job.device)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)  # before fully_shard
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comm = CountingComm()
    model.set_comm(comm)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    elements = sum(p.numel() for p in model.parameters())  # every weight, gathered twice a step
    for step in range(3):
        comm.reset()
        x = torch.randn(8, DIM, generator=gen).to(job.device)
        loss = F.mse_loss(model(x), x.flip(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        precompute_float8_dynamic_scale_for_fsdp(model)  # the next step's scales, at once
        gathered = sum(r.nbytes for r in comm.records if r.op == "all_gather")
        per_element = gathered * dist.get_world_size() / (2 * elements)
        log(f"step {step}: loss {loss.item():.4f}, {per_element:.2f} bytes per gathered element")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
