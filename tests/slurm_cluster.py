"""A real Slurm on this machine for the launch tests: munged, slurmctld and two slurmd daemons
emulating the nodes `n1` and `n2` (both NodeAddr=127.0.0.1, each on its own port), Debian's
`slurm-wlm` and `munge` packages (`.ci/run` installs them).

    with SlurmCluster(folder) as cluster:       # waits until n1 and n2 are idle
        job = cluster.sbatch(script_path)
        cluster.run("scontrol", "show", "job", str(job))

Everything lives in `folder`: its own munge key and socket, slurm.conf, state, spool folders,
logs and pid files, and free ports picked at start, so it never touches a system Slurm or
munge and two test runs never meet. Commands run with SLURM_CONF pointing at this slurm.conf
(`cluster.env`). No accounting (so no sacct: jobs are followed with `scontrol show job`), no
cgroups (proctrack/linuxproc, task/none): it runs in an unprivileged container as root.

`skip_reason()` says why the tests cannot run here (daemons absent, or not root); in CI
(CI=true) the tests fail instead of skipping, since .ci/run installs the packages.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
START_TIMEOUT_S = 60


def skip_reason() -> str | None:
    """Why a real Slurm cannot run here, or None when it can."""
    missing = [d for d in DAEMONS if shutil.which(d) is None and not _in_sbin(d)]
    if missing:
        return (
            f"Slurm/munge not installed ({', '.join(missing)} missing): "
            "apt-get install slurm-wlm munge (.ci/run does this in CI)"
        )
    if os.geteuid() != 0:
        return "the Slurm test cluster runs its daemons as root (CI runs as root)"
    return None


def _in_sbin(name: str) -> bool:
    return any(Path(d, name).exists() for d in ("/usr/sbin", "/sbin"))


def _which(name: str) -> str:
    found = shutil.which(name) or next(
        (str(Path(d, name)) for d in ("/usr/sbin", "/sbin") if Path(d, name).exists()), None
    )
    if found is None:
        raise FileNotFoundError(f"{name} not found: apt-get install slurm-wlm munge")
    return found


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    """munged + slurmctld + slurmd n1, n2 under `folder`; a context manager."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.conf = self.folder / "slurm.conf"
        self.socket = self.folder / "munge" / "munge.socket"
        self._processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- life cycle
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(
                f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf)]
            )
        self._wait_idle()

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons this object started (by pid)."""
        if self._processes and self.conf.exists():
            subprocess.run(
                ["scancel", "--full", "--user", "root"],
                env=self.env,
                capture_output=True,
                timeout=30,
                check=False,
            )
        for process in reversed(self._processes):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self._processes):
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(15)
        self._processes.clear()

    # -- commands
    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        done = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}\n"
                + self.logs()
            )
        return done.stdout

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict of its Key=Value fields ({} once it is forgotten)."""
        text = self.run("scontrol", "show", "job", "--oneliner", str(job_id), check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def logs(self) -> str:
        """The daemons' logs (the end of each), for failure messages."""
        parts = []
        for path in sorted(self.folder.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-25:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # -- set-up
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.folder / f"{name}.out", "ab")  # noqa: SIM115 - the daemon owns it
        self._processes.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        )
        log.close()

    def _start_munge(self) -> None:
        folder = self.socket.parent
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
        key = folder / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        self._spawn(
            "munged",
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={key}",
                f"--pid-file={folder / 'munged.pid'}",
                f"--log-file={self.folder / 'munged.log'}",
                f"--seed-file={folder / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.socket.exists():
            if self._processes[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{self.logs()}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        state = self.folder / "state"
        state.mkdir(exist_ok=True)
        for node in NODES:
            (self.folder / "spool" / node).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        f = self.folder
        lines = [
            "ClusterName=mmtrain-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A requeued job waits cred_expire + 1 s (its old credential is revoked on the
            # nodes until then; starting earlier gets it killed): 5 s, the least Slurm takes.
            f"AuthInfo=socket={self.socket},cred_expire=5",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={f / 'spool' / '%n'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={f / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "MinJobAge=3600",  # keep finished jobs visible to `scontrol show job` (no sacct)
            "KillWait=30",
            "SchedulerParameters=sched_interval=1",
            "SlurmctldParameters=enable_configless",
        ]
        for node, port in zip(NODES, node_ports, strict=True):
            lines.append(
                f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} "
                "CPUs=2 RealMemory=1000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP"
        )
        self.conf.write_text("\n".join(lines) + "\n")

    def _wait_idle(self) -> None:
        """Until every node reports idle (slurmd registered), or a daemon died."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self._processes if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited at start:\n{self.logs()}")
            states = self.run("sinfo", "--noheader", "-N", "-o", "%N %t", check=False)
            idle = {line.split()[0] for line in states.splitlines() if line.endswith(" idle")}
            if idle >= set(NODES):
                return
            time.sleep(0.2)
        raise RuntimeError(f"nodes {NODES} not idle after {START_TIMEOUT_S} s:\n{self.logs()}")
