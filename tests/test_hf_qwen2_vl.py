"""Qwen2-VL / Qwen2.5-VL folders <-> mmtrain's native-resolution VLM: a model transformers
builds from a tiny config (random weights, saved by transformers) is read by mmtrain and gives
transformers' logits (float64, to rounding) for images of aspect 1:1, 1:4 and 3:1, several
images in one row, a short clip and text-only rows; written back, the folder loads into
transformers with no missing or unexpected key and gives the same logits."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mmtrain.models.build import create_model, model_with_weights
from mmtrain.models.decoder import next_positions
from mmtrain.models.formats.hf_qwen2_vl import (
    read_hf_qwen2_vl,
    spec_from_config,
    write_hf_qwen2_vl,
)
from mmtrain.models.splice import make_layout
from mmtrain.models.visual_inputs import splice_visual_inputs
from mmtrain.spec import ModelSpec
from test_decoder import randomize, rms_norm_in_input_precision

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl  # noqa: E402

IMAGE, VIDEO, START, END = 150, 151, 152, 153
TEXT = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=1e6,
            bos_token_id=1, eos_token_id=2)  # fmt: skip
VISION = {
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                     patch_size=4, spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                       num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=16, fullatt_block_indexes=[1], tokens_per_second=2),
}  # fmt: skip
CLASSES = {
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
}
# rows: text ids with one placeholder per input; inputs: (kind, frames, height, width)
CASES = {
    "square": ([[1, START, IMAGE, END, 7, 8]], [("image", 1, 16, 16)]),
    "tall": ([[1, START, IMAGE, END, 9]], [("image", 1, 32, 8)]),  # 1:4
    "wide": ([[START, IMAGE, END, 3, 4]], [("image", 1, 8, 24)]),  # 3:1
    "several": (
        [[1, START, IMAGE, END, 5, START, IMAGE, END, 6]],
        [("image", 1, 8, 24), ("image", 1, 16, 8)],
    ),  # fmt: skip
    "clip": ([[2, START, VIDEO, END, 5, 6, 7]], [("video", 4, 8, 32)]),
    # two images of their own sizes, then a 4-frame clip whose time positions (0 and 2 at
    # Qwen2.5-VL's 1 s a temporal patch x 2 tokens a second) pass its 2 x 2 merged grid, then
    # text: the text follows the clip as transformers' get_rope_index places it
    "images-then-clip": (
        [[1, START, IMAGE, END, 4, START, IMAGE, END, 5, START, VIDEO, END, 6, 7, 8]],
        [("image", 1, 8, 24), ("image", 1, 16, 8), ("video", 4, 16, 16)],
    ),
    "text": ([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], []),
}
FPS = 2.0  # the clip's frame rate: 1 s per temporal patch of 2 frames


def rotary_in_input_precision(q, k, cos, sin):
    """transformers' vision rotary, rotating in at least float32 instead of always in float32
    (which rounds float64 q and k to float32)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    cos, sin = cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)
    rotate = modeling_qwen2_vl.rotate_half
    q_embed = q.to(dtype) * cos + rotate(q.to(dtype)) * sin
    k_embed = k.to(dtype) * cos + rotate(k.to(dtype)) * sin
    return q_embed.to(q.dtype), k_embed.to(k.dtype)


@pytest.fixture(params=list(CLASSES))
def family(request, monkeypatch):
    # transformers rounds its RMSNorms and its vision rotary to float32: in float64 here, so
    # that the two models are equal up to float64 rounding
    for module in (modeling_qwen2_vl, modeling_qwen2_5_vl):
        for name in dir(module):
            if name.endswith("RMSNorm"):
                monkeypatch.setattr(getattr(module, name), "forward", rms_norm_in_input_precision)
        monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", rotary_in_input_precision)
    return request.param


def peer(family: str, seed: int = 0):
    config_cls, model_cls = CLASSES[family]
    config = config_cls(text_config=TEXT, vision_config=VISION[family], image_token_id=IMAGE,
                        video_token_id=VIDEO, vision_start_token_id=START,
                        vision_end_token_id=END, attn_implementation="sdpa")  # fmt: skip
    model = model_cls(config)
    with torch.no_grad():
        randomize(model, seed)
    return model.double().eval()


def inputs(case: str, seed: int = 1):
    rows, specs = CASES[case]
    g = torch.Generator().manual_seed(seed)
    images, videos = [], []
    for kind, frames, h, w in specs:
        shape = (3, h, w) if kind == "image" else (frames, 3, h, w)
        (images if kind == "image" else videos).append(torch.randn(shape, generator=g).double())
    return torch.tensor(rows), images, videos


