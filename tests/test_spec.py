"""The model description: presets, analytic counts, validation and (de)serialisation."""

import json
from dataclasses import replace

import pytest
import yaml

from mmtrain.cli import main
from mmtrain.spec import ModelSpec, load_spec, preset_names, with_tower
from mmtrain.structured import FieldError


def test_openclip_presets_match_published_counts():
    # OpenCLIP's model profile: parameters and forward GFLOPs (2 x MACs) at 224 px.
    b32 = load_spec("ViT-B-32")
    assert b32.params() == 151_277_313
    assert b32.forward_flops() / 1e9 == pytest.approx(14.78, rel=0.002)
    l14 = load_spec("vit-l-14")  # case-insensitive
    assert l14.forward_flops() / 1e9 == pytest.approx(175.33, rel=0.002)
    assert l14.params() == 427_616_513
    assert load_spec("ViT-B-16").params() == 149_620_737
    assert load_spec("ViT-SO400M-14-SigLIP-384").params() / 1e6 == pytest.approx(877.96, abs=0.01)


def test_tokens_per_sample_follow_the_stems():
    spec = load_spec("tiny-multimodal")
    tokens = spec.tokens_per_sample()
    assert tokens["image"] == (32 // 8) ** 2 + 1
    assert tokens["video"] == (4 // 2) * (32 // 8) ** 2 + 1
    assert tokens["audio"] == (32 // 8) * ((1 + 16000 // 160) // 8) + 1
    assert tokens["timeseries"] == 128 // 8  # mean pooling: no class token
    assert tokens["text"] == 32
    assert load_spec("ViT-L-14-336").tokens_per_sample()["image"] == 24 * 24 + 1


def test_tiny_clip_is_about_two_million_parameters():
    assert 1.5e6 < load_spec("tiny-clip").params() < 2.5e6


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_round_trips_through_yaml_and_json(tmp_path, name):
    spec = load_spec(name)
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"spec{suffix}"
        spec.save(path)
        assert ModelSpec.load(path) == spec
        assert load_spec(str(path)) == spec


def _tiny_dict():
    return yaml.safe_load(yaml.safe_dump(load_spec("tiny-clip").to_dict()))


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (
            lambda d: d["towers"]["image"].update(widht=3),
            "towers.image.widht",
            "did you mean 'width'",
        ),
        (
            lambda d: d["towers"]["image"].update(activation="relu"),
            "towers.image.activation",
            "quick_gelu",
        ),
        (
            lambda d: d["towers"]["image"].update(heads=3),
            "towers.image.heads",
            "does not divide width",
        ),
        (lambda d: d["towers"]["image"].update(layers="two"), "towers.image.layers", "integer"),
        (lambda d: d["towers"]["text"].update(modality="speech"), "towers.text.modality", "one of"),
        (lambda d: d.update(pairs=[["image", "txt"]]), "pairs[0][1]", "did you mean 'text'"),
        (lambda d: d.update(objective="infonce"), "objective", "siglip"),
        (
            lambda d: d["towers"]["image"]["stem"].update(patch_size=0),
            "towers.image.stem.patch_size",
            "positive",
        ),
        (
            lambda d: d["towers"]["image"].update(pooling="eot"),
            "towers.image.pooling",
            "text tower",
        ),
    ],
)
def test_validation_errors_name_the_field(mutate, field, words):
    data = _tiny_dict()
    mutate(data)
    with pytest.raises(FieldError) as err:
        ModelSpec.from_dict(data)
    assert err.value.path == field
    assert words in str(err.value)


def test_with_tower_changes_one_stem_field():
    spec = with_tower(load_spec("tiny-clip"), "image", stem={"image_size": 96})
    assert spec.towers["image"].tokens() == (96 // 8) ** 2 + 1
    assert load_spec("tiny-clip").towers["image"].tokens() == 65


def test_cli_spec_json_and_bad_name(capsys):
    assert main(["spec", "ViT-B-32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"] == 151_277_313
    assert main(["spec", "vit-b-33"]) == 2
    assert "did you mean" in capsys.readouterr().err


def _spec_json(capsys, model: str) -> dict:
    assert main(["spec", model, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _listing_line(capsys, name: str) -> str:
    assert main(["spec"]) == 0
    (line,) = [row for row in capsys.readouterr().out.splitlines() if row.split()[0] == name]
    return line


@pytest.mark.parametrize(
    ("name", "counted", "shown"),
    [
        # a projector VLM: one row of decoder.max_positions with one 336 px image (576 tokens)
        ("llava-1.5-7b", {"positions": 4096, "images": [[336, 336]]},
         "1 row of 4,096 positions (decoder.max_positions) with 1 image 336x336 px"),
        # a native-resolution VLM: its whole context as one row, no image (no fixed size)
        ("Qwen2.5-VL-7B", {"positions": 128_000, "images": []},
         "1 row of 128,000 positions (decoder.max_positions), no image"),
    ],
)  # fmt: skip
def test_spec_names_the_row_a_language_models_flops_count(capsys, name, counted, shown):
    spec = load_spec(name)
    out = _spec_json(capsys, name)
    row = out["forward_flops_input"]
    assert row["positions"] == counted["positions"]
    assert [image["size"] for image in row["images"]] == counted["images"]
    # the figure is the spec's count of exactly that row, and per position its share
    at_shape = sum(spec.sequence_flops_by_part([row["positions"]], len(row["images"])).values())
    assert out["forward_flops_per_sample"] == at_shape == spec.forward_flops()
    per_position = at_shape / row["positions"]
    assert out["forward_flops_per_position"] == per_position  # JSON floats round-trip exactly
    assert main(["spec", name]) == 0
    summary = capsys.readouterr().out
    assert shown in summary and f"{per_position / 1e9:,.2f} GFLOPs per position" in summary
    line = _listing_line(capsys, name)
    assert f"{at_shape / 1e9:.2f} GFLOPs/sample" in line
    assert f"{counted['positions']:,} positions" in line
    assert f"{per_position / 1e9:,.2f} GFLOPs/position" in line


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("ViT-B-32", "image 224x224 px, text 77 tokens"),
        ("tiny-multimodal", "image 32x32 px, video 4 frames of 32x32 px, audio 1 s at 16,000 Hz, "
                            "timeseries 3 channels x 128 steps, text 32 tokens"),
        ("DiT-XL-2", "latent 4x32x32 (channels x height x width)"),
        ("SD3-medium", "latent 16x128x128 (channels x height x width) and 333 text tokens"),
    ],
)  # fmt: skip
def test_spec_names_the_input_of_encoders_and_denoisers(capsys, name, shown):
    spec = load_spec(name)
    out = _spec_json(capsys, name)
    counted = out["forward_flops_input"]
    if spec.denoiser is not None:  # the figure is the denoiser's count at the size shown
        d = spec.denoiser
        assert counted["size"] == list(d.size()) and counted["channels"] == d.channels
        assert out["forward_flops_per_sample"] == d.forward_flops(counted["size"])
    else:  # one input per tower, at its stem's size
        assert set(counted["towers"]) == set(spec.towers)
        for tower, seen in counted["towers"].items():
            assert seen["tokens"] == spec.towers[tower].tokens(), tower
    assert out["forward_flops_per_sample"] == spec.forward_flops()
    assert "forward_flops_per_position" not in out
    assert main(["spec", name]) == 0
    assert f"counted at: {shown}" in capsys.readouterr().out
    assert f"at {shown}" in _listing_line(capsys, name)


def test_the_shape_shown_is_the_one_counted(tmp_path, capsys):
    """Change the shape in a spec file: what spec prints, and its figure, follow."""
    path = tmp_path / "short.yaml"
    vlm = load_spec("tiny-vlm")
    replace(vlm, decoder=vlm.decoder.replace(max_positions=300)).save(path)
    out = _spec_json(capsys, str(path))
    assert out["forward_flops_input"]["positions"] == 300
    assert out["forward_flops_per_sample"] == load_spec("tiny-vlm").sequence_flops(300, 1)
    path = tmp_path / "small.yaml"
    with_tower(load_spec("tiny-clip"), "image", stem={"image_size": 96}).save(path)
    out = _spec_json(capsys, str(path))
    assert out["forward_flops_input"]["towers"]["image"]["size"] == [96, 96]
    assert out["forward_flops_per_sample"] == load_spec(str(path)).forward_flops()
    assert out["forward_flops_per_sample"] > load_spec("tiny-clip").forward_flops()
