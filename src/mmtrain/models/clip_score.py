"""CLIP score: how well each image matches its own caption, as 100 x cosine, floored at 0.

The one implementation in mmtrain, kept with the models because it scores the embeddings a
contrastive model gives a pair (image i, caption i): the evaluator reports its mean over
image-caption pairs (`eval/clipscore.py`), and the relevance filter of `mmtrain data build`
(DataComp-style CLIP-score filtering, `data/ingest/filters.py`) keeps or drops samples by it.
The floor makes the score a relevance measure: below zero an image and a caption are simply
unrelated, and how unrelated does not matter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["clip_score"]


def clip_score(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 [N]: 100 * max(0, cos(a[i], b[i])) for embeddings a, b of shape [N, D].

    The inputs are normalised here, so raw (unnormalised) embeddings give the same score.
    """
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(
            f"clip_score needs two [N, D] tensors, got {list(a.shape)} and {list(b.shape)}"
        )
    cosine = (F.normalize(a.float(), dim=-1) * F.normalize(b.float(), dim=-1)).sum(dim=-1)
    return 100.0 * cosine.clamp(min=0.0)
