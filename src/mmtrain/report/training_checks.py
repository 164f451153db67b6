"""What the optimiser's numbers say (`mmtrain doctor`): learning rates per tower, a learning
rate so large that the model collapsed, and a precision whose range the run overflows.

- Per tower: a pretrained vision encoder fine-tuned at the language side's learning rate (or a
  larger one) forgets what it knew faster than the language side learns to use it. Recipes
  that unfreeze the vision tower give it a fifth to a tenth of the language model's rate
  (LLaVA-NeXT / LLaVA-OneVision: `mm_vision_tower_lr` 2e-6 beside 1e-5 to 2e-5). Checked on a
  vision-language model and on any run that starts from a checkpoint (`init`).
- Collapse: a CLIP loss over a batch of B pairs is ln B exactly when the model gives every pair
  the same score, whatever the images and texts (chance). Training leaves that value within a
  few steps; a loss that sits at it, step after step past the warm-up, is a model whose
  embeddings collapsed, most often because the learning rate was too large.
- Clipping: the gradient norm above `train.grad_clip` in most of the later half of the steps:
  the clip, not the learning rate, sets the update, and the learning rate is too large for
  the model (or the clip too tight).
- Precision: fp16 overflows past 65504 (the loss scaler skips the step and halves its scale),
  fp8 past its scaled range; bf16 has fp32's exponent range and does not.
"""

from __future__ import annotations

import math
from typing import Any

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import RunData
from mmtrain.spec import VISION_TOWER

VISION_MODALITIES = ("image", "video")
VISION_LR_SHARE = 0.1  # the vision tower's rate as a share of the language side's (advice)
CHANCE_BAND = 0.01  # a loss within 1% of ln B is at chance
COLLAPSE_STEPS = 10  # steps in a row past the warm-up at chance before doctor calls it collapse
LOW_PRECISION = ("fp16", "fp8")
# GradScaler doubles its scale after 2000 clean steps and halves it on an overflow, so a healthy
# fp16 run skips about one step in 2000; skips above 1 in 100 are a range the format lacks, and
# a scale under 1 means even unscaled gradients do not fit.
SKIP_SHARE = 0.01
SCALE_FLOOR = 1.0
# Gradient clipping: early steps of a run from scratch exceed the clip as a rule (norms fall by
# an order of magnitude over the first hundreds of steps); a run whose later half still clips
# most steps trains at the clip's step size, not at the learning rate it was given.
CLIP_WINDOW = 8  # steps of the run's later half, at least, before clipping is judged
CLIPPED_SHARE = 0.5


def _tower_lr(run: RunData, tower: str) -> float:
    towers = config_value(run, "train", "towers", {}) or {}
    own = (towers.get(tower) or {}).get("lr")
    return float(own if own is not None else config_value(run, "train", "lr", 0.0))


def _trainable(run: RunData, tower: str) -> bool:
    """A tower trains when the optimizer has a group of it (rows log `lr/TOWER/...`)."""
    last = run.train_rows[-1] if run.train_rows else {}
    return any(key.startswith(f"lr/{tower}/") for key in last)


def _vision_and_language(spec: Any) -> tuple[list[str], list[str]]:
    vision = [n for n, t in spec.towers.items() if t.modality in VISION_MODALITIES]
    language = [n for n, t in spec.towers.items() if t.modality == "text"]
    if getattr(spec, "vision", None) is not None:
        vision.append(VISION_TOWER)
    if getattr(spec, "decoder", None) is not None:
        language.append("text")  # the decoder's name among the towers (models/vlm.py)
    return vision, language


