"""Two nodes with their own network addresses: two Linux network namespaces joined by a veth
pair (10.x.y.1 and 10.x.y.2, no other route between them), one `mmtrain launch local
--node-rank R` agent in each. Training runs; node 1 is killed (every process in its namespace);
the survivor stops with the trainer's clear message; both restart and the run resumes to the
weights of the uninterrupted two-rank run. Needs root (CI runs as root) and `ip`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from launch_helpers import (
    REPO,
    STEPS,
    THREAD_ENV,
    free_port,
    newest_checkpoint_step,
    reference_weights,
    shards_in,
    step_rows,
    wait_all,
    wait_until,
    write_run,
)

pytestmark = pytest.mark.slow


def _skip_reason() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    return None


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Namespaces A and B joined by a veth pair; yields (names, addresses); removed after."""
    reason = _skip_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the namespace test, but: {reason}")
        pytest.skip(reason)
    tag = os.getpid() % 10000
    names = (f"mmt{tag}a", f"mmt{tag}b")
    subnet = f"10.{200 + tag % 50}.{tag % 250}"
    addresses = (f"{subnet}.1", f"{subnet}.2")
    links = (f"mmt{tag}va", f"mmt{tag}vb")
    try:
        for name in names:
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, addresses, strict=True):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
        yield names, addresses
    finally:
        for name in names:
            _kill_namespace(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in namespace `name`: the whole node dies at once."""
    pids = subprocess.run(
        ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
    ).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_nodes(config, names, addresses, port, folder, tag):
    nodes = []
    for rank, name in enumerate(names):
        log = open(folder / f"{tag}-node{rank}.log", "ab")  # noqa: SIM115 - the child owns it
        argv = ["ip", "netns", "exec", name, sys.executable, "-m", "mmtrain", "launch", "local"]
        argv += [str(config), "--nodes", "2", "--procs-per-node", "1"]
        argv += ["--rdzv-host", addresses[0], "--rdzv-port", str(port), "--node-rank", str(rank)]
        nodes.append(
            subprocess.Popen(
                argv,
                env={**os.environ, **THREAD_ENV},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
        log.close()
    return nodes


def test_two_namespaced_nodes_train_survive_a_dead_node_and_resume(
    two_hosts, tmp_path, tmp_path_factory, record_property
):
    names, addresses = two_hosts
    shards = shards_in(tmp_path / "shards")
    reference = reference_weights(tmp_path_factory.getbasetemp(), shards)
    config = write_run(tmp_path / "job", shards, steps=STEPS)
    run = tmp_path / "job" / "run"

    first = _start_nodes(config, names, addresses, free_port(), tmp_path, "first")
    try:
        wait_until(
            lambda: newest_checkpoint_step(run) >= 2,
            240,
            "checkpoint of step 2",
            alive=lambda: all(p.poll() is None for p in first),
        )
        _kill_namespace(names[1])
        survivor_code = first[0].wait(120)
    finally:
        for p in first:
            if p.poll() is None:
                p.kill()
            p.wait(30)
    survivor_log = (tmp_path / "first-node0.log").read_text(errors="replace")
    assert survivor_code != 0, survivor_log
    assert "another rank of this job stopped or was killed" in survivor_log, survivor_log
    assert "restart every rank with the same command" in survivor_log, survivor_log
    resumed_from = newest_checkpoint_step(run)
    assert 2 <= resumed_from < STEPS

    again = _start_nodes(config, names, addresses, free_port(), tmp_path, "again")
    codes = wait_all(again)
    logs = "".join((tmp_path / f"again-node{r}.log").read_text(errors="replace") for r in (0, 1))
    assert codes == [0, 0], logs
    assert f"resumed from step {resumed_from}" in logs, logs
    assert step_rows(run) == list(range(1, STEPS + 1))
    assert (run / "model.safetensors").read_bytes() == reference
    record_property(
        "figure", f"node 1 killed after checkpoint {resumed_from}; both restarted; same bits"
    )
