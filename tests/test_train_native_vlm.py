"""`train` on a native-resolution VLM (presets/tiny-qwen2-vl.yaml): pages of several aspects
and short clips at their own sizes, within a pixel budget, padded and packed, resumed exactly,
and 2 FSDP2 ranks of which one sees text only.

Real parts: PNG pages and MP4 clips (PyAV), tar shards of conversations, the streaming loader,
a byte-level BPE with the "plain" template, real gloo processes. Exact comparisons in float64
as tests/test_train_vlm.py explains (rtol 1e-9).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image

from dist_helpers import run_distributed
from mmtrain.config import config_from_dict
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.media import encode_video
from mmtrain.data.stream.tokenizer import train_bpe
from mmtrain.spec import load_spec
from mmtrain.train.loop import train

EXACT = {"rtol": 1e-9, "atol": 1e-12}
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (30, 60, 220)}
VISION = {"image_max_tokens": 24, "sample_max_tokens": 64, "frame_min_tokens": 4,
          "frame_max_tokens": 12}  # fmt: skip
SIZES = [(40, 40), (96, 24), (24, 72), (56, 32)]  # (height, width): 1:1, 4:1, 1:3, ...


def _png(rgb: tuple[int, int, int], size: tuple[int, int], seed: int) -> bytes:
    height, width = size
    image = Image.new("RGB", (width, height), rgb)
    image.putpixel((seed % width, (7 * seed) % height), (255, 255, 255))  # no two alike
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _clip(rgb: tuple[int, int, int], seed: int) -> bytes:
    frames = np.zeros((6, 32, 48, 3), dtype=np.uint8)
    frames[:] = rgb
    frames[:, seed % 32, :, :] = 255  # a white line that differs per clip
    return encode_video(frames, fps=4)


def _record(i: int) -> tuple[dict, dict[str, bytes]]:
    """Pages of four sizes (one or two per sample), a clip every fifth sample, every fourth
    sample text-only."""
    name = list(COLOURS)[i % len(COLOURS)]
    if i % 4 == 3:
        messages = [
            {"role": "user", "content": f"Say {name}."},
            {"role": "assistant", "content": f"{name} " * (1 + i % 3)},
        ]
        return {"id": str(i), "messages": messages}, {}
    members = {"0.png": _png(COLOURS[name], SIZES[i % len(SIZES)], i)}
    content = "<image>"
    if i % 3 == 1:
        members["1.png"] = _png(COLOURS[name], SIZES[(i + 1) % len(SIZES)], i + 1)
        content += "<image>"
    record = {"id": str(i), "images": list(members)}
    if i % 5 == 0:
        members["v0.mp4"] = _clip(COLOURS[name], i)
        record["videos"] = ["v0.mp4"]
        content = "<video>" + content
    record["messages"] = [
        {"role": "user", "content": content},
        {"role": "assistant", "content": f"a {name} page"},
    ]
    return record, members


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("native-vlm-shards")
    words = [f"Say {name}. a {name} page {name}" for name in COLOURS] * 4
    vocab = train_bpe(words, vocab_size=280, out_path=folder / "tokenizer.json").vocab_size
    spec = load_spec("tiny-qwen2-vl").to_dict()
    spec["decoder"].update(vocab_size=vocab + 2, bos_id=None, eos_ids=[])
    spec["vision_tokens"].update(image_token_id=vocab, video_token_id=vocab + 1)
    (folder / "spec.json").write_text(json.dumps(spec))
    with ShardWriter(folder, max_samples=8) as writer:
        for i in range(24):
            record, members = _record(i)
            writer.write({"__key__": f"{i:09d}", "json": json.dumps(record), **members})
    write_manifest(folder, writer.shards, modalities=["image", "video", "text"])
    return folder


def _config(out: Path, shards: Path, *, data=None, train=None, **top):
    return config_from_dict(
        {
            "model": str(shards / "spec.json"),
            "data": {
                "train": str(shards),
                "tokenizer": str(shards / "tokenizer.json"),
                "chat_template": "plain",
                "sequence_length": 160,
                "vision": VISION,
                **(data or {}),
            },
            "train": {
                "steps": 4,
                "batch_size": 4,
                "micro_batch": 2,
                "precision": "fp64",
                "lr": 1e-3,
                "warmup_steps": 0,
                **(train or {}),
            },
            "checkpoint": {"every_steps": 2, "keep": 3},
            "metrics": {"tensorboard": False},
            "out": str(out),
            **top,
        }
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_trains_and_resumes_exactly(tmp_path, shards, pack):
    """Stopped after step 3 (a crash: step 2's checkpoint resumes), then rerun: the same
    weights as a run never stopped; the vision tower and its merger learned."""
    data = {"pack": pack}
    whole = train(_config(tmp_path / "whole", shards, data=data, train={"steps": 6}))
    assert all(np.isfinite(r["loss"]) for r in whole.history)
    config = _config(tmp_path / "stopped", shards, data=data, train={"steps": 6})
    train(config, halt_after_step=3)
    resumed = train(config)
    assert resumed.resumed_from == 2
    a, b = _weights(tmp_path / "whole"), _weights(tmp_path / "stopped")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history[2:]]


def _train_rank(rank: int, world: int, config) -> tuple[list[float], list[int]]:
    """The rank's losses and, per forward, how many pages and clips its batch held."""
    from mmtrain.models import LanguageModel

    inputs, forward = [], LanguageModel.forward

    def counting(self, batch):
        inputs.append(len(batch.get("image", [])) + len(batch.get("video", [])))
        return forward(self, batch)

    LanguageModel.forward = counting
    try:
        return [row["loss"] for row in train(config).history], inputs
    finally:
        LanguageModel.forward = forward


@pytest.mark.slow
def test_two_fsdp_ranks_one_with_text_only_follow_one_rank(tmp_path, shards):
    """2 FSDP2 ranks (activation checkpointing per block) and 1 rank, same global batch: the
    same losses and weights, with steps where one rank's micro-batch holds no page or clip
    (its tower runs on a stand-in, so the sharded collectives of both ranks match)."""
    towers = {"text": {"activation_checkpointing": True}}
    settings = {"towers": towers, "micro_batch": 1, "batch_size": 2, "steps": 5}
    one = train(_config(tmp_path / "one", shards, train=settings))
    config = _config(tmp_path / "two", shards, train={**settings, "parallel": "fsdp"})
    (losses0, inputs0), (losses1, inputs1) = run_distributed(
        _train_rank, world_size=2, args=(config,)
    )
    assert any((a == 0) != (b == 0) for a, b in zip(inputs0, inputs1, strict=True))
    for got in (losses0, losses1):
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor([r["loss"] for r in one.history]), **EXACT
        )
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for name in a:
        torch.testing.assert_close(b[name], a[name], **EXACT, msg=name)


