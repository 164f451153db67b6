"""A full disk during a checkpoint write, and checkpoint files damaged at rest.

The disk fills up in the child process through RLIMIT_FSIZE (SIGXFSZ ignored): any write past
the limit fails with EFBIG, as a write to a full disk fails with ENOSPC, at the same place.
"""

from __future__ import annotations

import signal

import pytest
from safetensors.torch import load_file

from faults.conftest import STEPS
from faults.harness import start, step_rows, tiny_run, wait_for
from mmtrain.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint

pytestmark = pytest.mark.slow


def _kill_after_checkpoint(config, run, step: int, log):
    """Train until checkpoint `step` exists, then SIGKILL (a crash; nothing else written)."""
    child = start(config, log=log)
    name = f"step_{step:08d}"
    assert wait_for(lambda: (run / "checkpoints" / name).is_dir(), child, 300, 0.005)
    child.signal(signal.SIGKILL)
    child.wait(60)


def test_full_disk_during_a_checkpoint_keeps_the_previous_one_and_resumes(
    tmp_path, fault_shards, reference, record_property
):
    config = tiny_run(tmp_path, steps=STEPS, shards=fault_shards)
    run = tmp_path / "run"
    _kill_after_checkpoint(config, run, 3, tmp_path / "first.log")
    before = latest_checkpoint(run / "checkpoints")
    assert before is not None
    weights_bytes = (before / "model.safetensors").stat().st_size

    # The next checkpoint's weights no longer fit: the write fails part-way through.
    full = start(config, log=tmp_path / "full.log", file_size_limit=weights_bytes // 2)
    code = full.wait(300)
    output = full.output()
    assert code == 1, output
    assert "cannot write checkpoint" in output and "File too large" in output, output
    assert not list((run / "checkpoints").glob("*.tmp"))  # the failed write cleaned up after itself
    newest = latest_checkpoint(run / "checkpoints")
    assert newest is not None and newest.name >= before.name and not verify_checkpoint(newest)
    assert not (run / "model.safetensors").exists()

    resumed = start(config, log=tmp_path / "resumed.log")
    assert resumed.wait(300) == 0, resumed.output()
    assert f"resumed from step {int(newest.name.split('_')[1])}" in resumed.output()
    assert (run / "model.safetensors").read_bytes() == reference
    assert step_rows(run) == list(range(1, STEPS + 1))
    record_property(
        "figure",
        f"write failed at {weights_bytes // 2} of {weights_bytes} bytes; previous checkpoint "
        f"{newest.name} verified; resumed run bitwise identical",
    )


def test_damaged_checkpoints_are_detected_by_the_manifest_and_skipped(
    tmp_path, fault_shards, reference, record_property
):
    config = tiny_run(tmp_path, steps=STEPS, shards=fault_shards, checkpoint={"keep": 8})
    run = tmp_path / "run"
    _kill_after_checkpoint(config, run, 4, tmp_path / "first.log")
    saved = [path for _, path in list_checkpoints(run / "checkpoints")]
    assert len(saved) >= 4
    truncated, flipped, deleted = saved[-1], saved[-2], saved[-3]
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    state = bytearray((flipped / "state.pt").read_bytes())
    state[len(state) // 2] ^= 0x10  # one bit, same size
    (flipped / "state.pt").write_bytes(bytes(state))
    (deleted / "meta.json").unlink()
    problems = [verify_checkpoint(path) for path in (truncated, flipped, deleted)]
    assert "bytes, manifest says" in problems[0][0]
    assert "sha256" in problems[1][0]
    assert "missing" in problems[2][0]
    # The weights themselves are still loadable: only the manifest tells they are damaged.
    load_file(str(flipped / "model.safetensors"))

    resumed = start(config, log=tmp_path / "resumed.log")
    assert resumed.wait(300) == 0, resumed.output()
    output = resumed.output()
    good = saved[-4]
    assert f"resumed from step {int(good.name.split('_')[1])}" in output, output
    for path in (truncated, flipped, deleted):
        assert f"skipping checkpoint {path}" in output
    assert (run / "model.safetensors").read_bytes() == reference
    record_property(
        "figure",
        "3/3 damaged checkpoints (truncated, 1 bit flipped, file deleted) skipped; "
        "resumed from the last good one, bitwise identical",
    )
