"""Runtime behaviours torch FSDP2 users rely on, run side by side with torch's ``fully_shard``.

Each scenario builds one model, deep-copies it three times and trains

- ``ours``: sharded by ``fully_shard.fully_shard``,
- ``torch``: sharded by ``torch.distributed.fsdp.fully_shard`` (the drop-in reference),
- ``ref``: unsharded, on the whole global batch,

for a few AdamW steps on W gloo ranks. Every rank takes its own rows of the same global batch,
so the reference's gradient is the average of the ranks' gradients. Each step compares the
loss, every gradient (``full_tensor()``, or ``None`` on all three) and, at the end, every
parameter: ours against the reference and ours against torch's, within 1e-5 (fp32).

Scenarios: LoRA-style blocks whose frozen base weight sits beside trainable adapters (every
frozen position, with activation checkpointing and with mixed precision), ``requires_grad_``
after wrapping (freeze and unfreeze), ``set_is_last_backward`` on a non-root module, the
profiler labels, and ``unshard(async_op=True)`` called from a forward under torch's
``replicate()`` (torch's ``test_unshard_async``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # the reference, tests only
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fully_shard import MixedPrecisionPolicy, fully_shard
from harness import mesh_1d, run_distributed
from parity import assert_close_or_both_none, needs_torch_fsdp2_on_cpu, train_beside_torch
from parity import full_or_none as _full

pytestmark = needs_torch_fsdp2_on_cpu

DIM, RANK_R, ROWS = 8, 2, 2  # width, adapter rank, rows per rank
ATOL, RTOL = 1e-5, 1e-5


class LoRABlock(nn.Module):
    """``base(x) + b(a(x))``: a (frozen) base projection beside a low-rank adapter."""

    def __init__(self, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, DIM)
        self.a = nn.Linear(DIM, RANK_R, bias=False)
        self.b = nn.Linear(RANK_R, DIM, bias=False)
        self.use_checkpoint = use_checkpoint

    def _run(self, x: Tensor) -> Tensor:
        return torch.tanh(self.base(x) + self.b(self.a(x)))

    def forward(self, x: Tensor) -> Tensor:
        if self.use_checkpoint:
            out: Tensor = checkpoint(self._run, x, use_reentrant=False)
            return out
        return self._run(x)


class LoRANet(nn.Module):
    """``stem`` (root group) then two LoRA blocks (one group each): the issue's minimal case."""

    def __init__(self, use_checkpoint: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(LoRABlock(use_checkpoint) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        return h


def _freeze(model: nn.Module, which: str) -> None:
    """Freeze the parameters named by ``which`` ("base", "a", "b", "stem", joined by '+')."""
    for name, p in model.named_parameters():
        parts = name.split(".")
        if any(w in parts for w in which.split("+")):
            p.requires_grad_(False)


def _wrap(model: nn.Module, shard: Callable[..., Any], **options: Any) -> None:
    for layer in model.get_submodule("layers").children():
        shard(layer, mesh=mesh_1d(), **options)
    shard(model, mesh=mesh_1d(), **options)


def _compare(what: str, got: Tensor | None, want: Tensor | None, atol: float) -> None:
    assert_close_or_both_none(what, got, want, atol, RTOL)


def _side_by_side(
    make: Callable[[], nn.Module],
    *,
    steps: int = 3,
    options: tuple[dict[str, Any], dict[str, Any]] = ({}, {}),
    between: Callable[[int, nn.Module], None] | None = None,
    compare_ref: bool = True,
    atol: float = ATOL,
) -> None:
    """Train ours, torch's and the reference; raise on the first difference (on every rank).

    ``options``: the keyword arguments for our ``fully_shard`` and torch's, in that order.
    ``between(step, model)`` runs on all three models before each step (e.g. to freeze).
    """
    torch.manual_seed(0)
    base = make()
    models = {"ours": copy.deepcopy(base), "torch": copy.deepcopy(base), "ref": base}
    _wrap(models["ours"], fully_shard, **options[0])
    _wrap(models["torch"], torch_fully_shard, **options[1])
    world = dist.get_world_size()

    def batch(step: int) -> tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(world * ROWS, DIM, generator=gen)
        return x, torch.randn(world * ROWS, DIM, generator=gen)

    def loss(m: nn.Module, x: Tensor, target: Tensor) -> Tensor:
        return ((m(x).float() - target) ** 2).mean()

    pairs = [("torch", "ours")] + ([("ref", "ours")] if compare_ref else [])
    train_beside_torch(
        models, batch, loss, ROWS, pairs=pairs, atol=atol, rtol=RTOL, steps=steps, between=between
    )


# -- LoRA: frozen weights beside trainable ones ----------------------------------------------


def _lora(frozen: str, use_checkpoint: bool, mixed: bool) -> None:
    def make() -> nn.Module:
        model = LoRANet(use_checkpoint)
        _freeze(model, frozen)
        return model

    if not mixed:
        _side_by_side(make)
        return
    ours = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)}
    theirs = {"mp_policy": TorchMixedPrecisionPolicy(torch.bfloat16, torch.float32)}
    # bf16 compute: the reference (fp32) differs by rounding; torch computes what we compute.
    _side_by_side(make, options=(ours, theirs), compare_ref=False, atol=1e-3)


