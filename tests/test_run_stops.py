"""A run that cannot go on stops and says why (issue 40, item 1).

- Samples too long for `data.sequence_length`: skipped, counted as `too_long_samples` (not
  corrupt), logged once, named by doctor; when every sample is too long, the run stops at once
  with exit 2 naming `data.sequence_length`, the positions the samples need and the largest
  image, instead of cycling through its epochs for ever.
- A signal with no step since the last checkpoint stops the run where it is.
- A denoiser's latents or cached text features of another shape than the spec's: exit 2 before
  the first step, naming the spec field and the sample's shape.

Real parts: PNG pages in conversation shards read by the streaming loader, the tiny-qwen2-vl
preset, `mmtrain train` and `mmtrain doctor` through the CLI, a real SIGTERM.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from mmtrain.cli import main
from mmtrain.config import config_from_dict
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.tokenizer import train_bpe
from mmtrain.models import LanguageModel
from mmtrain.report.doctor import diagnose
from mmtrain.report.rundata import load_run
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError
from mmtrain.train.loop import train


def _png(side: int, seed: int) -> bytes:
    image = Image.new("RGB", (side, side), (200, 30, 30))
    image.putpixel((seed % side, (3 * seed) % side), (255, 255, 255))  # no two alike
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> Path:
    """24 one-page conversations: every third page 64 x 64 px (64 positions in the tiny
    tower: 4 px patches merged 2 x 2), the others 16 x 16 px (4 positions)."""
    folder = tmp_path_factory.mktemp("pages")
    vocab = train_bpe(["a red page"] * 8, vocab_size=280, out_path=folder / "tokenizer.json")
    spec = load_spec("tiny-qwen2-vl").to_dict()
    spec["decoder"].update(vocab_size=vocab.vocab_size + 2, bos_id=None, eos_ids=[])
    spec["vision_tokens"].update(
        image_token_id=vocab.vocab_size, video_token_id=vocab.vocab_size + 1
    )
    (folder / "spec.json").write_text(json.dumps(spec))
    with ShardWriter(folder, max_samples=8) as writer:
        for i in range(24):
            record = {
                "id": str(i),
                "images": ["0.png"],
                "messages": [
                    {"role": "user", "content": "<image>"},
                    {"role": "assistant", "content": "a red page"},
                ],
            }
            page = _png(64 if i % 3 == 0 else 16, i)
            writer.write({"__key__": f"{i:09d}", "json": json.dumps(record), "0.png": page})
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return folder


def _run_config(pages: Path, out: Path, sequence_length: int, steps: int = 3) -> dict:
    return {
        "model": str(pages / "spec.json"),
        "data": {
            "train": str(pages),
            "tokenizer": str(pages / "tokenizer.json"),
            "chat_template": "plain",
            "sequence_length": sequence_length,
        },
        "train": {"steps": steps, "batch_size": 4, "lr": 1e-3},
        "checkpoint": {"every_steps": 2},
        "metrics": {"tensorboard": False, "log_every": 1},
        "out": str(out),
    }


def test_samples_too_long_for_the_row_are_counted_apart_logged_once_and_named(
    tmp_path, pages, caplog
):
    """A row of 24 positions holds the small pages (about 10 positions with the text), not the
    large ones (70): those are skipped as too long, not as corrupt."""
    config = config_from_dict(_run_config(pages, tmp_path / "run", 24, steps=6))
    with caplog.at_level(logging.WARNING):
        result = train(config)
    assert result.step == 6
    assert result.corrupt_samples == 0
    # 6 steps x 4 entries: one epoch, whose 8 large pages were each skipped once
    assert result.too_long_samples == 8
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in rows if "loss" in r]
    assert steps[-1]["too_long_samples"] == result.too_long_samples
    assert all(r["corrupt_samples"] == 0 for r in steps)
    said = [r for r in caplog.records if "too long for the row" in r.getMessage()]
    assert len(said) == 1  # once, not once a sample
    assert not [r for r in caplog.records if "corrupt" in r.getMessage()]
    findings = {f.kind: f for f in diagnose(load_run(tmp_path / "run"))}
    finding = findings["data_quality"]
    assert finding.evidence["too_long_samples"] == result.too_long_samples
    assert finding.evidence["data.sequence_length"] == 24
    assert "data.sequence_length" in finding.advice


def test_a_row_too_short_for_every_sample_stops_at_once_with_exit_2(tmp_path, pages, capsys):
    """Every sample needs more positions than the row: the run stops in its first step
    (24 samples, all refused: 48 in a row prove an epoch) instead of cycling through epochs."""
    config = _run_config(pages, tmp_path / "run", 3)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 2
    message = capsys.readouterr().err
    assert "data.sequence_length: 3 positions per row hold none of the samples" in message
    needed = int(re.search(r"they need up to (\d+) positions", message).group(1))
    assert needed > 64  # the large page's 64 positions and its text
    assert "image of 64x64 px (64x64 at the tower: 64 positions)" in message
    assert f"data.sequence_length={needed} or more" in message
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    # the run folder says why: doctor names the field to change
    assert main(["doctor", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "[error] data_quality" in out and "change data.sequence_length" in out


def test_a_signal_before_the_first_step_completes_stops_the_run_where_it_is(
    tmp_path, pages, monkeypatch
):
    """SIGTERM during the first forward: nothing to save, so the run stops at once (no step
    finished, no checkpoint); after a step since the last checkpoint the step finishes and
    its checkpoint is written (tests/test_train_vlm.py's packed-sigterm)."""
    forward = LanguageModel.forward

    def forward_then_signal(self, batch):
        os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, batch)

    monkeypatch.setattr(LanguageModel, "forward", forward_then_signal)
    result = train(config_from_dict(_run_config(pages, tmp_path / "run", 96)))
    assert result.stopped_by_signal and result.step == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    monkeypatch.undo()
    assert train(config_from_dict(_run_config(pages, tmp_path / "run", 96))).step == 3


