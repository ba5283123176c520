"""The whole sharded model in one graph: ``torch.compile(model, fullgraph=True)``.

    torchrun --standalone --nproc-per-node 2 examples/compile_whole.py                 # inductor
    torchrun --standalone --nproc-per-node 2 examples/compile_whole.py --backend aot_eager

``fully_shard`` each block, then the root, as usual; then compile the root. The all-gathers
and reduce-scatters are operations of the compiled graphs (the graph path,
``fully_shard.graph``). With ``--backend aot_eager`` the script keeps the forward and backward
graphs AOTAutograd hands to its compiler and prints the collectives in each: one all-gather
per group in forward; in backward one reduce-scatter per group, and the gathers of the groups
that reshard after forward (the blocks), recomputed. Then the frames dynamo compiled after each
step (1, 1, 1: one graph, no recompilation).
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import torch
from toy import ToyLM, batch, log, loss_fn

from fully_shard import fully_shard, init_distributed


class KeepGraphs:
    """A torch.compile backend: ``aot_eager`` that keeps the forward and backward graphs."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        self.frames = 0

        def keep(kind: str) -> Any:
            def compiler(gm: torch.fx.GraphModule, example: Any) -> Any:
                self.graphs[kind].append(gm)
                return make_boxed_func(gm.forward)

            return compiler

        self._aot = aot_autograd(
            fw_compiler=keep("forward"),
            bw_compiler=keep("backward"),
            partition_fn=min_cut_rematerialization_partition,
        )

    def __call__(self, gm: torch.fx.GraphModule, example: Any) -> Any:
        self.frames += 1
        return self._aot(gm, example)


def collectives(gm: torch.fx.GraphModule) -> str:
    """``'3 all_gather_into_tensor (torch.float32)'``, ... for one graph; a block compiled as a
    region (``invoke_subgraph``, one compiled body per block structure) counts its body's
    collectives at each of its calls."""
    seen = _count(gm)
    return ", ".join(f"{n} {what}" for what, n in sorted(seen.items())) or "none"


def _count(gm: torch.fx.GraphModule) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.invoke_subgraph:
            seen.update(_count(getattr(gm, node.args[0].target)))
            continue
        name = getattr(node.target, "__name__", "")
        if name.split(".")[0] in (
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "all_to_all_single",  # the reduce-scatter on gloo
            "all_reduce",
        ):
            seen[f"{name.split('.')[0]} ({node.args[0].meta['val'].dtype})"] += 1
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from torch._dynamo.testing import CompileCounterWithBackend

    keep = KeepGraphs() if args.backend == "aot_eager" else None
    counter = keep or CompileCounterWithBackend(args.backend)
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    torch.manual_seed(0)
    model = ToyLM(n_layers=2).to(job.device)
    for block in model.layers:
        fully_shard(block, mesh=job.mesh)
    fully_shard(model, mesh=job.mesh)
    run = torch.compile(model, backend=counter, fullgraph=True)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    frames: list[int] = []
    for step in range(args.steps):
        start = time.perf_counter()
        tokens, targets = batch(step, device=job.device)
        loss = loss_fn(run(tokens), targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f} ({time.perf_counter() - start:.2f} s)")
        frames.append(keep.frames if keep is not None else counter.frame_count)  # type: ignore[union-attr]
    if keep is not None:
        for kind, graphs in keep.graphs.items():
            for gm in graphs:
                log(f"{kind} graph: {collectives(gm)}")
    log(f"frames compiled after each step: {frames} (the whole model, fullgraph=True)")
    if frames != [1] * len(frames):
        raise SystemExit(f"expected one frame compiled once, got {frames}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
