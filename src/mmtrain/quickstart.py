"""`mmtrain quickstart`: see a model learn, offline, in minutes on a laptop CPU.

    Twemoji PNGs + names (pip packages) ──quickstart_data──▶ OUT/data/raw/{train,val}/KEY.png|txt
        ──mmtrain data build──▶ OUT/data/{train,val}/ shards + manifest.json
        ──time a few steps──▶ steps that fit the budget
        ──mmtrain train (tiny-clip, validation on the held-out keys)──▶ OUT/run/ (+ eval.json)
        ──mmtrain report──▶ OUT/run/report.html

Every stage is the project's own public API, so the quickstart is also a worked example of
the commands a user runs on their own data.

The model is tiny-clip's tower design (width 128, 4 heads, byte-level text) in a variant cut
to learn within minutes on a CPU, each change measured on 2 shared cores at a fixed number of
steps (held-out image->text R@5 after 100 steps of 64 pairs; measured with the former N(0, 0.02)
initialisation, before the width-aware one of `MultimodalModel.init_weights`, and not re-measured):

- 32-pixel images: an emoji is still recognisable, with a quarter of the patches of 64 px.
- 2 blocks per tower instead of 5: about 2.5 times more steps in the same minutes.
- Captions are the bare emoji names (`quickstart_data.caption`) in 48 text bytes: 90% of the
  names fit whole, and the text tower, which costs most of a step, runs 25% faster than at 64.
- Mean pooling of the text tokens instead of the end-of-text token: every byte of a name
  reaches the embedding from the first step, where "eot" must first learn to carry the name
  to the last position (5.4% against 2.8% R@5 at 100 steps, both at lr 2e-3).
- lr 1e-3 with 10% warm-up: 7.8% R@5 at 100 steps against 5.4% at 2e-3 (with templated
  captions and "eot", 2e-3 sat at the chance loss, ln 64, for 50 steps).

Training runs a fixed number of steps (`QuickstartConfig.steps`), so the result does not
depend on how loaded the machine is; `minutes` is only an upper bound: the steps are timed
first, and a machine too slow for all of them in the budget trains fewer (and says so).

With these defaults (450 steps, ~2 min of training on 2 lightly loaded cores) held-out
image->text R@5 is 58.7% against 1.3% chance (387 emoji); with the former initialisation it
was 18.9% (and 19.6% after 650 steps).

`--modalities image,audio,timeseries` adds spoken captions and sensor time-series towers to the
same model (`mmtrain.quickstart_modalities`); without it the run is exactly the one above.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.quickstart_data import check_packages, list_emoji, write_raw
from mmtrain.spec import ModelSpec, load_spec, with_tower
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

BASE_MODEL = "tiny-clip"
MIN_STEPS = 20  # below this nothing is learned; the budget is then too small for the machine
BUDGET_MARGIN = 1.15  # data decoding, metrics and validation on top of the timed steps


@dataclass
class QuickstartConfig:
    """What `mmtrain quickstart` runs; the defaults are tuned for 2 CPU cores and 5 minutes."""

    out: Path = Path("runs/quickstart")
    steps: int = 450  # fixed, so results do not depend on machine load
    minutes: float = 5.0  # upper bound on training time: fewer steps on a slower machine
    fit_budget: bool = True  # time the steps first and cut them to `minutes` if needed
    batch_size: int = 64
    lr: float = 1e-3  # 2e-3 sits at the chance loss for 50+ steps; 5e-4 learns half as fast
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    image_size: int = 32
    patch_size: int = 8
    context_length: int = 48  # bytes of the bare emoji name (90% fit whole)
    layers: int | None = 2  # transformer blocks per tower (None: tiny-clip's 5)
    text_pooling: str = "mean"  # tiny-clip's "eot" learns ~3x slower here (module docstring)
    val_fraction: float = 0.1  # share of emoji keys held out (by hash of the key)
    limit: int | None = None  # use an evenly spaced subset of this many emoji (tests)
    evals: int = 2  # validations during training (the last one is at the final step)
    build_workers: int = 2
    seed: int = 0
    # Towers besides text: ("image",) is the image-text quickstart; more in quickstart_modalities.
    modalities: tuple[str, ...] = ("image",)

    def validate(self) -> None:
        if self.steps < 1:
            raise FieldError("--steps", f"must be at least 1, got {self.steps}")
        if not self.minutes > 0:
            raise FieldError("--minutes", f"must be positive, got {self.minutes}")
        if not 0 < self.val_fraction < 1:
            raise FieldError("val_fraction", f"must be in (0, 1), got {self.val_fraction}")
        if self.limit is not None and self.limit < 20:
            raise FieldError("--limit", f"needs at least 20 emoji, got {self.limit}")
        for name in ("batch_size", "image_size", "patch_size", "context_length", "evals"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        from mmtrain.quickstart_modalities import parse_modalities

        if tuple(self.modalities) != parse_modalities(",".join(self.modalities)):
            raise FieldError("--modalities", "give some of image, audio, timeseries in that order")


# With --modalities (more than images): batches of 32, as the sensor set has only 40
# recordings (a larger batch would repeat them as each other's negatives); steps measured to
# keep the whole run within about 5 minutes on 2 cores (README).
MODALITIES_DEFAULTS: dict[str, Any] = {"batch_size": 32, "steps": 900}


def make_config(modalities: tuple[str, ...] = ("image",), **given: Any) -> QuickstartConfig:
    """A QuickstartConfig with the defaults of `modalities`, then the `given` fields that
    are not None (the CLI's flags)."""
    defaults = {} if tuple(modalities) == ("image",) else dict(MODALITIES_DEFAULTS)
    chosen = {name: value for name, value in given.items() if value is not None}
    return QuickstartConfig(modalities=tuple(modalities), **{**defaults, **chosen})


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


Phase = Callable[[str, str], None]  # (stage name, detail) as each stage starts
StepHook = Callable[[dict[str, Any]], None]  # each step's metrics row, plus "total_steps"


# ----------------------------------------------------------------------------- stages
def quickstart_spec(config: QuickstartConfig) -> ModelSpec:
    """tiny-clip with the quickstart's image size, patch size and text length."""
    spec = load_spec(BASE_MODEL)
    image = {"image_size": config.image_size, "patch_size": config.patch_size}
    spec = with_tower(spec, "image", stem=image)
    spec = with_tower(
        spec, "text", stem={"context_length": config.context_length}, pooling=config.text_pooling
    )
    if config.layers is not None:
        for name in spec.towers:
            spec = with_tower(spec, name, layers=config.layers)
    spec.validate()
    return spec


def build_shards(
    src: Path, out: Path, workers: int, modalities: str = "image,text"
) -> dict[str, Any]:
    """`mmtrain data build SRC --out OUT --modalities MODALITIES` through its Python API;
    returns the manifest. Nothing may be rejected: the source is ours."""
    from mmtrain.data.build_args import add_build_arguments, config_from_args
    from mmtrain.data.ingest import build

    parser = argparse.ArgumentParser(prog="mmtrain data build")
    add_build_arguments(parser)
    argv = [str(src), "--out", str(out), "--modalities", modalities]
    argv += ["--workers", str(workers), "--max-reject-rate", "0", "--no-progress"]
    source, build_config = config_from_args(parser.parse_args(argv))
    report = build(source, build_config)
    if not report.ok or report.manifest["counts"]["rejected"]:
        raise RuntimeError(f"building {out} rejected samples; see {out / 'rejects.jsonl'}")
    return report.manifest


def time_steps(
    spec: ModelSpec,
    batch_size: int,
    probe_batch: int = 32,
    towers: tuple[str, ...] = ("image", "text"),
) -> float:
    """Seconds per optimizer step of `spec` at `batch_size` on this CPU, for batches that hold
    `towers` (and the loss of the pairs among them).

    Two steps (forward, loss, backward, AdamW) on random inputs of the right shapes are timed
    after a warm-up step, at `probe_batch` samples and scaled up linearly: a CPU's step time is
    close to linear in the batch, and the fixed overhead left in makes the estimate cautious.
    The faster of the two counts (the one least disturbed by other processes).
    """
    import torch

    from mmtrain.losses import ContrastiveLoss
    from mmtrain.models import create_model
    from mmtrain.plan.measure import random_batch

    probe = min(probe_batch, batch_size)
    generator = torch.Generator().manual_seed(0)
    model = create_model(spec, seed=0)
    loss_fn = ContrastiveLoss.from_spec(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {n: x for n, x in random_batch(spec, probe, generator).items() if n in towers}
    pairs = [pair for pair in spec.pairs if set(pair) <= set(towers)]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        features = model(batch)
        loss, _ = loss_fn(features, pairs, model.logit_scale)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times[1:]) * batch_size / probe


def fit_steps(
    config: QuickstartConfig, phase: Phase, lap: PhaseClock, step_seconds: Callable[[], float]
) -> tuple[int, float | None]:
    """(steps, seconds per step): `config.steps`, or fewer when `config.fit_budget` and the
    step time that `step_seconds()` measures says they do not fit `config.minutes`."""
    if not config.fit_budget:
        return config.steps, None
    phase(
        "calibrate",
        f"{config.steps} steps of {config.batch_size}, at most {config.minutes:g} min",
    )
    started = time.perf_counter()
    seconds = step_seconds()
    steps = plan_steps(config, seconds, time.perf_counter() - started)
    lap("calibrate")
    if steps < config.steps:
        log.warning(
            "%.2f s per step: only %d of %d steps fit %g min; the model learns less",
            seconds, steps, config.steps, config.minutes,
        )  # fmt: skip
    return steps, seconds


def plan_steps(config: QuickstartConfig, step_seconds: float, spent_s: float = 0.0) -> int:
    """`config.steps`, or fewer when they do not fit what is left of `config.minutes` after
    `spent_s` (the timing itself) at `step_seconds` each; never fewer than MIN_STEPS."""
    fit = int((config.minutes * 60 - spent_s) / (step_seconds * BUDGET_MARGIN))
    if fit >= config.steps:
        return config.steps
    if fit < MIN_STEPS:
        raise FieldError(
            "--minutes",
            f"{config.minutes:g} min gives only {fit} steps at {step_seconds:.2f} s per step on "
            f"this machine; give more minutes, or fewer --steps ({MIN_STEPS} or more)",
        )
    return fit


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


def check_out(out: Path) -> None:
    """Refuse an output folder that already holds something other than an unfinished
    quickstart: the quickstart never overwrites a user's files."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FieldError("--out", f"{out} is a file; give a folder")
    if (Paths(out).run / "eval.json").exists():
        raise FieldError(
            "--out", f"{out} already holds a finished quickstart; give another --out or delete it"
        )
    ours = ("data", "model.yaml", "run", "ATTRIBUTION.txt")
    foreign = [p.name for p in out.iterdir() if p.name not in ours]
    if foreign:
        raise FieldError(
            "--out", f"{out} holds other files ({', '.join(sorted(foreign)[:3])}); use a new folder"
        )


# ----------------------------------------------------------------------------- the whole run
def run_quickstart(
    config: QuickstartConfig,
    on_phase: Phase | None = None,
    on_step: StepHook | None = None,
) -> QuickstartResult:
    """Data, calibration, training with validation, report; see the module docstring.

    Raises `quickstart_data.MissingPackages` when the optional packages are not installed
    (before writing anything) and FieldError for bad settings. With `config.modalities`
    other than ("image",) it runs `quickstart_modalities.run_modalities` instead.
    """
    config.validate()
    if tuple(config.modalities) != ("image",):
        from mmtrain.quickstart_modalities import run_modalities

        return run_modalities(config, on_phase, on_step)
    check_packages()
    phase, paths, lap = begin(config, on_phase)
    seconds = lap.seconds

    phase("data", f"{config.limit or 'all'} emoji, {config.val_fraction:.0%} held out")
    split = write_raw(list_emoji(config.limit), paths.raw, config.val_fraction)
    if split.val < 2 or split.train < config.batch_size:
        raise FieldError(
            "--limit",
            f"{split.train} train / {split.val} validation emoji is too few for batches of "
            f"{config.batch_size}; use more emoji or a smaller batch",
        )
    build_shards(split.train_dir, paths.train_shards, config.build_workers)
    build_shards(split.val_dir, paths.val_shards, config.build_workers)
    shutil.copy2(paths.raw / "ATTRIBUTION.txt", paths.out / "ATTRIBUTION.txt")
    spec = quickstart_spec(config)
    spec.save(paths.spec)
    lap("data")

    steps, step_seconds = fit_steps(config, phase, lap, lambda: time_steps(spec, config.batch_size))

    phase("train", f"{steps} steps of {config.batch_size} pairs")
    from mmtrain.train.loop import train

    hook = None if on_step is None else lambda row: on_step({**row, "total_steps": steps})
    result = train(run_config(config, paths, steps), on_step=hook)
    lap("train")
    if result.eval is None or "retrieval" not in result.eval:
        raise RuntimeError(f"training wrote no validation report in {paths.run}")

    phase("report", str(paths.run / "report.html"))
    from mmtrain.report import build_report

    report = build_report(paths.run)
    lap("report")
    shutil.copy2(paths.out / "ATTRIBUTION.txt", paths.run / "ATTRIBUTION.txt")
    return QuickstartResult(
        paths=paths,
        n_train=split.train,
        n_val=result.eval["n_samples"],
        steps=steps,
        step_seconds=step_seconds,
        retrieval=result.eval["retrieval"],
        chance=chance_levels(result.eval["n_samples"]),
        report_html=report.html,
        seconds=seconds,
    )


__all__ = [
    "BASE_MODEL",
    "MODALITIES_DEFAULTS",
    "Paths",
    "QuickstartConfig",
    "QuickstartResult",
    "build_shards",
    "chance_levels",
    "check_out",
    "make_config",
    "plan_steps",
    "quickstart_spec",
    "run_config",
    "run_config_dict",
    "run_quickstart",
    "time_steps",
]
