"""The report's plots: one small function per chart, each returning a `Plot` (PNG bytes, or a
note saying why there is nothing to draw).

Every training run has the general charts (loss, learning rate, throughput, data wait, MFU,
memory): one left undrawn keeps its note (a crash, an unknown peak). The others belong to some
runs only (a contrastive model's temperature, communication on several ranks, validation, a
denoiser's validation): `make_plots` leaves them out, silently, where the run has no data for
them. The loss is named by the run's objective.

Figures are built as `matplotlib.figure.Figure` objects with the Agg canvas directly, never
through `pyplot`: no global figure registry, no backend switching, nothing left behind in the
calling process (a notebook or a training job can build a report safely).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from mmtrain.report.rundata import RunData, eval_label, planned_memory_gib

DPI = 110
SIZE_IN = (6.4, 3.4)
SMOOTH_ABOVE = 30  # points; longer noisy curves get a smoothed line over the faint raw one
PALETTE = ("#1f6feb", "#d9480f", "#2f9e44", "#9c36b5", "#0c8599", "#c2255c", "#5c940d", "#495057")


@dataclass
class Plot:
    """One chart of the report: `png` is None when the run has no data for it (`note` says why)."""

    name: str  # file stem: the PNG is written as NAME.png beside report.html
    title: str
    png: bytes | None
    note: str = ""


@dataclass
class Line:
    label: str
    steps: Sequence[float]
    values: Sequence[float]
    smooth: bool = False  # draw the raw values faintly and an exponential average on top
    style: str = "-"
    marker: str | None = None
    color: str | None = None  # default: the next colour of PALETTE


# ----------------------------------------------------------------------------- drawing
def figure(
    lines: Sequence[Line],
    *,
    ylabel: str,
    xlabel: str = "optimizer step",
    hlines: Sequence[tuple[str, float]] = (),
    logy: bool = False,
    ylim: tuple[float | None, float | None] | None = None,
) -> bytes:
    """PNG bytes of a line chart (one Figure, rendered by Agg, then dropped)."""
    fig = Figure(figsize=SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, line in enumerate(lines):
        color = line.color or PALETTE[i % len(PALETTE)]
        single = len(line.values) == 1
        marker = line.marker or ("o" if single or len(line.values) <= 12 else None)
        if line.smooth and len(line.values) > SMOOTH_ABOVE:
            ax.plot(line.steps, line.values, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(line.steps, smooth(line.values), color=color, label=line.label, linewidth=1.6)
        else:
            ax.plot(
                line.steps,
                line.values,
                line.style,
                color=color,
                label=line.label,
                marker=marker,
                markersize=4,
                linewidth=1.6,
            )
    for j, (label, value) in enumerate(hlines):
        color = PALETTE[(len(lines) + j) % len(PALETTE)]
        ax.axhline(value, color=color, linestyle="--", linewidth=1.4, label=label)
    if logy:
        ax.set_yscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    entries = len(lines) + len(hlines)
    if entries > 3:  # below the axes: a big legend inside would hide the curves
        ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    elif entries > 1:
        ax.legend(fontsize=8, frameon=False)
    return to_png(fig)


def to_png(fig: Figure) -> bytes:
    """Render a Figure to PNG bytes without timestamps or software tags (reproducible files)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi="figure", metadata={"Software": None})
    return buffer.getvalue()


