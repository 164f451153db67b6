"""Are a loss spike's samples mismatched pairs? (`mmtrain doctor RUN_DIR --relevance`)

A batch of pairs whose caption does not describe the image spikes a contrastive loss. The
run's own model scores each spike sample's image against its caption (the CLIP score that
`mmtrain data build --relevance-model` filters on, computed by the same `RelevanceScorer`)
beside the same score of the run's other samples (report/spike_samples.py)."""

from __future__ import annotations

import statistics

from mmtrain.report.finding import config_value
from mmtrain.report.run_model import image_text_model
from mmtrain.report.rundata import RunData
from mmtrain.report.spike_samples import (
    KEEP_SHARE,
    Sample,
    SamplesUnavailable,
    SpikeSamples,
    lower_bound,
)


def relevance_change(
    run: RunData, samples: SpikeSamples, device: str = "cpu"
) -> tuple[dict, str | None]:
    """(evidence, the data build command that drops the spike's pairs, or None when most of
    them score like the run's others). Raises ModelUnavailable when the run has no image-text
    model."""
    from mmtrain.data.ingest.filters import RelevanceScorer
    from mmtrain.data.stream.tokenizer import get_tokenizer

    model, _, _ = image_text_model(run)
    tokenizer = str(config_value(run, "data", "tokenizer", "byte"))
    scorer = RelevanceScorer(model, device=device, tokenizer=get_tokenizer(tokenizer))
    spiked = [s for s in samples.spiked if s.image is not None and s.caption is not None]
    if not spiked:
        raise SamplesUnavailable("the spike's samples hold no image-text pair to score")
    spike_scores = _scores(scorer, spiked)
    other_scores = _scores(scorer, samples.others)
    threshold = lower_bound(other_scores)
    below = [s.key for s, score in zip(spiked, spike_scores, strict=True) if score < threshold]
    evidence = {
        "relevance_median_spike": round(statistics.median(spike_scores), 3),
        "relevance_median_others": round(statistics.median(other_scores), 3),
        "relevance_threshold": round(threshold, 3),
        "samples_below_threshold": below,
    }
    if len(below) * 2 <= len(spiked):
        return evidence, None
    tokenizer_flag = "" if tokenizer == "byte" else f" --relevance-tokenizer {tokenizer}"
    return evidence, (
        f"{len(below)} of the {len(spiked)} samples score under {threshold:.1f}, a threshold "
        f"that keeps {KEEP_SHARE:.0%} of the run's other samples: rebuild the source "
        f"({', '.join(samples.paths)}) with mmtrain data build SRC --out DIR --relevance-model "
        f"{run.run_dir} --relevance-threshold {threshold:.1f}{tokenizer_flag}"
    )


def _scores(scorer, samples: list[Sample]) -> list[float]:
    pairs = [s for s in samples if s.image is not None and s.caption is not None]
    return [float(x) for x in scorer([s.image for s in pairs], [s.caption for s in pairs])]
