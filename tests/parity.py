"""The parity template: a sharded model must train exactly like an unsharded replica.

`check_parity` runs inside every rank of a distributed job (default process group initialised,
world size W, a 1-D `DeviceMesh` over the W ranks passed in, or a 2-D HSDP one). Each step:

    global batch (W * grad_accum * local_batch rows, identical on every rank, seeded)
      rank r takes rows [r * k * b, (r + 1) * k * b)        (k = grad_accum, b = local_batch)
      sharded model: k micro-batches of b rows, loss = mean over the micro-batch / k
      reference:     the whole global batch at once, loss = mean over the global batch

Because every micro-batch has the same number of rows, the reference gradient equals the
average over ranks of the per-rank gradients, which is what fully sharded data parallelism
computes (reduce-scatter with SUM, then divide by W). So, step by step:

- the all-reduced mean of the sharded losses equals the reference loss;
- every parameter's gradient, `.full_tensor()`, equals the reference gradient (before the
  optimizer step; frozen parameters keep `grad is None` on both sides);
- after the last step, every parameter's `.full_tensor()` equals the reference parameter.

Every comparison is made with identical tensors on every rank (`full_tensor()` all-gathers,
the loss is all-reduced), so a mismatch raises the same `AssertionError` on every rank and no
rank is left waiting in a collective.

Parameters the shard function leaves as plain tensors (e.g. `ignored_params`) are compared
directly. Their gradients are not reduced by the engine, so the template all-reduces (averages)
them itself before comparing, as a user would with DDP or by hand.

The implementation under test is whatever `shard` calls; `wrap_layers_then_root(shard_fn)`
builds the usual bottom-up wrapping for any `fully_shard`-compatible callable, so the same test
runs against ours and torch's `torch.distributed.fsdp.fully_shard`.

Beside the template, the pieces of the tests it does not fit, each written once:
`assert_stats_within` (what a test asks of its `ParityStats`), `step_beside_reference` (one
step of a sharded model and its reference, for loops that change the model between steps),
`train_on_rank_rows` (the checkpoint tests' training), and, side by side with torch's
`fully_shard`, `assert_trains_like_torch` (ours vs torch's) and `train_beside_torch` (ours,
torch's and the unsharded model).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, TypedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

# For a test that runs torch's own fully_shard as the reference: on CPU it needs
# Stream.record_event, which torch 2.6 lacks.
needs_torch_fsdp2_on_cpu = pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason=f"torch {torch.__version__}'s own FSDP2 cannot run on CPU (no Stream.record_event)",
)

__all__ = [
    "Batch",
    "MakeBatch",
    "ParityStats",
    "ShardFn",
    "assert_close_or_both_none",
    "assert_same",
    "assert_stats_within",
    "assert_trains_like_torch",
    "check_parity",
    "fsdp_gradient_sync",
    "full_or_none",
    "full_values",
    "global_and_rank_rows",
    "loss_fn",
    "make_float_batch",
    "make_token_batch",
    "snapshot",
    "step_beside_reference",
    "train_beside_torch",
    "train_on_rank_rows",
    "wrap_layers_then_root",
]

Batch = tuple[Tensor, Tensor]
"""(inputs, targets), both with the batch in dim 0."""

MakeBatch = Callable[[int, torch.Generator], Batch]
"""`make_batch(n_rows, generator) -> (inputs, targets)`, deterministic given the generator."""

ShardFn = Callable[..., Any]
"""A `fully_shard`-compatible callable: `shard_fn(module_or_list, *, mesh=..., **options)`."""

OptimizerName = Literal["adamw", "adam", "sgd"]

OptimizerFactory = Callable[[list[nn.Parameter], float], torch.optim.Optimizer]
"""`factory(trainable_params, lr) -> optimizer`, for an optimizer `OptimizerName` does not name."""


class ParityStats(TypedDict):
    """What `check_parity` observed; every difference is a max absolute difference."""

    max_loss_diff: float
    max_grad_diff: float
    max_param_diff: float
    ref_losses: list[float]  # the reference loss of each step
    zero_grad_params: list[str]  # trainable params whose reference grad was 0 at every step


# ---------------------------------------------------------------------------------------------
# Data and loss
# ---------------------------------------------------------------------------------------------


def make_token_batch(
    n: int, gen: torch.Generator, *, vocab_size: int = 32, seq_len: int = 8
) -> Batch:
    """Random next-token data: tokens (n, seq_len) int64 and targets (n, seq_len) int64.

    Targets are the tokens shifted by one (drawn as one (n, seq_len + 1) sequence). Bind the
    keywords with `functools.partial` to get a `MakeBatch`.
    """
    seq = torch.randint(0, vocab_size, (n, seq_len + 1), generator=gen)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def make_float_batch(n: int, gen: torch.Generator, *, in_dim: int, out_dim: int) -> Batch:
    """Gaussian regression data: inputs (n, in_dim) fp32 and targets (n, out_dim) fp32."""
    x = torch.randn(n, in_dim, generator=gen)
    y = torch.randn(n, out_dim, generator=gen)
    return x, y


def global_and_rank_rows(in_dim: int, rows: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """(global batch, this rank's rows of it), inside a rank of the default group.

    The global batch is `W * rows` Gaussian rows of width `in_dim`, drawn from `seed`, so every
    rank holds the same one; rank r's rows are `[r * rows, (r + 1) * rows)`, which makes an
    unsharded replica's gradient on the global batch the mean over ranks of theirs.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(world * rows, in_dim, generator=torch.Generator().manual_seed(seed))
    return x, x[rank * rows : (rank + 1) * rows]


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    """Mean loss over every element of the batch: a scalar fp32 tensor.

    Integer targets (n, ...) with logits (n, ..., C) give cross-entropy averaged over all
    positions; float targets give the mean squared error. Either way each row of an
    equal-sized micro-batch weighs the same, which `check_parity` relies on.
    """
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output.float().flatten(0, -2), target.flatten())
    return F.mse_loss(output.float(), target.float())


