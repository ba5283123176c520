"""``reshard_after_forward=n``: after forward keep the parameters sharded over n ranks (hpZ).

With W shard ranks and an int n dividing W, a group's forward all-gathers over all W ranks as
usual; after forward each rank keeps, instead of nothing, its piece of the padded parameters
split over its group of n consecutive shard ranks (``1/n`` of the padded size), and
backward all-gathers those pieces within the n ranks. torch 2.13's semantics: ``n == W`` is
``True``, ``n == 1`` is ``False`` (with a warning); ``set_reshard_after_forward`` takes only
a bool and replaces the int.

- parity at W = 4, n = 2 over 2 AdamW steps (the second gathers the pieces of the parameters
  the first one updated; 4 steps in ``nox -s soak``): against an unsharded replica (1-D mesh,
  dims 0 and 1, and a (1, 4) HSDP mesh) and against torch's ``fully_shard`` with the option;
- memory: between forward and backward, each rank holds exactly ``1/n`` of the padded
  parameters and no unsharded storage;
- what the module shows between forward and backward: torch's DTensors on the
  ``(W/n, n)`` mesh, ``(Replicate(), Shard(d))``, each rank's ``torch.chunk`` rows over n,
  side by side with torch's; then the optimizer's sharded DTensors again;
- bytes: forward's all-gather sends ``1/W`` of the padded group per rank over W ranks,
  backward's ``torch.chunk`` pieces over n ranks (at most ``1/n`` of it);
- the corner cases: n == 1 and n == W, ``set_reshard_after_forward``, pieces that went stale,
  tensor-parallel parameters refused before anything changed.
"""

from __future__ import annotations

import copy
import functools
import math
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fully_shard import (
    CountingComm,
    FullyShardNotImplementedError,
    FullyShardValueError,
    fully_shard,
)
from harness import device_mesh, mesh_1d, run_distributed
from matrix import FULL_MATRIX, thinned
from models import MLPStack, ModelArgs, Transformer
from parity import (
    check_parity,
    make_float_batch,
    make_token_batch,
    needs_torch_fsdp2_on_cpu,
    wrap_layers_then_root,
)

WORLD = 4
N = 2
DIMS = [7, 13, 5, 3]  # uneven over 4 ranks and over 2 groups of 2
STEPS = 4 if FULL_MATRIX else 2  # AdamW steps of a training run: a step after a step


def _torch_fully_shard(*args: Any, **kwargs: Any) -> Any:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard(*args, **kwargs)


def _impl(name: str) -> Any:
    return fully_shard if name == "ours" else _torch_fully_shard


def _build(model: str) -> nn.Module:
    if model == "transformer":
        return Transformer(ModelArgs(n_layers=3))
    return MLPStack(DIMS, activation="tanh")


def _batch(model: str) -> Any:
    if model == "transformer":
        return make_token_batch
    return functools.partial(make_float_batch, in_dim=DIMS[0], out_dim=DIMS[-1])


def _placement(dim: int) -> Any:
    return None if dim == 0 else (lambda p: Shard(dim) if p.dim() > dim else None)


def _parity(impl: str, model: str, shard_dim: int, mesh_shape: tuple[int, ...]) -> Any:
    shard = wrap_layers_then_root(
        _impl(impl), reshard_after_forward=N, shard_placement_fn=_placement(shard_dim)
    )
    mesh = device_mesh(mesh_shape)
    return check_parity(lambda: _build(model), shard, _batch(model), mesh, steps=STEPS)


_PARITY = [
    ("mlp", 0, (WORLD,)),
    ("transformer", 0, (WORLD,)),
    ("mlp", 1, (WORLD,)),
    ("transformer", 0, (1, WORLD)),  # HSDP: replicate 1, shard 4
]


# The transformer on the 1-D mesh in nox -s soak only: in the suite it trains on the (1, W) HSDP
# mesh, whose shard dim is the same W ranks split in groups of n, and the MLP on the 1-D mesh.
@pytest.mark.parametrize(
    ("model", "shard_dim", "mesh_shape"),
    thinned(_PARITY, [_PARITY[0], *_PARITY[2:]]),
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else None,
)
def test_parity_with_the_unsharded_model(
    model: str, shard_dim: int, mesh_shape: tuple[int, ...]
) -> None:
    for stats in run_distributed(_parity, WORLD, "ours", model, shard_dim, mesh_shape):
        assert stats["zero_grad_params"] == []


