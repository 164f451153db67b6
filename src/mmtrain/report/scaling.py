"""Scaling efficiency across runs of one config at different GPU counts (`mmtrain doctor RUN1
RUN2 ...`): do N ranks train N times what one rank trains?

Each run's throughput is the median `samples_per_s` (the global batch over the step time) of its
steps after the warm-up; per rank it is that over the run's world size (its `layout` record).
The efficiency of a run is its per-rank throughput over that of the run with the fewest ranks:
1.0 is linear scaling, for a fixed global batch (strong scaling) as for a fixed batch per rank
(weak scaling). The median keeps one slow step (a checkpoint, a busy neighbour) from deciding.

Below SCALING_EFFICIENCY the added GPUs buy less than four fifths of what they cost. The
finding names what grew with the world size, in the order the field looks: the exposed
communication share of the step (another layout, parallel groups inside one node), then the
data-wait share (the input pipeline feeds N ranks from the same hosts).

Within one run (`rank_balance`): a step lasts as long as its heaviest rank, so ranks whose
rows differ in cost (a language model's rows and pages) wait for it at every collective. The
rows' `load_balance` (the ranks' mean model FLOPs over the heaviest rank's, train/recorder.py)
under SCALING_EFFICIENCY is a share of the ranks' time lost the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from mmtrain.plan.comm import COMM_SHARE_LIMIT
from mmtrain.report.finding import Finding, config_value, steady_rows
from mmtrain.report.rundata import RunData

# The complement of the 20% communication rule: a step that waits a fifth of its time for
# communication scales at 80% at best.
SCALING_EFFICIENCY = 1.0 - COMM_SHARE_LIMIT
SHARE_GROWTH = 0.05  # a share of the step that grew by less is not what the time went to


class ScalingInputError(ValueError):
    """Runs that cannot be compared: another model or precision, or one GPU count for all."""


def _share(run: RunData, key: str) -> float:
    rows = steady_rows(run, key)
    return statistics.fmean(r[key] / r["step_s"] for r in rows) if rows else 0.0


def _same_config(runs: Sequence[RunData]) -> None:
    first = runs[0]
    for run in runs[1:]:
        for what, mine, theirs in (
            ("model", run.spec or run.config.get("model"), first.spec or first.config.get("model")),
            ("train.precision", config_value(run, "train", "precision", None),
             config_value(first, "train", "precision", None)),
        ):  # fmt: skip
            if mine != theirs:
                raise ScalingInputError(
                    f"{run.run_dir}: another {what} than {first.run_dir}; scaling compares "
                    "runs of one config at different GPU counts"
                )
    if len({r.world_size() for r in runs}) < 2:
        raise ScalingInputError(
            f"all {len(runs)} runs have {first.world_size()} ranks: give runs of the config at "
            "different GPU counts"
        )


def _throughput(run: RunData) -> float:
    rows = steady_rows(run, "samples_per_s")
    if not rows:
        raise ScalingInputError(f"{run.run_dir}: no training step after the warm-up recorded")
    return statistics.median(r["samples_per_s"] for r in rows)


def scaling(runs: Sequence[RunData]) -> Finding | None:
    """The scaling finding of runs of one config (any order), or None when it scales."""
    _same_config(runs)
    runs = sorted(runs, key=RunData.world_size)
    worlds = [r.world_size() for r in runs]
    per_rank = [_throughput(r) / w for r, w in zip(runs, worlds, strict=True)]
    efficiency = [p / per_rank[0] for p in per_rank]
    if min(efficiency[1:]) >= SCALING_EFFICIENCY:
        return None
    worst = min(range(1, len(runs)), key=efficiency.__getitem__)
    comm = [round(_share(r, "comm_exposed_s"), 4) for r in runs]
    wait = [round(_share(r, "data_wait_s"), 4) for r in runs]
    evidence: dict[str, Any] = {
        "runs": [str(r.run_dir) for r in runs],
        "world_size": worlds,
        "samples_per_s_per_rank": [round(p, 4) for p in per_rank],
        "scaling_efficiency": [round(e, 4) for e in efficiency],
        "comm_exposed_fraction_mean": comm,
        "data_wait_fraction_mean": wait,
    }
    rows = steady_rows(runs[worst], "samples_per_s")
    return Finding(
        kind="scaling",
        severity="warning",
        evidence=evidence,
        why=(
            f"at {worlds[worst]} ranks each rank trains {efficiency[worst]:.0%} of what it "
            f"trains at {worlds[0]} (below {SCALING_EFFICIENCY:.0%}): {worlds[worst]} ranks train "
            f"{worlds[worst] * efficiency[worst] / worlds[0]:.2f}x the samples/s of "
            f"{worlds[0]}, where linear scaling gives {worlds[worst] / worlds[0]:g}x"
        ),
        advice=_advice(runs[worst], worlds[worst], (comm[0], comm[worst]), (wait[0], wait[worst])),
        cost_s=(1.0 - efficiency[worst]) * sum(r["step_s"] for r in rows),
        steps=[r["step"] for r in rows],
    )


def _advice(run: RunData, world: int, comm: tuple[float, float], wait: tuple[float, float]) -> str:
    """The change for the share of the step (base run, scaled run) that grew the most."""
    model = run.config.get("model", "MODEL")
    comm_growth, wait_growth = comm[1] - comm[0], wait[1] - wait[0]
    if comm_growth >= max(wait_growth, SHARE_GROWTH):
        return (
            f"the exposed communication went from {comm[0]:.0%} to {comm[1]:.0%} of the step: "
            f"compare layouts with mmtrain plan --model {model} --gpus {world} --recommend, "
            "and keep the parallel groups inside one node (NVLink)"
        )
    if wait_growth >= SHARE_GROWTH:
        workers = int(config_value(run, "data", "workers", 0))
        return (
            f"the wait for data went from {wait[0]:.0%} to {wait[1]:.0%} of the step: each "
            f"host feeds more ranks; decode in more processes: data.workers={max(2, 2 * workers)}"
        )
    if not steady_rows(run, "comm_exposed_s"):
        return "measure the communication: rerun with metrics.comm_timing=true, then doctor again"
    return (
        "neither communication nor the wait for data grew: compare the ranks' step times; "
        "the slowest rank sets every step"
    )


def rank_balance(run: RunData) -> Finding | None:
    """A finding when the ranks' work per step is uneven: their mean model FLOPs under
    SCALING_EFFICIENCY of the heaviest rank's, on average over the steps."""
    rows = steady_rows(run, "load_balance")
    if not rows:
        return None
    balance = statistics.fmean(r["load_balance"] for r in rows)
    if balance >= SCALING_EFFICIENCY:
        return None
    dealt = bool(config_value(run, "data", "balance", False))
    micro = run.plan.get("micro_batch") or 1
    per_rank = config_value(run, "train", "batch_size", 0) // max(1, run.world_size())
    evidence = {
        "load_balance_mean": round(balance, 4),
        "load_balance_min": round(min(r["load_balance"] for r in rows), 4),
        "world_size": run.world_size(),
        "data.balance": dealt,
        "samples_per_rank_per_step": per_rank,
        "micro_batch": micro,
    }
    if not dealt and per_rank > 1:
        advice = ("deal each step's samples to the ranks by cost: data.balance=true (the same "
                  "samples, the same gradient)")  # fmt: skip
    elif per_rank <= 1:
        advice = ("one sample per rank and step leaves nothing to deal: more samples per "
                  "rank (train.batch_size), then data.balance=true")  # fmt: skip
    else:
        advice = ("the samples differ in cost more than dealing evens out: pack rows to one "
                  "length (data.pack=true) or cap the pages' tokens (data.vision)")  # fmt: skip
    return Finding(
        kind="scaling",
        severity="warning",
        evidence=evidence,
        why=(
            f"the ranks did {balance:.0%} of the heaviest rank's model FLOPs on average (under "
            f"{SCALING_EFFICIENCY:.0%}): every step lasts as long as its heaviest rank, and "
            "the others wait for it at its collectives"
        ),
        advice=advice,
        cost_s=(1.0 - balance) * sum(r.get("compute_s", r["step_s"]) for r in rows),
        steps=[r["step"] for r in rows],
    )
