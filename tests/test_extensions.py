"""Tensor-subclass all-gather extensions: a hand-written int8 block-quantized weight.

``Int8BlockWeight`` wraps an fp32 master weight ``(rows, cols)``. Its
``fsdp_pre_all_gather`` quantizes this rank's rows to int8 values ``(rows, cols)`` and fp32
scales ``(rows, ceil(cols / BLOCK))`` (one per block of ``BLOCK`` columns of a row, so the
quantization of a shard is the shard of the quantization); ``fsdp_post_all_gather``
dequantizes the gathered pair into the unsharded weight in ``param_dtype``, and with
``out=`` refills the weight it built before. Every call is written to a log that the tests
read: every argument of the protocol is checked against what torch's FSDP2 passes.

Parity: against an unsharded model whose linear layers use ``dequantize(quantize(W))`` with a
straight-through gradient (the same transform), W = 2 and 3, AdamW, uneven dim 0 and
``reshard_after_forward`` True and False; and against torch's ``fully_shard`` running the same
subclass on gloo; and with the same hooks monkey-patched onto a plain local tensor after
``to_empty()`` (no subclass), 1-D and HSDP, as torch's tests do. The bytes on the wire are
counted (``CountingComm``) and compared with what the pre hook returned, and the gathered
outputs the post hook sees with every rank's inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from extension_stubs import (
    BLOCK,
    HIDDEN,
    IN,
    OUT,
    QMLP,
    BadSignature,
    Int8BlockWeight,
    PreOnly,
    QLinear,
    convert,
    dequantize_rows,
    quantize_rows,
)
from fully_shard import (
    CountingComm,
    FullyShardNotImplementedError,
    FullyShardTypeError,
    FullyShardValueError,
    MixedPrecisionPolicy,
    fully_shard,
)
from harness import device_mesh, mesh_1d, run_distributed
from parity import check_parity, make_float_batch, needs_torch_fsdp2_on_cpu


def _shard_fn(impl: str) -> Callable[..., Any]:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    return fully_shard


def _shard(
    impl: str, log: list[dict[str, Any]], mesh: Any = None, pad: bool = True, **options: Any
) -> Callable[[nn.Module, Any], None]:
    def shard(model: nn.Module, dp_mesh: Any) -> None:
        convert(model, log, pad=pad)
        fs = _shard_fn(impl)
        for layer in model.layers:  # type: ignore[union-attr]
            fs(layer, mesh=mesh or dp_mesh, **options)
        fs(model, mesh=mesh or dp_mesh, **options)

    return shard


# -- parity ------------------------------------------------------------------------------------


def _batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return make_float_batch(n, gen, in_dim=IN, out_dim=3)


def _parity(reshard: bool, pad: bool, steps: int) -> dict[str, Any]:
    log: list[dict[str, Any]] = []
    stats = check_parity(
        QMLP,
        _shard("ours", log, pad=pad, reshard_after_forward=reshard),
        _batch,
        mesh_1d(),
        steps=steps,
        lr=1e-2,
        atol=1e-5,
    )
    return {
        "pre_calls": sum(e["hook"] == "pre" for e in log),
        "fresh_posts": sum(e["hook"] == "post" and e["out"] is None for e in log),
        "zero_grad": stats["zero_grad_params"],
    }


@pytest.mark.parametrize("pad", [True, False], ids=["padded-inputs", "local-rows"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("world", [2, 3])
def test_trains_like_an_unsharded_model_with_the_same_transform(
    world: int, reshard: bool, pad: bool
) -> None:
    steps = 3
    for got in run_distributed(_parity, world, reshard, pad, steps, timeout=120):
        assert got["zero_grad"] == []
        # the two quantized layers: one gather each in forward, one more in backward when
        # they reshard after forward; the post hook builds each weight once, then refills it
        per_step = 2 * (2 if reshard else 1)
        assert got["pre_calls"] == steps * per_step
        assert got["fresh_posts"] == 2


def _train(impl: str, steps: int) -> dict[str, torch.Tensor]:
    """Train the even model with ``impl``'s fully_shard; the losses and final parameters."""
    log: list[dict[str, Any]] = []
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = QMLP(even=True)
    _shard(impl, log)(model, mesh_1d())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = _batch(2 * world, gen)
        loss = F.mse_loss(model(x[2 * rank : 2 * rank + 2]), y[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    out = {"losses": torch.stack(losses)}
    for name, p in model.named_parameters():
        full = p.full_tensor()  # type: ignore[attr-defined]
        out[name] = full._data if isinstance(full, Int8BlockWeight) else full
    return out


@needs_torch_fsdp2_on_cpu
def test_matches_torch_fully_shard_on_the_same_subclass() -> None:
    ours = run_distributed(_train, 2, "ours", 3)
    ref = run_distributed(_train, 2, "torch", 3)
    for got, want in zip(ours, ref, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


# -- hooks patched onto a plain tensor (torch's test_all_gather_extensions_monkey_patch) --------


def _patch_int8_hooks(local: torch.Tensor, log: list[tuple[int, int]]) -> None:
    """The int8 transform's hooks, set on one local shard as instance methods (no subclass);
    each pre call logs the mesh it got as ``(ndim, size)``."""

    def pre(
        self: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        log.append((mesh.ndim, mesh.size()))
        return quantize_rows(self), None

    def post(
        self: torch.Tensor,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        full = dequantize_rows(*outputs, dtype=param_dtype)
        if out is not None:
            out.data.copy_(full[: out.size(0)])  # .data: what autograd saved keeps its version
            return None
        return full, (full,)

    local.fsdp_pre_all_gather = pre.__get__(local)  # type: ignore[attr-defined]
    local.fsdp_post_all_gather = post.__get__(local)  # type: ignore[attr-defined]


def _patched_after_to_empty(impl: str, hsdp: bool) -> list[tuple[int, int]]:
    """Meta init, wrap, ``to_empty()`` + ``reset_parameters()``, then the hooks patched onto
    every quantized weight's ``_local_tensor``: trains like the unsharded model with the same
    transform. Returns the meshes the pre hook was given."""
    log: list[tuple[int, int]] = []
    world = dist.get_world_size()
    mesh = device_mesh((2, world // 2), ("replicate", "shard")) if hsdp else mesh_1d()

    def build() -> nn.Module:
        with torch.device("meta"):
            return QMLP(even=True)

    def shard(model: nn.Module, dp_mesh: Any) -> None:
        fs = _shard_fn(impl)
        for layer in model.layers:  # type: ignore[union-attr]
            layer.quantized_gather = True  # the gather dequantizes: no fake_quant in forward
            fs(layer, mesh=dp_mesh)
        fs(model, mesh=dp_mesh)
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        for layer in model.layers:  # type: ignore[union-attr]
            _patch_int8_hooks(layer.weight._local_tensor, log)

    stats = check_parity(
        build, shard, _batch, mesh, steps=3, lr=1e-2, atol=1e-5, reference_from_sharded=True
    )
    assert stats["zero_grad_params"] == []
    return log


@pytest.mark.parametrize(("hsdp", "world"), [(False, 2), (True, 4)], ids=["1d-w2", "hsdp-2x2"])
@pytest.mark.parametrize("impl", ["ours", pytest.param("torch", marks=needs_torch_fsdp2_on_cpu)])
def test_hooks_patched_on_a_local_tensor_are_honoured(impl: str, hsdp: bool, world: int) -> None:
    """Parity with the transform proves the hooks ran on every gather; on HSDP the pre hook
    gets the 1-D shard mesh (torch's test_all_gather_extension_hsdp_mesh)."""
    shard_size = world // 2 if hsdp else world
    for log in run_distributed(_patched_after_to_empty, world, impl, hsdp, timeout=120):
        # two patched weights, one gather each per forward and one more per backward, 3 steps
        assert log == [(1, shard_size)] * (3 * 2 * 2)


# -- every argument of the protocol ------------------------------------------------------------


def _arguments(param_dtype: torch.dtype | None) -> dict[str, Any]:
    log: list[dict[str, Any]] = []
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = QMLP()
    full = {i: layer.weight.detach().clone() for i, layer in enumerate(model.layers)}
    convert(model, log)
    mesh = mesh_1d()
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # the weight each forward computes with, and its values then (its storage is freed after)
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {0: [], 1: []}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda m, args, i=i: seen[i].append((m.weight, m.weight.detach().clone()))
        )
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, _ = _batch(2, gen)
        model(x).sum().backward()  # no optimizer step: the weights stay what `full` holds

    compute = param_dtype or torch.float32
    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    layer_of = {id(m): i for i, m in enumerate(model.layers)}
    pres = [e for e in log if e["hook"] == "pre"]
    posts = [e for e in log if e["hook"] == "post"]
    check(len(pres) == len(posts) == 8, f"{len(pres)} pre and {len(posts)} post calls, not 8")
    built: dict[int, torch.Tensor] = {}
    for pre, post in zip(pres, posts, strict=True):  # each pre is followed by its post
        i = layer_of[id(pre["module"])]
        rows, cols = full[i].shape
        chunk = math.ceil(rows / world)
        check(pre["mesh"] is mesh, "pre: mesh is not the 1-D shard mesh")
        check(pre["outer_size"] == full[i].shape, f"pre: outer_size {pre['outer_size']}")
        check(tuple(pre["outer_stride"]) == (cols, 1), f"pre: outer_stride {pre['outer_stride']}")
        check(pre["mp_policy"] is mp, "pre: mp_policy is not the group's policy")
        want_rows = max(0, min(chunk, rows - rank * chunk))
        check(pre["rows"] == want_rows, f"pre: {pre['rows']} local rows, not {want_rows}")
        check(post["metadata"] is pre["metadata"], "post: metadata is not what pre returned")
        check(post["param_dtype"] == compute, f"post: param_dtype {post['param_dtype']}")
        shapes = [(tuple(t.shape), t.dtype) for t in post["outputs"]]
        nb = math.ceil(cols / BLOCK)
        want = [((world * chunk, cols), torch.int8), ((world * chunk, nb), torch.float32)]
        check(shapes == want, f"post: outputs {shapes}")
        if i not in built:
            check(post["out"] is None, "post: out= given on the first gather")
            built[i] = seen[i][0][0]
        else:
            check(post["out"] is built[i], "post: out= is not the weight it built before")
    for i, weights in seen.items():
        expect = dequantize_rows(*quantize_rows(full[i]), dtype=compute)
        for w, values in weights:
            check(w is built[i], f"layer {i}: forward saw another tensor than the built one")
            check(w.dtype == compute and torch.equal(values, expect), f"layer {i}: values")
    return {"problems": problems, "dtype": str(built[0].dtype)}


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_hooks_get_every_argument_as_torch_passes_it(param_dtype: torch.dtype | None) -> None:
    for got in run_distributed(_arguments, 2, param_dtype):
        assert got == {"problems": [], "dtype": str(param_dtype or torch.float32)}


def _hsdp_mesh_given() -> list[int]:
    """HSDP (2 x 2): the pre hook gets the shard dim's 1-D mesh."""
    log: list[dict[str, Any]] = []
    mesh = device_mesh((2, 2), ("replicate", "shard"))
    torch.manual_seed(0)
    model = QMLP()
    _shard("ours", log, mesh=mesh)(model, mesh)
    model(torch.randn(2, IN)).sum().backward()
    given = {(m.mesh_dim_names, tuple(m.mesh.tolist())) for e in log if (m := e.get("mesh"))}
    (only,) = given  # one mesh for every call: the "shard" dim of this rank's row
    assert only[0] == ("shard",)
    return list(only[1])


def test_hsdp_gives_the_pre_hook_the_shard_mesh() -> None:
    got = run_distributed(_hsdp_mesh_given, 4, timeout=120)
    assert got == [[0, 1], [0, 1], [2, 3], [2, 3]]


# -- what goes over the wire -------------------------------------------------------------------


def _wire(pad: bool) -> dict[str, Any]:
    log: list[dict[str, Any]] = []
    torch.manual_seed(0)
    model = QMLP()
    _shard("ours", log, pad=pad)(model, mesh_1d())
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]
    model(torch.randn(2, IN)).sum().backward()
    gathers = [(str(r.dtype), r.nbytes) for r in comm.records if r.op == "all_gather"]
    first = next(e for e in log if e["hook"] == "pre")  # layer 0's forward gather
    post = next(e for e in log if e["hook"] == "post")
    return {
        "gathers": gathers,
        "sent": [t for t in first["inputs"]],
        "got": [t for t in post["outputs"]],
    }


@pytest.mark.parametrize("pad", [True, False], ids=["padded-inputs", "local-rows"])
def test_the_wire_carries_what_the_pre_hook_returned(pad: bool) -> None:
    world = 3
    results = run_distributed(_wire, world, pad)

    def padded(rows: int, cols: int, itemsize: int) -> int:
        return math.ceil(rows / world) * cols * itemsize

    def layer(rows: int, cols: int) -> int:
        # int8 values + fp32 scales from the pre hook, the fp32 bias as itself
        nb = math.ceil(cols / BLOCK)
        return padded(rows, cols, 1) + padded(rows, nb, 4) + padded(rows, 1, 4)

    head = padded(3, OUT, 4) + padded(3, 1, 4)
    l0, l1 = layer(HIDDEN, IN), layer(OUT, HIDDEN)
    # forward: root (fp32), layer 0, layer 1 (uint8: mixed dtypes); backward: layer 1, 0
    want = [
        ("torch.float32", head),
        ("torch.uint8", l0),
        ("torch.uint8", l1),
        ("torch.uint8", l1),
        ("torch.uint8", l0),
    ]
    chunk = math.ceil(HIDDEN / world)
    for got in results:
        assert got["gathers"] == want
        for i in range(2):  # values, scales: rank r's inputs (zero-padded) at rows r*chunk...
            sent = []
            for r in range(world):
                t = results[r]["sent"][i]
                sent.append(F.pad(t, (0, 0, 0, chunk - t.size(0))))
            torch.testing.assert_close(got["got"][i], torch.cat(sent), rtol=0, atol=0)


# -- refused up front, and bad hooks -----------------------------------------------------------


def _refusal(case: str) -> str:
    torch.manual_seed(0)
    model = QMLP(even=True)  # 8 rows: a tensor-parallel split of 2 x 4
    mesh = mesh_1d()
    kwargs: dict[str, Any] = {}
    if case in ("pre only", "bad signature"):
        kind = PreOnly if case == "pre only" else BadSignature
        model.layers[0].weight = nn.Parameter(model.layers[0].weight.detach().as_subclass(kind))
        error: type[Exception] = FullyShardTypeError
    else:
        convert(model, [])
        error = FullyShardNotImplementedError
        if case == "Shard(1)":
            kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 else None
        elif case == "reshard_after_forward=2":
            kwargs["reshard_after_forward"] = 2
        elif case == "tensor parallel":
            root = device_mesh((1, dist.get_world_size()), ("dp", "tp"))
            layer = model.layers[0]
            local = layer.weight.detach().chunk(root["tp"].size())[root["tp"].get_local_rank()]
            layer.weight = nn.Parameter(
                DTensor.from_local(Int8BlockWeight(local.clone(), []), root["tp"], [Shard(0)])
            )
            mesh = root["dp"]
    layer = model.layers[0]
    before = {n: id(p) for n, p in layer.named_parameters()}
    with pytest.raises(error) as info:
        fully_shard(layer, mesh=mesh, **kwargs)
    # nothing changed: the same parameter objects, the class not swapped
    assert {n: id(p) for n, p in layer.named_parameters()} == before
    assert type(layer) is QLinear
    return str(info.value)


@pytest.mark.parametrize(
    ("case", "world", "message"),
    [
        ("pre only", 2, "defines only one of fsdp_pre_all_gather / fsdp_post_all_gather"),
        ("bad signature", 2, "takes neither torch's arguments"),
        ("Shard(1)", 2, "sharded on dim 0 only, but shard_placement_fn chose Shard(1)"),
        ("reshard_after_forward=2", 4, "reshard_after_forward=2 with parameter 'weight'"),
        ("tensor parallel", 2, "tensor-parallel DTensor whose local tensor is a Int8BlockWeight"),
    ],
)
def test_what_an_extension_cannot_do_is_refused_before_anything_changes(
    case: str, world: int, message: str
) -> None:
    for got in run_distributed(_refusal, world, case, timeout=120):
        assert message in got


def _patched_refusal(case: str) -> str:
    """Hooks patched on after fully_shard, onto a parameter sharded in a way an extension
    cannot be: refused at the first forward (lazy init), before any all-gather."""
    torch.manual_seed(0)
    model = QMLP(even=True)
    layer = model.layers[0]
    if case == "Shard(1)":
        fully_shard(layer, mesh=mesh_1d(), shard_placement_fn=lambda p: Shard(p.dim() - 1))
    else:
        fully_shard(layer, mesh=mesh_1d(), reshard_after_forward=2)
    fully_shard(model, mesh=mesh_1d())
    _patch_int8_hooks(layer.weight._local_tensor, [])
    with pytest.raises(FullyShardNotImplementedError) as info:
        model(torch.randn(2, IN))
    return str(info.value)


@pytest.mark.parametrize(
    ("case", "world", "message"),
    [
        ("Shard(1)", 2, "sharded on dim 0 only, but shard_placement_fn chose Shard(1)"),
        ("reshard_after_forward=2", 4, "reshard_after_forward=2 with parameter"),
    ],
)
def test_hooks_patched_on_later_are_refused_at_the_first_forward(
    case: str, world: int, message: str
) -> None:
    for got in run_distributed(_patched_refusal, world, case, timeout=120):
        assert message in got


def _flat_inputs_on_an_uneven_split() -> str:
    torch.manual_seed(0)
    model = QMLP()
    convert(model, [], flat=True)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    with pytest.raises(FullyShardValueError) as info:
        model(torch.randn(2, IN))
    model.reset_iter_state()  # type: ignore[operator]
    return str(info.value)


def test_inputs_that_cannot_be_padded_raise_on_every_rank() -> None:
    # 7 rows over 2 ranks (4 + 3): a flat input is neither 4 nor 3 rows long on either rank
    for got in run_distributed(_flat_inputs_on_an_uneven_split, 2):
        assert "all-gather input 0 of Int8BlockWeight.fsdp_pre_all_gather has shape" in got
        assert "splits unevenly over 2 ranks" in got
