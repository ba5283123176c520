"""Tiny deterministic test models (fp32, CPU) for the parity tests.

Two models, both small enough that a training step takes milliseconds:

- `MLPStack`: Linear(+ReLU) blocks with arbitrary widths, for shape properties (dims of 1,
  primes, dims smaller than the world size, which leave some ranks with empty shards).
- `Transformer`: a Llama-style decoder (RMSNorm, causal attention with rotary embeddings and
  optional grouped-query heads, SwiGLU feed-forward, optionally tied output head).

Beside them `SmallNet`, the fixed two-module net of the bad-input catalogues, and `SoftMoE`, a
mixture of experts whose expert weights may be expert-parallel DTensors.

Both keep their wrappable blocks in `self.layers` (an `nn.ModuleList`), so a test can shard each
block and then the root. Every module that owns parameters or computed buffers has a
`reset_parameters()` that re-initialises it from torch's global RNG, so the models also work
with meta-device construction:

    with torch.device("meta"):
        model = Transformer(ModelArgs())
    ...  # shard it
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty() breaks parameter sharing, as in every torch module
    model.reset_parameters()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = [
    "Activation",
    "Attention",
    "FeedForward",
    "MLPBlock",
    "MLPStack",
    "ModelArgs",
    "RMSNorm",
    "RotaryEmbedding",
    "SmallNet",
    "SoftMoE",
    "Transformer",
    "TransformerBlock",
    "apply_rotary",
]


# ---------------------------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------------------------


Activation = Literal["relu", "tanh", "none"]


class MLPBlock(nn.Module):
    """One `Linear(in_dim, out_dim)` followed by an activation ("relu", "tanh" or "none").

    A block is its own module so that a test can `fully_shard` it as one group.
    """

    def __init__(
        self, in_dim: int, out_dim: int, *, bias: bool = True, activation: Activation = "relu"
    ):
        super().__init__()
        if activation not in ("relu", "tanh", "none"):
            raise ValueError(f"activation must be 'relu', 'tanh' or 'none', got {activation!r}")
        self.linear = nn.Linear(in_dim, out_dim, bias=bias)  # weight (out_dim, in_dim)
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.linear(x)  # (B, in_dim) -> (B, out_dim)
        if self.activation == "relu":
            return F.relu(y)
        if self.activation == "tanh":
            return torch.tanh(y)
        return y

    def reset_parameters(self) -> None:
        """Re-initialise from torch's global RNG (torch's default `nn.Linear` init)."""
        self.linear.reset_parameters()

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class MLPStack(nn.Module):
    """A stack of `len(dims) - 1` blocks mapping `(B, dims[0])` to `(B, dims[-1])`.

    Block i is `Linear(dims[i], dims[i + 1])` + ReLU; the last block has no activation so that
    the output (and so the loss) is not clipped. Any positive widths are accepted, including 1
    and widths smaller than the world size.

    A ReLU after a narrow layer (width 1 or 2, especially without bias) is often dead for every
    input, which zeroes the gradients of all earlier layers and makes a parity check on them
    vacuous; `activation="tanh"` keeps every gradient nonzero.

    Example:
        >>> model = MLPStack([7, 13, 1, 5, 3])
        >>> model(torch.randn(4, 7)).shape
        torch.Size([4, 3])
    """

    def __init__(self, dims: list[int], bias: bool = True, *, activation: Activation = "relu"):
        super().__init__()
        if len(dims) < 2:
            raise ValueError(f"MLPStack needs at least two dims (in and out), got {dims}")
        if any(d < 1 for d in dims):
            raise ValueError(f"MLPStack dims must be positive, got {dims}")
        self.dims = list(dims)
        n_blocks = len(dims) - 1
        self.layers = nn.ModuleList(
            MLPBlock(
                dims[i],
                dims[i + 1],
                bias=bias,
                activation=activation if i < n_blocks - 1 else "none",
            )
            for i in range(n_blocks)
        )

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:  # (B, dims[i]) -> (B, dims[i + 1])
            x = layer(x)
        return x

    def reset_parameters(self) -> None:
        """Re-initialise every block, in order, from torch's global RNG."""
        for layer in self.layers:
            assert isinstance(layer, MLPBlock)  # narrows the ModuleList item for mypy
            layer.reset_parameters()


