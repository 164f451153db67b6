"""Checkpoints: atomic, verified by their manifest, resumable, pruned, weights_only-loadable."""

import json
import random

import numpy as np
import pytest
import torch

from mmtrain.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from mmtrain.train.rng import capture_rng_state, restore_rng_state


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _optimizer_state() -> dict:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.sum().backward()
    opt.step()
    return opt.state_dict()


def test_round_trip_with_optimizer_rng_and_config(tmp_path):
    state = {
        "optimizer": _optimizer_state(),
        "rng": capture_rng_state(),
        "loader": {"epoch": 2, "consumed": 17},
    }
    path = save_checkpoint(tmp_path, 10, _model(0), state, meta={"config": {"lr": 0.1}})
    assert path.name == "step_00000010"
    ckpt = load_checkpoint(path)  # uses torch.load(weights_only=True)
    assert ckpt.step == 10 and ckpt.meta["config"] == {"lr": 0.1}
    torch.testing.assert_close(ckpt.model["w"], _model(0)["w"])
    assert ckpt.state["loader"] == {"epoch": 2, "consumed": 17}
    assert ckpt.state["optimizer"]["state"][0]["exp_avg"].shape == (3,)


def test_rng_state_restores_every_generator():
    saved = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(1)
    restore_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_newest_valid_checkpoint_wins_and_corrupt_ones_are_skipped(tmp_path, caplog):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, _model(step))
    newest = tmp_path / "step_00000003"
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # one flipped bit, same size
    (newest / "model.safetensors").write_bytes(bytes(data))
    (tmp_path / "step_00000002" / "state.pt").write_bytes(b"")  # truncated
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    assert "sha256" in caplog.text and "bytes" in caplog.text
    with pytest.raises(CheckpointError, match="step_00000003"):
        load_checkpoint(newest)


def test_interrupted_write_is_invisible_and_cleaned_up(tmp_path):
    save_checkpoint(tmp_path, 1, _model(1))
    (tmp_path / "step_00000002.tmp").mkdir()  # a run killed mid-write leaves this
    (tmp_path / "step_00000002.tmp" / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    save_checkpoint(tmp_path, 2, _model(2))
    assert not (tmp_path / "step_00000002.tmp").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"


def test_missing_manifest_means_unfinished(tmp_path):
    path = save_checkpoint(tmp_path, 5, _model(5))
    (path / "manifest.json").unlink()
    assert verify_checkpoint(path) and latest_checkpoint(tmp_path) is None


def test_keep_prunes_old_valid_checkpoints_only(tmp_path):
    for step in range(1, 4):
        save_checkpoint(tmp_path, step, _model(step))
    (tmp_path / "step_00000001" / "meta.json").write_text("{}")  # corrupt: kept for inspection
    save_checkpoint(tmp_path, 4, _model(4), keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 3, 4]


def test_newer_schema_is_refused_with_a_clear_message(tmp_path):
    path = save_checkpoint(tmp_path, 1, _model(1))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="upgrade mmtrain"):
        load_checkpoint(path)
