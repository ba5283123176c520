"""Reliability: exceptions in forward and backward, misuse sequences, and a rank that dies.

The rule for exceptions: after an exception on every rank, ``reset_iter_state()`` on the root
leaves nothing gathered and nothing armed, and the next iteration's gradients equal a clean
run's. A call that skips the reset gets an error that names ``reset_iter_state``, never silent
wrong gradients.

The rule for misuse: every sequence either computes what an unsharded replica computes, or
raises a ``FullyShardError`` that says which call came in which state.

Each case builds ``Net`` (a root that owns ``stem`` plus one group per block), an unsharded
deep copy, and a global batch split over ranks; the replica's gradient is the mean over ranks.
"""

from __future__ import annotations

import copy
import functools
import itertools
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.distributed.tensor import DTensor

from fully_shard import CountingComm, FullyShardStateError, fully_shard
from harness import mesh_1d, run_distributed
from models import MLPBlock
from parity import global_and_rank_rows, wrap_layers_then_root

DIMS = (6, 9, 5, 7, 4)
ROWS = 2  # rows per rank


class Net(nn.Module):
    """``grad_hook``, when set, is registered on the activation between block 0 and block 1."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_hook: Callable[[Tensor], Tensor | None] | None = None
        self.stem = nn.Linear(DIMS[0], DIMS[1])  # owned by the root group
        self.layers = nn.ModuleList(
            MLPBlock(a, b, activation="tanh") for a, b in itertools.pairwise(DIMS[1:])
        )

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.stem(x))  # (B, 6) -> (B, 9)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == 0 and self.grad_hook is not None:
                h.register_hook(self.grad_hook)
        return h  # (B, 4)


def _setup(**options: Any) -> tuple[Net, Net, CountingComm]:
    torch.manual_seed(0)
    model = Net()
    replica = copy.deepcopy(model)
    wrap_layers_then_root(fully_shard, **options)(model, mesh_1d())
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]  # an FSDPModule method
    return model, replica, comm


#: (global batch of W * ROWS rows, this rank's ROWS of it); `_batch(seed)` for another one.
_batch = functools.partial(global_and_rank_rows, DIMS[0], ROWS)


def _loss(out: Tensor) -> Tensor:
    return out.pow(2).mean()


def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_grads(model: nn.Module, replica: nn.Module, scale: float = 1.0) -> None:
    ref = dict(replica.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            raise AssertionError(f"rank {dist.get_rank()}: {name} has no gradient")
        torch.testing.assert_close(
            _full(p.grad), scale * ref[name].grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: n + m
        )


def _assert_params(model: nn.Module, replica: nn.Module) -> None:
    ref = dict(replica.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            _full(p.detach()), ref[name].detach(), atol=1e-6, rtol=1e-5, msg=lambda m, n=name: n + m
        )


def _hook_counts(model: nn.Module) -> list[int]:
    """Module hooks of every module and post-accumulate-grad hooks of every unsharded param."""
    counts = []
    for m in model.modules():
        counts += [len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)]
        state = m.__dict__.get("_fsdp_state")
        if state is not None:
            for sp in state.group.params:
                hooks = getattr(sp.unsharded_param, "_post_accumulate_grad_hooks", None)
                counts.append(0 if hooks is None else len(hooks))
    return counts


def _assert_idle(model: nn.Module) -> None:
    """Nothing gathered, nothing in flight, no phase or flag left armed, on every group."""
    rank = dist.get_rank()
    ctx = model._fsdp_state.root
    if ctx is not None and ctx.it != type(ctx.it)():
        raise AssertionError(f"rank {rank}: root context still armed: {ctx}")
    for m in model.modules():
        state = m.__dict__.get("_fsdp_state")
        if state is None:
            continue
        group = state.group
        if state.phase.name != "IDLE" or group.state.name != "SHARDED":
            raise AssertionError(f"rank {rank}: {state!r} is not idle and sharded")
        if group.has_pending_reduce() or state.it != type(state.it)():
            raise AssertionError(f"rank {rank}: {state!r} has per-iteration state left")
        for sp in group.params:
            mod, name = sp.slots[0]
            if mod._parameters[name] is not sp.sharded_param or sp.storage_allocated():
                raise AssertionError(f"rank {rank}: {sp!r} still gathered")
            if sp.unsharded_param is not None and sp.unsharded_param.grad is not None:
                raise AssertionError(f"rank {rank}: {sp.fqn} keeps an unsharded gradient")


def _clean_step_matches(model: Net, replica: Net) -> None:
    """After recovery: one clean iteration gives the replica's gradients and parameters."""
    model.zero_grad()
    replica.zero_grad()
    gx, x = _batch(seed=7)
    _loss(model(x)).backward()
    _loss(replica(gx)).backward()
    _assert_grads(model, replica)
    _assert_idle(model)
    for opt_model in (model, replica):
        with torch.no_grad():
            for p in opt_model.parameters():
                p -= 0.1 * p.grad  # type: ignore[operator]
    _assert_params(model, replica)


