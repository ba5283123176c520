"""LoRA fine-tuning with Hugging Face PEFT, sharded with ``fully_shard``.

    pip install transformers peft      # or: pip install -e '.[hf]'
    torchrun --standalone --nproc-per-node 2 examples/peft_lora.py

PEFT wraps the attention projections of each decoder layer in LoRA adapters and freezes
everything else, so every sharded layer holds frozen base weights beside trainable adapters.
A group is freed only when autograd is done with its layer (the frozen weights are still
needed for the input gradient after the adapters' gradients have arrived), and only the
adapters get gradients, reductions and optimizer state.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
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
        use_cache=False,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).to(job.device)  # or from_pretrained(...) on every rank
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    for layer in base.model.layers:  # frozen q/k/v/o/mlp weights + trainable lora_A/lora_B
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    trainable = [p for p in model.parameters() if p.requires_grad]
    total = sum(1 for _ in model.parameters())
    optim = torch.optim.AdamW(trainable, lr=1e-3)  # optimizer state for the adapters only
    for step in range(3):
        tokens, _ = batch(step, device=job.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        log(
            f"step {step}: loss {loss.item():.4f}, {len(trainable)} of {total} parameters trainable"
        )
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