def peer_logits(hf, ours, text, images, videos, family):
    """transformers' logits at the last position of each of our ids (their ids hold each
    input's tokens), from the same patches our tower makes (the processor's layout)."""
    tower = ours.towers["vision"]
    batch, kwargs = {"text": text, "image": images, "video": videos}, {}
    grids = {}
    for kind, items in (("image", images), ("video", videos)):
        if items:
            patches, grid = tower.patchify(items)
            kwargs[f"pixel_values{'_videos' if kind == 'video' else ''}"] = patches
            kwargs[f"{kind}_grid_thw"] = grid
            grids[kind] = (grid.prod(dim=1) // 4).tolist()
    if videos and family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor([2 / FPS] * len(videos))
    counts = iter(grids.get("image", []) + grids.get("video", []))  # one row of inputs here
    ids, types = [], []
    for row in text.tolist():
        expanded, kinds = [], []
        for token in row:
            n = next(counts) if token in (IMAGE, VIDEO) else 1
            expanded += [token] * n
            kinds += [{IMAGE: 1, VIDEO: 2}.get(token, 0)] * n
        ids.append(expanded)
        types.append(kinds)
    is_visual = (text == IMAGE) | (text == VIDEO)
    spans = [n for kind in ("image", "video") for n in grids.get(kind, [])]
    layout = make_layout(is_visual, torch.tensor(spans, dtype=torch.long))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), mm_token_type_ids=torch.tensor(types), **kwargs)
    index = layout.ends[..., None].expand(-1, -1, out.logits.shape[-1])
    return out.logits.gather(1, index), batch


