"""fp32 parameters inside bf16 groups, sharded the way torchtitan's apply_fsdp_to_decoder does.

torchtitan (since its #5068) builds its MixedPrecisionPolicy with ``param_dtype_override_fn``
on every call (torch 2.15's keyword), so that a bf16 model keeps chosen parameters (here the
output head, as NeMo's ``_keep_in_fp32_modules_strict`` does for an ``lm_head``) in fp32
inside their group. The calls below are the ones apply_fsdp_to_decoder makes for an untied
dense decoder under its "default" reshard policy without pipelining: the embedding, then
``[norm, head]`` in one group kept gathered after forward, every block, then the root, each
with ``mesh``, ``mp_policy`` (``cast_forward_inputs=False``) and ``reshard_after_forward``.

torchrun --standalone --nproc-per-node 2 examples/fp32_params.py
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from toy import ToyLM, batch, log, loss_fn

from fully_shard import CountingComm, MixedPrecisionPolicy, fully_shard, init_distributed


class Fp32Head(nn.Linear):
    """An output head that computes in its weight's dtype (fp32 here), whatever comes in."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.to(self.weight.dtype))


def main() -> None:
    job = init_distributed()  # torchrun's ranks: a GPU each and NCCL, or gloo on the CPU
    torch.manual_seed(0)
    model = ToyLM().to(job.device)
    head = Fp32Head(model.head.in_features, model.head.out_features, bias=False)
    head.weight = model.head.weight
    model.head = head
    keep_fp32 = {id(model.head.weight)}

    mp_policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,  # one gradient dtype per group: needed once dtypes mix
        cast_forward_inputs=False,
        param_dtype_override_fn=lambda p: p.dtype if id(p) in keep_fp32 else None,
    )
    fsdp_config = {"mesh": job.mesh, "mp_policy": mp_policy}
    fully_shard(model.embed, **fsdp_config, reshard_after_forward=True)
    fully_shard([model.norm, model.head], **fsdp_config, reshard_after_forward=False)
    for block in model.layers:
        fully_shard(block, **fsdp_config, reshard_after_forward=True)
    fully_shard(model, **fsdp_config, reshard_after_forward=True)
    comm = CountingComm()
    model.set_comm(comm)

    computed: dict[str, set[torch.dtype]] = {"head": set(), "blocks": set()}
    model.head.register_forward_hook(lambda m, a, o: computed["head"].add(m.weight.dtype))
    model.layers[0].up.register_forward_hook(lambda m, a, o: computed["blocks"].add(m.weight.dtype))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        tokens, targets = batch(step, device=job.device)
        logits = model(tokens)
        loss = loss_fn(logits, targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
        log(f"step {step}: loss {loss.item():.4f} (logits {logits.dtype})")

    gathers = sorted({str(r.dtype) for r in comm.records if r.op == "all_gather"})
    masters = {p.dtype for p in model.parameters()}
    log(
        f"head computes in {computed['head']}, blocks in {computed['blocks']}; all-gathers "
        f"{gathers}; sharded (master) parameters {masters}"
    )
    if computed != {"head": {torch.float32}, "blocks": {torch.bfloat16}} or not all(
        torch.isfinite(torch.tensor(losses))
    ):
        raise RuntimeError(f"unexpected compute dtypes {computed} or losses {losses}")
    job.shutdown()  # leave together: no rank tears down its connections while one still runs


if __name__ == "__main__":
    main()
