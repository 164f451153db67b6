"""What the tests of pipeline folders' transformers (test_hub_flux.py, test_hub_wan.py) share:
the objective's draws for the reference's side, a run's losses, and FSDP2 against DDP on 2
gloo ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from mmtrain.config import DiffusionConfig, load_config
from mmtrain.models.schedules import draw_generator, flow_pair
from mmtrain.train.diffusion import flow_timesteps
from mmtrain.train.loop import train

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


def objective_draws(
    x0: torch.Tensor, config: DiffusionConfig, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy, target, t) as DiffusionObjective draws them at `step` for rank 0's first
    micro-batch of clean latents `x0` (train/diffusion.py): what the reference's side feeds
    diffusers' class."""
    draws = draw_generator(seed, step, 0, 0, device=torch.device("cpu"))
    noise = torch.randn(x0.shape, generator=draws, dtype=x0.dtype)
    t = flow_timesteps(x0.shape[0], config, draws, x0.device).to(x0.dtype)
    noisy, target = flow_pair(x0, noise, t)
    return noisy, target, t


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def _losses_on_ranks(rank: int, world: int, paths: list[str]) -> list[list[float]]:
    return [[row["loss"] for row in train(load_config(path)).history] for path in paths]


def check_fsdp_trains_what_ddp_trains(
    run_config: Callable[..., Path], tmp_path: Path, pipeline: Path, latents: Path
) -> dict[str, torch.Tensor]:
    """FSDP2 on 2 gloo ranks trains what DDP on the same 2 ranks trains: a denoiser draws its
    noise and timesteps per rank (train/diffusion.py), so DDP is the data-parallel run it must
    equal, not one process. float64, AdamW's eps 1 so an update is Lipschitz in its gradient
    (test_hub_train_parallel.py); the losses agree to 1e-9, the weights to float32's rounding
    of their updates (diffusers' norms take their statistics in float32). `run_config(root,
    pipeline, latents, name, **train)` writes a run's config. Returns DDP's weights."""
    from dist_helpers import run_distributed

    settings = {"precision": "fp64", "eps": 1.0, "steps": 3, "batch_size": 4, "lr": 1e-2,
                "micro_batch": 2}  # fmt: skip
    paths = [
        str(run_config(tmp_path, pipeline, latents, name, parallel=name, **settings))
        for name in ("ddp", "fsdp")
    ]
    first, second = run_distributed(_losses_on_ranks, world_size=2, args=(paths,),
                                    timeout_s=300)  # fmt: skip
    assert first == second  # every rank logs the global loss
    ddp, fsdp = first
    torch.testing.assert_close(torch.tensor(fsdp), torch.tensor(ddp), rtol=1e-9, atol=0)
    source = load_file(pipeline / WEIGHTS)
    want, got = load_file(tmp_path / "ddp" / WEIGHTS), load_file(tmp_path / "fsdp" / WEIGHTS)
    assert got.keys() == want.keys()
    moved = max((want[k] - v.double()).abs().max().item() for k, v in source.items())
    assert moved > 1e-6  # the steps changed the weights far beyond the tolerance below
    for key, value in want.items():
        update = (value - source[key].double()).abs().max().item()
        torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-12 + 1e-6 * update,
                                   msg=key)  # fmt: skip
    return want
