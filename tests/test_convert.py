"""OpenCLIP interop: converted weights compute OpenCLIP's embeddings, both ways, and bad
checkpoints are refused with every offending key listed.

open_clip is not installed: `openclip_reference` computes OpenCLIP's forward pass from a state
dict under OpenCLIP's own names, and the state dicts are built here with OpenCLIP's names and shapes.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from mmtrain.cli import main
from mmtrain.models.build import create_model, load_model
from mmtrain.models.formats.keys import CheckpointMismatch
from mmtrain.models.formats.openclip import (
    IncompatibleSpec,
    key_map,
    mmtrain_to_openclip,
    openclip_to_mmtrain,
    read_openclip_checkpoint,
)
from mmtrain.spec import ModelSpec, load_spec
from openclip_reference import (
    VIT_B_32,
    ClipShape,
    clip_token_ids,
    encode_image,
    encode_text,
    random_openclip_state_dict,
)

# Image and text widths differ from each other and from embed_dim, so a swapped or untransposed
# tensor cannot have the right shape by accident.
SMALL = ClipShape(
    embed_dim=16,
    image_size=32,
    patch_size=8,
    vision_width=32,
    vision_layers=2,
    vision_heads=4,
    context_length=12,
    vocab_size=64,
    text_width=24,
    text_layers=2,
    text_heads=3,
)
# Embeddings are compared in float64: our forward and the reference differ only in the order of
# their float operations (fused q/k/v, SDPA vs explicit softmax), so they agree to ~1e-15 on any
# CPU; in float32 the same comparison depends on the CPU's kernels.
ATOL = 1e-10


def _double(state: dict) -> dict:
    return {k: v.double() if v.is_floating_point() else v for k, v in state.items()}


def convert(*args) -> int:
    """`mmtrain convert ARGS...` through the real CLI; returns its exit code."""
    return main(["convert", *map(str, args)])


def small_case(seed: int = 0, shape: ClipShape = SMALL) -> tuple[ModelSpec, dict]:
    spec = ModelSpec.from_dict(shape.spec_dict())
    return spec, random_openclip_state_dict(shape, torch.Generator().manual_seed(seed))


def inputs(shape: ClipShape, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(3, 3, shape.image_size, shape.image_size, generator=g)
    longest = shape.context_length - 2  # EOT lands on the last position
    text = clip_token_ids([0, 3, longest], shape, g)
    return images, text


def assert_same_embeddings(model, openclip_sd: dict, shape: ClipShape) -> None:
    images, text = inputs(shape)
    images, reference = images.double(), _double(openclip_sd)
    model = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        ours = model.encode({"image": images, "text": text})
        torch.testing.assert_close(
            ours["image"], encode_image(reference, images, shape), atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            ours["text"], encode_text(reference, text, shape), atol=ATOL, rtol=0
        )


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("quick_gelu", [False, True])
def test_converted_openclip_weights_give_openclip_embeddings(quick_gelu):
    shape = replace(SMALL, quick_gelu=quick_gelu)
    spec, openclip_sd = small_case(shape=shape)
    model = create_model(spec)
    model.load_state_dict(openclip_to_mmtrain(openclip_sd, spec), strict=True)
    assert_same_embeddings(model, openclip_sd, shape)
    torch.testing.assert_close(
        model.logit_scale.detach(), openclip_sd["logit_scale"], atol=0, rtol=0
    )


def test_optional_tensors_logit_bias_and_text_projection_bias():
    shape = replace(SMALL, text_proj_bias=True, logit_bias=True)
    spec, openclip_sd = small_case(shape=shape)
    ours = openclip_to_mmtrain(openclip_sd, spec)
    model = create_model(spec, device="meta")
    model.load_state_dict(ours, strict=True, assign=True)
    assert_same_embeddings(model, openclip_sd, shape)
    assert torch.equal(model.logit_bias, openclip_sd["logit_bias"])
    back = mmtrain_to_openclip(ours, spec)
    assert back.keys() == openclip_sd.keys()
    assert all(torch.equal(back[k], v) for k, v in openclip_sd.items())


def test_reference_is_sensitive_to_the_weights():
    # Guards the test above against a reference that ignores what it is given.
    spec, openclip_sd = small_case()
    model = create_model(spec)
    model.load_state_dict(openclip_to_mmtrain(openclip_sd, spec), strict=True)
    openclip_sd["transformer.resblocks.1.mlp.c_fc.bias"] += 0.1
    openclip_sd["visual.ln_pre.bias"] += 0.1
    with pytest.raises(AssertionError):
        assert_same_embeddings(model, openclip_sd, SMALL)


def test_openclip_round_trip_reproduces_the_dict_exactly():
    spec, openclip_sd = small_case()
    back = mmtrain_to_openclip(openclip_to_mmtrain(openclip_sd, spec), spec)
    assert back.keys() == openclip_sd.keys()
    for key, value in openclip_sd.items():
        assert torch.equal(back[key], value), key
        assert back[key].is_contiguous()


def test_exported_mmtrain_model_gives_the_same_embeddings_in_openclip():
    spec, _ = small_case()
    model = create_model(spec, seed=3)
    openclip_sd = mmtrain_to_openclip(model.state_dict(), spec)
    assert_same_embeddings(model, openclip_sd, SMALL)


def test_key_map_covers_every_tensor_of_every_openclip_preset():
    # The model on the meta device costs no memory, so the ViT-L presets are checked too.
    for name in ("ViT-B-32", "ViT-B-16", "ViT-L-14", "ViT-L-14-336"):
        spec = load_spec(name)
        model = create_model(spec, device="meta")
        ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        assert ours == {p.ours: p.shape for p in key_map(spec)}, name
    # OpenCLIP's ViT-B-32 has 151,277,313 parameters (its published model profile).
    assert sum(torch.Size(p.their_shape).numel() for p in key_map("ViT-B-32")) == 151_277_313


# ----------------------------------------------------------------------------- bad input
def test_missing_unknown_and_misshaped_keys_are_listed_in_one_error():
    spec, openclip_sd = small_case()
    del openclip_sd["visual.ln_post.bias"]
    openclip_sd["visual.head.weight"] = torch.zeros(3)
    openclip_sd["text_projection"] = openclip_sd["text_projection"].t()  # [E, w] instead of [w, E]
    with pytest.raises(CheckpointMismatch) as info:
        openclip_to_mmtrain(openclip_sd, spec)
    err = info.value
    assert err.missing == ["visual.ln_post.bias [32]"]
    assert err.unexpected == ["visual.head.weight [3]"]
    assert err.mismatched == ["text_projection is [16, 24], expected [24, 16]"]
    message = str(err)
    for key in ("visual.ln_post.bias", "visual.head.weight", "text_projection", "3 problems"):
        assert key in message


def test_checkpoint_of_another_model_names_the_extra_layers():
    spec, openclip_sd = small_case()
    smaller = load_spec_dict(SMALL, vision_layers=1)
    with pytest.raises(CheckpointMismatch) as info:
        openclip_to_mmtrain(openclip_sd, smaller)
    assert info.value.missing == []
    assert len(info.value.unexpected) == 12  # the 12 tensors of visual block 1
    assert all(k.startswith("visual.transformer.resblocks.1.") for k in info.value.unexpected)


def load_spec_dict(shape: ClipShape, **changes) -> ModelSpec:
    return ModelSpec.from_dict(replace(shape, **changes).spec_dict())


def test_mmtrain_state_dict_with_wrong_keys_is_refused():
    spec, openclip_sd = small_case()
    ours = openclip_to_mmtrain(openclip_sd, spec)
    del ours["towers.text.norm_final.weight"]
    with pytest.raises(CheckpointMismatch, match="towers.text.norm_final.weight"):
        mmtrain_to_openclip(ours, spec)


def test_specs_without_an_openclip_counterpart_are_refused_with_reasons():
    data = SMALL.spec_dict()
    data["towers"]["image"]["pooling"] = "mean"
    data["towers"]["text"]["stem"]["causal"] = False
    with pytest.raises(IncompatibleSpec) as info:
        key_map(ModelSpec.from_dict(data))
    assert "towers.image.pooling" in str(info.value)
    assert "towers.text.stem.causal" in str(info.value)
    with pytest.raises(IncompatibleSpec, match="one image and one text tower"):
        key_map("tiny-multimodal")


# ----------------------------------------------------------------------------- files
def test_training_checkpoint_with_module_prefixes_loads(tmp_path):
    spec, openclip_sd = small_case()
    checkpoint = {
        "epoch": 7,
        "name": "my-run",
        "state_dict": {f"module.{k}": v for k, v in openclip_sd.items()},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
    }
    torch.save(checkpoint, tmp_path / "epoch_7.pt")
    loaded = read_openclip_checkpoint(tmp_path / "epoch_7.pt")
    assert list(loaded) == list(openclip_sd)
    assert all(torch.equal(loaded[k], v) for k, v in openclip_sd.items())


def test_causal_mask_buffer_is_ignored():
    spec, openclip_sd = small_case()
    openclip_sd["attn_mask"] = torch.full((12, 12), float("-inf")).triu(1)
    converted = openclip_to_mmtrain(openclip_sd, spec)
    assert not any("mask" in k for k in converted)


def test_pickled_python_objects_are_not_loaded(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save(
        {"state_dict": {"x": torch.zeros(1)}, "args": ModelSpec}, path
    )  # a class: needs unpickling code
    with pytest.raises(ValueError, match="not unpickled for safety"):
        read_openclip_checkpoint(path)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_cli_round_trip(tmp_path, suffix, capsys):
    spec, openclip_sd = small_case()
    spec_file = tmp_path / "clip.yaml"
    spec.save(spec_file)
    source = tmp_path / f"openclip{suffix}"
    if suffix == ".pt":
        torch.save(
            {"epoch": 1, "state_dict": {f"module.{k}": v for k, v in openclip_sd.items()}}, source
        )
    else:
        save_file(openclip_sd, source)

    folder = tmp_path / "converted"
    assert (
        convert("--from", "openclip", str(source), "--model", str(spec_file), "--out", str(folder))
        == 0
    )
    model = load_model(folder)
    assert_same_embeddings(model, openclip_sd, SMALL)

    back = tmp_path / f"back{suffix}"
    assert (
        convert("--to", "openclip", str(folder), "--model", str(spec_file), "--out", str(back)) == 0
    )
    exported = read_openclip_checkpoint(back)
    assert exported.keys() == openclip_sd.keys()
    assert all(torch.equal(exported[k], v) for k, v in openclip_sd.items())
    assert "wrote" in capsys.readouterr().out


def test_cli_reports_bad_checkpoint_with_file_and_keys(tmp_path, capsys):
    spec, openclip_sd = small_case()
    spec_file = tmp_path / "clip.yaml"
    spec.save(spec_file)
    del openclip_sd["ln_final.weight"]
    openclip_sd["visual.extra"] = torch.zeros(2)
    source = tmp_path / "broken.safetensors"
    save_file(openclip_sd, source)
    code = convert(
        "--from", "openclip", str(source), "--model", str(spec_file), "--out", str(tmp_path / "out")
    )
    err = capsys.readouterr().err
    assert code == 2
    assert str(source) in err and "ln_final.weight" in err and "visual.extra" in err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_the_wrong_model_and_unknown_files(tmp_path, capsys):
    spec, openclip_sd = small_case()
    source = tmp_path / "small.safetensors"
    save_file(openclip_sd, source)
    code = convert(
        "--from", "openclip", str(source), "--model", "ViT-B-32", "--out", str(tmp_path / "o")
    )
    assert code == 2
    assert (
        "visual.conv1.weight is [32, 3, 8, 8], expected [768, 3, 32, 32]" in capsys.readouterr().err
    )

    assert (
        convert(
            "--from",
            "openclip",
            str(tmp_path / "nope.pt"),
            "--model",
            "ViT-B-32",
            "--out",
            str(tmp_path / "o"),
        )
        == 2
    )
    assert "nope.pt" in capsys.readouterr().err

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    assert (
        convert(
            "--from", "openclip", str(garbage), "--model", "ViT-B-32", "--out", str(tmp_path / "o")
        )
        == 2
    )
    assert "garbage.pt is not a readable PyTorch checkpoint" in capsys.readouterr().err


def test_cli_export_checks_the_named_model(tmp_path, capsys):
    spec, openclip_sd = small_case()
    spec_file = tmp_path / "clip.yaml"
    spec.save(spec_file)
    source = tmp_path / "small.safetensors"
    save_file(openclip_sd, source)
    folder = tmp_path / "converted"
    assert (
        convert("--from", "openclip", str(source), "--model", str(spec_file), "--out", str(folder))
        == 0
    )
    capsys.readouterr()
    assert (
        convert(
            "--to", "openclip", str(folder), "--model", "ViT-B-32", "--out", str(tmp_path / "x.pt")
        )
        == 2
    )
    assert "visual.conv1.weight: [32, 3, 8, 8] vs [768, 3, 32, 32]" in capsys.readouterr().err
    assert convert("--to", "openclip", str(folder), "--out", str(tmp_path / "x.npz")) == 2
    assert ".safetensors or FILE.pt" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


# ----------------------------------------------------------------------------- full size
@pytest.mark.slow
def test_vit_b_32_round_trip_matches_openclip(tmp_path):
    spec = load_spec("ViT-B-32")
    openclip_sd = random_openclip_state_dict(VIT_B_32, torch.Generator().manual_seed(0))
    model = create_model(spec)
    model.load_state_dict(openclip_to_mmtrain(openclip_sd, spec), strict=True)
    images, text = inputs(VIT_B_32)
    images, text = images[:2].double(), text[1:]
    reference = _double(openclip_sd)
    double = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        ours = double.encode({"image": images, "text": text})
    torch.testing.assert_close(
        ours["image"], encode_image(reference, images, VIT_B_32), atol=ATOL, rtol=0
    )
    torch.testing.assert_close(
        ours["text"], encode_text(reference, text, VIT_B_32), atol=ATOL, rtol=0
    )
    del double
    back = mmtrain_to_openclip(model.state_dict(), spec)
    assert back.keys() == openclip_sd.keys()
    assert all(torch.equal(back[k], v) for k, v in openclip_sd.items())