# -- exceptions ----------------------------------------------------------------------------------


class _Boom(RuntimeError):
    pass


def _raise_in_forward(module: nn.Module, args: Any) -> None:
    raise _Boom("boom in forward")


class _FailingBackward(torch.autograd.Function):
    """Identity in forward; raises in backward, like a loss with a broken custom gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        raise _Boom("boom in backward")


def _raise_in_backward(grad: Tensor) -> None:
    raise _Boom("boom in backward")


def _fail(where: str, model: Net, x: Tensor) -> None:
    """Run one iteration that raises ``_Boom`` at ``where`` (on every rank)."""
    if where.startswith("forward"):
        target = {"forward:stem": model.stem, "forward:block1": model.layers[1].linear}[where]
        handle = target.register_forward_pre_hook(_raise_in_forward)
        try:
            _loss(model(x)).backward()
        finally:
            handle.remove()
    elif where == "loss backward":
        _loss(_FailingBackward.apply(model(x))).backward()
    elif where == "mid backward":
        # Between block 0 and block 1: blocks 2 and 1 have reduced (one reduce-scatter may
        # still be in flight), block 0 and the root are still gathered.
        model.grad_hook = _raise_in_backward
        try:
            _loss(model(x)).backward()
        finally:
            model.grad_hook = None
    else:
        raise ValueError(where)


def _recover_after_exception(where: str, reshard_after_forward: bool | None) -> None:
    model, replica, _ = _setup(reshard_after_forward=reshard_after_forward)
    _, x = _batch()
    _loss(model(x)).backward()  # a good first step: lazy init, hooks in place
    hooks = _hook_counts(model)
    with pytest.raises(_Boom):
        _fail(where, model, x)
    model.reset_iter_state()  # type: ignore[operator]
    _assert_idle(model)
    if _hook_counts(model) != hooks:
        raise AssertionError(f"hooks changed: {hooks} -> {_hook_counts(model)}")
    replica.load_state_dict({k: _full(v) for k, v in model.state_dict().items()})
    _clean_step_matches(model, replica)


WHERE = ["forward:stem", "forward:block1", "loss backward", "mid backward"]


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
@pytest.mark.parametrize("where", WHERE)
def test_reset_after_an_exception_gives_clean_gradients(
    where: str, reshard_after_forward: bool | None
) -> None:
    run_distributed(_recover_after_exception, 2, where, reshard_after_forward)


def _skipping_the_reset(where: str) -> str | None:
    """The next iteration without a reset: the FullyShardStateError it raises, or None if it
    ran, in which case its gradients must be a clean run's."""
    model, replica, _ = _setup()
    _, x = _batch()
    with pytest.raises(_Boom):
        _fail(where, model, x)
    try:
        _clean_step_matches(model, replica)
    except FullyShardStateError as e:
        model.reset_iter_state()  # type: ignore[operator]
        _assert_idle(model)
        return str(e)
    return None


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ("forward:block1", ("came in phase FORWARD", "reset_iter_state()")),
        # The loss fails before any of the model's backward hooks ran: nothing is armed, and
        # the next iteration is clean even without a reset.
        ("loss backward", None),
        ("mid backward", ("previous backward had not finished", "reset_iter_state()")),
    ],
)
def test_skipping_the_reset_raises_instead_of_computing_wrong_gradients(
    where: str, words: tuple[str, ...] | None
) -> None:
    message = run_distributed(_skipping_the_reset, 2, where)[0]
    if words is None:
        assert message is None
    else:
        assert message is not None
        for word in words:
            assert word in message


# -- misuse ----------------------------------------------------------------------------------------


def _unshard_twice(model: Net, replica: Net, comm: CountingComm) -> None:
    gx, x = _batch()
    model.layers[0].unshard()  # type: ignore[operator]
    model.layers[0].unshard()  # type: ignore[operator]
    comm.reset()
    _loss(model(x)).backward()
    _loss(replica(gx)).backward()
    _assert_grads(model, replica)
    # the block was gathered once by the explicit calls, and again only for backward
    gathers = comm.count_by_op()["all_gather"]
    if gathers != 2 * len(model.layers):  # forward: root + 2 blocks; backward: 3 blocks
        raise AssertionError(f"{gathers} all-gathers")


