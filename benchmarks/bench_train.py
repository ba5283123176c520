"""Train one Llama-style model with fully_shard, torch FSDP2 and DDP in one run, and compare.

One command spawns ``--nproc`` local ranks (gloo on CPU, or NCCL with ``--device cuda``) and
builds the same model from the same seed once per implementation:

* ``ours``  -- :func:`fully_shard.fully_shard` on every block, then on the root;
* ``ours-int8`` -- the same with ``QuantizationPolicy(all_gather="int8")``: weights all-gathered
  as block-quantized int8 (``--block-size``, default 256), fp32 masters and gradients;
* ``fsdp2`` -- ``torch.distributed.fsdp.fully_shard`` (torch's FSDP2), wrapped the same way;
  ``--wrap head`` also makes ``[norm, output]`` one group of its own (not resharded after
  forward) for both, so the head's gradients are reduced as soon as they are ready;
* ``ddp``   -- ``torch.nn.parallel.DistributedDataParallel``;
* ``plain`` (only with ``--nproc 1``) -- the model itself, no wrapper: the floor a one-rank
  run of any of them is measured against;
* ``ours-graph`` -- ours sharded the same way, then ``torch.compile(model, fullgraph=True)``:
  the whole step in one graph, collectives included (``fully_shard.graph``);
  ``ours-graph-reorder`` (inductor only) adds inductor's reordering passes (the ``reorder``
  recipe of docs/recipes/compile.md: each collective starts earlier and is waited for later);
* ``fsdp2-compiled`` -- torchtitan's order for torch's FSDP2: each block
  ``torch.compile(block, fullgraph=True)``, then ``fully_shard`` on the compiled blocks and the
  root (the hooks run eagerly between the blocks' graphs);
* ``ours-buckets`` -- ours with ``set_bucket_cap_mb(--bucket-cap-mb)``: the groups'
  collectives merged into buckets; ``ours-zero2`` the same with ``reshard_after_forward=False``
  on every block: the parameters stay gathered from forward to backward, so a step moves one
  all-gather and one reduce-scatter per bucket, DDP's bytes (ZeRO-2's traffic, ZeRO-3's
  sharded optimizer state);
* ``ddp-compiled`` -- DDP, then ``torch.compile(model)``;
  the three compiled ones use ``--compile-backend`` (default inductor) and report the time of
  their first step (the compilation) separately;
* ``ours-nogather`` (only when asked for) -- ours with every all-gather replaced by a local
  copy of the rank's own shard into each slot: no bytes move, the losses are wrong by design.
  A floor for the step time: what ours would take if all-gathers cost nothing.

All of them train on the same global batches with AdamW. After a warm-up they run interleaved,
a few steps each in rotating order (ABC, BCA, CAB, ...), so that noise from the machine falls on
all of them alike. Then the parent process trains an unsharded replica on the same global
batches (as W micro-batches, see :func:`reference_losses`): the reference for the losses.

Per implementation it prints step time (median and IQR over steps; a step's time is the slowest
rank's) and how it splits into forward, backward and optimizer, per-rank peak memory over one
step, the bytes each collective sent per step, the final loss and the largest per-step loss
difference from the reference; for ZeRO-3 also the volume theory predicts, and the ratios
of ours (and ours-int8) to FSDP2 and DDP. The last line printed is one JSON
object with every number. docs/performance.md explains each of them.

Example:
    $ python benchmarks/bench_train.py --size small --nproc 2
    $ python benchmarks/bench_train.py --size medium --impls ours,fsdp2 --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import inspect
import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.multiprocessing.spawn import spawn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

import fully_shard as fs
from fully_shard.demo import leave_rank
from fully_shard.launch import Distributed, init_distributed, worker_environment
from fully_shard.quantize import int8_gather_nbytes

IMPLS = (
    "ours",
    "ours-int8",
    "fsdp2",
    "ddp",
    "ours-nogather",
    "plain",
    "ours-graph",
    "ours-graph-reorder",
    "fsdp2-compiled",
    "ddp-compiled",
    "ours-buckets",
    "ours-zero2",
)
DEFAULT_IMPLS = IMPLS[:4]
OURS = (
    "ours",
    "ours-int8",
    "ours-nogather",
    "ours-graph",
    "ours-graph-reorder",
    "ours-buckets",
    "ours-zero2",
)
ZERO3 = (*OURS, "fsdp2", "fsdp2-compiled")
# Compiled with torch.compile (--compile-backend): their collectives are in the compiled code,
# where no Comm can count them, so their bytes are not measured.
COMPILED = ("ours-graph", "ours-graph-reorder", "fsdp2-compiled", "ddp-compiled")
# docs/recipes/compile.md's "reorder": inductor's passes that start each collective earlier
# and wait for it later (torch 2.13 runs none of them unless they are listed).
REORDER = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": [
        "reorder_compute_for_overlap",
        "sink_waits",
        "raise_comms",
    ],
}
PHASES = ("forward", "backward", "optimizer")
LABELS = {
    "ours": "fully_shard (ours)",
    "ours-int8": "ours, int8 gather",
    "fsdp2": "torch FSDP2",
    "ddp": "torch DDP",
    "ours-nogather": "ours, no-op gathers",
    "plain": "unsharded, no wrapper",
    "ours-graph": "ours, one graph",
    "ours-graph-reorder": "ours, graph reord.",
    "fsdp2-compiled": "FSDP2, blocks comp.",
    "ddp-compiled": "DDP, compiled",
    "ours-buckets": "ours, buckets",
    "ours-zero2": "ours, buckets, kept",
}
MIB = 1024 * 1024
_STEP_MARK = "bench::measured_step"  # the profiler range around the step whose memory counts

# ---------------------------------------------------------------------------------------------
# The model: a compact Llama (token embedding, N x [RMSNorm, causal attention with RoPE,
# RMSNorm, SwiGLU], final RMSNorm, untied output head), fp32.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Model and per-rank batch sizes.

    Attributes:
        vocab: token ids; rows of the embedding and of the output head.
        dim: model width (``n_heads`` divides it; head_dim is even for RoPE).
        n_layers: transformer blocks, each its own ``fully_shard`` group.
        n_heads: attention heads.
        ffn_hidden: SwiGLU hidden width.
        seq_len: tokens per sequence.
        batch: sequences per rank per step (the global batch is ``W * batch``).

    Example:
        >>> ModelConfig(vocab=64, dim=16, n_layers=2, n_heads=2, ffn_hidden=32, seq_len=8,
        ...             batch=2).dim
        16
    """

    vocab: int
    dim: int
    n_layers: int
    n_heads: int
    ffn_hidden: int
    seq_len: int
    batch: int


