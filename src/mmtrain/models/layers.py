"""Transformer building blocks shared by every tower: norms, activations, attention, MLP, Block.

One pre-norm `Block` serves all five modalities, so parallelism wrappers (activation
checkpointing, FSDP) and the planner's per-block formulas have exactly one shape to know.
Parameter names are a contract (the OpenCLIP converter maps onto them): `norm1`, `attn.qkv`,
`attn.out`, `norm2`, `mlp.fc1`, `mlp.fc2`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.models.attention import AttentionKernel


def make_norm(kind: str, width: int, eps: float) -> nn.Module:
    """LayerNorm (weight and bias) or RMSNorm (weight only), as `TowerSpec.norm` names them."""
    if kind == "layernorm":
        return nn.LayerNorm(width, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(width, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; use layernorm or rmsnorm")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """The sigmoid approximation of GELU that OpenAI's CLIP weights were trained with."""
    return x * torch.sigmoid(1.702 * x)


def activation_fn(kind: str):
    """The elementwise activation for `gelu`, `gelu_tanh` and `quick_gelu` (swiglu is in Mlp)."""
    if kind == "gelu":
        return F.gelu
    if kind == "gelu_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    if kind == "quick_gelu":
        return quick_gelu
    raise ValueError(f"unknown activation {kind!r}; use gelu, gelu_tanh, quick_gelu or swiglu")


class Mlp(nn.Module):
    """Two linear layers around an activation; for SwiGLU, `fc1` yields gate and value (gate first)."""

    def __init__(self, width: int, hidden: int, activation: str = "gelu"):
        super().__init__()
        self.swiglu = activation == "swiglu"
        self.act = None if self.swiglu else activation_fn(activation)
        self.fc1 = nn.Linear(width, 2 * hidden if self.swiglu else hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.swiglu:
            gate, value = h.chunk(2, dim=-1)
            h = F.silu(gate) * value
        else:
            h = self.act(h)
        return self.fc2(h)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, W] -> [B, heads, T, W / heads]."""
    b, t, w = x.shape
    return x.view(b, t, heads, w // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, D] -> [B, T, heads * D]."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


def attention_mask(
    key_mask: torch.Tensor | None, queries: int, causal: bool
) -> tuple[torch.Tensor | None, bool]:
    """The (attn_mask, is_causal) pair for `scaled_dot_product_attention`.

    `key_mask` is bool [B, T], True for keys that may be attended to (e.g. non-padding tokens).
    A causal mask alone uses SDPA's `is_causal` fast path; SDPA does not accept both at once, so
    a causal plus padding mask is combined into one boolean mask.
    """
    if key_mask is None:
        return None, causal
    mask = key_mask[:, None, None, :]  # [B, 1, 1, T]: same for every head and query
    if causal:
        t = key_mask.shape[1]
        lower = torch.ones(queries, t, dtype=torch.bool, device=key_mask.device).tril()
        mask = mask & lower
    return mask, False


class Attention(nn.Module):
    """Multi-head self-attention with a fused q/k/v projection (rows ordered q, k, v)."""

    def __init__(self, width: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        if width % heads:
            raise ValueError(f"heads ({heads}) must divide width ({width})")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=qkv_bias)
        self.out = nn.Linear(width, width)

    def forward(
        self,
        x: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
        kernel: AttentionKernel | None = None,
    ) -> torch.Tensor:
        """`kernel`: x is this rank's slice of the tokens (sequence parallelism); the kernel
        attends over all of them (no key_mask, not causal: a denoiser's full attention)."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (split_heads(t, self.heads) for t in (q, k, v))
        if kernel is not None:
            return self.out(merge_heads(kernel(q, k, v)))
        mask, is_causal = attention_mask(key_mask, x.shape[1], causal)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return self.out(merge_heads(y))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(
        self,
        width: int,
        heads: int,
        hidden: int,
        *,
        activation: str = "gelu",
        norm: str = "layernorm",
        norm_eps: float = 1e-5,
        qkv_bias: bool = True,
    ):
        super().__init__()
        self.norm1 = make_norm(norm, width, norm_eps)
        self.attn = Attention(width, heads, qkv_bias)
        self.norm2 = make_norm(norm, width, norm_eps)
        self.mlp = Mlp(width, hidden, activation)

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), key_mask, causal)
        return x + self.mlp(self.norm2(x))


class CrossAttention(nn.Module):
    """Multi-head attention of queries over a separate memory: `q` projects the queries, `kv` the
    memory (rows ordered k, v). Used by attention pooling (a learned probe) and the fusion head."""

    def __init__(self, width: int, heads: int, bias: bool = True):
        super().__init__()
        if width % heads:
            raise ValueError(f"heads ({heads}) must divide width ({width})")
        self.heads = heads
        self.q = nn.Linear(width, width, bias=bias)
        self.kv = nn.Linear(width, 2 * width, bias=bias)
        self.out = nn.Linear(width, width)

    def forward(
        self, queries: torch.Tensor, memory: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = split_heads(self.q(queries), self.heads)
        k, v = (split_heads(t, self.heads) for t in self.kv(memory).chunk(2, dim=-1))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(merge_heads(y))