def _reshard_between_forward_and_backward(model: Net, replica: Net, comm: CountingComm) -> None:
    gx, x = _batch()
    out = model(x)  # the root keeps its parameters gathered for backward
    model.reshard()  # type: ignore[operator]
    model.layers[2].reshard()  # type: ignore[operator]
    _loss(out).backward()
    _loss(replica(gx)).backward()
    _assert_grads(model, replica)


def _reshard_during_backward(model: Net, replica: Net, comm: CountingComm) -> None:
    _, x = _batch()
    model.grad_hook = lambda g: model.layers[0].reshard()  # type: ignore[operator]
    _loss(model(x)).backward()


def _backward_twice(model: Net, replica: Net, comm: CountingComm) -> None:
    _, x = _batch()
    loss = model(x).sum()  # saves nothing: the second backward gets into the model's graph
    loss.backward()
    loss.backward()  # torch refuses: the graph was freed


def _backward_twice_retained(model: Net, replica: Net, comm: CountingComm) -> None:
    gx, x = _batch()
    loss = _loss(model(x))
    loss.backward(retain_graph=True)
    loss.backward()
    ref_loss = _loss(replica(gx))
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    _assert_grads(model, replica)


def _submodule_alone(model: Net, replica: Net, comm: CountingComm) -> None:
    # Before the root ever ran (the block becomes a root of its own), then after.
    world, rank = dist.get_world_size(), dist.get_rank()
    gh = torch.randn(world * ROWS, DIMS[2], generator=torch.Generator().manual_seed(3))
    h = gh[rank * ROWS : (rank + 1) * ROWS]
    for _ in range(2):
        _loss(model.layers[1](h)).backward()
        _loss(replica.layers[1](gh)).backward()
        _assert_grads(model.layers[1], replica.layers[1])
        gx, x = _batch()
        model.zero_grad()
        replica.zero_grad()
        _loss(model(x)).backward()
        _loss(replica(gx)).backward()
        _assert_grads(model, replica)
        model.zero_grad()
        replica.zero_grad()
    _assert_idle(model)


def _optimizer_step_between(model: Net, replica: Net, comm: CountingComm) -> None:
    _, x = _batch()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    _loss(model(x)).backward()
    out = model(x)
    optim.step()
    _loss(out).backward()


def _optimizer_step_while_gathered(model: Net, replica: Net, comm: CountingComm) -> None:
    # Gathered copies taken before the step (explicit unshard, or reshard_after_backward=False)
    # must not be what the next forward computes with.
    gx, x = _batch()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(replica.parameters(), lr=0.1)
    model.layers[1].set_reshard_after_backward(False)  # type: ignore[operator]
    for _ in range(2):
        _loss(model(x)).backward()
        _loss(replica(gx)).backward()
        model.layers[0].unshard()  # type: ignore[operator]
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    model.layers[1].set_reshard_after_backward(True)  # type: ignore[operator]
    out, ref_out = model(x), replica(gx)
    torch.testing.assert_close(out, ref_out[dist.get_rank() * ROWS :][:ROWS])
    _loss(out).backward()
    _loss(ref_out).backward()
    _assert_grads(model, replica)


def _sync_toggled_mid_backward(model: Net, replica: Net, comm: CountingComm) -> None:
    _, x = _batch()
    model.grad_hook = lambda g: model.set_requires_gradient_sync(False)  # type: ignore[operator]
    _loss(model(x)).backward()


def _sync_toggled_between_forward_and_backward(
    model: Net, replica: Net, comm: CountingComm
) -> None:
    # The flag is read in backward: this backward keeps its gradients local, the next reduces
    # the sum of both.
    gx, x = _batch()
    out = model(x)
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    comm.reset()
    _loss(out).backward()
    if comm.count_by_op().get("reduce_scatter", 0):
        raise AssertionError("a backward with sync off reduced")
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    _loss(model(x)).backward()
    _loss(replica(gx)).backward()
    _loss(replica(gx)).backward()
    _assert_grads(model, replica)


#: (sequence, None if it must work, else the words of the FullyShardStateError it must raise)
MISUSE: dict[str, tuple[Callable[[Net, Net, CountingComm], None], tuple[str, ...] | None]] = {
    "unshard twice": (_unshard_twice, None),
    "reshard between forward and backward": (_reshard_between_forward_and_backward, None),
    "reshard during backward": (
        _reshard_during_backward,
        ("reshard() was called during backward",),
    ),
    "backward twice with retain_graph": (_backward_twice_retained, None),
    "forward on a submodule alone": (_submodule_alone, None),
    "optimizer step between forward and backward": (
        _optimizer_step_between,
        ("backward came for parameter", "changed in place", "optimizer.step()"),
    ),
    "optimizer step while gathered": (_optimizer_step_while_gathered, None),
    "set_requires_gradient_sync mid-backward": (
        _sync_toggled_mid_backward,
        ("set_requires_gradient_sync(False) was called during backward",),
    ),
    "set_requires_gradient_sync between forward and backward": (
        _sync_toggled_between_forward_and_backward,
        None,
    ),
}


