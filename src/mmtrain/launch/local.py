"""`mmtrain launch local`: torchrun agents ("nodes") that meet in one c10d rendezvous.

Without `--node-rank` every node's agent runs here, on one host: the multi-node path (one
rendezvous, a rank per process, node-crossing collectives) on a laptop. With `--node-rank R`
only node R's agent runs, so the same command on R hosts (or network namespaces) forms one job;
node 0 hosts the rendezvous (`is_host`, never guessed from names or addresses), and each agent
names the address the others reach it at (`--local-addr`, by default the source address of its
route to the rendezvous host), since the ranks' MASTER_ADDR is that of the agent holding rank 0.

Stopping: the agents run in their own sessions with SIGTERM ignored (as under Slurm, see
mmtrain.launch.slurm), so Ctrl-C in a terminal or a SIGTERM reaches this process alone, which
sends one SIGTERM to each rank (the agents' children). The ranks finish their step, checkpoint
and exit 0, and torchrun, seeing its ranks succeed, exits 0 too. Through torchrun the signal
would end in a torchrun failure whatever the ranks did, and a rank takes a second signal as
"exit now, without a checkpoint".
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

from mmtrain.launch.address import free_port, interface_of, route_source
from mmtrain.launch.job import SIGNALS_WITHOUT_TERM, Job, shell_join, torchrun_argv
from mmtrain.structured import FieldError


@dataclass(frozen=True)
class LocalOptions:
    rdzv_host: str = "127.0.0.1"
    rdzv_port: int | None = None
    rdzv_id: str | None = None
    node_rank: int | None = None  # None: every node's agent, here
    local_addr: str | None = None
    shutdown_s: int = 30  # torchrun's wait for its ranks after a signal


@dataclass(frozen=True)
class AgentCommand:
    node_rank: int
    argv: list[str]
    env: dict[str, str]  # added to this process's environment

    def shell(self) -> str:
        assignments = [f"{k}={v}" for k, v in sorted(self.env.items())]
        return shell_join([*assignments, *self.argv])


def agent_commands(job: Job, options: LocalOptions) -> list[AgentCommand]:
    """The torchrun command of each node to start here."""
    if options.node_rank is not None:
        if not 0 <= options.node_rank < job.nodes:
            raise FieldError(
                "--node-rank", f"must be in 0..{job.nodes - 1} for --nodes {job.nodes}"
            )
        if options.rdzv_port is None:
            raise FieldError(
                "--rdzv-port", "needed with --node-rank: every node's agent must name the same one"
            )
        ranks = [options.node_rank]
    else:
        ranks = list(range(job.nodes))
    port = options.rdzv_port or free_port()
    endpoint = f"{options.rdzv_host}:{port}"
    rdzv_id = options.rdzv_id or job.name
    local_addr = options.local_addr or _local_addr(options)
    env = {
        "PET_SHUTDOWN_TIMEOUT": str(options.shutdown_s),
        "PET_SIGNALS_TO_HANDLE": SIGNALS_WITHOUT_TERM,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_WITHOUT_TERM,
    }
    interface = interface_of(local_addr)
    if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo binds to the address of the host's name otherwise, often 127.0.0.1.
        env["GLOO_SOCKET_IFNAME"] = interface
    return [
        AgentCommand(
            rank,
            [
                job.python,
                "-m",
                "torch.distributed.run",
                f"--rdzv-conf=is_host={int(rank == 0)}",
                f"--local-addr={local_addr}",
                *torchrun_argv(
                    job, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, module="mmtrain.launch.worker"
                ),
            ],
            env,
        )
        for rank in ranks
    ]


def _local_addr(options: LocalOptions) -> str:
    if options.node_rank is None:
        return options.rdzv_host  # every agent on this host: the rendezvous host is this one
    return route_source(options.rdzv_host)


def run_agents(commands: list[AgentCommand]) -> int:
    """Start every agent, wait for all; 0 when all succeeded, else the first failure's code
    (1 for an agent killed by a signal). SIGINT/SIGTERM here become one SIGTERM per rank."""
    processes = [
        subprocess.Popen(
            c.argv, env={**os.environ, **c.env}, start_new_session=True, preexec_fn=_ignore_term
        )
        for c in commands
    ]
    stopping = []

    def stop(signum, frame) -> None:
        if stopping:
            return  # one SIGTERM per rank; a second would abort its checkpoint
        stopping.append(signum)
        for p in processes:
            for pid in _children(p.pid):
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [p.wait() for p in processes]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = [c for c in codes if c != 0]
    if not failed:
        return 0
    return failed[0] if failed[0] > 0 else 1


def _ignore_term() -> None:
    """In the agent before exec: SIGTERM ignored (the ranks restore it, mmtrain.launch.worker)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _children(pid: int) -> list[int]:
    """Pids of the processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found