def test_inspect_counts_the_tokens_the_loader_lays_out(shards, capsys):
    """`data inspect --model` counts each sample's LM positions from its pages' and clips'
    header sizes under the run's budget: the same numbers the loader's decoder encodes."""
    from mmtrain.cli import main
    from mmtrain.data.ingest.inspect import conversation_counts, open_shards
    from mmtrain.data.stream.conversation_batches import ConversationBatcher
    from mmtrain.spec import ModelSpec

    config = _config(shards / "unused", shards)
    spec = ModelSpec.from_dict(json.loads((shards / "spec.json").read_text()))
    batcher = ConversationBatcher(config.data, spec)
    sources = open_shards(str(shards))[2]
    counts = conversation_counts(
        sources, batcher.tokenizer, batcher.template, budget=batcher.budget
    )
    decoder = batcher.decoder(spec)
    loaded = []
    for index in range(len(sources)):
        out = decoder(sources.read(index), None)
        spans = out["spans"][:, 1].tolist()
        loaded.append(len(out["input_ids"]) - len(spans) + sum(spans))
    assert counts.positions == loaded and not counts.refused
    argv = ["data", "inspect", str(shards), "--tokenizer", str(shards / "tokenizer.json"),
            "--chat-template", "plain", "--model", str(shards / "spec.json"),
            *(f"--budget={k}={v}" for k, v in VISION.items()), "--json"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)["conversations"]
    assert report["positions"]["max"] == max(loaded)
    assert report["visual_tokens"]["max"] <= 64 and report["page_tokens"]["max"] <= 24


