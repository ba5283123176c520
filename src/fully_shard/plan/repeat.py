"""Trace a run of identical blocks once, not once per block.

A model of N identical blocks (Llama-3-8B: 32) costs N times one block to trace on fake
tensors, though every middle block does the same thing. The planner traces a shortened replica
instead, whose longest run of identical consecutive blocks keeps only four: the first (whose
input comes from outside the run), two middle ones, and the last (whose output leaves it).
The two middle blocks must leave identical items in the trace (marks, activation spans,
gradient bytes: the same up to the block's number); then the first middle block's items,
renumbered, stand for each of the dropped blocks, and the result is the trace of the whole
model. Anything that does not fit this (the run is not in one ``nn.ModuleList`` or
``nn.Sequential``, the shortened model does not run, the middle blocks differ, a block's
items leak into the part of the trace that is not renumbered) makes the planner trace the
whole model, as before.

Identical means: the same class, the same parameter shapes, dtypes and ``requires_grad``, the
same buffers, and the same non-integer settings on every submodule (a ``bool`` such as
``is_sliding``, a string such as ``"full_attention"``), so a sliding-window layer is not
taken for a global one. Integer attributes (``layer_idx``) are left out: every block has its
own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from .activations import Item, Mark, Trace

KEEP = 4  # blocks of a run kept in the shortened replica: first, two middle, last


@dataclass(frozen=True)
class Run:
    """Consecutive identical blocks ``start .. start + length - 1`` (0-based among the blocks),
    all children of the container ``parent`` (a ``ModuleList`` or ``Sequential``)."""

    start: int
    length: int
    parent: str
    keys: tuple[str, ...]  # the container's child names, in order


def _settings(module: nn.Module) -> tuple[tuple[str, object], ...]:
    return tuple(
        (k, v)
        for k, v in sorted(vars(module).items())
        if not k.startswith("_") and (v is None or isinstance(v, (bool, str, float)))
    )


def signature(block: nn.Module) -> tuple[object, ...]:
    """What two blocks must share to be traced as one (see the module doc)."""
    params = tuple((tuple(p.shape), p.dtype, p.requires_grad) for p in block.parameters())
    buffers = tuple((tuple(b.shape), b.dtype) for b in block.buffers())
    settings = tuple((name, type(m), _settings(m)) for name, m in block.named_modules())
    return (type(block), params, buffers, settings)


def find_run(model: nn.Module, block_names: Sequence[str]) -> Run | None:
    """The longest run of identical blocks worth shortening (more than ``KEEP``), or None."""
    best: Run | None = None
    i = 0
    while i < len(block_names):
        parent, _, key = block_names[i].rpartition(".")
        container = model.get_submodule(parent) if parent else model
        if type(container) not in (nn.ModuleList, nn.Sequential):
            i += 1
            continue
        keys = tuple(name for name, _ in container.named_children())
        sig = signature(model.get_submodule(block_names[i]))
        j = i + 1
        while j < len(block_names):
            p, _, k = block_names[j].rpartition(".")
            if p != parent or keys.index(k) != keys.index(key) + (j - i):
                break
            if signature(model.get_submodule(block_names[j])) != sig:
                break
            j += 1
        if j - i > KEEP and (best is None or j - i > best.length):
            best = Run(i, j - i, parent, keys)
        i = j
    return best


def kept_blocks(run: Run, n_blocks: int) -> list[int]:
    """Indices (0-based among the blocks) of the blocks the shortened replica keeps."""
    end = run.start + run.length - 1
    return [b for b in range(n_blocks) if not run.start + KEEP - 1 <= b < end]


@contextmanager
def shortened(replica: nn.Module, run: Run, block_names: Sequence[str]) -> Iterator[None]:
    """``replica`` with the run's container holding only the kept blocks, for the ``with``."""
    container = replica.get_submodule(run.parent) if run.parent else replica
    dropped = {
        block_names[b].rpartition(".")[2]
        for b in range(run.start + KEEP - 1, run.start + run.length - 1)
    }
    children = [(k, m) for k, m in container.named_children() if k not in dropped]
    if isinstance(container, nn.Sequential):
        short: nn.Module = nn.Sequential()
        for k, m in children:
            short.add_module(k, m)
    else:
        short = nn.ModuleList(m for _, m in children)
    owner, _, attr = run.parent.rpartition(".")
    holder = replica.get_submodule(owner) if owner else replica
    setattr(holder, attr, short)
    try:
        yield
    finally:
        setattr(holder, attr, container)


