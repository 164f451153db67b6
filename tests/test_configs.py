"""Every recipe in configs/ loads, validates and names a model that builds its spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmtrain.config import load_config
from mmtrain.spec import load_spec

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
EXPECTED = {
    "tiny-clip",
    "clip-vit-b-16",
    "siglip-vit-b-16",
    "audio-text",
    "video-text",
    "finetune-clip",
    "vlm-stage1",
    "vlm-stage2",
    "llava-1.5-7b",
    "qwen2.5-vl-7b-docs",
    "qwen2.5-vl-7b-docs-lora",
}
# their comments launch 8 ranks
MULTI_GPU = {
    "siglip-vit-b-16": 8,
    "video-text": 8,
    "vlm-stage1": 8,
    "vlm-stage2": 8,
    "llava-1.5-7b": 8,
    "qwen2.5-vl-7b-docs": 8,
    "qwen2.5-vl-7b-docs-lora": 2,
}


def test_the_recipes_of_the_issue_are_there():
    assert EXPECTED | {"fusion-4modal"} <= {path.stem for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipe_loads_and_validates(path):
    config = load_config(path)
    spec = load_spec(config.model)  # a preset or configs/specs/*.yaml, resolved next to the file
    assert set(config.train.towers) <= set(spec.tower_names()), "train.towers names unknown towers"
    config.validate(world_size=MULTI_GPU.get(path.stem, 1))  # the batch splits evenly
    assert path.read_text().startswith("#"), "a recipe opens with what it is for and its data"


def test_fusion_recipe_fuses_four_modalities_into_a_classifier():
    spec = load_spec(load_config(CONFIGS[0].parent / "fusion-4modal.yaml").model)
    assert {t.modality for t in spec.towers.values()} == {"image", "audio", "timeseries", "text"}
    assert spec.fusion is not None and spec.fusion.task == "classify"