@pytest.mark.parametrize("frozen", ["base", "a", "b", "a+b", "stem+base", "base+a+b"])
def test_frozen_weights_beside_trainable_ones_train_like_torch(frozen: str) -> None:
    """The issue's LoRA crash: a group freed at its last trainable gradient while autograd
    still needs the frozen weight for the input's gradient ('setStorage ... size 0')."""
    run_distributed(_lora, 2, frozen, False, False)


@pytest.mark.parametrize(
    ("world", "use_checkpoint", "mixed"), [(1, False, False), (2, True, False), (2, False, True)]
)
def test_lora_with_checkpointing_and_mixed_precision(
    world: int, use_checkpoint: bool, mixed: bool
) -> None:
    run_distributed(_lora, world, "base", use_checkpoint, mixed)


# -- requires_grad_ after fully_shard ----------------------------------------------------------


def _toggle_requires_grad(step: int, model: nn.Module) -> None:
    # step 0: layers.0.a frozen from the start; step 1: unfreeze it, freeze layers.1.base
    p_a = model.get_parameter("layers.0.a.weight")
    p_base = model.get_parameter("layers.1.base.weight")
    if step == 0:
        p_a.requires_grad_(False)
    if step == 1:
        p_a.requires_grad_(True)
        p_base.requires_grad_(False)


def _requires_grad_after_wrapping() -> None:
    _side_by_side(LoRANet, steps=3, between=_toggle_requires_grad)


@pytest.mark.parametrize("world", [1, 2])
def test_requires_grad_changed_after_wrapping_is_followed(world: int) -> None:
    """Unfreezing after fully_shard trains the weight; freezing leaves its grad None."""
    run_distributed(_requires_grad_after_wrapping, world)


# -- set_is_last_backward on a non-root module -------------------------------------------------


def _is_last_backward_on_a_block(impl: str) -> list[bool]:
    torch.manual_seed(0)
    model = LoRANet()
    _wrap(model, fully_shard if impl == "ours" else torch_fully_shard)
    x = torch.randn(ROWS, DIM)
    model(x).sum().backward()  # lazy init, one full step
    block: Any = model.layers[1]  # ours or torch's FSDPModule
    block.set_is_last_backward(False)  # torch: one flag for the whole tree
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()
    # With the flag off the end of backward does not finish the reductions; the next backward
    # with it on does, and then every gradient is there.
    block.set_is_last_backward(True)
    model(x).sum().backward()
    return [p.grad is not None for p in model.parameters()]


def test_set_is_last_backward_on_a_block_sets_the_flag_for_the_tree() -> None:
    ours = run_distributed(_is_last_backward_on_a_block, 2, "ours")
    theirs = run_distributed(_is_last_backward_on_a_block, 2, "torch")
    assert ours == theirs and all(all(r) for r in ours)


def _flag_is_shared(impl: str) -> tuple[bool, bool]:
    torch.manual_seed(0)
    model = LoRANet()
    _wrap(model, fully_shard if impl == "ours" else torch_fully_shard)
    model(torch.randn(ROWS, DIM)).sum().backward()
    model.layers[0].set_is_last_backward(False)  # type: ignore[operator]
    if impl == "ours":
        ctx = model._fsdp_state.root
        seen = ctx is not None and not ctx.is_last_backward
    else:
        seen = not model._get_fsdp_state()._state_ctx.is_last_backward  # type: ignore[operator]
    model.layers[0].set_is_last_backward(True)  # type: ignore[operator]
    return seen, True


def test_the_is_last_backward_flag_of_a_block_is_the_roots() -> None:
    assert run_distributed(_flag_is_shared, 1, "ours") == run_distributed(
        _flag_is_shared, 1, "torch"
    )


# -- profiler labels -------------------------------------------------------------------------

