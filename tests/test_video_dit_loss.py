"""The temporal-consistency term of a video denoiser's loss (`train.diffusion.temporal_weight`,
train/diffusion.py `frame_change`)."""

from __future__ import annotations

import pytest
import torch

from mmtrain.config import DiffusionConfig
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError
from mmtrain.train.diffusion import DiffusionObjective, frame_change


def video(frames: int = 4) -> ModelSpec:
    spec = load_spec("tiny-dit").to_dict()
    spec["denoiser"].update({"frames": frames, "input": "video", "sample_size": 16})
    return ModelSpec.from_dict(spec)


def test_a_steady_error_costs_nothing_and_flicker_four_times_its_square():
    steady = torch.full((1, 3, 4, 8, 8), 0.5, dtype=torch.float64)
    assert torch.equal(frame_change(steady), torch.zeros(1, dtype=torch.float64))
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64).view(1, 1, 4, 1, 1)
    flicker = 0.5 * signs.expand(1, 3, 4, 8, 8)
    assert torch.equal(frame_change(flicker), torch.full((1,), 4 * 0.25, dtype=torch.float64))


def _loss(weight: float, prediction: torch.Tensor, batch: dict) -> torch.Tensor:
    config = DiffusionConfig(cfg_dropout=0.0, temporal_weight=weight)
    objective = DiffusionObjective(video(), config, seed=0)
    objective.prepare(None, [batch], None, 0)
    objective.inputs(batch, 0)
    target, _ = objective.targets[0]
    return objective.loss({"prediction": prediction(target)}, batch, 0)


def test_the_term_adds_its_weight_times_the_frame_change_of_the_error():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 3, 4, 16, 16, generator=g, dtype=torch.float64)
    batch = {"video": x0, "class": torch.tensor([0, 1])}
    offset = torch.randn(2, 3, 4, 16, 16, generator=g, dtype=torch.float64)
    plain = _loss(0.0, lambda target: target + offset, batch)
    weighted = _loss(0.5, lambda target: target + offset, batch)
    expected = plain + 0.5 * frame_change(offset).mean()
    assert torch.allclose(weighted, expected, rtol=1e-12, atol=0)
    assert torch.allclose(plain, offset.square().flatten(1).mean(1).mean(), rtol=1e-12, atol=0)


def test_the_term_is_refused_for_an_image_denoiser_by_field():
    with pytest.raises(FieldError, match="temporal_weight"):
        DiffusionObjective(load_spec("tiny-dit"), DiffusionConfig(temporal_weight=0.1), seed=0)
    with pytest.raises(FieldError, match="temporal_weight"):
        DiffusionConfig(temporal_weight=-1.0).validate()