def tower_learning_rates(run: RunData) -> Finding | None:
    spec, init = run.spec, run.config.get("init")
    if spec is None or not (init or getattr(spec, "decoder", None) is not None):
        return None
    vision, language = _vision_and_language(spec)
    vision = [n for n in vision if _trainable(run, n)]
    language = [n for n in language if _trainable(run, n)]
    if not vision or not language:
        return None  # a frozen vision tower (or language side) takes no learning rate
    fastest = max(vision, key=lambda n: _tower_lr(run, n))
    slowest = min(language, key=lambda n: _tower_lr(run, n))
    vision_lr, language_lr = _tower_lr(run, fastest), _tower_lr(run, slowest)
    if vision_lr < language_lr:
        return None
    start = "starts from a checkpoint (init)" if init else "is a vision-language model"
    return Finding(
        kind="learning_rate",
        severity="warning",
        evidence={
            f"lr of {fastest}": vision_lr,
            f"lr of {slowest}": language_lr,
            "init": init,
        },  # fmt: skip
        why=(
            f"the run {start} and trains the vision tower {fastest!r} at {vision_lr:g}, not "
            f"below the language side's {language_lr:g}: a pretrained encoder at that rate "
            "forgets its features before the language side learns to use them"
        ),
        advice=(
            f"give the vision tower its own, smaller rate: train.towers.{fastest}.lr="
            f"{language_lr * VISION_LR_SHARE:.3g} (a tenth of {language_lr:g}; recipes use a "
            f"fifth to a tenth), or freeze it first: train.towers.{fastest}.freeze=true"
        ),
        steps=[run.train_rows[-1]["step"]] if run.train_rows else [],
    )


def _chance_loss(run: RunData) -> float | None:
    """ln B for a CLIP loss over one pair of towers and no fusion head (nothing else added)."""
    spec = run.spec
    if spec is None or spec.objective != "clip" or len(spec.pairs) != 1 or spec.fusion:
        return None
    batch = int(config_value(run, "train", "batch_size", 0))
    return math.log(batch) if batch > 1 else None


def collapsed_learning_rate(run: RunData) -> Finding | None:
    chance = _chance_loss(run)
    if chance is None:
        return None
    warmup = int(config_value(run, "train", "warmup_steps", 0))
    rows = [r for r in run.train_rows if r["step"] > warmup and math.isfinite(r.get("loss", 0))]
    at_chance = []  # the trailing rows whose loss sits at chance
    for row in reversed(rows):
        if "loss" not in row or abs(row["loss"] - chance) > CHANCE_BAND * chance:
            break
        at_chance.append(row)
    if len(at_chance) < COLLAPSE_STEPS:
        return None
    at_chance.reverse()
    lr = float(config_value(run, "train", "lr", 0.0))
    clip = config_value(run, "train", "grad_clip", None)
    clipped = sum(1 for r in rows if clip and r.get("grad_norm", 0.0) > clip)
    return Finding(
        kind="learning_rate",
        severity="error",
        evidence={
            "loss_mean": round(sum(r["loss"] for r in at_chance) / len(at_chance), 6),
            "chance_loss": round(chance, 6),
            "train.batch_size": int(config_value(run, "train", "batch_size", 0)),
            "grad_norm_last": run.train_rows[-1].get("grad_norm"),
            "clipped_steps": clipped,
            "train.lr": lr,
            "train.warmup_steps": warmup,
        },
        why=(
            f"the loss sat at ln B = {chance:.4f} (chance: every pair scored the same) for "
            f"{len(at_chance)} steps after the warm-up: the embeddings collapsed and the steps "
            "train nothing; a learning rate too large for the model is the usual cause"
        ),
        advice=(
            f"train again with train.lr={lr / 10:.3g} (now {lr:g}) and a longer warm-up "
            f"(train.warmup_steps={max(2 * warmup, 10)}); keep train.grad_clip on"
        ),
        cost_s=sum(r.get("step_s", 0.0) for r in at_chance),
        steps=[r["step"] for r in at_chance],
    )