SIZES = {
    # For the benchmark's own test: seconds in all, numbers meaningless except bytes and losses.
    "tiny": ModelConfig(
        vocab=64, dim=32, n_layers=2, n_heads=2, ffn_hidden=48, seq_len=16, batch=2
    ),
    # ~1.1 M parameters; a step takes tens of milliseconds on one CPU thread.
    "small": ModelConfig(
        vocab=1024, dim=128, n_layers=4, n_heads=4, ffn_hidden=352, seq_len=64, batch=4
    ),
    # ~8.5 M parameters; a step takes about half a second on one CPU thread.
    "medium": ModelConfig(
        vocab=4096, dim=256, n_layers=8, n_heads=8, ffn_hidden=704, seq_len=128, batch=4
    ),
}
DEFAULT_STEPS = {"tiny": 4, "small": 30, "medium": 30}
WRAPS = ("blocks", "head")


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim; weight ``(dim,)``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x (B, H, S, hd); cos, sin (S, hd): rotate the two halves of each head (RoPE)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions; no biases."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, d = x.shape  # (B, S, dim) -> (B, H, S, hd) for SDPA
        q, k, v = (
            w(x).view(b, s, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))  # type: ignore[no-any-return]


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``; w1, w3 ``(hidden, dim)``, w2 ``(dim, hidden)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))  # type: ignore[no-any-return]


class Llama(nn.Module):
    """tokens ``(B, S)`` int64 -> logits ``(B, S, vocab)``; embedding and head are not tied.

    The RoPE tables are non-persistent buffers (DDP is told not to broadcast them).

    Example:
        >>> cfg = ModelConfig(vocab=64, dim=16, n_layers=2, n_heads=2, ffn_hidden=32,
        ...                   seq_len=8, batch=2)
        >>> Llama(cfg)(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 64])
    """

    cos: Tensor
    sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        nn.init.normal_(self.tok_embeddings.weight, std=0.02)
        hd = cfg.dim // cfg.n_heads
        inv_freq = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # (hd/2,)
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # (S, hd)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        s = tokens.shape[1]
        h = self.tok_embeddings(tokens)  # (B, S, dim)
        cos, sin = self.cos[:s], self.sin[:s]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


def make_batches(cfg: ModelConfig, world: int, n_steps: int, seed: int) -> list[Tensor]:
    """``n_steps`` global batches, each ``(W * batch, seq_len + 1)`` int64 tokens.

    Each row counts up from a random start by a random stride (mod vocab), with 10% of the
    tokens replaced by noise, so the loss falls within a few steps yet never reaches zero.
    """
    batches = []
    for step in range(n_steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = world * cfg.batch
        start = torch.randint(0, cfg.vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 8, (rows, 1), generator=g)
        tokens = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab
        noise = torch.rand(tokens.shape, generator=g) < 0.1
        tokens[noise] = torch.randint(0, cfg.vocab, (int(noise.sum()),), generator=g)
        batches.append(tokens)
    return batches


def train_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    tokens: Tensor,
    mark: Callable[[], None] | None = None,
) -> Tensor:
    """Forward, backward, AdamW step, zero the gradients; returns the (local) mean loss.

    ``mark`` (if given) is called after the loss and after backward: the phase boundaries.
    """
    logits = model(tokens[:, :-1])  # (B, S, vocab)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    if mark is not None:
        mark()
    loss.backward()  # type: ignore[no-untyped-call]
    if mark is not None:
        mark()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


# ---------------------------------------------------------------------------------------------
# Building the three implementations, and counting their collectives
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    """Everything a rank needs to know (picklable, sent to every spawned rank)."""

    size: str
    model: ModelConfig
    world: int
    steps: int
    warmup: int
    round_steps: int
    impls: tuple[str, ...]
    wrap: str
    device: str
    seed: int
    lr: float
    foreach: bool
    block_size: int = 256
    backend: str = "gloo"  # "nccl" for --device cuda unless --backend gloo
    compile_backend: str = "inductor"  # torch.compile's, for the compiled implementations
    bucket_cap_mb: float = 25.0  # ours-buckets: set_bucket_cap_mb (DDP's default cap)

    @property
    def quantization(self) -> fs.QuantizationPolicy:
        """The policy of ``ours-int8``."""
        return fs.QuantizationPolicy(all_gather="int8", block_size=self.block_size)


@dataclass
class RankContext:
    """One rank's fixed surroundings: device, mesh and the precomputed batches."""

    opts: RunOptions
    rank: int
    device: torch.device
    mesh: DeviceMesh
    batches: list[Tensor]  # this rank's rows of every global batch, on the device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class _Done:
    def wait(self) -> bool:
        return True


