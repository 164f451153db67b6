"""The model description: presets, analytic counts, validation and (de)serialisation."""

import json

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
