"""The denoiser's objective: rectified flow (flow matching) or DDPM, as one of the loop's
objectives (train/objectives.py), with `train.diffusion` (config.py) for its settings.

Each micro-batch's clean samples x0 (pixels in [-1, 1] or latents) become the model's input
in `inputs`, before the forward:

- flow matching (Liu et al. 2022; Esser et al. 2024, SD3): x_t = (1 - t) x0 + t eps with t in
  (0, 1), and the network predicts the velocity eps - x0. The network sees 1000 t.
- DDPM (Ho et al. 2020): x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps at an integer step t of a
  linear beta schedule; the network predicts eps, or v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0
  (Salimans & Ho 2022); min-SNR-gamma weights each sample (Hang et al. 2023).

A share `cfg_dropout` of the samples get the "no class" id (an MMDiT: zeroed text, its hidden
states and pooled vector both, SD3's empty condition), which classifier-free guidance needs at
sampling time. The loss is the mean squared error per sample (over the prediction's
channels; DiT's learned-sigma channels are not trained by it), averaged over the micro-batch
and divided by the K micro-batches of the step, like any per-sample mean. A guidance-distilled
hub denoiser (FLUX.1-dev) is fed `guidance` (the scale it is trained at) per sample.

The noise, the timesteps and the dropout are drawn from a generator seeded by (run seed, step,
rank, micro-batch) alone, on the device: a resumed or rolled-back run draws exactly what the
uninterrupted run drew, and nothing depends on torch's global RNG or on the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmtrain.config import DiffusionConfig
from mmtrain.losses import at_least_fp32
from mmtrain.models.dit import CLASS, PREDICTION, TEXT_HIDDEN, TIMESTEP
from mmtrain.models.hub.pipeline import flow_shift
from mmtrain.models.schedules import (
    FLOW_TIMESTEP_SCALE,
    ddpm_alphas_cumprod,
    ddpm_pair,
    draw_generator,
    flow_pair,
    shift_flow_time,
)
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

Batch = Mapping[str, torch.Tensor]
GUIDANCE = "guidance"  # the batch key of a guidance-distilled denoiser's scale (models/hub)


def flow_timesteps(
    n: int, config: DiffusionConfig, g: torch.Generator, device, shift: float | None = None
) -> torch.Tensor:
    """t in (0, 1) per sample: logit-normal or uniform, then shifted (DiffusionConfig's shift,
    or `shift` where the model's own applies)."""
    if config.timesteps == "logit_normal":
        normal = torch.randn(n, generator=g, device=device)
        t = torch.sigmoid(config.logit_mean + config.logit_std * normal)
    else:
        t = torch.rand(n, generator=g, device=device)
    return shift_flow_time(t, config.fixed_shift() if shift is None else shift)


def frame_change(error: torch.Tensor) -> torch.Tensor:
    """Mean squared change [B] of a video's error [B, C, T, H, W] between consecutive frames.

    An error that is the same in every frame (a steady offset) costs nothing here; one that
    alternates from frame to frame (flicker) costs up to four times its own square: the term
    asks the prediction to move between frames as the target does, on top of matching it.
    """
    return (error[:, :, 1:] - error[:, :, :-1]).square().flatten(1).mean(dim=1)


class DiffusionObjective:
    """Flow matching (`flow_matching`) or DDPM (`diffusion`) for the spec's denoiser."""

    def __init__(self, spec: ModelSpec, config: DiffusionConfig, *, seed: int, rank: int = 0):
        assert spec.denoiser is not None
        self.denoiser = spec.denoiser
        self.flow = spec.objective == "flow_matching"
        self.config, self.seed, self.rank = config, seed, rank
        self.key = spec.denoiser.input
        self.alphas_cumprod = None if self.flow else ddpm_alphas_cumprod(config)
        self.temporal = config.temporal_weight > 0
        self.guidance = spec.hub is not None and spec.hub.guidance
        # A pipeline's transformer samples its times as its scheduler shifts them (FLUX: by
        # the sample's size), unless train.diffusion.shift says otherwise.
        self.pipeline_shift = None
        if self.flow and spec.hub is not None and config.shift is None:
            self.pipeline_shift = flow_shift(Path(spec.hub.source))
        if self.temporal and not spec.denoiser.is_video():
            raise FieldError(
                "train.diffusion.temporal_weight",
                f"{spec.name} is not a video denoiser (frames 1): a term between frames needs "
                "frames > 1",
            )

    def prepare(
        self, trained: nn.Module, micro_batches: Sequence[Batch], precision: Any, step: int = 0
    ) -> None:
        self.k, self.step = len(micro_batches), step
        self.total: torch.Tensor | None = None
        self.targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def inputs(self, batch: Batch, j: int) -> dict[str, torch.Tensor]:
        """The model's input for micro-batch j: the noisy sample, its timesteps and classes
        (some dropped); the target and per-sample weights are kept for `loss`."""
        x0 = batch[self.key]
        g = draw_generator(self.seed, self.step, self.rank, j, device=x0.device)
        n = x0.shape[0]
        noise = torch.randn(x0.shape, generator=g, device=x0.device, dtype=x0.dtype)
        if self.flow:
            shift = self._shift(x0)
            t = flow_timesteps(n, self.config, g, x0.device, shift).to(x0.dtype)
            noisy, target = flow_pair(x0, noise, t)
            timestep, weight = t * FLOW_TIMESTEP_SCALE, torch.ones_like(t)
        else:
            noisy, target, timestep, weight = self._ddpm(x0, noise, g)
        conditions = (CLASS, *self.denoiser.text_members())
        out = {k: v for k, v in batch.items() if k != self.key and k not in conditions}
        out.update({self.key: noisy, TIMESTEP: timestep})
        if self.denoiser.num_classes:
            out[CLASS] = self._dropped(batch[CLASS], g)
        if self.denoiser.takes_text():
            out.update(self._dropped_text(batch, g))
        if self.guidance:  # a guidance-distilled hub denoiser (FLUX.1-dev): the scale trained at
            out[GUIDANCE] = torch.full((n,), self.config.guidance, device=x0.device, dtype=x0.dtype)
        self.targets[j] = (target, weight)
        return out

    def _shift(self, x0: torch.Tensor) -> float | None:
        if self.pipeline_shift is None:
            return None
        return self.pipeline_shift.at(self.denoiser.tokens(x0.shape[2:]))

    def _ddpm(self, x0: torch.Tensor, noise: torch.Tensor, g: torch.Generator):
        n, steps_total = x0.shape[0], self.config.ddpm_steps
        steps = torch.randint(0, steps_total, (n,), generator=g, device=x0.device)
        abar = self.alphas_cumprod.to(x0.device)[steps]
        noisy, target = ddpm_pair(x0, noise, abar.to(x0.dtype), self.denoiser.prediction)
        weight = torch.ones_like(abar)
        if self.config.min_snr is not None:
            snr = abar / (1 - abar)
            clipped = snr.clamp(max=self.config.min_snr)
            weight = clipped / (snr + 1 if self.denoiser.prediction == "v" else snr)
        return noisy, target, steps.to(x0.dtype), weight.to(x0.dtype)

    def _dropped(self, classes: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        keep = (
            torch.rand(classes.shape, generator=g, device=classes.device) >= self.config.cfg_dropout
        )
        return torch.where(keep, classes, torch.full_like(classes, self.denoiser.num_classes))

    def _dropped_text(self, batch: Batch, g: torch.Generator) -> dict[str, torch.Tensor]:
        """The text of a share `cfg_dropout` of the samples zeroed, hidden states and pooled
        vector (where the denoiser takes one) together (one draw per sample, where a DiT draws
        its class dropout)."""
        n = batch[TEXT_HIDDEN].shape[0]
        keep = torch.rand(n, generator=g, device=batch[TEXT_HIDDEN].device)
        keep = keep >= self.config.cfg_dropout
        out = {}
        for key in self.denoiser.text_members():
            text = batch[key]
            kept = keep.reshape(n, *(1,) * (text.dim() - 1))
            out[key] = torch.where(kept, text, torch.zeros_like(text))
        return out

    def reads(self, batch: Batch) -> set[str]:
        return {PREDICTION}

    def loss(self, out: Mapping[str, torch.Tensor], batch: Batch, j: int) -> torch.Tensor:
        target, weight = self.targets.pop(j)
        prediction = at_least_fp32(out[PREDICTION])[:, : self.denoiser.channels]
        error = prediction - at_least_fp32(target)
        per_sample = error.square().flatten(1).mean(dim=1)
        if self.temporal:
            per_sample = per_sample + self.config.temporal_weight * frame_change(error)
        share = (at_least_fp32(weight) * per_sample).mean() / self.k
        self.total = share.detach() if self.total is None else self.total + share.detach()
        return share

    def report(self) -> dict[str, torch.Tensor]:
        return {"": self.total}
