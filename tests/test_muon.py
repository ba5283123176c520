"""``fully_shard.Muon``: torch's Muon on sharded parameters, each matrix orthogonalized once.

Every distributed case trains a sharded model with ``fully_shard.Muon`` beside an unsharded
replica with ``torch.optim.Muon`` on the global batch (``check_parity``) and asks for the
same parameters after 3 steps. The cases of one world size run in one job, so the suite pays
one pool round trip per world size: uneven rows (d0 not divisible by W, d0 < W), tall and
wide matrices, gradient accumulation, clipping, two param groups, mixed precision (fp32
masters, bf16 compute), HSDP (replicas bit-identical). Each job also counts Newton-Schulz
calls (once per matrix across the job) and the bytes ``all_to_all_single`` moved (the
exchange's theory).
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import fully_shard
from fully_shard import MixedPrecisionPolicy
from fully_shard import fully_shard as shard_fn
from fully_shard.optim import muon as muon_module
from fully_shard.optim.exchange import WholeMatrixExchange, assign_owners, row_bounds
from harness import device_mesh, mesh_1d, run_distributed
from models import MLPStack
from parity import (
    check_parity,
    fsdp_gradient_sync,
    loss_fn,
    make_float_batch,
    wrap_layers_then_root,
)

# Weights (out, in): (5, 6) wide, (13, 5) tall and uneven over 2..4 ranks, (2, 13) fewer rows
# than 3 or 4 ranks, (7, 2) tall with one column.
DIMS = [6, 5, 13, 2, 7]
SHAPES = [(b, a) for a, b in itertools.pairwise(DIMS)]
LR = 0.02
STEPS = 3
# Max |sharded - unsharded| after 3 steps; measured 0 or a few 1e-8 (the sharded gradient's
# reduction order). torch.optim.Muon on the same sharded model is off by 2e-3 to 5e-3.
ATOL = 1e-6


def _muon_pair(**options: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(ours, torch's) factories for ``check_parity``; two param groups if ``groups``."""
    groups = options.pop("groups", False)

    def split(params: list[nn.Parameter], lr: float) -> list[dict[str, Any]]:
        if not groups:
            return [{"params": params}]
        return [{"params": params[0::2]}, {"params": params[1::2], "lr": lr / 3}]

    def ours(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return fully_shard.Muon(split(params, lr), lr=lr, **options)

    def theirs(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        return torch.optim.Muon(split(params, lr), lr=lr, **options)

    return ours, theirs


def _parity(mesh: Any, **options: Any) -> float:
    """Train 3 steps beside the unsharded torch Muon; the max parameter difference."""
    accum = options.pop("grad_accum", 1)
    max_norm = options.pop("max_norm", None)
    shard_options = {}
    if options.pop("columns", False):  # every weight split on dim 1 instead of dim 0
        shard_options["shard_placement_fn"] = lambda p: Shard(1)
    shard = wrap_layers_then_root(shard_fn, **shard_options)
    stats = check_parity(
        functools.partial(MLPStack, DIMS, bias=False, activation="tanh"),
        shard,
        functools.partial(make_float_batch, in_dim=DIMS[0], out_dim=DIMS[-1]),
        mesh,
        steps=STEPS,
        lr=LR,
        optimizer=_muon_pair(**options),
        grad_accum=accum,
        set_gradient_sync=fsdp_gradient_sync if accum > 1 else None,
        max_norm=max_norm,
        atol=ATOL,
        rtol=0.0,
    )
    return stats["max_param_diff"]


def _counted(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """``fn()``, with how many Newton-Schulz calls and all-to-all bytes this rank made."""
    calls, sent = [0], [0]
    orthogonalize, all_to_all = muon_module.orthogonalize, dist.all_to_all_single

    def counting_ns(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return orthogonalize(*args)

    def counting_a2a(
        out: torch.Tensor, inp: torch.Tensor, out_splits: Any, in_splits: Any, **kw: Any
    ) -> Any:
        me = dist.get_rank(kw["group"])
        sent[0] += (inp.numel() - in_splits[me]) * inp.element_size()
        return all_to_all(out, inp, out_splits, in_splits, **kw)

    with (
        mock.patch.object(muon_module, "orthogonalize", counting_ns),
        mock.patch.object(dist, "all_to_all_single", counting_a2a),
    ):
        result = fn()
    return result, calls[0], sent[0]


def _same_gradients(
    mesh: Any, mp: MixedPrecisionPolicy | None = None, *, freeze: bool = False
) -> tuple[float, bool]:
    """Train 3 steps, the unsharded torch Muon stepping on the sharded model's gradients.

    For layouts whose gradients are not the global batch's to the bit (bf16 compute), and to
    read the sharded parameters afterwards. ``freeze``: the second block is frozen but both
    optimizers hold it (no gradient: skipped). Returns (max parameter difference, whether
    every replica of an HSDP mesh holds bit-identical shards).
    """
    torch.manual_seed(0)
    model = MLPStack(DIMS, bias=False, activation="tanh")
    model.layers[1].requires_grad_(not freeze)
    reference = copy.deepcopy(model)
    wrap_layers_then_root(shard_fn, **({"mp_policy": mp} if mp else {}))(model, mesh)
    ours, theirs = _muon_pair()
    opt, ref_opt = ours(list(model.parameters()), LR), theirs(list(reference.parameters()), LR)
    gen = torch.Generator().manual_seed(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    for _ in range(STEPS):
        x, y = make_float_batch(2 * world, gen, in_dim=DIMS[0], out_dim=DIMS[-1])
        loss_fn(model(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2]).backward()
        for p, ref_p in zip(model.parameters(), reference.parameters(), strict=True):
            ref_p.grad = None if p.grad is None else p.grad.full_tensor()  # type: ignore[attr-defined]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    diff = max(
        (p.full_tensor() - ref_p).abs().max().item()  # type: ignore[attr-defined]
        for p, ref_p in zip(model.parameters(), reference.parameters(), strict=True)
    )
    identical = True
    if mesh.ndim == 2:  # (replicate, shard): each replica's shards, gathered over replicas
        for p in model.parameters():
            local = p.to_local().detach()  # type: ignore[attr-defined]
            copies = [torch.empty_like(local) for _ in range(mesh.size(0))]
            dist.all_gather(copies, local, group=mesh.get_group(0))
            identical &= all(torch.equal(c, copies[0]) for c in copies)
    return diff, identical


def _exchange_alone() -> bool:
    """The exchange with another computation (3-D fp32 tensors, results in bf16, 3 buckets):
    each rank gets its rows of the whole result, and sends the bytes it planned."""
    world, rank = dist.get_world_size(), dist.get_rank()
    shapes = [(5, 2, 3), (1, 4, 1), (9, 3, 2), (4, 4, 4)]
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(s, generator=gen) for s in shapes]
    exchange = WholeMatrixExchange(shapes, [1.0, 1.0, 3.0, 2.0], mesh_1d().get_group(), buckets=3)
    mine = [t[slice(*row_bounds(t.shape[0], world, rank))] for t in full]
    got = exchange.run(mine, lambda i, whole: whole.cumsum(0) * (i + 1), out_dtype=torch.bfloat16)
    for i, t in enumerate(full):
        want = (t.cumsum(0) * (i + 1)).bfloat16()[slice(*row_bounds(t.shape[0], world, rank))]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)
    return exchange.sent_bytes == exchange.planned_bytes(4, 2)


def _cases() -> dict[str, Any]:
    mesh = mesh_1d()
    out: dict[str, Any] = {"exchange_bytes_as_planned": _exchange_alone()}
    out["plain"], out["ns_calls"], out["sent"] = _counted(lambda: _parity(mesh))
    out["nesterov_off_groups"] = _parity(
        mesh, nesterov=False, groups=True, adjust_lr_fn="match_rms_adamw"
    )
    out["accum_clip"] = _parity(mesh, grad_accum=2, max_norm=0.05, weight_decay=0.0)
    out["columns"] = _parity(mesh, columns=True)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out["mixed_precision_frozen"], _ = _same_gradients(mesh, bf16, freeze=True)
    if dist.get_world_size() == 4:
        hsdp = device_mesh((2, 2), ("replicate", "shard"))
        out["hsdp"], out["replicas_identical"] = _same_gradients(hsdp)
        out["two_meshes"] = _two_meshes(mesh, hsdp)
    return out


def _two_meshes(*meshes: Any) -> float:
    """Parameters on two meshes in one optimizer (grouped per mesh) against torch's Muon on
    the full tensors with the same gradients; the max difference after 3 steps."""
    gen = torch.Generator().manual_seed(2)
    full = [torch.randn(s, generator=gen) for s in SHAPES * 2]
    sharded = [
        nn.Parameter(distribute_tensor(t, meshes[i % 2], _rows(meshes[i % 2])))
        for i, t in enumerate(full)
    ]
    reference = [nn.Parameter(t.clone()) for t in full]
    ours = fully_shard.Muon(sharded, lr=LR)
    theirs = torch.optim.Muon(reference, lr=LR)
    for _ in range(STEPS):
        for p, q in zip(sharded, reference, strict=True):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements)
        ours.step()
        theirs.step()
    return max(
        (p.full_tensor() - q).abs().max().item() for p, q in zip(sharded, reference, strict=True)
    )


def _rows(mesh: Any) -> list[Any]:
    """Rows split over the mesh's last dim, replicated over the others."""
    return [Replicate()] * (mesh.ndim - 1) + [Shard(0)]


CASES = (
    "plain",
    "nesterov_off_groups",
    "accum_clip",
    "columns",
    "mixed_precision_frozen",
    "hsdp",
    "two_meshes",
)


def _theory_bytes(world: int) -> int:
    """Bytes all ranks send per step: every row not on its matrix's owner goes there and back,
    bf16 both ways."""
    owners = assign_owners([muon_module.newton_schulz_flops(s, 5) for s in SHAPES], world)
    total = 0
    for (rows, cols), owner in zip(SHAPES, owners, strict=True):
        start, stop = row_bounds(rows, world, owner)
        total += (rows - (stop - start)) * cols * (2 + 2)
    return total


@pytest.mark.parametrize("world", [2, 3, 4])
def test_muon_equals_unsharded_torch_muon(world: int) -> None:
    results = run_distributed(_cases, world, timeout=120)
    assert sum(r["ns_calls"] for r in results) == STEPS * len(SHAPES)  # once per matrix
    assert sum(r["sent"] for r in results) == STEPS * _theory_bytes(world)
    for r in results:
        for key in (
            "plain",
            "nesterov_off_groups",
            "accum_clip",
            "mixed_precision_frozen",
            "hsdp",
            "two_meshes",
        ):
            assert r.get(key, 0.0) <= ATOL, (key, r)
        assert r.get("replicas_identical", True)
        assert r["exchange_bytes_as_planned"]
    assert ("hsdp" in results[0]) == (world == 4)


def _train_global(model: nn.Module, opt: torch.optim.Optimizer, steps: range, world: int) -> None:
    """Steps ``steps`` of the global batches, this rank's rows (all of them if ``world`` 1)."""
    rank = dist.get_rank() if world > 1 else 0
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        x, y = make_float_batch(4, gen, in_dim=DIMS[0], out_dim=DIMS[-1])
        rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
        loss_fn(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()


def _sharded_model_and_muon() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLPStack(DIMS, bias=False, activation="tanh")
    wrap_layers_then_root(shard_fn)(model, mesh_1d())
    return model, fully_shard.Muon(model.parameters(), lr=LR)


def _save_at_4(path: str) -> None:
    model, opt = _sharded_model_and_muon()
    _train_global(model, opt, range(2), 4)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _resume_at_2(path: str) -> tuple[float, list[str]]:
    """Load the W=4 checkpoint at W=2, train 2 steps; the max difference from torch's Muon
    trained 4 steps unsharded, and the placements of the loaded momentum buffers."""
    torch.manual_seed(0)
    reference = MLPStack(DIMS, bias=False, activation="tanh")
    _train_global(reference, torch.optim.Muon(reference.parameters(), lr=LR), range(4), 1)
    model, opt = _sharded_model_and_muon()
    model_sd, optim_sd = get_state_dict(model, opt)  # runs a zero step: state to load into
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    placements = [str(s["momentum_buffer"].placements) for s in opt.state.values()]
    _train_global(model, opt, range(2, 4), 2)
    diff = max(
        (p.full_tensor() - ref_p).abs().max().item()  # type: ignore[attr-defined]
        for p, ref_p in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return diff, placements


def test_dcp_save_at_4_resume_at_2_equals_uninterrupted(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save_at_4, 4, path, timeout=120)
    for diff, placements in run_distributed(_resume_at_2, 2, path, timeout=120):
        assert placements == ["(Shard(dim=0),)"] * len(SHAPES)
        assert diff <= ATOL


def _bad_layouts() -> list[str]:
    """The errors a rank sees for layouts Muon cannot gather; raised before any step."""
    mesh = device_mesh((1, 2), ("dp", "tp"))  # tensor parallel + FSDP: two dims split
    messages = []
    cols = nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0), Shard(1)]))
    with pytest.raises(fully_shard.FullyShardNotImplementedError) as info:
        fully_shard.Muon([("tp.w", cols)])
    messages.append(str(info.value))
    return messages


