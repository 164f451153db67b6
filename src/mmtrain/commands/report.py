"""`mmtrain report RUN_DIR [--out FILE]`: a self-contained HTML report of a training run."""

from __future__ import annotations

import argparse
from pathlib import Path

from mmtrain.cli import UsageError
from mmtrain.commands._args import add_ownership_arguments, ownership_given

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
            "as PNG files beside it. Parts the run lacks are left out with a note. With --gpu "
            "NAME, the run's measured GPU-hours priced on demand, by the month and bought."
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
    g = p.add_argument_group(
        "cost: the run's measured GPU-hours (training time x ranks) priced on demand, by the "
        "month and bought, as mmtrain plan --own does (docs/PLANNER.md, Rent or buy)"
    )
    g.add_argument(
        "--gpu",
        default=None,
        help="the catalog GPU to price the run's GPU-hours on (the report's note names the one "
        "the run recorded); without it no cost table",
    )
    add_ownership_arguments(g, on_demand=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mmtrain.plan.ownership import Given
    from mmtrain.report import build_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: not a folder (give the `out` folder of a training run)")
    if args.out is not None and Path(args.out).suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out {args.out}: give an .html file name")
    prices = ownership_given(args)
    if args.gpu is None and prices != Given():  # a price given, but no GPU to price the run on
        raise UsageError("the price flags price the run's GPU-hours on a GPU: give --gpu NAME")
    report = build_report(run_dir, args.out, gallery=not args.no_gallery, device=args.device,
                          gpu=args.gpu, prices=prices)  # fmt: skip
    drawn = [p for p in report.plots if p.png is not None]
    left_out = [p for p in report.plots if p.png is None]
    print(f"report: {report.html}")
    print(f"  {len(drawn)} charts (PNG files beside it: {report.html.stem}_*.png)")
    for plot in left_out:
        print(f"  left out: {plot.title}: {plot.note}")
    if report.costs:  # the cost table, the console's way: its title and its three rows
        print(f"  {report.costs[0].title}")
        for option, total, how in report.costs[0].rows:
            print(f"    {option}: {total} ({how})")
    for note in report.notes:
        print(f"  note: {note}")
    print(f"open it in a browser: file://{report.html.resolve()}")
    return 0
