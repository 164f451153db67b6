"""The planner on diffusion transformers: a denoiser spec is one "diffusion" stack whose
parameters, FLOPs and saved activations are the module's (`--measure`: activations within
10%, model states within 1%, as tests/test_plan_measure.py), and the hand-built DiT workload
rows still plan as before; an MMDiT's joint blocks and text are planned as measured."""

import json

import pytest
import yaml

from mmtrain.cli import main
from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.hardware import default_catalog
from mmtrain.plan.activations import activation_options, layer_bytes, layer_terms
from mmtrain.plan.compute import workload_family
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import make_plan
from mmtrain.plan.model import from_spec
from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec

DIT_XL_2_PARAMS = 674_834_720  # Peebles & Xie's DiT-XL/2 with learned sigma (its checkpoints)


def _plan_json(capsys, argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_dit_xl_2_plans_as_one_diffusion_stack(capsys):
    out = _plan_json(capsys, ["--model", "DiT-XL-2", "--gpu", "h100"])
    model, memory, time = out["model"], out["memory"], out["time"]
    assert model["params"] == DIT_XL_2_PARAMS
    assert model["trainable_params"] == DIT_XL_2_PARAMS
    assert model["tokens_per_sample"] == {"denoiser": 256}
    assert model["towers"]["denoiser"] == {
        "params": DIT_XL_2_PARAMS,
        "mode": "train",
        "layers": 28,
        "width": 1152,
    }
    spec = load_spec("DiT-XL-2")
    assert model["forward_flops_per_sample"] == spec.denoiser.forward_flops()
    assert model["train_flops_per_sample"] == 3 * spec.denoiser.forward_flops()
    # 16 B/param: bf16 weights and grads, fp32 master, momentum and variance
    assert memory["weights_bytes"] == 2 * DIT_XL_2_PARAMS
    assert memory["optimizer_bytes"] == 12 * DIT_XL_2_PARAMS
    assert memory["activations_by_tower"]["denoiser"] > 28 * 14_000_000  # 28 blocks (below)
    assert memory["loss_bytes"] == 4 * (4 * 32 * 32 + 1)  # the fp32 error and the weight
    assert time["efficiency_family"] == "diffusion"
    assert "no published diffusion run" in time["efficiency_source"]


def test_denoiser_family_and_stack():
    spec = load_spec("DiT-XL-2")
    model = from_spec(spec)
    assert workload_family(model) == "diffusion"
    (stack,) = model.stacks
    d = spec.denoiser
    assert (stack.name, stack.kind) == ("denoiser", "diffusion")
    assert (stack.layers, stack.width, stack.heads, stack.mlp_hidden) == (28, 1152, 16, 4608)
    assert stack.tokens == d.tokens() == 256
    assert stack.params == d.params() and stack.forward_flops == d.forward_flops()
    assert stack.layer_params == d.block_params()
    # what ZeRO gathers per block: its matrices (biases aside), the modulation's 6 w^2 included
    assert stack.block_params() == 18 * 1152**2
    assert 0 < d.block_params() - stack.block_params() < 20 * 1152


def test_dit_block_activations_per_op():
    """DiT-XL-2's block at micro-batch 1 under bf16 autocast (2-byte copies, fp32 residual
    stream and LayerNorm outputs), counted op by op as autograd saves them (models/dit.py)."""
    stack = from_spec(load_spec("DiT-XL-2")).stacks[0]
    s, h, f, a = 256, 1152, 4608, 16
    per_token = (
        2 * h * 4  # norm1, norm2 inputs (the fp32 residual stream)
        + 2 * 2 * 4  # their mean and rstd (fp32)
        + 2 * h * 4  # their outputs, which the (1 + scale) product reads (fp32 LayerNorm)
        + h * 2  # qkv's input (the modulated tokens, cast)
        + 3 * h * 2  # q, k, v: views of the qkv output
        + h * 2  # attention output (the out projection's input is a view of it)
        + a * 4  # attention log-sum-exp
        + h * 2  # fc1's input
        + 2 * f * 2  # GELU's input, fc2's input
        + 2 * h * 2  # attention and MLP outputs, which the gates' products read
    )
    per_sample = (1 + 6 + 2) * h * 2  # SiLU(c), the modulation output, two (1 + scale)
    expected = {
        "none": s * per_token + per_sample,
        "selective": s * (per_token - 3 * h * 2 - h * 2 - a * 4) + per_sample,
        "full": s * h * 4,  # the block's input (c, shared by every block, is kept once)
    }
    for ac, value in expected.items():
        o = activation_options("bf16", "flash", ac, 1, False)
        assert layer_bytes(stack, 1, o) == value, ac
    assert expected["none"] == 14_196_992  # 48.1 s b h: a plain ViT block keeps 32
    terms = layer_terms(stack, 1, activation_options("bf16", "flash", "none", 1, False))
    assert terms["gated_outputs"] == s * 2 * h * 2 and terms["norm_copies"] == s * 2 * h * 4


def _spec_file(tmp_path):
    """A DDPM denoiser on latents without classes, with learned sigma (the loss reads only the
    first half of the output's channels)."""
    spec = DenoiserSpec(
        sample_size=16,
        channels=4,
        patch_size=2,
        width=96,
        layers=3,
        heads=6,
        learn_sigma=True,
        prediction="epsilon",
        input="latent",
    )
    path = tmp_path / "ddpm-dit.yaml"
    data = {"name": "ddpm-dit", "objective": "diffusion", "denoiser": spec.to_dict()}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _video_spec_file(tmp_path):
    """A flow-matching video DiT over 4-frame clips in tubes of 2 x 4 x 4."""
    spec = DenoiserSpec(sample_size=16, channels=3, patch_size=4, width=32, layers=2, heads=2,
                        frames=4, temporal_patch=2, input="video")  # fmt: skip
    path = tmp_path / "video-dit.yaml"
    data = {"name": "video-dit", "objective": "flow_matching", "denoiser": spec.to_dict()}
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "tiny-dit", "--micro-batch", "4", "--ac", "none"],
        ["--model", "tiny-dit", "--micro-batch", "3", "--ac", "full"],
        ["--model", "tiny-dit", "--micro-batch", "4", "--ac", "selective"],
        ["--model", "tiny-dit", "--micro-batch", "2", "--lora", "denoiser"],
        [
            "--model",
            "tiny-dit",
            "--micro-batch",
            "2",
            "--ac",
            "selective",
            "--lora",
            "denoiser",
            "--lora-targets",
            "mlp",
        ],
        # the DiT's inputs (patches, timestep MLP, classes) freeze with its first blocks
        ["--model", "tiny-dit", "--micro-batch", "4", "--freeze-blocks", "denoiser=1"],
        ["--model", "VIDEO", "--micro-batch", "2", "--ac", "none"],
        ["--model", "VIDEO", "--micro-batch", "2", "--ac", "full"],
        ["--model", "DDPM", "--micro-batch", "2", "--ac", "none"],
        ["--model", "DDPM", "--micro-batch", "2", "--ac", "full"],
    ],
)
def test_measure_agrees_with_prediction(capsys, tmp_path, argv):
    files = {"DDPM": _spec_file, "VIDEO": _video_spec_file}
    argv = [files[a](tmp_path) if a in files else a for a in argv]
    measured = _plan_json(capsys, [*argv, "--measure"])["measured"]
    assert abs(measured["activations_error"]) < 0.10
    assert abs(measured["model_state_error"]) < 0.01
    assert measured["activations_bytes"] > 0
    assert measured["trainable_params"] == measured["predicted_trainable_params"]
    assert measured["optimizer_state_params"] == measured["predicted_trainable_params"]