def test_layout_errors_name_the_parameter() -> None:
    for messages in run_distributed(_bad_layouts, 2):
        assert "'tp.w'" in messages[0] and "Shard(dim=1)" in messages[0]


def test_non_2d_parameter_gets_torchs_error() -> None:
    bias = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="only supports 2D parameters") as ours:
        fully_shard.Muon([nn.Parameter(torch.zeros(2, 2)), bias])
    with pytest.raises(ValueError, match="only supports 2D parameters"):
        torch.optim.Muon([bias])
    assert isinstance(ours.value, fully_shard.FullyShardValueError)
    assert "params[1]" in str(ours.value) and "AdamW" in str(ours.value)
    with pytest.raises(fully_shard.FullyShardValueError, match=r"'head\.bias'"):
        fully_shard.Muon([("w", nn.Parameter(torch.zeros(2, 2))), ("head.bias", bias)])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        fully_shard.Muon([nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="nope")
    w = nn.Parameter(torch.ones(2, 2))
    w.grad = torch.ones(2, 2)
    opt = fully_shard.Muon([w], ns_steps=100)
    with pytest.raises(fully_shard.FullyShardValueError, match="fewer than 100"):
        opt.step()
    assert not opt.state and torch.equal(w, torch.ones(2, 2))  # refused before any change


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (5, 5)])
def test_newton_schulz_is_torchs_bit_for_bit(shape: tuple[int, int]) -> None:
    """Our written-out arithmetic (for a torch without Muon) equals torch's own."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    args = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert torch.equal(muon_module.newton_schulz(g, *args), _zeropower_via_newtonschulz(g, *args))


# Elementwise: each rank's rows update alone, so the sharded step is the unsharded one.
SAFE = {
    "SGD": {"momentum": 0.9},
    "Adam": {},
    "AdamW": {},
    "Adagrad": {},
    "RMSprop": {},
    "Adamax": {},
    "NAdam": {},
    "RAdam": {},
    "ASGD": {},
    "Adadelta": {},
}


def _rprop_on_shards() -> str:
    """torch 2.13's Rprop is elementwise but its code has no DTensor path: a boolean-mask
    assignment (the default, foreach=False) has no sharding strategy."""
    model = MLPStack(DIMS, activation="tanh")
    wrap_layers_then_root(shard_fn)(model, mesh_1d())
    opt = torch.optim.Rprop(model.parameters())
    model(torch.randn(2, DIMS[0])).sum().backward()
    with pytest.raises(RuntimeError, match="placement") as info:
        opt.step()
    return str(info.value)


def _safe_optimizers() -> dict[str, float]:
    out = {}
    for name, options in SAFE.items():
        cls = getattr(torch.optim, name)

        def factory(params: list[nn.Parameter], lr: float, cls: Any = cls, o: Any = options) -> Any:
            return cls(params, lr=lr, **o)

        stats = check_parity(
            functools.partial(MLPStack, DIMS, activation="tanh"),
            wrap_layers_then_root(shard_fn),
            functools.partial(make_float_batch, in_dim=DIMS[0], out_dim=DIMS[-1]),
            mesh_1d(),
            steps=STEPS,
            optimizer=(factory, factory),
        )
        out[name] = stats["max_param_diff"]
    return out


def test_elementwise_optimizers_are_safe_on_shards() -> None:
    """The "safe" rows of docs/optimizers.md: torch's optimizer on our sharded parameters
    trains like on the unsharded model (check_parity's tolerances)."""
    diffs = run_distributed(_safe_optimizers, 2, timeout=120)[0]
    assert set(diffs) == set(SAFE)
    run_distributed(_rprop_on_shards, 2)
