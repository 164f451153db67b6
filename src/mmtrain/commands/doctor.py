"""`mmtrain doctor RUN_DIR [RUN_DIR ...] [--json]`: what a run's measurements say is wrong, and
what to change; given runs of one config at different GPU counts, also how well it scales."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmtrain.cli import UsageError

ORDER = 55


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="diagnose a training run from its measurements (also while it trains)",
        description=(
            "Read RUN_DIR's metrics and say what is wrong, costliest first: each finding with "
            "its evidence (metric, value, steps), why it matters and the change to make (a "
            "config key and value, or a command). Checks: input-bound steps, exposed "
            "communication, undecodable samples, non-finite steps and loss spikes with their "
            "batches' sample keys, learning rates, fp16/fp8 overflows, MFU under half the "
            "planner's figure, a CUDA run's memory past its plan or its device (--relevance and "
            "--quality examine a loss spike's samples). Several RUN_DIRs of one config at different GPU counts add "
            "their scaling efficiency (per-rank throughput against the run with the fewest "
            "ranks). A healthy run gets no finding."
        ),
    )
    p.add_argument(
        "run_dirs",
        metavar="RUN_DIR",
        nargs="+",
        help="the run folder (`out` of mmtrain train); several: one config at several GPU counts",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"findings": [...]}; several runs: the scaling finding there, and '
        '{"runs": {RUN_DIR: {"findings": [...]}}}',
    )
    p.add_argument(
        "--relevance",
        action="store_true",
        help="score the samples of loss-spike batches with the run's own image-text model "
        "against its other samples, and give the relevance filter that drops them (loads "
        "the model)",
    )
    p.add_argument(
        "--quality",
        action="store_true",
        help="measure the samples of loss-spike batches as `mmtrain data build` filters do "
        "(image side, aspect, sharpness, caption length) against the run's other samples, "
        "and give the filters that drop them (reads the training shards)",
    )
    p.add_argument("--device", default="cpu", help="device for --relevance (default cpu)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mmtrain.report.doctor import diagnose
    from mmtrain.report.rundata import load_run
    from mmtrain.report.scaling import ScalingInputError, scaling

    for run_dir in map(Path, args.run_dirs):
        if not run_dir.is_dir():
            raise UsageError(f"{run_dir}: not a folder (give the `out` folder of a training run)")
    runs = [load_run(run_dir) for run_dir in args.run_dirs]
    together = []
    if len(runs) > 1:
        try:
            together = [f for f in [scaling(runs)] if f is not None]
        except ScalingInputError as err:
            raise UsageError(str(err)) from None
    each = {str(run.run_dir): diagnose(run) for run in runs}
    if args.relevance or args.quality:
        for run in runs:
            each[str(run.run_dir)] = [_examined(run, f, args) for f in each[str(run.run_dir)]]
    if args.json:
        per_run = {name: {"findings": [f.to_dict() for f in v]} for name, v in each.items()}
        if len(runs) == 1:
            out = next(iter(per_run.values()))
        else:
            out = {"findings": [f.to_dict() for f in together], "runs": per_run}
        print(json.dumps(out, indent=1))
        return 0
    if len(runs) > 1:
        print(f"across {len(runs)} runs: " + ("scaling" if together else "no scaling finding"))
        _print(together)
    for run in runs:
        findings = each[str(run.run_dir)]
        if not run.train_rows:
            print(f"{run.run_dir}: no training step recorded" + (":" if findings else " yet"))
        elif not findings:
            print(f"{run.run_dir}: no finding in {len(run.train_rows)} steps")
        elif len(runs) > 1:
            print(f"{run.run_dir}:")
        _print(findings)
    return 0


def _examined(run, finding, args: argparse.Namespace):
    """A loss spike with its samples examined (report/doctor.py examine_spike); others as
    they are."""
    from mmtrain.report.doctor import examine_spike
    from mmtrain.report.run_model import ModelUnavailable
    from mmtrain.report.spike_samples import SamplesUnavailable

    if finding.kind != "loss_spike":
        return finding
    try:
        return examine_spike(run, finding, relevance=args.relevance, quality=args.quality,
                             device=args.device)  # fmt: skip
    except (ModelUnavailable, SamplesUnavailable) as err:
        flags = " ".join(f for f, on in (("--relevance", args.relevance),
                                         ("--quality", args.quality)) if on)  # fmt: skip
        raise UsageError(f"{run.run_dir}: {flags}: {err}") from None


def _print(findings: list) -> None:
    for i, finding in enumerate(findings, 1):
        print(f"{i}. [{finding.severity}] {finding.kind} ({finding.span()}): {finding.why}")
        for name, value in finding.evidence.items():
            print(f"     {name}: {value}")
        print(f"   change: {finding.advice}")
