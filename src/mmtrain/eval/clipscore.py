"""CLIP score: how well each image matches its own caption, as 100 x cosine, floored at 0.

The one implementation in mmtrain: the evaluator reports its mean over image-caption pairs, and
the relevance filter of `mmtrain data build` (DataComp-style CLIP-score filtering) keeps or drops
samples by it. The floor makes the score a relevance measure: below zero an image and a caption
are simply unrelated, and how unrelated does not matter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["clip_score", "clip_score_summary"]


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


def clip_score_summary(scores: torch.Tensor) -> dict[str, Any]:
    """Mean, median and the fraction of pairs floored at 0, for `eval.json`."""
    n = int(scores.numel())
    if n == 0:
        raise ValueError("no pairs to summarise")
    s = scores.double().cpu()
    ordered = s.sort().values
    return {
        "mean": float(s.mean()),
        "median": float((ordered[(n - 1) // 2] + ordered[n // 2]) / 2),
        "zero_fraction": float((s == 0).double().mean()),
        "n_pairs": n,
    }
