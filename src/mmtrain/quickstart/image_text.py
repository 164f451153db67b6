"""`mmtrain quickstart`: see a model learn, offline, in minutes on a laptop CPU.

    Twemoji PNGs + names (pip packages) ──emoji_data──▶ OUT/data/raw/{train,val}/KEY.png|txt
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
- Captions are the bare emoji names (`emoji_data.caption`) in 48 text bytes: 90% of the
  names fit whole, and the text tower, which costs most of a step, runs 25% faster than at 64.
- Mean pooling of the text tokens instead of the end-of-text token: every byte of a name
  reaches the embedding from the first step, where "eot" must first learn to carry the name
  to the last position (5.4% against 2.8% R@5 at 100 steps, both at lr 2e-3).
- lr 1e-3 with 10% warm-up: 7.8% R@5 at 100 steps against 5.4% at 2e-3 (with templated
  captions and "eot", 2e-3 sat at the chance loss, ln 64, for 50 steps).

Training runs a fixed number of steps (`QuickstartConfig.steps`, `budget`), so the result does not
depend on how loaded the machine is; `minutes` is only an upper bound: the steps are timed
first, and a machine too slow for all of them in the budget trains fewer (and says so).

With these defaults (450 steps, ~2 min of training on 2 lightly loaded cores) held-out
image->text R@5 is 58.7% against 1.3% chance (387 emoji); with the former initialisation it
was 18.9% (and 19.6% after 650 steps).

`--modalities image,audio,timeseries` adds spoken captions and sensor time-series towers to the
same model (`mmtrain.quickstart.modalities`); without it the run is exactly the one above.
"""

from __future__ import annotations

import shutil

from mmtrain.quickstart.budget import fit_steps, time_steps
from mmtrain.quickstart.common import (
    Phase,
    QuickstartResult,
    StepHook,
    begin,
    build_shards,
    chance_levels,
    run_config,
)
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.emoji_data import check_packages, list_emoji, write_raw
from mmtrain.spec import ModelSpec, load_spec, with_tower
from mmtrain.structured import FieldError

BASE_MODEL = "tiny-clip"


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


def run_image_text(
    config: QuickstartConfig,
    on_phase: Phase | None = None,
    on_step: StepHook | None = None,
) -> QuickstartResult:
    """Data, calibration, training with validation, report; see the module docstring.

    Raises `emoji_data.MissingPackages` when the optional packages are not installed
    (before writing anything) and FieldError for bad settings.
    """
    config.validate()
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


__all__ = ["BASE_MODEL", "quickstart_spec", "run_image_text"]
