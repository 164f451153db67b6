"""The tiny hub folders of tests/hub_folders.py are real: transformers loads them offline, with
no missing or unexpected weight, its processor's inputs run through the model's own forward
(image tokens = image features, a finite loss), the image changes the logits, and the
huggingface_hub cache layout resolves by name."""

from __future__ import annotations

import huggingface_hub
import pytest
import torch
import transformers

import hub_folders
from hub_folders import FAMILIES

CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
           "internvl": "InternVLForConditionalGeneration",
           "gemma3": "Gemma3ForConditionalGeneration",
           "idefics3": "Idefics3ForConditionalGeneration"}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return {family: hub_folders.make_folder(family, root, seed=1) for family in FAMILIES}


def expected_image_tokens(family: str, inputs) -> int:
    """The image features the model makes from these pixels: 4 per 32 px tile (a 4x4 patch
    grid merged 2x2), Qwen3-VL's 8 px patch grid merged 2x2."""
    if family == "qwen3_vl":
        return int(inputs["image_grid_thw"].prod(-1).sum()) // 4
    tiles = inputs["pixel_values"].shape[0]
    if family == "idefics3":  # [batch, tiles, 3, H, W]; all-zero padding tiles are dropped
        tiles = int(inputs["pixel_values"].flatten(2).any(-1).sum())
    return 4 * tiles


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_loads_offline(folders, family):
    folder = folders[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    assert config.get_text_config().vocab_size == len(tokenizer)
    processor = hub_folders.load_processor(folder)
    assert type(processor).__name__ == config.architectures[0].replace(
        "ForConditionalGeneration", "Processor"
    )
    if type(processor).__mro__[1] is not transformers.ProcessorMixin:  # images-only: no torchvision
        with pytest.raises((ImportError, ValueError, AttributeError, OSError)):
            transformers.AutoProcessor.from_pretrained(folder, local_files_only=True)
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, local_files_only=True, output_loading_info=True)  # fmt: skip
    assert type(model).__name__ == CLASSES[family]
    assert not any(info.values()), info


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_on_processed_conversation(folders, family):
    folder = folders[family]
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True)
    conversation = [hub_folders.conversation(family)]
    first = hub_folders.processed(folder, [hub_folders.image(1)], conversation)
    second = hub_folders.processed(folder, [hub_folders.image(2)], conversation)
    image_token_id = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    assert int((first["input_ids"] == image_token_id).sum()) == expected_image_tokens(family, first)
    torch.testing.assert_close(first["input_ids"], second["input_ids"], rtol=0, atol=0)
    with torch.no_grad():
        out = model(**first, labels=first["input_ids"])
        other = model(**second).logits
    assert torch.isfinite(out.loss)
    # float32 rounding of a 2-layer forward is a few hundred eps of the logits' scale
    rounding = 1e3 * torch.finfo(torch.float32).eps * out.logits.abs().max()
    assert (out.logits - other).abs().max() > rounding


def test_hub_cache_resolves_by_name(folders, tmp_path):
    folder = folders["qwen3_vl"]
    cache = tmp_path / "cache"
    snapshot = hub_folders.hub_cache(folder, "tiny-org/tiny-qwen3-vl", cache)
    found = huggingface_hub.snapshot_download(
        "tiny-org/tiny-qwen3-vl", cache_dir=cache, local_files_only=True)  # fmt: skip
    assert found == str(snapshot)
    names = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in snapshot.iterdir()) == names
    for name in names:
        assert (snapshot / name).is_symlink()
        assert (snapshot / name).read_bytes() == (folder / name).read_bytes()
    repo = cache / "models--tiny-org--tiny-qwen3-vl"
    assert (repo / "refs" / "main").read_text() == snapshot.name
    config = transformers.AutoConfig.from_pretrained(
        "tiny-org/tiny-qwen3-vl", cache_dir=cache, local_files_only=True)  # fmt: skip
    own = transformers.AutoConfig.from_pretrained(folder, local_files_only=True).to_dict()
    assert config.to_dict() == dict(own, _name_or_path="tiny-org/tiny-qwen3-vl")
