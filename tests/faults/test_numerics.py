"""Non-finite numbers injected into a real training run: NaN inputs, an infinite loss, NaN
gradients, fp16 overflow, and several bad steps in a row. The step is skipped and counted (or,
in fp16, left to the loss scaler), the run rolls back to its last checkpoint after K in a row,
and no checkpoint nor the final weights ever hold a non-finite number."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import mmtrain
from faults.harness import tiny_run
from mmtrain.checkpoint import list_checkpoints
from mmtrain.config import load_config
from mmtrain.losses import ContrastiveLoss
from mmtrain.train import loop
from mmtrain.train.loop import train

pytestmark = pytest.mark.slow

STEPS = 6
BAD = 3  # the step that goes wrong


def _config(tmp_path, shards, **train_settings):
    path = tiny_run(
        tmp_path, steps=STEPS, shards=shards, train=train_settings, checkpoint={"keep": 100}
    )
    return load_config(path)


def _assert_nothing_non_finite_saved(run) -> int:
    """Every checkpoint and the final weights are finite; returns how many files were checked."""
    files = [path / "model.safetensors" for _, path in list_checkpoints(run / "checkpoints")]
    files.append(run / "model.safetensors")
    for file in files:
        for name, tensor in load_file(str(file)).items():
            assert torch.isfinite(tensor).all(), f"{file}: {name} is not finite"
    return len(files)


def _on_calls(calls: set[int], action):
    """A counter: call `action` on the listed (1-based) calls of the wrapped function."""
    count = [0]

    def hit() -> bool:
        count[0] += 1
        return count[0] in calls

    return hit


def _nan_gradient_at(monkeypatch, steps: set[int], value: float = math.nan) -> None:
    hit = _on_calls(steps, None)
    original = loop.optimizer_step

    def optimizer_step(model, optimizer, precision, grad_clip, **kwargs):
        if hit():
            param = next(p for p in model.parameters() if p.grad is not None)
            param.grad.view(-1)[0] = value
        return original(model, optimizer, precision, grad_clip, **kwargs)

    monkeypatch.setattr(loop, "optimizer_step", optimizer_step)


def _infinite_loss_at(monkeypatch, steps: set[int]) -> None:
    hit = _on_calls(steps, None)
    original = ContrastiveLoss.__call__

    def call(self, *args, **kwargs):
        loss, parts = original(self, *args, **kwargs)
        return (loss * math.inf, parts) if hit() else (loss, parts)

    monkeypatch.setattr(ContrastiveLoss, "__call__", call)


def test_nan_inputs_loss_and_gradients_are_skipped_and_counted(
    tmp_path, fault_shards, monkeypatch, record_property
):
    """One bad step of each kind in one run (never K in a row): three skips, no rollback."""
    config = _config(tmp_path, fault_shards)
    config.guards.inject_nan_steps = [2]  # NaN images and text embeddings in step 2
    _infinite_loss_at(monkeypatch, {4})
    _nan_gradient_at(monkeypatch, {6})
    result = train(config)
    assert result.step == STEPS and result.skipped_steps == 3 and result.rollbacks == 0
    rows = {row["step"]: row for row in result.history}
    assert not math.isfinite(rows[2]["loss"]) and not math.isfinite(rows[4]["loss"])
    assert rows[STEPS]["skipped_steps"] == 3
    checked = _assert_nothing_non_finite_saved(tmp_path / "run")
    record_property(
        "figure",
        f"3/3 bad steps (NaN input, inf loss, NaN gradient) skipped and counted; "
        f"{checked}/{checked} saved weight files finite",
    )


@pytest.mark.parametrize(
    "every",
    [2, 1],
)
def test_k_non_finite_steps_in_a_row_roll_back_to_the_last_checkpoint(
    every, tmp_path, fault_shards, record_property
):
    """Steps 3 and 4 get NaN inputs; K = 2: the run goes back to the checkpoint of step 2 (the
    last one before the streak) and trains steps 3 and 4 again, on clean inputs."""
    config = _config(tmp_path, fault_shards)
    config.checkpoint.every_steps = every
    config.guards.max_nonfinite_in_a_row = 2
    config.guards.inject_nan_steps = [BAD, BAD + 1]  # each injected once: the replay is clean
    result = train(config)
    assert result.step == STEPS and result.rollbacks == 1 and result.skipped_steps == 2
    assert [row["step"] for row in result.history] == list(range(1, STEPS + 1))
    assert all(math.isfinite(row["loss"]) for row in result.history)
    checked = _assert_nothing_non_finite_saved(tmp_path / "run")
    record_property(
        "figure",
        f"2 NaN steps in a row -> 1 rollback, steps replayed; {checked} weight files finite",
    )


def test_a_run_that_keeps_diverging_stops_with_a_clear_error(tmp_path, fault_shards, monkeypatch):
    config = _config(tmp_path, fault_shards)
    config.guards.max_nonfinite_in_a_row = 2
    config.guards.max_rollbacks = 1
    _infinite_loss_at(monkeypatch, set(range(BAD, 100)))  # every step from step 3 on
    with pytest.raises(FloatingPointError, match=r"guards\.max_rollbacks.*the run diverges"):
        train(config)
    _assert_checkpoints_finite = [
        path / "model.safetensors" for _, path in list_checkpoints(tmp_path / "run" / "checkpoints")
    ]
    assert _assert_checkpoints_finite
    for file in _assert_checkpoints_finite:
        assert all(torch.isfinite(t).all() for t in load_file(str(file)).values()), file
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_fp16_overflow_is_left_to_the_loss_scaler(
    tmp_path, fault_shards, monkeypatch, record_property
):
    config = _config(tmp_path, fault_shards, precision="fp16")
    config.guards.max_nonfinite_in_a_row = 1  # an overflow must not count towards a rollback
    _nan_gradient_at(monkeypatch, {BAD}, value=math.inf)
    result = train(config)
    # GradScaler starts at 2**16 and halves on its own first overflows: skips before step 3 are
    # expected. What matters: the injected overflow is one more skip and the scale halves, and
    # no skip (even several in a row, with K = 1) triggers a rollback.
    assert result.step == STEPS and result.rollbacks == 0
    rows = {row["step"]: row for row in result.history}
    assert rows[BAD]["skipped_steps"] == rows[BAD - 1]["skipped_steps"] + 1
    assert rows[BAD]["loss_scale"] == rows[BAD - 1]["loss_scale"] / 2
    assert rows[BAD + 1]["skipped_steps"] == rows[BAD]["skipped_steps"]  # training goes on
    scales = [row["loss_scale"] for row in result.history]
    assert all(math.isfinite(row["loss"]) for row in result.history)
    checked = _assert_nothing_non_finite_saved(tmp_path / "run")
    weights = mmtrain.load_model(tmp_path / "run").state_dict()
    assert all(t.dtype == torch.float32 for t in weights.values())
    record_property(
        "figure",
        f"overflow at step {BAD}: skipped by the scaler (scale {scales[BAD - 2]:g} -> "
        f"{scales[BAD - 1]:g}), no rollback; {checked} weight files finite",
    )
