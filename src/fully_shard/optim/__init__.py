"""``fully_shard.optim``: optimizers whose update needs each matrix whole, on sharded parameters.

Elementwise optimizers (SGD, Adam, AdamW, ...) are exact on ``Shard(0)`` DTensor parameters
as they are: each rank updates its rows. An optimizer that computes on a whole matrix is not:
:class:`Muon` is torch's Muon made exact, on :class:`WholeMatrixExchange` (gather each
matrix on one owner rank, compute there once, send the rows back), which another
whole-matrix optimizer can reuse. docs/optimizers.md has the table of which torch optimizers
are safe on shards and why.

It is a tool beside the engine: it reads parameters as the public DTensors they are and
imports nothing of the engine but the row split (:func:`fully_shard.layout.split_rows`).

Example:
    >>> from fully_shard.optim import Muon
    >>> muon = Muon(hidden_matrices, lr=0.02)  # doctest: +SKIP
"""

from __future__ import annotations

from .exchange import RowSharding, WholeMatrixExchange, assign_owners, row_bounds, row_sharding
from .muon import Muon, newton_schulz, orthogonalize

__all__ = [
    "Muon",
    "RowSharding",
    "WholeMatrixExchange",
    "assign_owners",
    "newton_schulz",
    "orthogonalize",
    "row_bounds",
    "row_sharding",
]