class NoGatherComm(fs.TorchComm):
    """``ours-nogather``'s Comm: all-gathers that move no bytes; the rest as ``TorchComm``.

    Each rank copies its own shard into every rank's slot of the output, so the unsharded
    parameters are wrong (every slot holds this rank's rows) but the engine does all its other
    work: copy-in, copy-out, hooks, prefetch, reduce-scatter. Timing only.
    """

    def all_gather(
        self, output: Tensor, input: Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> _Done | None:
        n = input.numel()
        for r in range(group.size()):
            slot = output.narrow(0, r * n, n)
            if slot.data_ptr() != input.data_ptr():
                slot.copy_(input)
        return _Done() if async_op else None


def build(impl: str, ctx: RankContext) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model from the run's seed, wrapped by ``impl``, and its AdamW optimizer."""
    torch.manual_seed(ctx.opts.seed)
    model: nn.Module = Llama(ctx.opts.model).to(ctx.device)
    mesh = own_mesh(ctx.mesh, impl)
    compile_backend = ctx.opts.compile_backend
    if impl in ZERO3:
        shard: Callable[..., Any] = torch_fully_shard
        if impl in OURS:
            policy = ctx.opts.quantization if impl == "ours-int8" else fs.QuantizationPolicy()
            shard = functools.partial(fs.fully_shard, quantization_policy=policy)
        for i, block in enumerate(list(model.layers)):
            if impl == "fsdp2-compiled":  # torchtitan's order: compile each block, then shard
                block = torch.compile(block, backend=compile_backend, fullgraph=True)
                model.layers[i] = block
            if impl == "ours-zero2":  # gathered from forward to backward: ZeRO-2's traffic
                shard(block, mesh=mesh, reshard_after_forward=False)
            else:
                shard(block, mesh=mesh)
        if ctx.opts.wrap == "head":
            # Backward starts at the head: keeping it gathered from forward costs no extra
            # gather, and as its own group its gradients go out first instead of waiting for
            # the embedding's, the last gradient of the step.
            shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False)
        shard(model, mesh=mesh)
        if impl == "ours-nogather":
            model.set_comm(NoGatherComm())  # type: ignore[operator]
        if impl in ("ours-buckets", "ours-zero2"):
            model.set_bucket_cap_mb(ctx.opts.bucket_cap_mb)  # type: ignore[operator]
        optim = _adamw(model, ctx)
        if impl == "ours-graph":
            model = torch.compile(model, backend=compile_backend, fullgraph=True)  # type: ignore[assignment]
        elif impl == "ours-graph-reorder":
            if compile_backend != "inductor":
                raise ValueError(
                    "ours-graph-reorder: inductor's passes need --compile-backend inductor"
                )
            model = torch.compile(model, fullgraph=True, options=REORDER)  # type: ignore[assignment]
        return model, optim
    elif impl in ("ddp", "ddp-compiled"):
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # The RoPE tables are the same on every rank: no buffer broadcast before each forward.
        # torch 2.13 renamed broadcast_buffers to forward_sync_buffers (the old name warns).
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        )
        model = DistributedDataParallel(model, device_ids=device_ids, **{no_sync: False})
        if impl == "ddp-compiled":
            optim = _adamw(model, ctx)
            return torch.compile(model, backend=compile_backend), optim  # type: ignore[return-value]
    elif impl == "plain":
        if dist.get_world_size() != 1:
            raise ValueError("--impls plain trains without synchronisation: use --nproc 1")
    else:
        raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")
    return model, _adamw(model, ctx)


def _adamw(model: nn.Module, ctx: RankContext) -> torch.optim.Optimizer:
    # foreach=None is torch's default: the per-tensor loop on CPU, the foreach kernels on CUDA.
    foreach = True if ctx.opts.foreach else None
    return torch.optim.AdamW(model.parameters(), lr=ctx.opts.lr, foreach=foreach)


class OpCounter:
    """Calls and bytes per collective op, as seen from this rank (the size of its input)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def add(self, op: str, t: Tensor) -> None:
        self.bytes[op] = self.bytes.get(op, 0) + t.numel() * t.element_size()
        self.calls[op] = self.calls.get(op, 0) + 1


def attach_counter(impl: str, model: nn.Module) -> Callable[[], dict[str, dict[str, int]]]:
    """Route ``model``'s collectives through a counter; returns a function reading it.

    ours: :class:`fully_shard.CountingComm` via ``set_comm``. FSDP2: subclasses of its default
    all-gather / reduce-scatter (``set_custom_all_gather`` / ``set_custom_reduce_scatter``),
    which do exactly what the defaults do. DDP: a comm hook that counts each bucket, then runs
    torch's default ``allreduce_hook``. Only the step that reads the counts uses them.
    """
    if impl in COMPILED:
        return lambda: {"bytes": {}, "calls": {}}
    if impl in OURS:
        comm = fs.CountingComm(NoGatherComm() if impl == "ours-nogather" else fs.TorchComm())
        model.set_comm(comm)  # type: ignore[operator]
        return lambda: {"bytes": comm.bytes_by_op(), "calls": comm.count_by_op()}
    counter = OpCounter()
    if impl == "fsdp2":
        # torch keeps its default Comm classes in a private module; they are public in intent
        # (set_custom_* takes them) but may move between releases. Where they are missing
        # (an older torch), FSDP2's bytes are not counted: its measured/theory reads 0.
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
                DefaultAllGather,
                DefaultReduceScatter,
            )
        except ImportError:
            return lambda: {"bytes": {}, "calls": {}}

        class CountingAllGather(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):  # type: ignore[no-untyped-def]
                counter.add("all_gather", input_tensor)
                return super().__call__(output_tensor, input_tensor, group, async_op)

        class CountingReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[no-untyped-def]
                counter.add("reduce_scatter", input_tensor)
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        for m in model.modules():
            if isinstance(m, TorchFSDPModule):
                m.set_custom_all_gather(CountingAllGather())
                m.set_custom_reduce_scatter(CountingReduceScatter())
    elif impl == "ddp":
        # No annotations: DDP compares them with dist.GradBucket, and with
        # ``from __future__ import annotations`` they would be strings.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            counter.add("all_reduce", bucket.buffer())
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        model.register_comm_hook(None, hook)  # type: ignore[operator]
    return lambda: {"bytes": dict(counter.bytes), "calls": dict(counter.calls)}


# ---------------------------------------------------------------------------------------------
# Measuring: memory and bytes on a fresh instance, then interleaved timing
# ---------------------------------------------------------------------------------------------


def _set_cpu_allocator_accounting(on: bool) -> bool:
    """Turn c10's ``caffe2_report_cpu_memory_usage`` flag on or off; False if not found.

    With the flag on, torch's CPU allocator keeps a process-wide total of live bytes, updated
    on every thread (gloo frees some tensors on its worker threads), and the profiler stamps
    that total on each allocation event. Without it the total only moves for allocations made
    while a profiler is active on the calling thread. The flag is a plain exported ``bool`` in
    libc10; the benchmark flips it only around the memory measurements.
    """
    lib = Path(torch.__file__).parent / "lib" / "libc10.so"
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(lib)), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):
        return False
    flag.value = on
    return True


def _allocation_events(prof: profile) -> list[tuple[int, int, int]]:
    """(time ns, bytes (+ alloc / - free), process-wide live bytes after it), CPU only."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("the torch profiler returned no events; cannot measure CPU memory")
    out = []
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        ef = node.extra_fields
        if type(ef).__name__ == "_ExtraFields_Allocation" and ef.device.type == "cpu":
            out.append((node.start_time_ns, ef.alloc_size, ef.total_allocated))
    out.sort(key=lambda ev: ev[0])
    return out


