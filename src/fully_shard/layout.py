"""What a parameter and its unsharded side both name: the split's geometry, and the parameter.

:class:`ShardLayout` is how one tensor is split over the ranks of a shard group (the W-rank
split of every parameter, and the n-rank split of a post-forward piece under
``reshard_after_forward=n``). :class:`ParamView` is what an unsharded side
(:mod:`fully_shard.storage`, :mod:`fully_shard.extensions`) reads of the parameter it serves,
and the one attribute it writes, ``unsharded_param``. Both live here, below ``param.py`` and the
sides, so that the imports point one way: ``param`` → ``storage`` / ``extensions`` → ``layout``.

The row split itself, :func:`split_rows`, is the one the whole package uses: the engine, the
planner (:mod:`fully_shard.plan`), the optimizers (:mod:`fully_shard.optim`) and the demo.

Example:
    >>> import torch
    >>> from fully_shard.layout import ShardLayout
    >>> ShardLayout.chunked(torch.Size([5, 3]), dim=0, world=2, rank=1).local_rows
    2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    # Only ParamView's annotations name them: at run time this module imports nothing of the
    # package, so that packing.py (below quantize.py, which these pull in) can use split_rows.
    from .mesh import MeshInfo
    from .policies import QuantizationPolicy
    from .quantize import GatherFormat
    from .spmd import TPLayout


class RowSplit(NamedTuple):
    """One rank's rows of a split like ``torch.chunk``: ``[start, stop)``, ``chunk`` per rank.

    Attributes:
        chunk: ``ceil(rows / world)``: rows every rank's padded shard has.
        start: the first row this rank holds (``min(rank * chunk, rows)``).
        stop: one past its last (``min(start + chunk, rows)``); ``start`` when it holds none.
    """

    chunk: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        """Rows this rank really holds: ``chunk``, or fewer (or none) on trailing ranks."""
        return self.stop - self.start


def split_rows(rows: int, world: int, rank: int = 0) -> RowSplit:
    """``rows`` split over ``world`` ranks like ``torch.chunk`` (and ``Shard(0)``), seen from
    ``rank``: rank r holds rows ``[r*c, min((r+1)*c, rows))`` with ``c = ceil(rows / world)``.

    Integer arithmetic (no float ``ceil``), so it is exact for any size. The padding rule
    follows from it: every rank sends ``chunk`` rows, ``world * chunk`` are gathered.

    Example:
        >>> from fully_shard.layout import split_rows
        >>> [tuple(split_rows(5, 4, r)) for r in range(4)]  # the last rank holds none
        [(2, 0, 2), (2, 2, 4), (2, 4, 5), (2, 5, 5)]
        >>> split_rows(5, 4, 2).rows
        1
    """
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return RowSplit(chunk, start, min(start + chunk, rows))


@dataclass(frozen=True)
class ShardLayout:
    """How a tensor of shape ``size`` is split on ``dim`` over ``world`` ranks, seen from ``rank``.

    Split like ``torch.chunk``: rank r holds rows ``[r*chunk, r*chunk + local_rows)`` of dim
    ``dim``; ``local_rows`` is ``chunk`` except on trailing ranks of an uneven split (fewer, or
    none). Every rank sends a padded shard of ``chunk`` rows, so the gathered tensor has
    ``world * chunk`` rows on ``dim``.

    Attributes:
        world: how many ranks share the tensor.
        rank: this rank's index among them.
        dim: the tensor dim that is split.
        chunk: rows per rank (padded).
        local_rows: rows this rank really holds.
        size: the unpadded shape of the tensor being split.

    Example:
        >>> import torch
        >>> from fully_shard.layout import ShardLayout
        >>> lay = ShardLayout.chunked(torch.Size([5, 3]), dim=0, world=4, rank=2)
        >>> lay.chunk, lay.offset, lay.local_rows, tuple(lay.padded_full_size)
        (2, 4, 1, (8, 3))
    """

    world: int
    rank: int
    dim: int
    chunk: int
    local_rows: int
    size: torch.Size

    @classmethod
    def chunked(cls, size: torch.Size, dim: int, world: int, rank: int) -> ShardLayout:
        """``size`` split on ``dim`` into ``world`` chunks of ``ceil(size[dim] / world)`` rows."""
        split = split_rows(size[dim], world, rank)
        return cls(world, rank, dim, split.chunk, split.rows, size)

    @property
    def offset(self) -> int:
        """The first row of dim ``dim`` this rank holds."""
        return split_rows(self.size[self.dim], self.world, self.rank).start

    def _with_rows(self, rows: int) -> torch.Size:
        size = list(self.size)
        size[self.dim] = rows
        return torch.Size(size)

    @property
    def local_size(self) -> torch.Size:
        """``(local_rows, *rest)`` for dim 0: what this rank holds."""
        return self._with_rows(self.local_rows)

    @property
    def padded_shard_size(self) -> torch.Size:
        """``(chunk, *rest)`` for dim 0: what every rank sends."""
        return self._with_rows(self.chunk)

    @property
    def padded_numel(self) -> int:
        return self.padded_shard_size.numel()

    @property
    def padded_full_size(self) -> torch.Size:
        """``(world * chunk, *rest)`` for dim 0: the gathered tensor."""
        return self._with_rows(self.world * self.chunk)

    def ranked(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (``padded_full_size``) as ``(world, *padded_shard_size)``: rank r's rows."""
        d, size = self.dim, self.padded_full_size
        return full.view(*size[:d], self.world, self.chunk, *size[d + 1 :]).movedim(d, 0)


class ParamView(Protocol):
    """What an unsharded side reads of the parameter it serves (``ShardedParam`` is one).

    Example:
        >>> DenseStorage().alloc(group.params[0])  # a ShardedParam is a ParamView  # doctest: +SKIP
    """

    fqn: str
    info: MeshInfo
    shard_dim: int
    tp: TPLayout | None
    orig_size: torch.Size
    sharded_param: nn.Parameter
    layout: ShardLayout
    # Written by the side: the tensor the module computes with, built at the first unshard.
    unsharded_param: nn.Parameter | None

    @property
    def requires_grad(self) -> bool: ...

    compute_dtype: torch.dtype  # the group's mixed precision answer, set at each all-gather

    @property
    def local_shard(self) -> torch.Tensor: ...

    def gather_format(self, policy: QuantizationPolicy) -> GatherFormat: ...
