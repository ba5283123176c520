"""Hugging Face ``transformers``: shard a ``LlamaForCausalLM`` layer by layer.

    pip install transformers
    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py

The model is built from a tiny ``LlamaConfig`` (random weights, nothing downloaded). For a
pretrained model, load it (``from_pretrained``) on every rank before ``fully_shard``, or build
it on the meta device and load a DCP checkpoint into the shards.
"""

from __future__ import annotations

import torch
from toy import VOCAB, batch, log
from transformers import LlamaConfig, LlamaForCausalLM

from fully_shard import fully_shard, init_distributed


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    mesh = job.mesh
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(job.device)
    for layer in model.model.layers:  # each LlamaDecoderLayer: one group
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # embeddings, final norm and the (tied) lm_head

    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        tokens, _ = batch(step, device=job.device)
        loss = model(input_ids=tokens, labels=tokens).loss  # HF shifts the labels itself
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(f"step {step}: loss {loss.item():.4f}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
