"""The run report: `build_report(RUN_DIR)` writes RUN_DIR/report.html and its PNGs.

    run folder ──rundata.load_run──▶ RunData (series, plan, eval.json, checkpoints, notes)
        ──plots.make_plots──▶ training charts ─┐
        ──gallery.retrieval_gallery──▶ gallery ─┼─▶ html.render_html ─▶ report.html (+ PNGs)
        ──rundata.summary_rows──▶ summary table ┘
    ──cost_tables──▶ its GPU-hours priced three ways (plan/ownership.py), when a GPU is named

The HTML is self-contained (PNGs as data URIs, inline CSS, no script), so it opens from disk
without a server; the same PNGs are written beside it for slides and tickets. Missing parts of a
run (no eval, no plan record, a crashed run without final weights) leave their chart out with a
note, never an error; what does not apply to the run (a logit scale beside a language model's
loss, a retrieval gallery for a denoiser) is left out without one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.plan.ownership import Given, GpuHourPrices, price_gpu_hours
from mmtrain.report.html import Page, Table, render_html
from mmtrain.report.plots import Plot, make_plots
from mmtrain.report.rundata import (
    RunData,
    duration,
    flatten,
    load_run,
    summary_rows,
    training_seconds,
)

log = logging.getLogger(__name__)

REPORT_FILE = "report.html"

__all__ = ["REPORT_FILE", "Report", "RunData", "build_report", "cost_tables", "load_run"]


@dataclass
class Report:
    """What `build_report` wrote."""

    html: Path
    pngs: list[Path] = field(default_factory=list)
    # the charts that apply to the run (`make_plots`, `gallery_section`): drawn, or `note` says why
    plots: list[Plot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    costs: list[Table] = field(default_factory=list)  # `cost_tables`: [] without a GPU named


def build_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    gallery: bool = True,
    device: str = "cpu",
    gpu: str | None = None,
    prices: Given | None = None,
) -> Report:
    """Write the report of the run in `run_dir` to `out` (default RUN_DIR/report.html) and each
    chart as `<out stem>_<chart>.png` beside it. `gallery=False` skips the retrieval gallery
    (which loads the model and embeds validation samples: seconds on a CPU for tiny models).
    `gpu` (a catalog name) and `prices` price the run's measured GPU-hours (`cost_tables`)."""
    from mmtrain import __version__
    from mmtrain.atomic import atomic_write_bytes, atomic_write_text

    run = load_run(run_dir)
    costs = cost_tables(run, gpu, prices or Given())  # first: a missing price is bad usage
    html_path = Path(out) if out is not None else run.run_dir / REPORT_FILE
    html_path.parent.mkdir(parents=True, exist_ok=True)
    training = make_plots(run)
    sections: list[tuple[str, list[Plot], bool]] = [("Training", training, False)]
    gallery_plots: list[Plot] = []
    stale = set()
    if gallery:
        from mmtrain.report.gallery import GALLERY_NAMES

        stale |= {"gallery", *GALLERY_NAMES}
        found = gallery_section(run, device)
        if found is not None:
            gallery_plots = found[1]
            sections.append((found[0], gallery_plots, True))

    samples = sample_grids(run)
    if samples:
        sections.append(("Samples", samples, True))
    plots = training + gallery_plots + samples
    files = {p.name: f"{html_path.stem}_{p.name}.png" for p in plots if p.png is not None}
    pngs = []
    for plot in plots:
        if plot.png is not None:
            path = html_path.parent / files[plot.name]
            atomic_write_bytes(path, plot.png)
            pngs.append(path)
    for name in (stale | {p.name for p in plots}) - set(files):
        _remove_stale(html_path.parent / f"{html_path.stem}_{name}.png")

    name = run.spec.name if run.spec is not None else run.run_dir.name
    page = Page(
        title=f"Training report: {run.run_dir.resolve().name} ({name})",
        subtitle=str(run.run_dir.resolve()),
        summary=summary_rows(run),
        diagnosis=diagnosis_table(run),
        tables=[*costs, *eval_tables(run.eval_report)],
        sections=sections,
        notes=run.notes,
        footer=f"written by mmtrain {__version__} (mmtrain report); charts also saved as PNG "
        f"files beside this page",
        files=files,
    )
    atomic_write_text(html_path, render_html(page))
    log.debug("report written to %s (%d charts)", html_path, len(pngs))
    return Report(html=html_path, pngs=pngs, plots=plots, notes=run.notes, costs=costs)


