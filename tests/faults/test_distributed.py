"""Two gloo ranks, one of them killed: the survivor must fail fast with a clear error instead of
hanging in a collective, and running both ranks again resumes from the last checkpoint."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from faults.harness import start, step_rows, tiny_run, wait_for
from mmtrain.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

SURVIVOR_TIMEOUT_S = 60  # far below any collective timeout: a hang would show
# The victim is killed once a checkpoint of step 2 or later is seen; however late that poll
# comes on a busy machine, the run is far from its end then.
STEPS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _newest_step(run) -> int:
    """The newest completed checkpoint's step as the folder shows it (0: none yet)."""
    folder = run / "checkpoints"
    names = os.listdir(folder) if folder.is_dir() else []
    return max((int(n.split("_")[1]) for n in names if not n.endswith(".tmp")), default=0)


def _start_ranks(config, folder, name):
    port = _free_port()
    children = []
    for rank in range(2):
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        children.append(start(config, log=folder / f"{name}-rank{rank}.log", env=env))
    return children


def test_a_killed_rank_stops_the_survivor_clearly_and_a_restart_resumes(
    tmp_path, fault_shards, record_property
):
    config = tiny_run(tmp_path, steps=STEPS, shards=fault_shards, train={"micro_batch": 4})
    run = tmp_path / "run"
    survivor, victim = _start_ranks(config, tmp_path, "first")
    try:
        assert wait_for(lambda: _newest_step(run) >= 2, survivor, 300, 0.005), survivor.output()
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = survivor.wait(SURVIVOR_TIMEOUT_S)
        waited_s = time.monotonic() - killed_at
    finally:
        for child in (survivor, victim):
            child.signal(signal.SIGKILL)
    output = survivor.output()
    assert code not in (0, None), output
    # The error says that a peer went away and what to do, not just a bare traceback.
    assert "another rank of this job stopped or was killed" in output, output
    assert "restart every rank with the same command" in output, output

    resumed_from = int(latest_checkpoint(run / "checkpoints").name.split("_")[1])
    again = _start_ranks(config, tmp_path, "again")
    codes = [child.wait(300) for child in again]
    assert codes == [0, 0], again[0].output() + again[1].output()
    assert f"resumed from step {resumed_from}" in again[0].output()
    assert (run / "model.safetensors").is_file()
    assert step_rows(run) == list(range(1, STEPS + 1))
    record_property(
        "figure",
        f"survivor exited (code {code}) {waited_s:.1f} s after its peer was killed; "
        f"2-rank restart resumed from step {resumed_from} and finished",
    )
