"""Heads that read token sequences: attention pooling (MAP) and the cross-attention fusion head.

Their parameter counts are `TowerSpec.pool_params()` and `FusionSpec.params()` in spec.py.
"""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.models.layers import CrossAttention, Mlp, make_norm
from mmtrain.spec import FusionSpec, TowerSpec


class MapPool(nn.Module):
    """Multihead attention pooling (SigLIP's MAP head): a learned probe attends over the tokens,
    then a residual MLP refines the pooled vector.

    Parameters: `probe` [width], `attn.q`, `attn.kv`, `attn.out`, `norm`, `mlp.fc1`, `mlp.fc2`.
    """

    def __init__(self, tower: TowerSpec):
        super().__init__()
        w = tower.width
        self.probe = nn.Parameter(torch.zeros(w))
        self.attn = CrossAttention(w, tower.heads, bias=tower.qkv_bias)
        self.norm = make_norm(tower.norm, w, tower.norm_eps)
        self.mlp = Mlp(w, tower.mlp_hidden(), tower.activation)

    def forward(self, tokens: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, width] (+ optional bool [B, T] of attendable tokens) -> [B, width]."""
        probe = self.probe.to(tokens.dtype).expand(tokens.shape[0], 1, -1)
        x = self.attn(probe, tokens, key_mask)
        x = x + self.mlp(self.norm(x))
        return x[:, 0]


class FusionBlock(nn.Module):
    """Queries attend over the (normalised) memory, then a residual MLP: both pre-norm."""

    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.norm_q = nn.LayerNorm(width)
        self.norm_mem = nn.LayerNorm(width)
        self.attn = CrossAttention(width, heads, bias=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = Mlp(width, hidden, "gelu")

    def forward(
        self, queries: torch.Tensor, memory: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        queries = queries + self.attn(self.norm_q(queries), self.norm_mem(memory), key_mask)
        return queries + self.mlp(self.norm2(queries))


class FusionHead(nn.Module):
    """Reads several towers' token sequences together and predicts `num_outputs` values.

    Each fused tower's tokens are mapped to the fusion width (`inputs[name]`, a Linear with bias)
    and tagged with a learned modality embedding (`modality_embed[name]`); the sequences are
    concatenated into one memory (padding tokens masked out). `queries` learned vectors
    cross-attend over it through `layers` FusionBlocks; the final norm and the mean over queries
    feed a Linear classifier/regressor (`out`). Logits for `classify`, values for `regress`.
    """

    def __init__(self, spec: FusionSpec, tower_widths: dict[str, int]):
        super().__init__()
        w = spec.width
        self.spec = spec
        self.inputs = nn.ModuleDict({n: nn.Linear(tw, w) for n, tw in tower_widths.items()})
        self.modality_embed = nn.ParameterDict(
            {n: nn.Parameter(torch.zeros(w)) for n in tower_widths}
        )
        self.queries = nn.Parameter(torch.zeros(spec.queries, w))
        hidden = int(w * spec.mlp_ratio)
        self.blocks = nn.ModuleList(FusionBlock(w, spec.heads, hidden) for _ in range(spec.layers))
        self.norm_final = nn.LayerNorm(w)
        self.out = nn.Linear(w, spec.num_outputs)

    def forward(self, memory: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
        """`memory[name] = (tokens [B, T, tower width], key_mask [B, T] bool or None)` for every
        fused tower -> [B, num_outputs]."""
        missing = [n for n in self.inputs if n not in memory]
        if missing:
            raise KeyError(f"fusion head needs the tokens of towers {missing}")
        parts, masks = [], []
        for name, proj in self.inputs.items():
            tokens, mask = memory[name]
            parts.append(proj(tokens) + self.modality_embed[name].to(tokens.dtype))
            masks.append(mask)
        mem = torch.cat(parts, dim=1)
        key_mask = None  # no padding anywhere: lets SDPA pick its fastest kernel
        if any(m is not None for m in masks):
            key_mask = torch.cat(
                [
                    torch.ones(p.shape[:2], dtype=torch.bool, device=p.device) if m is None else m
                    for p, m in zip(parts, masks, strict=True)
                ],
                dim=1,
            )
        x = self.queries.to(mem.dtype).expand(mem.shape[0], -1, -1)
        for block in self.blocks:
            x = block(x, mem, key_mask)
        return self.out(self.norm_final(x).mean(dim=1))
