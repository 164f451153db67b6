"""The planner on native-resolution VLMs (Qwen2-VL family: spec.vision): the same parameters
as the built module (exactly), a row's FLOPs as the specs count them, activations as autograd
keeps them in one CPU step (within the 10% the other --measure tests hold), and `--visual`."""

import json
from dataclasses import replace

import pytest

from mmtrain.cli import main
from mmtrain.native_vision_spec import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS
from mmtrain.plan.model import Rows, default_rows, from_spec
from mmtrain.plan.native_vision import parse_visual
from mmtrain.plan.workloads import load_model
from mmtrain.spec import VISION_TOWER, load_spec
from mmtrain.structured import FieldError

TINY = "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def gelu_path(tmp_path_factory):
    """A tiny Qwen2-VL-shaped variant: LayerNorm, a quick_gelu fc1/fc2 MLP, no windows."""
    spec = load_spec(TINY)
    vision = spec.vision.replace(
        mlp="gelu", activation="quick_gelu", norm="layer_norm", mlp_hidden=64, window_size=0,
        full_attention_blocks=(),
    )  # fmt: skip
    path = tmp_path_factory.mktemp("spec") / "tiny-qwen2-vl-gelu.yaml"
    replace(spec, name="tiny-qwen2-vl-gelu", vision=vision).save(path)
    return path


@pytest.mark.parametrize("name", ["Qwen2.5-VL-7B", TINY])
def test_parameter_counts_equal_the_built_module(name):
    from mmtrain.models.build import create_model

    spec = load_spec(name)
    module = create_model(spec, device="meta")
    planned = load_model(name)
    assert sum(p.numel() for p in module.parameters()) == planned.params() == spec.params()
    tower = sum(p.numel() for p in module.towers[VISION_TOWER].parameters())
    assert planned.stack(VISION_TOWER).params == tower == spec.vision.params()  # merger in
    assert planned.trainable_params() == sum(
        p.numel() for p in module.parameters() if p.requires_grad
    )


def test_row_flops_are_the_towers_and_the_decoders():
    spec = load_spec("Qwen2.5-VL-7B")
    v = spec.vision
    inputs = ((1, *v.resized(1000, 700)), (1, *v.resized(300, 1200)), (8, 448, 448))
    model = from_spec(spec, Rows(8192, visual_inputs=inputs))
    vision = sum(v.forward_flops(h, w, f) for f, h, w in inputs)
    assert model.forward_flops() == vision + spec.decoder.forward_flops(8192)
    assert model.stack("vision").forward_flops == vision
    assert model.stack("vision").tokens == sum(v.patches(h, w, f) for f, h, w in inputs)
    assert model.stack("text").tokens == 8192


def test_default_row_is_one_page_at_max_pixels():
    spec = load_spec("Qwen2.5-VL-7B")
    rows = default_rows(spec)
    assert rows.positions == spec.decoder.max_positions
    assert rows.visual_inputs == ((1, *spec.vision.resized(4096, 4096)),)
    height, width = rows.visual_inputs[0][1:]
    assert height * width <= spec.vision.max_pixels
    model = load_model("Qwen2.5-VL-7B", context=4096)  # load_model's rows: the default page
    assert model.stack("vision").tokens == spec.vision.patches(height, width)
    assert load_model(TINY, images=0).stack("vision").tokens == 0  # text-only rows


def test_rows_must_hold_the_visual_tokens():
    spec = load_spec(TINY)
    with pytest.raises(FieldError, match="cannot hold") as err:
        from_spec(spec, Rows(65, visual_inputs=((1, 64, 64),)))  # 64 tokens + 2
    assert err.value.path == "--context"
    from_spec(spec, Rows(66, visual_inputs=((1, 64, 64),)))
    with pytest.raises(FieldError) as err:
        from_spec(spec, Rows(512, visual_inputs=((1, 60, 64),)))  # not a multiple of 8
    assert err.value.path == "visual_inputs[0]"