# ---------------------------------------------------------------------------------------------
# Wrapping helpers
# ---------------------------------------------------------------------------------------------


def wrap_layers_then_root(
    shard_fn: ShardFn, **options: Any
) -> Callable[[nn.Module, DeviceMesh], None]:
    """A `shard` for `check_parity`: `shard_fn` each block of `model.layers`, then the root.

    `options` (e.g. `reshard_after_forward=False`, `mp_policy=...`) go to every call.
    `shard_fn` is the implementation under test: ours or torch's `fully_shard`.
    """

    def shard(model: nn.Module, mesh: DeviceMesh) -> None:
        layers = model.get_submodule("layers")
        for block in layers.children():
            shard_fn(block, mesh=mesh, **options)
        shard_fn(model, mesh=mesh, **options)

    return shard


def fsdp_gradient_sync(model: nn.Module, sync: bool) -> None:
    """A `set_gradient_sync` hook for `check_parity`: `model.set_requires_gradient_sync(sync)`."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]  # FSDPModule method


# ---------------------------------------------------------------------------------------------
# The template
# ---------------------------------------------------------------------------------------------


def _full(t: Tensor) -> Tensor:
    """The global value of a (possibly sharded) tensor; all-gathers if it is a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_or_none(t: Tensor | None) -> Tensor | None:
    """:func:`_full` of a gradient that may be ``None``."""
    return None if t is None else _full(t)


# torch 2.13 renamed the flat-tensor all-gather and deprecated the old name (2.6 has only it).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rows_per_rank(rows: int, world: int) -> list[int]:
    """Each rank's rows of a ``Shard(0)`` tensor of ``rows`` rows: DTensor's ``torch.chunk``
    split (the last ranks may hold fewer, or none)."""
    chunks = [c.size(0) for c in torch.empty(rows, 0).chunk(world)]
    return chunks + [0] * (world - len(chunks))


def _row_sharded(t: Tensor | None) -> bool:
    return (
        isinstance(t, DTensor)
        and t.device_mesh.ndim == 1
        and type(t.placements[0]) is Shard  # not a subclass (_StridedShard)
        and t.placements[0].dim == 0
        and t.ndim > 0
    )


