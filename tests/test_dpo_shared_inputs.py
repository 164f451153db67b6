"""A preference pair's two sides hold the same images and clips: the pair's micro-batch keeps
each input once and the vision tower encodes it once (`image_sources` / `video_sources` say
which input each placeholder takes). The model's logits and its tower's gradients equal those
of the batch with every side's inputs given apart (float64: equal up to rounding), for a
native-resolution VLM (pages and a clip at their own sizes; padded and packed rows) and a
LLaVA-style one (a projector over fixed-size images)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmtrain.config import DataConfig, DataSource, VisionDataConfig
from mmtrain.data.stream.conversation_batches import ConversationBatcher
from mmtrain.data.stream.media import encode_video
from mmtrain.data.stream.preference_batches import PairDecoder, collate_pairs
from mmtrain.models.build import create_model
from mmtrain.models.visual_inputs import IMAGE_SOURCES, IMAGES, VIDEO_FPS, VIDEO_SOURCES, VIDEOS
from mmtrain.spec import load_spec
from mmtrain.train.metrics import language_model_forward_flops


def _png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


CLIP = encode_video(np.random.default_rng(0).integers(0, 256, (6, 24, 40, 3), dtype=np.uint8), 4)


def _pair(key: str, images: list[bytes], video: bool, chosen: str, rejected: str) -> dict:
    members = {f"{n}.png": data for n, data in enumerate(images)}
    tags = "".join("<image>" for _ in images)
    record = {"id": key, "images": list(members)}
    if video:
        members["v0.mp4"] = CLIP
        record["videos"] = ["v0.mp4"]
        tags += "<video>"
    record |= {"messages": [{"role": "user", "content": tags + "Read it."}],
               "chosen": chosen, "rejected": rejected}  # fmt: skip
    return {"__key__": key, "json": json.dumps(record).encode(), **members}


def _batch(spec, pack: bool, samples: list[dict], vision: VisionDataConfig | None = None):
    data = DataConfig(train=[DataSource("unused")], chat_template="plain", sequence_length=400,
                      pack=pack, vision=vision)  # fmt: skip
    batcher = ConversationBatcher(data, spec)
    decode = PairDecoder(batcher.decoder(spec, train=False))
    return collate_pairs(spec, batcher)([decode(s, np.random.default_rng(0)) for s in samples])


def _apart(batch: dict) -> dict:
    """The same batch with each placeholder's input given on its own (no sharing)."""
    out = {k: v for k, v in batch.items() if k not in (IMAGE_SOURCES, VIDEO_SOURCES)}
    image_sources = batch[IMAGE_SOURCES]
    if isinstance(batch[IMAGES], list):
        out[IMAGES] = [batch[IMAGES][i] for i in image_sources]
        out[VIDEOS] = [batch[VIDEOS][i] for i in batch[VIDEO_SOURCES]]
        out[VIDEO_FPS] = [batch[VIDEO_FPS][i] for i in batch[VIDEO_SOURCES]]
    else:
        out[IMAGES] = batch[IMAGES][torch.tensor(image_sources)]
    return out


def _float64(batch: dict) -> dict:
    def cast(value):
        if isinstance(value, list):
            return [cast(v) for v in value]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.double()
        return value

    return {k: cast(v) for k, v in batch.items()}


def _logits_and_tower_grads(model, batch: dict, tower: str):
    model.zero_grad()
    logits = model.logits(batch)
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if n.startswith(tower) and p.grad is not None}  # fmt: skip


def _same_as_apart(spec, batch: dict, tower: str) -> None:
    model = create_model(spec, seed=0, dtype=torch.float64)
    shared = _logits_and_tower_grads(model, _float64(batch), tower)
    apart = _logits_and_tower_grads(model, _float64(_apart(batch)), tower)
    torch.testing.assert_close(shared[0], apart[0], rtol=1e-12, atol=1e-12)
    assert shared[1].keys() == apart[1].keys() and shared[1]
    for name, grad in shared[1].items():
        torch.testing.assert_close(grad, apart[1][name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_native_vlms_pair_encodes_its_pages_and_clip_once(pack):
    spec = load_spec("tiny-qwen2-vl")
    vision = VisionDataConfig(image_max_tokens=20, frame_min_tokens=4, frame_max_tokens=12)
    samples = [_pair("a", [_png(48, 24, 1), _png(32, 40, 2)], True, "twelve", "thirteen"),
               _pair("b", [_png(40, 40, 3)], False, "ok", "no")]  # fmt: skip
    batch = _batch(spec, pack, samples, vision)
    assert len(batch[IMAGES]) == 3 and len(batch[VIDEOS]) == 1  # each input once
    assert batch[IMAGE_SOURCES] == [0, 1, 2, 0, 1, 2] and batch[VIDEO_SOURCES] == [0, 0]
    _same_as_apart(spec, batch, "towers.vision")
    # MFU counts the tower's work once per input and the rows as the model lays them out.
    shared, apart = (language_model_forward_flops(spec, b) for b in (batch, _apart(batch)))
    assert shared["text"] == apart["text"] and 2 * shared["vision"] == apart["vision"]


def test_a_llava_style_pair_encodes_its_image_once():
    spec = load_spec("tiny-vlm")
    samples = [_pair("a", [_png(80, 64, 1)], False, "cat", "dog"),
               _pair("b", [_png(64, 90, 2)], False, "red", "blue")]  # fmt: skip
    batch = _batch(spec, False, samples)
    assert batch[IMAGES].shape[0] == 2 and batch[IMAGE_SOURCES] == [0, 1, 0, 1]
    _same_as_apart(spec, batch, "towers.image")


def test_a_llava_style_full_fine_tune_keeps_a_frozen_copy(tmp_path):
    """A LLaVA-style model's images are cropped and flipped at random at each read, which one
    stored score cannot follow: `auto` trains against a frozen copy (the first step's loss is
    log 2, policy and reference alike) and stores no reference log-probs."""
    from mmtrain.config import config_from_dict
    from mmtrain.data.storage.manifest import write_manifest
    from mmtrain.data.storage.shard_writer import ShardWriter
    from mmtrain.train.loop import train
    from mmtrain.train.reference_cache import FOLDER

    with ShardWriter(tmp_path / "shards", max_samples=8) as writer:
        for i in range(4):
            writer.write(_pair(f"{i:04d}", [_png(80, 64, i)], False, "cat", "dog"))
    write_manifest(tmp_path / "shards", writer.shards, modalities=["image", "text"])
    config = config_from_dict({
        "model": "tiny-vlm",
        "data": {"train": str(tmp_path / "shards"), "chat_template": "plain",
                 "sequence_length": 128, "workers": 0},
        "train": {"steps": 1, "batch_size": 4, "objective": "dpo", "precision": "fp32"},
        "metrics": {"tensorboard": False}, "out": str(tmp_path / "run")})  # fmt: skip
    result = train(config)
    assert result.history[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)
    assert not (tmp_path / "run" / FOLDER).exists()
