"""`mmtrain quickstart --diffusion`: a class-conditional DiT learns to draw emoji, offline.

    stage 0  the image-text quickstart's CLIP (trained here into OUT/clip/, or an existing
             run given with --clip): the offline feature extractor of the evaluation
    data     the emoji of ten classes (`emoji_classes`: flags, faces, hearts, clocks, buttons,
             people in five skin tones) as KEY.png + KEY.cls ──mmtrain data build──▶
             OUT/data/{train,val}/ shards, split by key as the CLIP's
    train    OUT/run/: a DiT on 32-pixel images (flow matching, guidance dropout, EMA), with a
             validation loss at fixed timesteps and a sample grid (a row per class) at each
             validation (OUT/run/samples/)
    evaluate samples of the EMA for the classes of the held-out images, against those images
             in the CLIP's image features: Fréchet distance beside the untrained model's and
             the real-vs-real floor, conditional accuracy (zero-shot, is a "flag" sample
             nearest to the prompt "flag"?) beside the real images', CLIP score
             -> OUT/run/eval.json "diffusion"; then the report (OUT/run/report.html)

The held-out images were seen by neither the CLIP nor the DiT: the FD compares what the DiT
draws for a class with images of that class it never saw. The untrained DiT (adaLN-Zero: its
first prediction is zero) returns its starting noise, so its FD is what "learned nothing"
scores; the floor is what two halves of the real images score at this number of images.

The model: 32 x 32 RGB pixels in 4-pixel patches (64 tokens), 4 blocks of width 128, 4 heads,
a class table of ten classes plus "no class"; Euler sampling over 25 steps with guidance 4. The
step count is fixed (deterministic results on any machine); `--minutes` only cuts it on a
machine too slow for it, as in the image-text quickstart.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.quickstart.budget import fit_steps, time_denoiser_steps
from mmtrain.quickstart.common import Paths, Phase, PhaseClock, StepHook, build_shards, check_out
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.emoji_classes import CLASSES, write_class_raw
from mmtrain.quickstart.emoji_data import check_packages, list_emoji
from mmtrain.quickstart.stage0 import clip_stage
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

# What OUT may hold besides a user's files (check_out refuses anything else).
OUTPUTS = ("data", "model.yaml", "run", "ATTRIBUTION.txt", "clip")


@dataclass
class DiffusionDemoConfig:
    """What `mmtrain quickstart --diffusion` runs; the defaults fit 6 minutes on 2 idle cores."""

    out: Path = Path("runs/quickstart-diffusion")
    clip: Path | None = None  # an image-text quickstart (OUT or OUT/run); None: train one
    clip_steps: int = 450  # the image-text quickstart's own default
    steps: int = 450
    minutes: float = 3.0  # upper bound on the DiT's training time
    fit_budget: bool = True
    batch_size: int = 64
    lr: float = 2e-3  # 450 steps: FD 0.212 against 0.217 at 1e-3, class accuracy 18% vs 7%
    warmup_fraction: float = 0.05
    ema: float = 0.99  # a short run: the last ~100 steps (DiT's 0.9999 is for 400k steps)
    cfg_dropout: float = 0.1
    width: int = 128
    layers: int = 4
    heads: int = 4
    patch_size: int = 4
    evals: int = 3  # validations (loss and a sample grid) during training, the last at the end
    samples: int = 256  # generated images for the FD (at most the held-out images' number)
    sample_steps: int = 25
    cfg: float = 4.0  # FD 0.201 (guidance 1: 0.221, 6: 0.233), class accuracy 31% (11%, 40%)
    limit: int | None = None  # an evenly spaced subset of this many emoji (tests)
    val_fraction: float = 0.1
    build_workers: int = 2
    seed: int = 0

    def validate(self) -> None:
        for name in ("clip_steps", "steps", "batch_size", "evals", "samples", "sample_steps"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if not self.minutes > 0:
            raise FieldError("--minutes", f"must be positive, got {self.minutes}")
        if self.limit is not None and self.limit < 20:
            raise FieldError("--limit", f"needs at least 20 emoji, got {self.limit}")
        if self.clip is not None and not self.clip.exists():
            raise FieldError("--clip", f"{self.clip} does not exist")

    def clip_config(self, out: Path) -> QuickstartConfig:
        """The image-text quickstart of stage 0, on the same emoji and split."""
        return QuickstartConfig(out=out, steps=self.clip_steps, fit_budget=self.fit_budget,
                                limit=self.limit, val_fraction=self.val_fraction,
                                build_workers=self.build_workers, seed=self.seed)  # fmt: skip

    def budget(self) -> QuickstartConfig:
        """The step budget in the form `budget.fit_steps` reads."""
        return QuickstartConfig(steps=self.steps, minutes=self.minutes, batch_size=self.batch_size,
                                fit_budget=self.fit_budget)  # fmt: skip


@dataclass
class DiffusionDemoResult:
    """What `--diffusion` did: the steps, the held-out scores (eval.json "diffusion"), how long."""

    paths: Paths
    clip_run: Path
    n_train: int
    steps: dict[str, int | None]  # {"clip": N (None: given), "dit": N}
    diffusion: dict[str, Any]
    report_html: Path
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def eval_json(self) -> Path:
        return self.paths.run / "eval.json"

    @property
    def grid(self) -> Path:
        return self.paths.run / "samples.png"


def dit_spec(config: DiffusionDemoConfig) -> ModelSpec:
    """A class-conditional flow-matching DiT on 32-pixel RGB images, a class per CLASSES."""
    spec = ModelSpec.from_dict({
        "name": "quickstart-dit",
        "objective": "flow_matching",
        "denoiser": {
            "sample_size": 32, "channels": 3, "patch_size": config.patch_size,
            "width": config.width, "layers": config.layers, "heads": config.heads,
            "num_classes": len(CLASSES), "prediction": "velocity", "input": "image",
        },
    })  # fmt: skip
    spec.validate()
    return spec


def train_config(config: DiffusionDemoConfig, paths: Paths, steps: int) -> dict[str, Any]:
    """The `mmtrain train` config (as a dict) of the DiT: validation loss and sample grids
    during training; the FD comes after (`evaluate`), once, on the EMA."""
    return {
        "model": str(paths.spec),
        "data": {
            "train": str(paths.train_shards),
            "val": str(paths.val_shards),
            "class_names": list(CLASSES),
            "workers": 0,  # a 72-pixel PNG decodes in far less than a step
            "shuffle_window": 4096,
        },
        "train": {
            "steps": steps,
            "batch_size": config.batch_size,
            "precision": "fp32",
            "lr": config.lr,
            "min_lr": config.lr / 10,
            "weight_decay": 0.0,  # DiT's
            # the AdamW settings its README figures were measured with
            "betas": [0.9, 0.98],
            "eps": 1e-6,
            "warmup_steps": min(steps, max(1, round(config.warmup_fraction * steps))),
            "schedule": "cosine",
            "grad_clip": 1.0,
            "device": "cpu",
            "ema": config.ema,
            "diffusion": {"cfg_dropout": config.cfg_dropout},
        },
        "eval": {
            "every_steps": math.ceil(steps / min(config.evals, steps)),
            "batch_size": 256,
            "sample_steps": config.sample_steps,
            "cfg": config.cfg,
        },  # fmt: skip
        "checkpoint": {"every_steps": None, "every_minutes": 5, "keep": 1},
        "metrics": {"log_every": 10},
        "seed": config.seed,
        "out": str(paths.run),
    }


def evaluate(config: DiffusionDemoConfig, paths: Paths, clip_run: Path, step: int) -> dict:
    """The EMA's and the untrained DiT's samples against the held-out images in the CLIP's
    features; OUT/run/eval.json (the trained report, with the untrained FD and accuracy
    beside it) and the grid of the EMA's samples, OUT/run/samples.png."""
    import numpy as np
    from PIL import Image

    from mmtrain import __version__, create_model, load_model
    from mmtrain.atomic import atomic_write_bytes, atomic_write_text
    from mmtrain.eval.diffusion import DenoiserEvaluator

    ema = load_model(paths.run / "ema").eval()
    untrained = create_model(ema.spec, seed=config.seed).eval()
    extractor = load_model(clip_run).eval()

    def evaluator(steps: int) -> DenoiserEvaluator:
        return DenoiserEvaluator(
            ema.spec, paths.val_shards, batch_size=256, class_names=CLASSES, seed=config.seed,
            extractor=extractor, samples=config.samples, steps=steps, cfg=config.cfg, rank=0,
            world_size=1,
        )  # fmt: skip

    trained_eval = evaluator(config.sample_steps)
    # The untrained DiT predicts 0 everywhere (adaLN-Zero), so every sampler returns its
    # starting noise whatever the step count: one step draws the very samples 25 would.
    untrained_eval = evaluator(1)
    try:
        trained = trained_eval.report(ema)["diffusion"]
        before = untrained_eval.report(untrained)["diffusion"]
        grid = trained_eval.sample_grid(ema, per_class=8, rows=len(CLASSES))
    finally:
        trained_eval.close()
        untrained_eval.close()
    trained["fd_untrained"] = before["fd"]
    trained["fd_half_untrained"] = before["fd_half"]
    trained["cond_accuracy_untrained"] = before.get("cond_accuracy")
    trained["clip_score_untrained"] = before.get("clip_score")
    document = {
        "schema_version": 1,
        "model": str(paths.run / "ema"),
        "model_name": ema.spec.name,
        "mmtrain_version": __version__,
        "step": step,
        "weights": "ema",
        "classes": list(CLASSES),
        "n_samples": trained["n"],
        "diffusion": trained,
    }
    atomic_write_text(paths.run / "eval.json", json.dumps(document, indent=2) + "\n")
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(grid)).save(buffer, format="PNG")
    atomic_write_bytes(paths.run / "samples.png", buffer.getvalue())
    return document