class SmallNet(nn.Module):
    """`inner` (Linear(5, 7) + ReLU, a Sequential) then `out` (Linear(7, 3)): (B, 5) -> (B, 3).

    The model of the bad-input catalogues (tests/test_validation.py,
    tests/test_dropin_validation.py): a nested submodule to shard as its own group, a root that
    keeps `out`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(5, 7), nn.ReLU())
        self.out = nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.out(self.inner(x))
        return y


# ---------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelArgs:
    """Hyper-parameters of `Transformer`; the defaults make a step take milliseconds.

    Attributes:
        vocab_size: number of token ids (embedding rows, output columns).
        dim: model width; must be divisible by `n_heads`.
        n_layers: number of `TransformerBlock`s in `Transformer.layers`.
        n_heads: query heads; head_dim = dim // n_heads (even when `rope` is on).
        n_kv_heads: key/value heads (grouped-query attention); None means `n_heads`.
        ffn_hidden: hidden width of the SwiGLU feed-forward.
        max_seq_len: longest sequence the rotary table covers.
        tie_embeddings: share one parameter between the token embedding and the output head.
        rope: apply rotary position embeddings to queries and keys.
        rope_theta: rotary base frequency.
        norm_eps: RMSNorm epsilon.

    Example:
        >>> ModelArgs(dim=24, n_heads=6, n_kv_heads=2, tie_embeddings=True).head_dim
        4
    """

    vocab_size: int = 32
    dim: int = 16
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int = 40
    max_seq_len: int = 8
    tie_embeddings: bool = False
    rope: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelArgs.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.rope and self.head_dim % 2 != 0:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


class RMSNorm(nn.Module):
    """`x / rms(x) * weight` over the last dim; weight (dim,) initialised to ones."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        # x (..., dim); the rms is taken per position
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return x * rms * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class RotaryEmbedding(nn.Module):
    """Holds the rotary table as a non-persistent buffer `freqs` (max_seq_len, head_dim // 2, 2).

    `freqs[s, i] = (cos(s * theta_i), sin(s * theta_i))`. It is not in the state dict and not a
    parameter; `reset_parameters()` recomputes it in place (needed after `to_empty()`).
    """

    freqs: Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.register_buffer("freqs", self._table(torch.device("cpu")), persistent=False)

    def _table(self, device: torch.device) -> Tensor:
        half = self.head_dim // 2
        inv = self.theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(self.max_seq_len, device=device).float(), inv)
        return torch.stack([angles.cos(), angles.sin()], dim=-1)  # (S, half, 2)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freqs.copy_(self._table(self.freqs.device))

    def forward(self, seq_len: int) -> Tensor:
        """The first `seq_len` rows of the table: (seq_len, head_dim // 2, 2)."""
        return self.freqs[:seq_len]


