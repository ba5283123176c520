"""What a parameter and its unsharded side both name: the split's geometry, and the parameter.

:class:`ShardLayout` is how one tensor is split over the ranks of a shard group (the W-rank
split of every parameter, and the n-rank split of a post-forward piece under
``reshard_after_forward=n``). :class:`ParamView` is what an unsharded side
(:mod:`fully_shard.storage`, :mod:`fully_shard.extensions`) reads of the parameter it serves,
and the one attribute it writes, ``unsharded_param``. Both live here, below ``param.py`` and the
sides, so that the imports point one way: ``param`` → ``storage`` / ``extensions`` → ``layout``.

Example:
    >>> import torch
    >>> from fully_shard.layout import ShardLayout
    >>> ShardLayout.chunked(torch.Size([5, 3]), dim=0, world=2, rank=1).local_rows
    2
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .mesh import MeshInfo
from .policies import QuantizationPolicy
from .quantize import GatherFormat
from .spmd import TPLayout


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
        dim_size = size[dim]
        chunk = math.ceil(dim_size / world)
        offset = min(rank * chunk, dim_size)
        local_rows = max(0, min(offset + chunk, dim_size) - offset)
        return cls(world, rank, dim, chunk, local_rows, size)

    @property
    def offset(self) -> int:
        return min(self.rank * self.chunk, self.size[self.dim])

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