def clipped_gradients(run: RunData) -> Finding | None:
    clip = config_value(run, "train", "grad_clip", None)
    rows = [r for r in run.train_rows if math.isfinite(r.get("grad_norm", math.nan))]
    later = rows[len(rows) // 2 :]
    if not clip or len(later) < CLIP_WINDOW or collapsed_learning_rate(run) is not None:
        return None  # a collapsed run's finding counts its clipped steps already
    clipped = [r for r in later if r["grad_norm"] > clip]
    if len(clipped) <= CLIPPED_SHARE * len(later):
        return None
    lr = float(config_value(run, "train", "lr", 0.0))
    norms = sorted(r["grad_norm"] for r in later)
    return Finding(
        kind="learning_rate",
        severity="warning",
        evidence={
            "clipped_steps": len(clipped),
            "steps_judged": len(later),
            "grad_norm_median": round(norms[len(norms) // 2], 6),
            "train.grad_clip": clip,
            "train.lr": lr,
        },
        why=(
            f"the gradient norm exceeded train.grad_clip={clip:g} in {len(clipped)} of the "
            f"last {len(later)} steps: the clip, not the learning rate, sets each update, and "
            "the run trains slower and less stably than its learning rate says"
        ),
        advice=(
            f"lower the learning rate: train.lr={lr / 3:.3g} (now {lr:g}); a clip below the "
            f"settled norm ({norms[len(norms) // 2]:.3g}) is too tight: raise train.grad_clip"
        ),
        cost_s=0.0,  # costs progress, not step time: listed after the step-time findings
        steps=[r["step"] for r in clipped],
    )


def _skipped_steps(run: RunData) -> list[int]:
    """The steps whose row counts one more skipped step than the row before."""
    steps, before = [], 0
    for row in run.train_rows:
        count = int(row.get("skipped_steps", before))
        if count > before:
            steps.append(row["step"])
        before = count
    return steps


def _past_settling(steps: list[int]) -> list[int]:
    """Skips after the first step that trained: the loss scale starts at 2^16 and halves on
    each overflow until the gradients fit, so a leading run of skips is the scaler settling."""
    settling = 0
    while settling < len(steps) and steps[settling] == settling + 1:
        settling += 1
    return steps[settling:]


def precision(run: RunData) -> Finding | None:
    mode = config_value(run, "train", "precision", "fp32")
    if mode not in LOW_PRECISION:
        return None
    skipped = _skipped_steps(run)
    skipped = _past_settling(skipped) if mode == "fp16" else skipped
    scales = [r["loss_scale"] for r in run.train_rows if "loss_scale" in r]
    collapsed = bool(scales) and min(scales) < SCALE_FLOOR
    steps = len(run.train_rows)
    if not collapsed and (not skipped or len(skipped) <= SKIP_SHARE * steps):
        return None
    evidence: dict[str, Any] = {"train.precision": mode, "skipped_steps": len(skipped),
                                "skipped_fraction": round(len(skipped) / max(steps, 1), 4)}  # fmt: skip
    if scales:
        evidence |= {"loss_scale_min": min(scales), "loss_scale_last": scales[-1]}
    why = (
        f"{len(skipped)} of {steps} steps were not finite in {mode} and trained nothing: values "
        "past the format's range (fp16's largest is 65504)"
    )
    if scales:
        why += f"; the loss scale fell to {min(scales):g}"
    advice = (
        "train.precision=bf16 (fp32's exponent range, no loss scaling)"
        if mode == "fp16"
        else "keep the layers that overflow out of fp8: train.fp8_keep_bf16=[NAME, ...] "
        "(module-name fragments, e.g. the first and last blocks), or train.precision=bf16"
    )
    step_s = [r["step_s"] for r in run.train_rows if r.get("step_s")]
    return Finding(
        kind="precision",
        severity="error" if collapsed else "warning",
        evidence=evidence,
        why=why,
        advice=advice,
        cost_s=len(skipped) * (sum(step_s) / len(step_s) if step_s else 0.0),
        steps=skipped,
    )
