"""``Muon`` on sharded parameters: torch's Muon, each matrix orthogonalized once, whole.

``torch.optim.Muon`` replaces each 2-D weight's momentum by an orthogonalized copy: Newton-
Schulz iterations in bf16 over the *whole* matrix. On ``Shard(0)`` DTensor parameters those
matmuls become sharded DTensor matmuls whose partial bf16 products are summed across ranks,
so the answer changes with the world size. Here the elementwise part (momentum, weight
decay, the update itself) stays on each rank's rows, and the orthogonalization runs once per
matrix, on one owner rank, through :class:`~fully_shard.optim.exchange.WholeMatrixExchange`:

    rank r:  buf_r = lerp(buf_r, g_r, 1 - mu)             (rows_r, d1)  fp32, sharded state
             u_r   = lerp(g_r, buf_r, mu)  (nesterov)     (rows_r, d1)
             u_r.bfloat16() ------ all_to_all ------> owner: U (d0, d1) bf16
                                                            O = NS(U)  (torch's function)
             O_r  <------------ all_to_all ------------- owner: O[rows_r]  bf16
             p_r  = p_r * (1 - lr * wd) - adjusted_lr * O_r

The rows travel in bf16 because torch's Newton-Schulz starts by casting its input to bf16:
sending the cast is bit-for-bit what it would compute on, at half the bytes of fp32. The
result comes back in bf16, the dtype torch adds into the parameter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .. import _compat
from ..errors import FullyShardTypeError, FullyShardValueError
from .exchange import RowSharding, WholeMatrixExchange, row_sharding

__all__ = ["Muon", "newton_schulz", "orthogonalize"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5


def newton_schulz(
    update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """The quintic Newton-Schulz orthogonalization of ``torch.optim.Muon``, in bf16.

    The same operations in the same order as torch 2.13's (so the same bits): cast to bf16,
    work on the wide orientation (transpose a tall matrix), scale to Frobenius norm 1 (at
    least ``eps``), then ``ns_steps`` times ``X <- a X + (b A + c A A) X`` with ``A = X X^T``.
    Used where torch has none (before ``torch.optim.Muon`` existed); :func:`orthogonalize`
    prefers torch's own.

    Example:
        >>> import torch
        >>> o = newton_schulz(torch.randn(4, 8), (3.4445, -4.7750, 2.0315), 5, 1e-7)
        >>> o.dtype, o.shape
        (torch.bfloat16, torch.Size([4, 8]))
    """
    if ns_steps >= 100:
        raise FullyShardValueError(f"ns_steps must be below 100, got {ns_steps}")
    if update.ndim != 2:
        raise FullyShardValueError(f"Newton-Schulz needs a 2-D matrix, got {tuple(update.shape)}")
    a, b, c = ns_coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm = 1
    for _ in range(ns_steps):
        gram = x @ x.T  # (m, m), m = the short side
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A A
        x = torch.addmm(x, poly, x, beta=a)  # a X + poly X
    return x.T if tall else x


def orthogonalize(
    update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> Tensor:
    """Orthogonalize one whole matrix with torch's Newton-Schulz (ours if torch has none).

    Example:
        >>> import torch
        >>> orthogonalize(torch.randn(6, 3), (3.4445, -4.7750, 2.0315), 5, 1e-7).shape
        torch.Size([6, 3])
    """
    fn = _compat.torch_newton_schulz() or newton_schulz
    return fn(update, ns_coefficients, ns_steps, eps)


def newton_schulz_flops(shape: tuple[int, ...], ns_steps: int) -> float:
    """Multiply-adds x 2 of :func:`newton_schulz` on a matrix of ``shape``: the owners' load.

    Per step, with ``m`` the short side and ``n`` the long one: ``X X^T`` (2 m m n),
    ``A A`` (2 m^3), ``poly X`` (2 m m n).
    """
    m, n = sorted(shape[:2])
    return float(ns_steps * (4 * m * m * n + 2 * m**3))


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """torch's Muon learning-rate scale for a ``shape`` matrix (on the *global* shape)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _local(t: Tensor) -> Tensor:
    """This rank's part of ``t`` (its rows, for a sharded DTensor); writes reach ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Matrix:
    """One parameter in one step: where it lives and this rank's rows of its update."""

    param: Tensor
    group: MutableMapping[str, Any]
    sharding: RowSharding | None
    update: Tensor  # (rows_r, d1) bf16: this rank's rows of the momentum update
    columns: bool  # split on dim 1: `update` is this rank's rows of the transpose

    @property
    def exchanged_shape(self) -> tuple[int, ...]:
        """The shape the exchange sees: the parameter's, transposed if split on columns."""
        rows, cols = self.param.shape
        return (cols, rows) if self.columns else (rows, cols)


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon`` for sharded parameters: same arguments, same numbers.

    Given the same gradients, it computes what ``torch.optim.Muon`` computes on the unsharded
    model: momentum and the parameter update stay on each rank's ``Shard(0)`` rows (the
    momentum buffers are sharded DTensors, like AdamW's state, so ``state_dict()`` and DCP
    reshard them), while each matrix's Newton-Schulz orthogonalization runs once in the whole
    job, on an owner rank chosen to balance that work, with torch's own arithmetic. Rows
    travel to the owner and back in two ``all_to_all_single`` per bucket and mesh, in bf16.

    Parameters may be plain tensors (orthogonalized where they are), ``fully_shard``'s (or
    torch's) 1-D ``Shard(0)`` DTensors, or HSDP's ``(Replicate(), Shard(0))`` ones (each
    replica group repeats the same work on the same data, so replicas stay bit-identical);
    parameters on different meshes are exchanged per mesh. Only 2-D parameters are accepted:
    give embeddings, the output head, norms and biases to AdamW.

    Args:
        params: the 2-D parameters (or param groups) to optimize.
        lr: learning rate (a float or a one-element tensor).
        weight_decay: decoupled weight decay, ``p *= 1 - lr * weight_decay``.
        momentum: momentum factor ``mu``.
        nesterov: use ``lerp(g, buf, mu)`` instead of ``buf`` as the update.
        ns_coefficients: the quintic's ``(a, b, c)``.
        eps: the floor of the norm the update is divided by.
        ns_steps: Newton-Schulz iterations (fewer than 100).
        adjust_lr_fn: ``None`` / ``"original"`` (``lr * sqrt(max(1, rows / cols))``) or
            ``"match_rms_adamw"`` (``0.2 * lr * sqrt(max(rows, cols))``).
        buckets: how many pieces each step's exchange is split into, so that sending one
            piece overlaps orthogonalizing another (not part of the state dict).

    Raises:
        FullyShardValueError: a bad hyperparameter, or a parameter that is not 2-D (the
            message names it when the optimizer was given names).
        FullyShardNotImplementedError: a DTensor layout other than rows split over one mesh
            dim (tensor parallelism + FSDP), naming the parameter and its mesh.

    Example:
        >>> import fully_shard
        >>> hidden = [p for n, p in model.named_parameters()  # doctest: +SKIP
        ...           if p.ndim == 2 and "embed" not in n and "output" not in n]
        >>> muon = fully_shard.Muon(hidden, lr=0.02)  # doctest: +SKIP
        >>> adamw = torch.optim.AdamW(rest, lr=3e-4)  # doctest: +SKIP
        >>> loss.backward(); muon.step(); adamw.step()  # doctest: +SKIP
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        buckets: int = 2,
    ) -> None:
        _check_hyperparameters(lr, weight_decay, momentum, adjust_lr_fn, buckets)
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        self.buckets = buckets
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, refusing parameters Muon cannot take before anything is added."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        param_group["params"] = params
        names = list(param_group.get("param_names", []))
        for index, item in enumerate(params):
            # (name, tensor) pairs come from named_parameters(); torch's method unpacks them
            default = names[index] if index < len(names) else f"params[{index}]"
            name, p = item if isinstance(item, tuple) else (default, item)
            _check_param(p, name)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]  # torch's overloads
        """One Muon step on every parameter that has a gradient.

        Every rank of a shard group must call it with gradients on the same parameters (as
        ``fully_shard``'s reduce-scatter leaves them): the exchange is a collective.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:  # every check before any state changes
            _check_newton_schulz(group)
            for p in group["params"]:
                if p.grad is not None:
                    _check_grad(p)
        matrices = [m for group in self.param_groups for m in self._momentum(group)]
        by_mesh: dict[tuple[Any, int] | None, list[_Matrix]] = {}
        for m in matrices:
            by_mesh.setdefault(None if m.sharding is None else m.sharding.key, []).append(m)
        for group_matrices in by_mesh.values():
            self._orthogonalize_and_apply(group_matrices[0].sharding, group_matrices)
        return loss

    def _momentum(self, group: MutableMapping[str, Any]) -> list[_Matrix]:
        """Advance the momentum of ``group``'s parameters with a gradient; their updates."""
        out = []
        mu = group["momentum"]
        for index, p in enumerate(group["params"]):
            if p.grad is None:
                continue  # frozen, or unused this step: skipped, as torch does
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    p.grad, memory_format=torch.preserve_format
                )
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            names = group.get("param_names", [])
            name = names[index] if index < len(names) else f"params[{index}]"
            sharding = row_sharding(p, name)
            # Split on columns: the exchange moves rows, so it gets the transpose, (cols_r, d0).
            columns = sharding is not None and sharding.tensor_dim == 1
            local = update.T if columns else update
            out.append(_Matrix(p, group, sharding, local.bfloat16(), columns))
        return out

    def _orthogonalize_and_apply(
        self, sharding: RowSharding | None, matrices: list[_Matrix]
    ) -> None:
        exchange = WholeMatrixExchange(
            [m.exchanged_shape for m in matrices],
            [newton_schulz_flops(m.exchanged_shape, m.group["ns_steps"]) for m in matrices],
            None if sharding is None or sharding.world == 1 else sharding.group,
            buckets=self.buckets,
        )

        def compute(i: int, whole: Tensor) -> Tensor:
            g, columns = matrices[i].group, matrices[i].columns
            # torch's arithmetic on the matrix as the parameter has it (contiguous, d0 x d1)
            matrix = whole.T.contiguous() if columns else whole
            o = orthogonalize(matrix, tuple(g["ns_coefficients"]), g["ns_steps"], g["eps"])
            return o.T if columns else o

        rows = exchange.run([m.update for m in matrices], compute)
        for m, ortho in zip(matrices, rows, strict=True):
            lr = float(m.group["lr"])
            param = _local(m.param)
            param.mul_(1 - lr * m.group["weight_decay"])
            update = ortho.T if m.columns else ortho
            param.add_(update, alpha=-adjusted_lr(lr, m.group["adjust_lr_fn"], m.param.shape))