def full_values(tensors: Sequence[Tensor | None]) -> list[Tensor | None]:
    """:func:`full_or_none` of each tensor, the ``Shard(0)`` DTensors of a 1-D mesh gathered
    by one all-gather per (mesh, dtype) rather than one ``full_tensor()`` each.

    The same values as ``full_tensor()`` (each rank's rows, put back in rank order): only the
    number of collectives differs. A template step compares every gradient, and on gloo each
    collective costs a millisecond or more of CPU (about 5 ms at W = 4 on 2 cores), so the
    checks cost as many collectives as the training they check. Every rank must pass tensors
    of the same kinds in the same order (as for ``full_tensor()``, a collective each).
    """
    out: list[Tensor | None] = list(tensors)
    batches: dict[tuple[Any, ...], list[int]] = {}
    for i, t in enumerate(tensors):
        if _row_sharded(t):
            assert isinstance(t, DTensor)
            batches.setdefault((id(t.device_mesh), t.dtype), []).append(i)
        elif isinstance(t, DTensor):
            out[i] = t.full_tensor()
    for indices in batches.values():
        first = tensors[indices[0]]
        assert isinstance(first, DTensor)
        group, world = first.device_mesh.get_group(), first.device_mesh.size()
        members = [t for t in (tensors[i] for i in indices) if isinstance(t, DTensor)]
        shapes = [tuple(t.shape) for t in members]
        rows = [_rows_per_rank(s[0], world) for s in shapes]
        widths = [math.prod(s[1:]) for s in shapes]
        totals = [sum(r[k] * w for r, w in zip(rows, widths, strict=True)) for k in range(world)]
        longest = max(totals)
        with torch.no_grad():
            mine = torch.zeros(longest, dtype=first.dtype, device=first.to_local().device)
            flat = torch.cat([t.to_local().reshape(-1) for t in members])
            mine[: flat.numel()] = flat
            gathered = torch.empty(world * longest, dtype=mine.dtype, device=mine.device)
            _all_gather(gathered, mine, group=group)
            starts = [k * longest for k in range(world)]
            for j, i in enumerate(indices):
                parts = []
                for k in range(world):
                    n = rows[j][k] * widths[j]
                    block = gathered[starts[k] : starts[k] + n]
                    parts.append(block.view(rows[j][k], *shapes[j][1:]))
                    starts[k] += n
                out[i] = torch.cat(parts)
    return out


def assert_close_or_both_none(
    what: str, got: Tensor | None, want: Tensor | None, atol: float, rtol: float | None = None
) -> None:
    """Both ``None`` (no gradient on either side), or close in fp32 (``rtol`` default: atol)."""
    if (got is None) != (want is None):
        raise AssertionError(f"{what}: one side is None: {got is None} vs {want is None}")
    if got is not None and want is not None:
        tol = atol if rtol is None else rtol
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=tol, msg=what)


def _max_diff(a: Tensor, b: Tensor) -> float:
    return 0.0 if a.numel() == 0 else (a.detach().double() - b.detach().double()).abs().max().item()


def param_diffs(model: nn.Module, reference: nn.Module) -> list[float]:
    """The largest difference of each parameter's global value from the reference's, in
    order (either side may be sharded)."""
    ours, theirs = list(model.parameters()), list(reference.parameters())
    if len(ours) != len(theirs):
        raise AssertionError(f"{len(ours)} parameters against the reference's {len(theirs)}")
    fulls = full_values([p.detach() for p in ours + theirs])
    return [
        _max_diff(p, q)
        for p, q in zip(fulls[: len(ours)], fulls[len(ours) :], strict=True)
        if p is not None and q is not None
    ]


def _compare(
    what: str, got: Tensor, want: Tensor, *, atol: float, rtol: float, where: str
) -> float:
    """Assert `got` is close to `want` like `torch.allclose`; return the max abs difference."""
    if got.shape != want.shape:
        raise AssertionError(
            f"{where}: {what} has shape {tuple(got.shape)}, reference has {tuple(want.shape)}"
        )
    got64, want64 = got.detach().double(), want.detach().double()
    diff = _max_diff(got64, want64)
    if not torch.allclose(got64, want64, atol=atol, rtol=rtol) or not math.isfinite(diff):
        raise AssertionError(
            f"{where}: {what} differs from the reference: max |sharded - ref| = {diff:.3e} "
            f"(atol={atol:g}, rtol={rtol:g}, shape {tuple(want.shape)}, "
            f"max |ref| = {want64.abs().max().item() if want.numel() else 0.0:.3e})"
        )
    return diff


