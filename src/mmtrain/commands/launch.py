"""`mmtrain launch slurm|k8s|local CONFIG.yaml ...`: what a scheduler runs, around torchrun.

`slurm` prints an sbatch script (`--submit`: submits it and prints the job id), `k8s` prints a
Kubeflow PyTorchJob manifest (`--jobset`: a JobSet), `local` starts several torchrun agents
on this host (or one agent of a job spread over hosts). See docs/MULTINODE.md.
"""

from __future__ import annotations

import argparse
import sys

from mmtrain.commands._args import count
from mmtrain.structured import FieldError

ORDER = 35


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="write (or submit) a multi-node job around torchrun: slurm, k8s, local",
        description=__doc__.splitlines()[0],
    )
    kinds = p.add_subparsers(dest="scheduler", metavar="SCHEDULER", required=True)
    _slurm(kinds)
    _k8s(kinds)
    _local(kinds)


def _common(p: argparse.ArgumentParser, *, gpus: bool = True) -> None:
    p.add_argument("config", help="run config YAML (what `mmtrain train` reads)")
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides for every rank"
    )
    p.add_argument("--nodes", type=count, required=True, help="nodes (one torchrun agent each)")
    ranks = p.add_mutually_exclusive_group()
    if gpus:
        ranks.add_argument("--gpus-per-node", type=count, help="GPUs per node = ranks per node")
    ranks.add_argument("--procs-per-node", type=count, help="ranks per node (CPU jobs: gloo)")
    p.add_argument(
        "--signal-seconds",
        type=int,
        help="lead time to stop before the end (default: the planner's checkpoint estimate)",
    )
    p.add_argument(
        "--checkpoint-write-gbps",
        type=float,
        default=None,
        help="assumed checkpoint write rate in GB/s for the estimate (default 0.5)",
    )


def _slurm(kinds) -> None:
    p = kinds.add_parser("slurm", help="print (or --submit) an sbatch script")
    _common(p)
    p.add_argument("--partition")
    p.add_argument("--time", help="time limit, HH:MM:SS")
    p.add_argument("--account")
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra #SBATCH line, e.g. --sbatch-arg=--qos=high (repeatable)",
    )
    p.add_argument(
        "--setup",
        help="shell lines run first on the node (module load ...; source .../activate); the "
        "script then runs `python` from PATH instead of this installation's",
    )
    p.add_argument("--submit", action="store_true", help="submit with sbatch; print the job id")
    p.set_defaults(func=run_slurm)


def _k8s(kinds) -> None:
    p = kinds.add_parser("k8s", help="print a Kubeflow PyTorchJob (or --jobset JobSet) manifest")
    _common(p)
    p.add_argument("--image", required=True, help="container image with mmtrain installed")
    p.add_argument("--namespace", default="default")
    p.add_argument("--name", help="job name (default: from the run's `out` folder)")
    p.add_argument("--pvc", help="a PersistentVolumeClaim to mount (data, run folder)")
    p.add_argument("--mount", default="/workspace", help="where --pvc is mounted")
    p.add_argument(
        "--workdir", help="the container's working directory (default: --mount with --pvc)"
    )
    p.add_argument("--elastic", action="store_true", help="elasticPolicy with c10d rendezvous")
    p.add_argument("--max-restarts", type=count, default=3)
    p.add_argument("--jobset", action="store_true", help="a JobSet instead of a PyTorchJob")
    p.add_argument("--shm-gb", type=float, default=None, help="size limit of /dev/shm")
    p.set_defaults(func=run_k8s)


def _local(kinds) -> None:
    p = kinds.add_parser(
        "local", help="run several torchrun agents on this host (or one agent of a multi-host job)"
    )
    _common(p, gpus=False)
    p.add_argument("--rdzv-host", default="127.0.0.1", help="rendezvous host (node 0's address)")
    p.add_argument("--rdzv-port", type=int, help="rendezvous port (default: a free one)")
    p.add_argument("--rdzv-id", help="rendezvous id (default: the job name)")
    p.add_argument(
        "--node-rank",
        type=int,
        help="start only this node's agent (node 0 hosts the rendezvous), e.g. on another host",
    )
    p.add_argument("--local-addr", help="this node's address as the others reach it")
    p.add_argument("--print", action="store_true", help="print the commands instead of running")
    p.set_defaults(func=run_local)


# ----------------------------------------------------------------------------- running
def _job(args: argparse.Namespace):
    from mmtrain.launch.grace import DEFAULT_WRITE_GB_PER_S, Grace, grace_for
    from mmtrain.launch.job import read_job

    procs = getattr(args, "gpus_per_node", None) or args.procs_per_node or 1
    job = read_job(args.config, args.overrides, args.nodes, procs)
    if args.signal_seconds is not None:
        if args.signal_seconds < 1:
            raise FieldError("--signal-seconds", f"must be positive, got {args.signal_seconds}")
        grace = Grace(0, 0.0, args.signal_seconds)
    else:
        grace = grace_for(job.config, args.checkpoint_write_gbps or DEFAULT_WRITE_GB_PER_S)
    return job, grace


def run_slurm(args: argparse.Namespace) -> int:
    from mmtrain.cli import UsageError
    from mmtrain.launch.slurm import SlurmOptions, sbatch_script, submit

    job, grace = _job(args)
    options = SlurmOptions(
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        time=args.time,
        account=args.account,
        sbatch_args=tuple(args.sbatch_arg),
        setup=args.setup,
    )
    try:
        script = sbatch_script(job, grace, options)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not args.submit:
        sys.stdout.write(script)
        return 0
    try:
        print(submit(script, options.workdir))
    except (RuntimeError, FileNotFoundError) as err:
        print(f"mmtrain launch slurm: {err}", file=sys.stderr)
        return 1
    return 0


def run_k8s(args: argparse.Namespace) -> int:
    from mmtrain.launch.k8s import K8sOptions, jobset, pytorchjob, to_yaml

    job, grace = _job(args)
    options = K8sOptions(
        image=args.image,
        namespace=args.namespace,
        name=args.name,
        gpus_per_node=args.gpus_per_node,
        pvc=args.pvc,
        mount=args.mount,
        workdir=args.workdir or (args.mount if args.pvc else None),
        elastic=args.elastic,
        max_restarts=args.max_restarts,
        shm_gb=args.shm_gb,
        config_path=args.config,
    )
    manifest = jobset(job, grace, options) if args.jobset else pytorchjob(job, grace, options)
    sys.stdout.write(to_yaml(manifest))
    return 0


def run_local(args: argparse.Namespace) -> int:
    from mmtrain.launch.local import LocalOptions, agent_commands, run_agents

    job, grace = _job(args)
    options = LocalOptions(
        rdzv_host=args.rdzv_host,
        rdzv_port=args.rdzv_port,
        rdzv_id=args.rdzv_id,
        node_rank=args.node_rank,
        local_addr=args.local_addr,
        shutdown_s=grace.seconds,
    )
    commands = agent_commands(job, options)
    if args.print:
        for command in commands:
            print(command.shell())
        return 0
    return run_agents(commands)
