"""``fully_shard.plan``: fit a model into a memory budget per rank, as cheaply as it can go.

:func:`plan` predicts the peak memory of one training step per rank for a configuration of
``fully_shard`` (which modules are groups, ``reshard_after_forward`` per group, activation
checkpointing per block, CPU offload), searches the configurations it is allowed to change,
and returns the one with the least predicted step cost that fits, as a :class:`Plan` that
prints as a table and applies itself with :meth:`Plan.apply`.

How the peak is predicted (docs/planning.md has the long form):

- activations are *measured*: one forward and backward of a meta-device replica of the model
  (no real tensor), under a dispatch mode that sees every tensor an op creates and frees
  (:mod:`fully_shard.plan.activations`), once plain and once with every block checkpointed;
- everything the engine holds is *counted* by replaying its schedule rule by rule
  (:mod:`fully_shard.plan.schedule`): shards, gather buffers, unsharded parameters (one group
  ahead for prefetch), post-forward pieces, reduce-scatter buffers, gradients, optimizer state.

It is a tool beside the engine: it reaches the engine only through ``fully_shard`` and the
public policies, and no engine file imports it.

Example:
    >>> import torch
    >>> from fully_shard import plan
    >>> with torch.device("meta"):  # doctest: +SKIP
    ...     model = build_model()
    >>> p = plan(model, budget="20GiB", world_size=64,  # doctest: +SKIP
    ...          example_inputs=(torch.zeros(1, 4096, dtype=torch.long),))
    >>> print(p)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from ..errors import FullyShardTypeError, FullyShardValueError, PlanInfeasibleError
from ..layout import split_rows
from ..persist import is_persistent
from ..policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, QuantizationPolicy
from ..quantize import int8_gather_nbytes
from .activations import Mark, Trace, fake_mode, fake_replica, run_trace, to_fake
from .buckets import BucketRuns, bucket_runs
from .repeat import KEEP, expand, find_run, kept_blocks, short_groups, shortened
from .schedule import CATEGORIES, Choice, Model, Outcome, ParamInfo, simulate

__all__ = [
    "CheckpointedBlock",
    "GroupPlan",
    "Plan",
    "PlanInfeasibleError",
    "StepCosts",
    "parse_bytes",
    "plan",
]

Option = Literal["reshard", "checkpoint", "offload"]
OptimizerSpec = str | Callable[[torch.Size, torch.dtype], int]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: int | str) -> int:
    """A byte count from an int or a string such as ``"20GiB"``, ``"80 GB"``, ``"512MiB"``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) of 1000.

    Example:
        >>> from fully_shard.plan import parse_bytes
        >>> parse_bytes("1.5GiB"), parse_bytes(4096), parse_bytes("2 MB")
        (1610612736, 4096, 2000000)
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise FullyShardTypeError(
            f"budget must be an int (bytes) or a string such as '20GiB', got {value!r} "
            f"({type(value).__name__})"
        )
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*(-?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise FullyShardValueError(
                f"budget {value!r} is not a size: write a number with an optional unit, "
                "e.g. '20GiB', '80GB', '512MiB' or '1073741824'"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise FullyShardValueError(
            f"budget must be positive (bytes per rank), got {value!r}; pass the memory one "
            "rank may use, e.g. '20GiB'"
        )
    return n


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class StepCosts:
    """How the planner weighs what a configuration costs per step, in bytes moved per rank.

    A configuration's cost is the bytes each rank sends or receives in all-gathers,
    reduce-scatters and all-reduces, plus ``recompute_flops / flops_per_byte`` for activation
    checkpointing, plus ``host_weight`` times the bytes copied between host and device with
    offload. The defaults describe a GPU that computes about 20,000 FLOPs in the time its
    network link moves one byte (~1e15 FLOP/s against ~50 GB/s) and a host link (PCIe) half as
    fast as the network.

    Attributes:
        flops_per_byte: FLOPs of recomputation that cost as much as moving one byte.
        host_weight: what one host<->device byte costs, in network bytes.

    Example:
        >>> from fully_shard.plan import StepCosts
        >>> StepCosts(flops_per_byte=5e3).host_weight
        2.0
    """

    flops_per_byte: float = 2.0e4
    host_weight: float = 2.0

    def __post_init__(self) -> None:
        for name in ("flops_per_byte", "host_weight"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise FullyShardValueError(f"StepCosts.{name} must be a positive number, got {v!r}")


@dataclass(frozen=True)
class GroupPlan:
    """One group of a :class:`Plan`: what it holds and the options chosen for it.

    Attributes:
        fqn: the module's qualified name (``""`` for the root).
        param_count: parameter elements it owns.
        sharded_bytes: bytes of its shards on rank 0 (the largest), in the parameter dtype;
            a kept-whole parameter's full size.
        unsharded_bytes: bytes of its gathered, padded parameters in the compute dtype
            (kept-whole ones are not gathered).
        reshard_after_forward: the value passed to ``fully_shard``.
        checkpoint: whether the block runs under activation checkpointing.

    Example:
        >>> from fully_shard.plan import GroupPlan
        >>> GroupPlan("layers.0", 1024, 1024, 4096, True, False).fqn
        'layers.0'
    """

    fqn: str
    param_count: int
    sharded_bytes: int
    unsharded_bytes: int
    reshard_after_forward: bool | int
    checkpoint: bool


class CheckpointedBlock(nn.Module):
    """Runs ``block`` under non-reentrant activation checkpointing (``torch.utils.checkpoint``).

    What :meth:`Plan.apply` puts in place of a block it checkpoints, before sharding the
    wrapper: the recipe of docs/recipes/activation-checkpointing.md. The block's parameters
    get the prefix ``block.`` in ``state_dict`` keys.

    Example:
        >>> import torch
        >>> from fully_shard.plan import CheckpointedBlock
        >>> wrapped = CheckpointedBlock(torch.nn.Linear(4, 4))
        >>> wrapped(torch.ones(2, 4, requires_grad=True)).shape
        torch.Size([2, 4])
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


@dataclass(frozen=True)
class Plan:
    """A configuration of ``fully_shard`` for one model, world size and budget.

    Attributes:
        budget: bytes per rank it was planned for.
        world_size: ranks the parameters are sharded over (the mesh's shard dim).
        replicate_size: ranks of the replicate dim (HSDP), 1 otherwise.
        device_type: where "peak" is counted (``"cuda"`` when planned by ``world_size``).
        peak_bytes: predicted peak device bytes per rank over one training step after the
            first (rank 0, the largest; see ``rank_peaks``).
        rank_peaks: the predicted peak of every rank (trailing ranks of an uneven split hold
            fewer rows).
        host_bytes: predicted host bytes per rank with offload (shards, gradients, optimizer
            state, the optimizer step); 0 without offload.
        groups: the groups in the order ``fully_shard`` is called (blocks, then the root).
        offload: whether sharded state is offloaded to the host (``CPUOffloadPolicy``).
        step_bytes: bytes each rank moves per step in collectives.
        recompute_flops: FLOPs activation checkpointing recomputes per step.
        step_cost: the planner's cost (``StepCosts``) of this configuration.
        bound: the phase (and group) of the peak.
        breakdown: bytes per category at the peak, ``((category, bytes), ...)``.
        mp_policy: the user's mixed precision, passed to every ``fully_shard`` call.
        quantization_policy: the user's gather quantization, passed to every ``fully_shard``
            call.
        bucket_cap_mb: the root's ``set_bucket_cap_mb`` (one of ``plan(bucket_caps=...)``),
            or ``None``: no buckets.
        buckets: groups per bucket, in issue order, with ``bucket_cap_mb`` (what the root's
            ``buckets.sizes()`` will say after the first step); ``None`` without.
        param_persistence_threshold: passed to every ``fully_shard`` call (parameters of
            fewer elements kept whole on every rank): the user's, or the candidate chosen
            among theirs; ``None``: none.

    Example:
        >>> p = fully_shard.plan(model, budget="2GiB", world_size=8,  # doctest: +SKIP
        ...                      example_inputs=(tokens,))
        >>> p.peak_bytes <= p.budget, [g.reshard_after_forward for g in p.groups]  # doctest: +SKIP
        (True, [True, True, False, False])
        >>> p.apply(model, mesh)  # doctest: +SKIP
    """

    budget: int
    world_size: int
    replicate_size: int
    device_type: str
    peak_bytes: int
    rank_peaks: tuple[int, ...]
    host_bytes: int
    groups: tuple[GroupPlan, ...]
    offload: bool
    step_bytes: int
    recompute_flops: int
    step_cost: float
    bound: str
    breakdown: tuple[tuple[str, int], ...]
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    quantization_policy: QuantizationPolicy = field(default_factory=QuantizationPolicy)
    bucket_cap_mb: float | None = None
    # A dict, as the root's buckets.sizes() gives it: left out of the hash (a Plan hashes).
    buckets: dict[str, list[int]] | None = field(default=None, hash=False)
    param_persistence_threshold: int | None = None

    def offload_policy(self) -> OffloadPolicy:
        """The offload policy every group gets.

        Example:
            >>> p.offload_policy()  # doctest: +SKIP
            OffloadPolicy()
        """
        return CPUOffloadPolicy() if self.offload else OffloadPolicy()

    def apply(self, model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
        """Shard ``model`` as planned: checkpoint-wrap blocks, ``fully_shard`` each, then root.

        Exactly the calls one would write by hand (see docs/planning.md), so the result
        trains exactly like them. Checks first that ``model`` has the planned blocks and is
        not sharded yet, and that ``mesh`` has the planned shard size; nothing changes if not.

        Example:
            >>> plan.apply(model, mesh)  # doctest: +SKIP
        """
        from ..api import fully_shard  # the engine's entry point; the engine never imports us
        from ..module import FSDPModule

        if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
            raise FullyShardValueError(
                "Plan.apply got a model that is already sharded (fully_shard was called on it "
                "or on a submodule); apply the plan to a fresh model"
            )
        if mesh is not None:
            shard = mesh.size(mesh.ndim - 1)
            if shard != self.world_size:
                raise FullyShardValueError(
                    f"the plan is for {self.world_size} shard ranks but the mesh's shard dim "
                    f"has {shard}; plan again with this mesh (plan(..., mesh=mesh))"
                )
        blocks = [g for g in self.groups if g.fqn]
        for g in blocks:
            try:
                model.get_submodule(g.fqn)
            except AttributeError:
                raise FullyShardValueError(
                    f"the plan names block {g.fqn!r}, which this model does not have; apply "
                    "the plan to the model it was made for"
                ) from None
        options: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": self.mp_policy,
            "offload_policy": self.offload_policy(),
            "quantization_policy": self.quantization_policy,
            "param_persistence_threshold": self.param_persistence_threshold,
        }
        for g in blocks:
            module = model.get_submodule(g.fqn)
            if g.checkpoint:
                parent_name, _, name = g.fqn.rpartition(".")
                module = CheckpointedBlock(module)
                setattr(model.get_submodule(parent_name), name, module)
            fully_shard(module, reshard_after_forward=g.reshard_after_forward, **options)
        root = next(g for g in self.groups if not g.fqn)
        fully_shard(model, reshard_after_forward=root.reshard_after_forward, **options)
        if self.bucket_cap_mb is not None:
            cast(FSDPModule, model).set_bucket_cap_mb(self.bucket_cap_mb)
        return model

    def __str__(self) -> str:
        lines = [
            f"fully_shard plan: {len(self.groups)} groups over {self.world_size} shard ranks"
            + (f" x {self.replicate_size} replicas" if self.replicate_size > 1 else "")
            + f", budget {_fmt(self.budget)} per rank ({self.device_type})",
            f"{'group':<28} {'params':>10} {'sharded':>12} {'unsharded':>12} "
            f"{'reshard':>8} {'checkpoint':>10}",
        ]
        for g in self.groups:
            lines.append(
                f"{g.fqn or '(root)':<28} {g.param_count:>10,} {_fmt(g.sharded_bytes):>12} "
                f"{_fmt(g.unsharded_bytes):>12} {g.reshard_after_forward!s:>8} "
                f"{'yes' if g.checkpoint else 'no':>10}"
            )
        share = 100 * self.peak_bytes / self.budget
        lines.append(
            f"predicted peak {_fmt(self.peak_bytes)} per rank ({share:.0f}% of the budget), "
            f"at: {self.bound}"
        )
        lines.append(
            "  at the peak: "
            + ", ".join(f"{name} {_fmt(n)}" for name, n in self.breakdown if n > 0)
        )
        offload = (
            f"offload to host ({_fmt(self.host_bytes)} host per rank)"
            if self.offload
            else "no offload"
        )
        if self.buckets is not None:
            b = self.buckets
            lines.append(
                f"buckets (set_bucket_cap_mb({self.bucket_cap_mb})): forward gathers "
                f"{b['forward']}, backward gathers {b['backward']}, reductions {b['reduce']}"
            )
        if self.param_persistence_threshold is not None:
            lines.append(
                f"kept whole on every rank (param_persistence_threshold="
                f"{self.param_persistence_threshold}): parameters of fewer elements"
            )
        lines.append(
            f"moves {_fmt(self.step_bytes)} per rank per step; recomputes "
            f"{self.recompute_flops / 1e9:.1f} GFLOP; {offload}"
        )
        return "\n".join(lines)


# -- building the planner's view of the model -----------------------------------------------


def _find_blocks(model: nn.Module, block_types: Sequence[type[nn.Module]] | None) -> list[str]:
    """FQNs of the blocks: instances of ``block_types`` (default: the repeated class holding
    the most parameters), outermost only, in module order."""
    if block_types is None:
        count: Counter[type[nn.Module]] = Counter()
        for name, m in model.named_modules():
            if name:
                count[type(m)] += 1
        repeated = {t for t, c in count.items() if c >= 2}
        # Each repeated class counts the parameters of its instances that sit inside no
        # instance of another repeated class: a transformer block beats the Linears in it.
        numel: Counter[type[nn.Module]] = Counter()
        outer: list[str] = []
        for name, m in model.named_modules():
            if not name or type(m) not in repeated:
                continue
            if any(name.startswith(o + ".") for o in outer):
                continue
            outer.append(name)
            numel[type(m)] += sum(p.numel() for p in m.parameters())
        if not numel or max(numel.values()) == 0:
            return []
        chosen: tuple[type[nn.Module], ...] = (max(numel, key=lambda t: numel[t]),)
    else:
        chosen = tuple(block_types)
    # How many module slots hold each parameter: a block whose parameter is also held
    # outside it (a tied output head) cannot be a group of its own.
    slots: Counter[int] = Counter()
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                slots[id(p)] += 1
    found: list[str] = []
    for name, m in model.named_modules():
        if not name or not isinstance(m, chosen) or any(name.startswith(f + ".") for f in found):
            continue
        inside: Counter[int] = Counter()
        for sub in m.modules():
            for p in sub._parameters.values():
                if p is not None:
                    inside[id(p)] += 1
        if all(inside[k] == slots[k] for k in inside):
            found.append(name)
    return found


def _optimizer_state(optimizer: OptimizerSpec) -> tuple[Callable[[int, int], int], bool]:
    """(state bytes from a local shard's numel and itemsize, whether AdamW temporaries)."""
    if callable(optimizer):
        user = optimizer

        def state(numel: int, itemsize: int) -> int:
            dtype = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
            return int(user(torch.Size([numel]), dtype.get(itemsize, torch.float32)))

        return state, False
    if optimizer == "adamw":
        # exp_avg and exp_avg_sq like the shard, plus the fp32 `step` scalar
        return (lambda n, s: 2 * n * s + 4), True
    if optimizer == "sgd":
        return (lambda n, s: 0), False
    if optimizer == "sgd_momentum":
        return (lambda n, s: n * s), False
    raise FullyShardValueError(
        f"optimizer={optimizer!r} is not a known layout; pass 'adamw', 'sgd', 'sgd_momentum' or "
        "a callable giving the state bytes of a parameter from its local shard's shape and dtype"
    )


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    from .activations import _tensors

    parts = [t.sum() for t in _tensors(output) if t.requires_grad]
    if not parts:
        raise FullyShardValueError(
            "the model's output has no tensor that needs a gradient, so there is no backward "
            "to plan; pass loss_fn= (output -> scalar loss)"
        )
    total = parts[0]
    for t in parts[1:]:
        total = total + t
    return total


def _inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    value = example_inputs() if callable(example_inputs) else example_inputs
    if isinstance(value, dict):
        return (), dict(value)
    if isinstance(value, torch.Tensor):
        return (value,), {}
    if isinstance(value, tuple):
        return value, {}
    raise FullyShardTypeError(
        f"example_inputs must be a tuple of forward arguments, a dict of keyword arguments, a "
        f"tensor, or a callable returning one, got {type(value).__name__}"
    )


def _quant_bytes(
    policy: QuantizationPolicy, shape: torch.Size, dtype: torch.dtype, padded_numel: int
) -> int | None:
    if not policy.quantizes(shape, dtype, padded_numel):
        return None
    return int8_gather_nbytes(padded_numel, policy.block_size)  # what Int8BlockGather sends


@dataclass(frozen=True)
class _Setup:
    model: Model
    # per group, on rank 0: (gathered bytes, reduce-scatter input bytes, shard bytes,
    # gradient shard bytes), summed once for the cost of every candidate
    group_sums: tuple[tuple[int, int, int, int], ...]
    labels: tuple[str, ...]
    numels: tuple[int, ...]
    world: int
    replicate: int
    device_is_host: bool
    device_type: str
    # bytes each rank sends in the end of backward's all-reduce of kept-whole gradients
    kept_sent: float = 0.0
    threshold: int | None = None


def _trace_shortened(
    trace: Callable[..., Trace],
    model: nn.Module,
    replica: nn.Module,
    block_names: Sequence[str],
    params: Sequence[nn.Parameter],
    owners: Sequence[int],
    want_ckpt: bool,
) -> tuple[Trace, Trace | None] | None:
    """Both traces from a replica whose longest run of identical blocks is cut to four
    (:mod:`fully_shard.plan.repeat`); None where there is no such run or it does not fit."""
    run = find_run(model, block_names)
    if run is None:
        return None
    n = len(block_names)
    short_group = short_groups(run, n)
    blocks = [replica.get_submodule(block_names[b]) for b in kept_blocks(run, n)]
    short_owners = [short_group[g] for g in owners]
    # A dropped block's parameters get a gradient where the first middle block's do.
    middle = [i for i, g in enumerate(owners) if g == run.start + 2]
    twins: dict[int, int] = {}
    for b in range(run.start + KEEP - 1, run.start + run.length - 1):
        mine = [i for i, g in enumerate(owners) if g == b + 1]
        twins.update(zip(mine, middle, strict=True))
    try:
        with shortened(replica, run, block_names):
            plain = trace(blocks, params, short_owners, False)
            ckpt = trace(blocks, params, short_owners, True) if want_ckpt else None
    except Exception:
        return None  # e.g. the model indexes its blocks by number: trace all of them
    full = expand(plain, run, n, twins)
    full_ckpt = None if ckpt is None else expand(ckpt, run, n, twins)
    if full is None or (ckpt is not None and full_ckpt is None):
        return None
    return full, full_ckpt


def _divisors(world: int) -> list[int]:
    return [n for n in range(2, world) if world % n == 0]


# -- the search -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Candidate:
    """One configuration the search may take: the first ``k_reshard`` blocks reshard fully,
    the others keep ``level``; the first ``k_checkpoint`` blocks are checkpointed."""

    offload: bool
    k_checkpoint: int
    level: bool | int
    k_reshard: int

    def choice(self, n_blocks: int) -> Choice:
        reshard = (False, *(True if i < self.k_reshard else self.level for i in range(n_blocks)))
        ckpt = (False, *(i < self.k_checkpoint for i in range(n_blocks)))
        return Choice(reshard, ckpt, self.offload)


def _candidates(
    n_blocks: int, world: int, allow: frozenset[str], offload_ok: bool
) -> list[_Candidate]:
    levels: list[bool | int] = [False, *_divisors(world)] if "reshard" in allow else [True]
    acs = range(n_blocks + 1) if "checkpoint" in allow else range(1)
    offloads = (False, True) if "offload" in allow and offload_ok else (False,)
    out: list[_Candidate] = []
    seen: set[tuple[bool, int, bool | int, int]] = set()
    for off in offloads:
        for k_ac in acs:
            for level in levels:
                for k_r in range(n_blocks + 1):
                    # Every block resharding fully is one configuration, whatever the level.
                    key = (
                        (off, k_ac, True, n_blocks)
                        if level is True or k_r == n_blocks
                        else (off, k_ac, level, k_r)
                    )
                    if key not in seen:
                        seen.add(key)
                        out.append(_Candidate(off, k_ac, level, k_r))
    return out


@dataclass(frozen=True)
class _Costs:
    """Per-block sums from which any candidate's cost is a few look-ups (prefix sums over
    blocks 1..k: index k)."""

    root_sent: float
    root_host: float
    sent: dict[bool | int, tuple[float, ...]]  # reshard value -> prefix sums of bytes sent
    host: dict[bool | int, tuple[float, ...]]  # same, host<->device bytes with offload
    flops: tuple[int, ...]  # prefix sums of forward FLOPs (recomputed when checkpointed)

    def of(self, c: _Candidate, costs: StepCosts) -> tuple[float, int, int]:
        """(cost, collective bytes per rank, recompute FLOPs) of ``c`` on rank 0."""
        k, n = c.k_reshard, len(self.flops) - 1
        sent = self.root_sent + self.sent[True][k] + self.sent[c.level][n] - self.sent[c.level][k]
        host = 0.0
        if c.offload:
            host = self.root_host + self.host[True][k]
            host += self.host[c.level][n] - self.host[c.level][k]
        flops = self.flops[c.k_checkpoint]
        return sent + flops / costs.flops_per_byte + costs.host_weight * host, int(sent), flops


def _group_traffic(s: _Setup, g: int, flag: bool | int) -> tuple[float, float]:
    """(bytes sent in collectives, host<->device bytes with offload) of group ``g`` per step
    on rank 0 when it reshards after forward with ``flag``."""
    gathered, padded, shards, grads = s.group_sums[g]
    if not gathered:
        return 0.0, 0.0
    frac = (s.world - 1) / s.world
    gathers = frac
    regathered = s.model.plain.outputs_need_grad[g]
    if regathered and flag is True:
        gathers += frac
    elif regathered and flag is not False:
        gathers += (flag - 1) / flag
    sent = gathers * gathered + frac * padded
    if s.replicate > 1:
        sent += 2 * (s.replicate - 1) / s.replicate * padded / s.world
    host = 0.0
    if not s.device_is_host:
        host = (1 + (flag is not False and regathered)) * shards + grads
    return sent, host


def _cost_table(s: _Setup, levels: Iterable[bool | int]) -> _Costs:
    n = s.model.n_groups - 1
    sent: dict[bool | int, tuple[float, ...]] = {}
    host: dict[bool | int, tuple[float, ...]] = {}
    for flag in {True, *levels}:
        per = [_group_traffic(s, g, flag) for g in range(1, n + 1)]
        sent[flag] = tuple(_prefix(a for a, _ in per))
        host[flag] = tuple(_prefix(b for _, b in per))
    root_sent, root_host = _group_traffic(s, 0, False)
    root_sent += s.kept_sent
    flops = [0, *_forward_flops(s.model.plain, n)]
    for k in range(1, n + 1):
        flops[k] += flops[k - 1]
    return _Costs(root_sent, root_host, sent, host, tuple(flops))


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _forward_flops(tr: Trace, n_blocks: int) -> list[int]:
    """Per block, the FLOPs of its forward (what checkpointing it recomputes)."""
    per = [0] * (n_blocks + 1)
    inside: int | None = None
    for item in tr.items:
        if isinstance(item, Mark):
            if item.kind == "fwd_start" and item.group:
                inside = item.group
            elif item.kind == "fwd_end" and item.group == inside:
                inside = None
            continue
        if inside is not None:
            per[inside] += item.flops
    return per[1:]


def _simulate(s: _Setup, c: Choice, rank: int = 0) -> Outcome:
    return simulate(s.model, c, s.world, rank, s.labels, s.device_is_host)


def _to_plan(
    s: _Setup,
    c: Choice,
    budget: int,
    cost: tuple[float, int, int],
    mp: MixedPrecisionPolicy,
    qp: QuantizationPolicy,
) -> Plan:
    out = _simulate(s, c)
    ranks = _rank_peaks(s, c, out.peak)
    groups: list[GroupPlan] = []
    m = s.model
    for g in [*range(1, m.n_groups), 0]:
        shard = unsharded = numel = 0
        for i, p in enumerate(m.params):
            if p.group != g:
                continue
            numel += s.numels[i]
            d0, rest = p.rows_rest()
            if p.kept:
                shard += d0 * rest * p.orig_itemsize
                continue
            split = split_rows(d0, s.world)  # rank 0's: the most rows
            shard += split.rows * rest * p.orig_itemsize
            unsharded += s.world * split.chunk * rest * p.compute_itemsize
        groups.append(
            GroupPlan(
                s.labels[g] if g else "", numel, shard, unsharded, c.reshard[g], c.checkpoint[g]
            )
        )
    return Plan(
        budget=budget,
        world_size=s.world,
        replicate_size=s.replicate,
        device_type=s.device_type,
        peak_bytes=max(ranks),
        rank_peaks=tuple(ranks),
        host_bytes=out.host_peak,
        groups=tuple(groups),
        offload=c.offload and not s.device_is_host,
        step_bytes=cost[1],
        recompute_flops=cost[2],
        step_cost=cost[0],
        bound=out.where,
        breakdown=tuple(zip(CATEGORIES, out.breakdown, strict=True)),
        mp_policy=mp,
        quantization_policy=qp,
        bucket_cap_mb=c.bucket_cap_mb,
        buckets=None if c.bucket_cap_mb is None else _runs(s, c).sizes(),
        param_persistence_threshold=s.threshold,
    )


def _runs(s: _Setup, c: Choice) -> BucketRuns:
    offload = c.offload and not s.device_is_host
    return bucket_runs(s.model.params, s.model.plain, c, s.world, offload)


def _with_buckets(s: _Setup, c: Choice, caps: Sequence[float], budget: int) -> Choice:
    """``c`` with the largest of ``caps`` (MiB) under which its predicted peak still fits
    ``budget``; ``c`` itself where none fits or none merges two groups."""
    for cap in sorted(caps, reverse=True):
        bucketed = dataclasses.replace(c, bucket_cap_mb=cap)
        if not _runs(s, bucketed).merges():
            return c  # a smaller cap merges nothing either
        if _simulate(s, bucketed).peak <= budget:
            return bucketed
    return c


def _rank_peaks(s: _Setup, c: Choice, peak0: int) -> list[int]:
    """Every rank's predicted peak; ranks that hold the same rows of every parameter (in the
    world and in each post-forward split) have the same peak, replayed once."""
    splits = sorted({f for f in c.reshard if f is not True and f is not False})
    shapes = [p.rows_rest()[0] for p in s.model.params]
    known: dict[tuple[int, ...], int] = {}
    out = []
    for r in range(s.world):
        key = tuple(split_rows(d0, n, r % n).rows for n in (s.world, *splits) for d0 in shapes)
        if key not in known:
            known[key] = peak0 if r == 0 else _simulate(s, c, r).peak
        out.append(known[key])
    return out


def _check_caps(caps: Sequence[float]) -> tuple[float, ...]:
    if isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence):
        raise FullyShardTypeError(
            f"bucket_caps must be a sequence of sizes in MiB, e.g. (25, 5), got {caps!r}"
        )
    for cap in caps:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise FullyShardTypeError(f"bucket_caps holds {cap!r}, not a size in MiB")
        if not (math.isfinite(cap) and cap > 0):
            raise FullyShardValueError(
                f"bucket_caps holds {cap!r}; each cap is a positive, finite size in MiB"
            )
    return tuple(caps)


def _check_thresholds(value: object) -> tuple[int | None, tuple[int, ...]]:
    """(the threshold to plan with, the candidates to choose among) from
    ``param_persistence_threshold``: an int or None, or a sequence of candidates."""
    from ..api import _check_persistence_threshold  # fully_shard's own check and messages

    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        found = tuple(_check_persistence_threshold(v) for v in value)
        if any(v is None for v in found):
            raise FullyShardTypeError(
                f"param_persistence_threshold holds None among its candidates {value!r}; "
                "list numbers of elements only (the plan may take none of them)"
            )
        return None, tuple(v for v in found if v is not None)
    return _check_persistence_threshold(value), ()


def _describe(c: Choice, labels: Sequence[str]) -> str:
    blocks = range(1, len(labels))
    reshard = Counter(str(c.reshard[g]) for g in blocks)
    ckpt = sum(c.checkpoint[g] for g in blocks)
    parts = [f"reshard_after_forward {dict(reshard)} over {len(blocks)} blocks"]
    parts.append(f"{ckpt} blocks checkpointed")
    parts.append("offload on" if c.offload else "offload off")
    return ", ".join(parts)


def plan(
    model: nn.Module,
    *,
    budget: int | str,
    example_inputs: Any,
    mesh: DeviceMesh | None = None,
    world_size: int | None = None,
    optimizer: OptimizerSpec = "adamw",
    mp_policy: MixedPrecisionPolicy | None = None,
    quantization_policy: QuantizationPolicy | None = None,
    allow: Iterable[Option] = ("reshard", "checkpoint", "offload"),
    block_types: Sequence[type[nn.Module]] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    costs: StepCosts = StepCosts(),
    bucket_caps: Sequence[float] = (),
    param_persistence_threshold: int | Sequence[int] | None = None,
) -> Plan:
    """The cheapest ``fully_shard`` configuration of ``model`` whose step fits in ``budget``.

    Predicts one training step's peak memory per rank (forward, backward, optimizer step, after
    the first step) for each configuration it may choose and returns the one with the least
    step cost (:class:`StepCosts`) that fits. It never changes numerics: mixed precision and
    int8 gathers are yours to pass, and it plans with them. Nothing of ``model`` changes, and
    nothing real is allocated: the model may live on the meta device.

    What it chooses, each only if named in ``allow``: ``reshard_after_forward`` per block
    (``"reshard"``: False, an int divisor of the world size, or True; the root keeps False),
    activation checkpointing of the first k blocks (``"checkpoint"``), ``CPUOffloadPolicy``
    (``"offload"``: only where the device is not the host). Not allowed means the engine's
    default (True for blocks) and no checkpointing or offload. As the budget shrinks the cost
    decides what goes first; with the default costs that is resharding after forward (the
    first blocks first), then ``reshard_after_forward=n`` for the rest, then checkpointing,
    then offload.

    Args:
        model: the unsharded model (any device; ``meta`` is fine).
        budget: bytes per rank, an int or a string such as ``"20GiB"``.
        example_inputs: one rank's micro-batch: a tuple of forward arguments, a dict of
            keyword arguments, or a callable returning one.
        mesh: the mesh to plan for (1-D, or 2-D HSDP ``(replicate, shard)``).
        world_size: plan for this many shard ranks without a process group (for an
            accelerator job: offload may be chosen).
        optimizer: the optimizer's state layout: ``"adamw"``, ``"sgd"``, ``"sgd_momentum"``,
            or a callable giving the state bytes of one parameter from its local shard's shape
            and dtype. ``zero_grad(set_to_none=True)`` after each step is assumed.
        mp_policy: mixed precision, passed to every ``fully_shard`` call (the planner
            computes in its ``param_dtype`` and casts inputs as the engine does).
        quantization_policy: int8 gathers, passed to every ``fully_shard`` call.
        allow: the options the planner may change.
        block_types: the module classes that become groups (default: the repeated class
            holding the most parameters).
        loss_fn: output -> scalar loss, as the training loop computes it (it must build any
            target on ``output.device``); default: the output's ``loss`` or the sum of its
            tensors.
        costs: how to weigh communication, recomputation and host traffic.
        bucket_caps: candidate ``set_bucket_cap_mb`` values (MiB). The configuration is
            chosen as without them; then it takes the largest cap under which its predicted
            peak, buckets included, still fits (none if none does), and ``apply`` sets it.
        param_persistence_threshold: passed to every ``fully_shard`` call: parameters of
            fewer elements are planned whole on every rank (parameter, gradient, optimizer
            state and compute-dtype copy at full size; no gather or reduce-scatter; their
            gradients held until the end of backward's all-reduce). A sequence lists
            candidates: the configuration is chosen without any; then it takes the largest
            candidate under which its predicted peak still fits (none if none does), before
            the bucket caps, and ``apply`` passes it on.

    Raises:
        PlanInfeasibleError: no allowed configuration fits; ``minimum_bytes`` says how much
            the best one needs.
        FullyShardValueError, FullyShardTypeError: bad arguments, or inputs the model does not
            run on (raised before anything is planned).

    Example:
        >>> import torch
        >>> from fully_shard import plan
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> p = plan(model, budget="1MiB", world_size=2,
        ...          example_inputs=(torch.zeros(8, 64),), allow=("reshard",))
        >>> p.peak_bytes <= p.budget, len(p.groups)
        (True, 5)
    """
    budget_bytes = parse_bytes(budget)
    if not isinstance(model, nn.Module):
        raise FullyShardTypeError(f"plan() needs an nn.Module, got {type(model).__name__}")
    from ..module import FSDPModule  # for the check only; the engine never imports us

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise FullyShardValueError(
            "plan() got a model that is already sharded; plan the unsharded model, then "
            "apply the plan to it"
        )
    allowed = frozenset(allow)
    unknown = allowed - {"reshard", "checkpoint", "offload"}
    if unknown:
        raise FullyShardValueError(
            f"allow has unknown options {sorted(unknown)}; choose from 'reshard', "
            "'checkpoint', 'offload'"
        )
    replicate = 1
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise FullyShardTypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if mesh.ndim > 2:
            raise FullyShardValueError(
                f"plan() handles 1-D and 2-D (HSDP) meshes, got a {mesh.ndim}-D mesh"
            )
        shard = mesh.size(mesh.ndim - 1)
        replicate = mesh.size(0) if mesh.ndim == 2 else 1
        if world_size is not None and world_size != shard:
            raise FullyShardValueError(
                f"world_size={world_size} disagrees with the mesh, whose shard dim has {shard} "
                "ranks; pass one of them"
            )
        world, device_type = shard, mesh.device_type
    elif world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise FullyShardValueError(
                f"world_size must be a positive int (shard ranks), got {world_size!r}"
            )
        world, device_type = world_size, "cuda"
    else:
        raise FullyShardValueError(
            "plan() needs mesh= (plan for this mesh) or world_size= (plan for that many ranks "
            "without a process group)"
        )
    state_of, adam = _optimizer_state(optimizer)
    mp = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    qp = QuantizationPolicy() if quantization_policy is None else quantization_policy
    if not isinstance(mp, MixedPrecisionPolicy):
        raise FullyShardTypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp!r}")
    if not isinstance(qp, QuantizationPolicy):
        raise FullyShardTypeError(f"quantization_policy must be a QuantizationPolicy, got {qp!r}")
    args, kwargs = _inputs(example_inputs)
    caps = _check_caps(bucket_caps)
    threshold, thresholds = _check_thresholds(param_persistence_threshold)

    block_names = _find_blocks(model, block_types)
    mode = fake_mode()
    replica, mapping = fake_replica(model, mp.compute_dtype, mode, mp.reduce_dtype_for)
    blocks = [replica.get_submodule(n) for n in block_names]
    params_orig = list(model.parameters())
    owner: dict[int, int] = {}
    for b, name in enumerate(block_names, start=1):
        for p in model.get_submodule(name).parameters():
            owner.setdefault(id(p), b)
    replica_params = [mapping[id(p)] for p in params_orig]
    owners = [owner.get(id(p), 0) for p in params_orig]
    meta_args, meta_kwargs = to_fake((args, kwargs), mode)
    in_dtype = mp.forward_input_dtype()
    loss = _default_loss if loss_fn is None else loss_fn
    # Once plain, once with every block checkpointed; any mix is composed from the two.
    trace = functools.partial(run_trace, replica, meta_args, meta_kwargs, loss, mode, in_dtype)
    want_ckpt = "checkpoint" in allowed and bool(blocks)
    traced = _trace_shortened(trace, model, replica, block_names, replica_params, owners, want_ckpt)
    if traced is None:
        try:
            plain = trace(blocks, replica_params, owners, False)
            ckpt = trace(blocks, replica_params, owners, True) if want_ckpt else None
        except FullyShardValueError:
            raise
        except Exception as e:
            raise FullyShardValueError(
                f"the model did not run on example_inputs (on meta tensors): "
                f"{type(e).__name__}: {e}; pass the inputs one rank's forward takes (and "
                "loss_fn= if the output is not a loss)"
            ) from e
    else:
        plain, ckpt = traced
    if ckpt is not None and [i for i in ckpt.items if isinstance(i, Mark)] != [
        i for i in plain.items if isinstance(i, Mark)
    ]:
        ckpt = None  # the checkpointed run took another path: do not compose from it
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())

    def setup_for(threshold: int | None) -> _Setup:
        """The planner's view of the model with ``threshold``'s parameters kept whole (the
        trace does not depend on it: the same tensors are computed with either way)."""
        infos: list[ParamInfo] = []
        for p in params_orig:
            g = owner.get(id(p), 0)
            d0 = p.shape[0] if p.ndim else 1
            padded = split_rows(d0, world).chunk * (p[0].numel() if p.ndim and d0 else 1)
            kept = is_persistent(p, threshold, None)  # the planner sees no TP parameters
            infos.append(
                ParamInfo(
                    shape=tuple(p.shape),
                    orig_itemsize=p.element_size(),
                    compute_itemsize=mp.compute_dtype(p.dtype).itemsize,
                    reduce_itemsize=mp.reduce_dtype_for(p.dtype).itemsize,
                    wire_bytes_per_row=None if kept else _quant_bytes(qp, p.shape, p.dtype, padded),
                    trainable=p.requires_grad,
                    group=g,
                    compute_dtype=str(mp.compute_dtype(p.dtype)),
                    reduce_dtype=str(mp.reduce_dtype_for(p.dtype)),
                    kept=kept,
                )
            )
        sums = [[0, 0, 0, 0] for _ in range(len(blocks) + 1)]
        kept_grads = 0
        for i, info in enumerate(infos):
            d0, rest = info.rows_rest()
            if info.kept:
                if i in plain.params_with_grad:
                    kept_grads += d0 * rest * info.reduce_itemsize
                continue
            split = split_rows(d0, world)  # rank 0's: the most rows
            chunk = split.chunk
            wire = info.wire_bytes_per_row
            acc = sums[info.group]
            acc[0] += world * (chunk * rest * info.compute_itemsize if wire is None else wire)
            acc[2] += split.rows * rest * info.orig_itemsize
            if i in plain.params_with_grad:
                acc[1] += world * chunk * rest * info.reduce_itemsize
                acc[3] += split.rows * rest * info.orig_itemsize
        return _Setup(
            Model(tuple(infos), len(blocks) + 1, plain, ckpt, buffers, state_of, adam),
            tuple((a, b, c, d) for a, b, c, d in sums),
            ("(root)", *block_names),
            tuple(p.numel() for p in params_orig),
            world,
            replicate,
            device_type == "cpu",
            device_type,
            # a ring all-reduce over every data-parallel rank sends 2 (n - 1) / n of the buffer
            2 * (world * replicate - 1) / (world * replicate) * kept_grads,
            threshold,
        )

    setup = setup_for(threshold)
    candidates = _candidates(
        len(blocks), world, allowed if ckpt else allowed - {"checkpoint"}, device_type != "cpu"
    )
    table = _cost_table(setup, {k.level for k in candidates})
    scored = sorted(
        ((table.of(k, costs), i, k) for i, k in enumerate(candidates)), key=lambda t: t[:2]
    )
    best: tuple[int, Choice, tuple[float, int, int]] | None = None
    for cost, _, k in scored:
        c = k.choice(len(blocks))
        peak = _simulate(setup, c).peak
        if peak <= budget_bytes:
            # Candidate thresholds, as bucket caps: the most kept whole that still fits.
            for t in sorted(thresholds, reverse=True):
                kept = setup_for(t)
                if _simulate(kept, c).peak <= budget_bytes:
                    setup, cost = kept, _cost_table(kept, {k.level}).of(k, costs)
                    break
            c = _with_buckets(setup, c, caps, budget_bytes)
            return _to_plan(setup, c, budget_bytes, cost, mp, qp)
        if best is None or peak < best[0]:
            best = (peak, c, cost)
    if best is None:  # at least the default configuration is always a candidate
        raise RuntimeError("plan(): no configuration was tried (internal error)")
    minimum, c, cost = best
    smallest = _to_plan(setup, c, budget_bytes, cost, mp, qp)
    raise PlanInfeasibleError(
        f"no allowed configuration fits {_fmt(budget_bytes)} per rank: the smallest predicted "
        f"peak is {_fmt(minimum)} ({minimum} bytes), with {_describe(c, setup.labels)}, at "
        f"{smallest.bound}. Raise the budget to at least that, allow more options (allow="
        f"{tuple(sorted(allowed))}), shard over more ranks, or use a smaller micro-batch",
        minimum_bytes=minimum,
        plan=smallest,
    )