def _train(impl: str, model: str) -> dict[str, Any]:
    """A few AdamW steps of the sharded model alone: losses and final full parameters."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = _build(model)
    wrap_layers_then_root(_impl(impl), reshard_after_forward=N)(net, mesh_1d())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = _batch(model)(WORLD * 2, gen)
        out = net(x[rank * 2 : rank * 2 + 2])
        if model == "transformer":
            loss = F.cross_entropy(out.flatten(0, 1), y[rank * 2 : rank * 2 + 2].flatten())
        else:
            loss = F.mse_loss(out, y[rank * 2 : rank * 2 + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": {n: p.full_tensor() for n, p in net.named_parameters()},  # type: ignore[attr-defined]
    }


def _train_both(model: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return _train("ours", model), _train("torch", model)


@needs_torch_fsdp2_on_cpu
# Against torch on the MLP in the suite (the transformer trains against the unsharded model
# above), on both in nox -s soak.
@pytest.mark.parametrize("model", thinned(["mlp", "transformer"], ["mlp"]))
def test_matches_torch_fully_shard_with_the_same_option(model: str) -> None:
    # torch's passes the same parity check...
    for stats in run_distributed(_parity, WORLD, "torch", model, 0, (WORLD,)):
        assert stats["zero_grad_params"] == []
    # ...and the two agree with each other, rank by rank (one job trains both)
    for a, b in run_distributed(_train_both, WORLD, model):
        torch.testing.assert_close(a["losses"], b["losses"], atol=1e-6, rtol=1e-5)
        for name, p in b["params"].items():
            torch.testing.assert_close(a["params"][name], p, atol=1e-6, rtol=1e-5, msg=name)


# -- memory ----------------------------------------------------------------------------------


def _padded_numel(shape: torch.Size, world: int) -> int:
    return math.ceil(shape[0] / world) * world * math.prod(shape[1:])


def _between_forward_and_backward(flag: bool | int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLPStack([8, 8, 8, 8], activation="tanh")  # every dim divides by 4
    for block in model.layers:
        fully_shard(block, mesh=mesh_1d(), reshard_after_forward=flag)
    fully_shard(model, mesh=mesh_1d())
    loss = model(torch.randn(2, 8)).sum()
    blocks = [block._fsdp_state.group for block in model.layers]  # type: ignore[union-attr]
    seen = {
        "piece_bytes": [g.post_forward_nbytes() for g in blocks],
        "padded_bytes": [
            sum(_padded_numel(p.orig_size, WORLD) * 4 for p in g.params) for g in blocks
        ],
        "storage_alive": [any(p.storage_allocated() for p in g.params) for g in blocks],
        "shows_sharded": [
            all(isinstance(t, DTensor) for t in block.parameters()) for block in model.layers
        ],
    }
    loss.backward()
    seen["piece_bytes_after"] = [g.post_forward_nbytes() for g in blocks]
    seen["storage_alive_after"] = [any(p.storage_allocated() for p in g.params) for g in blocks]
    return seen


@pytest.mark.parametrize(("flag", "held"), [(N, 1 / N), (True, 0.0), (False, 0.0)])
def test_between_forward_and_backward_a_rank_holds_one_nth_of_the_padded_parameters(
    flag: bool | int, held: float
) -> None:
    for seen in run_distributed(_between_forward_and_backward, WORLD, flag):
        assert seen["piece_bytes"] == [int(b * held) for b in seen["padded_bytes"]]
        # False keeps the whole unsharded storage; True and an int free it
        assert seen["storage_alive"] == [flag is False] * 3
        assert seen["shows_sharded"] == [flag is not False] * 3
        # after backward nothing of either kind is left
        assert seen["piece_bytes_after"] == [0, 0, 0]
        assert seen["storage_alive_after"] == [False, False, False]


def _shown_between_forward_and_backward(impl: str, dims: list[int]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLPStack(dims, activation="tanh")
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrap_layers_then_root(_impl(impl), reshard_after_forward=N)(model, mesh_1d())
    sharded = dict(model.named_parameters())
    loss = model(torch.randn(2, dims[0])).sum()
    shown = {}
    for name, p in model.named_parameters():
        if not name.startswith("layers."):
            continue  # the root keeps its parameters gathered (reshard_after_forward=False)
        assert isinstance(p, DTensor)
        shown[name] = {
            "mesh": tuple(p.device_mesh.shape),
            "mesh_ranks": p.device_mesh.mesh.tolist(),
            "placements": tuple(p.placements),
            "local": tuple(p.to_local().shape),
            "is_sharded": p is sharded[name],
            "values_exact": bool(torch.equal(p.full_tensor(), full[name])),
        }
    loss.backward()
    after = all(p is sharded[n] for n, p in model.named_parameters())
    return {"shown": shown, "sharded_again": after}


def _shown_both(dims: list[int]) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        _shown_between_forward_and_backward("ours", dims),
        _shown_between_forward_and_backward("torch", dims),
    )


@needs_torch_fsdp2_on_cpu
@pytest.mark.parametrize("dims", [[8, 8, 8, 8], DIMS], ids=["even", "uneven"])
def test_between_forward_and_backward_the_module_shows_the_n_rank_dtensors_as_torch(
    dims: list[int],
) -> None:
    both = run_distributed(_shown_both, WORLD, dims)  # one job: ours, then torch's
    for rank, (a, b) in enumerate(both):
        assert a["sharded_again"] and b["sharded_again"]
        assert a["shown"].keys() == b["shown"].keys()
        for name, got in a["shown"].items():
            want = b["shown"][name]
            shard_dim = got["placements"][1].dim
            assert got["mesh"] == want["mesh"] == (WORLD // N, N), name
            assert got["mesh_ranks"] == want["mesh_ranks"] == [[0, 1], [2, 3]], name
            assert got["placements"] == want["placements"] == (Replicate(), Shard(0)), name
            # each rank holds its torch.chunk rows over its group of n
            assert got["local"] == want["local"], (rank, name)
            assert shard_dim == 0 and not got["is_sharded"], name
            # ours are the parameter's values; torch's are too when n divides every dim
            # evenly into W-padded chunks, and off by padding rows otherwise (migrating.md)
            assert got["values_exact"], (rank, name)
            if dims == [8, 8, 8, 8]:
                assert want["values_exact"], (rank, name)


# -- bytes -----------------------------------------------------------------------------------


class GroupSizeComm(CountingComm):
    """Also records the size of the process group each all-gather ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers: list[tuple[int, int, str]] = []  # (group size, bytes sent, dtype)

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
    ) -> Any:
        self.gathers.append((group.size(), input.numel() * input.element_size(), str(input.dtype)))
        return super().all_gather(output, input, group, async_op)


