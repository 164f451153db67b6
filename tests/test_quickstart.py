"""The quickstart: its data set (names, captions, split, images), its missing-package message,
and a small end-to-end run (a few hundred emoji, a few steps) that writes every output."""

from __future__ import annotations

import importlib.util
import io
import json

import numpy as np
import pytest
from PIL import Image

from mmtrain.cli import main
from mmtrain.quickstart import QuickstartConfig
from mmtrain.quickstart import emoji_data as qd
from mmtrain.quickstart.budget import plan_steps
from mmtrain.quickstart.common import chance_levels, check_out
from mmtrain.quickstart.image_text import quickstart_spec
from mmtrain.structured import FieldError

HAVE_EXTRA = all(importlib.util.find_spec(m) is not None for m in qd.REQUIRED)
needs_extra = pytest.mark.skipif(
    not HAVE_EXTRA,
    reason="the quickstart's optional packages are not installed: pip install 'mmtrain[quickstart]'",
)


# ----------------------------------------------------------------------------- data set
def test_split_is_a_stable_hash_of_the_key():
    keys = [f"{i:x}" for i in range(0x1F300, 0x1F300 + 2000)]
    held_out = [k for k in keys if qd.is_validation(k, 0.1)]
    assert 150 < len(held_out) < 250  # about 10%
    assert held_out == [k for k in keys if qd.is_validation(k, 0.1)]  # same every time
    # a larger fraction keeps every key a smaller one held out (the split is a threshold)
    assert set(held_out) <= {k for k in keys if qd.is_validation(k, 0.3)}


def test_caption_is_the_bare_name():
    item = qd.Emoji("1f44d-1f3fd", "thumbs up, medium skin tone", None)
    assert qd.caption(item) == "thumbs up, medium skin tone"


def test_on_white_composites_transparency_onto_white():
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[:2] = (200, 0, 0, 255)  # opaque red top half, transparent (black) bottom half
    buffer = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buffer, format="PNG")
    out = np.asarray(Image.open(io.BytesIO(qd.on_white(buffer.getvalue()))))
    assert out.shape == (4, 4, 3)
    assert (out[:2] == (200, 0, 0)).all() and (out[2:] == 255).all()


@needs_extra
def test_emoji_names_are_readable_with_skin_tones_and_flags():
    import emoji

    names = emoji.EMOJI_DATA
    assert qd.emoji_name("1f44d-1f3fd", names) == "thumbs up, medium skin tone"
    assert qd.emoji_name("1f1e9-1f1ea", names) == "flag of Germany"
    assert qd.emoji_name("1f600", names) == "grinning face"
    two_tones = qd.emoji_name("1f9d1-1f3fb-200d-1f91d-200d-1f9d1-1f3ff", names)
    assert two_tones == "people holding hands, light skin tone and dark skin tone"
    assert qd.emoji_name("1f1e6", names) == "regional indicator symbol letter a"


@needs_extra
def test_list_emoji_covers_the_twemoji_set_with_unique_keys():
    items = qd.list_emoji()
    assert len(items) > 3500
    assert len({i.key for i in items}) == len(items)
    assert all(i.png.is_file() and i.name for i in items[:: len(items) // 20])
    subset = qd.list_emoji(limit=50)
    assert len(subset) == 50 and subset[0].key == items[0].key


# ----------------------------------------------------------------------------- settings
def test_chance_level_is_k_over_n():
    assert chance_levels(400) == {"R@1": 1 / 400, "R@5": 5 / 400, "R@10": 10 / 400}
    assert chance_levels(3)["R@5"] == 1.0


def test_plan_steps_is_fixed_unless_the_budget_is_too_small():
    config = QuickstartConfig(steps=300, minutes=4.0)
    assert plan_steps(config, step_seconds=0.1) == 300  # fits: the fixed count, any machine
    steps = plan_steps(config, step_seconds=1.0)
    assert 180 <= steps < 240  # 240 s of steps, less the margin for data and validation
    assert plan_steps(config, step_seconds=1.0, spent_s=120.0) < steps / 2 + 1
    with pytest.raises(FieldError, match="--minutes"):
        plan_steps(config, step_seconds=60.0)


def test_spec_is_tiny_clip_with_the_quickstart_input_sizes():
    spec = quickstart_spec(QuickstartConfig(image_size=32, context_length=72))
    assert spec.towers["image"].stem.image_size == 32
    assert spec.towers["text"].stem.context_length == 72
    assert all(t.width == 128 and t.layers == 2 for t in spec.towers.values())
    assert spec.towers["text"].pooling == "mean"
    full_depth = quickstart_spec(QuickstartConfig(layers=None))
    assert all(t.layers == 5 for t in full_depth.towers.values())  # tiny-clip's own depth


def test_out_folder_with_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FieldError, match="other files"):
        check_out(tmp_path)
    check_out(tmp_path / "new")  # a folder that does not exist yet is fine


def test_missing_packages_exit_2_naming_the_install_command(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(qd, "REQUIRED", {"mmtrain_no_such_module": "no-such-package==1"})
    code = main(["quickstart", "--out", str(tmp_path / "qs"), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install 'mmtrain[quickstart]'" in err and "no-such-package" in err
    assert not (tmp_path / "qs").exists()  # nothing written


# ----------------------------------------------------------------------------- end to end
@needs_extra
@pytest.mark.slow
def test_small_quickstart_writes_data_run_eval_and_report(tmp_path, capsys):
    out = tmp_path / "qs"
    argv = ["quickstart", "--out", str(out), "--limit", "200", "--steps", "3"]
    assert main([*argv, "--batch-size", "16"]) == 0
    printed = capsys.readouterr().out
    run = out / "run"
    for path in ("model.safetensors", "spec.yaml", "config.yaml", "metrics.jsonl", "report.html"):
        assert (run / path).is_file(), path
    assert "CC-BY 4.0" in (out / "ATTRIBUTION.txt").read_text()
    train_manifest = json.loads((out / "data" / "train" / "manifest.json").read_text())
    val_manifest = json.loads((out / "data" / "val" / "manifest.json").read_text())
    n_train, n_val = train_manifest["counts"]["samples"], val_manifest["counts"]["samples"]
    assert n_train + n_val == 200 and 5 <= n_val <= 40

    report = json.loads((run / "eval.json").read_text())
    assert report["n_samples"] == n_val
    for direction in ("image->text", "text->image"):
        metrics = report["retrieval"][direction]
        assert metrics["n_queries"] == n_val
        for k in ("R@1", "R@5", "R@10"):
            assert 0.0 <= metrics[k] <= 1.0
        assert metrics["R@1"] <= metrics["R@5"] <= metrics["R@10"]
    assert str(run / "report.html") in printed and str(run / "eval.json") in printed
    assert f"chance: R@1 {100 / n_val:.1f}%" in printed
    # the held-out keys are exactly those the hash puts there
    val_keys = sorted(p.stem for p in (out / "data" / "raw" / "val").glob("*.png"))
    assert val_keys and all(qd.is_validation(k, 0.1) for k in val_keys)