def _make_optimizer(
    name: OptimizerName | OptimizerFactory, params: Iterable[nn.Parameter], lr: float
) -> torch.optim.Optimizer:
    trainable = [p for p in params if p.requires_grad]
    if callable(name):
        return name(trainable, lr)
    if name == "adamw":
        return torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(trainable, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(trainable, lr=lr, momentum=0.9)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw', 'adam' or 'sgd'")


def _named_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())  # shared (tied) parameters appear once


def _copy_reference_from(reference: nn.Module, sharded: nn.Module) -> None:
    """Overwrite the reference's parameters and buffers with the sharded model's global values."""
    buffers = dict(sharded.named_buffers())
    params = _named_params(sharded)
    ref_params = _named_params(reference)
    for name in ref_params:
        if name not in params:
            raise AssertionError(f"sharding removed parameter {name!r}")
    fulls = full_values([params[name].detach() for name in ref_params])
    with torch.no_grad():
        for ref_p, full in zip(ref_params.values(), fulls, strict=True):
            ref_p.copy_(full)  # type: ignore[arg-type]  # a parameter is never None
        for name, ref_b in reference.named_buffers():
            ref_b.copy_(_full(buffers[name]))


def _data_parallel_coordinates(mesh: DeviceMesh) -> tuple[int, int, dist.ProcessGroup | None, int]:
    """(number of data-parallel ranks, this rank's index among them, the group to sum losses
    over, how many ranks that sum covers).

    A 2-D (replicate, shard) mesh that does not span the default group is the data-parallel
    part of a larger mesh (HSDP + TP): the ranks outside it (this rank's TP peers) see the same
    batch and compute the same loss, so the sum runs over every rank and is divided by all.
    """
    if mesh.ndim == 1:
        return mesh.size(), mesh.get_local_rank(), mesh.get_group(), mesh.size()
    flat = mesh.mesh.flatten().tolist()  # ranks in data order
    world = dist.get_world_size()
    if world % mesh.size() != 0:
        raise ValueError(
            f"a {mesh.ndim}-D mesh of {mesh.size()} ranks must tile the default group of "
            f"{world} ranks"
        )
    return len(flat), flat.index(dist.get_rank()), None, world


