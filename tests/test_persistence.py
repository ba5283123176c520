"""Small parameters kept whole (``param_persistence_threshold``): Replicate, never gathered.

What they must do, checked on a 2-block ``Transformer`` whose head has a bias and whose
logits a scalar temperature, with a threshold that keeps the norms (16,), the bias (32,) and
the temperature () whole and shards the rest:

- train like the unsharded model (``check_parity``, 3 AdamW steps, clipped so that
  ``clip_grad_norm_``'s total norm decides every step) with reshard after forward on, off
  and to pairs (W = 4), gradient accumulation with sync off, frozen and tied parameters,
  activation checkpointing, HSDP (2 x 1 and 2 x 2), buckets, groups whose every parameter is
  kept whole, blocks compiled with ``block.compile()``, and tensor parallelism (dp 2 x tp 2:
  the TP placement kept, ``Replicate`` on the dp dim); with mixed precision like the same
  model without the threshold, computing in bf16;
- issue one all-reduce per step for every kept-whole gradient (two on HSDP), and no
  all-gather for a group that keeps everything whole (counted with ``CountingComm`` in a step
  after those);
- divide as the group's ``set_gradient_divide_factor`` says, and send zeros for an unused
  parameter under ``set_reduce_scatter_unused_params(True)``;
- show ``Replicate`` DTensors to ``state_dict()`` and DCP, which loads them at other world
  sizes, sharded or not, and loads a sharded checkpoint into them; ``clip_grad_norm_``'s
  total norm is the unsharded model's;
- refuse a bad threshold before changing anything.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.utils.checkpoint import checkpoint

from fully_shard import (
    CountingComm,
    FSDPModule,
    FullyShardTypeError,
    FullyShardValueError,
    MixedPrecisionPolicy,
    fully_shard,
)
from fully_shard.trace import Recorder
from harness import device_mesh, mesh_1d, run_distributed
from models import ModelArgs, Transformer
from parity import (
    assert_same,
    assert_stats_within,
    check_parity,
    fsdp_gradient_sync,
    loss_fn,
    make_token_batch,
    snapshot,
)
from tp_plan import apply_tp

# Keeps the norm weights (16), the head's bias (32) and the temperature () whole; the
# smallest sharded parameter (wq, 16 x 16) has 256 elements.
THRESHOLD = 33
WHOLE = ("attention_norm.weight", "ffn_norm.weight", "norm.weight", "output.bias", "temperature")


class _Tempered(Transformer):
    """``Transformer`` with a bias on the head and (``scalar``) a learnt scalar temperature on
    the logits, which only a threshold above 1 can shard (a scalar has no dim 0)."""

    def __init__(self, args: ModelArgs, *, scalar: bool = True) -> None:
        super().__init__(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=True)
        self.temperature = nn.Parameter(torch.tensor(1.5)) if scalar else None
        self.tie_weights()

    def forward(self, tokens: Tensor) -> Tensor:
        logits = super().forward(tokens)
        return logits if self.temperature is None else logits * self.temperature


def _shard(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    comm: CountingComm | None = None,
    cap: float | None = None,
    norm_groups: bool = False,
    compile: bool = False,
    threshold: int | None = THRESHOLD,
    **options: Any,
) -> None:
    """Each block (``norm_groups``: its two norms first, alone), then the root; ``compile``:
    then each block's ``block.compile()``."""
    for block in model.get_submodule("layers").children():
        if norm_groups:
            for norm in (block.attention_norm, block.ffn_norm):
                fully_shard(norm, mesh=mesh, param_persistence_threshold=threshold, **options)
        fully_shard(block, mesh=mesh, param_persistence_threshold=threshold, **options)
    fully_shard(model, mesh=mesh, param_persistence_threshold=threshold, **options)
    assert isinstance(model, FSDPModule)
    if compile:
        torch._dynamo.reset()
        for block in model.get_submodule("layers").children():
            block.compile(backend="eager")
    if cap is not None:
        model.set_bucket_cap_mb(cap)
    if comm is not None:
        model.set_comm(comm)