def _gathers(flag: bool | int, *, set_after: bool | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in model.layers:
            fully_shard(block, mesh=mesh_1d(), reshard_after_forward=flag)
    fully_shard(model, mesh=mesh_1d())
    if set_after is not None:
        model.set_reshard_after_forward(set_after, True)  # type: ignore[operator]  # torch's positional recurse
    comm = GroupSizeComm()
    model.set_comm(comm)  # type: ignore[operator]
    model(torch.randn(2, DIMS[0])).sum().backward()
    shapes = [[tuple(p.orig_size) for p in b._fsdp_state.group.params] for b in model.layers]  # type: ignore[union-attr]
    return {"gathers": comm.gathers, "shapes": shapes, "warnings": [str(w.message) for w in caught]}


def _group_bytes(shapes: list[tuple[int, ...]], over: int) -> int:
    """Bytes one rank sends for a group whose parameters are split like ``torch.chunk`` over
    ``over`` ranks: one padded chunk each (the W-rank shard, or the n-rank post-forward piece,
    which is never more than ``1/n`` of the W-padded parameter)."""
    return sum(_padded_numel(torch.Size(s), over) * 4 // over for s in shapes)


def _expected(shapes: list[list[tuple[int, ...]]], backward_world: int | None) -> list[Any]:
    forward = [(WORLD, _group_bytes(s, WORLD), "torch.float32") for s in shapes]
    if backward_world is None:
        return forward
    backward = [(backward_world, _group_bytes(s, backward_world), "torch.float32") for s in shapes]
    return forward + backward[::-1]


@pytest.mark.parametrize(
    ("flag", "set_after", "backward_world"),
    [
        (N, None, N),  # backward gathers torch.chunk(P, n) pieces, padded, within n ranks
        (WORLD, None, WORLD),  # n == W is True
        (True, None, WORLD),
        (N, True, WORLD),  # set_reshard_after_forward(True) replaces the int
        (N, False, None),  # ... and False keeps the parameters: no backward all-gather
        (False, None, None),
    ],
)
def test_backward_all_gather_moves_the_n_group_bytes(
    flag: bool | int, set_after: bool | None, backward_world: int | None
) -> None:
    for got in run_distributed(_gathers, WORLD, flag, set_after=set_after):
        assert got["gathers"] == _expected(got["shapes"], backward_world)
        assert got["warnings"] == []


def test_n_equal_1_keeps_the_parameters_like_false_and_says_so() -> None:
    for got in run_distributed(_gathers, WORLD, 1):
        assert got["gathers"] == _expected(got["shapes"], None)
        assert len(got["warnings"]) == 3  # one per fully_shard call
        assert "reshard_after_forward=1" in got["warnings"][0]
        assert "like reshard_after_forward=False" in got["warnings"][0]


# -- stale pieces, errors ----------------------------------------------------------------------


def _stale_pieces() -> bool:
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    for block in model.layers:
        fully_shard(block, mesh=mesh_1d(), reshard_after_forward=N)
    fully_shard(model, mesh=mesh_1d())
    sharded = list(model.parameters())  # what an optimizer holds
    block = model.layers[0]
    block_sharded = dict(block.named_parameters())
    model(torch.randn(2, DIMS[0])).sum()  # forward that needs grad, no backward: pieces kept
    assert block._fsdp_state.group.post_forward_nbytes() > 0  # type: ignore[union-attr]
    with torch.no_grad():
        for p in sharded:
            p.add_(0.5)  # the pieces are now stale
    # the module still shows the (stale) post-forward pieces; the sharded ones are what counts
    want = {n: p.full_tensor() for n, p in block_sharded.items()}  # type: ignore[attr-defined]
    block.unshard()  # type: ignore[operator]
    return all(torch.equal(p, want[n]) for n, p in block.named_parameters())


def test_pieces_that_went_stale_are_not_gathered() -> None:
    assert run_distributed(_stale_pieces, WORLD) == [True] * WORLD


def _to_between_forward_and_backward() -> bool:
    torch.manual_seed(0)
    model = MLPStack(DIMS, activation="tanh")
    full = {n: p.detach().double() for n, p in model.named_parameters()}
    wrap_layers_then_root(fully_shard, reshard_after_forward=N)(model, mesh_1d())
    model(torch.randn(2, DIMS[0])).sum()  # pieces shown, no backward
    model.double()  # converts the sharded DTensors, not the pieces
    shards = [p.to_local().shape[0] for p in model.parameters()]  # type: ignore[attr-defined]
    rank = dist.get_rank()
    chunks = [math.ceil(t.shape[0] / WORLD) for t in full.values()]
    want = [
        max(0, min((rank + 1) * c, t.shape[0]) - min(rank * c, t.shape[0]))
        for c, t in zip(chunks, full.values(), strict=True)
    ]  # this rank's rows of the W-rank split (torch.chunk)
    exact = all(
        p.dtype == torch.float64 and torch.equal(p.full_tensor(), full[n])  # type: ignore[attr-defined]
        for n, p in model.named_parameters()
    )
    model(torch.randn(2, DIMS[0], dtype=torch.float64)).sum().backward()
    return exact and shards == want


def test_to_between_forward_and_backward_converts_the_sharded_parameters() -> None:
    assert run_distributed(_to_between_forward_and_backward, WORLD) == [True] * WORLD


def _copies() -> bool:
    model = MLPStack(DIMS)
    fully_shard(model, mesh=mesh_1d(), reshard_after_forward=N)
    # the mesh now caches its subgroups: it must still pickle (torch.compile, DCP planners)
    # and its DTensors still deep-copy
    clone = pickle.loads(pickle.dumps(mesh_1d()))
    param = copy.deepcopy(next(model.parameters()))
    return bool(clone == mesh_1d() and isinstance(param, DTensor))


def test_a_mesh_with_subgroups_still_pickles_and_its_dtensors_copy() -> None:
    assert run_distributed(_copies, WORLD) == [True] * WORLD


def _errors() -> list[str]:
    out = []
    model = MLPStack(DIMS)
    fully_shard(model, mesh=mesh_1d(), reshard_after_forward=N)
    try:
        model.set_reshard_after_forward(N)  # type: ignore[operator]
    except FullyShardValueError as e:
        out.append(str(e))
    # A tensor-parallel parameter: a (dp=4, tp=1) mesh, so n=2 is a real resharding
    root = device_mesh((WORLD, 1), ("dp", "tp"))
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), root["tp"], [Shard(0)]))
    before = type(lin)
    try:
        fully_shard(lin, mesh=root["dp"], reshard_after_forward=N)
    except FullyShardNotImplementedError as e:
        out.append(str(e))
    out.append(str(type(lin) is before and not isinstance(lin.bias, DTensor)))
    return out


def test_errors_say_what_to_do() -> None:
    for got in run_distributed(_errors, WORLD):
        assert got == [
            "set_reshard_after_forward takes a bool (as torch's does), got 2; to reshard to "
            "groups of n ranks after forward pass reshard_after_forward=n to fully_shard",
            "reshard_after_forward=2 with tensor-parallel parameter 'weight' is not supported "
            "(nor by torch's fully_shard); pass True or False for the modules with "
            "tensor-parallel parameters",
            "True",
        ]
