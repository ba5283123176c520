"""torchtitan 0.3.0's own parallelize functions, calling our ``fully_shard``.

``tests/test_titan_meshes.py`` rebuilds torchtitan's meshes and sharding by hand; here
torchtitan's code does it, as its trainer does (``Trainer.__init__`` in torchtitan 0.3.0):

1. ``ParallelismConfig`` → ``model_config.update_from_config`` (the sharding configs) →
   ``ParallelDims.from_config(...).build_mesh()`` (gloo, ``device_type`` "cpu");
2. the model built and initialized (``init_weights()``) → its ``parallelize_fn``
   (``parallelize_llama``, ``parallelize_qwen3``: tensor or expert parallelism, then
   ``apply_fsdp_to_decoder``, which calls ``fully_shard`` per block and on the root, with
   torch's ``ShardPlacementResult`` and the ``efsdp`` mesh for the routed experts, then
   ``set_gradient_divide_factor(1.0)`` and, under EP, explicit prefetching);
3. its loss, ``CrossEntropyLoss`` (sum over the rank's tokens divided by the global token
   count; the vocab-parallel cross-entropy on TP's ``Shard(-1)`` logits).

``torchtitan.distributed.fsdp``'s ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``,
``CPUOffloadPolicy`` and ``DataParallelMeshDims`` are rebound to ours inside each rank (the
only module of these paths that imports them; ``components/loss.py`` imports ``FSDPModule``
only for the chunked loss, unused here), so torchtitan shards with our engine. Every case
trains 3 AdamW steps (1 where the experts' bf16 gradients are summed over ``efsdp`` ranks: see
``_experts_after_adamw``) against the unsharded model (``check_parity``, fp32: compile off, no
activation checkpointing, ``mixed_precision_param="float32"``; 1e-5) on the debug models
shrunk to a few units: dim 16, 2 layers, vocabulary 32, 4 experts (top 2).

- llama3 with TP 2 (sequence parallel, torchtitan's default) x FSDP 2 at W = 4;
- Qwen3-MoE (every block MoE) with EP 2 at W = 2 (``efsdp`` 1) and W = 4 (``efsdp`` 2), and
  EP 4 at W = 4 (``efsdp`` 1), the tokens all-to-all'ed by torchtitan's token dispatcher.

Three things torchtitan's trainer does that a CPU test does not. It builds the model on the
meta device and initializes it after ``parallelize_fn``, through DTensor's random ops; on a CPU
mesh those have no RNG tracker (torch's is for CUDA-like devices), so every rank draws the
same values for its shard: the router's rows come out equal, every token picks the same two
experts and the router gets no gradient. Here the model is initialized before
``parallelize_fn``, which torchtitan allows ("the model must fit on GPU or CPU memory"). Its
attention is ``FlexAttention``, compiled with inductor at import, so the layers here use its
``ScaledDotProductAttention`` (causal; what its graph-trainer tests use). And
``update_from_config`` imports ``torchtitan.trainer`` only to ask whether the config is a
``Trainer.Config``, whose imports (torchdata, tensorboard, datasets) the soak session does not
install: a stub ``Trainer`` answers no, as it does for any non-trainer config. torchtitan's
package is installed with ``--no-deps`` (``nox -s soak``); the module skips without it.

The SPMD backend is ``"partial_dtensor"`` (DTensor for TP and EP, FSDP on the ``fsdp`` /
``efsdp`` slices); torchtitan 0.3.0's default, ``"spmd_types"``, passes the whole dense mesh
with ``dp_mesh_dims`` instead and is not run here. torch's own ``fully_shard`` cannot run these
cases on gloo: with torchtitan's divide factor of 1 its reduce-scatter asks for
``ReduceOp.PREMUL_SUM``, which gloo lacks.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import fully_shard as ours
from fully_shard._compat import strided_shard
from harness import run_distributed
from matrix import FULL_MATRIX
from parity import assert_stats_within, check_parity, make_token_batch

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.skipif(
    not FULL_MATRIX, reason="torchtitan's own code, about 10 s: nox -s soak runs it"
)

VOCAB, SEQ, LOCAL_BATCH = 32, 8, 2
make_tokens = functools.partial(make_token_batch, vocab_size=VOCAB, seq_len=SEQ)
# what torchtitan.distributed.fsdp imports from torch.distributed.fsdp, rebound to ours
REBOUND = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
REBOUND += ("DataParallelMeshDims",)


def _on_ours(mp: pytest.MonkeyPatch, backend: str) -> None:
    """torchtitan's FSDP names bound to ours, its meshes on CPU, its SPMD backend set."""
    import torchtitan.distributed.fsdp as titan_fsdp
    import torchtitan.distributed.parallel_dims as titan_dims
    import torchtitan.distributed.utils as titan_utils

    for name in REBOUND:
        mp.setattr(titan_fsdp, name, getattr(ours, name))
    mp.setattr(titan_dims, "device_type", "cpu")  # its init_device_mesh(device_type, ...)
    mp.setattr(titan_utils, "_spmd_backend", backend)  # Trainer: set_spmd_backend(...)
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError:  # its data loading and metrics imports are not installed
        stub = types.ModuleType("torchtitan.trainer")
        stub.Trainer = type("Trainer", (), {"Config": type("Config", (), {})})  # type: ignore[attr-defined]
        mp.setitem(sys.modules, "torchtitan.trainer", stub)


