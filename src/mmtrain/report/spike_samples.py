"""A loss spike's samples read back from the run's training shards, beside the run's others
(`mmtrain doctor RUN_DIR --relevance / --quality`).

The loss_spike finding names the sample keys of the batches that spiked. Whether they are the
dirt of web image-text data, or clean samples met by a learning rate on the edge, shows only
against the run's own data: each examination (report/spike_relevance.py: the run's model's
CLIP score; report/spike_quality.py: the measures `mmtrain data build` filters on) measures
the spike's samples and REFERENCE_SAMPLES others, evenly spread over the shards, and proposes
the filter bound that keeps KEEP_SHARE of the others; spike samples past it are what that
filter drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import RunData

REFERENCE_SAMPLES = 64  # the run's other samples measured beside the spike's, evenly spread
KEEP_SHARE = 0.95  # a proposed filter bound keeps this share of them


class SamplesUnavailable(Exception):
    """The spike's samples cannot be read from the run's training shards; the message says why."""


@dataclass(frozen=True)
class Sample:
    """One image-text sample as decoded for training (None: the sample has no such part)."""

    key: str
    image: np.ndarray | None  # uint8 [H, W, 3]
    caption: str | None


@dataclass(frozen=True)
class SpikeSamples:
    paths: list[str]  # the training sources, as the run's config names them
    spiked: list[Sample]  # the spike's samples found in the shards, in key order
    others: list[Sample]  # up to REFERENCE_SAMPLES of the run's other samples


def read_spike_samples(run: RunData, finding: Finding) -> SpikeSamples:
    """The samples of `finding` (a loss_spike) and the run's reference samples, decoded; raises
    SamplesUnavailable when the shards cannot be opened or hold none of the spike's keys."""
    from mmtrain.data.storage.shards import ShardSet

    paths = train_paths(run)
    try:
        shards = ShardSet.open(paths)
    except (OSError, ValueError) as err:
        raise SamplesUnavailable(f"the training shards could not be opened: {err}") from None
    try:
        where = {shards.key(i): i for i in range(len(shards))}
        spiked = sorted({where[k] for k in finding.evidence["samples"] if k in where})
        chosen = set(spiked)
        others = [i for i in range(len(shards)) if i not in chosen]
        others = others[:: max(1, len(others) // REFERENCE_SAMPLES)][:REFERENCE_SAMPLES]
        samples = SpikeSamples(paths, _decoded(shards, spiked), _decoded(shards, others))
    finally:
        shards.close()
    if not samples.spiked or not samples.others:
        raise SamplesUnavailable("the spike's samples are not in the training shards")
    return samples


def _decoded(shards: Any, ids: list[int]) -> list[Sample]:
    """The samples whose parts decode (the data_quality finding counts the others)."""
    from mmtrain.data.stream.media import MediaError, decode_image, decode_text
    from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS

    samples = []
    for i in ids:
        raw = shards.read(i)
        image = next((raw[e] for e in MODALITY_EXTENSIONS["image"] if e in raw), None)
        text = next((raw[e] for e in MODALITY_EXTENSIONS["text"] if e in raw), None)
        try:
            samples.append(Sample(shards.key(i),
                                  None if image is None else decode_image(image),
                                  None if text is None else decode_text(text)))  # fmt: skip
        except MediaError:
            continue
    return samples


def train_paths(run: RunData) -> list[str]:
    sources = config_value(run, "data", "train", None) or []
    sources = [sources] if isinstance(sources, (str, dict)) else sources
    paths = [s["path"] if isinstance(s, dict) else s for s in sources]  # resolved: dicts
    return [str(p) for path in paths for p in (path if isinstance(path, list) else [path])]


def lower_bound(values: list[float]) -> float:
    """The bound under which a filter drops values, keeping KEEP_SHARE of `values`."""
    return float(np.quantile(values, 1.0 - KEEP_SHARE))


def upper_bound(values: list[float]) -> float:
    """The bound over which a filter drops values, keeping KEEP_SHARE of `values`."""
    return float(np.quantile(values, KEEP_SHARE))
