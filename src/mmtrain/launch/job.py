"""What every launcher starts from: the run config, checked for the job's world size, and the
torchrun arguments the launchers share.

A launcher reads the config on the machine where it runs (the same file the job reads later):
`data.workers` sizes the CPUs a node asks for, the model sizes the checkpoint (`grace`), and
`train.batch_size` must split over nodes x ranks, an error now rather than after the queue.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mmtrain.config import RunConfig, load_config
from mmtrain.structured import FieldError

# SIGTERM is left out of what torchrun handles where the scheduler signals every process of a
# node itself (Slurm): the ranks get it once, from the scheduler (see mmtrain.launch.slurm).
SIGNALS_WITHOUT_TERM = "SIGINT,SIGHUP,SIGQUIT"


@dataclass(frozen=True)
class Job:
    """A run config to start on `nodes` x `procs_per_node` ranks."""

    config_path: Path  # absolute
    config: RunConfig
    nodes: int
    procs_per_node: int
    overrides: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: this_python())

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def name(self) -> str:
        """A job name from the run folder: letters, digits and dashes."""
        stem = Path(self.config.out).name or self.config_path.stem
        cleaned = "".join(c if c.isalnum() else "-" for c in stem.lower()).strip("-")
        return f"mmtrain-{cleaned or 'run'}"[:50]

    def cpus_per_node(self) -> int:
        """One core per rank for the main process plus one per decode worker."""
        return self.procs_per_node * (self.config.data.workers + 1)

    def train_argv(self, config_path: str | None = None) -> list[str]:
        """`mmtrain train CONFIG OVERRIDES` as the rank's arguments after `python -m ...`."""
        return ["train", config_path or str(self.config_path), *self.overrides]


def this_python() -> str:
    """This installation's Python, by absolute path but not resolved: a virtual environment's
    `bin/python` is a link, and resolving it would leave the environment."""
    return str(Path(sys.executable).absolute())


def read_job(
    config_path: str | Path,
    overrides: list[str] | tuple[str, ...],
    nodes: int,
    procs_per_node: int,
    python: str | None = None,
) -> Job:
    """Load and check CONFIG for `nodes` x `procs_per_node` ranks (FieldError naming the field)."""
    if nodes < 1:
        raise FieldError("--nodes", f"must be at least 1, got {nodes}")
    if procs_per_node < 1:
        raise FieldError("--procs-per-node", f"must be at least 1, got {procs_per_node}")
    path = Path(config_path).absolute()
    config = load_config(path, list(overrides))
    try:
        config.validate(world_size=nodes * procs_per_node)
    except FieldError as err:
        raise FieldError(
            err.path, f"{err.message} (for {nodes} node(s) x {procs_per_node} rank(s), in {path})"
        ) from None
    return Job(path, config, nodes, procs_per_node, tuple(overrides), python or this_python())


def torchrun_argv(
    job: Job,
    *,
    rdzv_endpoint: str,
    rdzv_id: str,
    module: str = "mmtrain",
    config_path: str | None = None,
) -> list[str]:
    """torchrun's options for a c10d rendezvous of `job.nodes` agents, then the rank's command.
    Per-node options (`--rdzv-conf=is_host=...`, `--local-addr`) are the caller's."""
    return [
        f"--nnodes={job.nodes}",
        f"--nproc-per-node={job.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id}",
        # A failed rank ends the job; the restart is the scheduler's (requeue, pod restart),
        # and it resumes from the newest valid checkpoint.
        "--max-restarts=0",
        "-m",
        module,
        *job.train_argv(config_path),
    ]


def shell_join(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