def _misuse(name: str) -> None:
    sequence, words = MISUSE[name]
    model, replica, comm = _setup()
    if words is None:
        sequence(model, replica, comm)
    else:
        with pytest.raises(FullyShardStateError) as info:
            sequence(model, replica, comm)
        for word in words:
            if word not in str(info.value):
                raise AssertionError(f"{word!r} not in {info.value}")
        model.reset_iter_state()  # type: ignore[operator]
    model.grad_hook = None
    _assert_idle(model)
    replica.load_state_dict({k: _full(v) for k, v in model.state_dict().items()})
    model.set_requires_gradient_sync(True)  # type: ignore[operator]
    _clean_step_matches(model, replica)


@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_works_or_says_which_call_came_in_which_state(name: str) -> None:
    run_distributed(_misuse, 2, name)


def _backward_twice_then_forward() -> str:
    model, replica, comm = _setup()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _backward_twice(model, replica, comm)
    return _skipping_the_reset_after(model)


def _skipping_the_reset_after(model: Net) -> str:
    _, x = _batch()
    with pytest.raises(FullyShardStateError) as info:
        model(x)
    model.reset_iter_state()  # type: ignore[operator]
    _assert_idle(model)
    return str(info.value)


def test_backward_twice_without_forward_then_forward_asks_for_a_reset() -> None:
    message = run_distributed(_backward_twice_then_forward, 2)[0]
    assert "previous backward had not finished" in message
    assert "reset_iter_state()" in message


# -- a rank that dies ---------------------------------------------------------------------------

PG_TIMEOUT_S = 5.0


def _dying_rank_main(rank: int, port: int, conn: Any, how: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    model, _, _ = _setup()
    _, x = _batch()
    if rank == 1:
        # Dies (or stops answering) in the middle of the second step's forward, between two
        # all-gathers.
        def die(module: nn.Module, args: Any) -> None:
            if die.calls == 1:  # type: ignore[attr-defined]
                if how == "hangs":
                    time.sleep(PG_TIMEOUT_S + 60)
                os._exit(17)
            die.calls += 1  # type: ignore[attr-defined]

        die.calls = 0  # type: ignore[attr-defined]
        model.layers[1].register_forward_pre_hook(die)
    start = time.monotonic()
    try:
        for _ in range(3):
            start = time.monotonic()
            _loss(model(x)).backward()
        conn.send((rank, "finished", "", 0.0))
    except Exception as e:
        conn.send(
            (rank, type(e).__name__, f"{e}\n{traceback.format_exc()}", time.monotonic() - start)
        )


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_a_dead_rank_makes_the_others_raise_within_the_timeout(how: str) -> None:
    # Own processes, not the harness pool: the point is a process group with a short timeout
    # whose peer really dies.
    ctx = multiprocessing.get_context("forkserver")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # A pipe, not a Queue: a Queue's semaphores leak when a process holding them is killed.
    receiver, sender = ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=_dying_rank_main, args=(r, store.port, sender, how)) for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        assert receiver.poll(PG_TIMEOUT_S + 90), "no rank reported: rank 0 hangs"
        rank, kind, message, elapsed = receiver.recv()
        if how == "dies":
            procs[1].join(30)
            assert procs[1].exitcode == 17, f"rank 1 should have died, exit {procs[1].exitcode}"
    finally:
        for p in procs:
            p.join(1)
            if p.is_alive():
                p.kill()
                p.join()
        receiver.close()
        sender.close()
    assert rank == 0
    assert kind != "finished", "rank 0 trained on although its peer died"
    assert kind in ("RuntimeError", "DistBackendError"), message
    assert elapsed < PG_TIMEOUT_S + 10, f"rank 0 took {elapsed:.1f} s to notice: {message}"
    # gloo's own words name the cause: the peer's socket closed or reset, or the timeout. A
    # gloo all-gather is W broadcasts in flight at once (TorchComm): the first to time out
    # closes the pair, and the one we wait on may report that closure instead.
    expected = ("by peer",) if how == "dies" else ("Timed out", "timeout caused pair closure")
    assert any(words in message for words in expected), message