def _check_hyperparameters(
    lr: float | Tensor, weight_decay: float, momentum: float, adjust_lr_fn: str | None, buckets: int
) -> None:
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise FullyShardValueError(f"a tensor lr must have one element, got shape {lr.shape}")
    if not lr >= 0.0:
        raise FullyShardValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not momentum >= 0.0:
        raise FullyShardValueError(f"momentum should be >= 0 but is: {momentum}")
    if not weight_decay >= 0.0:
        raise FullyShardValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise FullyShardValueError(
            f"adjust_lr_fn {adjust_lr_fn!r} is not supported: use None, 'original' or "
            "'match_rms_adamw'"
        )
    if not isinstance(buckets, int) or buckets < 1:
        raise FullyShardValueError(f"buckets must be a positive int, got {buckets!r}")


def _check_param(p: Tensor, name: str) -> None:
    if not isinstance(p, Tensor):
        raise FullyShardTypeError(f"Muon optimizes tensors; {name} is a {type(p).__name__}")
    if p.ndim != 2:
        raise FullyShardValueError(
            f"Muon only supports 2D parameters whereas we found a parameter with size: "
            f"{tuple(p.shape)} (parameter {name!r}). Give it to an elementwise optimizer such as "
            "torch.optim.AdamW (embeddings, output head, norms and biases usually are)."
        )
    row_sharding(p, name)  # a layout we cannot gather raises here, before any step


def _check_newton_schulz(group: MutableMapping[str, Any]) -> None:
    if group["ns_steps"] >= 100:
        raise FullyShardValueError(
            f"ns_steps={group['ns_steps']}: Newton-Schulz steps must be fewer than 100"
        )
    if len(group["ns_coefficients"]) != 3:
        raise FullyShardValueError(
            f"ns_coefficients must be three numbers (a, b, c), got {group['ns_coefficients']!r}"
        )


def _check_grad(p: Tensor) -> None:
    if torch.is_complex(p):
        raise FullyShardValueError("Muon does not support complex parameters")
    if p.grad is not None and p.grad.is_sparse:
        raise FullyShardValueError("Muon does not support sparse gradients")