CORE_LABELS = {
    "pre_forward",
    "post_forward",
    "pre_backward",
    "post_backward",
    "all_gather",
    "all_gather_copy_out",
    "post_backward_reduce",
    "root_post_backward_callback",
}


def _profiled_labels(impl: str) -> set[str]:
    torch.manual_seed(0)
    model = LoRANet()
    _wrap(model, fully_shard if impl == "ours" else torch_fully_shard)
    x = torch.randn(ROWS, DIM)
    model(x).sum().backward()  # lazy init outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    return {e.name for e in prof.events() if e.name.startswith("FSDP::")}


def test_hooks_and_collectives_show_up_in_profiler_traces_like_torchs() -> None:
    ours = run_distributed(_profiled_labels, 2, "ours")[0]
    theirs = run_distributed(_profiled_labels, 2, "torch")[0]
    for kind in sorted(CORE_LABELS):
        # A block's labels read the same in both: "FSDP::<kind> (layers.0)".
        label = f"FSDP::{kind} (layers.0)"
        if label in theirs:
            assert label in ours, f"{label} in torch's trace, not in ours: {sorted(ours)}"
        assert any(name.startswith(f"FSDP::{kind}") for name in ours), kind


def test_profiler_labels_are_made_only_while_a_profiler_records() -> None:
    """No ``record_function`` while nothing records (it cost ~6 µs a label, about 14 a group
    a step); under a profiler the same labels as before, and a span that began before the
    profiler started ends without one."""
    from types import SimpleNamespace
    from unittest import mock

    from fully_shard import observer

    labels = observer.ProfilerLabels()
    group: Any = SimpleNamespace(label="layers.0")
    call = observer.CollectiveCall("all_gather", torch.zeros(1), None)  # type: ignore[arg-type]
    with mock.patch.object(observer, "record_function", wraps=observer.record_function) as made:
        labels.begin(group, "pre_forward")
        labels.collective(group, call, lambda: None)
        assert made.call_count == 0
        labels.begin(group, "unshard")  # open when the profiler starts: ends unlabelled
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            labels.end(group, "unshard")
            labels.begin(group, "post_forward")
            labels.collective(group, call, lambda: None)
            labels.end(group, "post_forward")
        assert made.call_count == 2
    names = {e.name for e in prof.events() if e.name.startswith("FSDP::")}
    assert names == {"FSDP::post_forward (layers.0)", "FSDP::all_gather (layers.0)"}


# -- unshard(async_op=True), then forward and backward with grad enabled -----------------------


def _unshard_everything_async(step: int, model: nn.Module) -> None:
    # Root and blocks, the handles dropped: each group's pre-forward waits for its gather.
    if not hasattr(model, "unshard"):
        return  # the unsharded reference
    handles = [m.unshard(async_op=True) for m in model.modules() if hasattr(m, "unshard")]
    if step == 1:
        for handle in handles:  # waited on explicitly once, before the forward
            handle.wait()


def _unshard_async_then_train() -> None:
    _side_by_side(LoRANet, steps=3, between=_unshard_everything_async)


@pytest.mark.parametrize("world", [1, 2])
def test_unshard_async_then_forward_and_backward_trains_like_torch(world: int) -> None:
    run_distributed(_unshard_async_then_train, world)


# -- unshard(async_op=True) from a forward, under torch's replicate() (torch's test_unshard_async) -


