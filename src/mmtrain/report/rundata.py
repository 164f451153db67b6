"""Read what a run folder holds, tolerating every part being absent or partly written.

A run folder (see `mmtrain.train.loop`) may hold `config.yaml`, `metrics.jsonl` (training rows,
a planner record, periodic evaluation rows), `eval.json` (from `mmtrain eval`), `spec.yaml` +
`model.safetensors` (when training finished) and `checkpoints/step_N/`. The report shows what is
there; this module turns the files into plain series and never raises for a missing part: it
records a note instead, so a report of a crashed or still-running run still renders.

metrics.jsonl rows are flattened (`{"plan": {"total_bytes": 1}}` -> `"plan/total_bytes"`) and
sorted into three kinds by their keys:
- training rows carry `loss` and no `kind` (one per optimizer step),
- the plan record is `{"kind": "plan", ...}` (the planner's memory prediction for this run;
  `MetricsWriter.record`), or carries `plan/...` keys,
- evaluation metrics are keys with a `val/` (the loop's periodic validation, merged into the
  step's row: `val/retrieval/image->text/R@1`), `eval/`, `retrieval/`, `zeroshot/`,
  `clip_score/`, `probe/` or `fusion/` part; they are collected per step as evaluation rows.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmtrain.folders import CHECKPOINT_DIR, CONFIG_FILE, EVAL_FILE, METRICS_FILE, SPEC_FILE

log = logging.getLogger(__name__)


# the trainer's records besides the plan: its ranks ("layout", at each start) and the
# recorder's steps worth tracing ("non_finite", "loss_spike": loss and sample keys)
EVENT_KINDS = ("layout", "non_finite", "loss_spike", "stopped")
EVAL_PARTS = ("val", "eval", "retrieval", "zeroshot", "clip_score", "probe", "fusion")
GIB = 2**30


@dataclass
class RunData:
    """Everything the report draws from one run folder."""

    run_dir: Path
    config: dict[str, Any] = field(default_factory=dict)
    train_rows: list[dict[str, Any]] = field(default_factory=list)  # flattened, by step
    eval_rows: list[dict[str, Any]] = field(default_factory=list)  # flattened, by step
    plan: dict[str, Any] = field(default_factory=dict)  # flattened plan record, "plan/" stripped
    eval_report: dict[str, Any] = field(default_factory=dict)  # eval.json as written
    spec: Any = None  # mmtrain.spec.ModelSpec when it could be read
    checkpoints: list[int] = field(default_factory=list)  # steps of finished checkpoint folders
    notes: list[str] = field(default_factory=list)  # what is missing or unreadable, and why
    # records by kind (EVENT_KINDS), in the order written
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def series(self, key: str, rows: list[dict[str, Any]] | None = None) -> tuple[list, list]:
        """(steps, values) of `key` over the training rows (or `rows`), finite numbers only."""
        steps, values = [], []
        for row in self.train_rows if rows is None else rows:
            value = row.get(key)
            if _is_number(value) and math.isfinite(value):
                steps.append(row["step"])
                values.append(float(value))
        return steps, values

    def world_size(self) -> int:
        """The run's ranks: its newest layout record (each start writes one), else its plan's."""
        layouts = self.events.get("layout", [])
        value = (layouts[-1] if layouts else self.plan).get("world_size", 1)
        return int(value) if _is_number(value) and value >= 1 else 1

    def keys(self, prefix: str, rows: list[dict[str, Any]] | None = None) -> list[str]:
        """Keys starting with `prefix` in any training row (or `rows`), in first-seen order."""
        seen: dict[str, None] = {}
        for row in self.train_rows if rows is None else rows:
            for key in row:
                if key.startswith(prefix):
                    seen.setdefault(key)
        return list(seen)


def load_run(run_dir: str | Path) -> RunData:
    """Read the run folder; raise FileNotFoundError only when the folder itself is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder (give the `out` of a training run)")
    run = RunData(run_dir=run_dir)
    run.config = _read_config(run_dir / CONFIG_FILE, run.notes)
    _read_metrics(run_dir / METRICS_FILE, run)
    run.eval_report = _read_eval(run_dir / EVAL_FILE, run.notes)
    run.spec = _read_spec(run_dir, run.config, run.notes)
    run.checkpoints = _checkpoint_steps(run_dir / CHECKPOINT_DIR)
    return run


