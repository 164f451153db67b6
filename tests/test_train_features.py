"""The training loop's features beyond the contrastive core: fusion heads, non-finite guards with
rollback, periodic validation, the memory plan record, per-rank RNG states, progressive
resolution."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

import mmtrain
from micro import MICRO_SPEC, MIXED_SPEC, make_mixed_sources, make_shards
from mmtrain.checkpoint import latest_checkpoint, load_checkpoint
from mmtrain.config import config_from_dict
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.media import MediaError
from mmtrain.spec import FusionSpec, ModelSpec, load_spec
from mmtrain.structured import FieldError
from mmtrain.train.data import read_label
from mmtrain.train.loop import train
from mmtrain.train.metrics import planned_memory
from mmtrain.train.optim import lr_factor
from mmtrain.train.resolution import allow_any_resolution, resize_grid, resize_time, spec_at
from mmtrain.train.rng import capture_rng_state, restore_rank_rng_state
from test_train import make_config

WORDS = ("idle", "running", "overheating", "failing")


# ----------------------------------------------------------------------------- data
def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def make_fusion_shards(folder, samples: int, seed: int = 0) -> str:
    """tiny-fusion's inputs: a grey thermal image, a 3-channel vibration signal, a work-order
    text and the machine state in `.cls`; each modality carries a noisy hint of the class."""
    rng = np.random.default_rng(seed)
    t = np.arange(128)
    with ShardWriter(folder, max_samples=16) as writer:
        for i in range(samples):
            label = int(rng.integers(0, 4))
            pixels = rng.integers(0, 60, (36, 36), dtype=np.uint8)
            pixels[: 9 * (label + 1)] += 120  # a hotter band for higher states
            signal = np.stack(
                [np.sin(2 * np.pi * (label + 1) * t / 32 + c) for c in range(3)]
            ) + 0.3 * rng.standard_normal((3, 128))
            words = f"unit {i % 7} reported {WORDS[label]}" if rng.random() < 0.7 else "unit ok"
            writer.write(
                {
                    "__key__": f"m{seed}_{i:05d}",
                    "png": _png(pixels),
                    "npy": _npy(signal.astype(np.float32)),
                    "txt": words.encode(),
                    "cls": str(label).encode(),
                }
            )
    return str(folder)


def fusion_config(tmp_path, shards: str, **sections):
    settings = {"steps": 12, "batch_size": 16, "lr": 2e-3, "warmup_steps": 2, "weight_decay": 0.0}
    data = {"train": shards, "shuffle_window": 16}
    data.update(sections.pop("data", {}))
    return config_from_dict(
        {
            "model": "tiny-fusion",
            "data": data,
            "train": {**settings, **sections.pop("train", {})},
            "checkpoint": {"every_steps": 100},
            "metrics": {"tensorboard": False},
            "seed": 0,
            "out": str(tmp_path / "run"),
            **sections,
        }
    )


# ----------------------------------------------------------------------------- fusion
@pytest.mark.slow
def test_fusion_model_trains_on_labelled_shards_and_validates(tmp_path):
    shards = make_fusion_shards(tmp_path / "train", 64)
    val = make_fusion_shards(tmp_path / "val", 24, seed=1)
    config = fusion_config(
        tmp_path, shards, data={"val": val}, eval={"every_steps": 6, "batch_size": 12}
    )
    result = train(config)

    losses = [r["loss/fusion"] for r in result.history]
    assert result.step == 12 and all(math.isfinite(v) for v in losses)
    assert result.history[0]["loss"] == pytest.approx(losses[0])  # no pairs: the head's loss
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.1, losses  # it learns
    assert "logit_scale" not in result.history[0]  # fusion-only: no temperature

    # Validation ran at steps 6 and 12 on the fused towers, labels from `.cls`.
    val_rows = {r["step"]: r for r in result.history if "val/fusion/accuracy" in r}
    assert sorted(val_rows) == [6, 12]
    assert val_rows[12]["val/n_samples"] == 24
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["step"] == 12 and report["fusion"]["n_samples"] == 24
    assert report["fusion"]["accuracy"] == val_rows[12]["val/fusion/accuracy"]
    assert mmtrain.load_model(tmp_path / "run").spec.name == "tiny-fusion"


def test_fusion_labels_from_cls_or_json_field():
    classify = FusionSpec(num_outputs=3)
    assert read_label({"cls": b"2"}, classify).item() == 2
    meta = {"json": json.dumps({"state": "hot"}).encode()}
    label = read_label(meta, classify, "state", ["cold", "warm", "hot"])
    assert label.dtype == torch.long and label.item() == 2
    regress = FusionSpec(num_outputs=2, task="regress")
    target = read_label({"json": b'{"label": [0.5, -1]}'}, regress)
    assert target.dtype == torch.float32 and target.tolist() == [0.5, -1.0]
    for bad, spec, match in (
        ({"cls": b"3"}, classify, "outside the fusion head's 3 classes"),
        ({"json": b'{"other": 1}'}, classify, "no field 'label'"),
        ({"txt": b"x"}, classify, "no label"),
        ({"cls": b"0.5"}, regress, r"not 2 number\(s\)"),
    ):
        with pytest.raises(MediaError, match=match):
            read_label(bad, spec)


# ----------------------------------------------------------------------------- guards
@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return make_shards(tmp_path_factory.mktemp("shards"), 40)


@pytest.mark.slow
def test_nan_steps_are_skipped_then_rolled_back_with_a_lower_lr(tmp_path, shards):
    config = make_config(tmp_path, shards, steps=6)
    config.guards.max_nonfinite_in_a_row = 2
    config.guards.rollback_lr_factor = 0.5
    config.guards.inject_nan_steps = [3, 4]  # real NaN inputs in steps 3 and 4
    result = train(config)

    assert result.step == 6 and result.rollbacks == 1 and result.skipped_steps == 2
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "kind" not in r]
    # Steps 3 and 4 were skipped, the run went back to the checkpoint of step 2 and trained
    # them again: the log keeps each step once, from the replay.
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert steps[-1]["skipped_steps"] == 2 and steps[-1]["rollbacks"] == 1
    assert steps[-1]["lr"] == pytest.approx(0.5 * 1e-3 * lr_factor(config.train)(6))

    final = mmtrain.load_model(tmp_path / "run").state_dict()
    assert all(torch.isfinite(v).all() for v in final.values())
    state = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints")).state
    assert state["counters"]["rollbacks"] == 1 and state["counters"]["skipped_steps"] == 2
    assert state["scheduler"]["base_lrs"][0] == pytest.approx(0.5e-3)  # kept on resume


def test_non_finite_steps_without_a_checkpoint_stop_with_a_clear_error(tmp_path, shards):
    config = make_config(tmp_path, shards, steps=4)
    config.guards.max_nonfinite_in_a_row = 1
    config.guards.inject_nan_steps = [1]
    with pytest.raises(FloatingPointError, match="no checkpoint to roll back to"):
        train(config)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing non-finite was saved


# ----------------------------------------------------------------------------- plan, RNG
def test_plan_record_and_measured_memory_per_step(tmp_path, shards):
    config = make_config(tmp_path, shards, steps=2)
    train(config)
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    plan = next(r for r in records if r.get("kind") == "plan")
    spec = ModelSpec.from_dict(MICRO_SPEC)
    expected = planned_memory(spec, config, world_size=1, recompute=[], device=torch.device("cpu"))
    assert plan["predicted_activations_bytes"] == expected["predicted_activations_bytes"] > 0
    assert plan["predicted_model_state_bytes"] == 16 * spec.params()  # fp32 w + g + AdamW
    assert plan["predicted_total_bytes"] >= plan["predicted_model_state_bytes"]
    for row in (r for r in records if "kind" not in r):
        assert row["peak_memory_bytes"] > 0 and row["rss_bytes"] > 0

    recomputed = planned_memory(
        spec, config, world_size=1, recompute=["image", "text"], device=torch.device("cpu")
    )
    assert recomputed["predicted_activations_bytes"] < expected["predicted_activations_bytes"]


def test_rng_states_are_saved_per_rank_and_restored_by_rank():
    torch.manual_seed(1)
    first = capture_rng_state()
    torch.manual_seed(2)
    second = capture_rng_state()
    restore_rank_rng_state([first, second], rank=1, seed=0, step=5)
    assert torch.equal(torch.get_rng_state(), second["torch"])
    restore_rank_rng_state(first, rank=0, seed=0, step=5)  # a single state (older checkpoints)
    assert torch.equal(torch.get_rng_state(), first["torch"])
    restore_rank_rng_state([first], rank=1, seed=0, step=5)  # more ranks than saved: seeded
    seeded = torch.get_rng_state()
    restore_rank_rng_state([second], rank=1, seed=0, step=5)
    assert torch.equal(torch.get_rng_state(), seeded)  # a function of (seed, rank, step)


# ----------------------------------------------------------------------------- resolution
def test_position_embeddings_interpolate_bicubic_in_space_and_linear_in_time():
    ramp = torch.arange(4.0).repeat(4, 1)  # 4 x 4 grid, value = column
    pos = torch.stack([ramp.flatten(), ramp.t().flatten()], dim=1)  # [16, 2]
    assert resize_grid(pos, 4) is pos
    up = resize_grid(pos, 8).reshape(8, 8, 2)
    assert torch.all(up[:, 1:, 0] >= up[:, :-1, 0])  # still increasing along columns
    assert torch.allclose(up[:, :, 0], up[0:1, :, 0].expand(8, 8))  # constant down the rows
    time = torch.tensor([[0.0], [2.0], [4.0]])
    assert resize_time(time, 5).flatten().tolist() == pytest.approx([0.0, 0.8, 2.0, 3.2, 4.0])


def test_stems_take_smaller_inputs_and_train_the_full_size_embeddings():
    spec = load_spec("tiny-clip")
    model = mmtrain.create_model(spec, seed=0)
    image = torch.randn(2, 3, 64, 64)
    before = model.encode({"image": image})["image"]
    allow_any_resolution(model)
    torch.testing.assert_close(model.encode({"image": image})["image"], before, rtol=0, atol=0)
    small = model.encode({"image": torch.randn(2, 3, 32, 32)})["image"]
    small.sum().backward()
    pos = model.towers["image"].stem.pos_embed
    assert small.shape == (2, spec.embed_dim) and pos.grad.abs().sum() > 0

    video = ModelSpec.from_dict(
        {
            "name": "micro-video",
            "embed_dim": 16,
            "pairs": [["video", "text"]],
            "towers": {
                "video": {
                    "modality": "video",
                    "stem": {"frames": 4, "tubelet": 2, "image_size": 16, "patch_size": 8},
                    **{"width": 16, "layers": 1, "heads": 2},
                },
                "text": {
                    "modality": "text",
                    "stem": {"vocab_size": 258, "context_length": 8},
                    **{"width": 16, "layers": 1, "heads": 2, "pooling": "eot"},
                },
            },
        }
    )
    model = allow_any_resolution(mmtrain.create_model(video, seed=0))
    tokens = model.towers["video"].stem(torch.randn(2, 2, 3, 8, 8))
    assert tokens.shape == (2, 1 + 1 * 1, 16)  # cls + 1 tubelet x 1 patch
    smaller = spec_at(video, 0, [(0, 8)], [(0, 2)]).towers["video"].stem
    assert (smaller.image_size, smaller.frames) == (8, 2)


def test_progressive_resolution_schedule_trains_small_then_full(tmp_path, shards):
    config = make_config(tmp_path, shards, steps=4)
    config.train.resolution_schedule = [(0, 8), (2, 16)]
    result = train(config)
    sizes = [r.get("input_size/image") for r in result.history]
    assert sizes == [8, 8, 16, 16]  # steps 1-2 at 8 px, then the spec's 16 px
    assert all(math.isfinite(r["loss"]) for r in result.history)
    model = mmtrain.load_model(tmp_path / "run")
    assert model.towers["image"].stem.pos_embed.shape[0] == 1 + 4  # spec size kept
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["resolution_schedule"] == [[0, 8], [2, 16]]


def test_validation_sets_of_different_modalities_each_evaluate_their_own_pair(tmp_path):
    """Training mixes image-text and timeseries-text sources; each validation set is
    evaluated on the pair its shards hold, not refused for the tower it lacks."""
    images, series = make_mixed_sources(tmp_path)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(MIXED_SPEC))
    config = config_from_dict(
        {
            "model": str(tmp_path / "spec.yaml"),
            "data": {
                "train": [str(images), str(series)],
                "val": [str(images), str(series)],
                "shuffle_window": 4,
            },
            "train": {"steps": 2, "batch_size": 4},
            "eval": {"every_steps": 2},
            "metrics": {"tensorboard": False},
            "out": str(tmp_path / "run"),
        }
    )
    train(config)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    last = [row for row in rows if "val/0/n_samples" in row][-1]
    assert last["val/0/retrieval/image->text/n_queries"] == 20
    assert last["val/1/retrieval/timeseries->text/n_queries"] == 12
    assert not any(
        "val/0/retrieval/timeseries" in key or "val/1/retrieval/image" in key for key in last
    )


def test_a_validation_set_holding_no_pair_of_the_model_is_refused_naming_it(tmp_path):
    images, series = make_mixed_sources(tmp_path)
    only_images = {**MIXED_SPEC, "pairs": [["image", "text"]]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(only_images))
    config = config_from_dict(
        {
            "model": str(tmp_path / "spec.yaml"),
            "data": {"train": str(images), "val": str(series)},
            "train": {"steps": 1, "batch_size": 4},
            "metrics": {"tensorboard": False},
            "out": str(tmp_path / "run"),
        }
    )
    with pytest.raises(
        FieldError, match=r"data\.val\[0\]\.path.*holds only text, timeseries: no pair"
    ):
        train(config)


@pytest.mark.parametrize(
    "towers",
    [
        {"text": {"lora": {"rank": 4, "targets": ["attn"]}}},
        {"image": {"unlocked_blocks": 1}},
        {"image": {"freeze_blocks": 1}, "text": {"freeze": True}},
    ],
    ids=["lora", "unlocked", "frozen"],
)
def test_plan_record_counts_what_the_tower_modes_train(tmp_path, shards, towers):
    """The run's own plan row follows train.towers: fp32 weights for every parameter (4 B),
    gradients and AdamW moments (12 B) only for those the trainer leaves trainable."""
    from mmtrain.train.lora import apply_lora, lora_towers
    from mmtrain.train.optim import freeze_parameters

    config = make_config(tmp_path, shards, towers=towers)
    spec = ModelSpec.from_dict(MICRO_SPEC)
    model = mmtrain.create_model(spec)
    apply_lora(model, lora_towers(config.train), seed=0)
    freeze_parameters(model, config.train)
    every = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable < spec.params()
    plan = planned_memory(spec, config, world_size=1, recompute=[], device=torch.device("cpu"))
    assert plan["predicted_model_state_bytes"] == 4 * every + 12 * trainable