def _checkpointed(model: nn.Module) -> None:
    for block in model.get_submodule("layers").children():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]


def _count_one_step(model: nn.Module, comm: CountingComm) -> tuple[dict[str, int], ...]:
    tokens, targets = make_token_batch(2, torch.Generator().manual_seed(7))
    comm.reset()
    out = model(tokens)
    forward = comm.count_by_op()
    comm.reset()
    loss_fn(out, targets).backward()
    return forward, comm.count_by_op()


CASES: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    # case: (build options, shard options, check_parity options)
    "reshard": ({}, {}, {}),
    "no-reshard": ({}, {"reshard_after_forward": False}, {}),
    "accum": ({}, {}, {"grad_accum": 2, "set_gradient_sync": fsdp_gradient_sync}),
    "frozen": ({"frozen": "layers.1."}, {}, {}),
    "tied": ({"tie_embeddings": True}, {}, {}),
    "checkpoint": ({"checkpoint": True}, {}, {}),
    "hsdp": ({}, {"hsdp": (2, 1)}, {}),
    "hsdp-2x2": ({}, {"hsdp": (2, 2)}, {}),
    "reshard-int": ({}, {"reshard_after_forward": 2}, {}),
    "buckets": ({}, {"cap": 64.0}, {}),
    "norm-groups": ({}, {"norm_groups": True}, {}),
    # block.compile() after fully_shard: the hooks stay eager and show kept-whole parameters
    "compiled-blocks": ({}, {"compile": True}, {}),
}

# (forward all-gathers, backward collectives) in a step after the first: root and 2 blocks
# each gather once in forward, the blocks again in backward; every group reduce-scatters;
# one all-reduce carries every kept-whole gradient of the model.
COUNTS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "reshard": ({"all_gather": 3}, {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 1}),
    "no-reshard": ({"all_gather": 3}, {"reduce_scatter": 3, "all_reduce": 1}),
    "accum": ({"all_gather": 3}, {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 1}),
    # block 1 is frozen: no reduce-scatter; its norms' gradients are not there to reduce
    "frozen": ({"all_gather": 3}, {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}),
    "tied": ({"all_gather": 3}, {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 1}),
    "checkpoint": ({"all_gather": 3}, {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 1}),
    # (replicate 2, shard 1): nothing to gather or scatter; one all-reduce over the replicas
    # per group and one for the kept-whole gradients
    "hsdp": ({}, {"all_reduce": 4}),
    # (replicate 2, shard 2): the kept-whole gradients are summed over the shard dim, then
    # over the replicas
    "hsdp-2x2": ({"all_gather": 3}, {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 5}),
    # W = 4 resharded to pairs after forward: the root too, so backward gathers it again
    "reshard-int": ({"all_gather": 3}, {"all_gather": 3, "reduce_scatter": 3, "all_reduce": 1}),
    "buckets": ({"all_gather": 1}, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1}),
    # the four norm groups gather nothing and reduce-scatter nothing
    "norm-groups": ({"all_gather": 3}, {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 1}),
    "compiled-blocks": (
        {"all_gather": 3},
        {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 1},
    ),
}


