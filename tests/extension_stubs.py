"""Tensor subclasses that implement torch's all-gather extension hooks, for the tests.

- ``Int8BlockWeight``: a complete one, an fp32 master weight that all-gathers as int8 values
  plus fp32 block scales (``quantize_rows`` / ``dequantize_rows``), logging every hook call;
  ``QMLP`` is the model that uses it (``convert`` swaps its weights in) and ``fake_quant`` the
  same transform on an unsharded reference. tests/test_extensions.py checks parity and every
  argument of the protocol with it, tests/test_error_classes.py what torch does with it.
- ``PreOnly`` and ``BadSignature``: incomplete or mis-declared hooks. ``fully_shard`` must
  refuse them before anything changes; tests/test_extensions.py checks our messages,
  tests/test_error_classes.py what torch's ``fully_shard`` does with the same tensors.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

__all__ = [
    "BLOCK",
    "HIDDEN",
    "IN",
    "OUT",
    "QMLP",
    "BadSignature",
    "Int8BlockWeight",
    "PreOnly",
    "QLinear",
    "convert",
    "dequantize_rows",
    "fake_quant",
    "quantize_rows",
]

BLOCK = 4
IN, HIDDEN, OUT = 6, 7, 5  # 7 and 5 rows split unevenly over 2 and 3 ranks


# -- the int8 transform ------------------------------------------------------------------------


def quantize_rows(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values ``(rows, cols)`` and fp32 scales ``(rows, ceil(cols / block))`` of ``w``."""
    rows, cols = w.shape
    nb = math.ceil(cols / block)
    padded = F.pad(w.detach().float(), (0, nb * block - cols)).view(rows, nb, block)
    scales = padded.abs().amax(dim=2) / 127  # (rows, nb)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.round(padded / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return values.view(rows, nb * block)[:, :cols].contiguous(), scales


def dequantize_rows(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = BLOCK
) -> torch.Tensor:
    rows, cols = values.shape
    nb = scales.size(1)
    padded = F.pad(values.float(), (0, nb * block - cols)).view(rows, nb, block)
    return (padded * scales[..., None]).view(rows, nb * block)[:, :cols].to(dtype).contiguous()


def fake_quant(w: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(w))`` with a straight-through gradient: the reference's weight."""
    q = dequantize_rows(*quantize_rows(w), dtype=w.dtype)
    return w + (q - w).detach()


# -- the complete extension --------------------------------------------------------------------