def _step_window(prof: profile) -> tuple[int, int]:
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    marks = [
        (e.start_ns(), e.start_ns() + e.duration_ns())
        for e in (results.events() if results is not None else [])
        if e.name() == _STEP_MARK
    ]
    if len(marks) != 1:
        raise RuntimeError(f"expected one {_STEP_MARK!r} range in the profile, got {len(marks)}")
    return marks[0]


def _memory_from_profile(prof: profile, process_wide: bool) -> tuple[int, int]:
    """(live bytes when the marked step starts, peak live bytes during it), this instance's.

    The profile runs from just before the instance is built to the end of the measured step.
    ``process_wide``: read the allocator's running total stamped on each event (exact across
    threads, sampled at the training thread's allocations and frees) and subtract its value
    before the build. Otherwise sum the events' sizes, which misses frees done on other threads.
    """
    events = _allocation_events(prof)
    if not events:
        return 0, 0
    start, end = _step_window(prof)
    # (time, live bytes just before the event, just after it)
    live: list[tuple[int, int, int]] = []
    if process_wide:
        base = events[0][2] - events[0][1]  # live before the first event: before the build
        live = [(t, total - nbytes - base, total - base) for t, nbytes, total in events]
    else:
        running = 0
        for t, nbytes, _ in events:
            live.append((t, running, running + nbytes))
            running += nbytes
    inside = [(before, after) for t, before, after in live if start <= t <= end]
    if not inside:  # nothing allocated or freed during the step
        earlier = [after for t, _, after in live if t < start]
        state = earlier[-1] if earlier else 0
        return state, state
    # The first event's "before" also reflects frees made on other threads since the last
    # event of the training thread, which the last "after" ahead of the step would not.
    state = inside[0][0]
    return state, max(state, *(after for _, after in inside))


def _warm_device(ctx: RankContext) -> None:
    """One unsharded forward and backward before anything is measured.

    cuBLAS allocates a workspace per thread the first time it runs there (the training thread
    and autograd's backward thread: 64 MiB together on an H200), and keeps it. Without this,
    the first implementation measured is charged for them (seen: ours 161.6 MiB of state at
    W=1, FSDP2 97.6, with ours measured first).
    """
    torch.manual_seed(ctx.opts.seed)
    model = Llama(ctx.opts.model).to(ctx.device)
    tokens = ctx.batches[0]
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()  # type: ignore[no-untyped-call]
    ctx.sync()


