"""The tensor-parallel plan the 2-D tests and the example use on `models.Transformer`.

Megatron-style: attention and SwiGLU are column- then row-parallel, the norms run sequence
parallel (their weights become Replicate DTensors whose gradients are Partial), the embedding
is row-parallel over the vocabulary and the output head column-parallel. Every parameter ends
up a DTensor on the TP mesh, so optimizer and `clip_grad_norm_` see one mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fully_shard import fully_shard
from models import Attention, Transformer


def chunk_piece(t: Tensor, n: int, dim: int, i: int) -> Tensor:
    """Piece ``i`` of ``n`` along ``dim``, split like ``torch.chunk`` (ceil-sized, maybe empty).

    What a rank holds of a weight that TP and then fully_shard split: the 2-D and 3-D tests
    build the expected local tensor from the unsharded weight with it.
    """
    size = t.size(dim)
    c = math.ceil(size / n)
    lo = min(i * c, size)
    return t.narrow(dim, lo, max(0, min(lo + c, size) - lo))


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Parallelise `model` in place over `tp_mesh` (heads and hidden sizes must divide)."""
    tp = tp_mesh.size()
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
        attention = block.get_submodule("attention")
        assert isinstance(attention, Attention)
        # Each TP rank computes its share of the heads.
        attention.n_heads //= tp
        attention.n_kv_heads //= tp


def apply_tp_then_fully_shard(
    model: Transformer,
    root: DeviceMesh,
    shard_placement_fn: Callable[[nn.Parameter], Placement | None] | None = None,
) -> None:
    """`apply_tp` over ``root["tp"]``, then fully_shard each block and the root over
    ``root["dp"]`` (the 2-D order torchtitan uses)."""
    apply_tp(model, root["tp"])
    for block in model.layers:
        fully_shard(block, mesh=root["dp"], shard_placement_fn=shard_placement_fn)
    fully_shard(model, mesh=root["dp"], shard_placement_fn=shard_placement_fn)


def tp_modules(model: nn.Module) -> list[str]:
    """Names of the modules `apply_tp` parallelises (for error messages in tests)."""
    return [name for name, _ in model.named_modules()]