class _AllReduced(nn.Module):
    """``relu(x @ w)``, then an async all-reduce of it (not differentiable) to overlap with."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM))

    def forward(self, x: Tensor) -> tuple[Tensor, Any]:
        y = torch.relu(x @ self.weight)
        return y, dist.all_reduce(y, async_op=True)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRABlock() for _ in range(2))

    def forward(self, ys: list[Tensor], works: list[Any]) -> Tensor:
        out = []
        for layer, y, work in zip(self.layers, ys, works, strict=True):
            work.wait()
            out.append(layer(y))
        return out[0] + out[1]


class _PrefetchingNet(nn.Module):
    """Unshards each sharded block from its own forward, between two all-reduces."""

    def __init__(self) -> None:
        super().__init__()
        self.reduced = nn.ModuleList(_AllReduced() for _ in range(2))
        self.blocks = _Blocks()

    def forward(self, x: Tensor) -> Tensor:
        ys, works = [], []
        for reduced, block in zip(self.reduced, self.blocks.layers, strict=True):
            y, work = reduced(x)
            ys.append(y)
            works.append(work)
            if hasattr(block, "unshard"):  # sharded (ours or torch's): gather while we wait
                block.unshard(async_op=True)
        return self.blocks(ys, works)  # type: ignore[no-any-return]


def _unshard_async_from_forward(impl: str) -> list[Tensor]:
    """Torch's test_unshard_async scenario: blocks sharded with reshard_after_forward=False,
    their parent sharded, the whole model under torch's replicate(); the losses of 3 Adam
    steps and the full parameters after them."""
    from torch.distributed._composable import replicate

    torch.manual_seed(0)
    model = _PrefetchingNet()
    if impl != "ref":  # "ref": the unsharded model, replicated (DDP averages the gradients)
        shard = fully_shard if impl == "ours" else torch_fully_shard
        for block in model.blocks.layers:
            shard(block, mesh=mesh_1d(), reshard_after_forward=False)
        shard(model.blocks, mesh=mesh_1d())
    replicate(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(dist.get_rank() + 1))
    losses = []
    for _ in range(3):
        loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return [torch.stack(losses)] + [_full(p.detach()) for p in model.parameters()]


def _unshard_async_side_by_side() -> None:
    got = {impl: _unshard_async_from_forward(impl) for impl in ("ref", "torch", "ours")}
    for want in ("ref", "torch"):
        for i, (a, b) in enumerate(zip(got["ours"], got[want], strict=True)):
            _compare(f"ours vs {want}: {'losses' if i == 0 else f'param {i}'}", a, b, ATOL)


def test_unshard_async_from_a_forward_under_replicate_trains_like_torch() -> None:
    run_distributed(_unshard_async_side_by_side, 2)


# -- register_post_accumulate_grad_hook on a sharded parameter (optimizer in backward) ---------


def _optimizer_in_backward(
    impl: str, accumulate: bool, data_world: int
) -> tuple[list[Tensor], list[int]]:
    """Per-parameter AdamW stepped from each parameter's post-accumulate-grad hook.

    Returns the parameters after three steps and, per parameter, how many times its hook ran.
    With ``accumulate``, each step is two micro-batches, the first with gradient sync off.
    ``data_world``: the number of ranks the global batch is cut for (the reference runs alone).
    """
    torch.manual_seed(0)
    model = LoRANet()
    if impl != "ref":
        _wrap(model, fully_shard if impl == "ours" else torch_fully_shard)
    params = list(model.parameters())
    optims = {p: torch.optim.AdamW([p], lr=1e-2) for p in params}
    calls = {p: 0 for p in params}

    def step_in_backward(p: Tensor) -> None:
        assert p.grad is not None, "the hook ran before the sharded gradient was in place"
        calls[p] += 1
        optims[p].step()
        optims[p].zero_grad(set_to_none=True)

    for p in params:
        p.register_post_accumulate_grad_hook(step_in_backward)
    world, rank = data_world, dist.get_rank()
    micro = 2 if accumulate else 1
    for step in range(3):
        for k in range(micro):
            gen = torch.Generator().manual_seed(100 + 10 * step + k)
            x = torch.randn(world * ROWS, DIM, generator=gen)
            if impl == "ref":
                if accumulate and k == 0:
                    continue  # the reference sees the last micro-batch of each step only
                loss = ((model(x) - 1.0) ** 2).mean()
            else:
                if accumulate:
                    model.set_requires_gradient_sync(k == micro - 1)  # type: ignore[operator]
                mine = slice(rank * ROWS, (rank + 1) * ROWS)
                loss = ((model(x[mine]) - 1.0) ** 2).mean()
            loss.backward()
    out = [p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]
    return out, [calls[p] for p in params]


@pytest.mark.parametrize("accumulate", [False, True], ids=["sync", "no-sync-then-sync"])
def test_post_accumulate_grad_hook_runs_once_per_reduction_like_torch(accumulate: bool) -> None:
    """Optimizer-in-backward: the hook runs after the sharded gradient is in place, once per
    backward that reduces (not for a backward with gradient sync off), as in torch."""
    ours = run_distributed(_optimizer_in_backward, 2, "ours", accumulate, 2)
    theirs = run_distributed(_optimizer_in_backward, 2, "torch", accumulate, 2)
    ours_params, ours_calls = ours[0]
    theirs_params, theirs_calls = theirs[0]
    assert ours_calls == theirs_calls == [3] * len(ours_calls)
    for got, want in zip(ours_params, theirs_params, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    if not accumulate:
        # Unsharded, autograd runs the same hooks itself, on the whole batch.
        ref_params, ref_calls = run_distributed(_optimizer_in_backward, 1, "ref", False, 2)[0]
        assert ref_calls == ours_calls
        for got, want in zip(ours_params, ref_params, strict=True):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
