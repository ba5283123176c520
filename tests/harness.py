"""Run a test function on W gloo ranks, in a warm pool of worker processes.

Usage, from a test module::

    from harness import mesh_1d, run_distributed

    def _sum_ranks() -> float:                   # module level: pickled by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum() -> None:
        assert run_distributed(_sum_ranks, 3) == [3.0, 3.0, 3.0]

How it works. For each world size W the harness keeps one *pool*: W worker processes started
with ``forkserver`` (the forkserver imports ``PRELOAD``, torch included, so a new rank costs a
fork, not an import), each with the default process group initialised on gloo. The rendezvous
store is a ``TCPStore`` hosted by the parent on a port the OS picks (port 0), so there is no
fixed port and no race for one. A job pickles ``(fn, args, kwargs)`` once, sends it to every
rank over a pipe and waits for W answers.

Failure handling. The first rank to raise starts a short grace period (``GRACE_S``) in which
the others may report too; ranks still running after it are presumed stuck in a collective.
Any failure, or a job that runs past its ``timeout``, kills the pool: after a mismatched
collective the process group cannot be trusted. The next job for that W builds a fresh pool.
A test that expects an error should catch it *inside* the rank function (``pytest.raises``
there), so the job succeeds and the pool stays warm.

Worker processes ignore SIGINT, die with their parent (``PR_SET_PDEATHSIG`` on Linux, EOF on
the pipe elsewhere) and are shut down by ``shutdown_pools()``, which ``conftest.py`` calls at
the end of the pytest session and ``atexit`` calls otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import resource_tracker
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "GRACE_S",
    "MAX_WORLD_SIZE",
    "RankError",
    "RankFailure",
    "device_mesh",
    "fresh_pool",
    "mesh_1d",
    "run_distributed",
    "shutdown_pools",
]

MAX_WORLD_SIZE = 4
#: Seconds the other ranks get to report after the first rank fails, before the pool is killed.
GRACE_S = 1.0
#: Timeout of every gloo collective. Finite so that a rank stuck in a collective eventually
#: raises on its own; a job's ``timeout`` is the usual way a hang ends.
GLOO_TIMEOUT = timedelta(seconds=120)
#: Seconds a pool may take to start all ranks and initialise the process group.
STARTUP_TIMEOUT_S = 120.0
#: Seconds a worker gets to exit on its own at shutdown before it is killed.
SHUTDOWN_TIMEOUT_S = 5.0

#: Imported once by the forkserver, before it forks any rank, so that no new rank imports them
#: again. ``torch._dynamo``: the first optimizer step in a process imports it (about 1 s of CPU
#: per rank); ``fully_shard``: every job uses it (about 500 modules); DCP: the checkpoint tests
#: and examples; the compile stack (AOTAutograd, the debugging backends, inductor's entry point:
#: about 600 modules, jinja2, networkx and sympy among them, no thread started): what a rank's
#: first ``torch.compile`` imports, 1.3 s of CPU against 0.1 s for the second. Pools are
#: started about 13 times per pytest worker (one per world size, and again after each test
#: that kills ranks), with up to 4 ranks importing at once on 2 cores; with these preloaded,
#: the first job of a 4-rank pool takes about half as long.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "functorch.compile",
    "torch._dynamo.backends.debugging",
    "torch._inductor.compile_fx",
    "fully_shard",
    __name__,
]

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class RankFailure:
    """What one rank reported when its job failed.

    Attributes:
        rank: the failing rank.
        type_name: the exception type, e.g. ``"ValueError"`` or ``"torch.OutOfMemoryError"``.
        message: ``str()`` of the exception.
        traceback: the rank's full formatted traceback (or why the process died).
    """

    rank: int
    type_name: str
    message: str
    traceback: str


class RankError(AssertionError):
    """One or more ranks failed. ``failures`` maps each failing rank to what it reported."""

    def __init__(
        self, fn_name: str, world_size: int, failures: dict[int, RankFailure], killed: list[int]
    ) -> None:
        self.fn_name = fn_name
        self.world_size = world_size
        self.failures = failures
        self.killed = killed
        ranks = ", ".join(str(r) for r in sorted(failures))
        lines = [f"{fn_name} failed on rank(s) {ranks} of world size {world_size}"]
        if killed:
            lines.append(
                f"rank(s) {', '.join(map(str, killed))} were still running {GRACE_S} s after "
                "the first failure (likely stuck in a collective) and were killed"
            )
        for rank in sorted(failures):
            f = failures[rank]
            lines.append(f"\n---- rank {rank}: {f.type_name}: {f.message}\n{f.traceback.rstrip()}")
        super().__init__("\n".join(lines))


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results by rank.

    ``fn`` must be a module-level function (it is pickled by reference), and ``args``,
    ``kwargs`` and the return values must pickle. Return plain tensors (``to_local()``,
    ``full_tensor()``), not DTensors: the parent has no process group to rebuild one on.
    Inside ``fn`` the default process group is initialised (gloo),
    ``torch.get_num_threads() == 1`` and ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` are set.
    A test that expects an exception should catch it inside ``fn``, so the pool stays warm.

    Raises:
        RankError: some rank raised (or its process died); the message holds each failing
            rank's traceback. The pool is rebuilt for the next job.
        TimeoutError: the job ran past ``timeout`` seconds. The pool is killed and rebuilt.
    """
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be in 1..{MAX_WORLD_SIZE}, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    try:
        payload = pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"run_distributed could not pickle {_name(fn)} and its arguments ({e}); "
            "fn must be a module-level function and its arguments picklable"
        ) from e
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(_name(fn), payload, timeout)
    except BaseException:
        # Includes KeyboardInterrupt in the parent: the ranks may be mid-job.
        pool.kill()
        del _POOLS[world_size]
        raise