# ----------------------------------------------------------------------------- files
def _read_config(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():
        notes.append(f"no {path.name}: model and data settings unknown")
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        notes.append(f"{path.name} is unreadable ({err.__class__.__name__}); settings unknown")
        return {}
    return data if isinstance(data, dict) else {}


def _read_metrics(path: Path, run: RunData) -> None:
    if not path.is_file():
        run.notes.append(f"no {path.name}: training curves cannot be drawn")
        return
    bad = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a crash
            bad += 1
            continue
        if not isinstance(row, dict):
            bad += 1
            continue
        _sort_row(flatten(row), run)
    if bad:
        run.notes.append(f"{path.name}: skipped {bad} unreadable line(s) (a crash mid-write?)")
    run.train_rows.sort(key=lambda r: r["step"])
    run.eval_rows.sort(key=lambda r: r["step"])


def _sort_row(row: dict[str, Any], run: RunData) -> None:
    if row.get("kind") in EVENT_KINDS:
        run.events.setdefault(row["kind"], []).append(row)
        return
    step = row.get("step")
    plan = {k[len("plan/") :]: v for k, v in row.items() if k.startswith("plan/")}
    kind = row.get("kind")
    if plan or kind == "plan":
        run.plan.update(plan or {k: v for k, v in row.items() if k not in ("kind", "step")})
        return
    if not _is_number(step):
        return
    row["step"] = int(step)
    if kind is None and _is_number(row.get("loss")):
        run.train_rows.append(row)
    evals = {k: v for k, v in row.items() if is_eval_key(k) and _is_number(v)}
    if evals:
        run.eval_rows.append({"step": int(step), **evals})


def _read_eval(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        notes.append(
            f"{path.name} is unreadable ({err.__class__.__name__}); final metrics left out"
        )
        return {}
    return data if isinstance(data, dict) else {}


def _read_spec(run_dir: Path, config: Mapping[str, Any], notes: list[str]) -> Any:
    from mmtrain.spec import load_spec
    from mmtrain.structured import FieldError

    source = run_dir / SPEC_FILE if (run_dir / SPEC_FILE).is_file() else config.get("model")
    if not source:
        return None
    try:
        return load_spec(source)
    except (FieldError, OSError, ValueError) as err:
        notes.append(f"model spec {source} could not be read: {err}")
        return None


def _checkpoint_steps(root: Path) -> list[int]:
    from mmtrain.checkpoint import list_checkpoints

    return [step for step, _ in list_checkpoints(root)]


# ----------------------------------------------------------------------------- values
def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with '/'-joined keys; other values kept as they are."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten(value, name))
        else:
            flat[name] = value
    return flat


def is_eval_key(key: str) -> bool:
    """Whether a flattened metrics key is an evaluation metric (any part names an eval kind)."""
    return any(part in EVAL_PARTS for part in key.split("/")[:-1])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def planned_memory_gib(plan: Mapping[str, Any]) -> float | None:
    """The planner's predicted peak memory per device, in GiB, from the plan record.

    The loop's record holds `predicted_allocated_bytes` (model states, activations and buffers:
    what CUDA's `max_memory_allocated` measures) and `predicted_total_bytes` (plus the CUDA
    context and fragmentation); the allocated figure is the one comparable with the measured
    peak. Older or hand-made records with only a total (`total_bytes`, `*_gib`) are read too.
    None when the record holds no memory figure."""
    keys = sorted(plan, key=lambda k: (k.count("/"), k))
    for suffix, scale in (
        ("predicted_allocated_bytes", 1 / GIB),
        ("predicted_total_bytes", 1 / GIB),
        ("total_gib", 1.0),
        ("total_bytes", 1 / GIB),
    ):
        for key in keys:
            if key.endswith(suffix) and _is_number(plan[key]):
                return float(plan[key]) * scale
    return None


# ----------------------------------------------------------------------------- summary
def summary_rows(run: RunData) -> list[tuple[str, str]]:
    """(label, value) rows of the table at the top of the report; unknown values are left out."""
    rows: list[tuple[str, str]] = []
    train = run.config.get("train") if isinstance(run.config.get("train"), dict) else {}
    if run.spec is not None:
        towers = ", ".join(f"{n} ({t.modality})" for n, t in run.spec.towers.items())
        rows.append(("model", f"{run.spec.name}: {towers}"))
        rows.append(("parameters", f"{run.spec.params():,} ({_si(run.spec.params())})"))
    elif run.config.get("model"):
        rows.append(("model", str(run.config["model"])))
    last = run.train_rows[-1] if run.train_rows else {}
    if last:
        planned = f" of {train['steps']:,}" if _is_number(train.get("steps")) else ""
        rows.append(("steps", f"{last['step']:,}{planned}"))
    if _is_number(last.get("samples_seen")):
        batch = f" (batch {train['batch_size']:,})" if _is_number(train.get("batch_size")) else ""
        rows.append(("samples seen", f"{int(last['samples_seen']):,}{batch}"))
    if last:
        pairs = [f"{k[len('loss/') :]} {last[k]:.4f}" for k in last if k.startswith("loss/")]
        extra = f" ({', '.join(pairs)})" if len(pairs) > 1 else ""
        first = run.train_rows[0]["loss"]
        rows.append(("final loss", f"{last['loss']:.4f}{extra}; first {first:.4f}"))
    rows += _recall_rows(run)
    wall = training_seconds(run)
    if wall is not None:
        rows.append(
            ("training time", f"{duration(wall)} (sum of step times and checkpoint writes)")
        )
    _, speeds = run.series("samples_per_s")
    if speeds:
        rows.append(("throughput", f"{_median(speeds):.1f} samples/s (median over steps)"))
    _, mem = run.series("peak_memory_gib")
    what = "peak memory (CUDA)"
    if not mem:
        _, mem = run.series("peak_rss_gib")
        what = "peak RSS (CPU process)"
    if mem:
        planned = planned_memory_gib(run.plan)
        plan_text = f"; planned {_gib(planned)}" if planned is not None else ""
        rows.append((what, f"{_gib(max(mem))}{plan_text}"))
    if train.get("precision"):
        rows.append(("precision", str(train["precision"])))
    if run.checkpoints:
        shown = ", ".join(str(s) for s in run.checkpoints[-5:])
        rows.append(("checkpoints", f"{len(run.checkpoints)} (steps {shown})"))
    else:
        rows.append(("checkpoints", "none"))
    if last and (last.get("skipped_steps") or last.get("corrupt_samples")):
        rows.append(
            (
                "problems",
                f"{int(last.get('skipped_steps', 0))} skipped steps, "
                f"{int(last.get('corrupt_samples', 0))} corrupt samples",
            )
        )
    return rows


def _recall_rows(run: RunData) -> list[tuple[str, str]]:
    """Final R@K per direction from eval.json, and the best R@K seen during training."""
    rows = []
    retrieval = run.eval_report.get("retrieval")
    if isinstance(retrieval, dict):
        for direction, metrics in retrieval.items():
            if not isinstance(metrics, dict):
                continue
            recalls = [f"{k} {100 * v:.1f}%" for k, v in metrics.items() if k.startswith("R@")]
            if recalls:
                n = metrics.get("n_queries")
                tail = f" ({n:,} queries, eval.json)" if _is_number(n) else " (eval.json)"
                rows.append((f"R@k {direction}", ", ".join(recalls) + tail))
    best: dict[str, dict[str, tuple[float, int]]] = {}
    for row in run.eval_rows:
        for key, value in row.items():
            group, _, metric = key.rpartition("/")
            if "retrieval" in group.split("/") and metric.startswith("R@"):
                held = best.setdefault(group, {}).get(metric)
                if held is None or value > held[0]:
                    best[group][metric] = (value, row["step"])
    for group, ks in best.items():
        steps = {s for _, s in ks.values()}
        if len(steps) == 1:  # all best at the same evaluation: say its step once
            text = ", ".join(f"{k} {100 * v:.1f}%" for k, (v, _) in ks.items())
            text += f" (step {steps.pop()})"
        else:
            text = ", ".join(f"{k} {100 * v:.1f}% (step {s})" for k, (v, s) in ks.items())
        rows.append((f"best R@k {eval_label(group)}", text + " during training"))
    return rows


def eval_label(key: str) -> str:
    """A flattened eval key without its bookkeeping parts: `val/retrieval/image->text/R@1` ->
    `image->text R@1`; the set number of a run with several validation sets is kept."""
    parts = [p for p in key.split("/") if p not in ("val", "eval", "retrieval")]
    return " ".join(f"set {p}" if p.isdigit() else p for p in parts)


def training_seconds(run: RunData) -> float | None:
    _, steps = run.series("step_s")
    if not steps:
        return None
    _, checkpoints = run.series("checkpoint_s_total")
    return sum(steps) + (checkpoints[-1] if checkpoints else 0.0)


def _gib(value: float) -> str:
    """GiB with three significant digits: 0.358 GiB, 0.00139 GiB, 71.2 GiB."""
    return f"{value:.3g} GiB"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def _si(count: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return str(count)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"