def as_transformers(spec: ModelSpec) -> ModelSpec:
    """`spec` with transformers' rule for the text after a clip (the default is Qwen's, which
    transformers up to 5.2 followed: mrope.py)."""
    tokens = dataclasses.replace(spec.vision_tokens, text_after="transformers")
    return dataclasses.replace(spec, vision_tokens=tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_a_folder_reads_and_gives_transformers_logits(tmp_path, family, case):
    hf = peer(family)
    hf.save_pretrained(tmp_path / "hf")
    spec, state = read_hf_qwen2_vl(tmp_path / "hf")
    assert spec.params() == sum(p.numel() for p in hf.parameters())
    spec = as_transformers(spec)  # the text after a clip as get_rope_index places it
    ours = model_with_weights(spec, state).double().eval()
    text, images, videos = inputs(case)
    want, batch = peer_logits(hf, ours, text, images, videos, family)
    if videos:
        batch["video_fps"] = [FPS] * len(videos)
    with torch.no_grad():
        got = ours.logits(batch)
    assert torch.allclose(got, want, rtol=0, atol=1e-10), (got - want).abs().max()


# Clips of 2, 4 and 6 frames (temporal grids 1, 2, 3 at temporal patch 2) at 1, 2 and 3 frames
# a second (2 s, 1 s and 2/3 s a grid step): Qwen2.5-VL at 2 and 25 tokens a second, and
# Qwen2-VL (one position a grid step, whatever the rate), each clip followed by text.
@pytest.mark.parametrize("fps", [1.0, 2.0, 3.0])
@pytest.mark.parametrize(
    "family, tokens_per_second", [("qwen2_vl", None), ("qwen2_5_vl", 2), ("qwen2_5_vl", 25)]
)
@pytest.mark.parametrize("frames", [2, 4, 6])
def test_positions_after_a_clip_equal_get_rope_index(
    tmp_path, frames, family, tokens_per_second, fps
):
    """The device rule (models/visual_inputs.py: positions from the layout, a clip's time from
    its frame rate) against transformers' get_rope_index given the processor's
    second_per_grid_ts = temporal_patch_size / fps."""
    config_cls, _ = CLASSES[family]
    vision = dict(VISION[family])
    if tokens_per_second is not None:
        vision["tokens_per_second"] = tokens_per_second
    config = config_cls(text_config=TEXT, vision_config=vision, image_token_id=IMAGE,
                        video_token_id=VIDEO, vision_start_token_id=START,
                        vision_end_token_id=END)  # fmt: skip
    config.save_pretrained(tmp_path)  # the config.json a folder holds, read as mmtrain reads it
    file = tmp_path / "config.json"
    spec = as_transformers(spec_from_config(json.loads(file.read_text()), file, "tiny"))
    tower = create_model(spec).towers["vision"]
    g = torch.Generator().manual_seed(0)
    # a 1 x 2 and a 3 x 1 merged grid: 2 and 3 grid steps reach past their rows and columns
    text = torch.tensor([[1, START, IMAGE, END, 4, START, VIDEO, END, 5, 6,
                          START, VIDEO, END, 7, 8, 9]])  # fmt: skip
    images = [torch.randn(3, 16, 8, generator=g)]
    videos = [
        torch.randn(frames, 3, 8, 16, generator=g),
        torch.randn(frames, 3, 24, 8, generator=g),
    ]
    batch = {"text": text, "image": images, "video": videos, "video_fps": [fps, fps]}
    with torch.no_grad():
        embeds = torch.zeros(*text.shape, spec.decoder.width)
        got = splice_visual_inputs(tower, spec.vision_tokens, embeds, batch, text >= 0).positions
    _, image_grid = tower.patchify(images)
    _, video_grid = tower.patchify(videos)
    counts = iter((torch.cat([image_grid, video_grid]).prod(dim=1) // 4).tolist())
    ids = [x for token in text[0].tolist()
           for x in [token] * (next(counts) if token in (IMAGE, VIDEO) else 1)]  # fmt: skip
    types = [{IMAGE: 1, VIDEO: 2}.get(x, 0) for x in ids]
    seconds = [config.vision_config.temporal_patch_size / fps] * len(videos)
    extra = {} if tokens_per_second is None else {"second_per_grid_ts": torch.tensor(seconds)}
    model_cls = transformers.Qwen2VLModel if family == "qwen2_vl" else transformers.Qwen2_5_VLModel
    want, deltas = model_cls(config).get_rope_index(
        torch.tensor([ids]), torch.tensor([types]), image_grid_thw=image_grid,
        video_grid_thw=video_grid, **extra,
    )  # fmt: skip
    assert torch.equal(got, want)
    # a generator's first new token goes one past the prompt's largest position (past a clip's
    # last time too), where transformers' rope_deltas put it
    assert torch.equal(next_positions(got), len(ids) + deltas)


def test_the_written_folder_loads_strictly_into_transformers(tmp_path, family):
    hf = peer(family, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    spec, state = read_hf_qwen2_vl(tmp_path / "hf")
    write_hf_qwen2_vl(spec, state, tmp_path / "back", max_shard_bytes=100_000)  # shards
    again, info = type(hf).from_pretrained(
        tmp_path / "back", output_loading_info=True, dtype=torch.float64
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    theirs = again.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in hf.state_dict().items())
    ours = model_with_weights(spec, state).double().eval()
    text, images, videos = inputs("several")
    want, _ = peer_logits(hf, ours, text, images, videos, family)
    got, _ = peer_logits(again.eval(), ours, text, images, videos, family)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)  # the same weights: to rounding
    read_back, state_back = read_hf_qwen2_vl(tmp_path / "back")
    assert dataclasses.replace(read_back, name=spec.name) == spec
    assert all(torch.equal(state[k], state_back[k]) for k in state)


def test_convert_from_and_to_hf_carries_the_processor_files(tmp_path, capsys):
    from mmtrain.cli import main
    from mmtrain.models import load_model

    hf = peer("qwen2_5_vl", seed=5)
    hf.save_pretrained(tmp_path / "hf")
    processor = {"min_pixels": 64, "max_pixels": 4096, "patch_size": 4, "merge_size": 2}
    (tmp_path / "hf" / "preprocessor_config.json").write_text(json.dumps(processor))
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ messages }}")
    assert (
        main(["convert", "--from", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mm")]) == 0
    )
    assert "copied chat_template.jinja, preprocessor_config.json" in capsys.readouterr().out
    model = load_model(tmp_path / "mm")
    assert (model.spec.vision.min_pixels, model.spec.vision.max_pixels) == (64, 4096)
    assert model.spec.vision_tokens.tokens_per_second == 2.0
    assert (
        main(["convert", "--to", "hf", str(tmp_path / "mm"), "--out", str(tmp_path / "back")]) == 0
    )
    assert "Qwen2_5_VLForConditionalGeneration" in capsys.readouterr().out
    assert (tmp_path / "back" / "chat_template.jinja").read_text() == "{{ messages }}"
    _, info = type(hf).from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_preset_is_what_transformers_builds_from_its_config():
    from mmtrain.models.formats.hf_qwen2_vl import hf_config
    from mmtrain.spec import load_spec

    spec = load_spec("Qwen2.5-VL-7B")
    config = hf_config(spec, torch.bfloat16)
    cls = transformers.Qwen2_5_VLForConditionalGeneration
    with torch.device("meta"):
        model = cls(transformers.Qwen2_5_VLConfig(**{k: v for k, v in config.items()
                                                       if k not in ("architectures",)}))  # fmt: skip
    assert sum(p.numel() for p in model.parameters()) == spec.params() == 8_292_166_656


def test_init_from_a_folder_fills_the_tower_and_the_lm_by_name(tmp_path):
    """`init: HF_FOLDER` (the fine-tuning start): every tensor of the native tower, merger
    included, and of the LM comes from the folder; `init: {vision: ...}` takes the tower
    alone and leaves the LM at its random init."""
    from mmtrain.models.build import create_model
    from mmtrain.train.init_start import load_init

    hf = peer("qwen2_5_vl", seed=7)
    hf.save_pretrained(tmp_path / "hf")
    spec, state = read_hf_qwen2_vl(tmp_path / "hf")
    model = create_model(spec).double()
    report = load_init(model, str(tmp_path / "hf"))
    assert not report.random and not report.ignored and report.loaded == len(state)
    got = model.state_dict()
    assert all(torch.equal(got[k], state[k].double()) for k in state)
    fresh = create_model(spec).double()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    load_init(fresh, {"vision": str(tmp_path / "hf")})
    after = fresh.state_dict()
    for key in state:
        tower = key.startswith("towers.vision.")
        assert torch.equal(after[key], state[key].double() if tower else before[key]), key
