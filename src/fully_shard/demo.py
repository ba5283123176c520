"""``python -m fully_shard.demo``: train a small Llama-style model on Shakespeare, sharded.

The demo launches its own ranks on this machine (``--nproc``, default 2; gloo on CPU, NCCL when
there is a GPU per rank), shards every transformer block and then the root with
:func:`~fully_shard.fully_shard`, and trains a character-level language model on the bundled
text (a selection of Shakespeare's Sonnets, public domain) with AdamW. Rank 0 shows a progress
bar (tqdm: ``pip install -e '.[demo]'`` from a clone; plain lines without it) and ends with a
summary: the loss from start to end, each rank's memory sharded vs unsharded, and the bytes
every collective moved in one step against the formula for them (see
:func:`expected_comm_bytes`).
``--trace DIR`` also writes the last step's timeline of every rank (``DIR/trace.json``, for
ui.perfetto.dev) and its memory timeline (``DIR/memory.png``; it needs matplotlib:
``pip install -e '.[plot]'``).

Example:
    $ python -m fully_shard.demo                       # ~1 minute on 2 CPU cores
    $ python -m fully_shard.demo --nproc 4 --size tiny --steps 50 --trace trace/
    $ python -m fully_shard.demo --mixed-precision --no-reshard
    $ python -m fully_shard.demo --quantize-all-gather   # int8 all-gathers (QuantizationPolicy)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not in __all__
from torch.multiprocessing.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    start_processes,
)

from . import trace
from .api import fully_shard
from .collectives import CountingComm
from .launch import Distributed, init_distributed, worker_environment
from .layout import split_rows
from .policies import MixedPrecisionPolicy, QuantizationPolicy
from .quantize import SCALE_BYTES, int8_gather_nbytes, n_blocks

TEXT_RESOURCE = "data/sonnets.txt"
TEXT_TITLE = "Shakespeare's Sonnets (public domain, bundled)"


def load_text() -> str:
    """The bundled training text: a selection of Shakespeare's Sonnets (about 29 KB).

    Example:
        >>> load_text().startswith("THE SONNETS")
        True
    """
    return resources.files("fully_shard").joinpath(TEXT_RESOURCE).read_text(encoding="utf-8")


# -- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the demo's Llama-style model.

    Attributes:
        dim: model width.
        n_layers: transformer blocks; each becomes one ``fully_shard`` group.
        n_heads: query heads (``dim // n_heads`` channels each).
        n_kv_heads: key/value heads (grouped-query attention).
        seq_len: tokens (characters) per training sequence.
        batch_per_rank: sequences per rank per step.

    Example:
        >>> SIZES["small"].dim
        128
    """

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    seq_len: int
    batch_per_rank: int

    @property
    def ffn_hidden(self) -> int:
        """The SwiGLU width: about 8/3 of ``dim``, a multiple of 8 (as in Llama)."""
        return 8 * math.ceil(8 * self.dim / 3 / 8)


SIZES: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32, batch_per_rank=8),
    "small": ModelConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=64, batch_per_rank=16
    ),
    "medium": ModelConfig(
        dim=256, n_layers=8, n_heads=8, n_kv_heads=4, seq_len=128, batch_per_rank=16
    ),
}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (b, s, heads, hd): rotate the (first half, second half) channel pairs by each position
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(nn.Module):
    """Pre-norm Llama block: RMSNorm, rotary grouped-query causal attention, RMSNorm, SwiGLU.

    Example:
        >>> block = Block(SIZES["tiny"])
        >>> cos, sin = rotary_tables(8, 16)
        >>> block(torch.zeros(2, 8, 64), cos, sin).shape
        torch.Size([2, 8, 64])
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        head_dim = cfg.dim // cfg.n_heads
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * head_dim, cfg.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.n_heads, -1)  # (b, s, heads, hd)
        k, v = self.wkv(h).view(b, s, 2, self.n_kv_heads, -1).unbind(2)  # (b, s, kv, hd) each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.n_heads != self.n_kv_heads,
        )  # (b, heads, s, hd)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        out: torch.Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return out


def rotary_tables(seq_len: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, ``(seq_len, 1, head_dim // 2)`` each.

    Example:
        >>> cos, sin = rotary_tables(8, 16)
        >>> cos.shape
        torch.Size([8, 1, 8])
    """
    half = head_dim // 2
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)[:, None, :]
    return angles.cos(), angles.sin()


