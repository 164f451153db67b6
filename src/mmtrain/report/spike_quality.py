"""Do a loss spike's samples fail `mmtrain data build`'s filters? (`mmtrain doctor RUN_DIR
--quality`)

Web image-text data holds placeholders ("image not available": one flat colour), thumbnails,
banners and captions of a word or of a page; a batch of them spikes the loss. Each measure a
build filter bounds is taken of the spike's samples and of the run's others the way the build
takes it (data/ingest: the decoded image's shorter side and aspect, the Laplacian variance of
its grayscale, the cleaned caption's words and characters), and a filter is proposed where
most of the spike's samples fall past the bound that keeps KEEP_SHARE of the others.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from mmtrain.data.ingest.filters import clean_caption, laplacian_variance
from mmtrain.report.spike_samples import (
    KEEP_SHARE,
    Sample,
    SpikeSamples,
    lower_bound,
    upper_bound,
)


def _side(s: Sample) -> float | None:
    return None if s.image is None else float(min(s.image.shape[:2]))


def _aspect(s: Sample) -> float | None:
    return None if s.image is None else max(s.image.shape[:2]) / max(1, min(s.image.shape[:2]))


def _sharpness(s: Sample) -> float | None:
    return None if s.image is None else laplacian_variance(s.image)


def _words(s: Sample) -> float | None:
    return None if s.caption is None else float(len(clean_caption(s.caption).split()))


def _chars(s: Sample) -> float | None:
    return None if s.caption is None else float(len(clean_caption(s.caption)))


@dataclass(frozen=True)
class Measure:
    name: str
    flag: str  # the `mmtrain data build` filter bounding it
    drops_below: bool  # the filter drops values under its bound (else over it)
    integer: bool  # the flag takes an integer
    of: Callable[[Sample], float | None]

    def bound(self, others: list[float]) -> float:
        """The flag's value that keeps KEEP_SHARE of `others`, rounded outwards so that the
        value printed keeps them too."""
        if self.drops_below:
            q = lower_bound(others)
            return float(math.floor(q)) if self.integer else math.floor(q * 100) / 100
        q = upper_bound(others)
        return float(math.ceil(q)) if self.integer else math.ceil(q * 100) / 100

    def fails(self, value: float, bound: float) -> bool:
        return value < bound if self.drops_below else value > bound


MEASURES = (
    Measure("shorter_side_px", "--min-side", True, True, _side),
    Measure("aspect", "--max-aspect", False, False, _aspect),
    Measure("sharpness", "--min-sharpness", True, False, _sharpness),
    Measure("caption_words", "--min-caption-words", True, True, _words),
    Measure("caption_words", "--max-caption-words", False, True, _words),
    Measure("caption_chars", "--min-caption-chars", True, True, _chars),
    Measure("caption_chars", "--max-caption-chars", False, True, _chars),
)


def quality_change(samples: SpikeSamples) -> tuple[dict, str | None]:
    """(evidence: each measure's median over the spike's samples and the others, and the
    filters most spike samples fail with the keys they drop; the data build command with those
    filters, or None when none is failed by most)."""
    evidence: dict = {}
    failed: dict[str, tuple[float, list[str]]] = {}
    for m in MEASURES:
        spiked = [(s.key, v) for s in samples.spiked if (v := m.of(s)) is not None]
        others = [v for s in samples.others if (v := m.of(s)) is not None]
        if not spiked or not others:
            continue
        evidence[f"{m.name}_median_spike"] = round(statistics.median(v for _, v in spiked), 3)
        evidence[f"{m.name}_median_others"] = round(statistics.median(others), 3)
        bound = m.bound(others)
        keys = [key for key, v in spiked if m.fails(v, bound)]
        if len(keys) * 2 > len(spiked):
            failed[m.flag] = (bound, keys)
    if not failed:
        return evidence, None
    evidence["filters_failed"] = {flag: bound for flag, (bound, _) in failed.items()}
    evidence["samples_failing"] = sorted({k for _, keys in failed.values() for k in keys})
    flags = " ".join(f"{flag} {_number(bound)}" for flag, (bound, _) in failed.items())
    counts = ", ".join(f"{len(keys)} {flag}" for flag, (_, keys) in failed.items())
    return evidence, (
        f"of the {len(samples.spiked)} samples, {counts} fail the filter bound that keeps "
        f"{KEEP_SHARE:.0%} of the run's other samples: rebuild the source "
        f"({', '.join(samples.paths)}) with mmtrain data build SRC --out DIR {flags}"
    )


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else str(value)