def _parity(case: str) -> dict[str, Any]:
    build_opts, shard_opts, parity_opts = CASES[case]
    shard_opts = dict(shard_opts)
    hsdp = shard_opts.pop("hsdp", None)
    mesh = mesh_1d() if hsdp is None else device_mesh(hsdp, ("rep", "shard"))
    args = ModelArgs(n_layers=2, tie_embeddings=bool(build_opts.get("tie_embeddings")))

    def build() -> nn.Module:
        model = _Tempered(args)
        for name, p in model.named_parameters():
            if name.startswith(build_opts.get("frozen", "-")):
                p.requires_grad_(False)
        if build_opts.get("checkpoint"):
            _checkpointed(model)
        if args.tie_embeddings:  # a small tied parameter too: both norms of a block share one
            for block in model.get_submodule("layers").children():
                block.ffn_norm.weight = block.attention_norm.weight
        return model

    comm = CountingComm()
    held: list[nn.Module] = []

    def shard(model: nn.Module, mesh: DeviceMesh) -> None:
        _shard(model, mesh, comm=comm, **shard_opts)
        held.append(model)

    # max_norm below the gradients' norm: every step is clipped by the total norm
    stats = check_parity(
        build, shard, make_token_batch, mesh, steps=3, max_norm=0.05, **parity_opts
    )
    model = held[0]
    placements = {
        name: tuple(p.placements) for name, p in model.named_parameters() if name.endswith(WHOLE)
    }
    forward, backward = _count_one_step(model, comm)
    return {"stats": dict(stats), "placements": placements, "counts": (forward, backward)}


@pytest.mark.parametrize("case", list(CASES))
def test_kept_whole_trains_like_the_unsharded_model_with_one_all_reduce(case: str) -> None:
    for seen in run_distributed(_parity, 4 if case in ("hsdp-2x2", "reshard-int") else 2, case):
        assert seen["stats"]["max_param_diff"] < 1e-5, seen["stats"]
        assert seen["stats"]["max_grad_diff"] < 1e-5, seen["stats"]
        dims = 2 if case.startswith("hsdp") else 1
        placements = seen["placements"]
        assert len(placements) == (1 if case == "tied" else 2) * 2 + 3
        assert set(placements.values()) == {(Replicate(),) * dims}, placements
        assert seen["counts"] == COUNTS[case], seen["counts"]


# -- tensor parallel: the TP placement kept, Replicate on the dp dim ---------------------------


def _tp_parity() -> dict[str, Any]:
    root = device_mesh((2, 2), ("dp", "tp"))
    args = ModelArgs(vocab_size=34, dim=16, n_layers=2, n_heads=4, ffn_hidden=34, max_seq_len=8)
    held: list[nn.Module] = []

    def shard(model: nn.Module, mesh: DeviceMesh) -> None:
        assert isinstance(model, Transformer)
        apply_tp(model, root["tp"])  # the norms: SequenceParallel (Replicate, Partial grads)
        for block in model.layers:
            fully_shard(block, mesh=mesh, param_persistence_threshold=THRESHOLD)
        fully_shard(model, mesh=mesh, param_persistence_threshold=THRESHOLD)
        held.append(model)

    make_batch = functools.partial(make_token_batch, vocab_size=args.vocab_size, seq_len=6)
    stats = check_parity(lambda: Transformer(args), shard, make_batch, root["dp"], steps=3)
    placements = {
        n: (p.device_mesh.mesh_dim_names, tuple(p.placements))
        for n, p in held[0].named_parameters()
        if n.endswith("norm.weight") or n == "layers.0.attention.wq.weight"
    }
    return {"stats": dict(stats), "placements": placements}


def test_tensor_parallel_norms_kept_whole_on_the_dp_dim() -> None:
    for seen in run_distributed(_tp_parity, 4):
        assert_stats_within(seen["stats"], 1e-5)
        placements = seen["placements"]
        wq = placements.pop("layers.0.attention.wq.weight")
        assert wq == (("dp", "tp"), (Shard(1), Shard(0))), wq  # sharded as without a threshold
        assert len(placements) == 2 * 2 + 1
        assert set(placements.values()) == {(("dp", "tp"), (Replicate(), Replicate()))}


# -- mixed precision: like the same model without the threshold -------------------------------


