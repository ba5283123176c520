"""fully_shard with the libraries and torch features users combine it with.

- Hugging Face ``transformers``: a tiny ``LlamaForCausalLM`` built from a ``LlamaConfig`` (no
  download), ``fully_shard`` on every decoder layer and on the root, trains like the unsharded
  model (untied and tied word embeddings).
- Hugging Face ``peft``: LoRA adapters on the attention projections of that Llama, the base
  weights frozen beside them in each sharded layer; ours and torch's ``fully_shard`` each train
  like the unsharded PEFT model.
- Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) *inside* sharded blocks:
  parity, and the recompute in backward runs on parameters gathered again for it.

Every case runs on W = 2 gloo ranks through the warm pool of ``harness.py`` and compares with
``parity.check_parity`` (every step's loss and gradients, the final full parameters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fully_shard import CountingComm, FSDPModule, fully_shard
from harness import mesh_1d, run_distributed
from models import ModelArgs, Transformer
from parity import check_parity, loss_fn, make_token_batch, wrap_layers_then_root

WORLD = 2
ARGS = ModelArgs(tie_embeddings=True)

# -- Hugging Face transformers ------------------------------------------------------------------

HF_VOCAB = 64
HF_SEQ = 8


def _hf_build(tie: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=HF_VOCAB,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=HF_SEQ,
        tie_word_embeddings=tie,
        use_cache=False,  # training: no KV cache in the outputs
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if tied != tie:
        raise AssertionError(f"tie_word_embeddings={tie} but lm_head tied={tied}")
    return model


def _hf_shard(model: nn.Module, mesh: DeviceMesh) -> None:
    for layer in model.model.layers:  # type: ignore[union-attr]  # LlamaModel.layers
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # embeddings, final norm, lm_head (tied or not): the root


def _hf_loss(output: Any, targets: Tensor) -> Tensor:
    return loss_fn(output.logits, targets)  # CausalLMOutputWithPast.logits (B, S, vocab)


def _hf_parity(tie: bool) -> dict[str, Any]:
    stats = check_parity(
        functools.partial(_hf_build, tie),
        _hf_shard,
        functools.partial(make_token_batch, vocab_size=HF_VOCAB, seq_len=HF_SEQ),
        mesh_1d(),
        loss=_hf_loss,
        steps=4,
        atol=1e-5,
        rtol=0.0,
    )
    return dict(stats)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_llama_trains_like_the_unsharded_model(tie: bool) -> None:
    pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[hf]')"
    )
    stats = run_distributed(_hf_parity, WORLD, tie, timeout=120)[0]
    assert stats["max_loss_diff"] <= 1e-5
    assert stats["max_param_diff"] <= 1e-5
    assert stats["zero_grad_params"] == []  # every parameter's comparison meant something


# -- Hugging Face PEFT: LoRA adapters beside frozen base weights -------------------------------


def _peft_build(tie: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    base = _hf_build(tie)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    # LoRA's B starts at zero, so the first step's adapter gradient would be all-zero on A;
    # random B makes every adapter weight (and the frozen base under it) matter from step 0.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model


def _peft_shard(shard_fn: Callable[..., Any]) -> Callable[[nn.Module, DeviceMesh], None]:
    def shard(model: nn.Module, mesh: DeviceMesh) -> None:
        llama = model.get_base_model()  # type: ignore[operator]  # PeftModel
        for layer in llama.model.layers:
            shard_fn(layer, mesh=mesh)  # q_proj/v_proj: frozen base + trainable lora_A/lora_B
        shard_fn(model, mesh=mesh)

    return shard


def _peft_parity(tie: bool, impl: str) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # reference, tests only

    stats = check_parity(
        functools.partial(_peft_build, tie),
        _peft_shard(fully_shard if impl == "ours" else torch_fully_shard),
        functools.partial(make_token_batch, vocab_size=HF_VOCAB, seq_len=HF_SEQ),
        mesh_1d(),
        loss=_hf_loss,
        steps=3,
        lr=1e-2,
        atol=1e-5,
        rtol=0.0,
    )
    return dict(stats)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_peft_lora_on_hf_llama_trains_like_the_unsharded_model_and_torch(tie: bool) -> None:
    """The issue's crash (``setStorage: ... storage of size 0`` in backward): a frozen base
    weight freed while autograd still needed it for the input gradient. Ours and torch's are
    each compared with the same unsharded PEFT model, step by step."""
    pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[hf]')"
    )
    pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[hf]')")
    ours = run_distributed(_peft_parity, WORLD, tie, "ours", timeout=180)[0]
    theirs = run_distributed(_peft_parity, WORLD, tie, "torch", timeout=180)[0]
    assert ours["ref_losses"] == theirs["ref_losses"]  # the same reference run
    assert ours["max_loss_diff"] <= 1e-5 and ours["max_param_diff"] <= 1e-5
    assert theirs["max_loss_diff"] <= 1e-5 and theirs["max_param_diff"] <= 1e-5
    assert ours["zero_grad_params"] == []


# -- activation checkpointing inside sharded blocks ---------------------------------------------


class _Recorder:
    """Counts runs of a block's checkpointed body and records the weight types it saw."""

    def __init__(self) -> None:
        self.calls = 0
        self.saw_dtensor = False
        self.shapes: set[tuple[int, ...]] = set()
        self.full_shape: tuple[int, ...] = ()

    def wrap(self, block: nn.Module) -> None:
        """Checkpoint ``block``'s body; call before ``fully_shard``, on the full parameters."""
        inner = block.forward
        self.full_shape = tuple(next(iter(block.parameters())).shape)

        def body(*args: Any) -> Tensor:
            self.calls += 1
            p = next(iter(block.parameters()))
            self.saw_dtensor |= isinstance(p, DTensor)
            self.shapes.add(tuple(p.shape))
            out: Tensor = inner(*args)
            return out

        def forward(*args: Any) -> Tensor:
            out: Tensor = checkpoint(body, *args, use_reentrant=False)
            return out

        block.forward = forward  # type: ignore[method-assign]  # the instance's own forward