class Int8BlockWeight(torch.Tensor):
    """An fp32 master weight that all-gathers as int8 values plus fp32 block scales.

    ``pad``: return inputs padded to every rank's row count, as torch's FSDP2 requires on a
    short rank (``False``: this rank's rows only, which ours pads). ``flat``: return the
    inputs flattened to 1-D (to test the error on an uneven split). ``log``: every hook
    call, appended as a dict.
    """

    # ops whose results stay an Int8BlockWeight: what sharding and the optimizer need
    PRESERVE: ClassVar[set[Any]] = {
        torch.ops.aten.detach.default,
        torch.ops.aten.alias.default,
        torch.ops.aten.slice.Tensor,
        torch.ops.aten.split.Tensor,
        torch.ops.aten.view.default,
        torch.ops.aten.as_strided.default,
        torch.ops.aten.clone.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.new_zeros.default,
        torch.ops.aten._to_copy.default,
        torch.ops.aten.copy_.default,
    }

    _data: torch.Tensor
    log: list[dict[str, Any]]
    pad: bool
    flat: bool

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, log: list[dict[str, Any]], pad: bool = True, flat: bool = False
    ) -> Int8BlockWeight:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(
        self, data: torch.Tensor, log: list[dict[str, Any]], pad: bool = True, flat: bool = False
    ) -> None:
        self._data = data
        self.log = log
        self.pad = pad
        self.flat = flat

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Int8BlockWeight({self._data!r})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        return ["_data"], (self.log, self.pad, self.flat)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: tuple[Any, ...], size: Any, stride: Any
    ) -> Int8BlockWeight:
        return Int8BlockWeight(inner["_data"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        first = next(
            a for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, Int8BlockWeight)
        )
        args, kwargs = pytree.tree_map_only(
            Int8BlockWeight, lambda t: t._data, (args, kwargs or {})
        )
        out = func(*args, **kwargs)
        if func not in cls.PRESERVE:
            return out
        return pytree.tree_map_only(
            torch.Tensor, lambda t: Int8BlockWeight(t, first.log, first.pad, first.flat), out
        )

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        values, scales = quantize_rows(self._data)
        chunk = math.ceil(outer_size[0] / mesh.size())
        if self.pad and values.size(0) < chunk:
            short = chunk - values.size(0)
            values, scales = F.pad(values, (0, 0, 0, short)), F.pad(scales, (0, 0, 0, short))
        inputs = (values, scales)
        if self.flat:
            inputs = (values.view(-1), scales.view(-1))
        metadata = {"cols": self._data.size(1), "block": BLOCK}
        self.log.append(
            {
                "hook": "pre",
                "mesh": mesh,
                "outer_size": outer_size,
                "outer_stride": outer_stride,
                "module": module,
                "mp_policy": mp_policy,
                "rows": self._data.size(0),
                "inputs": [t.clone() for t in inputs],
                "metadata": metadata,
            }
        )
        return inputs, metadata

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        values, scales = outputs  # (W * chunk, cols) int8, (W * chunk, nb) fp32
        full = dequantize_rows(values, scales, param_dtype, metadata["block"])
        self.log.append(
            {
                "hook": "post",
                "outputs": [t.clone() for t in outputs],
                "metadata": metadata,
                "param_dtype": param_dtype,
                "out": out,
            }
        )
        if out is not None:
            # .data: the weight autograd saved in forward must not see a new version
            out.data.copy_(full[: out.size(0)])
            return None
        return full, (full,)


class QLinear(nn.Linear):
    """``nn.Linear`` whose forward uses ``fake_quant(weight)`` unless ``quantized_gather``:
    then the weight it sees was dequantized by the all-gather already."""

    quantized_gather = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.quantized_gather else fake_quant(self.weight)
        return F.linear(x, w, self.bias)


class QMLP(nn.Module):
    """Two quantized layers and a plain head. The default sizes split unevenly over 2 and 3
    ranks; ``even=True`` gives sizes that split evenly over 2 (torch's FSDP2 needs that for
    this subclass: on a short rank it wants every input in the weight's padded shape)."""

    def __init__(self, even: bool = False) -> None:
        super().__init__()
        hidden, out = (8, 6) if even else (HIDDEN, OUT)
        self.layers = nn.ModuleList([QLinear(IN, hidden), QLinear(hidden, out)])
        self.head = nn.Linear(out, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)  # type: ignore[no-any-return]


def convert(model: nn.Module, log: list[dict[str, Any]], **kwargs: Any) -> None:
    """Make every ``QLinear`` weight an ``Int8BlockWeight`` (what torchao's convert does)."""
    for m in model.modules():
        if isinstance(m, QLinear):
            m.weight = nn.Parameter(Int8BlockWeight(m.weight.detach(), log, **kwargs))
            m.quantized_gather = True


# -- incomplete or mis-declared extensions -----------------------------------------------------


class PreOnly(torch.Tensor):
    """Half an all-gather extension: a pre hook without its post hook."""

    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        return (self,), None


class BadSignature(torch.Tensor):
    """An all-gather extension whose pre hook takes neither of torch's argument lists
    (``(mesh)`` or ``(mesh, outer_size, outer_stride, module, mp_policy)``); its post hook
    has torch's signature."""

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any) -> Any:
        return (self,), None

    def fsdp_post_all_gather(
        self, outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None
    ) -> Any:
        return outputs[0], ()