def apply_rotary(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate consecutive channel pairs of x (B, S, H, head_dim) by freqs (S, head_dim // 2, 2)."""
    b, s, h, d = x.shape
    pairs = x.float().reshape(b, s, h, d // 2, 2)
    cos = freqs[:, None, :, 0]  # (S, 1, half), broadcast over batch and heads
    sin = freqs[:, None, :, 1]
    x0, x1 = pairs[..., 0], pairs[..., 1]  # (B, S, H, half)
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.reshape(b, s, h, d).type_as(x)


class Attention(nn.Module):
    """Causal multi-head attention with optional grouped-query key/value heads.

    wq (n_heads * hd, dim), wk / wv (n_kv_heads * hd, dim), wo (dim, n_heads * hd); no biases.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: Tensor, freqs: Tensor | None) -> Tensor:
        b, s, _ = x.shape  # (B, S, dim)
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        if freqs is not None:
            q, k = apply_rotary(q, freqs), apply_rotary(k, freqs)
        repeat = self.n_heads // self.n_kv_heads
        if repeat > 1:  # (B, S, n_kv, hd) -> (B, S, n_heads, hd)
            k = k.repeat_interleave(repeat, dim=2)
            v = v.repeat_interleave(repeat, dim=2)
        # SDPA wants (B, H, S, hd)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        merged = out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim)
        y: Tensor = self.wo(merged)  # (B, S, dim)
        return y

    def reset_parameters(self) -> None:
        for lin in (self.wq, self.wk, self.wv, self.wo):
            lin.reset_parameters()


class FeedForward(nn.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`; w1 / w3 (hidden, dim), w2 (dim, hidden); no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate: Tensor = F.silu(self.w1(x))  # (B, S, hidden)
        y: Tensor = self.w2(gate * self.w3(x))  # (B, S, dim)
        return y

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w2, self.w3):
            lin.reset_parameters()


class TransformerBlock(nn.Module):
    """Pre-norm residual block: `h = x + attn(norm(x)); out = h + ffn(norm(h))`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(self, x: Tensor, freqs: Tensor | None) -> Tensor:
        h: Tensor = x + self.attention(self.attention_norm(x), freqs)  # (B, S, dim)
        out: Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out

    def reset_parameters(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    """Llama-style decoder: tokens (B, S) int64 -> logits (B, S, vocab_size) fp32.

    `tok_embeddings` (vocab, dim) -> `layers` (n_layers x `TransformerBlock`) -> `norm` ->
    `output` (vocab, dim). With `tie_embeddings`, `output.weight` *is* `tok_embeddings.weight`
    (one `nn.Parameter` registered under two modules; `named_parameters()` lists it once, as
    `tok_embeddings.weight`), so both modules must be sharded in the same group, e.g. the root.

    Example:
        >>> model = Transformer(ModelArgs(tie_embeddings=True))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = (
            RotaryEmbedding(args.head_dim, args.max_seq_len, args.rope_theta) if args.rope else None
        )
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.reset_parameters()  # construction and reset draw the same values from the RNG

    def tie_weights(self) -> None:
        """Point `output.weight` at `tok_embeddings.weight` again if `tie_embeddings`.

        Needed after `to_empty()`, which gives each module its own new parameter.
        """
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: Tensor) -> Tensor:
        _, s = tokens.shape  # (B, S)
        if s > self.args.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len={self.args.max_seq_len}")
        h = self.tok_embeddings(tokens)  # (B, S, dim)
        freqs = self.rope(s) if self.rope is not None else None  # (S, head_dim // 2, 2)
        for layer in self.layers:
            h = layer(h, freqs)
        logits: Tensor = self.output(self.norm(h))  # (B, S, vocab)
        return logits

    def reset_parameters(self) -> None:
        """Re-initialise every submodule from torch's global RNG, in registration order.

        Each submodule uses its own `reset_parameters()` (embedding rows ~ N(0, 1), torch's
        default `nn.Linear` init, norms to ones, the rotary table recomputed). With tied
        embeddings the output head is skipped: its weight is the embedding.
        """
        self.tok_embeddings.reset_parameters()
        if self.rope is not None:
            self.rope.reset_parameters()
        for layer in self.layers:
            assert isinstance(layer, TransformerBlock)  # narrows the ModuleList item for mypy
            layer.reset_parameters()
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            self.output.reset_parameters()


class SoftMoE(nn.Module):
    """Soft mixture of experts: every expert sees every token, weighted by the router.

    The expert weights are `(experts, dim, hidden)` and `(experts, hidden, dim)`. With them as
    DTensors `Shard(0)` over an expert-parallel (EP) mesh, each rank computes its own experts
    and the weighted sum over experts ends `Partial`, summed over the EP ranks (a real MoE
    sends each token to its top-k experts with an all-to-all; what sharding does is the same).
    `shared=True` adds a shared expert (a dense `Linear`) that every token goes through.
    """

    def __init__(self, dim: int, hidden: int, experts: int, *, shared: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)
        self.shared = nn.Linear(dim, dim) if shared else None

    def forward(self, x: Tensor) -> Tensor:
        gates = torch.softmax(self.router(x), dim=-1)  # (n, experts)
        w_in = self.w_in
        h_in, g_in = x.to(w_in.dtype), gates.to(w_in.dtype)
        if isinstance(w_in, DTensor):  # expert parallel
            mesh = w_in.device_mesh
            h_in = DTensor.from_local(h_in, mesh, [Replicate()] * mesh.ndim, run_check=False)
            g_in = DTensor.from_local(g_in, mesh, [Replicate()] * mesh.ndim, run_check=False)
        # Batched matmuls over the experts, never a view that merges the expert dim with
        # another: on a 2-D (ep, etp) mesh DTensor's first sharding propagation of such a view
        # (what einsum's backward makes) took seconds per op.
        every = h_in.expand(w_in.shape[0], *h_in.shape)  # each expert's copy: (experts, n, dim)
        h = F.gelu(torch.bmm(every, w_in))  # (experts, n, hidden)
        out = torch.bmm(h, self.w_out)  # (experts, n, dim)
        y = (g_in.transpose(0, 1).unsqueeze(-1) * out).sum(0)  # weighted over experts: (n, dim)
        if isinstance(y, DTensor):
            y = y.redistribute(placements=[Replicate()] * y.device_mesh.ndim).to_local()
        y = y.to(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        return y  # type: ignore[no-any-return]