def gallery_section(run: RunData, device: str) -> tuple[str, list[Plot]] | None:
    """The gallery of the run's kind, when the run has what it shows: a language model's
    generated answers (eval.json's examples), an image-text model's retrievals on its
    validation shards (data.val). None for other runs (a denoiser's samples are their own
    section), or without those: then the report has no gallery section."""
    from mmtrain.report.gallery import generation_gallery, retrieval_gallery

    spec = run.spec
    if spec is None:
        return None
    if spec.is_language_model():
        if not run.eval_report.get("examples"):
            return None
        return "Generation gallery", generation_gallery(run)
    modalities = [{spec.towers[a].modality, spec.towers[b].modality} for a, b in spec.pairs]
    data = run.config.get("data")
    if {"image", "text"} not in modalities or not (isinstance(data, Mapping) and data.get("val")):
        return None
    return "Retrieval gallery", retrieval_gallery(run, device=device)


def sample_grids(run: RunData) -> list[Plot]:
    """A denoiser's sample grids (RUN/samples/step_N.png, written at each validation): the
    first and the newest, a row per class, from the same seed, so they show what training
    changed."""
    from mmtrain.folders import SAMPLES_DIR

    grids = sorted((run.run_dir / SAMPLES_DIR).glob("step_*.png"))
    chosen = list(dict.fromkeys([grids[0], grids[-1]])) if grids else []
    plots = []
    for path in chosen:
        step = int(path.stem.removeprefix("step_"))
        plots.append(Plot(f"samples_{step}", f"Samples at step {step}", path.read_bytes(),
                          "a row per class, the same noise at every step"))  # fmt: skip
    return plots


def diagnosis_table(run: RunData) -> Table | None:
    """`mmtrain doctor`'s findings, the costliest first (a row saying so when there is none);
    None before the first training step."""
    from mmtrain.report.doctor import diagnose

    if not run.train_rows:
        return None
    findings = diagnose(run)
    title = f"Diagnosis (mmtrain doctor, {len(run.train_rows)} steps)"
    header = ["finding", "severity", "evidence", "why", "change", "cost"]
    rows = [
        [f.kind, f.severity, f.evidence_text(), f.why, f.advice, f"{f.cost_s:.3g} s"]
        for f in findings
    ]
    return Table(title, header, rows or [["none", "", "", "", "", ""]], numeric=(5,))


def cost_tables(run: RunData, gpu: str | None, given: Given) -> list[Table]:
    """The run's measured GPU-hours (training time, as the summary counts it, x its ranks)
    priced on demand, by the month and bought with plan/ownership.py's arithmetic, then the
    catalog defaults that priced them. Without `gpu`, or before the first step, no table: a
    note in `run.notes` says why (and which flag to give). A missing or bad price raises
    FieldError naming its flag."""
    seconds = training_seconds(run)
    ranks = run.world_size()
    hours = (seconds or 0.0) / 3600 * ranks
    if gpu is None:
        if seconds is None:  # nothing measured: nothing to say
            return []
        run.notes.append(f"cost left out ({_ran_on(run)}, {hours:.3g} device-hours "
                         "measured): give --gpu NAME and your prices (mmtrain report --help; "
                         "an error names any the catalog lacks) to price them as on that "
                         "GPU")  # fmt: skip
        return []
    p = price_gpu_hours(hours, gpu, given)  # first: bad prices are errors, steps or none
    if seconds is None:
        run.notes.append("cost left out: metrics.jsonl has no step times to price")
        return []
    rows = _cost_rows(p)
    title = (f"Cost of the measured GPU-hours ({p.currency}): {hours:,.2f} GPU-hours = "
             f"{duration(seconds)} x {ranks} rank(s) on {gpu}, over "
             f"{given.horizon_months:g} months")  # fmt: skip
    tables = [Table(title, ["option", "total", "how"], rows, numeric=(1,))]
    if p.defaults_used:
        used = [[f.name, f"{f.value:g}", f.flag, f.source, f.as_of] for f in p.defaults_used]
        header = ["default", "value", "flag to override", "source", "as of"]
        tables.append(Table("Catalog defaults in the cost", header, used, numeric=(1,)))
    return tables


