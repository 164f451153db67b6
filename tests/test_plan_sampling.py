"""`mmtrain plan --inference` for a denoiser: a sampler's FLOPs, time, cost and memory per
image on one GPU (plan/sampling.py)."""

from __future__ import annotations

import json

import pytest

from mmtrain.cli import main
from mmtrain.hardware import default_catalog
from mmtrain.plan.sampling import sampling_estimate
from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec
from mmtrain.structured import FieldError


def test_an_image_costs_steps_times_forwards_times_the_specs_forward():
    model, gpu = load_model("DiT-XL-2"), default_catalog().gpu("a100")
    forward = load_spec("DiT-XL-2").denoiser.forward_flops()
    guided = sampling_estimate(model, gpu, steps=50, batch=8)
    plain = sampling_estimate(model, gpu, steps=50, guidance=False, batch=8)
    assert guided.flops_per_image == 50 * 2 * forward
    assert plain.flops_per_image == 50 * forward
    assert guided.seconds_per_image == pytest.approx(2 * plain.seconds_per_image, rel=1e-12)
    # The time is the FLOPs at the achievable fraction of the GPU's bf16 peak, or --mfu's.
    at = sampling_estimate(model, gpu, steps=50, mfu=0.5)
    assert at.seconds_per_image == pytest.approx(
        at.flops_per_image / (0.5 * gpu.peak_flops("bf16"))
    )
    # Memory: weights at the precision, a working set per image and forward.
    assert guided.weights_bytes == model.params() * 2
    assert guided.activations_bytes == pytest.approx(2 * plain.activations_bytes)
    assert guided.activations_bytes == pytest.approx(
        8 * sampling_estimate(model, gpu).activations_bytes
    )
    assert 0 < guided.max_batch < plain.max_batch


def test_cost_per_million_images_follows_the_price():
    model, gpu = load_model("DiT-XL-2"), default_catalog().gpu("h100")
    est = sampling_estimate(model, gpu, steps=25, price_per_gpu_hour=3.0)
    d = est.to_dict()
    assert d["gpu_hours_per_million_images"] == pytest.approx(1e6 * est.seconds_per_image / 3600)
    assert d["cost_per_million_images"] == pytest.approx(3.0 * d["gpu_hours_per_million_images"])


def test_bad_sampling_inputs_name_their_flag():
    gpu = default_catalog().gpu("h100")
    with pytest.raises(FieldError, match="--sampling-steps"):
        sampling_estimate(load_model("DiT-XL-2"), gpu, steps=0)
    with pytest.raises(FieldError, match="--model"):
        sampling_estimate(load_model("tiny-clip"), gpu)


def test_plan_inference_of_a_denoiser_prints_its_sampling(capsys):
    argv = ["plan", "--model", "DiT-XL-2", "--gpu", "a100", "--inference", "--json"]
    assert main([*argv, "--sampling-steps", "25", "--samples", "1000"]) == 0
    out = json.loads(capsys.readouterr().out)["sampling"]
    assert out["steps"] == 25 and out["forwards_per_step"] == 2 and out["fits"]
    assert out["gpu_hours"] == pytest.approx(1000 * out["seconds_per_image"] / 3600)
    assert main(["plan", "--model", "DiT-XL-2", "--inference", "--no-guidance"]) == 0
    assert "no guidance" in capsys.readouterr().out
