"""What a run's measurements say is wrong, and what to change (`mmtrain doctor RUN_DIR`).

Each check reads the run folder (report/rundata.py: the step rows, the recorder's events, the
resolved config) and returns at most one `Finding`: its kind, the evidence (metric names,
values and the steps they came from), why it matters and the change to make, as a config key
and a value or a command. Findings are ordered by the step time they cost, most first.

The thresholds are the field's rules of thumb, named here: a step that waits for data or for
communication more than a fifth of its time has a cheaper fix than more GPUs; a skipped step
or a loss spike comes with the sample keys of its batch.
"""

from __future__ import annotations

import dataclasses
import statistics

from mmtrain.plan.comm import COMM_SHARE_LIMIT
from mmtrain.report.data_checks import corrupt_samples, refused_data, too_long_samples
from mmtrain.report.finding import Finding, config_value, steady_rows
from mmtrain.report.layout_check import SEQUENCE_COLLECTIVES, sequence_groups_across_nodes
from mmtrain.report.memory_check import memory
from mmtrain.report.preference_check import preference_rewards
from mmtrain.report.rundata import RunData
from mmtrain.report.scaling import rank_balance
from mmtrain.report.training_checks import (
    clipped_gradients,
    collapsed_learning_rate,
    precision,
    tower_learning_rates,
)
from mmtrain.report.warmup_check import short_warmup

INPUT_BOUND_SHARE = 0.3  # mean data-wait share of a step above which the input pipeline binds
# A step that waited for data more than half its time stalled; a tenth of the steps stalling is
# a pipeline that runs dry in bursts even when its mean share is low (the utilisation that jumps
# up and down)
STALL_SHARE = 0.5
STALLED_STEPS = 0.1
# (communication: plan/comm.py's COMM_SHARE_LIMIT, the threshold the run warns at)
EXPOSED_PREFIX = "comm_exposed_s/"  # the rows' breakdown of comm_exposed_s by collective
# MFU under half what the planner expects of the workload on the device: the step spends its
# time on something other than the model's matmuls (the planner's figures are midpoints of
# published ranges; a run within a factor of two of one is not where the time goes)
MFU_SHARE = 0.5
# A language model's rows more than a fifth padding: packing them (data.pack) is the change
# (MFU counts padded positions as model work, since they are computed; the check reads the
# useful part, MFU times the share of positions that are not padding)
PADDING_SHARE = 0.2


def diagnose(run: RunData) -> list[Finding]:
    """Every finding the run's measurements support, the costliest first."""
    checks = (
        _input_bound,
        _communication,
        sequence_groups_across_nodes,
        rank_balance,
        _mfu,
        memory,
        corrupt_samples,
        too_long_samples,
        refused_data,
        _non_finite,
        _loss_spikes,
        collapsed_learning_rate,
        preference_rewards,
        clipped_gradients,
        short_warmup,
        tower_learning_rates,
        precision,
    )
    findings = [f for check in checks if (f := check(run)) is not None]
    return sorted(findings, key=lambda f: -f.cost_s)


def _input_bound(run: RunData) -> Finding | None:
    rows = steady_rows(run, "data_wait_s")
    if not rows:
        return None
    shares = [r["data_wait_s"] / r["step_s"] for r in rows]
    share = statistics.fmean(shares)
    stalled = [r for r, s in zip(rows, shares, strict=True) if s > STALL_SHARE]
    bursts = share <= INPUT_BOUND_SHARE  # then only the stalls call for a change
    if bursts and len(stalled) < STALLED_STEPS * len(rows):
        return None
    flagged = stalled if bursts else rows
    workers = int(config_value(run, "data", "workers", 0))
    evidence = {
        "data_wait_fraction_mean": round(share, 4),
        "data_wait_fraction_max": round(max(shares), 4),
        "data_wait_fraction_stdev": round(statistics.pstdev(shares), 4),
        "stalled_steps": len(stalled),
        "data_wait_s_total": round(sum(r["data_wait_s"] for r in flagged), 4),
        "data.workers": workers,
    }
    if any("cache_hit_rate" in r for r in rows):
        evidence["cache_hit_rate_mean"] = round(
            statistics.fmean(r["cache_hit_rate"] for r in rows if "cache_hit_rate" in r), 4
        )
    why = (
        f"the step waited for its batch {share:.0%} of its time (above "
        f"{INPUT_BOUND_SHARE:.0%}): the accelerator idles while samples are read and decoded"
    )
    if bursts:
        why = (
            f"{len(stalled)} of {len(rows)} steps waited for their batch more than "
            f"{STALL_SHARE:.0%} of their time (the mean is {share:.0%}): the input stalls in "
            "bursts (a slow sample or shard), and on several ranks every rank waits for the "
            "one that stalled"
        )
    return Finding(
        kind="input_bound",
        severity="info" if bursts else "warning",
        evidence=evidence,
        why=why,
        advice=(
            f"decode in more processes: data.workers={max(2, 2 * workers)} (now {workers}; "
            "each holds batches read ahead, which absorb a slow one); if the cache hit rate is "
            "low, give data.cache_max_gb room for the epoch's shards"
        ),
        cost_s=evidence["data_wait_s_total"],
        steps=[r["step"] for r in flagged],
    )