def check_parity(
    build_model: Callable[[], nn.Module],
    shard: Callable[[nn.Module, DeviceMesh], None],
    make_batch: MakeBatch,
    mesh: DeviceMesh,
    *,
    loss: Callable[[Tensor, Tensor], Tensor] = loss_fn,
    steps: int = 5,
    local_batch: int = 2,
    lr: float = 1e-3,
    optimizer: OptimizerName | tuple[OptimizerFactory, OptimizerFactory] = "adamw",
    atol: float = 1e-6,
    rtol: float = 1e-5,
    grad_accum: int = 1,
    set_gradient_sync: Callable[[nn.Module, bool], None] | None = None,
    reference_from_sharded: bool = False,
    seed: int = 0,
    max_norm: float | None = None,
    loss_shares: bool = False,
    tolerance_of: Callable[[str, Literal["grad", "param"]], tuple[float, float] | None]
    | None = None,
) -> ParityStats:
    """Train a sharded model and an unsharded replica side by side and compare every step.

    Call on every rank of the default process group (W = `mesh.size()` ranks).

    Args:
        build_model: builds the model; called once per rank right after `torch.manual_seed(seed)`
            so every rank builds the same values. Freeze parameters here (requires_grad=False).
        shard: applies the sharding in place, e.g. `wrap_layers_then_root(fully_shard)`; it
            chooses the wrapping and may leave parameters unsharded (ignored params).
        make_batch: `make_batch(n_rows, generator) -> (inputs, targets)`; called once per step
            with `n_rows = W * grad_accum * local_batch` and a generator seeded the same on
            every rank, so all ranks see the same global batch and each takes its own slice.
        mesh: the data-parallel mesh passed to `shard`. 1-D: its W ranks split the batch. A
            2-D (replicate, shard) HSDP mesh: its ranks split the batch, in the order of
            `mesh.mesh.flatten()`; if it spans only part of the default group (HSDP + TP on a
            3-D mesh), the other ranks of the job are TP peers seeing the same rows.
        loss: `loss(model(inputs), targets)`, a mean over the rows (see `loss_fn`).
        steps: optimizer steps.
        local_batch: rows per micro-batch per rank.
        lr, optimizer: the same optimizer ("adamw", "adam" or "sgd" with momentum) drives both,
            or a pair of `OptimizerFactory` (the sharded model's, the reference's), e.g. an
            optimizer for sharded parameters beside the torch one it must match.
            Adam turns a gradient entry that is pure rounding noise into a full +-lr update,
            so the final parameter difference grows with lr: 1e-2 gave 1e-5 where 1e-3 gives
            1e-6 on the Transformer; raise atol with lr.
        atol, rtol: `torch.allclose` tolerances for losses, gradients and parameters. Against
            torch's fully_shard (fp32, W = 2..4, both test models) no element needed more than
            atol = 7e-8 beyond rtol = 1e-5, so the defaults leave a margin of ~15x while still
            catching a 1% error in a gradient of size 1e-3 (the tiny models' typical size).
        grad_accum: micro-batches per step (k). The sharded model runs k forward/backward passes
            on its k micro-batches, each loss divided by k, then one optimizer step.
        set_gradient_sync: called as `set_gradient_sync(model, sync)` before every micro-batch,
            `sync` True only on the last, e.g. `fsdp_gradient_sync` to test skipped reduction.
        reference_from_sharded: after `shard`, copy the sharded model's global parameter and
            buffer values into the reference instead of relying on identical construction (for
            meta-device init, where `shard` also runs `to_empty()` + `reset_parameters()`).
        seed: seeds the model build and the data.
        max_norm: if given, `clip_grad_norm_(params, max_norm)` on both models before each
            optimizer step (after the gradients are compared).
        loss_shares: each rank's loss is its share of the global one, e.g. torchtitan's sum
            over the rank's tokens divided by the global batch's token count (with `loss`
            dividing by the same count for both models, the reference's loss is the global
            mean): the sharded losses then sum over the data-parallel ranks instead of
            averaging, and so must the gradients (torchtitan sets the engine's
            `gradient_divide_factor` to 1).
        tolerance_of: `tolerance_of(name, "grad" | "param")`, where it returns one, is the
            `(atol, rtol)` of that parameter's gradients or of its value after the last step,
            for a parameter the model computes in lower precision than the rest (torchtitan's
            routed experts run their matmuls in bf16). Those comparisons still raise beyond
            it but stay out of the returned maxima, which keep to `atol` / `rtol`.

    Returns:
        `ParityStats`: the max differences seen, the reference losses and the names of
        trainable parameters whose gradient was zero at every step (a vacuous comparison).

    Raises:
        AssertionError: naming the step, the parameter and the max abs difference.
    """
    if steps < 1 or local_batch < 1 or grad_accum < 1:
        raise ValueError(
            f"steps={steps}, local_batch={local_batch}, grad_accum={grad_accum} "
            "must all be positive"
        )
    world, rank, group, summed_over = _data_parallel_coordinates(mesh)
    # loss shares sum over the data-parallel ranks (each counted once: TP peers repeat them)
    shares = world if loss_shares else 1

    torch.manual_seed(seed)
    model = build_model()
    reference = copy.deepcopy(model)
    shard(model, mesh)
    if reference_from_sharded:
        reference.to_empty(device=torch.device("cpu"))
        tie = getattr(reference, "tie_weights", None)
        if callable(tie):
            tie()  # to_empty() broke parameter sharing in the reference
        _copy_reference_from(reference, model)

    params, ref_params = _named_params(model), _named_params(reference)
    if params.keys() != ref_params.keys():
        raise AssertionError(
            "sharding changed the parameter names: only sharded "
            f"{sorted(params.keys() - ref_params.keys())}, only reference "
            f"{sorted(ref_params.keys() - params.keys())}"
        )
    initial = full_values([p.detach() for p in params.values()])
    for (name, p), full in zip(params.items(), initial, strict=True):
        assert full is not None
        _compare(
            f"initial parameter {name!r}",
            full,
            ref_params[name],
            atol=0.0,
            rtol=0.0,
            where="before training",
        )
        if p.requires_grad != ref_params[name].requires_grad:
            raise AssertionError(
                f"parameter {name!r}: requires_grad={p.requires_grad} after "
                f"sharding, {ref_params[name].requires_grad} before"
            )

    mine, theirs = optimizer if isinstance(optimizer, tuple) else (optimizer, optimizer)
    opt = _make_optimizer(mine, params.values(), lr)
    ref_opt = _make_optimizer(theirs, ref_params.values(), lr)
    data_gen = torch.Generator().manual_seed(seed + 1)
    rows = local_batch * grad_accum  # rows of one rank per step

    stats = ParityStats(
        max_loss_diff=0.0, max_grad_diff=0.0, max_param_diff=0.0, ref_losses=[], zero_grad_params=[]
    )
    ever_nonzero: set[str] = set()
    for step in range(steps):
        where = f"rank {rank}, step {step}"
        inputs, targets = make_batch(world * rows, data_gen)  # (W * k * b, ...)

        # Reference: the whole global batch at once.
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = loss(reference(inputs), targets)
        torch.autograd.backward(ref_loss)

        # Sharded: this rank's k micro-batches.
        opt.zero_grad(set_to_none=True)
        local_loss = torch.zeros((), dtype=torch.float64)
        for micro in range(grad_accum):
            if set_gradient_sync is not None:
                set_gradient_sync(model, micro == grad_accum - 1)
            lo = rank * rows + micro * local_batch
            micro_loss = loss(model(inputs[lo : lo + local_batch]), targets[lo : lo + local_batch])
            torch.autograd.backward(micro_loss / grad_accum)
            local_loss += micro_loss.detach().double() / grad_accum
        dist.all_reduce(local_loss, group=group)  # sum over ranks
        mean_loss = local_loss * shares / summed_over

        stats["ref_losses"].append(ref_loss.item())
        stats["max_loss_diff"] = max(
            stats["max_loss_diff"],
            _compare(
                "loss (mean over ranks)",
                mean_loss,
                ref_loss.detach().double(),
                atol=atol,
                rtol=rtol,
                where=where,
            ),
        )

        compared: list[tuple[str, Tensor]] = []  # (name, this rank's grad), gathered at once
        for name, p in params.items():
            ref_p = ref_params[name]
            if not p.requires_grad:
                if p.grad is not None or ref_p.grad is not None:
                    raise AssertionError(
                        f"{where}: frozen parameter {name!r} got a gradient "
                        f"(sharded: {p.grad is not None}, reference: "
                        f"{ref_p.grad is not None})"
                    )
                continue
            if (p.grad is None) != (ref_p.grad is None):
                raise AssertionError(
                    f"{where}: grad of {name!r} is "
                    f"{'None' if p.grad is None else 'set'} but the reference's "
                    f"is {'None' if ref_p.grad is None else 'set'}"
                )
            if p.grad is None or ref_p.grad is None:
                continue
            if isinstance(p, DTensor) != isinstance(p.grad, DTensor):
                raise AssertionError(
                    f"{where}: parameter {name!r} is a "
                    f"{type(p.data).__name__} but its grad is a "
                    f"{type(p.grad).__name__}"
                )
            if not isinstance(p, DTensor):
                # Unsharded (ignored) parameter: the engine leaves its gradient local.
                dist.all_reduce(p.grad, group=group)
                p.grad.mul_(shares).div_(summed_over)
            compared.append((name, p.grad))
        fulls = full_values([g for _, g in compared])
        for (name, _), grad in zip(compared, fulls, strict=True):
            assert grad is not None
            ref_p = ref_params[name]
            assert ref_p.grad is not None
            own = None if tolerance_of is None else tolerance_of(name, "grad")
            a, r = (atol, rtol) if own is None else own
            diff = _compare(f"grad of {name!r}", grad, ref_p.grad, atol=a, rtol=r, where=where)
            if own is None:
                stats["max_grad_diff"] = max(stats["max_grad_diff"], diff)
            if bool((ref_p.grad != 0).any()):
                ever_nonzero.add(name)

        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
            torch.nn.utils.clip_grad_norm_(list(ref_params.values()), max_norm)
        opt.step()
        ref_opt.step()

    finals = full_values([p.detach() for p in params.values()])
    for name, full in zip(params, finals, strict=True):
        assert full is not None
        own = None if tolerance_of is None else tolerance_of(name, "param")
        a, r = (atol, rtol) if own is None else own
        diff = _compare(
            f"parameter {name!r}",
            full,
            ref_params[name],
            atol=a,
            rtol=r,
            where=f"rank {rank}, after {steps} steps",
        )
        if own is None:
            stats["max_param_diff"] = max(stats["max_param_diff"], diff)
    stats["zero_grad_params"] = sorted(
        n for n, p in params.items() if p.requires_grad and n not in ever_nonzero
    )
    return stats


