"""`mmtrain doctor`'s checks of the samples a run read: those that did not decode (corrupt),
those too long for the row (data.sequence_length), and a run stopped because no batch could
be filled at all."""

from __future__ import annotations

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import RunData

CORRUPT_SHARE = 0.01  # unreadable samples above 1 in 100: the shards, not bad luck
# Samples too long for the row above 1 in 100: the row length or the pixel budget is off for
# the data (each is read and tokenised for nothing, and the model never sees them).
TOO_LONG_SHARE = 0.01


def corrupt_samples(run: RunData) -> Finding | None:
    rows = [r for r in run.train_rows if "corrupt_samples" in r and "samples_seen" in r]
    if not rows:
        return None
    corrupt, seen = int(rows[-1]["corrupt_samples"]), int(rows[-1]["samples_seen"])
    share = corrupt / (corrupt + seen) if corrupt + seen else 0.0
    if share <= CORRUPT_SHARE:
        return None
    before = [0, *(int(r["corrupt_samples"]) for r in rows[:-1])]
    steps = [r["step"] for r, b in zip(rows, before, strict=True) if r["corrupt_samples"] > b]
    sources = config_value(run, "data", "train", None) or ["SHARDS"]
    sources = [sources] if isinstance(sources, (str, dict)) else sources
    paths = [s["path"] if isinstance(s, dict) else str(s) for s in sources]  # resolved: dicts
    inspect = " ; ".join(f"mmtrain data inspect {path}" for path in paths)
    return Finding(
        kind="data_quality",
        severity="warning",
        evidence={
            "corrupt_samples": corrupt,
            "samples_seen": seen,
            "corrupt_fraction": round(share, 4),
        },  # fmt: skip
        why=(
            f"{share:.1%} of the samples read could not be decoded and were skipped (above "
            f"{CORRUPT_SHARE:.0%}): the run trains on a different mix than the manifest says, "
            "and pays for reading them"
        ),
        advice=(
            f"find them: {inspect} ; rebuild the shards with mmtrain data build (it refuses "
            "files that do not decode)"
        ),
        cost_s=share * sum(r.get("step_s", 0.0) for r in rows),
        steps=steps,
    )


def too_long_samples(run: RunData) -> Finding | None:
    """Samples skipped because the row of data.sequence_length positions cannot hold them
    (an image or clip would be cut, or every answer): above TOO_LONG_SHARE of those read."""
    rows = [r for r in run.train_rows if "too_long_samples" in r and "samples_seen" in r]
    if not rows:
        return None
    too_long, seen = int(rows[-1]["too_long_samples"]), int(rows[-1]["samples_seen"])
    share = too_long / (too_long + seen) if too_long + seen else 0.0
    if share <= TOO_LONG_SHARE:
        return None
    before = [0, *(int(r["too_long_samples"]) for r in rows[:-1])]
    steps = [r["step"] for r, b in zip(rows, before, strict=True) if r["too_long_samples"] > b]
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
            "too_long_samples": too_long,
            "samples_seen": seen,
            "too_long_fraction": round(share, 4),
            "data.sequence_length": length,
        },
        why=(
            f"{share:.1%} of the samples read were longer than a row of {length} positions and "
            "were skipped (cutting them would cut an image, a clip or every answer): the model "
            "never trains on them, and the data mix is not the one the shards hold"
        ),
        advice=(
            "see how long the samples are: mmtrain plan --data SHARDS --model MODEL (their "
            f"length distribution); then a longer data.sequence_length{budget}"
        ),
        cost_s=share * sum(r.get("step_s", 0.0) for r in rows),
        steps=steps,
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
