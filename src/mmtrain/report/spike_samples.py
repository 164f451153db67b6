"""Are a loss spike's samples dirty pairs? (`mmtrain doctor RUN_DIR --relevance`)

The loss_spike finding names the sample keys of the batches that spiked. A batch of pairs
whose caption does not describe the image (the common dirt of web image-text data) spikes a
contrastive loss; so does a learning rate on the edge, on clean samples. The run's own model
tells them apart: it scores each spike sample's image against its caption (the CLIP score that
`mmtrain data build --relevance-model` filters on, computed by the same `RelevanceScorer`) beside
the same score of the run's other samples. The threshold it proposes keeps KEEP_SHARE of those
other samples; spike samples under it are what a relevance filter at that threshold drops.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import numpy as np

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.run_model import ModelUnavailable, image_text_model
from mmtrain.report.rundata import RunData

REFERENCE_SAMPLES = 64  # the run's other samples scored beside the spike's, evenly spread
KEEP_SHARE = 0.95  # the proposed threshold keeps this share of them


def score_spike_samples(run: RunData, finding: Finding, device: str = "cpu") -> Finding:
    """`finding` (a loss_spike) with the relevance of its samples against the run's others in
    its evidence, and the filter that drops them in its advice. Raises ModelUnavailable when
    the run has no image-text model or its training shards cannot be read."""
    from mmtrain.data.ingest.filters import RelevanceScorer
    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.tokenizer import get_tokenizer

    model, _, _ = image_text_model(run)
    tokenizer = str(config_value(run, "data", "tokenizer", "byte"))
    scorer = RelevanceScorer(model, device=device, tokenizer=get_tokenizer(tokenizer))
    paths = _train_paths(run)
    try:
        shards = ShardSet.open(paths)
    except (OSError, ValueError) as err:
        raise ModelUnavailable(f"the training shards could not be opened: {err}") from None
    try:
        where = {shards.key(i): i for i in range(len(shards))}
        keys = [k for k in finding.evidence["samples"] if k in where]
        spiked = {where[k] for k in keys}
        others = [i for i in range(len(shards)) if i not in spiked]
        others = others[:: max(1, len(others) // REFERENCE_SAMPLES)][:REFERENCE_SAMPLES]
        spike_scores = _scores(scorer, shards, [where[k] for k in keys])
        other_scores = _scores(scorer, shards, others)
    finally:
        shards.close()
    if not keys or not other_scores:
        raise ModelUnavailable("the spike's samples are not in the training shards")
    threshold = float(np.quantile(other_scores, 1.0 - KEEP_SHARE))
    below = [k for k, s in zip(keys, spike_scores, strict=True) if s < threshold]
    evidence = {
        **finding.evidence,
        "relevance_median_spike": round(statistics.median(spike_scores), 3),
        "relevance_median_others": round(statistics.median(other_scores), 3),
        "relevance_threshold": round(threshold, 3),
        "samples_below_threshold": below,
    }
    return dataclasses.replace(
        finding, evidence=evidence, advice=_advice(run, paths, tokenizer, threshold, below, keys)
    )


def _scores(scorer: Any, shards: Any, ids: list[int]) -> list[float]:
    from mmtrain.data.stream.media import MediaError, decode_image, decode_text
    from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS

    images, captions = [], []
    for i in ids:
        sample = shards.read(i)
        try:
            image = next(e for e in MODALITY_EXTENSIONS["image"] if e in sample)
            text = next(e for e in MODALITY_EXTENSIONS["text"] if e in sample)
            images.append(decode_image(sample[image]))
            captions.append(decode_text(sample[text]))
        except (MediaError, StopIteration):
            continue  # undecodable: the data_quality finding counts those
    return [float(s) for s in scorer(images, captions)]


def _train_paths(run: RunData) -> list[str]:
    sources = config_value(run, "data", "train", None) or []
    sources = [sources] if isinstance(sources, (str, dict)) else sources
    paths = [s["path"] if isinstance(s, dict) else s for s in sources]  # resolved: dicts
    return [str(p) for path in paths for p in (path if isinstance(path, list) else [path])]


def _advice(
    run: RunData, paths: list[str], tokenizer: str, threshold: float, below: list, keys: list
) -> str:
    if len(below) * 2 <= len(keys):
        return (
            f"{len(keys) - len(below)} of the {len(keys)} samples score like the run's others "
            "(not mismatched pairs): the spike is the optimiser's; lower train.lr or "
            "train.grad_clip"
        )
    tokenizer_flag = "" if tokenizer == "byte" else f" --relevance-tokenizer {tokenizer}"
    return (
        f"{len(below)} of the {len(keys)} samples score under {threshold:.1f}, a threshold that "
        f"keeps {KEEP_SHARE:.0%} of the run's other samples: rebuild the source ({', '.join(paths)}) "
        f"with mmtrain data build SRC --out DIR --relevance-model {run.run_dir} "
        f"--relevance-threshold {threshold:.1f}{tokenizer_flag}"
    )
