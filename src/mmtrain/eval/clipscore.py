"""CLIP score for evaluation: the score of each pair, and its summary for `eval.json`.

`clip_score` (100 x cosine of an image's and its caption's embeddings, floored at 0) is
implemented once, in `mmtrain.models.clip_score`, below both the evaluator and the relevance
filter of `mmtrain data build`; it is re-exported here as part of the evaluation API.
"""

from __future__ import annotations

from typing import Any

import torch

from mmtrain.models.clip_score import clip_score

__all__ = ["clip_score", "clip_score_summary"]


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