# ----------------------------------------------------------------------------- denoisers
def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array.astype(np.float32))
    return buffer.getvalue()


def _mmdit(tmp_path: Path) -> Path:
    spec = ModelSpec.from_dict({
        "name": "tiny-mmdit",
        "objective": "flow_matching",
        "denoiser": {"architecture": "mmdit", "input": "latent", "sample_size": 8, "channels": 4,
                     "patch_size": 2, "width": 32, "layers": 2, "heads": 2, "text_width": 16,
                     "pooled_width": 8, "text_tokens": 5, "pos_embed_max_size": 6},
    })  # fmt: skip
    path = tmp_path / "spec.yaml"
    spec.save(path)
    return path


def _latent_shards(folder: Path, latent: tuple, hidden: tuple, pooled: tuple) -> Path:
    with ShardWriter(folder, max_samples=4) as writer:
        for i in range(4):
            writer.write({
                "__key__": f"s{i}",
                "latent.npy": _npy(np.zeros(latent)),
                "text_hidden.npy": _npy(np.zeros(hidden)),
                "text_pooled.npy": _npy(np.zeros(pooled)),
            })  # fmt: skip
    return folder


@pytest.mark.parametrize(
    ("latent", "hidden", "field", "shape"),
    [
        ((16, 8, 8), (5, 16), "denoiser.channels", "[16, 8, 8]"),
        ((4, 16, 16), (5, 16), "denoiser.sample_size", "[4, 16, 16]"),
        ((4, 8, 8), (5, 32), "denoiser.text_width", "[5, 32]"),
        ((4, 8, 8), (7, 16), "denoiser.text_tokens", "[7, 16]"),
    ],
    ids=["channels", "size", "text-width", "text-tokens"],
)
def test_latents_or_text_features_of_another_shape_stop_before_the_first_step(
    tmp_path, capsys, latent, hidden, field, shape
):
    shards = _latent_shards(tmp_path / "shards", latent, hidden, (8,))
    config = {
        "model": str(_mmdit(tmp_path)),
        "data": {"train": str(shards)},
        "train": {"steps": 2, "batch_size": 2},
        "metrics": {"tensorboard": False},
        "out": str(tmp_path / "run"),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 2
    message = capsys.readouterr().err
    assert f"{field}:" in message and shape in message and "s0" in message
    if field == "denoiser.sample_size":  # a bucket of the latents' size would take them
        assert "data.buckets: [[16, 16]]" in message
    if field == "denoiser.text_tokens":  # what encode-latents wrote against what the spec takes
        assert "wrote 7 text tokens a caption" in message and "takes 5" in message
    with pytest.raises(FieldError):  # the same through the library, no step taken
        train(config_from_dict(config))
