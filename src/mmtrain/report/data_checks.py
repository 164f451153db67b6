"""`mmtrain doctor`'s checks of the samples a run read: those that did not decode (corrupt),
those too long for the row (data.sequence_length), and a run stopped because no batch could
be filled at all."""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import RunData

CORRUPT_SHARE = 0.01  # unreadable samples above 1 in 100: the shards, not bad luck
# Samples too long for the row above 1 in 100: the row length or the pixel budget is off for
# the data (each is read and tokenised for nothing, and the model never sees them).
TOO_LONG_SHARE = 0.01


@dataclass(frozen=True)
class _Skipped:
    """A run's skipped samples of one kind (a counter of the metrics rows): the last count,
    its share of the samples read, and the steps at which it grew."""

    count: int
    seen: int
    share: float
    steps: list[int]
    cost_s: float  # the share of the run's step time spent reading them


def _skipped(run: RunData, key: str, threshold: float) -> _Skipped | None:
    """The samples counted under `key` when they are above `threshold` of those read."""
    rows = [r for r in run.train_rows if key in r and "samples_seen" in r]
    if not rows:
        return None
    count, seen = int(rows[-1][key]), int(rows[-1]["samples_seen"])
    share = count / (count + seen) if count + seen else 0.0
    if share <= threshold:
        return None
    before = [0, *(int(r[key]) for r in rows[:-1])]
    steps = [r["step"] for r, b in zip(rows, before, strict=True) if r[key] > b]
    cost_s = share * sum(r.get("step_s", 0.0) for r in rows)
    return _Skipped(count, seen, share, steps, cost_s)


def corrupt_samples(run: RunData) -> Finding | None:
    skipped = _skipped(run, "corrupt_samples", CORRUPT_SHARE)
    if skipped is None:
        return None
    sources = config_value(run, "data", "train", None) or ["SHARDS"]
    sources = [sources] if isinstance(sources, (str, dict)) else sources
    paths = [s["path"] if isinstance(s, dict) else str(s) for s in sources]  # resolved: dicts
    inspect = " ; ".join(f"mmtrain data inspect {path}" for path in paths)
    return Finding(
        kind="data_quality",
        severity="warning",
        evidence={
            "corrupt_samples": skipped.count,
            "samples_seen": skipped.seen,
            "corrupt_fraction": round(skipped.share, 4),
        },  # fmt: skip
        why=(
            f"{skipped.share:.1%} of the samples read could not be decoded and were skipped "
            f"(above {CORRUPT_SHARE:.0%}): the run trains on a different mix than the manifest "
            "says, and pays for reading them"
        ),
        advice=(
            f"find them: {inspect} ; rebuild the shards with mmtrain data build (it refuses "
            "files that do not decode)"
        ),
        cost_s=skipped.cost_s,
        steps=skipped.steps,
    )


def too_long_samples(run: RunData) -> Finding | None:
    """Samples skipped because the row of data.sequence_length positions cannot hold them
    (an image or clip would be cut, or every answer): above TOO_LONG_SHARE of those read."""
    skipped = _skipped(run, "too_long_samples", TOO_LONG_SHARE)
    if skipped is None:
        return None
    length = config_value(run, "data", "sequence_length", None)
    budget = (
        " or a smaller page budget (data.vision.image_max_tokens, sample_max_tokens)"
        if config_value(run, "data", "vision", None) is not None
        else ""
    )
    return Finding(
        kind="data_quality",
        severity="warning",
        evidence={
            "too_long_samples": skipped.count,
            "samples_seen": skipped.seen,
            "too_long_fraction": round(skipped.share, 4),
            "data.sequence_length": length,
        },
        why=(
            f"{skipped.share:.1%} of the samples read were longer than a row of {length} "
            "positions and were skipped (cutting them would cut an image, a clip or every "
            "answer): the model never trains on them, and the data mix is not the one the "
            "shards hold"
        ),
        advice=(
            "see how long the samples are: mmtrain plan --data SHARDS --model MODEL (their "
            f"length distribution); then a longer data.sequence_length{budget}"
        ),
        cost_s=skipped.cost_s,
        steps=skipped.steps,
    )


def refused_data(run: RunData) -> Finding | None:
    """A run stopped because no batch could be filled (every sample of an epoch refused): the
    `stopped` record the trainer writes with the field to change."""
    stops = [e for e in run.events.get("stopped", []) if e.get("field")]
    if not stops:
        return None
    stop = stops[-1]
    return Finding(
        kind="data_quality",
        severity="error",
        evidence={"field": stop["field"], "step": stop["step"]},
        why=f"the run stopped: {stop['message']}",
        advice=f"change {stop['field']} as the message says, then run the same command again",
        steps=[int(stop["step"]) + 1],
    )
