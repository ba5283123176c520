"""The whole-matrix exchange: gather each row-sharded matrix on one owner rank, compute, send back.

An optimizer whose update of a matrix depends on the whole matrix (Muon's Newton-Schulz
orthogonalization, Shampoo's preconditioners, Adafactor's factored second moments) cannot run
on the ``Shard(0)`` rows each rank holds. Gathering every matrix on every rank would make W
copies of the same work. Instead each matrix gets one *owner*:

1. :func:`assign_owners` spreads the matrices over the W ranks of the shard group by the work
   each costs (greedy, largest first onto the least-loaded rank), the same on every rank
   because it is a function of the shapes alone;
2. :meth:`WholeMatrixExchange.run` sends every rank's rows of matrix ``i`` to its owner (one
   ``all_to_all_single`` per bucket for all the matrices in it), calls
   ``compute(i, whole)`` on the owner only, and sends each rank its rows of the result (one
   more ``all_to_all_single`` per bucket).

Buckets pipeline the three acts: every bucket's gather is issued at once (async), and while
bucket ``b`` is computed the gathers of later buckets and the send-back of earlier ones are in
flight.

Rows split like ``torch.chunk`` (and ``Shard(0)``): with ``c = ceil(d0 / W)`` rank ``r`` holds
rows ``[r * c, min((r + 1) * c, d0))``, so trailing ranks may hold fewer rows or none.

Bytes per step, summed over the group, for matrices ``i`` of shape ``(d0_i, d1_i)``:
``sum_i (d0_i - rows_of_owner_i) * d1_i * (in_itemsize + out_itemsize)`` (each row that does
not already live on the owner travels there once and its result travels back once);
:meth:`WholeMatrixExchange.planned_bytes` computes it per rank.

To build another whole-matrix optimizer on it: keep the elementwise state sharded as usual,
make the per-matrix input on each rank's rows (a local tensor of ``(rows, d1)``), build one
exchange per shard group with the shapes and a cost per matrix, and call :meth:`run` with a
``compute`` that maps a whole input to a whole result of the same shape; what comes back is
each rank's rows of every result. :func:`row_sharding` tells which shard group a parameter's
rows are split over.

Example:
    >>> import torch
    >>> from fully_shard.optim.exchange import assign_owners
    >>> assign_owners([1.0, 8.0, 3.0, 3.0], world=2)  # 8 alone; 3 + 3 + 1 on the other
    [1, 0, 1, 1]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import FullyShardNotImplementedError, FullyShardValueError
from ..layout import split_rows

__all__ = ["RowSharding", "WholeMatrixExchange", "assign_owners", "row_bounds", "row_sharding"]

Compute = Callable[[int, torch.Tensor], torch.Tensor]
"""``compute(index, whole) -> result``: the whole-matrix work, run on the owner only."""


def assign_owners(costs: Sequence[float], world: int) -> list[int]:
    """The owner rank of each matrix: largest cost first, onto the least-loaded rank.

    Deterministic (ties go to the lower index and the lower rank), so every rank that calls it
    with the same costs gets the same owners and no rank needs to tell the others.

    Example:
        >>> assign_owners([4.0, 4.0, 4.0], world=2)
        [0, 1, 0]
    """
    if world < 1:
        raise FullyShardValueError(f"world must be at least 1, got {world}")
    load = [0.0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def row_bounds(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows ``rank`` holds when ``rows`` split like ``torch.chunk``.

    Example:
        >>> [row_bounds(5, 4, r) for r in range(4)]  # chunks of 2: the last rank holds none
        [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    split = split_rows(rows, world, rank)
    return split.start, split.stop


@dataclass(frozen=True)
class RowSharding:
    """Which shard group a parameter's rows are split over.

    Attributes:
        mesh: the parameter's mesh.
        shard_dim: the mesh dim whose ranks each hold a ``Shard(0)`` slice of rows; the other
            dims (HSDP's replicate dim) hold identical copies, and each copy runs its own
            exchange on identical data, so the copies stay bit-identical.
        tensor_dim: the tensor dim that is split: 0 (rows), or 1 for a 2-D parameter sharded
            on its columns (``fully_shard(..., shard_placement_fn=lambda p: Shard(1))``),
            whose transpose the exchange then sees as rows.
    """

    mesh: DeviceMesh
    shard_dim: int
    tensor_dim: int = 0

    @property
    def key(self) -> tuple[DeviceMesh, int]:
        """What parameters exchanged together share: the mesh and its shard dim."""
        return self.mesh, self.shard_dim

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group of the shard dim."""
        return self.mesh.get_group(self.shard_dim)

    @property
    def world(self) -> int:
        """How many ranks the rows split over."""
        return int(self.mesh.size(self.shard_dim))


def row_sharding(param: torch.Tensor, name: str) -> RowSharding | None:
    """How ``param``'s rows are split, or ``None`` if this rank holds it whole.

    A plain tensor, or a DTensor replicated on every mesh dim, is whole here. A DTensor with
    ``Shard(0)`` on one mesh dim and ``Replicate()`` on the others (``fully_shard``'s 1-D and
    HSDP layouts, and torch's) splits over that dim; so does a 2-D one with ``Shard(1)``
    there instead (``tensor_dim=1``).

    Raises:
        FullyShardNotImplementedError: any other layout (tensor parallelism + FSDP: two shard
            dims, a strided shard, ``Partial``), naming ``name`` and the mesh.
    """
    if not isinstance(param, DTensor):
        return None
    shard_dims = [
        d
        for d, p in enumerate(param.placements)
        if type(p) is Shard and (p.dim == 0 or (p.dim == 1 and param.ndim == 2))
    ]
    others = [
        p
        for d, p in enumerate(param.placements)
        if d not in shard_dims and type(p) is not Replicate
    ]
    if len(shard_dims) > 1 or others:
        raise FullyShardNotImplementedError(
            f"parameter {name!r} (shape {tuple(param.shape)}) is laid out as "
            f"{tuple(param.placements)} on mesh {param.device_mesh}: only one dim split over one "
            "mesh dim (Shard(0) or Shard(1), other dims Replicate(): fully_shard's 1-D and "
            "HSDP layouts) can be gathered whole. For tensor parallelism + FSDP, give this "
            "parameter to an elementwise optimizer (AdamW) or keep it out of tensor parallelism."
        )
    if not shard_dims:
        return None
    placement = cast(Shard, param.placements[shard_dims[0]])  # a Shard: chosen by type above
    return RowSharding(param.device_mesh, shard_dims[0], placement.dim)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


class WholeMatrixExchange:
    """Gather row-sharded matrices whole on their owners, compute there, send the rows back.

    Built from the global shapes (dim 0 is split over ``group``; trailing dims are kept) and a
    cost per matrix; every rank of ``group`` must build it with the same arguments and call
    :meth:`run` with its own rows of each matrix, in the same order.

    Args:
        shapes: each matrix's global shape.
        costs: each matrix's work (any unit): owners are balanced by it.
        group: the process group the rows are split over; ``None``: every matrix is whole on
            this rank (a plain or replicated parameter), computed here, nothing sent.
        buckets: how many collectives each direction is split into, so that communication
            overlaps the computation of earlier buckets (at most the matrices one rank owns).

    Example:
        >>> shapes, costs = [(8, 4), (6, 6)], [1.0, 2.0]
        >>> ex = WholeMatrixExchange(shapes, costs, mesh.get_group())  # doctest: +SKIP
        >>> mine = ex.run([w1.to_local(), w2.to_local()], lambda i, m: m * 2)  # doctest: +SKIP
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        costs: Sequence[float],
        group: dist.ProcessGroup | None = None,
        *,
        buckets: int = 1,
    ) -> None:
        if len(shapes) != len(costs):
            raise FullyShardValueError(f"{len(shapes)} shapes but {len(costs)} costs")
        if buckets < 1:
            raise FullyShardValueError(f"buckets must be at least 1, got {buckets}")
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.group = group
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.owners = assign_owners(costs, self.world)
        self.buckets = self._split_buckets(buckets)
        #: bytes this rank sent to other ranks in its last :meth:`run` (both directions).
        self.sent_bytes = 0

    def _split_buckets(self, buckets: int) -> list[list[int]]:
        """Bucket ``b`` takes the ``b``-th share of each owner's matrices (in owner order)."""
        by_owner: dict[int, list[int]] = {}
        for i in sorted(range(len(self.shapes)), key=lambda i: self.owners[i]):
            by_owner.setdefault(self.owners[i], []).append(i)
        n = max(1, min(buckets, max((len(v) for v in by_owner.values()), default=1)))
        out: list[list[int]] = [[] for _ in range(n)]
        for owned in by_owner.values():
            for k, i in enumerate(owned):
                out[k * n // len(owned)].append(i)
        return [sorted(b) for b in out if b]

    def rows(self, i: int, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of matrix ``i``'s rows that ``rank`` holds."""
        return row_bounds(self.shapes[i][0], self.world, rank)

    def _row_numel(self, i: int) -> int:
        return _numel(self.shapes[i][1:])

    def _local_numel(self, i: int, rank: int) -> int:
        start, stop = self.rows(i, rank)
        return (stop - start) * self._row_numel(i)

    def planned_bytes(self, in_itemsize: int, out_itemsize: int) -> int:
        """Bytes this rank sends to others per :meth:`run`: its rows of every matrix it does
        not own (there), and the other ranks' rows of every result it owns (back)."""
        sent = 0
        for i, owner in enumerate(self.owners):
            mine = self._local_numel(i, self.rank)
            if owner == self.rank:
                sent += (_numel(self.shapes[i]) - mine) * out_itemsize
            else:
                sent += mine * in_itemsize
        return sent

    def owned(self) -> list[int]:
        """The indices of the matrices this rank computes."""
        return [i for i, o in enumerate(self.owners) if o == self.rank]

    def run(
        self,
        shards: Sequence[torch.Tensor],
        compute: Compute,
        *,
        out_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """Compute every matrix once, on its owner; return this rank's rows of each result.

        Args:
            shards: this rank's rows of each matrix, ``(rows_i, *shape_i[1:])``, one dtype.
            compute: ``compute(i, whole)`` returns the whole result of matrix ``i`` (its
                global shape); called only for the matrices this rank owns.
            out_dtype: the results' dtype (default: the shards'); the result of ``compute`` is
                cast to it before it is sent.
        """
        self._check_shards(shards)
        if not shards:
            return []
        dtype = shards[0].dtype
        out_dtype = dtype if out_dtype is None else out_dtype
        self.sent_bytes = 0
        if self.world == 1:
            return [self._checked(i, compute(i, s), out_dtype) for i, s in enumerate(shards)]
        gathers = [self._gather(bucket, shards) for bucket in self.buckets]
        sends = []
        for bucket, pending in zip(self.buckets, gathers, strict=True):
            wholes = pending.wait()
            done = {i: self._checked(i, compute(i, w), out_dtype) for i, w in wholes.items()}
            sends.append(self._send_back(bucket, done, out_dtype, shards[0].device))
        results: dict[int, torch.Tensor] = {}
        for pending_back in sends:
            results.update(pending_back.wait())
        if len(results) != len(shards):
            raise RuntimeError(
                f"rank {self.rank}: the exchange returned {len(results)} of {len(shards)} "
                "matrices (an internal error: buckets do not cover every matrix)"
            )
        return [results[i] for i in range(len(shards))]

    def _check_shards(self, shards: Sequence[torch.Tensor]) -> None:
        if len(shards) != len(self.shapes):
            raise FullyShardValueError(f"{len(shards)} shards for {len(self.shapes)} matrices")
        for i, s in enumerate(shards):
            start, stop = self.rows(i, self.rank)
            want = (stop - start, *self.shapes[i][1:])
            if tuple(s.shape) != want:
                raise FullyShardValueError(
                    f"rank {self.rank}: matrix {i} of global shape {self.shapes[i]} should have "
                    f"local shape {want} (rows split like torch.chunk over {self.world} ranks), "
                    f"got {tuple(s.shape)}"
                )
            if s.dtype != shards[0].dtype:
                raise FullyShardValueError(
                    f"every shard of one exchange needs one dtype: {shards[0].dtype} and {s.dtype}"
                )

    def _checked(self, i: int, result: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if tuple(result.shape) != self.shapes[i]:
            raise FullyShardValueError(
                f"compute({i}, ...) returned shape {tuple(result.shape)}; the exchange sends "
                f"back rows of a result shaped like its input, {self.shapes[i]}"
            )
        return result.to(dtype)

    def _gather(self, bucket: list[int], shards: Sequence[torch.Tensor]) -> _Pending:
        """Send this rank's rows of each matrix in ``bucket`` to its owner (async)."""
        by_dest = [[i for i in bucket if self.owners[i] == d] for d in range(self.world)]
        inp = torch.cat(
            [shards[i].reshape(-1) for dest in by_dest for i in dest] or [shards[0].new_empty(0)]
        )
        in_splits = [sum(self._local_numel(i, self.rank) for i in dest) for dest in by_dest]
        mine = by_dest[self.rank]
        out_splits = [sum(self._local_numel(i, src) for i in mine) for src in range(self.world)]
        out = inp.new_empty(sum(out_splits))
        work = dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=self.group, async_op=True
        )
        self.sent_bytes += (sum(in_splits) - in_splits[self.rank]) * inp.element_size()

        def unpack() -> dict[int, torch.Tensor]:
            wholes = {i: out.new_empty(self.shapes[i]) for i in mine}
            offset = 0
            for src in range(self.world):
                for i in mine:
                    start, stop = self.rows(i, src)
                    n = self._local_numel(i, src)
                    wholes[i][start:stop].reshape(-1).copy_(out[offset : offset + n])
                    offset += n
            return wholes

        return _Pending(work, unpack, inp)

    def _send_back(
        self,
        bucket: list[int],
        results: Mapping[int, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> _Pending:
        """Send each rank its rows of the results this rank computed in ``bucket`` (async)."""
        mine = [i for i in bucket if self.owners[i] == self.rank]
        parts = []
        for dest in range(self.world):
            for i in mine:
                start, stop = self.rows(i, dest)
                parts.append(results[i][start:stop].reshape(-1))
        inp = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
        in_splits = [sum(self._local_numel(i, d) for i in mine) for d in range(self.world)]
        by_src = [[i for i in bucket if self.owners[i] == s] for s in range(self.world)]
        out_splits = [sum(self._local_numel(i, self.rank) for i in src) for src in by_src]
        out = torch.empty(sum(out_splits), dtype=dtype, device=device)
        work = dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=self.group, async_op=True
        )
        self.sent_bytes += (sum(in_splits) - in_splits[self.rank]) * inp.element_size()

        def unpack() -> dict[int, torch.Tensor]:
            pieces, offset = {}, 0
            for src in by_src:
                for i in src:
                    start, stop = self.rows(i, self.rank)
                    n = self._local_numel(i, self.rank)
                    pieces[i] = out[offset : offset + n].view(stop - start, *self.shapes[i][1:])
                    offset += n
            return pieces

        return _Pending(work, unpack, inp)


class _Pending:
    """A collective in flight and how to read its output once it has landed."""

    def __init__(
        self,
        work: dist.Work | None,
        unpack: Callable[[], dict[int, torch.Tensor]],
        sent: torch.Tensor,
    ) -> None:
        self._work = work
        self._unpack = unpack
        # The input must outlive the collective: on a GPU the caching allocator could hand its
        # memory to the next bucket's packing while NCCL still reads it.
        self._sent: torch.Tensor | None = sent

    def wait(self) -> dict[int, torch.Tensor]:
        if self._work is not None:
            self._work.wait()
        self._sent = None
        return self._unpack()