def _communication(run: RunData) -> Finding | None:
    rows = steady_rows(run, "comm_exposed_s")
    if not rows:
        return None
    share = statistics.fmean(r["comm_exposed_s"] / r["step_s"] for r in rows)
    if share <= COMM_SHARE_LIMIT:
        return None
    world = run.world_size()
    by_collective = _exposed_by_collective(rows)
    evidence = {
        "comm_exposed_fraction_mean": round(share, 4),
        "comm_s_total": round(sum(r["comm_s"] for r in rows), 4),
        "comm_exposed_s_total": round(sum(r["comm_exposed_s"] for r in rows), 4),
        "comm_exposed_s_by_collective": by_collective,
        "world_size": world,
        "train.parallel": config_value(run, "train", "parallel", "auto"),
        "train.sequence_parallel": config_value(run, "train", "sequence_parallel", 1),
    }
    model = run.config.get("model", "MODEL")
    largest = next(iter(by_collective), None)
    most = f", most of it in {largest}" if largest else ""
    advice = f"compare layouts: mmtrain plan --model {model} --gpus {world} --recommend"
    if largest in SEQUENCE_COLLECTIVES:
        advice = (
            "sequence parallelism's exchanges wait: a smaller train.sequence_parallel (if the "
            "rows fit), or the other train.sequence_parallel_attention (all_to_all moves heads, "
            f"ring keys and values); then {advice}"
        )
    return Finding(
        kind="communication",
        severity="warning",
        evidence=evidence,
        why=(
            f"the step waited for communication {share:.0%} of its time{most} (above "
            f"{COMM_SHARE_LIMIT:.0%}): past that, another parallel layout or more intra-node "
            "bandwidth is cheaper than more GPUs"
        ),
        advice=advice,
        cost_s=evidence["comm_exposed_s_total"],
        steps=[r["step"] for r in rows],
    )