def test_validation_and_eval_read_pages_as_training_did(tmp_path, shards, capsys):
    """Validation during training and `mmtrain eval RUN` afterwards score the same pages at
    the same budgeted sizes: the same perplexity, answers with their document scores."""
    from mmtrain.cli import main

    run = tmp_path / "val"
    result = train(_config(run, shards, data={"val": str(shards)}, train={"steps": 2}))
    assert np.isfinite(result.history[-1]["val/perplexity"])
    report = json.loads((run / "eval.json").read_text())
    generation = report["generation"]
    assert generation["n"] == 24 and generation["n_shuffled"] > 0
    assert 0.0 <= generation["anls"] <= 1.0 and generation["cer"] >= 0.0
    first = report["examples"][0]  # sample 0: a clip and a page
    assert (first["videos"], first["images"]) == (["v0.mp4"], ["0.png"])
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(shards), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["perplexity"] == pytest.approx(report["perplexity"], rel=1e-9)
    assert again["generation"]["anls"] == pytest.approx(generation["anls"], rel=1e-9)
    # the report's gallery shows each answer beside its page and a few frames of its clip
    from mmtrain.report.gallery import _eval_examples, _example_images
    from mmtrain.report.rundata import load_run

    data = load_run(run)
    thumbs = _example_images(data, _eval_examples(data.eval_report))
    assert len(thumbs[0]) == 3  # one page, then the clip's frames, capped at three
    assert main(["report", str(run)]) == 0 and (run / "report.html").is_file()


def test_the_last_vision_blocks_and_the_merger_train_at_their_own_rate(tmp_path, shards):
    """`train.towers.vision`: unlocked_blocks 1 keeps the patch embedding and block 0 as they
    were while block 1 and the merger train, at the tower's own (smaller) learning rate."""
    base = tmp_path / "base"
    train(_config(base, shards, train={"steps": 1, "lr": 0.0}))
    towers = {"vision": {"unlocked_blocks": 1, "lr": 1e-4}}
    run = train(_config(tmp_path / "tuned", shards, train={"steps": 2, "towers": towers},
                        init=str(base)))  # fmt: skip
    first = run.history[0]
    assert first["lr/vision/decay"] == pytest.approx(0.1 * first["lr/text/decay"])
    before, after = _weights(base), _weights(tmp_path / "tuned")

    def changed(prefix: str) -> bool:
        names = [n for n in before if n.startswith(prefix)]
        assert names, prefix
        return any(not torch.equal(before[n], after[n]) for n in names)

    assert not changed("towers.vision.patch_embed.") and not changed("towers.vision.blocks.0.")
    assert changed("towers.vision.blocks.1.") and changed("towers.vision.merger.")
    assert changed("towers.text.blocks.")


def test_generate_answers_about_a_page_and_a_clip(tmp_path, shards, capsys):
    """`mmtrain generate RUN --image PAGE --video CLIP --prompt ...` reads them at the run's
    budget and answers (a few untrained tokens; what matters is the path runs end to end)."""
    from mmtrain.cli import main

    run = tmp_path / "gen"
    train(_config(run, shards, train={"steps": 1}))
    record, members = _record(0)
    (tmp_path / "page.png").write_bytes(members["0.png"])
    (tmp_path / "clip.mp4").write_bytes(members["v0.mp4"])
    argv = ["generate", str(run), "--image", str(tmp_path / "page.png"), "--video",
            str(tmp_path / "clip.mp4"), "--prompt", "<video> then <image>", "--max-new-tokens",
            "4"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    assert main([*argv[:2], "--video", str(tmp_path / "clip.mp4"), "--prompt", "<image>"]) == 2
    assert "<image> tag(s) but 0 --image" in capsys.readouterr().err