def measure_instance(impl: str, ctx: RankContext) -> dict[str, Any]:
    """Peak memory over one steady-state step and the bytes per collective of the next, and
    the time of the instance's first step (the compiled implementations compile in it).

    A fresh instance, built, warmed up (2 steps: AdamW allocates its state, DDP rebuilds its
    buckets), measured and torn down inside this call, so the timed instances are untouched
    and the memory belongs to this one alone: every number is relative to the bytes live just
    before the build. On CPU the torch profiler's allocation events are read (see
    :func:`_memory_from_profile`); on CUDA ``torch.cuda.memory_allocated`` and
    ``max_memory_allocated``.
    """
    gc.collect()
    on_cpu = ctx.device.type == "cpu"
    prof, process_wide, base = None, False, 0
    if on_cpu:
        process_wide = _set_cpu_allocator_accounting(True)
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.start()
    else:
        torch.cuda.synchronize(ctx.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(ctx.device)
    model, optim = build(impl, ctx)
    for k in range(2):
        start = time.perf_counter()
        train_step(model, optim, ctx.batches[k])
        if k == 0:  # the compiled implementations compile here, their first time in the run
            ctx.sync()
            first_step = time.perf_counter() - start
    ctx.sync()
    if not on_cpu:
        state = torch.cuda.memory_allocated(ctx.device) - base
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with record_function(_STEP_MARK):
        train_step(model, optim, ctx.batches[2])
        ctx.sync()
    if prof is not None:
        prof.stop()
        _set_cpu_allocator_accounting(False)
        state, peak = _memory_from_profile(prof, process_wide)
    else:
        peak = torch.cuda.max_memory_allocated(ctx.device) - base
    read_counts = attach_counter(impl, model)
    train_step(model, optim, ctx.batches[3])
    ctx.sync()
    counts = read_counts()
    return {"state_bytes": state, "peak_bytes": peak, "first_step_s": first_step, **counts}


def time_interleaved(
    ctx: RankContext,
) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Train every implementation; returns per-impl step times (s) and global losses.

    A step's time is ``[total, forward, backward, optimizer]``: forward includes the loss,
    optimizer is ``step()`` plus ``zero_grad()``.

    Warm-up steps (untimed) first, then rounds of ``round_steps`` steps per implementation in
    rotating order. Every implementation trains on global batch k at its k-th step. A barrier
    before each step lines the ranks up, so a step's time is its own, not the previous one's.
    """
    opts = ctx.opts
    runs = {impl: build(impl, ctx) for impl in opts.impls}
    times: dict[str, list[list[float]]] = {impl: [] for impl in opts.impls}
    losses: dict[str, list[Tensor]] = {impl: [] for impl in opts.impls}

    def one_step(impl: str, timed: bool) -> None:
        model, optim = runs[impl]
        tokens = ctx.batches[len(losses[impl])]
        marks: list[float] = []

        def mark() -> None:
            ctx.sync()  # on GPU: a phase ends when its kernels do (costs a sync, not a copy)
            marks.append(time.perf_counter())

        dist.barrier()
        t0 = time.perf_counter()
        loss = train_step(model, optim, tokens, mark)
        ctx.sync()
        t3 = time.perf_counter()
        losses[impl].append(loss)
        if timed:
            t1, t2 = marks
            times[impl].append([t3 - t0, t1 - t0, t2 - t1, t3 - t2])

    for _ in range(opts.warmup):
        for impl in opts.impls:
            one_step(impl, timed=False)
    n_rounds = math.ceil(opts.steps / opts.round_steps)
    for r in range(n_rounds):
        order = opts.impls[r % len(opts.impls) :] + opts.impls[: r % len(opts.impls)]
        for impl in order:
            for _ in range(min(opts.round_steps, opts.steps - len(times[impl]))):
                one_step(impl, timed=True)
    global_losses = {}
    for impl in opts.impls:
        stacked = torch.stack(losses[impl]).double()
        dist.all_reduce(stacked)  # mean of the ranks' means = the global batch's mean loss
        global_losses[impl] = (stacked / opts.world).tolist()
    return times, global_losses


def own_mesh(mesh: DeviceMesh, impl: str) -> DeviceMesh:
    """``mesh``'s ranks and process group under a dim name of ``impl``'s own.

    Several sharded models in one process share DTensor's sharding-propagation cache, which
    finds a later model's parameter specs equal to an earlier model's and compares them in
    Python at every hit (``DTensorSpec.__eq__``): the model built second paid about 3% more
    Python calls in ``optimizer.step()`` (AdamW on the 48-block model, torch 2.13), whichever
    implementation it was. Meshes that differ in name make the specs unequal, so each
    implementation meets only its own cache entries, as in a job that trains one model.
    """
    name = "dp_" + impl.replace("-", "_")
    return init_device_mesh(mesh.device_type, tuple(mesh.shape), mesh_dim_names=(name,))


def init_rank(
    rank: int, world: int, device_type: str, backend: str, port: int, timeout: timedelta
) -> Distributed:
    """A spawned rank's setup: one intra-op thread, torchrun's environment, the process group.

    ``init_distributed`` joins and picks the device, as under torchrun: one GPU per rank with
    NCCL (``--device cuda``), the CPU with gloo (``--device cpu``). Only ranks sharing GPUs
    (``--device cuda --backend gloo``, round robin) are set up here: one device per local rank
    is all ``init_distributed`` makes.
    """
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)
    os.environ.update(worker_environment(rank, world, port))  # rank 0 hosts the store
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device_type == "cpu":
        return init_distributed(backend="gloo", timeout=timeout)
    if backend != "gloo":  # "auto": the device's default backend
        return init_distributed(backend=None if backend == "auto" else backend, timeout=timeout)
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, timeout=timeout)  # gloo with CUDA tensors: ranks share GPUs
    mesh = init_device_mesh(device.type, (world,))
    return Distributed(rank, world, rank, backend, device, mesh)


def _rank_main(rank: int, opts: RunOptions, port: int, out_path: str) -> None:
    job = init_rank(rank, opts.world, opts.device, opts.backend, port, timedelta(minutes=10))
    device, mesh = job.device, job.mesh
    try:
        n_batches = max(opts.warmup + opts.steps, 4)
        batch = opts.model.batch
        mine = [
            b[rank * batch : (rank + 1) * batch].to(device)
            for b in make_batches(opts.model, opts.world, n_batches, opts.seed)
        ]
        ctx = RankContext(opts, rank, device, mesh, mine)
        if device.type == "cuda":
            _warm_device(ctx)
        t0 = time.perf_counter()
        measured = {impl: measure_instance(impl, ctx) for impl in opts.impls}
        t1 = time.perf_counter()
        times, losses = time_interleaved(ctx)
        phases = {"measure_s": t1 - t0, "train_s": time.perf_counter() - t1}
        result = {
            "rank": rank,
            "measured": measured,
            "times": times,
            "losses": losses,
            "phases": phases,
        }
        gathered: list[Any] = [None] * opts.world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out_path).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()
    # Done, and the results are on disk. Leave without the interpreter's finalization (see
    # fully_shard.demo.leave_rank): about one exit in three, after a run this short (--size
    # tiny), aborted there with "terminate called without an active exception". An exception
    # above still exits through spawn's error path.
    leave_rank()


# ---------------------------------------------------------------------------------------------
# The parent: reference run, theory, summary
# ---------------------------------------------------------------------------------------------


def reference_losses(opts: RunOptions) -> list[float]:
    """An unsharded replica trained in this process on the same global batches.

    Each global batch is run as W micro-batches of the per-rank size, each loss scaled by
    ``1 / W`` before backward, and one optimizer step: the same mean over the global batch,
    with the same matrix shapes as on the ranks. A single ``(W * batch)``-row forward would
    round differently inside the matmuls, and AdamW, which moves every weight by about ``lr``
    whatever its gradient's size, amplifies those last-bit differences over tens of steps.
    What is left to differ is the order in which the ranks' gradients are summed.
    On ``--device cuda`` it runs on the first GPU, with the ranks' kernels.
    """
    device = torch.device("cuda", 0) if opts.device == "cuda" else torch.device("cpu")
    torch.manual_seed(opts.seed)
    model = Llama(opts.model).to(device)
    optim = torch.optim.AdamW(
        model.parameters(), lr=opts.lr, foreach=True if opts.foreach else None
    )
    b = opts.model.batch
    losses = []
    for batch in make_batches(opts.model, opts.world, opts.warmup + opts.steps, opts.seed):
        tokens = batch.to(device)
        total = 0.0
        for r in range(opts.world):
            micro = tokens[r * b : (r + 1) * b]
            logits = model(micro[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), micro[:, 1:].flatten())
            (loss / opts.world).backward()  # type: ignore[no-untyped-call]
            total += loss.item()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(total / opts.world)
    return losses


def zero3_theory(
    cfg: ModelConfig,
    world: int,
    wrap: str = "blocks",
    quantization: fs.QuantizationPolicy | None = None,
) -> dict[str, Any]:
    """ZeRO-3 bytes per step per rank with dim-0 padding, from the parameter shapes alone.

    A group's padded shard is ``sum(ceil(d0 / W) * numel / d0 * 4)`` bytes over its params.
    all-gather = sum over groups of padded shard x gathers (2: blocks, resharded after forward
    and gathered again for backward; 1: the root, and with ``wrap="head"`` the
    ``[norm, output]`` group, kept from forward to backward);
    reduce-scatter input = sum over groups of ``W * padded shard``.

    ``all_gather_int8``: the all-gather under ``quantization``: a parameter it quantizes sends
    its ``n = ceil(d0 / W) * numel / d0`` elements as int8 plus ``4 * ceil(n / block_size)``
    bytes of fp32 scales instead of ``4 n`` (the reduce-scatter is the same).

    Example:
        >>> zero3_theory(SIZES["tiny"], 2, "head")["groups"]
        4
    """
    policy = fs.QuantizationPolicy() if quantization is None else quantization
    model = Llama(cfg)
    groups = [(list(block.parameters()), 2) for block in model.layers]
    sends = world > 1  # one rank: ours and torch's FSDP2 issue no collective at all
    if wrap == "head":
        groups.append(([*model.norm.parameters(), *model.output.parameters()], 1))
    owned = {id(p) for params, _ in groups for p in params}
    groups.append(([p for p in model.parameters() if id(p) not in owned], 1))
    ag = rs = ag_int8 = 0
    for params, gathers in groups:
        for p in params:
            numel = math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0])
            shard = numel * p.element_size() * sends
            ag += shard * gathers
            rs += world * shard
            if policy.quantizes(p.shape, p.dtype, numel):
                ag_int8 += int8_gather_nbytes(numel, policy.block_size) * gathers * sends
            else:
                ag_int8 += shard * gathers
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "all_gather": ag,
        "all_gather_int8": ag_int8,
        "reduce_scatter": rs,
        "groups": len(groups),
        "all_gather_calls": sum(g for _, g in groups),
        "reduce_scatter_calls": len(groups),
        "params": n_params,
        "param_bytes": n_params * 4,
    }


def _over(measured: int, theory: int) -> float:
    """measured / theory; 1.0 when both are 0 (one rank: nothing due, nothing sent)."""
    if theory == 0:
        return 1.0 if measured == 0 else math.inf
    return measured / theory


def ring_wire_bytes(world: int, by_op: dict[str, int]) -> int:
    """What a ring algorithm (NCCL's) sends per rank for these input sizes.

    all-gather of a shard: ``(W - 1) * shard``; reduce-scatter of an input:
    ``(W - 1) / W * input``; all-reduce: ``2 (W - 1) / W * tensor``.
    """
    w = world
    return int(
        (w - 1) * by_op.get("all_gather", 0)
        + (w - 1) / w * by_op.get("reduce_scatter", 0)
        + 2 * (w - 1) / w * by_op.get("all_reduce", 0)
    )


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(opts: RunOptions, ranks: list[dict[str, Any]], ref: list[float]) -> dict[str, Any]:
    """Fold the ranks' raw numbers into one record per implementation."""
    theory = zero3_theory(opts.model, opts.world, opts.wrap, opts.quantization)
    impls: dict[str, Any] = {}
    for impl in opts.impls:
        # The slowest rank's step; its phases are that rank's phases.
        per_step = [
            max((r["times"][impl][i] for r in ranks), key=lambda t: t[0]) for i in range(opts.steps)
        ]
        ms = [t[0] * 1e3 for t in per_step]
        phase_ms = {
            name: statistics.median(t[k] * 1e3 for t in per_step)
            for k, name in enumerate(PHASES, start=1)
        }
        measured = [r["measured"][impl] for r in ranks]
        losses = ranks[0]["losses"][impl]
        comm_bytes = measured[0]["bytes"]
        rec: dict[str, Any] = {
            "step_ms": {
                "median": statistics.median(ms),
                "p25": _percentile(ms, 0.25),
                "p75": _percentile(ms, 0.75),
                "p10": _percentile(ms, 0.10),
                "p90": _percentile(ms, 0.90),
                "min": min(ms),
                "all": ms,
            },
            "phase_ms_median": phase_ms,
            "first_step_s": max(r["measured"][impl]["first_step_s"] for r in ranks),
            "peak_bytes_per_rank": [m["peak_bytes"] for m in measured],
            "state_bytes_per_rank": [m["state_bytes"] for m in measured],
            "comm_bytes_per_step": comm_bytes,
            "comm_calls_per_step": measured[0]["calls"],
            "comm_bytes_per_rank_equal": all(m["bytes"] == comm_bytes for m in measured),
            "ring_wire_bytes_per_step": ring_wire_bytes(opts.world, comm_bytes),
            "final_loss": losses[-1],
            "final_loss_rel_diff_vs_ref": (losses[-1] - ref[-1]) / ref[-1],
            "max_abs_loss_diff_vs_ref": max(abs(a - b) for a, b in zip(losses, ref, strict=True)),
            "losses": losses,
        }
        if impl in ZERO3 and impl not in COMPILED and impl != "ours-zero2":  # ZeRO-3's bytes
            ag_theory = theory["all_gather_int8" if impl == "ours-int8" else "all_gather"]
            rec["measured_over_theory"] = {
                "all_gather": _over(comm_bytes.get("all_gather", 0), ag_theory),
                "reduce_scatter": _over(
                    comm_bytes.get("reduce_scatter", 0), theory["reduce_scatter"]
                ),
            }
        impls[impl] = rec
    ratios: dict[str, Any] = {}
    for mine in OURS:
        if mine not in impls:
            continue
        ours = impls[mine]
        others = ("fsdp2", "ddp", "plain") if mine == "ours" else ("ours", "fsdp2", "ddp")
        if mine.startswith("ours-graph"):
            others = ("ours", "fsdp2-compiled", "ddp-compiled")
        for other in others:
            if other in impls:
                ratios[f"{mine}/{other}"] = {
                    "step_time_median": ours["step_ms"]["median"]
                    / impls[other]["step_ms"]["median"],
                    "peak_memory_max_rank": max(ours["peak_bytes_per_rank"])
                    / max(impls[other]["peak_bytes_per_rank"]),
                }
    pairs = [
        ("ours-graph", "ours"),
        ("ours-graph", "fsdp2-compiled"),
        ("ours-graph", "ddp-compiled"),
        ("ours-graph-reorder", "ours-graph"),
    ]
    for mine, other in pairs:
        if mine in impls and other in impls and f"{mine}/{other}" not in ratios:
            ratios[f"{mine}/{other}"] = {
                "step_time_median": impls[mine]["step_ms"]["median"]
                / impls[other]["step_ms"]["median"],
                "peak_memory_max_rank": max(impls[mine]["peak_bytes_per_rank"])
                / max(impls[other]["peak_bytes_per_rank"]),
            }
    return {
        "config": {**asdict(opts), "impls": list(opts.impls)},
        "machine": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "backend": opts.backend,
            "threads_per_rank": 1,
        },
        "theory_zero3_per_rank": theory,
        "reference_final_loss": ref[-1],
        "reference_losses": ref,
        "impls": impls,
        "ratios": ratios,
    }


def _mib(b: float) -> str:
    return f"{b / MIB:.2f}"


def print_report(s: dict[str, Any]) -> None:
    cfg, theory = s["config"], s["theory_zero3_per_rank"]
    w = cfg["world"]
    m = cfg["model"]
    print(
        f"\n== bench_train: size={cfg['size']}  W={w}  device={cfg['device']} "
        f"({s['machine']['backend']}, 1 thread/rank, {s['machine']['cpus']} CPUs seen)  "
        f"torch {s['machine']['torch']}"
    )
    print(
        f"   model: {theory['params'] / 1e6:.2f} M params ({_mib(theory['param_bytes'])} MiB fp32)"
        f", vocab {m['vocab']}, dim {m['dim']}, {m['n_layers']} blocks, seq {m['seq_len']}, "
        f"batch {m['batch']}/rank; {cfg['warmup']} warm-up + {cfg['steps']} timed steps "
        f"(rounds of {cfg['round_steps']}), AdamW lr {cfg['lr']}, wrap {cfg['wrap']}"
        f"{' foreach' if cfg['foreach'] else ''}"
    )
    header = (
        f"{'implementation':<20}{'step ms: median [p25-p75]':>28}{'peak MiB/rank':>22}"
        f"{'state MiB':>11}{'AG MiB':>9}{'RS MiB':>9}{'AR MiB':>9}{'wire MiB':>10}"
        f"{'final loss':>12}{'max|dloss|':>12}"
    )
    print(header)
    print("-" * len(header))
    for impl, r in s["impls"].items():
        t = r["step_ms"]
        b = r["comm_bytes_per_step"]
        peaks = "/".join(f"{p / MIB:.1f}" for p in r["peak_bytes_per_rank"])
        step = f"{t['median']:.1f} [{t['p25']:.1f}-{t['p75']:.1f}]"
        print(
            f"{LABELS[impl]:<20}{step:>28}"
            f"{peaks:>22}{_mib(max(r['state_bytes_per_rank'])):>11}"
            f"{_mib(b.get('all_gather', 0)):>9}{_mib(b.get('reduce_scatter', 0)):>9}"
            f"{_mib(b.get('all_reduce', 0)):>9}{_mib(r['ring_wire_bytes_per_step']):>10}"
            f"{r['final_loss']:>12.4f}{r['max_abs_loss_diff_vs_ref']:>12.2e}"
        )
    print(
        f"{'reference (1 proc)':<20}{'':>28}{'':>22}{'':>11}{'':>9}{'':>9}{'':>9}{'':>10}"
        f"{s['reference_final_loss']:>12.4f}"
    )
    print(
        f"ZeRO-3 theory per rank per step: all-gather {_mib(theory['all_gather'])} MiB "
        f"({theory['all_gather_calls']} calls; int8 blocks of {cfg['block_size']}: "
        f"{_mib(theory['all_gather_int8'])} MiB), reduce-scatter input "
        f"{_mib(theory['reduce_scatter'])} MiB ({theory['reduce_scatter_calls']} calls), "
        f"{theory['groups']} groups"
    )
    for impl in ZERO3:
        r = s["impls"].get(impl)
        if r is not None and "measured_over_theory" in r:
            ratio = r["measured_over_theory"]
            calls = r["comm_calls_per_step"]
            print(
                f"  {LABELS[impl]}: measured/theory all-gather {ratio['all_gather']:.3f} "
                f"({calls.get('all_gather', 0)} calls), reduce-scatter "
                f"{ratio['reduce_scatter']:.3f} ({calls.get('reduce_scatter', 0)} calls)"
            )
    print(
        "median ms per phase (slowest rank's step): "
        + ", ".join(
            f"{LABELS[impl]} " + " / ".join(f"{r['phase_ms_median'][p]:.1f}" for p in PHASES)
            for impl, r in s["impls"].items()
        )
        + "  (forward / backward / optimizer)"
    )
    compiled = [impl for impl in s["impls"] if impl in COMPILED]
    if compiled:
        print(
            f"first step (compilation, {cfg['compile_backend']}), slowest rank: "
            + ", ".join(f"{LABELS[i]} {s['impls'][i]['first_step_s']:.1f} s" for i in compiled)
            + "; their collectives run inside compiled code: bytes not counted"
        )
    for name, r in s["ratios"].items():
        print(
            f"ratio {name}: step time (median) {r['step_time_median']:.2f}x, "
            f"peak memory (max rank) {r['peak_memory_max_rank']:.2f}x"
        )
    int8 = s["impls"].get("ours-int8")
    if int8 is not None:
        print(
            f"ours-int8 final loss vs the unquantized reference: "
            f"{100 * int8['final_loss_rel_diff_vs_ref']:+.2f}%"
        )
    if "ours-nogather" in s["impls"]:
        print(
            "ours-nogather: every all-gather a local copy, no bytes moved (a floor for the step "
            "time; its losses are wrong by design)"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_args(argv: list[str] | None) -> tuple[RunOptions, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument(
        "--round-steps", type=int, default=5, help="steps per implementation per round"
    )
    parser.add_argument("--nproc", type=int, default=2, help="world size: local ranks to spawn")
    parser.add_argument(
        "--impls",
        default=",".join(DEFAULT_IMPLS),
        help=f"comma-separated subset of {','.join(IMPLS)} (default: all but ours-nogather)",
    )
    parser.add_argument(
        "--block-size", type=int, default=256, help="ours-int8: elements per fp32 scale"
    )
    parser.add_argument(
        "--wrap",
        choices=WRAPS,
        default="blocks",
        help="ZeRO-3 groups: every block then the root (default), or also [norm, output]",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: NCCL on cuda (a GPU per rank), gloo on cpu; gloo on cuda lets ranks share "
        "a GPU and stages every collective through host memory",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of ours-graph, fsdp2-compiled, ddp-compiled (default inductor)",
    )
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="ours-buckets, ours-zero2: set_bucket_cap_mb, MiB per bucket (default 25, DDP's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--foreach",
        action="store_true",
        help="AdamW(foreach=True) for every implementation (torch's default on CPU: per tensor)",
    )
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    impls = tuple(x.strip() for x in args.impls.split(",") if x.strip())
    unknown = [x for x in impls if x not in IMPLS]
    if unknown or not impls or len(set(impls)) != len(impls):
        parser.error(f"--impls takes distinct names from {','.join(IMPLS)}, got {args.impls!r}")
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    steps = DEFAULT_STEPS[args.size] if args.steps is None else args.steps
    if args.block_size < 1:
        parser.error("--block-size must be >= 1")
    if not args.bucket_cap_mb > 0:
        parser.error("--bucket-cap-mb must be > 0")
    if steps < 1 or args.warmup < 0 or args.round_steps < 1:
        parser.error("--steps and --round-steps must be >= 1, --warmup >= 0")
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cpu" and backend == "nccl":
        parser.error("--backend nccl needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if backend == "nccl" and torch.cuda.device_count() < args.nproc:
        parser.error(
            f"NCCL needs a GPU per rank: {args.nproc} ranks, {torch.cuda.device_count()} GPU(s); "
            "--backend gloo lets ranks share a GPU"
        )
    opts = RunOptions(
        size=args.size,
        model=SIZES[args.size],
        world=args.nproc,
        steps=steps,
        warmup=args.warmup,
        round_steps=args.round_steps,
        impls=impls,
        wrap=args.wrap,
        device=args.device,
        backend=backend,
        seed=args.seed,
        lr=args.lr,
        foreach=args.foreach,
        block_size=args.block_size,
        compile_backend=args.compile_backend,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    return opts, args.json_out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    opts, json_out = parse_args(argv)
    # Kineto prints a line per profiler start/stop on every rank; the ranks inherit this.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        spawn(_rank_main, args=(opts, _free_port(), out), nprocs=opts.world)  # type: ignore[no-untyped-call]
        ranks = json.loads(Path(out).read_text())
    torch.set_num_threads(1)
    ref = reference_losses(opts)
    summary = summarize(opts, ranks, ref)
    summary["wall_s"] = time.perf_counter() - t0
    summary["rank0_phases_s"] = ranks[0]["phases"]
    print_report(summary)
    phases = summary["rank0_phases_s"]
    print(
        f"(wall time {summary['wall_s']:.0f} s: memory/bytes {phases['measure_s']:.0f} s, "
        f"interleaved training {phases['train_s']:.0f} s)"
    )
    line = json.dumps(summary, separators=(",", ":"))
    if json_out is not None:
        json_out.write_text(line + "\n")
    print(line)
    return summary


if __name__ == "__main__":
    main()
