"""Start from pretrained weights: build on meta, shard, allocate, then load rank 0's checkpoint.

    torchrun --standalone --nproc-per-node 2 examples/pretrained.py

The way to load a model too big for every rank to hold in full: no rank ever builds it in
full on its device. Each rank builds the model on the meta device, shards it, and allocates
only its own shards (``to_empty``); rank 0 alone reads the checkpoint, into CPU memory, and
``set_model_state_dict(..., broadcast_from_rank0=True)`` sends every tensor to the other ranks,
each keeping its rows. The checkpoint here is a tiny Hugging Face Llama written with
``save_pretrained`` (a ``torch.save`` of the toy model when ``transformers`` is not installed).

The script then checks its claim against the same checkpoint loaded the ordinary way into an
unsharded model: the same logits, and after one AdamW step the same loss and parameters.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from toy import SEQ, VOCAB, ToyLM, log, loss_fn

from fully_shard import fully_shard, init_distributed

Loss = Callable[[nn.Module, Tensor, Tensor], Tensor]


def hf_llama(directory: Path) -> tuple[Callable[[], nn.Module], Callable[[], nn.Module], Loss]:
    """(build an untrained model, load the checkpoint, the loss) for a tiny Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        use_cache=False,
    )

    def load() -> nn.Module:
        return LlamaForCausalLM.from_pretrained(directory)

    def loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
        return model(input_ids=tokens, labels=tokens).loss

    if dist.get_rank() == 0 and not (directory / "config.json").exists():
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(directory)  # the "pretrained" checkpoint
    return (lambda: LlamaForCausalLM(config)), load, loss


def toy(directory: Path) -> tuple[Callable[[], nn.Module], Callable[[], nn.Module], Loss]:
    """The same for the toy model and a plain ``torch.save`` checkpoint."""

    def load() -> nn.Module:
        model = ToyLM()
        model.load_state_dict(torch.load(directory / "model.pt", weights_only=True))
        return model

    def loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
        return loss_fn(model(tokens), targets)

    if dist.get_rank() == 0 and not (directory / "model.pt").exists():
        torch.manual_seed(0)
        torch.save(ToyLM().state_dict(), directory / "model.pt")
    return ToyLM, load, loss


def blocks(model: nn.Module) -> Any:
    return model.model.layers if hasattr(model, "model") else model.layers


def recompute_buffers(model: nn.Module, device: torch.device) -> None:
    """Refill what ``to_empty`` left uninitialised and no checkpoint holds: non-persistent
    buffers (the rotary embedding's frequencies), rebuilt on the device."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is not None:
        with torch.device(device):
            model.model.rotary_emb = type(rotary)(rotary.config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None, help="default: a new temporary dir")
    args = parser.parse_args()
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    where = [str(args.dir) if args.dir else tempfile.mkdtemp(prefix="fully_shard_pretrained_")]
    dist.broadcast_object_list(where)  # rank 0's directory for every rank
    has_hf = importlib.util.find_spec("transformers") is not None
    build, load, loss = (hf_llama if has_hf else toy)(Path(where[0]))
    dist.barrier()  # rank 0 has written the checkpoint

    # 1. Shapes only, then shards only: no rank allocates the full model on its device.
    with torch.device("meta"):
        model = build()
    for block in blocks(model):
        fully_shard(block, mesh=job.mesh)
    fully_shard(model, mesh=job.mesh)
    model.to_empty(device=job.device)
    recompute_buffers(model, job.device)

    # 2. Rank 0 reads the checkpoint (CPU memory); every rank keeps its rows of each tensor.
    full = load().state_dict() if dist.get_rank() == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    log(f"loaded {len(full)} tensors on rank 0 into {sum(1 for _ in model.parameters())} shards")

    # 3. The check: the checkpoint loaded normally into an unsharded model, on every rank.
    reference = load().to(job.device)
    gen = torch.Generator().manual_seed(0)  # the same batch on every rank
    seq = torch.randint(0, VOCAB, (4, SEQ + 1), generator=gen).to(job.device)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    with torch.no_grad():
        got, want = model(tokens), reference(tokens)
        got, want = (getattr(o, "logits", o) for o in (got, want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    steps = [(model, torch.optim.AdamW(model.parameters(), lr=1e-2))]
    steps.append((reference, torch.optim.AdamW(reference.parameters(), lr=1e-2)))
    losses = []
    for m, optim in steps:  # the same batch on every rank: averaged gradients equal one rank's
        losses.append(loss(m, tokens, targets))
        losses[-1].backward()
        optim.step()
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    ref_params = dict(reference.named_parameters())
    diff = max(
        (p.full_tensor() - ref_params[name]).abs().max().item()
        for name, p in model.named_parameters()
    )
    log(f"outputs and one AdamW step match the unsharded model: max |param diff| {diff:.1e}")
    if diff > 1e-5:
        raise SystemExit(f"the loaded sharded model drifted from the unsharded one by {diff:.2e}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
