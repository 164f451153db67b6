"""The noise schedules a denoiser is trained and sampled with, shared by the objective
(train/diffusion.py) and the samplers (eval/sampling.py), so the two cannot disagree.

- Flow matching: x_t = (1 - t) x0 + t eps for t in [0, 1]; the timestep shift
  t' = s t / (1 + (s - 1) t) (Esser et al. 2024, SD3) moves training and sampling towards noise
  for larger inputs.
- DDPM: the linear beta schedule of Ho et al. 2020 (beta_start .. beta_end over `ddpm_steps`),
  x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps.
"""

from __future__ import annotations

import torch

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
