"""SIGTERM (a preemption notice) during data loading, during the forward pass and during a
checkpoint write: a run with no step since its last checkpoint stops at once (that checkpoint
stands), one with a step since finishes its step and writes a valid checkpoint; each exits 0,
and running the same command again ends bitwise where an uninterrupted run ends.

The signal is raised from inside the child (a hook at the exact place) so that it lands where
the test says; a real `python -m mmtrain train` process stopped from outside covers the CLI's
exit code.
"""

from __future__ import annotations

import os
import signal

import pytest

from faults.conftest import STEPS
from faults.harness import start, step_rows, tiny_run, wait_for
from mmtrain.checkpoint import latest_checkpoint, verify_checkpoint

pytestmark = pytest.mark.slow

AT_CALL = 3  # the hook's 3rd call: step 3's data or forward, step 3's checkpoint write


class SigtermInside:
    """Child setup: wrap `module.attribute` so that its AT_CALL-th call sends this process a
    SIGTERM and then carries on (the signal is handled at the next bytecode, mid-call)."""

    def __init__(self, module: str, attribute: str):
        self.module, self.attribute = module, attribute

    def __call__(self) -> None:
        import importlib

        owner = importlib.import_module(self.module)
        *path, name = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        calls = [0]

        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == AT_CALL:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)


# Where the signal lands, and the step whose checkpoint the run stops with. The run saves every
# step: in step 3's data loading or forward no step has completed since step 2's checkpoint,
# so the run stops there at once; during step 3's checkpoint write step 3 has completed, and
# the signal is seen at the next step boundary (the loop checks before it saves).
PLACES = {
    "data loading": (SigtermInside("mmtrain.train.data", "TrainData.next_batch"), 2),
    "forward": (SigtermInside("mmtrain.models.build", "MultimodalModel.forward"), 2),
    "checkpoint write": (SigtermInside("mmtrain.checkpoint", "save_file"), 4),
}


@pytest.mark.parametrize("place", list(PLACES))
def test_sigterm_ends_with_a_valid_checkpoint_and_exit_0(
    place, tmp_path, fault_shards, reference, record_property
):
    config = tiny_run(tmp_path, steps=STEPS, shards=fault_shards)
    run = tmp_path / "run"
    setup, stop_step = PLACES[place]
    child = start(config, log=tmp_path / "stopped.log", setup=setup)
    assert child.wait(300) == 0, child.output()
    assert f"stopped by a signal at step {stop_step}" in child.output(), child.output()
    newest = latest_checkpoint(run / "checkpoints")
    assert newest.name == f"step_{stop_step:08d}" and not verify_checkpoint(newest)
    assert not list((run / "checkpoints").glob("*.tmp"))

    resumed = start(config, log=tmp_path / "resumed.log")
    assert resumed.wait(300) == 0, resumed.output()
    assert f"resumed from step {stop_step}" in resumed.output()
    assert (run / "model.safetensors").read_bytes() == reference
    assert step_rows(run) == list(range(1, STEPS + 1))
    record_property(
        "figure",
        f"SIGTERM in {place} of step 3: exit 0, checkpoint of step {stop_step} verified, "
        "resumed run bitwise identical",
    )


def test_sigterm_to_the_command_from_outside_exits_0(tmp_path, fault_shards, record_property):
    config = tiny_run(tmp_path, steps=200, shards=fault_shards)
    run = tmp_path / "run"
    child = start(config, log=tmp_path / "out.log", real_process=True)
    assert wait_for(lambda: (run / "checkpoints" / "step_00000002").is_dir(), child, 300, 0.01)
    child.signal(signal.SIGTERM)
    assert child.wait(120) == 0, child.output()
    newest = latest_checkpoint(run / "checkpoints")
    assert newest is not None and not verify_checkpoint(newest)
    assert f"stopped by a signal at step {int(newest.name.split('_')[1])}" in child.output()
    record_property("figure", f"`python -m mmtrain train` stopped at {newest.name}: exit 0")


def test_sigterm_while_a_replay_after_a_rollback_saves_finishes_the_save(
    tmp_path, fault_shards, monkeypatch
):
    """Steps 3 and 4 are non-finite (K = 2): the run rolls back to step 2's checkpoint and
    trains step 3 again, saving it over the bad streak's step 3. A SIGTERM during that save is
    a step completed since the checkpoint rolled back to: the save completes, the run finishes
    its next step, saves it and stops; no half-written checkpoint is left."""
    import mmtrain.checkpoint
    from mmtrain.checkpoint import load_checkpoint
    from mmtrain.config import load_config
    from mmtrain.train.loop import train

    config = load_config(tiny_run(tmp_path, steps=STEPS, shards=fault_shards))
    config.guards.max_nonfinite_in_a_row = 2
    config.guards.inject_nan_steps = [3, 4]
    commit, calls = mmtrain.checkpoint._commit, [0]

    def commit_with_a_signal(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:  # steps 1, 2 and the bad 3 saved; then the replayed step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return commit(*args, **kwargs)

    monkeypatch.setattr(mmtrain.checkpoint, "_commit", commit_with_a_signal)
    result = train(config)
    assert result.stopped_by_signal and result.rollbacks == 1 and result.step == 4
    checkpoints = tmp_path / "run" / "checkpoints"
    newest = latest_checkpoint(checkpoints)
    assert newest.name == "step_00000004" and not verify_checkpoint(newest)
    assert not list(checkpoints.glob("*.tmp")) and not list(checkpoints.glob(".*.replaced"))
    assert load_checkpoint(newest).state["counters"]["rollbacks"] == 1
