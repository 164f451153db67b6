"""Sampling a trained denoiser: noise -> samples, deterministic for a seed.

- Flow matching: Euler steps of dx/dt = v(x, t) from t = 1 (noise) to t = 0 (data), on the grid
  of `steps` equal steps in t, shifted as training shifted its times (models/schedules.py); with
  `heun`, Heun's second-order correction on every step but the last (Karras et al. 2022, Alg. 1).
- DDPM: DDIM's deterministic update (Song et al. 2021, eta = 0) over `steps` of the training
  schedule's steps, spaced evenly from the last to the first, from an epsilon or v prediction.

Classifier-free guidance (Ho & Salimans 2022): with `cfg` != 1 every step also predicts with
the "no class" id, and the prediction used is uncond + cfg (cond - uncond). The noise comes
from one generator seeded by `seed` on the model's device: the same seed gives the same samples.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from mmtrain.config import DiffusionConfig
from mmtrain.models.build import unwrap_model
from mmtrain.models.dit import CLASS, PREDICTION, TIMESTEP
from mmtrain.models.schedules import FLOW_TIMESTEP_SCALE, ddpm_alphas_cumprod, shift_flow_time

SAMPLERS = ("euler", "heun", "ddim")


def sample(
    model: nn.Module,
    classes: Tensor | None,
    n: int,
    *,
    steps: int = 50,
    cfg: float = 1.0,
    seed: int = 0,
    config: DiffusionConfig | None = None,
    sampler: str | None = None,
) -> Tensor:
    """`n` samples [n, C, H, W] of the model's input space (pixels in [-1, 1] or latents);
    `classes` int64 [n] for a class-conditional model (None otherwise). `config`: the run's
    `train.diffusion` (its shift or its DDPM schedule); `sampler`: euler or heun (flow), ddim
    (DDPM); default euler / ddim."""
    spec, config = unwrap_model(model).spec, config or DiffusionConfig()
    d = spec.denoiser
    flow = spec.objective == "flow_matching"
    sampler = sampler or ("euler" if flow else "ddim")
    if sampler not in (("euler", "heun") if flow else ("ddim",)):
        raise ValueError(f"{sampler!r} does not sample a {spec.objective} model")
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    param = next(model.parameters())
    g = torch.Generator(device=param.device).manual_seed(seed)
    x = torch.randn((n, *d.sample_shape()), generator=g, device=param.device, dtype=param.dtype)
    predict = _guided(model, classes, cfg)
    with torch.no_grad():
        if flow:
            return _flow(predict, x, steps, config.shift, heun=sampler == "heun")
        return _ddim(predict, x, steps, ddpm_alphas_cumprod(config), d.prediction)


def _guided(model: nn.Module, classes: Tensor | None, cfg: float):
    """t [n] -> the (guided) prediction at x, channels of the prediction only."""
    d = unwrap_model(model).spec.denoiser
    key = d.input
    if d.num_classes and classes is None:
        raise ValueError("a class-conditional model samples with `classes`")

    def predict(x: Tensor, t: Tensor) -> Tensor:
        batch = {key: x, TIMESTEP: t.to(x.dtype)}
        if not d.num_classes:
            return _predict(model, batch)[:, : d.channels]
        cond = _predict(model, {**batch, CLASS: classes})[:, : d.channels]
        if cfg == 1.0:
            return cond
        null = torch.full_like(classes, d.num_classes)
        uncond = _predict(model, {**batch, CLASS: null})[:, : d.channels]
        return uncond + cfg * (cond - uncond)

    return predict


def _predict(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    # Through the module's own call (not `predict`): wrappers (FSDP's root, DDP) hook it.
    return model(batch)[PREDICTION]


def _flow(predict, x: Tensor, steps: int, shift: float, heun: bool) -> Tensor:
    times = shift_flow_time(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)
    n = x.shape[0]

    def at(t: float) -> Tensor:  # the network's timestep, in the samples' dtype
        return torch.full((n,), t * FLOW_TIMESTEP_SCALE, device=x.device, dtype=x.dtype)

    for i in range(steps):
        t, t_next = float(times[i]), float(times[i + 1])
        v = predict(x, at(t))
        x_next = x + (t_next - t) * v
        if heun and i < steps - 1:
            x_next = x + (t_next - t) * (v + predict(x_next, at(t_next))) / 2
        x = x_next
    return x


def _ddim(predict, x: Tensor, steps: int, alphas_cumprod: Tensor, prediction: str) -> Tensor:
    total = alphas_cumprod.shape[0]
    grid = torch.linspace(total - 1, 0, steps).round().long().tolist()
    n = x.shape[0]
    for i, t in enumerate(grid):
        abar = float(alphas_cumprod[t])
        out = predict(x, torch.full((n,), float(t), device=x.device, dtype=x.dtype))
        a, b = abar**0.5, (1 - abar) ** 0.5
        if prediction == "v":
            x0, eps = a * x - b * out, b * x + a * out
        else:
            x0, eps = (x - b * out) / a, out
        abar_next = float(alphas_cumprod[grid[i + 1]]) if i + 1 < steps else 1.0
        x = abar_next**0.5 * x0 + (1 - abar_next) ** 0.5 * eps
    return x


def to_uint8(images: Tensor) -> Tensor:
    """Pixels in [-1, 1] [N, C, H, W] -> uint8 [N, H, W, C] (clamped)."""
    pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu()


def image_grid(pixels: np.ndarray, rows: int) -> np.ndarray:
    """uint8 images [rows * cols, H, W, C] -> one RGB grid [rows * H, cols * W, 3], row-major."""
    if pixels.shape[-1] == 1:
        pixels = np.repeat(pixels, 3, axis=-1)
    n, h, w, _ = pixels.shape
    cols = n // rows
    grid = pixels.reshape(rows, cols, h, w, 3).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(grid.reshape(rows * h, cols * w, 3))
