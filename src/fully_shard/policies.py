"""Policies: small frozen dataclasses that answer the engine's dtype and device questions.

The engine never decides a dtype or a device on its own: it asks the group's policy. A policy
never reaches into the engine. To change one answer, subclass the policy and override the
method that gives it; the defaults (``MixedPrecisionPolicy()``, ``OffloadPolicy()``) answer
"what the parameter already is" and cost nothing.

Questions and who answers them:

=================================================  ==========================================
question                                           answered by
=================================================  ==========================================
one parameter's own policy (override resolved)     ``MixedPrecisionPolicy.for_param``
dtype of the all-gather and of forward/backward    ``MixedPrecisionPolicy.compute_dtype``
dtype of the gradient reduce-scatter               ``MixedPrecisionPolicy.reduce_dtype_for``
dtype the module's outputs are cast to             ``MixedPrecisionPolicy.output_dtype``
dtype floating forward inputs are cast to          ``MixedPrecisionPolicy.forward_input_dtype``
device the sharded parameters and grads live on    ``OffloadPolicy.shard_device``
pin the host memory of offloaded shards            ``OffloadPolicy.use_pinned_memory``
gather this parameter block-quantized to int8?     ``QuantizationPolicy.quantizes``
=================================================  ==========================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import FullyShardArgumentTypeError, FullyShardTypeError, FullyShardValueError


def _check_float_dtype(name: str, dtype: object) -> None:
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise FullyShardTypeError(
            f"MixedPrecisionPolicy.{name} must be a torch.dtype or None, got {dtype!r} "
            f"({type(dtype).__name__}); pass e.g. {name}=torch.bfloat16"
        )
    if not dtype.is_floating_point:
        raise FullyShardValueError(
            f"MixedPrecisionPolicy.{name}={dtype} is not a floating-point dtype; parameters and "
            "gradients can only be cast to float16, bfloat16, float32 or float64"
        )


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes a group all-gathers, computes and reduces in.

    The sharded parameters (what the optimizer steps on) always keep their own dtype: they are
    the fp32 master weights when the model was built in fp32. Shards are cast to ``param_dtype``
    *before* the all-gather, so bf16 halves the bytes every all-gather moves.

    Attributes:
        param_dtype: dtype of the unsharded parameters, the all-gather and forward/backward
            compute. ``None`` keeps each parameter's own dtype.
        reduce_dtype: dtype of the unsharded gradients and of their reduce-scatter (and HSDP
            all-reduce), as in torch 2.15: the unsharded parameter's ``grad_dtype`` is set to
            it, so autograd produces and accumulates gradients in it, with gradient sync on or
            off, and they are packed for the reduce-scatter without a cast. ``None`` means the
            compute dtype (``param_dtype``, or the parameter's dtype if that is ``None`` too).
            fp32 here with bf16 ``param_dtype`` costs twice the reduce bytes (and fp32
            unsharded gradients) and gives gradients closer to a full-precision run. The
            sharded gradient (what the optimizer reads) takes the parameter's own dtype, or the
            ``grad_dtype`` the parameter had before ``fully_shard``.
        output_dtype: if set, floating-point forward outputs are cast to this dtype.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``; a grouped
            ``fully_shard([a, b])`` casts each module's inputs before that module's forward.
        param_dtype_override_fn: keyword-only (torch 2.15's name). Called once per managed
            parameter when ``fully_shard`` is applied, with the ``nn.Parameter``; it returns
            ``None`` or ``param_dtype`` (the default) or the parameter's own dtype (keep it:
            e.g. ``A_log``, ``dt_bias``, a router or an ``lm_head`` in fp32 inside a bf16
            group). Anything else is refused before the module changes. It must answer the
            same on every rank. A group whose trainable parameters then compute in several
            dtypes needs one ``reduce_dtype`` (one reduce-scatter, one gradient dtype). Forward
            inputs are still cast to ``param_dtype``.

    Example:
        >>> import torch
        >>> from fully_shard import MixedPrecisionPolicy
        >>> mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> mp.compute_dtype(torch.float32), mp.reduce_dtype_for(torch.float32)
        (torch.bfloat16, torch.float32)
        >>> keep = MixedPrecisionPolicy(
        ...     param_dtype=torch.bfloat16,
        ...     reduce_dtype=torch.float32,
        ...     param_dtype_override_fn=lambda p: p.dtype if p.dim() == 1 else None,
        ... )
        >>> keep.for_param(torch.nn.Parameter(torch.zeros(4))).compute_dtype(torch.float32)
        torch.float32
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Callable[[nn.Parameter], torch.dtype | None] | None = field(
        default=None, kw_only=True
    )

    def __post_init__(self) -> None:
        _check_float_dtype("param_dtype", self.param_dtype)
        _check_float_dtype("reduce_dtype", self.reduce_dtype)
        _check_float_dtype("output_dtype", self.output_dtype)
        if not isinstance(self.cast_forward_inputs, bool):
            raise FullyShardTypeError(
                "MixedPrecisionPolicy.cast_forward_inputs must be a bool, got "
                f"{self.cast_forward_inputs!r}"
            )
        fn = self.param_dtype_override_fn
        if fn is not None and not callable(fn):
            raise FullyShardTypeError(
                "MixedPrecisionPolicy.param_dtype_override_fn must be a callable "
                f"(nn.Parameter -> torch.dtype | None) or None, got {fn!r} "
                f"({type(fn).__name__})"
            )

    def for_param(self, param: nn.Parameter, name: str = "a parameter") -> MixedPrecisionPolicy:
        """This policy as it applies to ``param``: ``param_dtype_override_fn`` asked once and
        folded into ``param_dtype`` (the override itself dropped). Without an override, the
        policy itself: nothing is copied.

        The parameter's own dtype as the answer becomes ``param_dtype=None`` ("keep its
        dtype"), so the parameter follows a later ``model.to(dtype)`` as an unmixed one does.
        ``name`` names the parameter in the error a bad answer raises.

        Example:
            >>> import torch
            >>> from fully_shard import MixedPrecisionPolicy
            >>> mp = MixedPrecisionPolicy(
            ...     param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float32
            ... )
            >>> mp.for_param(torch.nn.Parameter(torch.zeros(2))).param_dtype is None
            True
        """
        fn = self.param_dtype_override_fn
        if fn is None:
            return self
        answer: object = fn(param)
        own = param.dtype
        if answer is not None and not isinstance(answer, torch.dtype):
            raise FullyShardArgumentTypeError(
                f"param_dtype_override_fn returned {answer!r} ({type(answer).__name__}) for "
                f"{name}; it must return a torch.dtype or None"
            )
        if answer is not None and answer not in (self.param_dtype, own):
            raise FullyShardValueError(
                f"param_dtype_override_fn returned {answer} for {name} (dtype {own}) with "
                f"param_dtype={self.param_dtype}; it may return None, param_dtype or the "
                f"parameter's own dtype ({own}), as torch 2.15's does: cast the parameter "
                "before fully_shard to compute it in another dtype"
            )
        keep_own = answer is not None and answer == own and answer != self.param_dtype
        param_dtype = None if keep_own else self.param_dtype
        return dataclasses.replace(self, param_dtype=param_dtype, param_dtype_override_fn=None)

    def compute_dtype(self, orig_dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter of ``orig_dtype`` is all-gathered and computed in.

        A non-floating parameter (a frozen int8 weight) keeps its dtype: casting it would
        change its values, not just their precision.
        """
        if self.param_dtype is None or not orig_dtype.is_floating_point:
            return orig_dtype
        return self.param_dtype

    def reduce_dtype_for(self, orig_dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradient of a parameter of ``orig_dtype`` is reduced in."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return self.compute_dtype(orig_dtype)

    def forward_input_dtype(self) -> torch.dtype | None:
        """The dtype floating-point forward inputs are cast to, or ``None`` to leave them."""
        return self.param_dtype if self.cast_forward_inputs else None


@dataclass(frozen=True)
class OffloadPolicy:
    """Where sharded parameters and gradients live. The base class offloads nothing.

    Example:
        >>> import torch
        >>> from fully_shard import OffloadPolicy
        >>> OffloadPolicy().shard_device(torch.device("cpu"))
        device(type='cpu')
    """

    def shard_device(self, compute_device: torch.device) -> torch.device:
        """The device the sharded parameters, their grads and so the optimizer state live on."""
        return compute_device

    def use_pinned_memory(self) -> bool:
        """Whether offloaded shards sit in pinned host memory (for non-blocking copies)."""
        return False


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and optimizer state on the CPU.

    Shards are copied to the compute device for each all-gather; reduced gradients are copied
    back, and the optimizer steps on the CPU. Saves all sharded state's accelerator memory at
    the cost of host-device traffic every step. On a CPU-only run it changes nothing.

    Attributes:
        pin_memory: allocate the CPU shards in pinned memory so the copies can be non-blocking.
            Ignored when no accelerator is present.

    Example:
        >>> import torch
        >>> from fully_shard import CPUOffloadPolicy
        >>> CPUOffloadPolicy().shard_device(torch.device("cpu"))
        device(type='cpu')
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise FullyShardTypeError(
                f"CPUOffloadPolicy.pin_memory must be a bool, got {self.pin_memory!r}"
            )

    def shard_device(self, compute_device: torch.device) -> torch.device:
        return torch.device("cpu")

    def use_pinned_memory(self) -> bool:
        return self.pin_memory


QUANTIZED_ALL_GATHER_DTYPES = ("int8",)


@dataclass(frozen=True)
class QuantizationPolicy:
    """Whether a group all-gathers its parameters block-quantized to int8 (ZeRO++'s qwZ).

    With ``all_gather="int8"`` each rank quantizes its own padded shard, flattened, in blocks
    of ``block_size`` elements (symmetric int8, one fp32 scale per block) and the group's one
    all-gather carries the int8 values and the scales (as ``uint8`` bytes, beside any
    unquantized parameter of the group); each rank then dequantizes them into the unsharded
    parameters in the compute dtype (``MixedPrecisionPolicy.param_dtype`` if set). An
    all-gather then moves ``1 + 4 / block_size`` bytes per element instead of 4 (fp32) or 2
    (bf16): 0.254 of fp32's bytes at ``block_size=256``.

    Forward and backward compute with the dequantized values; every element is within half
    its block's quantization step (``max |x| / 127 / 2`` over the block) of the master
    value, plus the compute dtype's rounding. The sharded parameters (the optimizer's fp32
    master weights), their gradients, the optimizer state and checkpoints stay exact: the
    gradient with respect to the dequantized parameter is reduce-scattered unchanged into the
    master's ``.grad`` (straight-through), and the reduce-scatter is not quantized.

    Which parameters are quantized (:meth:`quantizes`): floating point of 16 bits or more,
    two or more dims, and at least ``block_size`` elements in each rank's padded shard.
    Norm weights and biases (1-D), small matrices, and integer or float8 parameters are
    gathered as they are. Subclass and override :meth:`quantizes` to choose otherwise.

    Attributes:
        all_gather: ``"int8"`` to quantize the all-gather; ``None`` (default) leaves it alone
            and costs nothing.
        block_size: elements per fp32 scale. Smaller blocks track local magnitudes more
            closely (a smaller error next to a large value elsewhere) and send more scale
            bytes (``4 / block_size`` per element).

    Example:
        >>> from fully_shard import QuantizationPolicy
        >>> policy = QuantizationPolicy(all_gather="int8", block_size=256)
        >>> for block in model.layers:  # doctest: +SKIP
        ...     fully_shard(block, quantization_policy=policy)
        >>> import torch
        >>> policy.quantizes(torch.Size([1024, 1024]), torch.float32, shard_numel=524288)
        True
        >>> policy.quantizes(torch.Size([1024]), torch.float32, shard_numel=512)  # a norm
        False
    """

    all_gather: str | None = None
    block_size: int = 256

    def __post_init__(self) -> None:
        value = self.all_gather
        if value is not None and not isinstance(value, str):
            raise FullyShardTypeError(
                f"QuantizationPolicy.all_gather must be a string or None, got {value!r} "
                f"({type(value).__name__}); pass all_gather='int8' to quantize the all-gather "
                "or None to leave it alone"
            )
        if value is not None and value not in QUANTIZED_ALL_GATHER_DTYPES:
            raise FullyShardValueError(
                f"QuantizationPolicy.all_gather={value!r} is not supported; the choices are "
                "'int8' (symmetric int8 values, one fp32 scale per block) and None (off)"
            )
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int):
            raise FullyShardTypeError(
                f"QuantizationPolicy.block_size must be an int, got {size!r} "
                f"({type(size).__name__}); e.g. block_size=256"
            )
        if size < 1:
            raise FullyShardValueError(
                f"QuantizationPolicy.block_size={size} must be at least 1 (elements per "
                "scale); e.g. block_size=256"
            )

    def quantizes(self, size: torch.Size, dtype: torch.dtype, shard_numel: int) -> bool:
        """Whether a parameter of ``size`` and ``dtype`` is all-gathered as int8.

        ``shard_numel``: the elements of its padded shard, what each rank sends (the same on
        every rank of the group, so every rank answers the same).
        """
        return (
            self.all_gather == "int8"
            and dtype.is_floating_point
            and dtype.itemsize >= 2
            and len(size) >= 2
            and shard_numel >= self.block_size
        )