class LlamaLM(nn.Module):
    """Character-level Llama-style LM: embedding, ``n_layers`` blocks, RMSNorm, untied head.

    Example:
        >>> model = LlamaLM(vocab=40, cfg=SIZES["tiny"])
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 40])
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, vocab: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.dim // cfg.n_heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)  # (b, s, dim)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.head(self.norm(x))  # (b, s, vocab)
        return logits


# -- what the summary compares against -----------------------------------------------------------


@dataclass(frozen=True)
class CommBytes:
    """Bytes one rank puts into the collectives of one training step.

    Attributes:
        all_gather: every all-gather input, in bytes.
        reduce_scatter: every reduce-scatter input, in bytes.
        int8_values: of ``all_gather``, the int8 values of quantized parameters.
        int8_scales: of ``all_gather``, their fp32 block scales.

    Example:
        >>> CommBytes(all_gather=36, reduce_scatter=72).total
        108
    """

    all_gather: int
    reduce_scatter: int
    int8_values: int = 0
    int8_scales: int = 0

    @property
    def total(self) -> int:
        """All-gather plus reduce-scatter bytes."""
        return self.all_gather + self.reduce_scatter


def expected_comm_bytes(
    groups: Sequence[tuple[Iterable[torch.Size], int]],
    world: int,
    param_bytes: int,
    reduce_bytes: int,
    quantization: QuantizationPolicy | None = None,
) -> CommBytes:
    """The formula the demo checks its measured bytes against.

    Each group is ``(parameter shapes, gathers per step)``. With ``c_p = ceil(d0_p / W)`` rows
    per rank of a parameter with ``d0_p`` rows of ``r_p`` elements, one rank sends, per step::

        all-gather     = sum_groups  n_g * sum_p c_p * r_p * param_bytes
        reduce-scatter = sum_groups        sum_p W * c_p * r_p * reduce_bytes

    (its padded shard into every all-gather; the whole padded gradient into the
    reduce-scatter). ``n_g`` is 2 for a block that reshards after forward (gathered again for
    backward) and 1 for the root, or for every group with ``--no-reshard``. On one rank
    (``W = 1``) nothing is sent: the engine issues no collective.

    With a ``quantization`` policy, a parameter it quantizes (asked for an fp32 master, the
    demo's) sends ``n_p = c_p * r_p`` int8 values plus ``4 * ceil(n_p / block_size)`` bytes
    of fp32 scales into each all-gather instead of ``n_p * param_bytes``; the reduce-scatter
    is unchanged.

    Example:
        >>> b = expected_comm_bytes([([torch.Size([5, 3])], 1)], world=2, param_bytes=4,
        ...                         reduce_bytes=4)
        >>> (b.all_gather, b.reduce_scatter)  # ceil(5/2) * 3 = 9 elements per rank
        (36, 72)
        >>> q = QuantizationPolicy(all_gather="int8", block_size=4)
        >>> expected_comm_bytes([([torch.Size([5, 3])], 1)], 2, 4, 4, q).all_gather  # 9 + 4 * 3
        21
    """
    policy = QuantizationPolicy() if quantization is None else quantization
    if world == 1:  # one rank: every collective is its own input, none is issued
        return CommBytes(0, 0, 0, 0)
    ag = rs = values = scales = 0
    for shapes, gathers in groups:
        for s in shapes:
            shard = split_rows(s[0], world).chunk * math.prod(s[1:])
            rs += world * shard * reduce_bytes
            if policy.quantizes(s, torch.float32, shard):
                ag += gathers * int8_gather_nbytes(shard, policy.block_size)
                values += gathers * shard
                scales += gathers * SCALE_BYTES * n_blocks(shard, policy.block_size)
            else:
                ag += gathers * shard * param_bytes
    return CommBytes(ag, rs, values, scales)


def _local_bytes(tensors: Iterable[Any]) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _training_state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> int:
    params = list(model.parameters())
    grads = [p.grad for p in params]
    states = [v for s in optim.state.values() for v in s.values()]
    return _local_bytes(params) + _local_bytes(grads) + _local_bytes(states)


# -- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    """One run of the demo (the command line, parsed).

    Attributes:
        size: a key of :data:`SIZES`.
        nproc: number of ranks.
        steps: AdamW steps.
        lr: peak learning rate (linear warm-up, then cosine decay to a tenth).
        mixed_precision: gather and compute in bfloat16, reduce gradients in float32.
        quantize_all_gather: all-gather the weights block-quantized to int8
            (``QuantizationPolicy(all_gather="int8", block_size=256)``).
        reshard: free each block's parameters after its forward (and gather them again for
            backward) rather than keep them until backward.
        trace_dir: where to write the last step's trace and memory plot, or ``None``.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank).
        sample_chars: characters of text to generate at the end (0: none).
        seed: the initial weights come from ``torch.manual_seed(seed)``, the batches from a
            generator seeded ``1234 + seed`` (the same on every rank).
        timeout_s: the whole run is stopped after this many seconds.

    Example:
        >>> DemoConfig(size="tiny", steps=5).model.n_layers
        2
    """

    size: str = "small"
    nproc: int = 2
    steps: int = 200
    lr: float = 3e-3
    mixed_precision: bool = False
    quantize_all_gather: bool = False
    reshard: bool = True
    trace_dir: Path | None = None
    device: str = "cpu"
    sample_chars: int = 120
    seed: int = 0
    timeout_s: float = 900.0

    @property
    def model(self) -> ModelConfig:
        """The model shape of :attr:`size`."""
        return SIZES[self.size]

    @property
    def quantization(self) -> QuantizationPolicy:
        """The quantization policy of :attr:`quantize_all_gather` (off: the default one)."""
        if self.quantize_all_gather:
            return QuantizationPolicy(all_gather="int8", block_size=256)
        return QuantizationPolicy()


def _lr_factor(step: int, steps: int) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def _sparkline(values: Sequence[float], width: int = 40) -> str:
    if not values:
        return ""
    bars = "▁▂▃▄▅▆▇█"
    n = min(width, len(values))
    # the mean of each of n equal slices of the curve
    means = [
        sum(chunk) / len(chunk)
        for i in range(n)
        if (chunk := values[i * len(values) // n : (i + 1) * len(values) // n])
    ]
    lo, hi = min(means), max(means)
    span = (hi - lo) or 1.0
    return "".join(bars[min(7, int((v - lo) / span * 8))] for v in means)


class _Progress:
    """tqdm on rank 0 when installed; otherwise a plain line every tenth of the run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.bar: Any = None
        if enabled:
            try:
                # untyped, and absent where only the core is installed (the typecheck run)
                from tqdm import tqdm  # type: ignore[import-untyped,import-not-found,unused-ignore]
            except ImportError:
                print("(pip install tqdm for a progress bar)", flush=True)
            else:
                # No monitor thread (tqdm starts one per process to fix stalled bars): a
                # thread is one more thing alive at interpreter exit, where the demo aborted.
                # A subclass, so tqdm's own class attribute stays as it was.
                bar = type("_Bar", (tqdm,), {"monitor_interval": 0})
                self.bar = bar(total=total, desc="training", unit="step", file=sys.stdout)

    def update(self, step: int, loss: float, step_ms: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", step=f"{step_ms:.0f}ms", refresh=False)
            self.bar.update(1)
        elif step == 0 or (step + 1) % max(1, self.total // 10) == 0 or step + 1 == self.total:
            print(
                f"step {step + 1:5d}/{self.total}  loss {loss:.4f}  {step_ms:7.1f} ms", flush=True
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt_bytes(n: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n:.0f} B"


def _worker(rank: int, cfg: DemoConfig, port: int) -> None:
    world = cfg.nproc
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    # What torchrun gives each worker, so init_distributed joins and picks the device as it
    # does under torchrun. The parent hosts the rendezvous store, as torchrun's agent does:
    # TORCHELASTIC_USE_AGENT_STORE makes every rank connect to it as a client.
    os.environ.update(worker_environment(rank, world, port, agent_store=True))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo on the loopback
    job = init_distributed(
        backend="gloo" if cfg.device == "cpu" else None, timeout=timedelta(seconds=cfg.timeout_s)
    )
    try:
        train(job, cfg)
    except BaseException:
        dist.destroy_process_group()  # no barrier: the other ranks may be gone
        raise
    # Leave together: rank 0 prints the summary after the others have returned, and no rank
    # tears its connections down while another still runs.
    job.shutdown()
    leave_rank()


def leave_rank() -> NoReturn:
    """End a spawned rank whose work is done and whose process group is destroyed: flush the
    output and exit with status 0, skipping the interpreter's finalization.

    Why: torch's DTensor caches (sharding propagation, redistribution plans) keep every
    ``DeviceMesh`` they met, and with it its process groups, alive after
    ``destroy_process_group()``, so gloo's worker threads run until the interpreter
    finalizes. A worker that drops a finished collective's tensor then has to take the GIL to
    free the tensor's Python object, and Python (3.11) ends such a thread with
    ``pthread_exit`` inside a C++ frame: ``std::terminate``, "terminate called without an
    active exception", SIGABRT after all the work was done. c10's fatal-signal stacks caught
    it on torch 2.13 (``ProcessGroupGloo::runLoop`` -> ``TensorImpl::decref_pyobject`` ->
    ``pthread_exit``). It is torch's, about one exit in 20-40 on a loaded machine, with this
    engine and with torch's own FSDP2 (both hold DTensors); pytorch/pytorch#190489 shows the
    same abort when ``destroy_process_group`` is never called, and #179291 (an ``atexit``
    destroy, abandoned) tried to fix that case, which would not cover this one.

    Example:
        >>> leave_rank()  # doctest: +SKIP  (the last line of a spawned rank's function)
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(job: Distributed, cfg: DemoConfig) -> list[float]:
    """Train on ``job``'s mesh and device, print the summary on rank 0.

    Returns the loss of every step (the mean over the global batch), the same on every rank.

    Example:
        >>> cfg = DemoConfig(steps=5, quantize_all_gather=True)
        >>> losses = train(init_distributed(), cfg)  # doctest: +SKIP
    """
    mc = cfg.model
    rank, world, device, mesh = job.rank, job.world_size, job.device, job.mesh
    text = load_text()
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(c) for c in text], device=device)
    torch.manual_seed(cfg.seed)  # the same initial model on every rank
    model = LlamaLM(len(vocab), mc).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.mixed_precision
        else MixedPrecisionPolicy()
    )
    param_bytes = 2 if cfg.mixed_precision else 4
    quant = cfg.quantization
    expected = expected_comm_bytes(
        [([p.shape for p in block.parameters()], 2 if cfg.reshard else 1) for block in model.layers]
        + [([p.shape for n, p in model.named_parameters() if not n.startswith("layers.")], 1)],
        world,
        param_bytes=param_bytes,
        reduce_bytes=4,
        quantization=quant,
    )
    # params + grads + the two AdamW moments, fp32, as an unsharded replica (DDP) holds them
    replica_state_bytes = 4 * 4 * n_params

    for block in model.layers:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=cfg.reshard,
            mp_policy=mp,
            quantization_policy=quant,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp, quantization_policy=quant)
    comm = CountingComm()
    model.set_comm(comm)  # type: ignore[operator]  # an FSDPModule method after fully_shard
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: _lr_factor(s, cfg.steps))

    if rank == 0:
        print(
            f"fully_shard demo: {world} rank(s), {job.backend} on {device.type}; "
            f"Llama-style model {cfg.size!r}: {mc.n_layers} blocks, dim {mc.dim}, "
            f"{n_params / 1e6:.2f} M parameters, {mc.n_layers + 1} fully_shard groups\n"
            f"data: {TEXT_TITLE}, {len(text):,} characters, vocabulary {len(vocab)}; "
            f"sequences of {mc.seq_len}, global batch {world} x {mc.batch_per_rank}\n"
            f"options: reshard_after_forward={cfg.reshard}, "
            f"mixed precision={'bf16 params / fp32 reduce' if cfg.mixed_precision else 'off'}, "
            f"all-gather={'int8, blocks of 256' if cfg.quantize_all_gather else 'unquantized'}",
            flush=True,
        )
    progress = _Progress(cfg.steps, enabled=rank == 0)
    gen = torch.Generator().manual_seed(1234 + cfg.seed)  # the same global batch on every rank
    losses: list[float] = []
    step_ms: list[float] = []
    recorder: trace.Recorder | None = None
    state_bytes = 0
    t_start = time.perf_counter()
    for step in range(cfg.steps):
        starts = torch.randint(
            0, len(data) - mc.seq_len - 1, (world * mc.batch_per_rank,), generator=gen
        )
        mine = starts[rank * mc.batch_per_rank : (rank + 1) * mc.batch_per_rank].tolist()
        x = torch.stack([data[s : s + mc.seq_len] for s in mine])
        y = torch.stack([data[s + 1 : s + mc.seq_len + 1] for s in mine])
        last = step == cfg.steps - 1
        comm.reset()
        t0 = time.perf_counter()
        # The last step is recorded: for the summary's peak memory, and for --trace.
        with trace.record(model) if last else contextlib.nullcontext() as rec:
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch's stubs
            optim.step()
        if last:
            recorder = rec
            state_bytes = _training_state_bytes(model, optim)
        optim.zero_grad()
        sched.step()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        step_ms.append(elapsed_ms)
        progress.update(step, losses[-1], elapsed_ms)
    progress.close()
    train_s = time.perf_counter() - t_start
    measured = comm.bytes_by_op()

    sample = _generate(model, data[: mc.seq_len], vocab, cfg.sample_chars, rank)
    memory = torch.tensor([float(state_bytes)], device=device)
    per_rank = [torch.zeros_like(memory) for _ in range(world)]
    dist.all_gather(per_rank, memory)
    recordings = trace.gather(recorder) if recorder is not None else []
    if rank != 0:
        return losses

    tail = step_ms[-min(10, len(step_ms)) :]
    print(
        f"\nloss     {losses[0]:.3f} -> {losses[-1]:.3f} over {cfg.steps} steps  "
        f"{_sparkline(losses)}  (uniform guess: ln {len(vocab)} = {math.log(len(vocab)):.3f})\n"
        f"time     {train_s:.1f} s training, {sum(tail) / len(tail):.0f} ms/step "
        f"(mean of the last {len(tail)})"
    )
    print("memory per rank: parameters + gradients + AdamW moments (fp32)")
    for r, b in enumerate(per_rank):
        value = b.item()
        print(
            f"  rank {r}: {_fmt_bytes(value):>10} sharded   vs "
            f"{_fmt_bytes(replica_state_bytes):>10} unsharded replica "
            f"({value / replica_state_bytes:.0%})"
        )
    if recordings:
        peak = recordings[0].peak_unsharded_bytes()
        full = recordings[0].replica_bytes
        print(
            f"  unsharded parameters alive at once (peak of the last step, rank 0): "
            f"{_fmt_bytes(peak)} of {_fmt_bytes(full)} ({peak / full:.0%})"
        )
    gathers = (
        "2 per block (forward, and again for backward), 1 for the root"
        if cfg.reshard
        else "1 per group (kept gathered from forward to backward)"
    )
    if cfg.quantize_all_gather:
        ag_formula = (
            "sum over groups of n_g * (sum over its int8 params of (c * r + 4 * "
            f"ceil(c * r / {quant.block_size})) + sum over the others of c * r * "
            f"{param_bytes}) B\n"
            "      int8 params: 2-D with at least one block per rank; the others (norms, "
            "biases) are gathered unquantized\n"
            f"      of the theory: int8 values {expected.int8_values:,} B, fp32 scales "
            f"{expected.int8_scales:,} B, unquantized "
            f"{expected.all_gather - expected.int8_values - expected.int8_scales:,} B"
        )
    else:
        ag_formula = f"sum over groups of n_g * sum over its params of c * r * {param_bytes} B"
    print(
        "communication per step and rank (bytes this rank puts into each collective):\n"
        f"  all-gather      measured {measured.get('all_gather', 0):>12,} B   "
        f"theory {expected.all_gather:>12,} B\n"
        f"  reduce-scatter  measured {measured.get('reduce_scatter', 0):>12,} B   "
        f"theory {expected.reduce_scatter:>12,} B\n"
        + (
            "  W = 1: one rank sends nothing, no collective is issued (the shard is used)\n"
            if world == 1
            else ""
        )
        + "  theory: the padded shards, c = ceil(d0 / W) rows of each parameter (d0 rows of r "
        f"elements), W = {world}:\n"
        f"    all-gather     = {ag_formula}\n"
        f"    reduce-scatter = sum over all params of W * c * r * 4 B\n"
        f"    n_g = gathers per step: {gathers}"
    )
    if sample:
        print(
            f"sample ({len(sample)} characters, temperature 0.8):\n  "
            + sample.replace("\n", "\n  ")
        )
    if cfg.trace_dir is not None:
        _write_trace(cfg.trace_dir, recordings, cfg)
    return losses


@torch.no_grad()
def _generate(model: nn.Module, prompt: torch.Tensor, vocab: list[str], n: int, rank: int) -> str:
    """Every rank runs each forward (its all-gathers are collective); rank 0 picks the token."""
    if n <= 0:
        return ""
    seq_len = prompt.numel()
    context = prompt.clone()
    gen = torch.Generator().manual_seed(7)
    out: list[str] = []
    for _ in range(n):
        logits = model(context[None, -seq_len:])[0, -1].float()
        token = torch.zeros(1, dtype=torch.long, device=context.device)
        if rank == 0:
            probs = torch.softmax(logits.cpu() / 0.8, dim=-1)
            token[0] = int(torch.multinomial(probs, 1, generator=gen).item())
        dist.broadcast(token, src=0)
        context = torch.cat([context, token])
        out.append(vocab[int(token.item())])
    return "".join(out)


def _write_trace(directory: Path, recordings: list[trace.Recording], cfg: DemoConfig) -> None:
    path = trace.write_chrome_trace(directory / "trace.json", recordings)
    print(f"trace    {path} (open in ui.perfetto.dev or chrome://tracing)")
    try:
        png = trace.plot_memory(
            directory / "memory.png",
            recordings,
            title=f"unsharded parameters over the last step ({cfg.size}, {cfg.nproc} ranks, "
            f"reshard={cfg.reshard})",
        )
    except ModuleNotFoundError as e:
        print(f"memory   plot skipped: {e}")
    else:
        print(f"memory   {png}")


# -- launching ----------------------------------------------------------------------------------


def _launch(cfg: DemoConfig) -> int:
    """Start ``cfg.nproc`` ranks around a rendezvous store on a free port; wait, with a timeout."""
    store = TCPStore(
        "127.0.0.1",
        0,
        cfg.nproc,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.timeout_s),
    )  # port 0: the OS picks a free port, no race for one
    ctx = start_processes(  # type: ignore[no-untyped-call]  # unannotated in torch
        _worker, args=(cfg, store.port), nprocs=cfg.nproc, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + cfg.timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                print(f"demo: still running after {cfg.timeout_s:.0f} s; stopping", file=sys.stderr)
                return 124
    except ProcessRaisedException as e:
        print(f"demo: a rank failed:\n{e}", file=sys.stderr)
        return 1
    except ProcessExitedException as e:
        print(f"demo: a rank exited: {e}", file=sys.stderr)
        return 1
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
    return 0


def parse_args(argv: Sequence[str] | None = None) -> DemoConfig:
    """The command line as a :class:`DemoConfig`.

    Example:
        >>> parse_args(["--size", "tiny", "--no-reshard"]).reshard
        False
    """
    parser = argparse.ArgumentParser(
        prog="python -m fully_shard.demo",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = DemoConfig()
    parser.add_argument("--nproc", type=int, default=defaults.nproc, help="number of ranks")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument("--size", choices=sorted(SIZES), default=defaults.size, help="model size")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    parser.add_argument(
        "--mixed-precision",
        action="store_true",
        help="gather and compute in bfloat16, reduce gradients in float32",
    )
    parser.add_argument(
        "--quantize-all-gather",
        action="store_true",
        help="all-gather weights as block-quantized int8 (QuantizationPolicy(all_gather='int8', "
        "block_size=256)); masters, gradients and optimizer state stay fp32",
    )
    parser.add_argument(
        "--reshard",
        action=argparse.BooleanOptionalAction,
        default=defaults.reshard,
        help="free each block's parameters after its forward (less memory, a second "
        "all-gather in backward) or keep them until backward",
    )
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        default=None,
        help="write the last step's Chrome trace (DIR/trace.json) and memory plot (DIR/memory.png)",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda (NCCL) if there is a GPU per rank, else cpu (gloo)",
    )
    parser.add_argument(
        "--sample",
        type=int,
        default=defaults.sample_chars,
        help="characters to generate at the end",
    )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="initial weights and batch order"
    )
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout_s, help="stop the run after this many s"
    )
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    device = args.device
    if device == "auto":
        has_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= args.nproc
        device = "cuda" if has_gpus else "cpu"
    elif device == "cuda" and torch.cuda.device_count() < args.nproc:
        parser.error(
            f"--device cuda needs one GPU per rank: {args.nproc} ranks, "
            f"{torch.cuda.device_count()} GPU(s)"
        )
    return replace(
        defaults,
        size=args.size,
        nproc=args.nproc,
        steps=args.steps,
        lr=args.lr,
        mixed_precision=args.mixed_precision,
        quantize_all_gather=args.quantize_all_gather,
        reshard=args.reshard,
        trace_dir=args.trace,
        device=device,
        sample_chars=max(0, args.sample),
        seed=args.seed,
        timeout_s=args.timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, launch the ranks, return the exit status.

    Example:
        >>> main(["--nproc", "2", "--steps", "5", "--size", "tiny"])  # doctest: +SKIP
        0
    """
    return _launch(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
