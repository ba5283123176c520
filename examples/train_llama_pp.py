"""Pipeline parallelism + fully_shard: a Llama cut into stages, each sharded over its dp ranks.

    torchrun --standalone --nproc-per-node 4 examples/train_llama_pp.py                 # 2 x 2
    torchrun --standalone --nproc-per-node 4 examples/train_llama_pp.py --schedule ZBVZeroBubble

A (pp=2, dp=world/2) mesh: torch's pipelining (``torch.distributed.pipelining``) runs the
schedule over the pp dim; every block and each stage module is sharded with ``fully_shard``
over the dp dim. torch's schedules recognise our modules as FSDP2 modules: gradient sync is
off for every microbatch but the step's end, so each group reduce-scatters once per step (the
script counts them). Single-stage schedules (GPipe, 1F1B) give each pp rank one stage; the
others two (looped, or V-shaped for ZBVZeroBubble and DualPipeV). The stages keep their
parameters gathered from forward to backward (``reshard_after_forward=False``, torchtitan's
choice under PP), which the zero-bubble schedules need. Every rank also trains an unsharded
replica on the whole global batch and the script ends with the largest parameter difference.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
import torch.nn.functional as F
from llama import Llama
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage

from fully_shard import CountingComm, fully_shard, init_distributed

VOCAB, SEQ, LAYERS = 64, 16, 4
SINGLE = {"GPipe", "1F1B"}
V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}


class LlamaStage(nn.Module):
    """A contiguous piece of ``Llama``: the embedding (first stage), some blocks, the head."""

    def __init__(self, model: Llama, first: int, last: int) -> None:
        super().__init__()
        n = len(model.layers)
        self.tok_embeddings = copy.deepcopy(model.tok_embeddings) if first == 0 else None
        self.layers = nn.ModuleList(copy.deepcopy(model.layers[i]) for i in range(first, last))
        self.norm = copy.deepcopy(model.norm) if last == n else None
        self.output = copy.deepcopy(model.output) if last == n else None

    def forward(self, h: Tensor) -> Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers:
            h = layer(h)
        if self.norm is not None and self.output is not None:
            h = self.output(self.norm(h))
        return h


def groups(stage: LlamaStage) -> int:
    """The stage's groups that own parameters: its blocks, and its root if it holds more."""
    in_blocks = sum(1 for _ in stage.layers.parameters())
    return len(stage.layers) + (sum(1 for _ in stage.parameters()) > in_blocks)


def batch(step: int, rows: int) -> tuple[Tensor, Tensor]:
    """Counting sequences with a random start: the next token is the current one plus one."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=gen)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    schedules = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"]
    schedules += ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
    parser.add_argument("--schedule", choices=schedules, default="1F1B")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="rows per data-parallel rank")
    args = parser.parse_args()

    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    device, world, rank = job.device, job.world_size, job.rank
    if world % 2:
        raise SystemExit(f"2 pipeline stages x dp ranks need an even world size, got {world}")
    mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    dp_size, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()

    torch.manual_seed(0)
    reference = Llama(vocab=VOCAB, n_layers=LAYERS).to(device)
    n_stages = 2 if args.schedule in SINGLE else 4
    if n_stages == 2:
        mine = [pp_rank]
    elif args.schedule in V_SHAPED:
        mine = [pp_rank, n_stages - 1 - pp_rank]
    else:
        mine = [pp_rank, pp_rank + 2]
    per = LAYERS // n_stages
    counter = CountingComm()
    modules, stages = [], []
    for s in mine:
        stage = LlamaStage(reference, s * per, (s + 1) * per)
        for block in stage.layers:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=False)
        stage.set_comm(counter)
        modules.append(stage)
        stages.append(PipelineStage(stage, s, n_stages, device, group=mesh["pp"].get_group()))
    schedule_cls = getattr(pipelining, f"Schedule{args.schedule}")
    schedule = schedule_cls(
        stages[0] if n_stages == 2 else stages, n_microbatches=args.microbatches, loss_fn=loss_fn
    )

    optim = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=3e-3)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    for step in range(args.steps):
        tokens, targets = batch(step, dp_size * args.batch)
        tokens, targets = tokens.to(device), targets.to(device)
        lo = dp_rank * args.batch
        before = sum(r.op == "reduce_scatter" for r in counter.records)
        inputs = (tokens[lo : lo + args.batch],) if 0 in mine else ()
        kwargs = {"target": targets[lo : lo + args.batch]} if n_stages - 1 in mine else {}
        losses: list[Tensor] = []
        schedule.step(*inputs, **kwargs, losses=losses)
        reductions = sum(r.op == "reduce_scatter" for r in counter.records) - before
        optim.step()
        optim.zero_grad()
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        if losses:  # the ranks holding the last stage
            loss = torch.stack(losses).mean().item()
            print(
                f"rank {rank} step {step}: loss {loss:.4f}, {reductions} reduce-scatters for "
                f"{sum(map(groups, modules))} sharded groups over {args.microbatches} "
                "microbatches",
                flush=True,
            )

    diff = 0.0
    for s, module in zip(mine, modules, strict=True):
        part = LlamaStage(reference, s * per, (s + 1) * per)
        for p, q in zip(module.parameters(), part.parameters(), strict=True):
            diff = max(diff, (p.full_tensor() - q).abs().max().item())
    result = torch.tensor([diff], device=device)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"max |pipelined + sharded - unsharded| over all parameters: {result.item():.2e}")
    if result.item() > 1e-4:
        raise SystemExit(f"the pipelined model drifted from the unsharded one by {diff:.2e}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