def _twin_mixed_precision() -> dict[str, Any]:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for threshold in (None, THRESHOLD):
        torch.manual_seed(0)
        model = _Tempered(ModelArgs(), scalar=False)
        _shard(model, mesh_1d(), threshold=threshold, mp_policy=mp)
        models.append(model)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    rank = torch.distributed.get_rank()
    seen: dict[str, Any] = {}
    for step in range(3):
        tokens, targets = make_token_batch(4, torch.Generator().manual_seed(step))
        tokens, targets = tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2]
        for model, optim in zip(models, optims, strict=True):
            with Recorder(model) as recorder:
                out = model(tokens)
                if "compute" not in seen:  # the root stays gathered: what forward computed with
                    seen["compute"] = model.norm.weight.dtype
                loss_fn(out, targets).backward()
            if step == 0:
                seen.setdefault("traced", []).append(recorder.recording())
            optim.step()
            optim.zero_grad()
    whole = models[1].get_parameter("norm.weight")
    seen["kept"] = (tuple(whole.placements), whole.dtype)
    pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
    seen["diff"] = max((a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in pairs)
    return seen


def test_mixed_precision_computes_in_param_dtype_and_trains_like_sharded() -> None:
    for seen in run_distributed(_twin_mixed_precision, 2):
        assert seen["diff"] < 1e-5
        assert seen["kept"] == ((Replicate(),), torch.float32)
        assert seen["compute"] == torch.bfloat16
        # A replica holds every parameter whole, kept whole or not: the same bytes either way
        # (no padding at W = 2 here); the kept-whole ones are alive at every sample (bf16).
        # The recorders were made before the first forward: the compute dtype counts anyway.
        sharded, kept = seen["traced"]
        assert kept.replica_bytes == sharded.replica_bytes
        kept_bytes = (16 * 5 + 32) * 2  # 2 x 2 block norms, the final norm, the head's bias
        assert sharded.memory[0].unsharded_bytes == 0
        assert kept.memory[0].unsharded_bytes == kept.memory[-1].unsharded_bytes == kept_bytes
        # At the peak (the root and one block gathered) the other block's kept-whole bytes
        # are alive too: the price of keeping them whole.
        assert kept.peak_unsharded_bytes() == sharded.peak_unsharded_bytes() + (16 + 16) * 2


def _twin_divide_factor() -> float:
    """Each group's gradients summed (``set_gradient_divide_factor(1.0)``), not averaged; a
    parameter forward never uses gets zeros (``set_reduce_scatter_unused_params(True)``)."""
    grads = []
    for threshold in (None, THRESHOLD):
        torch.manual_seed(0)
        model = _Tempered(ModelArgs(), scalar=False)
        model.spare = nn.Parameter(torch.ones(4))  # kept whole under THRESHOLD, never used
        _shard(model, mesh_1d(), threshold=threshold)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_reduce_scatter_unused_params(True)
        rank = torch.distributed.get_rank()
        tokens, targets = make_token_batch(2, torch.Generator().manual_seed(rank))
        loss_fn(model(tokens), targets).backward()
        grads.append([p.grad.full_tensor() for p in model.parameters() if p.grad is not None])
        assert tuple(model.spare.placements) == ((Replicate(),) if threshold else (Shard(0),))
        assert torch.equal(model.spare.grad.full_tensor(), torch.zeros(4))
    assert len(grads[0]) == len(grads[1]) == len(list(model.parameters()))
    return max((a - b).abs().max().item() for a, b in zip(*grads, strict=True))


def test_the_divide_factor_and_unused_params_apply_to_kept_whole_gradients_too() -> None:
    for diff in run_distributed(_twin_divide_factor, 2):
        assert diff < 1e-6


# -- state_dict, DCP across world sizes, clip_grad_norm_ ------------------------------------


def _train_and_save(path: str, threshold: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Tempered(ModelArgs())
    reference = _Tempered(ModelArgs())
    reference.load_state_dict(model.state_dict())
    _shard(model, mesh_1d(), threshold=threshold)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        tokens, targets = make_token_batch(2, torch.Generator().manual_seed(step))
        loss_fn(model(tokens), targets).backward()
        optim.step()
        optim.zero_grad()
    # clip_grad_norm_'s total norm over Shard(0) and Replicate gradients: the unsharded one's
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            p.copy_(q.full_tensor())
    tokens, targets = make_token_batch(4, torch.Generator().manual_seed(9))
    rank = torch.distributed.get_rank()
    loss_fn(model(tokens[2 * rank : 2 * rank + 2]), targets[2 * rank : 2 * rank + 2]).backward()
    loss_fn(reference(tokens), targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    optim.zero_grad()
    sd = model.state_dict()
    kinds = {k: tuple(v.placements) for k, v in sd.items() if k.endswith(WHOLE)}
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    moments = {n: optim.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    return {
        "norm": (norm.full_tensor().item(), want.item()),
        "kinds": kinds,
        "full": full,
        "moments": moments,
    }


def _load(path: str, threshold: int | None) -> dict[str, Any]:
    model = _Tempered(ModelArgs())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
    _shard(model, mesh_1d(), threshold=threshold)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = make_token_batch(2, torch.Generator().manual_seed(0))
    loss_fn(model(tokens), targets).backward()
    optim.step()  # state tensors for DCP to load into
    optim.zero_grad()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    moments = {n: optim.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    return {"full": full, "moments": moments}


# (threshold at save, world and threshold at load): kept whole -> kept whole, kept whole ->
# sharded, sharded -> kept whole (2 keeps only the scalar whole)
@pytest.mark.parametrize(
    ("saved_with", "load_world", "load_with"),
    [(THRESHOLD, 1, THRESHOLD), (THRESHOLD, 3, 2), (2, 4, THRESHOLD)],
)
def test_state_dict_dcp_and_clip_grad_norm(
    tmp_path: Path, saved_with: int, load_world: int, load_with: int
) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, 2, path, saved_with)[0]
    got, want = saved["norm"]
    assert abs(got - want) < 1e-5 * want, saved["norm"]
    kinds = saved["kinds"]
    assert kinds.pop("temperature") == (Replicate(),)
    assert set(kinds.values()) == {(Replicate(),) if saved_with == THRESHOLD else (Shard(0),)}
    assert len(kinds) == 2 * 2 + 2
    for loaded in run_distributed(_load, load_world, path, load_with):
        for key in ("full", "moments"):
            assert loaded[key].keys() == saved[key].keys()
            for name, value in saved[key].items():
                torch.testing.assert_close(loaded[key][name], value, rtol=0, atol=0, msg=name)


# -- bad input ---------------------------------------------------------------------------------


def _bad_thresholds() -> list[str]:
    torch.manual_seed(0)
    model = _Tempered(ModelArgs())
    before = snapshot(model)
    errors = []
    for bad in (-1, True, 2.5, "64"):
        with pytest.raises((FullyShardValueError, FullyShardTypeError)) as info:
            fully_shard(model, mesh=mesh_1d(), param_persistence_threshold=bad)  # type: ignore[arg-type]
        errors.append(f"{type(info.value).__name__}: {info.value}")
        assert_same(before, snapshot(model))
    assert not isinstance(model, FSDPModule)
    # 2: only the scalar is kept whole (0 or None would refuse it: a scalar has no dim 0)
    fully_shard(model, mesh=mesh_1d(), param_persistence_threshold=2)
    kinds = {n: tuple(p.placements) for n, p in model.named_parameters()}
    assert kinds.pop("temperature") == (Replicate(),)
    assert set(kinds.values()) == {(Shard(0),)}
    return errors


def test_a_bad_threshold_is_refused_before_anything_changes() -> None:
    errors = run_distributed(_bad_thresholds, 1)[0]
    assert [e.split(":")[0] for e in errors] == [
        "FullyShardValueError",
        "FullyShardTypeError",
        "FullyShardTypeError",
        "FullyShardTypeError",
    ]
    assert "param_persistence_threshold=-1" in errors[0]
