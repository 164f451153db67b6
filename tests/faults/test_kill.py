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
from mmtrain.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

KILLS = int(os.environ.get("MMTRAIN_FAULT_KILLS", "20"))
SEED = 7
# The run must outlast the kills. Every kill moment is bounded by what the run folder shows,
# not by a time: a life is killed before the checkpoint after its target appears, and its
# target is at most 2 steps past the newest checkpoint, so a life makes at most 3 steps of
# progress on any machine, fast or slow; 4 per life leaves one step of margin.
STEPS = 4 * KILLS + 2
MOMENTS = ("starting", "in a step", "in a checkpoint write")


# Inside a checkpoint write the child's fsyncs take this long, so that a poller on a busy
# machine sees the `step_N.tmp` folder before it is renamed (unslowed, it lives a few ms).
WRITE_FSYNC_S = 0.1


class SlowFsync:
    """Child setup: every `os.fsync` sleeps WRITE_FSYNC_S first (weights are unaffected)."""

    def __call__(self) -> None:
        original = os.fsync

        def slow(fd):
            time.sleep(WRITE_FSYNC_S)
            return original(fd)

        os.fsync = slow


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


def _newest(run) -> int:
    """The newest completed checkpoint's step as the folder shows it (0: none), without
    verifying it: cheap enough to poll every few milliseconds."""
    steps = [int(n.split("_")[1]) for n in _checkpoints(run) if not n.endswith(".tmp")]
    return max(steps, default=0)


def _writing(run, at_least: int) -> bool:
    return any(
        n.endswith(".tmp") and int(n.split("_")[1].split(".")[0]) >= at_least
        for n in _checkpoints(run)
    )


def _wait_at_most(seconds: float, until, child) -> None:
    """Sleep `seconds`, cut short as soon as `until()` holds (or the child has exited)."""
    deadline = time.monotonic() + seconds
    wait_for(lambda: until() or time.monotonic() >= deadline, child, seconds + 120, 0.002)


def _kill_at(moment: str, child, run, rng, timing: dict[str, float]) -> None:
    """Wait for `moment` of the child's life, then SIGKILL it.

    The waits are polls of the run folder, as an outside observer sees it, and each ends at the
    latest when the run has checkpointed one step past its target: a life makes at most ~3
    steps of progress however fast the machine is or however late a poll comes on a busy one
    (a poll that misses a moment kills one step later instead of never). Random delays are
    drawn in units of the uninterrupted run's measured start-up and step times."""
    done = _saved_step(run)
    target = done + int(rng.integers(1, 3))
    if moment == "starting":
        # Somewhere in start-up or resume, at the latest as its first new checkpoint appears.
        delay = float(rng.uniform(0.0, timing["startup_s"]))
        _wait_at_most(delay, lambda: _newest(run) > done, child)
    elif moment == "in a step":
        wait_for(lambda: _newest(run) >= target, child, 300, 0.002)
        delay = float(rng.uniform(0.0, timing["step_s"]))
        _wait_at_most(delay, lambda: _newest(run) > target, child)
    else:
        wait_for(lambda: _writing(run, target) or _newest(run) > target, child, 300, 0.0005)
    child.signal(signal.SIGKILL)


def _timed_straight_run(config, run, log) -> dict[str, float]:
    """Run to the end uninterrupted; its start-up time (until the first checkpoint appears) and
    its time per step after that, as seen from outside."""
    started = time.monotonic()
    child = start(config, log=log)
    wait_for(lambda: _newest(run) >= 1, child, 300, 0.002)
    first = time.monotonic()
    assert child.wait(300) == 0, child.output()
    return {"startup_s": first - started, "step_s": (time.monotonic() - first) / (STEPS - 1)}


def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(tmp_path, record_property):
    config = tiny_run(tmp_path / "a", steps=STEPS)
    timing = _timed_straight_run(config, tmp_path / "a" / "run", tmp_path / "straight.log")
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
        slowed = SlowFsync() if moment == "in a checkpoint write" else None
        child = start(config, log=tmp_path / f"life{i:02d}.log", setup=slowed)
        _kill_at(moment, child, run, rng, timing)
        code = child.wait(60)
        assert code != 0, (
            f"life {i} finished the run before its kill ({kills} kills so far, checkpoints "
            f"{_checkpoints(run)}, timing {timing}): a life made more progress than planned"
        )
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
