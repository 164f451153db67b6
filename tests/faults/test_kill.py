"""SIGKILL at random moments, resume each time: the end result is bitwise the uninterrupted one.

One run folder is killed again and again (at seeded random moments: while it starts or resumes,
during a step, and inside a checkpoint write, caught by polling for the `step_N.tmp` folder), and
every restart is the same `mmtrain train` command, which resumes from the newest checkpoint whose
manifest verifies. After the last kill the run finishes; its `model.safetensors` must equal, byte
for byte, that of a run that was never interrupted, and its metrics log must hold each step once.

`MMTRAIN_FAULT_KILLS` sets the number of kills (default 20).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

from faults.harness import start, step_rows, tiny_run, wait_for
from mmtrain.train.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("MMTRAIN_FAULT_KILLS", "20"))
SEED = 7
# The run must outlast the kills: a life makes at most 3 steps of progress before its kill.
STEPS = 3 * KILLS + 2
MOMENTS = ("starting", "in a step", "in a checkpoint write")


def _checkpoints(run):
    folder = run / "checkpoints"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def _tmp_folders(run) -> set[tuple[str, int, int]]:
    """Half-written checkpoint folders, with inode and mtime (a rewrite is a new folder)."""
    found = set()
    for name in _checkpoints(run):
        if name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                info = os.stat(run / "checkpoints" / name)
                found.add((name, info.st_ino, info.st_mtime_ns))
    return found


def _saved_step(run) -> int:
    path = latest_checkpoint(run / "checkpoints")
    return int(path.name.split("_")[1]) if path is not None else 0


def _kill_at(moment: str, child, run, rng, step_s: float) -> None:
    """Wait for `moment` of the child's next step (after the newest valid checkpoint), then
    SIGKILL it. The waits are short polls of the run folder, as an outside observer sees it."""
    done = _saved_step(run)
    target = f"step_{done + int(rng.integers(1, 3)):08d}"
    if moment == "starting":
        time.sleep(float(rng.uniform(0.0, 1.0)))
    elif moment == "in a step":
        wait_for(lambda: target in _checkpoints(run), child, 120, 0.005)
        time.sleep(float(rng.uniform(0.0, step_s)))
    else:
        wait_for(lambda: target + ".tmp" in _checkpoints(run), child, 120, 0.0005)
    child.signal(signal.SIGKILL)


def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(tmp_path, record_property):
    config = tiny_run(tmp_path / "a", steps=STEPS)
    started = time.monotonic()
    straight = start(config, log=tmp_path / "straight.log")
    assert straight.wait(300) == 0, straight.output()
    step_s = (time.monotonic() - started) / STEPS  # generous: includes start-up
    expected = (tmp_path / "a" / "run" / "model.safetensors").read_bytes()

    config = tiny_run(tmp_path / "b", steps=STEPS, shards=tmp_path / "a" / "shards")
    run = tmp_path / "b" / "run"
    rng = np.random.default_rng(SEED)
    landed = {moment: 0 for moment in MOMENTS}
    inside_write = 0
    kills = 0
    for i in range(KILLS):
        moment = MOMENTS[int(rng.choice(len(MOMENTS), p=[0.15, 0.45, 0.4]))]
        before = _tmp_folders(run)
        child = start(config, log=tmp_path / f"life{i:02d}.log")
        _kill_at(moment, child, run, rng, step_s)
        code = child.wait(60)
        if code == 0:
            break  # it finished before the moment came: nothing left to kill
        assert code == -signal.SIGKILL, child.output()
        kills += 1
        landed[moment] += 1
        # The kill landed inside a write when it left a new half-written folder behind.
        inside_write += bool(_tmp_folders(run) - before)

    final = start(config, log=tmp_path / "final.log")
    assert final.wait(300) == 0, final.output()
    assert (run / "model.safetensors").read_bytes() == expected, (
        "the killed-and-resumed run must end with the uninterrupted run's weights, bit for bit"
    )
    assert kills == KILLS and inside_write >= 1
    record_property(
        "figure",
        f"{kills}/{KILLS} SIGKILL points, bitwise identical "
        f"({landed['starting']} while starting or resuming, {landed['in a step']} in a step, "
        f"{inside_write} inside a checkpoint write)",
    )
    # The log reads like one run: each step once, in order (rows after the last checkpoint of a
    # killed life are dropped on resume).
    assert step_rows(run) == list(range(1, STEPS + 1))
