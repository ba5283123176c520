"""Parametrizations the suite thins and ``nox -s soak`` runs in full.

The suite must stay within its time budget, so a product of options that the engine treats
independently runs as an *all-pairs* subset: every value of every axis meets every value of
every other axis at least once (a bug that needs two options together is still caught; one
that needs three particular values at once is left to the soak). ``nox -s soak`` sets
``FULLY_SHARD_FULL_MATRIX=1`` and gets the whole product.

Usage, in a test module::

    from matrix import pairwise

    @pytest.mark.parametrize(("world", "model", "pattern"), pairwise([1, 2, 4], MODELS, PATTERNS))
    def test_x(world, model, pattern): ...
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["FULL_MATRIX", "pairwise", "thinned"]

#: ``nox -s soak``: every parametrization in full.
FULL_MATRIX = os.environ.get("FULLY_SHARD_FULL_MATRIX") == "1"


def pairwise(*axes: Sequence[Any]) -> list[tuple[Any, ...]]:
    """An all-pairs subset of ``itertools.product(*axes)``, in product order (the whole
    product under ``FULLY_SHARD_FULL_MATRIX=1``).

    Greedy and deterministic: it walks the product and keeps each combination that covers a
    pair of values not yet covered, taking first the combinations that cover the most.

    >>> len(pairwise([1, 2, 3, 4], ["a", "b"], ["x", "y", "z"])) < 24
    True
    """
    product = list(itertools.product(*axes))
    if FULL_MATRIX or len(axes) < 3:
        return product

    def pairs(combo: tuple[Any, ...]) -> set[tuple[int, int, int, int]]:
        index = [axis.index(value) for axis, value in zip(axes, combo, strict=True)]
        return {(i, index[i], j, index[j]) for i, j in itertools.combinations(range(len(axes)), 2)}

    uncovered = set().union(*(pairs(c) for c in product))
    kept: list[tuple[Any, ...]] = []
    while uncovered:
        best = max(product, key=lambda c: len(pairs(c) & uncovered))
        kept.append(best)
        uncovered -= pairs(best)
    return sorted(kept, key=product.index)


def thinned(full: Sequence[Any], kept: Sequence[Any]) -> list[Any]:
    """``kept`` (a subset of ``full``) in the suite, ``full`` under ``FULLY_SHARD_FULL_MATRIX=1``.

    >>> thinned([1, 2, 3], [1, 3]) == ([1, 2, 3] if FULL_MATRIX else [1, 3])
    True
    """
    missing = [k for k in kept if k not in full]
    if missing:
        raise ValueError(f"thinned: {missing} are not in the full list")
    return list(full) if FULL_MATRIX else list(kept)