def shutdown_pools() -> None:
    """Stop every warm pool and wait for its processes to exit.

    Also stops multiprocessing's forkserver and resource tracker, if running, so that they
    are reaped here rather than left as zombies for init after this process exits.
    """
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.shutdown()
    # Private helpers (present since 3.8) that restart on demand. Best effort: a Python whose
    # internals differ just leaves them to exit on their own when this process does.
    helpers: list[Any] = [
        multiprocessing.forkserver._forkserver,
        resource_tracker._resource_tracker,
    ]
    for helper in helpers:
        with contextlib.suppress(Exception):
            helper._stop()


def fresh_pool(world_size: int) -> None:
    """Replace the warm pool of ``world_size`` by a new, started one, before a test that
    kills its ranks (or has one end with ``os._exit``).

    Such a rank, after earlier tests' ``torch.compile`` jobs, leaves their compile pool's
    semaphores for multiprocessing's resource tracker to clean up, with a "leaked semaphore"
    warning at the end of the session; a new pool has none.
    """
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.shutdown()
    _POOLS[world_size] = _Pool(world_size)


def device_mesh(shape: Sequence[int], dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """Inside a rank function: a CPU ``DeviceMesh`` of ``shape``, cached per worker process.

    Building a mesh creates process groups, a collective on every rank; caching keeps
    repeated jobs on a warm pool from creating new groups each time. Every rank must call
    it with the same arguments (as with any mesh construction).
    """
    key = (tuple(shape), None if dim_names is None else tuple(dim_names))
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
        _MESHES[key] = mesh
    return mesh


def mesh_1d() -> DeviceMesh:
    """Inside a rank function: the 1-D CPU mesh over all ranks, ``(world_size,)``."""
    return device_mesh((dist.get_world_size(),))


# Parent side: one pool per world size. Worker side: meshes built in this process.
_POOLS: dict[int, _Pool] = {}
_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...] | None], DeviceMesh] = {}


