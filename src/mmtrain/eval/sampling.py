"""Sampling a trained denoiser: noise -> samples, deterministic for a seed.

- Flow matching: Euler steps of dx/dt = v(x, t) from t = 1 (noise) to t = 0 (data), on the grid
  of `steps` equal steps in t, shifted as training shifted its times (models/schedules.py); with
  `heun`, Heun's second-order correction on every step but the last (Karras et al. 2022, Alg. 1).
- DDPM: DDIM's deterministic update (Song et al. 2021, eta = 0) over `steps` of the training
  schedule's steps, spaced evenly from the last to the first, from an epsilon or v prediction.

The condition is what the model's batch holds beside the noisy sample: {"class": ids [n]} for
a class-conditional DiT, {"text_hidden": [n, L, text_width], "text_pooled": [n, pooled_width]}
(a text encoder's outputs) for an MMDiT, nothing for an unconditional DiT. Classifier-free
guidance (Ho & Salimans 2022): with `cfg` != 1 every step also predicts with the "no class" id
or the zeroed text (what the objective's guidance dropout trains, train/diffusion.py), and the
prediction used is uncond + cfg (cond - uncond). The noise comes from one generator seeded by
`seed` on the model's device: the same seed gives the same samples.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor, nn

from mmtrain.config import DiffusionConfig
from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.models.build import unwrap_model
from mmtrain.models.dit import CLASS, PREDICTION, TEXT_HIDDEN, TEXT_POOLED, TIMESTEP
from mmtrain.models.schedules import FLOW_TIMESTEP_SCALE, ddpm_alphas_cumprod, shift_flow_time

SAMPLERS = ("euler", "heun", "ddim")
Condition = Mapping[str, Tensor]


def condition_keys(denoiser: DenoiserSpec) -> tuple[str, ...]:
    """The batch keys a denoiser is conditioned on (module docstring)."""
    if denoiser.takes_text():
        return denoiser.text_members()
    return (CLASS,) if denoiser.num_classes else ()


def condition_of(denoiser: DenoiserSpec, batch: Condition) -> dict[str, Tensor]:
    """The condition entries of a batch (a loader's, or the model's input)."""
    return {key: batch[key] for key in condition_keys(denoiser)}


def null_condition(denoiser: DenoiserSpec, condition: Condition) -> dict[str, Tensor]:
    """The unconditional branch of guidance: the "no class" id (`num_classes`), or the text
    zeroed, hidden states and pooled vector both, as the objective drops them in training."""
    if denoiser.takes_text():
        return {key: torch.zeros_like(condition[key]) for key in denoiser.text_members()}
    if denoiser.num_classes:
        return {CLASS: torch.full_like(condition[CLASS], denoiser.num_classes)}
    return {}


def sample(
    model: nn.Module,
    condition: Condition | None,
    n: int,
    *,
    steps: int = 50,
    cfg: float = 1.0,
    seed: int = 0,
    config: DiffusionConfig | None = None,
    sampler: str | None = None,
    shape: tuple[int, ...] | None = None,
) -> Tensor:
    """`n` samples [n, C, H, W] of the model's input space (pixels in [-1, 1] or latents), for
    `condition` (module docstring; None for an unconditional DiT), moved to the model's device.
    `config`: the run's `train.diffusion` (its shift or its DDPM schedule); `sampler`: euler or
    heun (flow), ddim (DDPM); default euler / ddim. `shape`: (H, W), or (T, H, W) of a clip, for
    a model trained on buckets (default: the spec's own)."""
    spec, config = unwrap_model(model).spec, config or DiffusionConfig()
    d = spec.denoiser
    flow = spec.objective == "flow_matching"
    sampler = sampler or ("euler" if flow else "ddim")
    if sampler not in (("euler", "heun") if flow else ("ddim",)):
        raise ValueError(f"{sampler!r} does not sample a {spec.objective} model")
    if steps < 1:
        raise ValueError(f"steps must be positive, got {steps}")
    param = next(model.parameters())
    condition = _checked(d, condition or {}, n, param)
    g = torch.Generator(device=param.device).manual_seed(seed)
    d.grid_of(shape)  # a ValueError for a size the patches do not divide
    size = d.sample_shape(shape)
    x = torch.randn((n, *size), generator=g, device=param.device, dtype=param.dtype)
    predict = _guided(model, condition, cfg)
    with torch.no_grad():
        if flow:
            return _flow(predict, x, steps, config.fixed_shift(), heun=sampler == "heun")
        return _ddim(predict, x, steps, ddpm_alphas_cumprod(config), d.prediction)


def _checked(d: DenoiserSpec, condition: Condition, n: int, param: Tensor) -> dict[str, Tensor]:
    """The condition the denoiser takes, one row per sample, on the model's device (text in
    its dtype); a ValueError naming what is missing, extra or of the wrong shape."""
    keys = condition_keys(d)
    if set(condition) != set(keys):
        kind = "an MMDiT" if d.is_mmdit() else "a cross-attention DiT" if d.takes_text() else "a class-conditional DiT" if keys else "this DiT"
        wanted = " + ".join(map(repr, keys)) or "no condition"
        raise ValueError(f"{kind} samples with {wanted}; got {sorted(condition) or 'none'}")
    out = {}
    for key in keys:
        value = condition[key]
        # any text length L: SD3's encoders give 333 tokens, a model may train on others
        shape = {CLASS: (n,), TEXT_HIDDEN: (n, None, d.text_width),
                 TEXT_POOLED: (n, d.pooled_width)}[key]  # fmt: skip
        if value.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(value.shape, shape, strict=True)
        ):
            wanted = ", ".join("L" if w is None else str(w) for w in shape)
            raise ValueError(f"{key!r} must be [{wanted}], got {list(value.shape)}")
        dtype = torch.long if key == CLASS else param.dtype
        out[key] = value.to(param.device, dtype)
    return out


def _guided(model: nn.Module, condition: dict[str, Tensor], cfg: float):
    """t [n] -> the (guided) prediction at x, channels of the prediction only."""
    d = unwrap_model(model).spec.denoiser
    key = d.input
    null = null_condition(d, condition)

    def predict(x: Tensor, t: Tensor) -> Tensor:
        batch = {key: x, TIMESTEP: t.to(x.dtype)}
        cond = _predict(model, {**batch, **condition})[:, : d.channels]
        if not condition or cfg == 1.0:  # an unconditional model has nothing to guide by
            return cond
        uncond = _predict(model, {**batch, **null})[:, : d.channels]
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
