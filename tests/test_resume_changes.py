"""Running a run's command again with changed settings (issue 40, item 2): settings that decide
the checkpoint's tensors (the spec, LoRA's presence / rank / targets, what is frozen, an EMA)
are refused with exit 2 naming each changed key and both values, and the checkpoint is left
as it was; the others (steps, learning rate, logging) resume with a warning, as before.

Real parts: the micro CLIP (tests/micro.py) trained through `mmtrain train` twice.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import yaml

from micro import MICRO_SPEC, make_shards, micro_spec
from mmtrain.cli import main


def _write(folder: Path, spec: dict, train: dict) -> Path:
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    config = {
        "model": "spec.yaml",
        "data": {"train": "shards", "shuffle_window": 8},
        "train": {"steps": 2, "batch_size": 8, "lr": 2e-3, "warmup_steps": 1, **train},
        "checkpoint": {"every_steps": 2},
        "metrics": {"tensorboard": False},
        "out": "run",
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _checkpoint_digest(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((run / "checkpoints").rglob("*"))
        if p.is_file()
    }


LORA = {"towers": {"text": {"lora": {"rank": 4}}}}


@pytest.mark.parametrize(
    ("first", "spec", "again", "named"),
    [
        (LORA, MICRO_SPEC, {"towers": {"text": {"lora": {"rank": 8}}}},
         "train.towers.text.lora.rank: 4 -> 8"),
        (LORA, MICRO_SPEC, {}, "train.towers.text.lora: {"),
        ({}, MICRO_SPEC, LORA, "train.towers.text.lora: unset -> {"),
        ({}, micro_spec(layers=3), {}, "model: towers.image.layers: 2 -> 3"),
        ({}, MICRO_SPEC, {"towers": {"image": {"freeze": True}}},
         "train.towers.image.freeze: False -> True"),
        ({}, MICRO_SPEC, {"ema": 0.99}, "train.ema: unset -> 0.99"),
    ],
    ids=["lora-rank", "lora-to-full", "full-to-lora", "spec", "freeze", "ema"],
)  # fmt: skip
def test_a_change_of_the_checkpoints_tensors_is_refused_naming_it(
    tmp_path, capsys, first, spec, again, named
):
    make_shards(tmp_path / "shards", samples=16)
    assert main(["train", str(_write(tmp_path, MICRO_SPEC, first)), "train.steps=2"]) == 0
    before = _checkpoint_digest(tmp_path / "run")
    capsys.readouterr()
    # the same command with the change, and more steps: run from another directory too
    assert main(["train", str(_write(tmp_path, spec, again)), "train.steps=4"]) == 2
    message = capsys.readouterr().err
    assert named in message
    assert "start a new `out:`, or put the old value back" in message
    assert _checkpoint_digest(tmp_path / "run") == before  # nothing written, nothing lost


def test_settings_a_resume_may_change_resume_with_a_warning(tmp_path, caplog):
    make_shards(tmp_path / "shards", samples=16)
    assert main(["train", str(_write(tmp_path, MICRO_SPEC, LORA))]) == 0
    changed = {**LORA, "towers": {"text": {"lora": {"rank": 4, "alpha": 8.0}}}}
    with caplog.at_level(logging.WARNING):
        code = main(["train", str(_write(tmp_path, MICRO_SPEC, changed)), "train.steps=4",
                     "train.lr=1e-3"])  # fmt: skip
    assert code == 0
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "resuming with changed settings" in warned and "train.lr" in warned
    assert "train.towers.text.lora.alpha" in warned  # a scale, not a shape: allowed


def test_a_changed_learning_rate_and_weight_decay_apply_from_the_resumed_step(tmp_path):
    """The checkpoint's optimizer and schedule carry the rates and AdamW settings the run
    started with; a resume with new ones trains with the new ones from its next step (the
    schedule, a function of the step, as a run started with them has it)."""
    import json

    make_shards(tmp_path / "shards", samples=16)
    path = _write(tmp_path, MICRO_SPEC, {})
    assert main(["train", str(path), "train.steps=4"]) == 0  # checkpoints at steps 2 and 4
    new = ["train.steps=6", "train.lr=5e-4", "train.weight_decay=0.05"]
    assert main(["train", str(path), *new]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    resumed = {r["step"]: r["lr"] for r in rows if "loss" in r}
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "shards").symlink_to(tmp_path / "shards")
    assert main(["train", str(_write(fresh, MICRO_SPEC, {})), *new]) == 0
    rows = [json.loads(x) for x in (fresh / "run" / "metrics.jsonl").open()]
    expected = {r["step"]: r["lr"] for r in rows if "loss" in r}
    assert [resumed[s] for s in (5, 6)] == [expected[s] for s in (5, 6)]
    assert resumed[4] != expected[4]  # before the resume: the old rate
    import torch

    state = torch.load(next((tmp_path / "run" / "checkpoints").glob("step_00000006")) / "state.pt",
                       weights_only=True)  # fmt: skip
    decays = {g["weight_decay"] for g in state["optimizer"]["param_groups"]}
    assert decays == {0.0, 0.05}  # no decay on norms, biases, embeddings; 0.05 on the rest


@pytest.mark.parametrize(
    "changed",
    [["train.lr", "train.steps"], ["train.steps"]],
    ids=["lr-and-steps", "steps-only"],
)
def test_the_resumed_step_trains_at_the_new_schedules_rate(changed):
    """A run that ended its cosine (lr 0 at its last step) resumed with more steps (and a new
    lr): its next step trains at the rate a run started with the new settings has there, not
    at the old schedule's 0 (apply_changed_settings, as the loop calls it after a resume)."""
    import torch

    from mmtrain.config import TrainConfig
    from mmtrain.train.optim import apply_changed_settings, group_settings, make_scheduler

    def set_up(steps: int, lr: float):
        weight = torch.nn.Parameter(torch.zeros(2))
        config = TrainConfig(steps=steps, batch_size=8, lr=lr, warmup_steps=1)
        optimizer = torch.optim.AdamW([{"params": [weight], "name": "text/decay"}], lr=lr)
        return optimizer, make_scheduler(optimizer, config)

    def run(optimizer, scheduler, steps: int) -> None:
        for _ in range(steps):
            optimizer.step()
            scheduler.step()

    old_optimizer, old_scheduler = set_up(4, 2e-3)
    run(old_optimizer, old_scheduler, 4)
    assert old_optimizer.param_groups[0]["lr"] == 0.0  # the end of the old cosine
    new_lr = 5e-4 if "train.lr" in changed else 2e-3
    optimizer, scheduler = set_up(6, new_lr)
    configured = group_settings(optimizer)
    optimizer.load_state_dict(old_optimizer.state_dict())
    scheduler.load_state_dict(old_scheduler.state_dict())
    apply_changed_settings(optimizer, scheduler, configured, changed)

    fresh_optimizer, fresh_scheduler = set_up(6, new_lr)  # started with the new settings
    run(fresh_optimizer, fresh_scheduler, 4)
    rate = fresh_optimizer.param_groups[0]["lr"]
    assert rate > 0 and optimizer.param_groups[0]["lr"] == rate  # step 5's rate, bit for bit
    run(optimizer, scheduler, 1)
    run(fresh_optimizer, fresh_scheduler, 1)
    assert optimizer.param_groups[0]["lr"] == fresh_optimizer.param_groups[0]["lr"]