def assert_stats_within(stats: Mapping[str, Any], tol: float, *, grads: bool = True) -> None:
    """A `check_parity` run (its `ParityStats`) stayed within `tol` and compared something.

    The max loss and parameter differences (and, with `grads`, the max gradient difference)
    are at most `tol`, and no trainable parameter had a zero gradient at every step.
    """
    keys = ("max_loss_diff", "max_grad_diff") if grads else ("max_loss_diff",)
    for key in (*keys, "max_param_diff"):
        if not stats[key] <= tol:
            raise AssertionError(f"{key} = {stats[key]:.3e} > {tol:g}")
    if stats["zero_grad_params"]:
        raise AssertionError(f"gradients zero at every step: {stats['zero_grad_params']}")


# ---------------------------------------------------------------------------------------------
# Loops the template does not cover
# ---------------------------------------------------------------------------------------------


def step_beside_reference(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    reference: nn.Module,
    ref_opt: torch.optim.Optimizer,
    batch: Batch,
    local_rows: int,
) -> tuple[Tensor, Tensor]:
    """One optimizer step of a sharded model and of its unsharded reference, MSE loss.

    For a loop that `check_parity` cannot run (the dtype changes mid-training, frozen
    parameters the optimizer must not see). Inside a rank of the default group: the sharded
    model trains on this rank's `local_rows` rows of the global `batch` (rank r's are
    `[r * local_rows, (r + 1) * local_rows)`), the reference on the whole batch. Returns
    (the sharded loss averaged over the ranks, the reference loss), to compare by the caller.
    """
    x, y = batch
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = slice(rank * local_rows, (rank + 1) * local_rows)
    loss = F.mse_loss(model(x[mine]), y[mine])
    loss.backward()
    opt.step()
    opt.zero_grad()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return summed / world, ref_loss.detach()


