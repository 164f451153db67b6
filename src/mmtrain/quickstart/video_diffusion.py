"""`mmtrain quickstart --video`: a tiny Wan-shaped text-to-video model learns moving squares,
offline, through the path a user's Wan 2.1 folder takes.

    pipeline OUT/pipeline/: a WanPipeline folder at toy sizes (quickstart/tiny_wan.py): its
             AutoencoderKLWan trained first on the demo's clips (stage 0), UMT5 and the
             transformer random
    data     clips of a red, green or yellow square moving left, right, up or down
             (quickstart/motion_clips.py) as MP4 shards with captions ──mmtrain data
             encode-latents --pipeline──▶ OUT/data/latents/ (the pipeline's own VAE and UMT5)
    train    OUT/run/: `init: OUT/pipeline` alone: the transformer as diffusers' class, flow
             matching with caption dropout, EMA, captions at 8 tokens (OUT/model.yaml: the
             transformer's spec at the demo's sizes); the run folder is a pipeline folder
    evaluate for each caption, clips sampled through WanPipeline with the EMA's transformer,
             (guidance 8, the zero text as its unconditional branch), decoded by the VAE and
             judged by where their frames move (motion_clips.
             direction_of): accuracy against the caption's direction, beside the untrained
             transformer's (chance: 1 in 4) and the drawn clips' through the VAE (the ceiling)
             -> OUT/run/eval.json "video", OUT/run/samples/*.mp4; then the report

The step count is fixed (deterministic results on any machine); `--minutes` only cuts it on a
machine too slow for it, as the other demos do.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.quickstart.common import Paths, Phase, PhaseClock, StepHook, check_out
from mmtrain.quickstart.motion_clips import (
    COLOURS,
    DIRECTIONS,
    caption,
    clip_shards,
    clips,
    direction_of,
)
from mmtrain.quickstart.tiny_wan import TinyWan, build_pipeline
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

OUTPUTS = ("pipeline", "data", "model.yaml", "run")
LATENT_SHAPE = (5, 8, 8)  # 9 frames of 16 x 16 through the 2x VAE: frames x height x width
# Caption tokens: the captions' five words and the end token fit in 8 (WanPipeline pads to
# 512 by default: 504 identical padding keys in every cross-attention, which made the same
# model learn 4x slower per step here, at 4x the step time).
TEXT_TOKENS = 8


@dataclass
class VideoDemoConfig:
    """What `mmtrain quickstart --video` runs."""

    out: Path = Path("runs/quickstart-video")
    steps: int = 2000
    minutes: float = 5.0
    fit_budget: bool = True
    batch_size: int = 32
    lr: float = 2e-3
    ema: float = 0.98
    train_clips: int = 1200
    val_clips: int = 48
    samples_per_caption: int = 4
    sample_steps: int = 20
    cfg: float = 8.0
    model: TinyWan = field(default_factory=TinyWan)
    seed: int = 0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "train_clips", "val_clips", "samples_per_caption",
                     "sample_steps"):  # fmt: skip
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if not self.minutes > 0:
            raise FieldError("--minutes", f"must be positive, got {self.minutes}")


@dataclass
class VideoDemoResult:
    paths: Paths
    steps: int
    n_train: int
    video: dict[str, Any]
    report_html: Path
    seconds: dict[str, float] = field(default_factory=dict)


def train_config(config: VideoDemoConfig, paths: Paths, steps: int) -> dict[str, Any]:
    """The `mmtrain train` config (as a dict): the pipeline folder's transformer, its spec
    (OUT/model.yaml, `model_spec`) at the demo's caption length."""
    return {
        "model": str(paths.spec),
        "init": str(paths.out / "pipeline"),
        "data": {
            "train": str(paths.out / "data" / "latents"),
            "buckets": [list(LATENT_SHAPE)],
            "workers": 0,
        },  # fmt: skip
        "train": {
            "steps": steps,
            "batch_size": config.batch_size,
            "precision": "fp32",
            "lr": config.lr,
            "min_lr": config.lr / 10,
            "weight_decay": 0.0,
            "warmup_steps": max(1, steps // 20),
            "schedule": "cosine",
            "grad_clip": 1.0,
            "device": "cpu",
            "ema": config.ema,
            "diffusion": {"cfg_dropout": 0.1},
        },  # fmt: skip
        "checkpoint": {"every_steps": None, "every_minutes": 5, "keep": 1},
        "metrics": {"log_every": 10},
        "seed": config.seed,
        "out": str(paths.run),
    }


def _check_libraries() -> None:
    """The pipeline is diffusers' and transformers' own classes: refuse, before writing
    anything, where they are missing."""
    import importlib.util

    missing = [m for m in ("diffusers", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise FieldError("--video", f"needs {' and '.join(missing)}: pip install 'mmtrain[hub]'")


def model_spec(pipeline: Path) -> ModelSpec:
    """The spec of the pipeline's transformer (what `init: PIPELINE_DIR` alone gives) at the
    demo's clip and caption length: the spec file a user writes (`mmtrain spec`, edited) to
    train at another text length than the pipeline's 512."""
    from dataclasses import replace

    from mmtrain.models.model_source import load_model_spec

    spec = load_model_spec(str(pipeline))
    frames, side, _ = LATENT_SHAPE
    denoiser = replace(spec.denoiser, frames=frames, sample_size=side, text_tokens=TEXT_TOKENS)
    return replace(spec, denoiser=denoiser)


def calibrated_steps(
    config: VideoDemoConfig, spec: ModelSpec, phase: Phase, lap: PhaseClock
) -> int:
    """`config.steps`, or fewer where they do not fit `config.minutes` on this machine (timed
    on the pipeline's transformer at the demo's latent shape)."""
    from mmtrain.quickstart.budget import fit_steps, time_denoiser_steps
    from mmtrain.quickstart.config import QuickstartConfig

    budget = QuickstartConfig(steps=config.steps, minutes=config.minutes,
                              batch_size=config.batch_size, fit_budget=config.fit_budget)  # fmt: skip
    steps, _ = fit_steps(budget, phase, lap, lambda: time_denoiser_steps(spec, config.batch_size))
    return steps


def encode_latents(paths: Paths) -> None:
    """`mmtrain data encode-latents` of the training clips through the pipeline's parts."""
    from mmtrain.cli import main

    argv = ["data", "encode-latents", str(paths.out / "data" / "train"), "--pipeline",
            str(paths.out / "pipeline"), "--size", "16", "--max-sequence-length",
            str(TEXT_TOKENS), "--out", str(paths.out / "data" / "latents")]  # fmt: skip
    if main(argv) != 0:
        raise RuntimeError(f"mmtrain {' '.join(argv)} failed (see above)")


def judged_accuracy(pipeline: Path, config: VideoDemoConfig, out: Path | None) -> dict:
    """Clips sampled through WanPipeline from `pipeline` for every caption, judged by
    direction_of: accuracy overall and per direction; MP4s into `out` when given."""
    import diffusers
    import numpy as np
    import torch

    from mmtrain.models.hub.wan import wan_prompt

    pipe = diffusers.WanPipeline.from_pretrained(str(pipeline))
    generator = torch.Generator().manual_seed(config.seed)
    right = {d: 0 for d in DIRECTIONS}
    n = config.samples_per_caption
    for colour in COLOURS:
        for direction in DIRECTIONS:
            text = wan_prompt(pipe, caption(colour, direction), TEXT_TOKENS, config.cfg)
            frames = pipe(num_videos_per_prompt=n, num_frames=9, height=16, width=16,
                          num_inference_steps=config.sample_steps, guidance_scale=config.cfg,
                          generator=generator, output_type="np", **text).frames  # fmt: skip
            videos = np.asarray(frames).transpose(0, 4, 1, 2, 3)  # [n, 3, T, H, W]
            right[direction] += sum(direction_of(v) == direction for v in videos)
            if out is not None:
                _write_samples(np.asarray(frames), out, f"{colour}-{direction}")
    per = len(COLOURS) * n
    return {"accuracy": sum(right.values()) / (per * len(DIRECTIONS)),
            "by_direction": {d: r / per for d, r in right.items()}, "n": per * len(DIRECTIONS)}  # fmt: skip


def vae_ceiling(pipeline: Path, config: VideoDemoConfig) -> float:
    """The judge's accuracy on drawn clips through the pipeline's VAE (encode, decode)."""
    import diffusers
    import numpy as np
    import torch

    vae = diffusers.AutoencoderKLWan.from_pretrained(str(pipeline), subfolder="vae").eval()
    drawn = list(clips(config.val_clips, seed=config.seed + 7))
    with torch.no_grad():
        x = torch.from_numpy(np.stack([c for _, _, c in drawn]))
        decoded = vae.decode(vae.encode(x).latent_dist.mean).sample.numpy()
    return float(
        np.mean([direction_of(v) == d for (_, d, _), v in zip(drawn, decoded, strict=True)])
    )


def _write_samples(frames, out: Path, stem: str) -> None:
    import numpy as np

    from mmtrain.data.stream.media import encode_video

    out.mkdir(parents=True, exist_ok=True)
    for i, clip in enumerate((np.clip(frames, 0, 1) * 255).round().astype(np.uint8)):
        (out / f"{stem}-{i}.mp4").write_bytes(encode_video(clip, fps=8))


def run_video_demo(
    config: VideoDemoConfig, on_phase: Phase | None = None, on_step: StepHook | None = None
) -> VideoDemoResult:
    """Pipeline (VAE stage), data, latents, training, evaluation, report (module docstring)."""
    config.validate()
    _check_libraries()
    check_out(config.out, OUTPUTS)
    paths = Paths(config.out)
    for name in OUTPUTS:
        shutil.rmtree(paths.out / name, ignore_errors=True)  # an interrupted run starts afresh
    phase = on_phase or (lambda name, detail: None)
    lap = PhaseClock()

    phase("pipeline", f"a tiny WanPipeline; its VAE trained for {config.model.vae_steps} steps")
    pipeline = build_pipeline(paths.out / "pipeline", config.model)
    lap("pipeline")

    phase("latents", f"{config.train_clips} clips of a square moving in one of 4 directions")
    clip_shards(paths.out / "data" / "train", config.train_clips, seed=config.seed)
    encode_latents(paths)
    spec = model_spec(pipeline)
    spec.save(paths.spec)
    lap("latents")

    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    steps = calibrated_steps(config, spec, phase, lap)
    phase("train", f"{steps} steps of {config.batch_size} clips")
    hook = None if on_step is None else lambda row: on_step({**row, "total_steps": steps})
    result = train(config_from_dict(train_config(config, paths, steps)), on_step=hook)
    lap("train")

    phase("judge", f"{config.samples_per_caption} clips per caption, trained and untrained")
    trained = judged_accuracy(paths.run / "ema", config, paths.run / "samples")
    untrained = judged_accuracy(pipeline, config, None)
    video = {**trained, "accuracy_untrained": untrained["accuracy"], "chance": 1 / len(DIRECTIONS),
             "accuracy_drawn_through_vae": vae_ceiling(pipeline, config),
             "samples_per_caption": config.samples_per_caption, "cfg": config.cfg}  # fmt: skip
    document = {"schema_version": 1, "model": str(paths.run / "ema"), "step": result.step,
                "weights": "ema", "video": video}  # fmt: skip
    from mmtrain.atomic import atomic_write_text

    atomic_write_text(paths.run / "eval.json", json.dumps(document, indent=2) + "\n")
    lap("judge")

    phase("report", str(paths.run / "report.html"))
    from mmtrain.report import build_report

    report = build_report(paths.run)
    lap("report")
    return VideoDemoResult(paths=paths, steps=steps, n_train=config.train_clips, video=video,
                           report_html=report.html, seconds=lap.seconds)  # fmt: skip