def test_visual_specs_are_resized_by_the_processors_rule():
    v = load_spec("Qwen2.5-VL-7B").vision
    assert parse_visual(v, "4000x3000") == (1, *v.resized(4000, 3000))
    clip = v.resized(480, 640, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    assert parse_visual(v, "17x480x640") == (16, *clip)  # whole temporal patches of 2
    for bad in ("640", "1x480x640", "0x10", "10x5000", "axb"):
        with pytest.raises(FieldError) as err:
            parse_visual(v, bad)
        assert err.value.path == "--visual"


# fp32 CPU step of the real module against the plan: pages of aspect 1:1, 1:4 and 3:1, without
# and with full checkpointing, for Qwen2.5-VL's block (RMSNorm, SwiGLU, windows) and
# Qwen2-VL's (LayerNorm, quick_gelu, full attention).
PAGES = ["64x64", "32x128", "96x32"]


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("model", [TINY, "GELU"])
def test_measure_agrees_with_prediction(capsys, gelu_path, model, page, ac):
    model = str(gelu_path) if model == "GELU" else model
    argv = ["--model", model, "--visual", page, "--context", "192", "--ac", ac]
    _check_measured(capsys, argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["--visual", "64x64", "--visual", "32x128", "--micro-batch", "2", "--ac", "selective"],
        ["--visual", "64x64", "--freeze", "vision"],
        ["--visual", "64x64", "--lora", "vision"],
        ["--visual", "96x32", "--lora", "vision", "--lora-targets", "attn", "--ac", "full"],
        ["--visual", "64x64", "--lora", "text", "--freeze", "vision"],
        ["--visual", "64x64", "--packed"],
    ],
)
def test_measure_agrees_when_finetuning(capsys, argv):
    _check_measured(capsys, ["--model", TINY, "--context", "256", *argv])


def _check_measured(capsys, argv):
    assert main(["plan", *argv, "--measure", "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert abs(measured["activations_error"]) < 0.10
    assert abs(measured["model_state_error"]) < 0.01
    assert measured["trainable_params"] == measured["predicted_trainable_params"]
    assert measured["optimizer_state_params"] == measured["predicted_trainable_params"]


def test_measure_a_clip_beside_an_image():
    """A clip [T, 3, H, W] under "video" with its own placeholder (sizes given at the tower's
    size: --visual would resize a clip to the video processor's budget, large for a tiny)."""
    from mmtrain.hardware import default_catalog
    from mmtrain.plan.config import PlanConfig
    from mmtrain.plan.estimate import make_plan
    from mmtrain.train.measure_step import measure_training_step

    inputs = ((4, 32, 48), (1, 64, 64))
    model = from_spec(load_spec(TINY), Rows(256, visual_inputs=inputs))
    plan = make_plan(model, PlanConfig(gpu="h100", precision="fp32"), default_catalog())
    measured = measure_training_step(TINY, plan, context=256, visual_inputs=inputs)
    assert abs(measured.activations_error) < 0.10


def test_plan_cli_reports_the_visual_tokens(capsys):
    argv = ["plan", "--model", TINY, "--gpu", "H100", "--visual", "64x256", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    visual = out["visual"]
    assert visual["inputs"] == [
        {"kind": "image", "frames": 1, "height": 64, "width": 256, "patches": 1024, "tokens": 256}
    ]
    assert visual["tokens_per_row"] == 256 and visual["positions_per_row"] == 2048
    assert visual["text_ids_per_row"] == 2048 - 256 + 1
    assert out["memory"]["activations_by_tower"]["vision"] > 0
    assert out["model"]["tokens_per_sample"]["vision"] == 1024
    argv = ["plan", "--model", "Qwen2.5-VL-7B", "--gpu", "H100", "--context", "8192"]
    assert main([*argv, "--visual", "1024x768", "--visual", "16x480x640", "--ac", "full"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "activations: vision" in text and "visual tokens" in text and "step" in text


def test_freezing_and_lora_plan_the_tower(capsys):
    argv = ["plan", "--model", TINY, "--visual", "64x64", "--context", "256", "--json"]
    spec = load_spec(TINY)
    assert main([*argv, "--freeze", "vision"]) == 0
    frozen = json.loads(capsys.readouterr().out)
    assert frozen["model"]["trainable_params"] == spec.decoder.params()
    assert frozen["memory"]["activations_by_tower"]["vision"] == 0
    assert main([*argv, "--lora", "vision", "--lora-rank", "4"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert spec.decoder.params() < lora["model"]["trainable_params"] < spec.params()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", TINY, "--visual", "64"], "--visual: '64' is not HxW"),
        (["--model", TINY, "--visual", "1x64x64"], "--visual: '1x64x64': a clip of 1 frame"),
        (["--model", TINY, "--visual", "8x4000"], "aspect ratio"),
        (["--model", "tiny-vlm", "--visual", "64x64"], "no native-resolution vision tower"),
        (["--model", TINY, "--visual", "64x64", "--images", "2"], "not both"),
        (["--model", TINY, "--visual", "64x64", "--context", "50"], "--context: 50 positions"),
    ],
)
def test_bad_visual_is_refused_by_name(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