def _sdpa(layers: list[Any]) -> list[Any]:
    """Causal SDPA in place of the compiled FlexAttention (see the module docstring)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


# -- the debug models, shrunk: each mirrors its module's _debugmodel / _debugmodel_moe --------


def _llama3() -> Any:
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    dim, n_heads = 16, 4
    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=SEQ, theta=500000, scaling="llama")
    layers = llama3._build_llama3_layers(
        n_layers=2, dim=dim, n_heads=n_heads, hidden_dim=32, rope=rope, attn_backend="flex"
    )
    return llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=dim, out_features=VOCAB, param_init=llama3._output_linear_init(dim)
        ),
        layers=_sdpa(layers),
    )


def _qwen3_moe() -> Any:
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    dim, head_dim = 16, 8
    layers = qwen3._build_qwen3_moe_layers(
        n_layers=2,
        dim=dim,
        n_heads=2,
        n_kv_heads=2,
        head_dim=head_dim,
        moe_hidden_dim=8,
        num_experts=4,
        top_k=2,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0),
        moe_comm_backend="standard",
    )
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=_sdpa(layers),
    )


MODELS: dict[str, tuple[Callable[[], Any], str]] = {
    "llama3": (_llama3, "torchtitan.models.llama3.parallelize:parallelize_llama"),
    "qwen3_moe": (_qwen3_moe, "torchtitan.models.qwen3.parallelize:parallelize_qwen3"),
}


# -- the trainer's steps ----------------------------------------------------------------------


def _titan_loss(output: Tensor, target: Tensor, *, tokens: int) -> Tensor:
    """torchtitan's ``CrossEntropyLoss``: the sum over ``target``'s tokens / ``tokens``."""
    from torchtitan.components.loss import CrossEntropyLoss

    loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(output, target, torch.tensor(tokens))
    return loss


LR = 1e-3  # check_parity's default


def _experts_after_adamw(name: str, what: str) -> tuple[float, float] | None:
    """The routed experts' values after an AdamW step, where ``efsdp`` has several ranks.

    torchtitan's ``GroupedExperts`` runs its grouped matmuls in bf16 (``x.bfloat16()``,
    ``w.bfloat16()``), so an expert's gradient is rounded to bf16 on each ``efsdp`` rank before
    the reduce-scatter sums them, where the unsharded model rounds the whole sum once. The
    gradients still agree within 1e-5 (they are ~1e-4 here) and are compared at it, but AdamW
    turns an entry that is rounding noise into a step of up to ``lr``: the experts' values
    after the step agree to 2 x lr, and every later forward carries that difference into
    every parameter, so these cases train one step, not 3. (With the bf16 casts made no-ops
    the experts' gradients agree to 1e-10 and all values to 1e-5 after 3 steps.)
    """
    return (2 * LR, 0.0) if what == "param" and ".routed_experts." in name else None


def _train_on_titan(model: str, backend: str, **degrees: int) -> dict[str, Any]:
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    build_config, entry = MODELS[model]
    module, name = entry.split(":")
    with pytest.MonkeyPatch.context() as mp:
        _on_ours(mp, backend)
        parallelize = getattr(__import__(module, fromlist=[name]), name)
        parallelism = ParallelismConfig(spmd_backend=backend, **degrees)
        training = TrainingConfig(
            mixed_precision_param="float32", seq_len=SEQ, local_batch_size=LOCAL_BATCH
        )
        config = build_config()
        config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
        dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        dims.build_mesh()
        batch = dims.get_mesh("batch")  # its ranks split the global batch; TP peers share

        def build() -> nn.Module:
            model = config.build()
            with torch.no_grad():
                model.init_weights(buffer_device=None)
            return model  # type: ignore[no-any-return]

        def shard(m: nn.Module, _: DeviceMesh) -> None:
            parallelize(
                m,
                parallel_dims=dims,
                training=training,
                parallelism=parallelism,
                compile_config=CompileConfig(enable=False),
                ac_config=None,
                dump_folder="",
            )
            m.train()

        tokens = batch.size() * LOCAL_BATCH * SEQ  # the global batch's token count
        efsdp = dims.get_optional_mesh("efsdp")
        bf16_sums = efsdp is not None and efsdp.size() > 1
        stats = dict(
            check_parity(
                build,
                shard,
                make_tokens,
                batch,
                loss=functools.partial(_titan_loss, tokens=tokens),
                steps=1 if bf16_sums else 3,
                local_batch=LOCAL_BATCH,
                lr=LR,
                atol=1e-5,
                loss_shares=True,
                tolerance_of=_experts_after_adamw if bf16_sums else None,
            )
        )
        sharded = build()
        shard(sharded, batch)
        stats["layouts"] = {
            n: (p.device_mesh.mesh_dim_names, p.placements)
            for n, p in sharded.named_parameters()
            if isinstance(p, DTensor)
        }
        stats["params"] = sum(1 for _ in sharded.parameters())
    return stats


CASES = [
    pytest.param(
        "llama3",
        4,
        {"data_parallel_shard_degree": 2, "tensor_parallel_degree": 2},
        id="llama3-W4-fsdp2xtp2",
    ),
    pytest.param("qwen3_moe", 2, {"expert_parallel_degree": 2}, id="qwen3_moe-W2-ep2"),
    pytest.param("qwen3_moe", 4, {"expert_parallel_degree": 2}, id="qwen3_moe-W4-ep2"),
    pytest.param("qwen3_moe", 4, {"expert_parallel_degree": 4}, id="qwen3_moe-W4-ep4"),
]


@pytest.mark.parametrize(("model", "world", "degrees"), CASES)
def test_torchtitan_parallelize_on_ours(model: str, world: int, degrees: dict[str, int]) -> None:
    results = run_distributed(
        _train_on_titan, world, model, "partial_dtensor", timeout=600, **degrees
    )
    for stats in results:
        assert_stats_within(stats, 1e-5)
    layouts = results[0]["layouts"]
    assert len(layouts) == results[0]["params"], "a parameter is not a DTensor"
    # torchtitan's layouts, composed with ours: TP's (fsdp, tp) mesh, or the experts on
    # (efsdp, ep) with EP's split of the experts first (fully_shard's strided inside it)
    if model == "llama3":
        wqkv = layouts["layers.0.attention.qkv_linear.wqkv.weight"]
        assert wqkv == (("fsdp", "tp"), (strided_shard(0, 2), Shard(0))), wqkv
    else:
        w1 = layouts["layers.0.moe.routed_experts.inner_experts.w1_EFD"]
        ep = degrees["expert_parallel_degree"]
        assert w1 == (("efsdp", "ep"), (strided_shard(0, ep), Shard(0))), w1
        assert layouts["layers.0.moe.router.gate.weight"] == (("fsdp",), (Shard(0),))