def _ran_on(run: RunData) -> str:
    """Where the run trained, from its layout record, with the catalog key for --gpu."""
    from mmtrain.hardware import default_catalog
    from mmtrain.structured import FieldError

    layouts = run.events.get("layout", [])
    device = str(layouts[-1].get("device", "")) if layouts else ""
    if device in ("", "cpu"):
        return "a CPU run" if device else "its device not recorded"
    try:
        return f"ran on {device}: --gpu {default_catalog().resolve_device(device)[0].key}"
    except FieldError:
        return f"ran on {device}, a GPU the catalog lacks"


def _cost_rows(p: GpuHourPrices) -> list[list[str]]:
    """option, total, how: buying is priced only at a given utilisation (the run does not say
    how busy an owned fleet would be), and always shows where it breaks even."""
    be = {k: "never" if v is None else f"{v:.1%}" for k, v in p.break_even_utilisation.items()}
    if p.utilisation is None:
        buy, how = "-", "give --utilisation (of the owned fleet) to price it"
    elif p.buy is None:
        buy, how = "never", "an idle fleet (utilisation 0) never pays for itself"
    else:
        buy, how = f"{p.buy:,.2f}", f"at {p.utilisation:.1%} utilisation"
    how += f"; breaks even with on demand at {be['on_demand']}, monthly at {be['monthly']}"
    return [
        ["on_demand", f"{p.on_demand:,.2f}", "each GPU-hour at the hourly price"],
        ["monthly", f"{p.monthly:,.2f}", "rented servers fully used"],
        ["buy", buy, how],
    ]


def eval_tables(report: Mapping[str, Any]) -> list[Table]:
    """Tables of eval.json: retrieval per direction, then the other numbers it holds; the same
    for each further validation set (`other_sets`, written by the training loop)."""
    tables = _eval_set_tables(report)
    others = report.get("other_sets")
    for i, other in enumerate(others if isinstance(others, list) else [], start=1):
        if isinstance(other, Mapping):
            tables += _eval_set_tables(other, f" set {i}")
    return tables


def _eval_set_tables(report: Mapping[str, Any], which: str = "") -> list[Table]:
    tables = []
    details = [f"on {report['data']}"] if report.get("data") else []
    if isinstance(report.get("step"), int):
        details.append(f"at step {report['step']}")
    source = " ".join([f"eval.json{which}", *details])
    retrieval = report.get("retrieval")
    if isinstance(retrieval, Mapping) and retrieval:
        ks = sorted(
            {
                k
                for m in retrieval.values()
                if isinstance(m, Mapping)
                for k in m
                if k.startswith("R@")
            },
            key=lambda k: int(k[2:]) if k[2:].isdigit() else 0,
        )
        header = ["direction", *ks, "mean rank", "median rank", "queries"]
        rows = []
        for direction, metrics in retrieval.items():
            if isinstance(metrics, Mapping):
                rows.append(
                    [
                        direction,
                        *(_percent(metrics.get(k)) for k in ks),
                        _number(metrics.get("mean_rank")),
                        _number(metrics.get("median_rank")),
                        _number(metrics.get("n_queries")),
                    ]
                )
        title = f"Final retrieval ({source})"
        tables.append(Table(title, header, rows, numeric=range(1, len(header))))
    other = {
        key: report[key]
        for key in ("perplexity", "nll_per_token", "target_tokens")  # a language model's
        if isinstance(report.get(key), (int, float)) and not isinstance(report.get(key), bool)
    }
    other |= {
        key: value
        for section in ("zeroshot", "clip_score", "probe", "fusion", "generation")
        if isinstance(report.get(section), Mapping)
        for key, value in flatten(report[section], section).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    if other:
        rows = [[key, _number(value)] for key, value in other.items()]
        tables.append(
            Table(f"Other evaluation metrics ({source})", ["metric", "value"], rows, (1,))
        )
    return tables


def _percent(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return f"{value:,}" if isinstance(value, int) else f"{value:,.4g}"


def _remove_stale(path: Path) -> None:
    """A chart drawn by an earlier report but not this time: remove it, so no PNG beside the
    report contradicts it."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass
