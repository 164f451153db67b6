"""Tokens per sample as a distribution: `Lengths` (per sample, LM positions and images, and a
native-resolution VLM's inputs at the tower's size) and `summarize` (count, mean, p50, p90,
p99, max of a list of counts).

Shared by the planner (`plan/lengths.py` lays the samples out in rows, `mmtrain plan --data`)
and the data tools (`data inspect` reports the same statistics), below both. Pure Python,
no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mmtrain.structured import FieldError

__all__ = ["Lengths", "percentile", "summarize"]


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """The nearest-rank percentile (a value that occurs in the data, never interpolated)."""
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(values: Sequence[int]) -> dict[str, float]:
    """count, mean, p50, p90, p99 and max of a list of counts."""
    ordered = sorted(values)
    n = len(ordered)
    return {
        "count": n,
        "mean": round(sum(ordered) / n, 2) if n else 0.0,
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1] if n else 0,
    }


Visual = tuple[int, int, int]  # (frames, height, width) at a native tower's size


@dataclass(frozen=True)
class Lengths:
    """Per sample: LM positions (images spliced in) and images. `source` names where they
    came from (shards, or a stated synthetic distribution).

    A native-resolution VLM (spec.vision: each page and clip at its own size) also gives
    `visual_shapes`: per sample, its images then clips as (frames, height, width) at the
    tower's size (`conversation_counts(..., budget=)`), from which the planner takes each
    sample's own visual tokens, patches and tower FLOPs (plan/lengths.py). Empty otherwise
    (a fixed-size tower: every image costs the same)."""

    positions: tuple[int, ...]
    images: tuple[int, ...]
    source: str = ""
    visual_shapes: tuple[tuple[Visual, ...], ...] = ()

    def __post_init__(self) -> None:
        if len(self.positions) != len(self.images):
            raise ValueError(f"{len(self.positions)} lengths but {len(self.images)} image counts")
        if self.visual_shapes and len(self.visual_shapes) != len(self.positions):
            raise ValueError(
                f"{len(self.positions)} lengths but {len(self.visual_shapes)} samples' visual shapes"
            )
        if not self.positions:
            raise FieldError("--data", f"{self.source or 'the data'} holds no usable sample")

    def summary(self) -> dict[str, dict[str, float]]:
        out = {"positions": summarize(self.positions), "images": summarize(self.images)}
        if self.visual_shapes:
            out["visual_inputs"] = summarize([len(s) for s in self.visual_shapes])
        return out
