"""`mmtrain doctor RUN_DIR [--json]`: what a run's measurements say is wrong, and what to change."""

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
            "communication, undecodable samples, non-finite steps and loss spikes with their batches' sample keys. "
            "A healthy run gets no finding."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (`out` of mmtrain train)")
    p.add_argument("--json", action="store_true", help='print {"findings": [...]}')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mmtrain.report.doctor import diagnose
    from mmtrain.report.rundata import load_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: not a folder (give the `out` folder of a training run)")
    data = load_run(run_dir)
    findings = diagnose(data)
    if args.json:
        print(json.dumps({"findings": [f.to_dict() for f in findings]}, indent=1))
        return 0
    if not data.train_rows:
        print(f"{run_dir}: no training steps recorded yet")
    elif not findings:
        print(f"{run_dir}: no finding in {len(data.train_rows)} steps")
    for i, finding in enumerate(findings, 1):
        print(f"{i}. [{finding.severity}] {finding.kind} ({finding.span()}): {finding.why}")
        for name, value in finding.evidence.items():
            print(f"     {name}: {value}")
        print(f"   change: {finding.advice}")
    return 0
