"""``torch.compile`` in every order trainers use, side by side with torch's ``fully_shard``.

The orders (each on a 2-block Llama-style model, ``whole`` on a 1-block one, W = 2 gloo ranks,
3 AdamW steps):

- ``titan``: torchtitan's, ``block = torch.compile(block, fullgraph=True)`` put back into
  ``model.layers``, then ``fully_shard`` on the compiled block;
- ``forward``: ``block.forward = torch.compile(block.forward)`` after sharding;
- ``tune_before`` / ``tune_after``: torchtune's ``block.compile()`` in place, before or after
  ``fully_shard(block)``; ``tune_after_fullgraph`` with ``fullgraph=True``;
- ``whole``: ``torch.compile(model)`` of the whole sharded model (graph breaks allowed; ours
  has none: the graph path of ``fully_shard.graph`` traces it as one frame, while torch's
  breaks at every hook). One block: the graph path over several blocks is test_graph's and
  test_regions' (one region per block structure), on smaller models.

Each trains against an unsharded *eager* replica that sees the global batch (losses every
step, final full parameters) and against torch's ``fully_shard`` compiled the same way (losses,
parameters, compiled frames, graph breaks; ``AGAINST_TORCH``: in the suite one order compiled
before sharding and one after, all six in ``nox -s soak``, where ``whole`` shows torch's graph
breaks at every hook against ours in one frame). "No recompilation after the first step": the
compiled-frame count after step 1 stays the same through step 3. ``IN_SUITE``: the orders the
suite runs; ``tune_after`` (``tune_after_fullgraph`` without ``fullgraph``: ours has no graph
break to allow) and ``forward`` (our hooks eager around a block's compiled forward, as in
``titan``, which also traces after sharding: ``torch.compile`` traces at the first call) run
in ``nox -s soak``.

The backends come from ``FULLY_SHARD_COMPILE_BACKENDS`` (default ``aot_eager``: dynamo and
AOTAutograd trace forward and backward as for inductor, without generating code);
``nox -s soak`` adds ``inductor``, which builds C++ for every graph (minutes on 2 cores).
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

import pytest
import torch
from torch import nn

from fully_shard import fully_shard
from harness import mesh_1d, run_distributed
from matrix import thinned
from models import ModelArgs, Transformer
from parity import loss_fn, make_token_batch

WORLD = 2
STEPS = 3
ORDERS = ("titan", "forward", "tune_before", "tune_after", "tune_after_fullgraph", "whole")
IN_SUITE = thinned(ORDERS, ["titan", "tune_before", "tune_after_fullgraph", "whole"])
# Side by side with torch's fully_shard compiled the same way: in the suite, one order compiled
# before sharding and one after; every order in nox -s soak (the whole model's torch side, with
# a graph break at every hook, is the slowest run of the file). Every order is checked against
# the eager replica in both, and test_graph checks the whole model against our eager engine.
AGAINST_TORCH = thinned(ORDERS, ["titan", "tune_after_fullgraph"])
BACKENDS = tuple(os.environ.get("FULLY_SHARD_COMPILE_BACKENDS", "aot_eager").split(","))


def _compile_and_shard(model: Transformer, order: str, shard: Any, counter: Any) -> nn.Module:
    """Shard ``model`` (blocks, then root) compiling in ``order``; return what to call."""
    mesh = mesh_1d()
    fullgraph = order.endswith("fullgraph")
    for i, block in enumerate(list(model.layers)):
        if order == "titan":
            compiled = torch.compile(block, backend=counter, fullgraph=True)
            model.layers[i] = compiled
            shard(compiled, mesh=mesh)
        elif order == "tune_before":
            block.compile(backend=counter)
            shard(block, mesh=mesh)
        else:
            shard(block, mesh=mesh)
            if order.startswith("tune_after"):
                block.compile(backend=counter, fullgraph=fullgraph)
            elif order == "forward":
                block.forward = torch.compile(block.forward, backend=counter)  # type: ignore[method-assign]
    shard(model, mesh=mesh)
    return torch.compile(model, backend=counter) if order == "whole" else model


def _train(order: str, backend: str, impl: str) -> dict[str, Any]:
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as shard
    else:
        shard = fully_shard
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(n_layers=1 if order == "whole" else 2))
    reference = copy.deepcopy(model)
    run = _compile_and_shard(model, order, shard, counter)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    rank, losses, ref_losses, frames = torch.distributed.get_rank(), [], [], []
    for step in range(STEPS):
        tokens, targets = make_token_batch(2 * WORLD, torch.Generator().manual_seed(step))
        mine = slice(2 * rank, 2 * rank + 2)
        loss = loss_fn(run(tokens[mine]), targets[mine])
        loss.backward()
        optim.step()
        optim.zero_grad()
        ref_loss = loss_fn(reference(tokens), targets)
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        frames.append(counter.frame_count)
    # Compare in module order: torchtitan's order adds "_orig_mod." to the names.
    params = [p.full_tensor() for p in model.parameters()]
    ref_params = [p.detach() for p in reference.parameters()]
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "params": params,
        "ref_params": ref_params,
        "frames": frames,
        "breaks": sum(counters["graph_break"].values()),
    }


def _both(order: str, backend: str) -> dict[str, dict[str, Any]]:
    impls = ("ours", "torch") if order in AGAINST_TORCH else ("ours",)
    return {impl: _train(order, backend, impl) for impl in impls}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", IN_SUITE)
def test_compile_order_trains_like_eager_and_like_torch(order: str, backend: str) -> None:
    got = run_distributed(functools.partial(_both, order, backend), WORLD, timeout=300)
    for rank_result in got:
        ours, theirs = rank_result["ours"], rank_result.get("torch")
        # The mean of the two ranks' local losses is the global batch's loss.
        assert len(ours["params"]) == len(ours["ref_params"]) > 0
        for p, ref in zip(ours["params"], ours["ref_params"], strict=True):
            torch.testing.assert_close(p, ref, atol=1e-5, rtol=1e-4)
        # Compiled in the first step, never again.
        first = ours["frames"][0]
        assert first >= 1
        assert ours["frames"] == [first] * STEPS
        if order == "whole":
            # Ours traces the whole sharded model as one frame (the graph path, graph.py).
            assert ours["frames"] == [1] * STEPS and ours["breaks"] == 0
        if theirs is None:
            continue
        for p, q in zip(ours["params"], theirs["params"], strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)
        if order == "whole":  # torch's breaks the graph at every hook
            assert theirs["frames"][0] > 1
        else:  # as many frames and graph breaks as torch
            assert ours["frames"] == theirs["frames"]
            assert ours["breaks"] == theirs["breaks"]
    # Each rank's loss is its half of the batch; their mean is the reference's.
    for step in range(STEPS):
        mean = sum(r["ours"]["losses"][step] for r in got) / WORLD
        assert mean == pytest.approx(got[0]["ours"]["ref_losses"][step], abs=1e-5)
