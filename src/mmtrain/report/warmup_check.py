"""A warm-up too short for Adam (`mmtrain doctor`): the loss of a run's first steps rose far
above where it started, after the warm-up had ended.

Adam divides each weight's gradient by the root of its second-moment estimate. Over the first
steps that estimate holds a handful of gradients, so each update is about the learning rate
times the gradient's sign, whatever the gradient's size: every weight moves by the full rate
at once. A model that starts from a checkpoint, whose gradients are small, is thrown furthest.
The estimate settles over about 2 / (1 - beta2) steps, and a linear warm-up over that many is
the untuned rule that works as well as tuned ones (Ma & Yarats, "On the adequacy of untuned
warmup for adaptive optimization", AAAI 2021): 100 steps at the CLIP default beta2 = 0.98.
"""

from __future__ import annotations

import math

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import RunData
from mmtrain.report.training_checks import collapsed_learning_rate

RISE = 2.0  # the loss at twice its first step's: the updates undid what the model knew
RECOVERED = 1.1  # back within 10% of the first step's loss: the rise's cost ends there
WARMUP_SHARE_MAX = 0.1  # a warm-up longer than a tenth of the run is rarely worth its steps


def adam_horizon(beta2: float) -> int:
    """The steps over which Adam's second-moment estimate settles: 2 / (1 - beta2)."""
    return round(2.0 / (1.0 - beta2))


def _sustained_rise(rows: list[dict], first: float, after: int, horizon: int) -> list[dict]:
    """The rows from the first step in (after, horizon] whose loss passed RISE times `first`
    and whose next step's stayed above RECOVERED times it, up to the step before the loss came
    back. A batch of dirty samples spikes on its own step and the next batch's loss is back;
    an update too large raises the loss of the batches after it too."""
    for i, row in enumerate(rows[:-1]):
        rising = after < row["step"] <= horizon and row["loss"] > RISE * first
        if rising and rows[i + 1]["loss"] > RECOVERED * first:
            rest = rows[i:]
            back = next((j for j, r in enumerate(rest) if r["loss"] <= RECOVERED * first), None)
            return rest[:back]
    return []


def short_warmup(run: RunData) -> Finding | None:
    rows = [r for r in run.train_rows if math.isfinite(r.get("loss", math.nan))]
    if not rows or rows[0]["loss"] <= 0 or collapsed_learning_rate(run) is not None:
        return None  # a collapsed run's finding asks for a longer warm-up already
    warmup = int(config_value(run, "train", "warmup_steps", 0))
    betas = config_value(run, "train", "betas", None) or (0.9, 0.98)  # unset: OpenCLIP's
    horizon = adam_horizon(float(betas[1]))
    steps = int(config_value(run, "train", "steps", rows[-1]["step"]))
    advised = min(horizon, max(1, int(WARMUP_SHARE_MAX * steps)))
    first = rows[0]["loss"]
    lost = _sustained_rise(rows, first, warmup, horizon) if warmup < advised else []
    if not lost:
        return None
    peak = max(lost, key=lambda r: r["loss"])
    back = next((r["step"] for r in rows if r["step"] > lost[-1]["step"]), None)
    evidence = {
        "loss_first": round(first, 6),
        "loss_peak": round(peak["loss"], 6),
        "peak_step": peak["step"],
        "recovered_at_step": back,
        "train.warmup_steps": warmup,
        "train.lr": float(config_value(run, "train", "lr", 0.0)),
        "adam_beta2": float(betas[1]),
        "init": run.config.get("init"),
    }
    if "grad_norm" in rows[0] and "grad_norm" in peak:
        evidence |= {"grad_norm_first": rows[0]["grad_norm"], "grad_norm_peak": peak["grad_norm"]}
    start = "the checkpoint's loss" if run.config.get("init") else "where training started"
    return Finding(
        kind="learning_rate",
        severity="warning",
        evidence=evidence,
        why=(
            f"the loss rose from {first:.4g} at step {rows[0]['step']} ({start}) to "
            f"{peak['loss']:.4g} at step {peak['step']}, {peak['loss'] / first:.1f}x, after a "
            f"warm-up of {warmup} steps: "
            "Adam's first updates move every weight by about the full learning rate whatever "
            f"its gradient, until its second-moment estimate settles over 2/(1-beta2) = "
            f"{horizon} steps" + ("" if back else "; the loss had not come back by the end")
        ),
        advice=(
            f"warm the learning rate up: train.warmup_steps={advised} (now {warmup}): "
            f"2/(1-beta2) = {horizon} steps, at most a tenth of train.steps; if the loss still "
            "rises, a smaller train.lr"
        ),
        cost_s=sum(r.get("step_s", 0.0) for r in lost),
        steps=[r["step"] for r in lost],
    )
