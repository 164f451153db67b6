"""`mmtrain launch slurm` on a real Slurm: munged, slurmctld and two slurmd (nodes n1, n2 on
127.0.0.1; tests/slurm_cluster.py). A two-node job the launcher submits trains to the end; the
same job signalled mid-run checkpoints, requeues itself, resumes and ends with the same bits.

Skipped where Slurm is not installed or the user is not root, except in CI (CI=true), where
.ci/run installs it and a skip would hide a regression: there the tests fail instead.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from launch_helpers import (
    STEPS,
    THREAD_ENV,
    newest_checkpoint_step,
    shards_in,
    step_rows,
    wait_until,
    write_run,
)
from mmtrain.plan.model import from_spec
from mmtrain.spec import load_spec
from slurm_cluster import SlurmCluster, skip_reason

JOB_TIMEOUT_S = 300
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = skip_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests, but: {reason}")
        pytest.skip(reason)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as running:
        yield running


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return shards_in(tmp_path_factory.mktemp("launch-shards"))


def _submit(cluster, config, elsewhere) -> int:
    """`mmtrain launch slurm CONFIG --nodes 2 --procs-per-node 1 --submit`, run from a folder
    that is neither the config's nor the repository's: the job must not depend on it."""
    done = subprocess.run(
        [sys.executable, "-m", "mmtrain", "launch", "slurm", str(config)]
        + ["--nodes", "2", "--procs-per-node", "1", "--submit"],
        env={**cluster.env, **THREAD_ENV},
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def _job_log(folder) -> str:
    return "".join(p.read_text(errors="replace") for p in folder.glob("mmtrain-*.out"))


def _wait_final(cluster, job_id, log_folder) -> dict[str, str]:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        info = cluster.job(job_id)
        if info.get("JobState") in FINAL_STATES:
            return info
        time.sleep(0.5)
    raise AssertionError(
        f"job {job_id} not finished after {JOB_TIMEOUT_S} s: {cluster.job(job_id)}\n"
        + _job_log(log_folder)
        + cluster.logs()
    )


@pytest.fixture(scope="module")
def uninterrupted(cluster, shards, tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("slurm-uninterrupted")
    config = write_run(folder / "job", shards, steps=STEPS)
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir()
    job_id = _submit(cluster, config, elsewhere)
    info = _wait_final(cluster, job_id, elsewhere)
    log = _job_log(elsewhere)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert info["NumNodes"] == "2" and info["Restarts"] == "0", info
    assert f"done: {STEPS} steps" in log, log
    assert step_rows(folder / "job" / "run") == list(range(1, STEPS + 1))
    return (folder / "job" / "run" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_a_two_node_job_trains_to_the_end(uninterrupted):
    assert len(uninterrupted) > 0


@pytest.mark.slow
def test_a_preempted_job_checkpoints_requeues_and_ends_bitwise_identical(
    cluster, shards, uninterrupted, tmp_path, record_property
):
    config = write_run(tmp_path / "job", shards, steps=STEPS)
    run = tmp_path / "job" / "run"
    job_id = _submit(cluster, config, tmp_path)
    wait_until(
        lambda: newest_checkpoint_step(run) >= 2,
        JOB_TIMEOUT_S,
        "checkpoint of step 2",
        alive=lambda: cluster.job(job_id).get("JobState") not in FINAL_STATES,
    )
    # What Slurm sends --signal=B:USR1 to: the batch shell alone.
    cluster.run("scancel", "--signal=USR1", "--batch", str(job_id))
    info = _wait_final(cluster, job_id, tmp_path)
    log = _job_log(tmp_path)
    assert info["JobState"] == "COMPLETED", f"{info}\n{log}"
    assert info["Restarts"] == "1", f"{info}\n{log}"
    stopped = [line for line in log.splitlines() if line.startswith("stopped by a signal at step")]
    # Every rank that prints (today: each) stopped cleanly, all at the same step.
    assert stopped and len(set(stopped)) == 1, log
    step = int(stopped[0].split()[6].rstrip(";"))
    assert 2 <= step < STEPS, log
    assert f"resumed from step {step}" in log, log
    # srun's status 0: every rank on both nodes exited 0 after its checkpoint.
    assert "step ended (0); requeueing job" in log and "(restart 1)" in log, log
    assert step_rows(run) == list(range(1, STEPS + 1))
    assert (run / "model.safetensors").read_bytes() == uninterrupted
    record_property("figure", f"pre-empted after step {step}, requeued once, resumed, same bits")


# ----------------------------------------------------------------------------- the script alone
def _script(config, *extra, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmtrain", "launch", "slurm", str(config), "--nodes", "2", *extra],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )


def _sbatch_options(script: str) -> dict[str, str]:
    found = re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, re.M)
    return {k: v for k, v in found}


def test_the_script_asks_for_what_the_config_needs_and_is_valid_bash(tmp_path):
    config = write_run(tmp_path / "job", tmp_path / "shards")
    data = yaml.safe_load(config.read_text())
    data["data"]["workers"] = 2
    data["model"] = "ViT-B-16"
    config.write_text(yaml.safe_dump(data))
    done = _script(config, "--procs-per-node", "2", "--time", "02:00:00", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    script = done.stdout
    options = _sbatch_options(script)
    assert options["nodes"] == "2" and options["ntasks-per-node"] == "1"
    assert options["cpus-per-task"] == "6"  # 2 ranks x (2 decode workers + 1)
    assert "requeue" in options and options["open-mode"] == "append"
    assert options["chdir"] == str(tmp_path) and options["output"].startswith(f"{tmp_path}/")
    params = from_spec(load_spec("ViT-B-16")).params()
    expected = math.ceil(2 * params * 12 / 0.5e9 + 120)  # fp32 weights + AdamW, 0.5 GB/s
    assert options["signal"] == f"B:USR1@{expected}"
    assert f"export MMTRAIN_PYTHON={sys.executable}" in script
    assert '--rdzv-id="$SLURM_JOB_ID"' in script and "--rdzv-backend=c10d" in script
    assert "scontrol requeue" in script and "trap on_usr1 USR1" in script
    assert f"-m mmtrain.launch.worker train {config}" in script
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_setup_lines_replace_this_installation(tmp_path):
    config = write_run(tmp_path / "job", tmp_path / "shards")
    done = _script(
        config, "--setup", "module load cuda; source /opt/env/bin/activate", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "module load cuda; source /opt/env/bin/activate\nexport MMTRAIN_PYTHON=python" in (
        done.stdout
    )


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path):
    config = write_run(tmp_path / "job", tmp_path / "shards")
    done = _script(config, "--procs-per-node", "3", cwd=tmp_path)
    assert done.returncode == 2
    assert "train.batch_size" in done.stderr and "2 node(s) x 3 rank(s)" in done.stderr
