"""Mixture of experts: experts sharded over a sub-mesh, the rest over every rank, one call each.

    torchrun --standalone --nproc-per-node 4 examples/moe_experts.py   # EP 2 x expert-FSDP 2

Runs on GPUs (NCCL) or on the CPU (gloo). The meshes are built the way torchtitan builds
them: one 1-D world mesh, unflattened into ``(fsdp,)`` for the dense parameters and into
``(efsdp, ep)`` for the experts (``--named-mesh``: one named ``(ep, efsdp)`` mesh instead). The
experts are expert parallel: a DTensor ``Shard(0)`` over ``ep`` (each EP rank holds and computes
half of the experts). ``fully_shard`` shards each EP rank's experts further over ``efsdp``, the
ranks holding the same experts, by returning ``ShardPlacementResult(Shard(0), efsdp)`` from
``shard_placement_fn``; the router and the dense layers are sharded over all ranks. So one
``fully_shard`` call owns two groups: one all-gather and one reduce-scatter per mesh. Each
expert weight ends as one DTensor on ``(efsdp, ep)``, placed ``(_StridedShard(0, sf=ep),
Shard(0))`` as torch's ``fully_shard`` places it (``(ep, efsdp)`` and ``(Shard(0), Shard(0))``
with ``--named-mesh``).

A toy "soft" MoE: every expert sees every token of its EP group, weighted by the router, and
the weighted sum over experts is a ``Partial`` DTensor summed over the EP ranks (a real MoE
sends each token to its top-k experts with an all-to-all; the sharding is the same). Every
rank also trains an unsharded replica, and the script ends by printing the largest difference
between the two (``--no-check`` skips it); it exits non-zero if they drift apart.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fully_shard import CountingComm, ShardPlacementResult, fully_shard, init_distributed

DIM, HIDDEN, EXPERTS, VOCAB, SEQ = 16, 32, 4, 32, 8


class MoE(nn.Module):
    """Soft mixture of experts: ``x (n, dim) -> sum_e gate_e(x) * expert_e(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / DIM**0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, x: Tensor) -> Tensor:
        gates = torch.softmax(self.router(x), dim=-1)  # (n, experts)
        if isinstance(self.w_in, DTensor):  # expert parallel: this rank's experts, all tokens
            mesh = self.w_in.device_mesh
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            gates = DTensor.from_local(gates, mesh, [Replicate()], run_check=False)
        h = F.gelu(torch.einsum("nd,edh->neh", x, self.w_in))
        y = torch.einsum("ne,ned->nd", gates, torch.einsum("neh,ehd->ned", h, self.w_out))
        if isinstance(y, DTensor):  # Partial over the EP ranks: sum the experts' outputs
            y = y.redistribute(placements=[Replicate()]).to_local()
        return y


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens).flatten(0, 1)  # (batch * seq, dim)
        return self.head(h + self.moe(h))  # type: ignore[no-any-return]


def batch(step: int, rows: int) -> tuple[Tensor, Tensor]:
    """Counting sequences with a random start: the next token is the current one plus one."""
    gen = torch.Generator().manual_seed(step)
    seq = (torch.randint(0, VOCAB, (rows, 1), generator=gen) + torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4, help="rows per expert-FSDP rank")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--named-mesh", action="store_true", help="one named (ep, efsdp) mesh, not torchtitan's"
    )
    args = parser.parse_args()

    # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU; job.mesh: 1-D over everyone
    job = init_distributed(mesh_dim_names=("world",))
    device, world, rank = job.device, job.world_size, job.rank
    ep = 2 if world % 2 == 0 else 1
    if args.named_mesh or not hasattr(job.mesh, "_unflatten"):  # torch < 2.13: named only
        everyone = job.mesh
        root = init_device_mesh(device.type, (ep, world // ep), mesh_dim_names=("ep", "efsdp"))
        ep_mesh, efsdp_mesh = root["ep"], root["efsdp"]
    else:  # torchtitan's ParallelDims.build_mesh(): slices of the unflattened world mesh
        everyone = job.mesh._unflatten(0, (world,), ("fsdp",))["fsdp"]
        sparse = job.mesh._unflatten(0, (world // ep, ep), ("efsdp", "ep"))
        ep_mesh, efsdp_mesh = sparse["ep"], sparse["efsdp"]
    # EP peers compute on the same tokens; the efsdp ranks see different ones.
    data_size, data_rank = efsdp_mesh.size(), efsdp_mesh.get_local_rank()

    torch.manual_seed(0)
    model = Model().to(device)
    reference = copy.deepcopy(model) if args.check else None
    for name in ("w_in", "w_out"):  # expert parallel: half of the experts per EP rank
        expert = getattr(model.moe, name)
        sharded = distribute_tensor(expert.detach(), ep_mesh, [Shard(0)])
        setattr(model.moe, name, nn.Parameter(sharded))

    def placement(p: nn.Parameter) -> ShardPlacementResult | None:
        # experts: over the ranks holding the same experts; the router: over everyone
        return ShardPlacementResult(Shard(0), efsdp_mesh) if p.dim() == 3 else None

    fully_shard(model.moe, mesh=everyone, shard_placement_fn=placement)
    fully_shard(model, mesh=everyone)

    counter = CountingComm()
    model.set_comm(counter)  # type: ignore[operator]  # an FSDPModule method
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=3e-3) if reference else None
    for step in range(args.steps):
        tokens, targets = batch(step, data_size * args.batch)
        tokens, targets = tokens.to(device), targets.to(device)
        lo = data_rank * args.batch
        logits = model(tokens[lo : lo + args.batch])
        loss = F.cross_entropy(logits, targets[lo : lo + args.batch].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        if reference is not None and ref_optim is not None:
            ref_loss = F.cross_entropy(reference(tokens), targets.flatten())
            ref_loss.backward()
            ref_optim.step()
            ref_optim.zero_grad()
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)

    if rank == 0:
        groups = model.moe._fsdp_state.groups
        print(
            f"moe: {len(groups)} groups, sharded over "
            + ", ".join(
                f"{g.info.shard_size} ranks ({', '.join(p.fqn for p in g.params)})" for g in groups
            )
        )
        for name in ("w_in", "w_out"):
            w = getattr(model.moe, name)
            assert isinstance(w, DTensor)
            print(f"moe.{name}: {w.device_mesh} {w.placements}, local {tuple(w.to_local().shape)}")
        per_step = {op: n // args.steps for op, n in counter.count_by_op().items()}
        print(f"collectives per step: {per_step}")
    if reference is not None:
        ref_params = dict(reference.named_parameters())
        diff = max(
            (p.full_tensor() - ref_params[n]).abs().max().item()
            for n, p in model.named_parameters()
        )
        if rank == 0:
            print(f"max |sharded - unsharded| over all parameters: {diff:.2e}")
        if diff > 1e-4:
            raise SystemExit(f"the sharded model drifted from the unsharded replica by {diff:.2e}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
