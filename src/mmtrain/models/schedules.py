"""The noise schedules a denoiser is trained and sampled with, shared by the objective
(train/diffusion.py) and the samplers (eval/sampling.py), so the two cannot disagree.

- Flow matching: x_t = (1 - t) x0 + t eps for t in [0, 1]; the timestep shift
  t' = s t / (1 + (s - 1) t) (Esser et al. 2024, SD3) moves training and sampling towards noise
  for larger inputs.
- DDPM: the linear beta schedule of Ho et al. 2020 (beta_start .. beta_end over `ddpm_steps`),
  x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mmtrain.config import DiffusionConfig

FLOW_TIMESTEP_SCALE = 1000.0  # the network's timestep for a flow t in [0, 1]


def shift_flow_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's resolution shift of flow times in [0, 1] (1: none; the ends stay where they are)."""
    return shift * t / (1 + (shift - 1) * t)


def ddpm_alphas_cumprod(config: DiffusionConfig) -> torch.Tensor:
    """abar_t of the linear beta schedule, float64 [ddpm_steps]."""
    betas = torch.linspace(
        config.beta_start, config.beta_end, config.ddpm_steps, dtype=torch.float64
    )
    return torch.cumprod(1 - betas, dim=0)


def draw_generator(seed: int, *keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` seeded by `seed` and `keys` alone (numpy's SeedSequence mixes
    them, so neighbouring steps or ranks get unrelated streams)."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(1, np.uint64)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state[0]) & (2**63 - 1))
    return generator


def _per_sample(values: Tensor, like: Tensor) -> Tensor:
    return values.view(-1, *([1] * (like.dim() - 1)))


def flow_pair(x0: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """(x_t, the velocity target) of flow matching at times t [B] in [0, 1]."""
    tb = _per_sample(t, x0)
    return (1 - tb) * x0 + tb * noise, noise - x0


def ddpm_pair(x0: Tensor, noise: Tensor, abar: Tensor, prediction: str) -> tuple[Tensor, Tensor]:
    """(x_t, the target: epsilon, or v = sqrt(abar) eps - sqrt(1 - abar) x0) of DDPM at the
    steps whose abar [B] is given."""
    a, b = _per_sample(abar.sqrt(), x0), _per_sample((1 - abar).sqrt(), x0)
    noisy = a * x0 + b * noise
    return noisy, (a * noise - b * x0 if prediction == "v" else noise)
