"""`mmtrain report RUN_DIR [--out FILE]`: a self-contained HTML report of a training run."""

from __future__ import annotations

import argparse
from pathlib import Path

from mmtrain.cli import UsageError

ORDER = 50


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="write report.html with plots of a training run (opens without a server)",
        description=(
            "Write a self-contained report.html of the run in RUN_DIR: a summary table, loss per "
            "pair, learning rate, logit scale, samples/s, data-wait %, MFU, memory measured vs "
            "planned, evaluation metrics over steps, and for image-text models a retrieval "
            "gallery of validation queries. The charts are embedded in the page and also saved "
            "as PNG files beside it. Parts the run lacks are left out with a note."
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (`out` of mmtrain train)")
    p.add_argument(
        "--out", metavar="FILE", help="HTML file to write (default: RUN_DIR/report.html)"
    )
    p.add_argument(
        "--no-gallery",
        action="store_true",
        help="skip the gallery (retrieval: loads the model and embeds validation samples; a "
        "language model: the answers of its eval.json beside their images)",
    )
    p.add_argument("--device", default="cpu", help="device for the gallery's model (default cpu)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mmtrain.report import build_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: not a folder (give the `out` folder of a training run)")
    if args.out is not None and Path(args.out).suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out {args.out}: give an .html file name")
    report = build_report(run_dir, args.out, gallery=not args.no_gallery, device=args.device)
    drawn = [p for p in report.plots if p.png is not None]
    left_out = [p for p in report.plots if p.png is None]
    print(f"report: {report.html}")
    print(f"  {len(drawn)} charts (PNG files beside it: {report.html.stem}_*.png)")
    for plot in left_out:
        print(f"  left out: {plot.title}: {plot.note}")
    for note in report.notes:
        print(f"  note: {note}")
    print(f"open it in a browser: file://{report.html.resolve()}")
    return 0