# Before the denoiser spec was planned (hand-built shapes; unchanged by it): params, forward
# FLOPs and saved activations at micro-batch 1 on one H100 (bf16 autocast, no checkpointing).
ROWS = {
    "dit-2b": (2_028_000_000, 19_901_424_000_000, 5_651_616_000),
    "dit-12b": (11_900_000_000, 124_542_798_004_224, 29_077_069_824),
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_dit_workload_rows(capsys, name):
    params, flops, saved = ROWS[name]
    model = load_model(name)
    assert workload_family(model) == "diffusion"
    assert [s.kind for s in model.stacks] == ["diffusion"]
    plan = make_plan(model, PlanConfig(gpu="h100"), default_catalog())
    assert (model.params(), model.forward_flops()) == (params, flops)
    assert plan.memory.saved_activations_bytes == saved
    out = _plan_json(capsys, ["--model", name, "--gpu", "h100"])
    assert out["model"]["params"] == params
    assert out["time"]["efficiency_family"] == "diffusion"


# ----------------------------------------------------------------------------- MMDiT
def test_sd3_medium_plans_as_one_diffusion_stack_over_image_and_text_tokens(capsys):
    out = _plan_json(capsys, ["--model", "SD3-medium", "--gpu", "h100"])
    d = load_spec("SD3-medium").denoiser
    assert out["model"]["params"] == d.params() == 2_028_328_000
    assert out["model"]["tokens_per_sample"] == {"denoiser": 64 * 64 + 333}
    assert out["model"]["forward_flops_per_sample"] == d.forward_flops()
    assert out["time"]["efficiency_family"] == "diffusion"


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_mmdit_measure_agrees_with_prediction(capsys, ac):
    # joint blocks, the last block whose text ends at the attention, the text's stem: exact
    argv = ["--model", "tiny-mmdit", "--micro-batch", "2", "--ac", ac, "--measure"]
    measured = _plan_json(capsys, argv)["measured"]
    assert measured["activations_error"] == 0 and measured["model_state_error"] == 0
    assert measured["trainable_params"] == measured["predicted_trainable_params"]
