"""The Qwen2.5-VL presets are the published models: their parameters are what transformers builds
from the published config.json values (on the meta device, nothing downloaded), tower by tower.

The values below are the Hugging Face folders' config.json (Qwen/Qwen2.5-VL-3B-Instruct,
-7B-, -32B-, -72B-Instruct; the 32B and 72B vision MLP of 3456 as in
Qwen/Qwen2.5-VL-72B-Instruct-AWQ's config.json, whose vision tower is not quantized, and in
pytorch/torchtune's qwen2_5_vl_32b / qwen2_5_vl_72b builders; 3420 for the 3B and 7B).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from mmtrain.plan.workloads import load_model
from mmtrain.spec import load_spec

VISION = dict(depth=32, hidden_size=1280, hidden_act="silu", num_heads=16, in_channels=3,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
              fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)  # fmt: skip
TEXT = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=128000)
PUBLISHED = {  # name: (text_config, vision intermediate_size, the model page's rounded count)
    "Qwen2.5-VL-3B": (dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                           num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                           tie_word_embeddings=True), 3420, None),
    "Qwen2.5-VL-7B": (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                           num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                           tie_word_embeddings=False), 3420, None),
    "Qwen2.5-VL-32B": (dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                            num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                            tie_word_embeddings=False), 3456, None),
    "Qwen2.5-VL-72B": (dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                            num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                            tie_word_embeddings=False), 3456, 73.4e9),
}  # fmt: skip


def _built(name: str) -> torch.nn.Module:
    text, mlp, _ = PUBLISHED[name]
    vision = {**VISION, "intermediate_size": mlp, "out_hidden_size": text["hidden_size"]}
    config = transformers.Qwen2_5_VLConfig(text_config={**TEXT, **text}, vision_config=vision)
    with torch.device("meta"):
        return transformers.Qwen2_5_VLForConditionalGeneration(config)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameters_are_what_transformers_builds_from_the_published_config(name):
    model = _built(name)
    spec = load_spec(name)
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.model.visual.parameters())
    assert spec.params() == total
    assert spec.vision.params() == vision  # the tower and its merger
    assert spec.decoder.params() == total - vision  # the LM, head included
    rounded = PUBLISHED[name][2]
    if rounded is not None:  # "73.4B params" on the model page, as issue 41 quotes it
        assert round(total / 1e8) * 1e8 == pytest.approx(rounded)


def test_presets_plan_their_published_shape():
    model = load_model("Qwen2.5-VL-72B", context=8192)
    text = model.stack("text")
    shape = (text.layers, text.width, text.heads, text.kv_heads, text.head_dim)
    assert shape == (80, 8192, 64, 8, 128)
    assert text.kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2  # 320 KiB a token in bf16
    assert model.params() == load_spec("Qwen2.5-VL-72B").params() == 73_410_777_344
