"""Tower: one encoder = stem -> norm_pre (optional) -> blocks -> norm_final -> pool -> proj.

`blocks` is a plain `nn.ModuleList` of `Block`, so activation checkpointing and FSDP can wrap
each block from outside (train/parallel.py) without the model knowing.
"""

from __future__ import annotations

import torch
from torch import nn

from mmtrain.models.heads import MapPool
from mmtrain.models.layers import Block, make_norm
from mmtrain.models.stems import build_stem
from mmtrain.spec import TowerSpec


class Tower(nn.Module):
    """Encodes one modality into an embedding [B, embed_dim] (not normalised; the model does)."""

    def __init__(self, spec: TowerSpec, embed_dim: int):
        super().__init__()
        self.spec = spec
        self.is_text = spec.modality == "text"
        self.causal = self.is_text and spec.stem.causal
        self.stem = build_stem(spec)
        self.norm_pre = (
            make_norm(spec.norm, spec.width, spec.norm_eps) if spec.has_pre_norm() else None
        )
        self.blocks = nn.ModuleList(
            Block(
                spec.width,
                spec.heads,
                spec.mlp_hidden(),
                activation=spec.activation,
                norm=spec.norm,
                norm_eps=spec.norm_eps,
                qkv_bias=spec.qkv_bias,
            )
            for _ in range(spec.layers)
        )
        self.norm_final = make_norm(spec.norm, spec.width, spec.norm_eps)
        self.pool = MapPool(spec) if spec.pooling == "map" else None
        self.proj = (
            nn.Linear(spec.width, embed_dim, bias=spec.proj_bias) if spec.output_proj else None
        )

    def token_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """Bool [B, T]: which output tokens carry content (False for text padding); None when all do."""
        return self.stem.key_mask(x)

    def _attention_key_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        # Causal text needs no padding mask: padding only follows the text, so no real token sees
        # it. Bidirectional text masks padding keys, except for "last" pooling, whose pooled
        # position is itself padding and reads the whole row (as SigLIP's text tower is trained).
        if not self.is_text or self.causal or self.spec.pooling == "last":
            return None
        return self.token_mask(x)

    def forward_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Input batch tensor -> token sequence [B, T, width] after the final norm."""
        tokens = self.stem(x)
        if self.norm_pre is not None:
            tokens = self.norm_pre(tokens)
        key_mask = self._attention_key_mask(x)
        for block in self.blocks:
            tokens = block(tokens, key_mask, self.causal)
        return self.norm_final(tokens)

    def pool_and_project(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Token sequence (from `forward_tokens(x)`) -> embedding [B, embed_dim].

        `x` is the tower's input, needed to find text padding: "eot" takes the end-of-text token
        (by default the last non-padding one, see `TextStem.eot_token`), "mean" averages
        non-padding tokens, "cls" position 0, "last" the final position.
        """
        pooling = self.spec.pooling
        mask = self.token_mask(x)
        if pooling == "cls":
            pooled = tokens[:, 0]
        elif pooling == "last":
            pooled = tokens[:, -1]
        elif pooling == "eot":
            rows = torch.arange(tokens.shape[0], device=tokens.device)
            pooled = tokens[rows, self._eot_positions(x, mask)]
        elif pooling == "mean":
            if mask is None:
                pooled = tokens.mean(dim=1)
            else:
                weights = mask.to(tokens.dtype).unsqueeze(-1)
                pooled = (tokens * weights).sum(dim=1) / weights.sum(dim=1)
        elif pooling == "map":
            pooled = self.pool(tokens, mask)
        else:
            raise ValueError(f"unknown pooling {pooling!r}")
        return pooled if self.proj is None else self.proj(pooled)

    def _eot_positions(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B] position of each row's end-of-text token, by the stem's `eot_token` rule."""
        eot = self.spec.stem.eot_token
        if eot == "argmax":
            return ids.argmax(dim=1)
        if eot is not None:
            # argmax returns the first maximum: the first position holding `eot`, 0 if none
            return (ids == eot).int().argmax(dim=1)
        positions = torch.arange(ids.shape[1], device=ids.device)
        return torch.where(mask, positions, -1).amax(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool_and_project(self.forward_tokens(x), x)