def _checkpoint_blocks(model: nn.Module) -> list[_Recorder]:
    recorders = []
    for block in model.get_submodule("layers").children():
        recorder = _Recorder()
        recorder.wrap(block)
        recorders.append(recorder)
    return recorders


def _ac_shard(model: nn.Module, mesh: DeviceMesh, **options: Any) -> None:
    _checkpoint_blocks(model)  # checkpoint first, so the region sits inside the FSDP hooks
    wrap_layers_then_root(fully_shard, **options)(model, mesh)


def _ac_parity(reshard_after_forward: bool) -> dict[str, Any]:
    shard = functools.partial(_ac_shard, reshard_after_forward=reshard_after_forward)
    return dict(
        check_parity(
            functools.partial(Transformer, ARGS), shard, make_token_batch, mesh_1d(), steps=3
        )
    )


def _ac_collectives(reshard_after_forward: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    recorders = _checkpoint_blocks(model)
    wrap_layers_then_root(fully_shard, reshard_after_forward=reshard_after_forward)(
        model, mesh_1d()
    )
    assert isinstance(model, FSDPModule)
    comm = CountingComm()
    model.set_comm(comm)
    tokens, targets = make_token_batch(2, torch.Generator().manual_seed(1))
    out = model(tokens)
    forward = comm.count_by_op()
    forward_calls = [r.calls for r in recorders]
    comm.reset()
    loss_fn(out, targets).backward()
    return {
        "forward": forward,
        "backward": comm.count_by_op(),
        "forward_calls": forward_calls,
        "total_calls": [r.calls for r in recorders],
        "saw_dtensor": [r.saw_dtensor for r in recorders],
        "shapes": [sorted(r.shapes) for r in recorders],
        "full_shapes": [r.full_shape for r in recorders],
    }


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_checkpointed_blocks_train_like_the_unsharded_model(reshard_after_forward: bool) -> None:
    stats = run_distributed(_ac_parity, WORLD, reshard_after_forward)[0]
    assert stats["zero_grad_params"] == []


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_checkpoint_recompute_runs_on_regathered_parameters(reshard_after_forward: bool) -> None:
    got = run_distributed(_ac_collectives, WORLD, reshard_after_forward)[0]
    n_blocks = ARGS.n_layers
    groups = n_blocks + 1  # every block and the root
    assert got["forward"] == {"all_gather": groups}
    # The option goes to every group, the root's too. Resharded groups are gathered once more
    # in backward, the blocks before their recompute; groups that kept their parameters are not.
    regathers = groups if reshard_after_forward else 0
    want = {"reduce_scatter": groups} | ({"all_gather": regathers} if regathers else {})
    assert got["backward"] == want
    # The body ran once in forward and once more in backward (the recompute) ...
    assert got["forward_calls"] == [1] * n_blocks
    assert got["total_calls"] == [2] * n_blocks
    # ... and both times on full, plain tensors, never on the sharded DTensors.
    assert got["saw_dtensor"] == [False] * n_blocks
    assert got["shapes"] == [[shape] for shape in got["full_shapes"]]
