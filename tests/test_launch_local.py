"""`mmtrain launch local --nodes 2`: two torchrun agents on this host, one rendezvous. Stopped
with one SIGTERM (what Ctrl-C becomes), both ranks checkpoint and exit 0 — each got the signal
once, from its agent — and the same command then resumes to the uninterrupted run's bits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from launch_helpers import (
    REPO,
    STEPS,
    THREAD_ENV,
    newest_checkpoint_step,
    reference_weights,
    shards_in,
    step_rows,
    wait_all,
    wait_until,
    write_run,
)
from mmtrain.report.rundata import load_run

pytestmark = pytest.mark.slow


def _launch(config, log):
    handle = open(log, "ab")  # noqa: SIM115 - the child owns it
    process = subprocess.Popen(
        [sys.executable, "-m", "mmtrain", "launch", "local", str(config)]
        + ["--nodes", "2", "--procs-per-node", "1"],
        env={**os.environ, **THREAD_ENV},
        stdout=handle,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    handle.close()
    return process


def test_two_local_agents_stop_on_one_sigterm_and_resume_to_the_same_bits(
    tmp_path, tmp_path_factory
):
    shards = shards_in(tmp_path / "shards")
    reference = reference_weights(tmp_path_factory.getbasetemp(), shards)
    config = write_run(tmp_path / "job", shards)
    run = tmp_path / "job" / "run"

    first = _launch(config, tmp_path / "first.log")
    try:
        wait_until(
            lambda: newest_checkpoint_step(run) >= 2,
            240,
            "checkpoint of step 2",
            alive=lambda: first.poll() is None,
        )
        first.send_signal(signal.SIGTERM)
    finally:
        codes = wait_all([first])
    log = (tmp_path / "first.log").read_text(errors="replace")
    assert codes == [0], log
    stopped = [line for line in log.splitlines() if line.startswith("stopped by a signal at step")]
    assert stopped and len(set(stopped)) == 1, log  # every rank at the same step
    step = newest_checkpoint_step(run)
    assert f"at step {step};" in stopped[0] and step < STEPS, log

    again = _launch(config, tmp_path / "again.log")
    codes = wait_all([again])
    log = (tmp_path / "again.log").read_text(errors="replace")
    assert codes == [0], log
    assert f"resumed from step {step}" in log, log
    assert step_rows(run) == list(range(1, STEPS + 1))
    assert (run / "model.safetensors").read_bytes() == reference
    # each start records torchrun's nodes: 2 ranks, one per node (LOCAL_WORLD_SIZE)
    layouts = load_run(run).events["layout"]
    assert [(r["world_size"], r["ranks_per_node"]) for r in layouts] == [(2, 1), (2, 1)]