def _mesh_dim_names(field_name: str, value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
        return value
    raise FullyShardTypeError(
        f"DataParallelMeshDims.{field_name} must be a mesh dim name, a non-empty tuple of "
        f"names or None, got {value!r}; e.g. DataParallelMeshDims(shard='dp')"
    )


@dataclass
class DataParallelMeshDims:
    """Which named dims of a full SPMD mesh are data parallel (torch 2.13's fields).

    For parameters that are already DTensors on a mesh holding every parallelism:
    ``shard`` names the dim(s) FSDP shards over, ``replicate`` the dim(s) it replicates
    over (HSDP / DDP); a tuple of names is flattened into one dim. At least one must be
    set (``shard`` for ``fully_shard``: replication alone is plain data parallelism).
    ``fully_shard(model, mesh=world, dp_mesh_dims=dims)`` reads the dims when it is called;
    the parameters must be DTensors on ``world`` with ``Replicate()`` on these dims. Not
    frozen, like torch's.

    Attributes:
        shard: mesh dim name(s) to shard parameters over, or ``None``.
        replicate: mesh dim name(s) to replicate parameters over, or ``None``.

    Example:
        >>> from fully_shard import DataParallelMeshDims
        >>> dims = DataParallelMeshDims(shard="dp_shard", replicate=("pp", "dp_rep"))
        >>> dims.shard_names, dims.replicate_names
        (('dp_shard',), ('pp', 'dp_rep'))
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _mesh_dim_names("shard", self.shard)
        _mesh_dim_names("replicate", self.replicate)
        if self.shard is None and self.replicate is None:
            raise FullyShardValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims, "
                "e.g. DataParallelMeshDims(shard='dp')"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        """``shard`` as a tuple of names (empty if ``None``)."""
        return _mesh_dim_names("shard", self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        """``replicate`` as a tuple of names (empty if ``None``)."""
        return _mesh_dim_names("replicate", self.replicate)