def _regroup(item: Item, mapping: dict[int, int]) -> Item:
    if isinstance(item, Mark):
        return Mark(item.kind, mapping.get(item.group, item.group))
    grads = tuple(sorted((mapping.get(g, g), n) for g, n in item.grads))
    frees = tuple(sorted((mapping.get(g, g), n) for g, n in item.input_frees))
    owner = mapping.get(item.owner, item.owner)
    return dataclasses.replace(item, owner=owner, grads=grads, input_frees=frees)


def _groups(items: Sequence[Item]) -> set[int]:
    out: set[int] = set()
    for item in items:
        if isinstance(item, Mark):
            out.add(item.group)
        else:
            out.add(item.owner)
            out.update(g for g, _ in item.grads)
            out.update(g for g, _ in item.input_frees)
    return out


def _index(items: Sequence[Item], kind: str, group: int) -> int | None:
    for i, item in enumerate(items):
        if isinstance(item, Mark) and item.kind == kind and item.group == group:
            return i
    return None


def short_groups(run: Run, n_blocks: int) -> list[int]:
    """Each group's number in the shortened replica (0 for a dropped block; groups 1-based)."""
    keep = kept_blocks(run, n_blocks)
    out = [0] * (n_blocks + 1)
    for i, b in enumerate(keep, start=1):
        out[b + 1] = i
    return out


def expand(short: Trace, run: Run, n_blocks: int, twins: dict[int, int]) -> Trace | None:
    """The whole model's trace from the shortened replica's, or None where it does not fit.

    ``n_blocks`` counts the whole model's blocks; groups are 1-based (0: the root).
    ``twins`` maps each parameter index of a dropped block to the same parameter of the
    run's first middle block (whose gradient it shares the fate of).
    """
    a = run.start + 1  # the run's first block as a group
    first, mid1, mid2, last = a, a + 1, a + 2, a + 3
    extra = run.length - KEEP  # dropped blocks
    full_last = a + run.length - 1
    items = short.items
    marks = [
        _index(items, "fwd_start", mid1),
        _index(items, "fwd_start", mid2),
        _index(items, "fwd_start", last),
        _index(items, "bwd_start", mid2),
        _index(items, "bwd_start", mid1),
        _index(items, "bwd_start", first),
    ]
    if any(m is None for m in marks):
        return None
    f1, f2, f3, b2, b1, b0 = (m for m in marks if m is not None)
    if not f1 < f2 < f3 <= b2 < b1 < b0:
        return None
    seg, seg_next = items[f1:f2], items[f2:f3]
    bseg, bseg_prev = items[b1:b0], items[b2:b1]
    up = {first: mid1, mid1: mid2, mid2: last}
    inside = {0, first, mid1, mid2}
    if (
        [_regroup(i, up) for i in seg] != list(seg_next)
        or [_regroup(i, up) for i in bseg] != list(bseg_prev)
        or not _groups(seg) <= inside
        or not _groups(bseg) <= inside
        or _groups(items[:f1]) & {mid1, mid2, last}
        or _groups(items[f3:b2]) & {mid1, mid2}
        or _groups(items[b0:]) & {mid2, last}
    ):
        return None
    after = {g: g + extra for g in range(last, n_blocks - extra + 1)}
    copies = [{first: first + j, mid1: mid1 + j, mid2: mid2 + j} for j in range(run.length - 2)]
    out: list[Item] = list(items[:f1])
    for m in copies:
        out += [_regroup(i, m) for i in seg]
    out += [_regroup(i, after) for i in items[f3:b2]]
    for m in reversed(copies):
        out += [_regroup(i, m) for i in bseg]
    out += list(items[b0:])
    if _index(out, "fwd_start", full_last) is None:
        return None

    def per_group(values: tuple[bool, ...]) -> tuple[bool, ...] | None:
        if values[mid1] != values[mid2]:
            return None
        return (*values[:mid2], *[values[mid1]] * extra, *values[mid2:])

    outputs, inputs = per_group(short.outputs_need_grad), per_group(short.inputs_need_grad)
    if outputs is None or inputs is None:
        return None
    got = short.params_with_grad
    with_grad = got | {i for i, twin in twins.items() if twin in got}
    return Trace(tuple(out), outputs, inputs, with_grad, short.input_bytes)
