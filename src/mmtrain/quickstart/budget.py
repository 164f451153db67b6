"""The quickstart's time budget: time a few steps on this machine, then train the fixed number
of steps, or fewer when they do not fit `--minutes` (and say so).

The step count is fixed so that results do not depend on how loaded the machine is; the budget
only cuts it on a machine too slow for all of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mmtrain.quickstart.common import Phase, PhaseClock
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

MIN_STEPS = 20  # below this nothing is learned; the budget is then too small for the machine
BUDGET_MARGIN = 1.15  # data decoding, metrics and validation on top of the timed steps


def step_seconds(loss: Callable, optimizer) -> float:
    """The faster of two timed optimizer steps (forward and loss by `loss()`, backward, AdamW)
    after a warm-up step: the one least disturbed by other processes."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        value = loss()
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def time_steps(
    spec: ModelSpec,
    batch_size: int,
    probe_batch: int = 32,
    towers: tuple[str, ...] = ("image", "text"),
) -> float:
    """Seconds per optimizer step of `spec` at `batch_size` on this CPU, for batches that hold
    `towers` (and the loss of the pairs among them).

    Two steps (forward, loss, backward, AdamW) on random inputs of the right shapes are timed
    after a warm-up step, at `probe_batch` samples and scaled up linearly: a CPU's step time is
    close to linear in the batch, and the fixed overhead left in makes the estimate cautious.
    The faster of the two counts (the one least disturbed by other processes).
    """
    import torch

    from mmtrain.losses import ContrastiveLoss
    from mmtrain.models import create_model
    from mmtrain.train.measure_step import random_batch

    probe = min(probe_batch, batch_size)
    generator = torch.Generator().manual_seed(0)
    model = create_model(spec, seed=0)
    loss_fn = ContrastiveLoss.from_spec(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {n: x for n, x in random_batch(spec, probe, generator).items() if n in towers}
    pairs = [pair for pair in spec.pairs if set(pair) <= set(towers)]

    def loss():
        return loss_fn(model(batch), pairs, model.logit_scale)[0]

    return step_seconds(loss, optimizer) * batch_size / probe


def time_language_model_steps(spec: ModelSpec, batch_size: int, positions: int) -> float:
    """Seconds per optimizer step of a vision-language model `spec` at `batch_size` rows of
    `positions` LM positions (one image each) on this CPU, with the image tower frozen (the
    `--vlm` quickstart's stage 2, the dearer of its two stages). Timed as `time_steps` does,
    on a probe of up to 16 rows scaled up linearly."""
    import torch

    from mmtrain.models import create_model
    from mmtrain.train.measure_step import language_batch, next_token_loss

    probe = min(16, batch_size)
    generator = torch.Generator().manual_seed(0)
    model = create_model(spec, seed=0)
    model.towers[spec.projector.tower].requires_grad_(False)
    batch = language_batch(spec, probe, positions, 1, generator)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)

    def loss():
        return next_token_loss(model(batch), batch["labels"])

    return step_seconds(loss, optimizer) * batch_size / probe


def time_denoiser_steps(spec: ModelSpec, batch_size: int) -> float:
    """Seconds per optimizer step of a denoiser `spec` at `batch_size` on this CPU, trained by
    its own objective (train/diffusion.py) on random clean samples; timed as `time_steps`
    does, on a probe of up to 16 samples scaled up linearly."""
    import torch

    from mmtrain.config import DiffusionConfig
    from mmtrain.models import create_model
    from mmtrain.train.diffusion import DiffusionObjective
    from mmtrain.train.measure_step import denoiser_batch

    probe = min(16, batch_size)
    model = create_model(spec, seed=0)
    objective = DiffusionObjective(spec, DiffusionConfig(), seed=0)
    batch = denoiser_batch(spec, probe, torch.Generator().manual_seed(0))
    objective.prepare(model, [batch], None, step=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss():
        return objective.loss(model(objective.inputs(batch, 0)), batch, 0)

    return step_seconds(loss, optimizer) * batch_size / probe


def fit_steps(
    config: QuickstartConfig, phase: Phase, lap: PhaseClock, step_seconds: Callable[[], float]
) -> tuple[int, float | None]:
    """(steps, seconds per step): `config.steps`, or fewer when `config.fit_budget` and the
    step time that `step_seconds()` measures says they do not fit `config.minutes`."""
    if not config.fit_budget:
        return config.steps, None
    phase(
        "calibrate",
        f"{config.steps} steps of {config.batch_size}, at most {config.minutes:g} min",
    )
    started = time.perf_counter()
    seconds = step_seconds()
    steps = plan_steps(config, seconds, time.perf_counter() - started)
    lap("calibrate")
    if steps < config.steps:
        log.warning(
            "%.2f s per step: only %d of %d steps fit %g min; the model learns less",
            seconds, steps, config.steps, config.minutes,
        )  # fmt: skip
    return steps, seconds


def plan_steps(config: QuickstartConfig, step_seconds: float, spent_s: float = 0.0) -> int:
    """`config.steps`, or fewer when they do not fit what is left of `config.minutes` after
    `spent_s` (the timing itself) at `step_seconds` each; never fewer than MIN_STEPS."""
    fit = int((config.minutes * 60 - spent_s) / (step_seconds * BUDGET_MARGIN))
    if fit >= config.steps:
        return config.steps
    if fit < MIN_STEPS:
        raise FieldError(
            "--minutes",
            f"{config.minutes:g} min gives only {fit} steps at {step_seconds:.2f} s per step on "
            f"this machine; give more minutes, or fewer --steps ({MIN_STEPS} or more)",
        )
    return fit


__all__ = [
    "BUDGET_MARGIN",
    "MIN_STEPS",
    "fit_steps",
    "plan_steps",
    "time_denoiser_steps",
    "time_language_model_steps",
    "time_steps",
]