def _exposed_by_collective(rows: list[dict]) -> dict[str, float]:
    """Seconds the steps waited for each collective (train/comm_timing.py's breakdown), the
    largest first."""
    totals: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith(EXPOSED_PREFIX):
                name = key[len(EXPOSED_PREFIX) :]
                totals[name] = totals.get(name, 0.0) + value
    return {k: round(v, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _mfu(run: RunData) -> Finding | None:
    rows = steady_rows(run, "mfu")
    achievable = run.plan.get("achievable_mfu")
    if not rows or not achievable:
        return None
    mfu = statistics.median(r["mfu"] for r in rows)
    useful = statistics.median(r["mfu"] * (1.0 - r.get("padding_fraction", 0.0)) for r in rows)
    if useful >= MFU_SHARE * achievable:
        return None
    split = {
        name: round(statistics.fmean(r[key] / r["step_s"] for r in rows if key in r), 4)
        for name, key in (("data_wait_fraction_mean", "data_wait_s"),
                          ("comm_exposed_fraction_mean", "comm_exposed_s"),
                          ("optimizer_fraction_mean", "optimizer_s"))
        if any(key in r for r in rows)
    }  # fmt: skip
    padding = [r["padding_fraction"] for r in rows if "padding_fraction" in r]
    evidence = {
        "mfu_median": round(mfu, 4),
        "achievable_mfu": round(achievable, 4),
        "efficiency_family": run.plan.get("efficiency_family"),
        **split,
        "train.compile": bool(config_value(run, "train", "compile", False)),
        "micro_batch": run.plan.get("micro_batch"),
    }
    if padding:
        evidence["padding_fraction_mean"] = round(statistics.fmean(padding), 4)
        evidence["useful_mfu_median"] = round(useful, 4)
        evidence["data.pack"] = bool(config_value(run, "data", "pack", False))
    return Finding(
        kind="mfu",
        severity="warning",
        evidence=evidence,
        why=(
            f"the model's FLOPs ran at {useful:.1%} of the device's peak"
            f"{' on positions that are not padding' if padding else ''}, under half the "
            f"{achievable:.1%} the planner expects of a {evidence['efficiency_family']} run "
            "(plan/compute.py): the step spends most of its time on something else"
        ),
        advice=_mfu_advice(evidence),
        cost_s=(1.0 - useful / achievable) * sum(r["step_s"] for r in rows),
        steps=[r["step"] for r in rows],
    )


def _mfu_advice(evidence: dict) -> str:
    """The changes the evidence calls for, in the order of the time they win back."""
    changes = []
    if evidence.get("data_wait_fraction_mean", 0.0) > INPUT_BOUND_SHARE:
        changes.append("feed the step (the input_bound finding): it waits for data")
    if evidence.get("comm_exposed_fraction_mean", 0.0) > COMM_SHARE_LIMIT:
        changes.append("hide the communication (the communication finding)")
    padding = evidence.get("padding_fraction_mean", 0.0)
    if padding > PADDING_SHARE and not evidence["data.pack"]:
        changes.append(f"pack several samples per row: data.pack=true ({padding:.0%} of the "
                       "positions computed are padding)")  # fmt: skip
    if not evidence["train.compile"]:
        changes.append("compile the towers: train.compile=true (fuses the small kernels "
                       "between the matmuls)")  # fmt: skip
    larger = 2 * (evidence["micro_batch"] or 1)
    changes.append(f"if memory allows, train.micro_batch={larger} (small matrices leave the "
                   "cores idle)")  # fmt: skip
    return "; then ".join(changes)


def _mean_step_s(run: RunData) -> float:
    times = [r["step_s"] for r in run.train_rows if r.get("step_s")]
    return statistics.fmean(times) if times else 0.0


def _events_finding(run: RunData, kind: str, why: str, advice: str) -> Finding | None:
    events = run.events.get(kind, [])
    if not events:
        return None
    samples = sorted({key for e in events for key in e.get("samples", [])})
    evidence = {"count": len(events), "loss": [e.get("loss") for e in events],
                "samples": samples}  # fmt: skip
    return Finding(
        kind=kind,
        severity="error" if kind == "non_finite" else "warning",
        evidence=evidence,
        why=why,
        advice=advice,
        cost_s=len(events) * _mean_step_s(run),  # each such step trained nothing useful
        steps=[int(e["step"]) for e in events],
    )


def _non_finite(run: RunData) -> Finding | None:
    return _events_finding(
        run,
        "non_finite",
        "steps had a non-finite loss or gradient and were skipped (after "
        "guards.max_nonfinite_in_a_row in a row the run rolls back)",
        "check the listed samples (`mmtrain data inspect`); under fp16/fp8 keep the unstable "
        "towers in bf16 (train.precision: bf16) or lower train.lr",
    )


def _loss_spikes(run: RunData) -> Finding | None:
    return _events_finding(
        run,
        "loss_spike",
        "the loss jumped far above its recent level (more than 4 standard deviations of its "
        "moving average): often a batch of dirty samples",
        "inspect the listed samples and rebuild the shards with filters (`mmtrain data build "
        "... --min-side`, relevance thresholds); a spike without bad samples: lower train.lr "
        "or lower train.grad_clip",
    )


def examine_spike(
    run: RunData, finding: Finding, *, relevance: bool, quality: bool, device: str = "cpu"
) -> Finding:
    """A loss_spike finding with its samples read back and examined (report/spike_samples.py):
    their build-filter measures (`quality`) and the run's model's score of each pair
    (`relevance`) in its evidence, and the filters that drop them as its change; when no
    examination finds them dirty, the spike is the optimiser's. Raises SamplesUnavailable, or
    ModelUnavailable for `relevance` without an image-text model."""
    from mmtrain.report.spike_quality import quality_change
    from mmtrain.report.spike_relevance import relevance_change
    from mmtrain.report.spike_samples import read_spike_samples

    samples = read_spike_samples(run, finding)
    evidence, changes = dict(finding.evidence), []
    examinations = [(quality, lambda: quality_change(samples)),
                    (relevance, lambda: relevance_change(run, samples, device))]  # fmt: skip
    for wanted, examine in examinations:
        if wanted:
            found, change = examine()
            evidence.update(found)
            changes += [change] if change else []
    advice = "; ".join(changes) or (
        f"the {len(samples.spiked)} samples measure like the run's others (not dirty data): "
        "the spike is the optimiser's; lower train.lr or train.grad_clip"
    )
    return dataclasses.replace(finding, evidence=evidence, advice=advice)