def _name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", "?")
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def _type_name(e: BaseException) -> str:
    kind = type(e)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def _receive(conn: multiprocessing.connection.Connection) -> Any:
    """The next message on ``conn``, or None when there is none or the other end is gone."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _context() -> ForkServerContext | SpawnContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        # Only effective before the forkserver starts; later calls are harmless.
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


class _Pool:
    """W worker processes that share one default gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._job = 0
        # The parent hosts the rendezvous store; port 0 lets the OS pick a free one.
        self._store: TCPStore | None = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False
        )
        port = self._store.port
        ctx = _context()
        self._procs: list[BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, port, child_end),
                    name=f"fully_shard-test-rank{rank}-of-{world_size}",
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
            self._wait_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            where = f"rank {rank} of world size {self.world_size}"
            if not multiprocessing.connection.wait(
                [conn, proc.sentinel], max(0.0, deadline - time.monotonic())
            ):
                raise TimeoutError(f"{where} did not start within {STARTUP_TIMEOUT_S} s")
            answer = _receive(conn)
            if answer is None:
                proc.join(GRACE_S)
                raise RuntimeError(f"{where} died while starting (exit code {proc.exitcode})")
            if answer[0] != "ready":
                raise RuntimeError(f"{where} failed to start:\n{answer[1]}")

    def run(self, fn_name: str, payload: bytes, timeout: float) -> list[Any]:
        self._job += 1
        job = self._job
        message = (job, list(sys.path), payload)
        for conn in self._conns:
            conn.send(message)

        results: dict[int, Any] = {}
        failures: dict[int, RankFailure] = {}
        running = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        while running:
            if first_failure is not None:
                deadline = min(deadline, first_failure + GRACE_S)
            # Each rank's pipe (it answered) and sentinel (it died), both mapped to the rank.
            watch: dict[Any, int] = {self._conns[r]: r for r in running}
            watch.update({self._procs[r].sentinel: r for r in running})
            ready = multiprocessing.connection.wait(
                list(watch), max(0.0, deadline - time.monotonic())
            )
            if not ready:
                break
            for obj in ready:
                rank = watch[obj]
                if rank not in running:
                    continue  # both its pipe and its sentinel were ready
                answer = _receive(self._conns[rank])
                if answer is not None:
                    kind, answered, body = answer
                    if answered != job:
                        raise RuntimeError(f"rank {rank} answered job {answered}, expected {job}")
                    if kind == "ok":
                        results[rank] = pickle.loads(body)
                    else:
                        failures[rank] = RankFailure(rank, *body)
                else:  # the process died without answering
                    self._procs[rank].join(GRACE_S)  # its pipe can close before it is reaped
                    code = self._procs[rank].exitcode
                    failures[rank] = RankFailure(
                        rank, "ProcessDied", f"worker process exited with code {code}", ""
                    )
                running.discard(rank)
            if failures and first_failure is None:
                first_failure = time.monotonic()

        if failures:
            raise RankError(fn_name, self.world_size, failures, sorted(running))
        if running:
            raise TimeoutError(
                f"{fn_name} on world size {self.world_size} did not finish within {timeout} s "
                f"(rank(s) {sorted(running)} still running, {sorted(results)} done); "
                "the pool was killed and will be rebuilt for the next job"
            )
        return [results[rank] for rank in range(self.world_size)]

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(SHUTDOWN_TIMEOUT_S)
        self._close()

    def shutdown(self) -> list[int | None]:
        """Ask every rank to leave; their exit codes (None for one that had to be killed)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send(None)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        codes = [proc.exitcode for proc in self._procs]
        self.kill()
        return codes

    def _close(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            proc.close()
        self._procs, self._conns = [], []
        self._store = None


def _worker_main(
    rank: int, world_size: int, port: int, conn: multiprocessing.connection.Connection
) -> None:
    """A rank's process: join the process group, then run jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    faulthandler.enable()  # a rank killed by a signal prints its Python stacks to stderr
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Keep gloo on the loopback interface, whatever the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    torch.set_num_threads(1)
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=GLOO_TIMEOUT)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=GLOO_TIMEOUT
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", rank))

    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            break
        job, sys_path, payload = message
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        try:
            fn, args, kwargs = pickle.loads(payload)
            answer: tuple[str, int, Any] = ("ok", job, pickle.dumps(fn(*args, **kwargs)))
        except BaseException as e:
            answer = ("error", job, (_type_name(e), str(e), traceback.format_exc()))
        conn.send(answer)
    dist.destroy_process_group()
    # No leave_rank() here (fully_shard.demo): a forkserver child already ends with os._exit
    # after multiprocessing's own finalizers, so the interpreter never finalizes with gloo's
    # threads alive; skipping those finalizers too leaks torch.compile's pool semaphores.


atexit.register(shutdown_pools)