def run_diffusion_demo(
    config: DiffusionDemoConfig, on_phase: Phase | None = None, on_step: StepHook | None = None
) -> DiffusionDemoResult:
    """Stage 0 (CLIP), data, calibration, training, evaluation, report; see the module
    docstring. Raises `emoji_data.MissingPackages` (before writing anything) when the
    quickstart's packages are missing and FieldError for bad settings."""
    config.validate()
    check_packages()
    check_out(config.out, OUTPUTS)
    paths = Paths(config.out)
    stale = [paths.out / "data", paths.run] + ([paths.out / "clip"] if config.clip is None else [])
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted run starts them afresh
    phase = on_phase or (lambda name, detail: None)
    lap = PhaseClock()

    clip_out = paths.out / "clip"
    clip = clip_stage(config.clip, config.clip_config(clip_out), paths.out, phase, on_step)
    lap("clip")

    phase("data", f"emoji of {len(CLASSES)} classes: {', '.join(CLASSES[:5])}, skin tones")
    split = write_class_raw(list_emoji(config.limit), paths.raw, config.val_fraction)
    if split.val < 2 or split.train < config.batch_size:
        raise FieldError(
            "--limit",
            f"{split.train} train / {split.val} validation emoji with a class is too few for "
            f"batches of {config.batch_size}; use more emoji or a smaller batch",
        )
    build_shards(split.train_dir, paths.train_shards, config.build_workers, modalities="image")
    build_shards(split.val_dir, paths.val_shards, config.build_workers, modalities="image")
    spec = dit_spec(config)
    spec.save(paths.spec)
    lap("data")

    steps, _ = fit_steps(config.budget(), phase, lap,
                         lambda: time_denoiser_steps(spec, config.batch_size))  # fmt: skip

    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    phase("train", f"{steps} steps of {config.batch_size} images")
    hook = None if on_step is None else lambda row: on_step({**row, "total_steps": steps})
    result = train(config_from_dict(train_config(config, paths, steps)), on_step=hook)
    lap("train")

    phase("evaluate", f"{config.samples} samples against the held-out emoji, in {clip.run}")
    document = evaluate(config, paths, clip.run, result.step)
    lap("evaluate")

    phase("report", str(paths.run / "report.html"))
    from mmtrain.report import build_report

    report = build_report(paths.run)
    lap("report")
    shutil.copy2(paths.out / "ATTRIBUTION.txt", paths.run / "ATTRIBUTION.txt")
    return DiffusionDemoResult(
        paths=paths,
        clip_run=clip.run,
        n_train=split.train,
        steps={"clip": clip.steps, "dit": steps},
        diffusion=document["diffusion"],
        report_html=report.html,
        seconds=lap.seconds,
    )


__all__ = [
    "OUTPUTS",
    "DiffusionDemoConfig",
    "DiffusionDemoResult",
    "dit_spec",
    "evaluate",
    "run_diffusion_demo",
    "train_config",
]