def train_on_rank_rows(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    batches: Sequence[Batch],
    dp_rank: int,
    dp_size: int,
    *,
    ranks: int,
    group: dist.ProcessGroup | None = None,
) -> list[float]:
    """One step per global batch of `batches`; return each step's global mean loss.

    Each step trains on this rank's share of the batch (slice `dp_rank` of `dp_size` equal
    slices of its rows, `loss_fn`). The reported loss is the loss summed over `group` (None:
    the default group) divided by `ranks`, that group's size; with one rank nothing is summed.
    For a checkpoint test: the run that saves and the runs that load and continue report
    losses that must agree whatever their layouts.
    """
    losses = []
    for x, y in batches:
        rows = x.size(0) // dp_size
        loss = loss_fn(model(x[dp_rank * rows :][:rows]), y[dp_rank * rows :][:rows])
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().double()
        if ranks > 1:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / ranks)
    return losses


# ---------------------------------------------------------------------------------------------
# Side by side with torch's fully_shard
# ---------------------------------------------------------------------------------------------


def assert_trains_like_torch(
    ours: nn.Module,
    theirs: nn.Module,
    make_batch: MakeBatch,
    dp_world: int,
    dp_rank: int,
    *,
    steps: int = 4,
) -> None:
    """Train one model sharded by ours and by torch's `fully_shard`; assert they stay equal.

    Both start from the same values (the caller checks the layouts). Each step, on
    `make_batch(2 * dp_world, generator seeded 1)`, both train with AdamW (lr 1e-2) on the
    2 rows of data-parallel rank `dp_rank`, MSE loss; then this rank's losses must agree and
    every parameter's `full_tensor()` too (rtol 1e-5, atol 1e-6). Every parameter must be a
    DTensor.
    """
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    theirs_params = dict(theirs.named_parameters())
    gen = torch.Generator().manual_seed(1)
    mine = slice(2 * dp_rank, 2 * dp_rank + 2)
    for step in range(steps):
        x, y = make_batch(2 * dp_world, gen)
        losses = []
        for model, opt in zip((ours, theirs), opts, strict=True):
            loss = F.mse_loss(model(x[mine]), y[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6, msg=f"step {step}")
        names = [name for name, _ in ours.named_parameters()]
        fulls = full_values(
            [p.detach() for _, p in ours.named_parameters()]
            + [theirs_params[name].detach() for name in names]
        )
        for name, got, want in zip(names, fulls[: len(names)], fulls[len(names) :], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")


def train_beside_torch(
    models: Mapping[str, nn.Module],
    batch: Callable[[int], Batch],
    loss: Callable[[nn.Module, Tensor, Tensor], Tensor],
    rows: int,
    *,
    pairs: Sequence[tuple[str, str]],
    atol: float,
    rtol: float | None = None,
    steps: int = 3,
    between: Callable[[int, nn.Module], None] | None = None,
) -> int:
    """Train ours, torch's and the unsharded model with AdamW; compare them at every step.

    Inside a rank of the default group (W ranks). `models`: `"ours"` and `"torch"`, one model
    sharded by each `fully_shard`, and `"ref"`, the same model unsharded, trained in that
    order. Step s: `between(s, model)` on each model if given, then the global batch
    `batch(s)` (the same on every rank): the sharded models take this rank's `rows` rows of it
    (rank r's are `[r * rows, (r + 1) * rows)`), the reference all of it, each
    `loss(model, inputs, targets)` (a mean). For each `(want, got)` of `pairs`, e.g.
    `("torch", "ours")`: the losses (the sharded ones averaged over the ranks) and every
    gradient (`full_tensor()`, or None on both) agree (`assert_close_or_both_none` with `atol`
    and `rtol`); after the last step, every parameter too.

    Returns:
        How many gradient comparisons were made (0 would mean nothing was checked).
    """
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = slice(rank * rows, (rank + 1) * rows)
    compared = 0
    for step in range(steps):
        if between is not None:
            for m in models.values():
                between(step, m)
        x, target = batch(step)
        losses = {}
        for name, m in models.items():
            xs, ts = (x, target) if name == "ref" else (x[mine], target[mine])
            step_loss = loss(m, xs, ts)
            step_loss.backward()
            reported = step_loss.detach().clone()
            if name != "ref":
                dist.all_reduce(reported)
                reported /= world
            losses[name] = reported
        named = {k: dict(m.named_parameters()) for k, m in models.items()}
        for want, got in pairs:
            what = f"step {step} loss {got} vs {want}"
            assert_close_or_both_none(what, losses[got], losses[want], atol, rtol)
            names = list(named[got])
            fulls = full_values(
                [named[got][n].grad for n in names] + [named[want][n].grad for n in names]
            )
            for n, g, w in zip(names, fulls[: len(names)], fulls[len(names) :], strict=True):
                assert_close_or_both_none(
                    f"step {step} grad {n}: {got} vs {want}", g, w, atol, rtol
                )
                compared += 1
        for opt in optims.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    named = {k: dict(m.named_parameters()) for k, m in models.items()}
    for want, got in pairs:
        names = list(named[got])
        fulls = full_values(
            [named[got][n].detach() for n in names] + [named[want][n].detach() for n in names]
        )
        for n, p, w in zip(names, fulls[: len(names)], fulls[len(names) :], strict=True):
            assert_close_or_both_none(f"param {n} vs {want}", p, w, atol, rtol)
    return compared


# ---------------------------------------------------------------------------------------------
# A model left untouched by a refused call
# ---------------------------------------------------------------------------------------------


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything about ``model`` a failed ``fully_shard`` call must not have touched."""
    mods = list(model.modules())
    return {
        "classes": [type(m) for m in mods],
        "params": [
            (n, id(p), type(p), p.detach().clone())
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        "hooks": [
            (
                list(m._forward_pre_hooks),
                list(m._forward_hooks),
                list(m._backward_hooks),
                list(m._backward_pre_hooks),
            )
            for m in mods
        ],
        "attrs": [sorted(m.__dict__) for m in mods],
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    """``after`` (a later `snapshot`) shows the model exactly as ``before`` did."""
    assert before["classes"] == after["classes"]
    assert before["hooks"] == after["hooks"]
    assert before["attrs"] == after["attrs"]
    assert len(before["params"]) == len(after["params"])
    for (n0, i0, t0, v0), (n1, i1, t1, v1) in zip(before["params"], after["params"], strict=True):
        assert (n0, i0, t0) == (n1, i1, t1), f"parameter {n0} was replaced"
        assert v0.shape == v1.shape, f"parameter {n0} changed shape"
        if v0.device.type != "meta":  # meta tensors have no values to compare
            assert torch.equal(v0, v1), f"parameter {n0} changed value"
