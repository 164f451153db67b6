"""The default initialisation (`MultimodalModel.init_weights`): width-aware stds per parameter
kind, every parameter covered, a pure function of the seed.

Statistical bounds are derived from the sample size: for n independent N(0, std^2) draws the
sample mean has standard deviation std / sqrt(n), and the sample standard deviation s satisfies
s / std - 1 ~ N(0, 1 / (2 (n - 1))) for large n. Six of those standard deviations make a false
failure about a one-in-a-billion event per check, on any machine.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import mmtrain
from mmtrain.models.init_rules import init_rules
from mmtrain.spec import load_spec, with_tower

SIGMAS = 6.0
PRESETS = sorted(p.stem for p in (Path(mmtrain.__file__).parent / "presets").glob("*.yaml"))


def map_pooling_spec():
    """tiny-clip whose image tower pools with a MAP head (probe + cross-attention + MLP)."""
    return with_tower(load_spec("tiny-clip"), "image", pooling="map")


def check_normal(name: str, param: torch.Tensor, std: float) -> None:
    """`param` looks like n draws of N(0, std^2), within SIGMAS standard errors."""
    x = param.detach().double().flatten()
    n = x.numel()
    assert abs(x.mean().item()) <= SIGMAS * std / math.sqrt(n), name
    ratio = x.std().item() / std
    assert abs(ratio - 1) <= SIGMAS / math.sqrt(2 * (n - 1)), f"{name}: std {ratio:.3f}x {std}"


@pytest.mark.parametrize("name", PRESETS)
def test_every_parameter_of_every_preset_has_an_init_rule(name):
    """No parameter falls through to the fallback: a new layer must be given its init."""
    model = mmtrain.create_model(name, device="meta")
    rules = init_rules(model)
    assert [n for n, _ in model.named_parameters() if n not in rules] == []


@pytest.mark.parametrize("name", ["tiny-multimodal", "tiny-fusion", "map"])
def test_drawn_weights_follow_their_rules(name):
    """Every tower kind (image, video, audio, timeseries, text), MAP pooling and the fusion head:
    constants exactly, random weights within the sample-size bound."""
    spec = map_pooling_spec() if name == "map" else name
    model = mmtrain.create_model(spec, seed=1)
    rules = init_rules(model)
    for param_name, param in model.named_parameters():
        rule = rules[param_name]
        if rule.std is None:
            assert torch.all(param == rule.value), param_name
        else:
            check_normal(param_name, param, rule.std)


def test_stds_per_parameter_kind_follow_the_conventions():
    """tiny-clip (width 128, 5 layers per tower), checked against the formulas themselves."""
    model = mmtrain.create_model("tiny-clip", seed=2)
    width, layers = 128, 5
    residual = width**-0.5 * (2 * layers) ** -0.5  # GPT-2 / OpenCLIP text proj_std
    image, text = model.towers["image"], model.towers["text"]
    expected = {
        "qkv": (image.blocks[0].attn.qkv.weight, width**-0.5),
        "attn out": (text.blocks[4].attn.out.weight, residual),
        "fc1": (image.blocks[2].mlp.fc1.weight, (2 * width) ** -0.5),
        "fc2": (text.blocks[1].mlp.fc2.weight, residual),
        "token embedding": (text.stem.token_embed.weight, 0.02),
        "text positions": (text.stem.pos_embed, 0.01),
        "patch conv": (image.stem.patch_embed.weight, (3 * 8 * 8) ** -0.5),
        "class token": (image.stem.cls_token, width**-0.5),
        "image positions": (image.stem.pos_embed, width**-0.5),
        "projection": (image.proj.weight, width**-0.5),
    }
    for kind, (param, std) in expected.items():
        check_normal(kind, param, std)
    assert torch.all(image.blocks[0].attn.qkv.bias == 0)
    assert torch.all(image.norm_final.weight == 1) and torch.all(image.norm_final.bias == 0)
    assert model.logit_scale.item() == pytest.approx(math.log(1 / 0.07))


def test_map_and_fusion_heads_are_width_aware():
    pool = mmtrain.create_model(map_pooling_spec(), seed=3).towers["image"].pool
    check_normal("probe", pool.probe, 128**-0.5)
    check_normal("MAP q", pool.attn.q.weight, 128**-0.5)
    fusion = mmtrain.create_model("tiny-fusion", seed=3).fusion
    w, layers = fusion.spec.width, fusion.spec.layers
    check_normal("queries", fusion.queries, w**-0.5)
    check_normal("fusion fc2", fusion.blocks[0].mlp.fc2.weight, w**-0.5 * (2 * layers) ** -0.5)
    check_normal("fusion classifier", fusion.out.weight, 0.1 * w**-0.5)  # small head: see build.py
    for name, linear in fusion.inputs.items():
        check_normal(f"fusion input {name}", linear.weight, linear.weight.shape[1] ** -0.5)


def test_init_is_a_pure_function_of_the_seed():
    a = mmtrain.create_model("tiny-multimodal", seed=7)
    b = mmtrain.create_model("tiny-multimodal", seed=7)
    c = mmtrain.create_model("tiny-multimodal", seed=8)
    rules = init_rules(a)
    for (name, pa), pb, pc in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name in rules and rules[name].std is not None:
            assert not torch.equal(pa, pc), name


def test_init_is_drawn_in_float32_whatever_the_dtype():
    """Draws happen in fp32 on the CPU and are then cast: a bf16 model is the fp32 one, cast."""
    fp32 = mmtrain.create_model("tiny-clip", seed=4)
    bf16 = mmtrain.create_model("tiny-clip", seed=4, dtype=torch.bfloat16)
    for (name, p32), p16 in zip(fp32.state_dict().items(), bf16.state_dict().values(), strict=True):
        assert torch.equal(p32.to(torch.bfloat16), p16), name
