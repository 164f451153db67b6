"""What every quickstart demo shares: its output folder, its phase clock, building shards, the
`mmtrain train` config of its run, and the result it hands back to the CLI.

The demos (`image_text`, `modalities`, `vlm`) import these; nothing here imports a demo, so
the demos never import each other's run code.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.structured import FieldError

Phase = Callable[[str, str], None]  # (stage name, detail) as each stage starts
StepHook = Callable[[dict[str, Any]], None]  # each step's metrics row, plus "total_steps"


class PhaseClock:
    """Seconds per phase, each measured from the end of the one before: `lap("data")`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._clock
        self._clock = now


@dataclass
class Paths:
    """Where the quickstart writes, under `out`."""

    out: Path

    @property
    def raw(self) -> Path:
        return self.out / "data" / "raw"

    @property
    def train_shards(self) -> Path:
        return self.out / "data" / "train"

    @property
    def val_shards(self) -> Path:
        return self.out / "data" / "val"

    @property
    def spec(self) -> Path:
        return self.out / "model.yaml"

    @property
    def run(self) -> Path:
        return self.out / "run"


@dataclass
class ChatPaths(Paths):
    """A language model's quickstart: also its tokenizer folder and the run's eval.json."""

    @property
    def tokenizer(self) -> Path:
        return self.out / "tokenizer"

    @property
    def eval_json(self) -> Path:
        return self.run / "eval.json"


@dataclass
class QuickstartResult:
    """What a quickstart did: where its outputs are, how well the model retrieves, how long."""

    paths: Paths
    n_train: int
    n_val: int
    steps: int
    step_seconds: float | None  # the calibration's estimate (None without one)
    retrieval: dict[str, dict[str, Any]]  # eval.json "retrieval": {"image->text": {"R@1": ..}}
    chance: dict[str, float]  # {"R@1": 1/n, "R@5": 5/n, ...} for the held-out pairs
    report_html: Path | None
    seconds: dict[str, float] = field(default_factory=dict)  # per stage
    modalities: tuple[str, ...] = ("image",)
    # With --modalities: chance per direction (the held-out sets differ in size), zero-shot
    # accuracy per tower ({"timeseries": {"top1": ..}}) and held-out samples per modality.
    chance_by_direction: dict[str, dict[str, float]] = field(default_factory=dict)
    zeroshot: dict[str, dict[str, Any]] = field(default_factory=dict)
    n_by_modality: dict[str, int] = field(default_factory=dict)

    @property
    def eval_json(self) -> Path:
        return self.paths.run / "eval.json"


def build_shards(
    src: Path, out: Path, workers: int, modalities: str = "image,text"
) -> dict[str, Any]:
    """`mmtrain data build SRC --out OUT --modalities MODALITIES` through its Python API;
    returns the manifest. Nothing may be rejected: the source is ours."""
    from mmtrain.data.ingest.options import BuildOptions, config_from_options
    from mmtrain.data.ingest.pipeline import build

    options = BuildOptions(
        src=str(src),
        out=out,
        modalities=modalities,
        workers=workers,
        max_reject_rate=0.0,
        progress=False,
    )
    source, build_config = config_from_options(options)
    report = build(source, build_config)
    if not report.ok or report.manifest["counts"]["rejected"]:
        raise RuntimeError(f"building {out} rejected samples; see {out / 'rejects.jsonl'}")
    return report.manifest


def run_config(config: QuickstartConfig, paths: Paths, steps: int) -> Any:
    """The `mmtrain train` config of the quickstart run (also saved as OUT/run/config.yaml)."""
    from mmtrain.config import config_from_dict

    return config_from_dict(run_config_dict(config, paths, steps))


def run_config_dict(config: QuickstartConfig, paths: Paths, steps: int) -> dict[str, Any]:
    """`run_config` as the dict `config_from_dict` reads (the --modalities run edits it)."""
    warmup = min(steps, max(10, round(config.warmup_fraction * steps)))
    evals = min(config.evals, steps)
    return {
        "model": str(paths.spec),
        "data": {
            "train": str(paths.train_shards),
            "val": str(paths.val_shards),
            "tokenizer": "byte",
            "workers": 0,  # decoding a 72-pixel PNG is cheap next to a step
            "shuffle_window": 4096,
        },
        "train": {
            "steps": steps,
            "batch_size": config.batch_size,
            "precision": "fp32",
            "lr": config.lr,
            "min_lr": config.lr / 100,
            "weight_decay": config.weight_decay,
            "warmup_steps": warmup,
            "schedule": "cosine",
            "grad_clip": 1.0,
            "device": "cpu",
        },
        "eval": {"every_steps": math.ceil(steps / evals), "batch_size": 256},
        "checkpoint": {"every_steps": None, "every_minutes": 5, "keep": 1},
        "metrics": {"log_every": 10},
        "seed": config.seed,
        "out": str(paths.run),
    }


def chance_levels(n: int, ks: tuple[int, ...] = (1, 5, 10)) -> dict[str, float]:
    """Expected R@k of a random ranking of `n` candidates with one right answer: k / n."""
    return {f"R@{k}": min(k, n) / n for k in ks}


def begin(config: QuickstartConfig, on_phase: Any) -> tuple[Any, Paths, PhaseClock]:
    """What every quickstart does first, once its packages are there: check the output folder
    and empty its data/ and run/ (cheap to remake: an interrupted run starts them afresh).
    Returns the phase callback (a no-op when none), the paths and a started phase clock."""
    check_out(config.out)
    paths = Paths(config.out)
    shutil.rmtree(paths.out / "data", ignore_errors=True)
    shutil.rmtree(paths.run, ignore_errors=True)
    return on_phase or (lambda name, detail: None), paths, PhaseClock()


OUTPUTS = ("data", "model.yaml", "run", "ATTRIBUTION.txt")  # what a quickstart writes in OUT


def check_out(out: Path, ours: tuple[str, ...] = OUTPUTS) -> None:
    """Refuse an output folder that already holds something other than an unfinished
    quickstart (whose outputs are `ours`): the quickstart never overwrites a user's files."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FieldError("--out", f"{out} is a file; give a folder")
    if (Paths(out).run / "eval.json").exists():
        raise FieldError(
            "--out", f"{out} already holds a finished quickstart; give another --out or delete it"
        )
    foreign = [p.name for p in out.iterdir() if p.name not in ours]
    if foreign:
        raise FieldError(
            "--out", f"{out} holds other files ({', '.join(sorted(foreign)[:3])}); use a new folder"
        )


__all__ = [
    "OUTPUTS",
    "Paths",
    "Phase",
    "PhaseClock",
    "QuickstartResult",
    "StepHook",
    "begin",
    "build_shards",
    "chance_levels",
    "check_out",
    "run_config",
    "run_config_dict",
]
