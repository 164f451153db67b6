"""Hugging Face CLIP / SigLIP interop: converted weights give transformers' own embeddings, both
ways, and bad folders are refused naming the file and the field.

Tiny transformers models are built from small configs (no download), every parameter randomised
(transformers initialises biases to 0 and norms to 1, which would hide a swapped tensor), saved
with `save_pretrained`, and converted through the real CLI.

Tolerances. In float64 both implementations compute the same sums in different orders: each
rounding is ~1e-16 relative, the embeddings are unit vectors, and no sum here has more than a few
hundred terms, so they agree to ~1e-14; FP64_ATOL = 1e-10 leaves four orders of magnitude on any
CPU. In float32 the same argument gives ~1e-6 (rounding ~6e-8 relative, amplified by the two
layers' norms and softmaxes); FP32_ATOL = 1e-4 is the interop contract of DESIGN.md section 5.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mmtrain.cli import main
from mmtrain.models.build import create_model, load_model, save_model
from mmtrain.models.formats.hf_clip import read_hf_folder
from mmtrain.models.formats.hf_common import HFFolderError, is_hf_folder
from mmtrain.models.multimodal import MultimodalModel

FP64_ATOL = 1e-10
FP32_ATOL = 1e-4

VOCAB, CONTEXT = 64, 12
BOS = VOCAB - 2
# Widths differ between the towers and from the projection, and the MLPs are not 4x wide, so a
# swapped or mis-split tensor cannot have the right shape by accident.
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=3,
    max_position_embeddings=CONTEXT,
)
VISION = dict(
    hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4, patch_size=8
)
CLIP_IMAGE, SIGLIP_IMAGE = 32, 36  # 36 px at patch 8: both drop the ragged border the same way

# CLIP's end-of-text rules: "legacy" configs say eos_token_id 2 and HF pools at the largest id
# (OpenAI's tokenizer: end-of-text is the last id, and it pads with it); otherwise HF pools at the
# first eos_token_id. EOS 3 is no largest id and pads too, so any other rule picks a wrong token.
CLIP_EOS = {"legacy": dict(config=2, token=VOCAB - 1), "eos": dict(config=3, token=3)}
SIGLIP_EOS = 1  # SigLIP's tokenizer ends with </s> (id 1) and pads with it


def convert(*args) -> int:
    """`mmtrain convert ARGS...` through the real CLI; returns its exit code."""
    return main(["convert", *map(str, args)])


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=g)
        if param.dim() >= 2:
            param.copy_(noise / math.sqrt(param[0].numel()))  # fan-in scaled, as trained weights
        elif "norm" in name and name.endswith("weight"):
            param.copy_(1 + 0.1 * noise)
        else:
            param.copy_(0.1 * noise)


def hf_clip(rule: str = "legacy", act: str = "quick_gelu") -> transformers.CLIPModel:
    text = dict(TEXT, hidden_act=act, eos_token_id=CLIP_EOS[rule]["config"], bos_token_id=BOS)
    text["pad_token_id"] = CLIP_EOS[rule]["token"]
    vision = dict(VISION, hidden_act=act, image_size=CLIP_IMAGE)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel(config)


def hf_siglip() -> transformers.SiglipModel:
    # SigLIP's text head maps onto the vision width (32), from a narrower text tower (24).
    text = dict(TEXT, projection_size=32, eos_token_id=SIGLIP_EOS, pad_token_id=SIGLIP_EOS)
    text["bos_token_id"] = BOS
    vision = dict(VISION, image_size=SIGLIP_IMAGE)
    return transformers.SiglipModel(
        transformers.SiglipConfig(text_config=text, vision_config=vision)
    )


def hf_vision(name: str) -> transformers.PreTrainedModel:
    if name == "SiglipVisionModel":
        return transformers.SiglipVisionModel(
            transformers.SiglipVisionConfig(**VISION, image_size=SIGLIP_IMAGE)
        )
    config = transformers.CLIPVisionConfig(**VISION, image_size=CLIP_IMAGE, projection_dim=16)
    return getattr(transformers, name)(config)


def saved(model: transformers.PreTrainedModel, folder, seed: int = 0, **kwargs):
    randomize(model, seed)
    model.eval().save_pretrained(folder, **kwargs)
    return model


# ----------------------------------------------------------------------------- inputs
def pixels(size: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(seed))


def clip_text(rule: str, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) as CLIP's tokenizer pads a batch (`padding=True`): BOS, words, EOS,
    then padding to the longest row; the longest fills the context."""
    g = torch.Generator().manual_seed(seed)
    eos = CLIP_EOS[rule]["token"]
    lengths = [1, 4, CONTEXT - 2]
    ids = torch.full((len(lengths), CONTEXT), eos)
    mask = torch.zeros(len(lengths), CONTEXT, dtype=torch.long)
    for row, n in enumerate(lengths):
        words = torch.randint(4, BOS, (n,), generator=g)  # no special id among the words
        ids[row, : n + 2] = torch.cat([torch.tensor([BOS]), words, torch.tensor([eos])])
        mask[row, : n + 2] = 1
    return ids, mask


def siglip_text(seed: int = 3) -> torch.Tensor:
    """Ids as SigLIP's processor makes them (`padding="max_length"`): words, </s>, padding with
    </s> to the full context; the last row is truncated and has no </s>."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((3, CONTEXT), SIGLIP_EOS)
    for row, n in enumerate([2, 7]):
        ids[row, :n] = torch.randint(2, VOCAB, (n,), generator=g)
    ids[2] = torch.randint(2, VOCAB, (CONTEXT,), generator=g)
    return ids


# ----------------------------------------------------------------------------- references
def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


def pooled(output) -> torch.Tensor:
    # transformers 5 returns a model output with the features as pooler_output; 4 a tensor
    return output if isinstance(output, torch.Tensor) else output.pooler_output


@torch.no_grad()
def hf_embeddings(model, batch: dict) -> dict[str, torch.Tensor]:
    """transformers' own embeddings (L2-normalised) of the batch's image and text."""
    out = {}
    if isinstance(model, transformers.CLIPVisionModelWithProjection):
        out["image"] = model(pixel_values=batch["image"]).image_embeds
    elif isinstance(model, transformers.CLIPVisionModel | transformers.SiglipVisionModel):
        out["image"] = model(pixel_values=batch["image"]).pooler_output
    else:
        out["image"] = pooled(model.get_image_features(pixel_values=batch["image"]))
        mask = batch.get("attention_mask")
        out["text"] = pooled(model.get_text_features(input_ids=batch["text"], attention_mask=mask))
    return {k: unit(v) for k, v in out.items()}


@torch.no_grad()
def assert_same_embeddings(ours, theirs, batch: dict, atol: float) -> None:
    expected = hf_embeddings(theirs, batch)
    got = ours.eval().encode({k: batch[k] for k in expected})
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=atol, rtol=0)


def in_dtype(batch: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def clip_batch(rule: str) -> dict:
    ids, mask = clip_text(rule)
    return {"image": pixels(CLIP_IMAGE), "text": ids, "attention_mask": mask}


def assert_exports_back(folder, hf_model, tmp_path, batch: dict) -> None:
    """`convert --to hf` of `folder` loads in transformers with no missing, unexpected or
    mis-shaped key, holds exactly the original tensors and computes exactly its outputs; and
    it reads back into the same spec and tensors (a bare vision model is written in the
    `vision_model.` layout of transformers 4, which transformers 5 saves without)."""
    back = tmp_path / "back"
    assert convert("--to", "hf", folder, "--out", back) == 0
    ours = load_model(folder)
    spec, state = read_hf_folder(back)
    assert spec.towers == ours.spec.towers and spec.embed_dim == ours.spec.embed_dim
    assert state.keys() == ours.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in ours.state_dict().items())
    cls = type(hf_model)
    reloaded, info = cls.from_pretrained(back, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], (kind, info[kind])
    original = hf_model.float().state_dict()
    assert reloaded.state_dict().keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(reloaded.state_dict()[key], value), key
    expected, got = hf_embeddings(hf_model, batch), hf_embeddings(reloaded.eval(), batch)
    for name in expected:  # same weights: a config difference (eps, act, eos) would show here
        assert torch.equal(got[name], expected[name]), name


# ----------------------------------------------------------------------------- both towers
@pytest.mark.parametrize("rule, act", [("legacy", "quick_gelu"), ("eos", "gelu")])
def test_clip_from_hf_gives_transformers_embeddings_and_exports_back(tmp_path, rule, act):
    hf = saved(hf_clip(rule, act), tmp_path / "hf")
    folder = tmp_path / "ours"
    assert convert("--from", "hf", tmp_path / "hf", "--out", folder) == 0
    batch = clip_batch(rule)
    assert_same_embeddings(load_model(folder), hf, batch, FP32_ATOL)
    assert_same_embeddings(
        load_model(folder, dtype=torch.float64),
        hf.double(),
        in_dtype(batch, torch.float64),
        FP64_ATOL,
    )
    assert_exports_back(folder, hf, tmp_path, batch)


def test_siglip_from_hf_gives_transformers_embeddings_and_exports_back(tmp_path):
    hf = saved(hf_siglip(), tmp_path / "hf")
    folder = tmp_path / "ours"
    assert convert("--from", "hf", tmp_path / "hf", "--out", folder) == 0
    model = load_model(folder)
    spec = model.spec
    assert spec.objective == "siglip" and not spec.towers["image"].has_pre_norm()
    assert model.logit_bias.shape == () and model.logit_bias.item() == hf.logit_bias.item()
    batch = {"image": pixels(SIGLIP_IMAGE), "text": siglip_text()}
    assert_same_embeddings(model, hf, batch, FP32_ATOL)
    assert_same_embeddings(
        load_model(folder, dtype=torch.float64),
        hf.double(),
        in_dtype(batch, torch.float64),
        FP64_ATOL,
    )
    assert_exports_back(folder, hf, tmp_path, batch)


def test_reference_comparison_is_sensitive_to_the_weights(tmp_path):
    # Guards the tests above against a comparison that cannot fail.
    hf = saved(hf_siglip(), tmp_path / "hf")
    spec, state = read_hf_folder(tmp_path / "hf")
    state["towers.image.pool.attn.kv.bias"][-1] += 0.5  # the value half of SigLIP's in_proj
    state["towers.text.blocks.1.attn.qkv.bias"][0] += 0.5
    model = MultimodalModel(spec)
    model.load_state_dict(state, strict=True)
    batch = {"image": pixels(SIGLIP_IMAGE), "text": siglip_text()}
    expected, got = hf_embeddings(hf, batch), model.eval().encode(batch)
    for name in ("image", "text"):
        assert (got[name] - expected[name]).abs().max() > 1e-3, name


# ----------------------------------------------------------------------------- vision alone
@pytest.mark.parametrize(
    "name", ["CLIPVisionModel", "CLIPVisionModelWithProjection", "SiglipVisionModel"]
)
def test_vision_model_from_hf_and_back(tmp_path, name):
    hf = saved(hf_vision(name), tmp_path / "hf")
    folder = tmp_path / "ours"
    assert convert("--from", "hf", tmp_path / "hf", "--out", folder) == 0
    model = load_model(folder)
    assert list(model.spec.towers) == ["image"] and not model.spec.pairs
    assert model.spec.params() == sum(p.numel() for p in model.parameters())
    size = SIGLIP_IMAGE if name.startswith("Siglip") else CLIP_IMAGE
    batch = {"image": pixels(size).double()}
    assert_same_embeddings(model.double(), hf.double(), batch, FP64_ATOL)
    assert_exports_back(folder, hf, tmp_path, {"image": pixels(size)})


# ----------------------------------------------------------------------------- files
def test_sharded_safetensors_folder(tmp_path):
    hf = saved(hf_clip("eos"), tmp_path / "hf", max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "hf" / "model.safetensors").exists()
    spec, state = read_hf_folder(tmp_path / "hf")
    model = MultimodalModel(spec)
    model.load_state_dict(state, strict=True)
    assert_same_embeddings(model, hf, clip_batch("eos"), FP32_ATOL)


def without_defaults(config: dict, defaults: dict) -> dict:
    missing = object()
    return {k: v for k, v in config.items() if k == "model_type" or v != defaults.get(k, missing)}


def test_config_without_default_values_reads_the_same(tmp_path):
    # transformers 4 wrote only the values that differ from its config classes' defaults, and
    # older configs keep the text tower's values in `text_config_dict`, which wins.
    saved(hf_clip("legacy"), tmp_path / "hf")
    full, state = read_hf_folder(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    text = without_defaults(config.pop("text_config"), transformers.CLIPTextConfig().to_dict())
    vision = without_defaults(
        config.pop("vision_config"), transformers.CLIPVisionConfig().to_dict()
    )
    top = without_defaults(config, transformers.CLIPConfig().to_dict())
    assert "hidden_act" not in text and "hidden_act" not in vision  # quick_gelu is the default
    assert "logit_scale_init_value" not in top
    stripped = {**top, "text_config": {"vocab_size": 7}, "text_config_dict": text}
    path.write_text(json.dumps({**stripped, "vision_config": vision}))
    spec, state_again = read_hf_folder(tmp_path / "hf")
    assert spec == full and state_again.keys() == state.keys()
    # transformers reads the stripped config.json as the same model
    hf = transformers.CLIPModel.from_pretrained(tmp_path / "hf")
    model = MultimodalModel(spec)
    model.load_state_dict(state_again, strict=True)
    assert_same_embeddings(model, hf, clip_batch("legacy"), FP32_ATOL)


def test_read_hf_folder_is_ready_for_load_state_dict(tmp_path):
    saved(hf_clip("eos"), tmp_path / "hf")
    assert is_hf_folder(tmp_path / "hf")
    spec, state = read_hf_folder(tmp_path / "hf")
    assert spec.towers["text"].stem.eot_token == 3 and spec.embed_dim == 16
    model = MultimodalModel(spec)
    model.load_state_dict(state, strict=True)
    assert spec.params() == sum(p.numel() for p in model.parameters())
    save_model(model, tmp_path / "ours")
    assert not is_hf_folder(tmp_path / "ours")


# ----------------------------------------------------------------------------- bad input
def test_unsupported_architecture_is_refused_naming_file_and_field(tmp_path, capsys):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    save_file({"x": torch.zeros(1)}, folder / "model.safetensors")
    assert convert("--from", "hf", folder, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert str(folder / "config.json") in err and "architectures" in err and "BertModel" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "siglip"}, "model_type"),
        ({"text_config": {"hidden_act": "relu"}}, "text_config.hidden_act"),
        ({"vision_config": {"image_size": [32, 48]}}, "vision_config.image_size"),
        ({"text_config": {"eos_token_id": 999}}, "text_config.eos_token_id"),
        ({"vision_config": {"vision_use_head": False}}, "vision_config.vision_use_head"),
        ({"text_config": {"projection_size": 24}}, "text_config.projection_size"),
    ],
)
def test_bad_config_fields_are_named(tmp_path, capsys, change, field):
    siglip = "vision_use_head" in str(change) or "projection_size" in str(change)
    saved(hf_siglip() if siglip else hf_clip(), tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    path.write_text(json.dumps(config))
    with pytest.raises(HFFolderError, match=f"config.json: {field}"):
        read_hf_folder(tmp_path / "hf")
    assert convert("--from", "hf", tmp_path / "hf", "--out", tmp_path / "out") == 2
    assert field in capsys.readouterr().err


def test_weights_that_do_not_fit_the_config_are_listed(tmp_path, capsys):
    saved(hf_clip(), tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    state = load_file(path)
    del state["text_model.final_layer_norm.bias"]
    state["vision_model.extra"] = torch.zeros(2)
    save_file(state, path, metadata={"format": "pt"})
    assert convert("--from", "hf", tmp_path / "hf", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "text_model.final_layer_norm.bias" in err and "vision_model.extra" in err


def test_pickled_weights_are_not_read(tmp_path, capsys):
    saved(hf_clip(), tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "pytorch_model.bin")
    assert convert("--from", "hf", tmp_path / "hf", "--out", tmp_path / "out") == 2
    assert "pytorch_model.bin is not read" in capsys.readouterr().err


def test_export_of_a_model_without_hf_counterpart_names_the_fields(tmp_path, capsys):
    save_model(create_model("tiny-clip"), tmp_path / "tiny")  # eot = last non-padding token
    assert convert("--to", "hf", tmp_path / "tiny", "--out", tmp_path / "out") == 2
    assert "towers.text.stem.eot_token" in capsys.readouterr().err
    save_model(create_model("tiny-multimodal"), tmp_path / "multi")
    assert convert("--to", "hf", tmp_path / "multi", "--out", tmp_path / "out") == 2
    assert "one image tower" in capsys.readouterr().err
    assert convert("--from", "hf", tmp_path / "multi", "--model", "ViT-B-32", "--out", "x") == 2
    assert "--model is for openclip" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
