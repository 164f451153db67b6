"""`mmtrain launch slurm`: an sbatch script that runs one torchrun per node through srun.

What the script does, and why:
- The batch script runs on the job's first node, so that node hosts the c10d rendezvous: it
  finds its own address there (`mmtrain.launch.address`; the names `scontrol show hostnames`
  prints need not resolve anywhere) and a free port, then starts `srun` with one task per node.
  Each task runs torchrun with `--rdzv-id=$SLURM_JOB_ID`, `is_host` true only on the batch
  node (so two "nodes" sharing an address never both try to host the store), and
  `--local-addr` set to the address that node reaches the head from (the ranks' MASTER_ADDR is
  the local address of the node that gets rank 0).
- `--signal=B:USR1@T` sends USR1 to the batch shell alone, T seconds before the time limit
  (`grace`). Its trap sends SIGTERM to every process of the job's steps
  (`scancel --signal=TERM $SLURM_JOB_ID`, not the batch shell), the ranks finish their step,
  write a checkpoint and exit 0, and the script then calls `scontrol requeue`; the requeued
  job (same id, logs appended: `--open-mode=append`) resumes from that checkpoint. A
  background `scontrol requeue` after T - 30 s requeues the job even if a checkpoint hangs.
- torchrun runs with SIGTERM ignored and not in its handled signals: Slurm delivers SIGTERM to
  every process of a step (pre-emption, `scancel`, the time limit, the trap above), so each
  rank already gets it once from Slurm; torchrun forwarding it again would be a second signal,
  which the trainer takes as "exit now, without a checkpoint" (mmtrain.train.loop's
  StopOnSignal), and torchrun would kill the ranks after its shutdown timeout. With torchrun
  out of the way, the ranks stop on their own, exit 0, and torchrun ends with them. The ranks
  run through `mmtrain.launch.worker`, which restores SIGTERM's default action the ignore would
  otherwise pass down.
- The script names everything by absolute path: this installation's Python (or the user's
  `--setup` lines and `python`), the config, the working directory (`--chdir`: data paths and
  `out` in a config are relative to it) and the log, so it can be submitted from any folder.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from mmtrain import __version__
from mmtrain.launch.grace import Grace
from mmtrain.launch.job import SIGNALS_WITHOUT_TERM, Job, shell_join, torchrun_argv

REQUEUE_MARGIN_S = 30  # the watchdog requeues this long before the time limit


@dataclass(frozen=True)
class SlurmOptions:
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None  # HH:MM:SS or any form sbatch accepts
    account: str | None = None
    sbatch_args: tuple[str, ...] = ()
    setup: str | None = None  # shell lines run before anything else (module load, activate)
    workdir: str = field(default_factory=lambda: str(Path.cwd()))


def _time_ok(value: str) -> bool:
    return re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", value) is not None


def sbatch_script(job: Job, grace: Grace, options: SlurmOptions) -> str:
    """The batch script's text."""
    if options.time is not None and not _time_ok(options.time):
        raise ValueError(f"--time {options.time!r}: use HH:MM:SS, MM or D-HH:MM:SS")
    workdir = Path(options.workdir).absolute()
    header = [
        f"--job-name={job.name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the node's ranks
        f"--cpus-per-task={job.cpus_per_node()}",
        *([f"--gpus-per-node={options.gpus_per_node}"] if options.gpus_per_node else []),
        *([f"--partition={options.partition}"] if options.partition else []),
        *([f"--time={options.time}"] if options.time else []),
        *([f"--account={options.account}"] if options.account else []),
        "--requeue",
        f"--signal=B:USR1@{grace.seconds}",
        "--open-mode=append",
        f"--chdir={workdir}",
        f"--output={workdir}/{job.name}-%j.out",
        *options.sbatch_args,
    ]
    python = "python" if options.setup else job.python
    torchrun = [
        *torchrun_argv(
            job,
            rdzv_endpoint="RDZV_ENDPOINT",  # replaced below by the shell variable
            rdzv_id="RDZV_ID",
            module="mmtrain.launch.worker",
        ),
    ]
    quoted = shell_join(torchrun)
    quoted = quoted.replace("--rdzv-endpoint=RDZV_ENDPOINT", '--rdzv-endpoint="$MMTRAIN_RDZV"')
    quoted = quoted.replace("--rdzv-id=RDZV_ID", '--rdzv-id="$SLURM_JOB_ID"')
    wait_s = max(grace.seconds - REQUEUE_MARGIN_S, 1)
    lines = [
        "#!/bin/bash",
        f"# Written by `mmtrain launch slurm` (mmtrain {__version__}) for {job.config_path}:",
        f"# {job.nodes} node(s) x {job.procs_per_node} rank(s), one torchrun per node through srun.",
        f"# {grace.describe()}.",
        "# Submit from any folder: sbatch THIS_FILE. USR1 before the time limit -> the ranks",
        "# checkpoint and exit 0 -> scontrol requeue -> the requeued job resumes.",
        *(f"#SBATCH {shlex.quote(h)}" for h in header),
        "set -uo pipefail  # no -e: a failed step must still reach the requeue below",
        *([options.setup] if options.setup else []),
        f"export MMTRAIN_PYTHON={shlex.quote(python)}",
        'echo "mmtrain: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST"',
        "# The rendezvous lives on this node (the batch script runs on the job's first node).",
        "export MMTRAIN_HEAD_NODE=$SLURMD_NODENAME",
        'head_addr=$("$MMTRAIN_PYTHON" -m mmtrain.launch.address) || exit 1',
        'port=$("$MMTRAIN_PYTHON" -m mmtrain.launch.address --free-port) || exit 1',
        'export MMTRAIN_RDZV="$head_addr:$port"',
        "# torchrun leaves SIGTERM to the ranks, which get it from Slurm (see mmtrain.launch.slurm).",
        f"export PET_SIGNALS_TO_HANDLE={SIGNALS_WITHOUT_TERM}",
        f"export TORCHELASTIC_SIGNALS_TO_HANDLE={SIGNALS_WITHOUT_TERM}",
        "",
        "preempted=0",
        "watchdog=",
        "on_usr1() {",
        "  preempted=1",
        '  echo "mmtrain: USR1: the time limit is near; the ranks checkpoint, then the job requeues"',
        '  scancel --signal=TERM "$SLURM_JOB_ID"  # every process of the steps, not this shell',
        f'  (sleep {wait_s}; echo "mmtrain: no clean stop in time; requeueing"; '
        'scontrol requeue "$SLURM_JOB_ID") &',
        "  watchdog=$!",
        "}",
        "trap on_usr1 USR1",
        "trap 'echo \"mmtrain: SIGTERM: the ranks got it too and checkpoint\"' TERM",
        "",
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '",
        '  is_host=0; [ "$SLURMD_NODENAME" = "$MMTRAIN_HEAD_NODE" ] && is_host=1',
        '  local_addr=$("$MMTRAIN_PYTHON" -m mmtrain.launch.address "${MMTRAIN_RDZV%:*}") || exit 1',
        '  interface=$("$MMTRAIN_PYTHON" -m mmtrain.launch.address --interface "$local_addr") &&',
        "    export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$interface}",
        '  trap "" TERM USR1',
        '  exec "$MMTRAIN_PYTHON" -m torch.distributed.run --rdzv-conf=is_host=$is_host \\',
        '    --local-addr="$local_addr" "$@"',
        f"' mmtrain-node {quoted} &",
        "step=$!",
        "while true; do",
        '  wait "$step"; status=$?',
        '  kill -0 "$step" 2>/dev/null || break  # a trap interrupted the wait: wait on',
        "done",
        '[ -n "$watchdog" ] && kill "$watchdog" 2>/dev/null',
        'if [ "$preempted" = 1 ]; then',
        '  echo "mmtrain: step ended ($status); requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def submit(script: str, workdir: str | Path) -> int:
    """`sbatch --parsable` the script (from stdin); the job id. Raises RuntimeError with
    sbatch's message when it refuses."""
    done = subprocess.run(
        ["sbatch", "--parsable"],
        input=script,
        capture_output=True,
        text=True,
        cwd=workdir,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
    return int(done.stdout.strip().split(";")[0])