def smooth(values: Sequence[float]) -> list[float]:
    """Bias-corrected exponential moving average over about 1/20 of the curve."""
    window = max(2, len(values) // 20)
    decay = 1.0 - 1.0 / window
    out, mean, weight = [], 0.0, 0.0
    for value in values:
        mean = decay * mean + (1 - decay) * value
        weight = decay * weight + (1 - decay)
        out.append(mean / weight)
    return out


def _missing(name: str, title: str, why: str) -> Plot:
    return Plot(name, title, None, why)


# ----------------------------------------------------------------------------- the charts
# What each objective's loss is (the loss chart's title, then its y axis).
LOSS_NAMES = {
    "clip": ("Contrastive loss", "contrastive loss (InfoNCE)"),
    "siglip": ("Sigmoid contrastive loss", "sigmoid loss (SigLIP)"),
    "triplet": ("Triplet loss", "triplet margin loss"),
    "next_token": ("Next-token loss", "cross-entropy per target token (nats)"),
    "flow_matching": ("Flow-matching loss", "mean squared error of the velocity"),
}


def loss_names(spec: Any) -> tuple[str, str]:
    """(title, y-axis label) of the run's loss, by its model's objective; a model with a
    fusion head adds its loss (cross-entropy of the classes or the targets' squared error)."""
    if spec is None:
        return "Loss", "loss"
    if spec.objective == "diffusion":
        return "Diffusion loss", f"mean squared error of the {spec.denoiser.prediction}"
    if spec.fusion is None:
        return LOSS_NAMES.get(spec.objective, ("Loss", "loss"))
    fusion = "cross-entropy" if spec.fusion.task == "classify" else "squared error"
    if not spec.pairs:
        return "Fusion-head loss", f"fusion head's {fusion}"
    title, _ = LOSS_NAMES.get(spec.objective, ("Loss", "loss"))
    return f"{title} + fusion-head loss", f"{title.lower()} + weighted {fusion}"


def loss_plot(run: RunData) -> Plot:
    name, ylabel = loss_names(run.spec)
    parts = run.keys("loss/")  # per pair, "fusion"
    title = f"{name} (total and per part)" if len(parts) > 1 else name
    steps, values = run.series("loss")
    if not values:
        return _missing("loss", title, "no training rows with a finite loss in metrics.jsonl")
    lines = [Line("total", steps, values, smooth=True)]
    if len(parts) > 1:  # with one part its loss is the total: do not draw it twice
        lines += [Line(k[len("loss/") :], *run.series(k), smooth=True) for k in parts]
    note = ""
    if len(parts) == 1:
        note = f"one part ({parts[0][len('loss/') :]}): its loss is the total"
    return Plot("loss", title, figure(lines, ylabel=ylabel), note)


def lr_plot(run: RunData) -> Plot:
    title = "Learning rate"
    groups = run.keys("lr/")
    distinct = {tuple(run.series(k)[1]) for k in groups}
    if len(groups) > 1 and len(distinct) > 1:  # parameter groups with different rates
        lines = [Line(k[len("lr/") :], *run.series(k)) for k in groups]
    else:
        lines = [Line("lr", *run.series("lr"))]
    if not lines[0].values:
        return _missing("lr", title, "no learning rate in metrics.jsonl")
    return Plot("lr", title, figure(lines, ylabel="learning rate"))


def logit_scale_plot(run: RunData) -> Plot:
    title = "Logit scale (inverse temperature)"
    steps, values = run.series("logit_scale")
    if not values:
        return _missing("logit_scale", title, "no logit scale in metrics.jsonl")
    return Plot("logit_scale", title, figure([Line("logit scale", steps, values)], ylabel="scale"))


def throughput_plot(run: RunData) -> Plot:
    title = "Throughput"
    steps, values = run.series("samples_per_s")
    if not values:
        return _missing("throughput", title, "no samples/s in metrics.jsonl")
    line = Line("samples/s", steps, values, smooth=True)
    return Plot(
        "throughput", title, figure([line], ylabel="samples / s (all ranks)", ylim=(0, None))
    )


# (metrics.jsonl key, legend, line style): the step split, then communication drawn beside it.
STEP_TIME_PARTS = (
    ("data_wait_s", "data wait", "-"),
    ("compute_s", "forward+backward", "-"),
    ("optimizer_s", "optimizer", "-"),
    ("comm_s", "communication in flight", "--"),
    ("comm_exposed_s", "communication waited for", ":"),
)


def step_time_plot(run: RunData) -> Plot:
    """The step split beside its communication; drawn for runs on several ranks (the only
    ones with communication: one process's split is in throughput and data wait)."""
    title = "Step time and communication"
    if not run.series("comm_s")[1]:
        why = "no communication in metrics.jsonl: one process, or a run older than the figures"
        return _missing("step_time", title, why)
    lines = []
    for key, label, style in STEP_TIME_PARTS:
        steps, values = run.series(key)
        if values:
            ms = [1e3 * v for v in values]
            lines.append(Line(label, steps, ms, smooth=True, style=style))
    note = (
        "data wait + forward+backward + optimizer = the step; communication runs inside "
        "forward+backward (overlapping it, not a fourth slice): 'in flight' counts every "
        "collective, 'waited for' only the time the step could not compute meanwhile"
    )
    return Plot("step_time", title, figure(lines, ylabel="ms per step", ylim=(0, None)), note)


def data_wait_plot(run: RunData) -> Plot:
    title = "Time waiting for data"
    steps, values = run.series("data_wait_fraction")
    if not values:
        return _missing("data_wait", title, "no data-wait fraction in metrics.jsonl")
    line = Line("data wait", steps, [100 * v for v in values], smooth=True)
    note = "share of each step spent waiting for the next batch; high means the loader starves the model"
    return Plot("data_wait", title, figure([line], ylabel="% of step time", ylim=(0, 100)), note)


def mfu_plot(run: RunData) -> Plot:
    title = "Model FLOPs utilisation"
    steps, values = run.series("mfu")
    if not values:
        return _missing(
            "mfu",
            title,
            "no MFU in metrics.jsonl: the device's peak FLOP/s is unknown (on a CPU, set "
            "metrics.peak_tflops to get it)",
        )
    line = Line("MFU", steps, [100 * v for v in values], smooth=True)
    return Plot("mfu", title, figure([line], ylabel="% of peak FLOP/s", ylim=(0, None)))


def measured_memory(run: RunData) -> tuple[str, list, list]:
    """(label, steps, GiB) of the measured peak: CUDA allocator peak, else the CPU process RSS."""
    for key, label in (("peak_memory_gib", "measured peak (CUDA)"), ("peak_rss_gib", "peak RSS")):
        steps, values = run.series(key)
        if values:
            return label, steps, values
    return "", [], []


def memory_plot(run: RunData) -> Plot:
    title = "Memory: measured vs planned"
    planned = planned_memory_gib(run.plan)
    label, steps, values = measured_memory(run)
    if not values and planned is None:
        return _missing("memory", title, "no memory figures in metrics.jsonl")
    notes = []
    if label == "peak RSS":
        notes.append("on a CPU the measure is the process's peak RSS (Python, data and model)")
    if planned is None:
        notes.append("no planner record in metrics.jsonl, so no planned line")
    elif values and planned > 0:
        notes.append(f"final measured / planned = {values[-1] / planned:.2f}")
    lines = [Line(label, steps, values)] if values else []
    hlines = [("planned (mmtrain plan)", planned)] if planned is not None else []
    # A CPU's RSS can be 100x the plan of a tiny model: a log axis keeps both lines visible.
    levels = [v for v in [*values, planned] if v is not None and v > 0]
    logy = bool(levels) and max(levels) / min(levels) > 20
    ylim = None if logy else (0, None)
    png = figure(lines, ylabel="GiB per device", hlines=hlines, logy=logy, ylim=ylim)
    return Plot("memory", title, png, "; ".join(notes))


def eval_plot(run: RunData) -> Plot:
    if run.spec is not None and run.spec.is_language_model():
        return perplexity_plot(run)
    title = "Evaluation during training"
    keys = [k for k in run.keys("", run.eval_rows) if k != "step" and _is_recall(k)]
    if not keys:
        why = "no periodic evaluation rows in metrics.jsonl"
        if run.eval_report:
            why += " (final metrics from eval.json are in the table above)"
        return _missing("eval", title, why)
    # One colour per direction (or metric group), one line style per k: R@1 solid, R@5 dashed...
    groups = list(dict.fromkeys(key.rsplit("/", 1)[0] for key in keys))
    styles: dict[str, str] = {}
    lines = []
    for key in keys:
        group, metric = key.rsplit("/", 1) if "/" in key else ("", key)
        style = styles.setdefault(metric, ("-", "--", ":", "-.")[len(styles) % 4])
        color = PALETTE[groups.index(group) % len(PALETTE)]
        steps, values = run.series(key, run.eval_rows)
        percent = [100 * v for v in values]
        lines.append(Line(eval_label(key), steps, percent, style=style, marker="o", color=color))
    return Plot("eval", title, figure(lines, ylabel="% of queries", ylim=(0, 100)))


def perplexity_plot(run: RunData) -> Plot:
    """A language model's validation: perplexity on each validation set, by step."""
    title = "Validation perplexity during training"
    keys = [k for k in run.keys("", run.eval_rows) if k.rsplit("/", 1)[-1] == "perplexity"]
    if not keys:
        return _missing("eval", title, "no periodic validation rows in metrics.jsonl")
    lines = [Line(eval_label(k.rsplit("/", 1)[0]) or "validation", *run.series(k, run.eval_rows),
                  marker="o") for k in keys]  # fmt: skip
    return Plot("eval", title, figure(lines, ylabel="perplexity (per target token)"))


def denoiser_plot(run: RunData) -> Plot:
    """A denoiser's validation: the loss at each fixed timestep and their mean (and the FD
    when an extractor was set), by step."""
    title = "Denoiser validation"
    keys = [k for k in run.keys("", run.eval_rows) if "/diffusion/" in f"/{k}" and
            k.rsplit("/", 1)[-1] not in ("n", "fd_n", "extractor")]  # fmt: skip
    if not keys:
        return _missing("denoiser", title, "no denoiser validation rows in metrics.jsonl")
    lines = []
    for i, key in enumerate(keys):
        steps, values = run.series(key, run.eval_rows)
        style = "-" if key.endswith(("/loss", "/fd")) else ":"
        label = key.split("diffusion/", 1)[-1].replace("loss_at/", "loss at t=")
        lines.append(Line(label, steps, values, style=style, marker="o",
                          color=PALETTE[i % len(PALETTE)]))  # fmt: skip
    return Plot("denoiser", title, figure(lines, ylabel="mean squared error / FD"))


def preference_plot(run: RunData) -> Plot:
    """A DPO run's rewards by step (TRL's names): the chosen and rejected answers' rewards and
    their margin, smoothed; a margin that falls back, or both rewards falling, is what
    `mmtrain doctor` names."""
    title = "Preference rewards (DPO)"
    keys = ("rewards/margins", "rewards/chosen", "rewards/rejected")
    lines = [Line(k.split("/", 1)[1], *run.series(k), smooth=True) for k in keys]
    if not lines[0].values:
        return _missing("preference", title, "no rewards/margins in metrics.jsonl")
    return Plot("preference", title, figure(lines, ylabel="beta x log-ratio to the reference"))


def _is_recall(key: str) -> bool:
    last = key.rsplit("/", 1)[-1]
    return last.startswith(("R@", "top")) or last in ("accuracy",)


PLOTS: tuple[Callable[[RunData], Plot], ...] = (
    loss_plot,
    lr_plot,
    logit_scale_plot,
    throughput_plot,
    step_time_plot,
    data_wait_plot,
    mfu_plot,
    memory_plot,
    eval_plot,
    denoiser_plot,
    preference_plot,
)
# Charts of some runs only: drawn where the run has their data, else left out (no note).
RUN_SPECIFIC = frozenset(
    {logit_scale_plot, step_time_plot, eval_plot, denoiser_plot, preference_plot}
)


def make_plots(run: RunData) -> list[Plot]:
    """The run's charts in display order: every general chart (one without data carries a
    note saying why) and the run-specific ones it has data for."""
    plots = [(make, make(run)) for make in PLOTS]
    return [plot for make, plot in plots if plot.png is not None or make not in RUN_SPECIFIC]
