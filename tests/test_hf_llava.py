"""Hugging Face LLaVA interop (models/formats/hf_llava.py) and the HF dispatch (formats/hf.py):
a converted LlavaForConditionalGeneration gives transformers' own logits, row for row; the export
loads back into transformers with no missing or unexpected key; bad configs name their field.

Tiny transformers models are built from configs (no download), every parameter randomised
(`randomize` from test_decoder.py: norms away from 1, biases away from 0, which would hide a
swapped tensor), saved with `save_pretrained` and read by our code.

Row for row. HF's input holds each image's placeholder `image_seq_length` (P) times, ours once.
Our row t is the id's LAST position among HF's: for a text id its own row, for a placeholder
the row of the image's last token.

Tolerances are test_decoder.py's: FP32_ATOL 1e-4 is the interop contract of DESIGN.md section 5;
in float64 both sides compute the same sums in different orders (~1e-16 relative each, a few
hundred O(1) terms), so FP64_ATOL 1e-10 leaves three orders of magnitude. transformers' RMSNorm
casts a float64 input down to float32; `rms_norm_in_input_precision` (test_decoder.py) makes it
normalise in the input's precision for the float64 comparison only.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping

import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from mmtrain.cli import main
from mmtrain.folders import INDEX_FILE, WEIGHTS_FILE
from mmtrain.models import load_model, save_model
from mmtrain.models.build import read_model_folder
from mmtrain.models.formats.hf import read_hf_model, write_hf_state
from mmtrain.models.formats.hf_common import HFFolderError
from mmtrain.models.formats.hf_llava import read_hf_llava
from mmtrain.spec import ModelSpec
from test_decoder import randomize, rms_norm_in_input_precision

FP64_ATOL = 1e-10
FP32_ATOL = 1e-4

VOCAB, IMAGE_ID = 64, 63
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
CLIP_VISION = dict(
    model_type="clip_vision_model",
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=16,
    patch_size=8,
)
SIGLIP_VISION = {**CLIP_VISION, "model_type": "siglip_vision_model"}
CASES = {
    # LLaVA-1.5's choices: CLIP tower, class token dropped, the block before the last
    "clip-llama-default": (CLIP_VISION, "llama", dict(vision_feature_layer=-2)),
    # a Qwen2 LM with a tied head, the class token kept, a feature layer counted from 0
    "clip-qwen2-full-tied": (
        CLIP_VISION,
        "qwen2",
        dict(
            vision_feature_layer=1,
            vision_feature_select_strategy="full",
            tie_word_embeddings=True,
        ),
    ),
    # a SigLIP tower (no class token, a MAP head LLaVA never runs), the last block
    "siglip-llama-full": (
        SIGLIP_VISION,
        "llama",
        dict(vision_feature_layer=-1, vision_feature_select_strategy="full"),
    ),
    # LLaVA-OneVision's layout: a SigLIP tower without its head, the block before the last
    "siglip-headless-qwen2": (
        {**SIGLIP_VISION, "vision_use_head": False},
        "qwen2",
        dict(vision_feature_layer=-2, vision_feature_select_strategy="full"),
    ),
}


# ----------------------------------------------------------------------------- helpers
def image_tokens(case: str) -> int:
    vision, _, top = CASES[case]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    keeps_cls = vision is CLIP_VISION and top.get("vision_feature_select_strategy") == "full"
    return patches + int(keeps_cls)


def llava(
    case: str, seed: int = 0, image_id: int = IMAGE_ID, **text_changes
) -> transformers.LlavaForConditionalGeneration:
    vision, family, top = CASES[case]
    text = {**TEXT, "model_type": family, **text_changes}
    if top.get("tie_word_embeddings"):
        text["tie_word_embeddings"] = True
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        image_seq_length=image_tokens(case),
        **top,
    )
    config._attn_implementation = "sdpa"
    model = transformers.LlavaForConditionalGeneration(config)
    randomize(model, seed)
    return model.eval()


# Two rows with two images each (HF runs them as one batch: equal expanded lengths).
IDS = torch.tensor([[5, IMAGE_ID, 6, 7, IMAGE_ID, 8], [IMAGE_ID, 9, 10, IMAGE_ID, 11, 12]])


def hf_inputs(ids: torch.Tensor, p: int) -> tuple[torch.Tensor, list[list[int]]]:
    """HF's ids (each placeholder P times) and, per row, the HF row of each of our ids."""
    rows, where = [], []
    for row in ids.tolist():
        expanded, last = [], []
        for token in row:
            expanded += [token] * (p if token == IMAGE_ID else 1)
            last.append(len(expanded) - 1)
        rows.append(expanded)
        where.append(last)
    return torch.tensor(rows), where


def images(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 3, 16, 16, generator=g).to(dtype)


@torch.no_grad()
def hf_rows(model, case: str, pixels: torch.Tensor) -> torch.Tensor:
    """transformers' logits at the rows that correspond to ours."""
    ids, where = hf_inputs(IDS, image_tokens(case))
    logits = model(input_ids=ids, pixel_values=pixels).logits
    return torch.stack([logits[r, where[r]] for r in range(len(where))])


@torch.no_grad()
def our_logits(model, pixels: torch.Tensor) -> torch.Tensor:
    return model.logits({"text": IDS, "image": pixels})


@pytest.fixture
def float64_reference(monkeypatch):
    def enable():
        for cls in (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm):
            monkeypatch.setattr(cls, "forward", rms_norm_in_input_precision)

    return enable


def assert_loads_back(cls, folder, original) -> None:
    """transformers loads `folder` with no missing or unexpected key, each tensor bitwise."""
    reloaded, info = cls.from_pretrained(folder, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info[kind], (kind, info[kind])
    expected, got = original.state_dict(), reloaded.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


# ----------------------------------------------------------------------------- LLaVA parity
@pytest.mark.parametrize("case", list(CASES))
def test_llava_logits_equal_transformers_row_for_row(tmp_path, case, float64_reference):
    hf = llava(case)
    sharded = case == "clip-llama-default"
    hf.save_pretrained(tmp_path / "hf", **({"max_shard_size": "20KB"} if sharded else {}))
    if sharded:
        assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
        assert not (tmp_path / "hf" / "model.safetensors").exists()
    assert (
        main(["convert", "--from", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mm")]) == 0
    )
    ours = load_model(tmp_path / "mm").eval()
    spec = ours.spec
    assert spec.image_tokens() == image_tokens(case)
    assert spec.projector.image_token_id == IMAGE_ID
    assert spec.params() == sum(p.numel() for p in hf.parameters())
    pixels = images(4, torch.float32)

    # float32, transformers as shipped
    expected = hf_rows(hf, case, pixels)
    torch.testing.assert_close(our_logits(ours, pixels), expected, atol=FP32_ATOL, rtol=0)

    # export: transformers loads it with no missing or unexpected key and computes the same
    argv = ["convert", "--to", "hf", str(tmp_path / "mm"), "--out", str(tmp_path / "back")]
    assert main(argv) == 0
    assert_loads_back(type(hf), tmp_path / "back", hf)
    spec_again, state_again = read_hf_llava(tmp_path / "back")
    assert spec_again.to_dict() == {**spec.to_dict(), "name": spec_again.name}
    assert all(torch.equal(state_again[k], v) for k, v in ours.state_dict().items())

    # float64: equal up to rounding
    float64_reference()
    expected = hf_rows(hf.double(), case, images(4, torch.float64))
    diff = (our_logits(ours.double(), images(4, torch.float64)) - expected).abs().max().item()
    assert diff < FP64_ATOL, diff


def test_parity_is_sensitive_to_the_image_path(tmp_path, float64_reference):
    # Guards the row-for-row comparison against one that cannot fail: the image tokens move
    # every later row, so a wrong feature layer or a swapped projector shows.
    hf = llava("clip-llama-default").double()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model_from_hf(tmp_path / "hf").double().eval()
    float64_reference()
    pixels = images(4, torch.float64)
    expected = hf_rows(hf, "clip-llama-default", pixels)
    assert (our_logits(ours, pixels) - expected).abs().max() < FP64_ATOL
    with torch.no_grad():
        ours.projector.fc2.bias[0] += 0.5
    assert (our_logits(ours, pixels) - expected).abs().max() > 1e-3


def load_model_from_hf(folder):
    from mmtrain.models.build import model_with_weights

    return model_with_weights(*read_hf_model(folder))


# ----------------------------------------------------------------------------- LM folders
LM_CASES = {
    "llama-sharded": ("llama", dict(), True),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True), False),
}
LM_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
}


def hf_lm(case: str, seed: int = 0, **text_changes):
    family, changes, _ = LM_CASES[case]
    config_cls, model_cls = LM_CLASSES[family]
    config = config_cls(**{**TEXT, **changes, **text_changes}, attn_implementation="sdpa")
    model = model_cls(config)
    randomize(model, seed)
    return model.eval()


@pytest.mark.parametrize("case", list(LM_CASES))
def test_language_model_folders_convert_both_ways(tmp_path, case, float64_reference):
    hf = hf_lm(case)
    sharded = LM_CASES[case][2]
    hf.save_pretrained(tmp_path / "hf", **({"max_shard_size": "20KB"} if sharded else {}))
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == sharded
    assert (
        main(["convert", "--from", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mm")]) == 0
    )
    ours = load_model(tmp_path / "mm").eval()
    assert ours.spec.is_language_model() and ours.spec.towers == {}
    assert all(key.startswith("towers.text.") for key in ours.state_dict())
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours.logits({"text": ids})
    torch.testing.assert_close(got, expected, atol=FP32_ATOL, rtol=0)

    argv = ["convert", "--to", "hf", str(tmp_path / "mm"), "--out", str(tmp_path / "back")]
    assert main(argv) == 0
    assert_loads_back(type(hf), tmp_path / "back", hf)

    float64_reference()
    with torch.no_grad():
        expected = hf.double()(input_ids=ids).logits
        got = ours.double().logits({"text": ids})
    assert (got - expected).abs().max().item() < FP64_ATOL


class RecordingReader(Mapping):
    """A lazy reader that records which tensors were read, and how many of the tensors it had
    handed out still had their memory alive (a view keeps it) when the next was asked for."""

    def __init__(self, reader):
        self.reader, self.reads, self.handed, self.most_alive = reader, [], [], 0

    def __getitem__(self, name):
        alive = sum(ref() is not None for ref in self.handed)
        self.most_alive = max(self.most_alive, alive)
        tensor = self.reader[name]
        self.handed.append(weakref.ref(tensor.untyped_storage()))
        self.reads.append(name)
        return tensor

    def __iter__(self):
        return iter(self.reader)

    def __len__(self):
        return len(self.reader)

    def meta_state(self):
        return self.reader.meta_state()


@pytest.mark.parametrize("case", ["lm", "llava"])
def test_sharded_folders_export_one_tensor_at_a_time(tmp_path, case):
    # A model folder in shards (save_model past max_shard_bytes) is read back bitwise and
    # exported to HF shards reading each of its tensors once, none kept while the next is read
    # (a decoder's tensors each map to their own HF tensors); transformers loads the shards.
    hf = hf_lm("llama-sharded") if case == "lm" else llava("clip-llama-default")
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model_from_hf(tmp_path / "hf")
    save_model(ours, tmp_path / "mm", max_shard_bytes=10_000)
    index = json.loads((tmp_path / "mm" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "mm" / WEIGHTS_FILE).exists()
    for path in (tmp_path / "mm", tmp_path / "mm" / INDEX_FILE):
        again = load_model(path)
        assert all(torch.equal(again.state_dict()[k], v) for k, v in ours.state_dict().items())

    spec, reader = read_model_folder(tmp_path / "mm")
    recording = RecordingReader(reader)
    write_hf_state(spec, recording, tmp_path / "back", max_shard_bytes=10_000)
    assert sorted(recording.reads) == sorted(ours.state_dict())
    assert len(recording.reads) == len(set(recording.reads))
    # LLaVA's CLIP tower: q/k/v come from one tensor too, so nothing is held across reads
    assert recording.most_alive == 0
    assert (tmp_path / "back" / INDEX_FILE).exists()
    assert not (tmp_path / "back" / WEIGHTS_FILE).exists()
    assert_loads_back(type(hf), tmp_path / "back", hf)


def test_convert_names_an_unsupported_architecture(tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    assert main(["convert", "--from", "hf", str(folder), "--out", str(tmp_path / "mm")]) == 2
    err = capsys.readouterr().err
    assert "config.json: architectures" in err and "LlavaForConditionalGeneration" in err
    assert not (tmp_path / "mm").exists()


def test_a_clip_folder_still_converts(tmp_path):
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                     "num_hidden_layers": 1, "num_attention_heads": 2,
                     "max_position_embeddings": 8, "eos_token_id": 63},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
        projection_dim=8,
    )  # fmt: skip
    transformers.CLIPModel(config).save_pretrained(tmp_path / "hf")
    assert (
        main(["convert", "--from", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mm")]) == 0
    )
    assert not load_model(tmp_path / "mm").spec.is_language_model()


# ----------------------------------------------------------------------------- bad configs
def llava_config(**changes) -> dict:
    config = llava("clip-llama-default").config.to_dict()
    for key, value in changes.items():
        section, _, field = key.rpartition(".")
        (config[section] if section else config)[field] = value
    return config


@pytest.mark.parametrize(
    "change, field, words",
    [
        ({"projector_hidden_act": "silu"}, "projector_hidden_act", "gelu"),
        ({"multimodal_projector_bias": False}, "multimodal_projector_bias", "biases"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy", "full"),
        ({"vision_feature_layer": [-2, -1]}, "vision_feature_layer", "a list of layers"),
        ({"vision_feature_layer": 7}, "vision_feature_layer", "outside"),
        ({"image_seq_length": 5}, "image_seq_length", "4 tokens"),
        ({"image_token_index": 64}, "image_token_index", "vocabulary"),
        ({"text_config.hidden_act": "gelu"}, "text_config.hidden_act", "silu"),
        ({"vision_config.model_type": "dinov2"}, "vision_config.model_type", "not supported"),
        (
            {"vision_config.model_type": "siglip_vision_model"},
            "vision_feature_select_strategy",
            "no class token",
        ),
    ],
)
def test_unsupported_llava_configs_name_file_and_field(tmp_path, change, field, words):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llava_config(**change)))
    with pytest.raises(HFFolderError, match=f"config.json: {field}: .*{words}"):
        read_hf_llava(folder)


def test_weights_that_do_not_fit_name_the_folder(tmp_path):
    hf = llava("clip-llama-default")
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["text_config"]["intermediate_size"] = 20  # the weights say 24
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        HFFolderError, match=r"mlp\.gate_proj\.weight is \[24, 32\], expected \[20, 32\]"
    ):
        read_hf_llava(tmp_path / "hf")


def test_image_token_id_is_read_under_either_name(tmp_path):
    from mmtrain.models.formats.hf_llava import spec_from_config

    config = llava_config()
    del config["image_token_index"]
    file = tmp_path / "config.json"
    assert (
        spec_from_config({**config, "image_token_id": 62}, file, "x").projector.image_token_id == 62
    )
    with pytest.raises(HFFolderError, match="config.json: image_token_id: 62 differs from"):
        spec_from_config({**config, "image_token_id": 62, "image_token_index": 61}, file, "x")


def test_export_refuses_what_llava_cannot_hold(tmp_path, capsys):
    from mmtrain.models import create_model

    spec, _ = read_hf_llava_folder(tmp_path)
    linear = spec.to_dict()
    linear["projector"]["kind"] = "linear"
    linear["towers"]["image"]["pooling"] = "mean"
    save_model(create_model(ModelSpec.from_dict(linear)), tmp_path / "mm")
    assert main(["convert", "--to", "hf", str(tmp_path / "mm"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "projector.kind: LLaVA needs mlp" in err and "towers.image.pooling" in err
    assert not (tmp_path / "o").exists()


def read_hf_llava_folder(tmp_path):
    llava("clip-llama-default").save_pretrained(tmp_path / "hf")
    return read_hf_llava(tmp_path / "hf")
