"""`mmtrain quickstart --vlm-video`: a native-resolution VLM learns to say what a shape does in
a short clip, offline, and the held-out figures show it reads the order of the frames.

    data     clips of 4 frames of 32 x 32 pixels: a square, triangle, cross or bar that moves
             (left, right, up, down), grows, shrinks or turns (clockwise, anticlockwise), drawn
             with Pillow and encoded to MP4 with PyAV (`video_data`), each a LLaVA conversation
             "What happens?\\n<video>" -> "moves left" ──mmtrain data build──▶
             OUT/data/{train,val}/ conversation shards; the held-out clips show (shape, motion)
             pairs that no training clip shows. A BPE of the conversations, with its chat
             template, in OUT/tokenizer/
    model    the `tiny-qwen2-vl` preset (a native-resolution tower: patch 4 over 2 frames,
             2 x 2 merge; a 2-block M-RoPE decoder of width 64) over the tokenizer's ids plus
             the image and video placeholders, from scratch
    train    OUT/run/: every clip's 4 frames at 32 x 32 within `data.vision`'s budget (two
             temporal patches of 4 x 4 tokens: 32 tokens), packed rows, fixed steps;
             validation at the end on the held-out clips (`VLMEvaluator`: greedy answers
             scored by exact match, once with the frames in order and once with each clip's
             frames reversed) -> OUT/run/eval.json
    report   OUT/run/eval.json gets a `video` block (accuracy in order / reversed, n, per
             motion, how often a reversed clip is answered with the opposite motion), and the
             CLI prints it as a table

Reversing a clip keeps its frames, its question and its tokens and changes only the order the
model sees them in. Every motion's reverse is another motion (`video_data.PAIRS`), drawn so
that a reversed clip looks exactly like a clip of the opposite motion: a model that reads one
frame, or ignores the order of the frames, scores the same both ways (about chance: it cannot
tell a pair apart); one that reads the order scores near 0 reversed, answering the opposite.

The step count is fixed (deterministic results on any machine); `--minutes` only cuts it on a
machine too slow for it, as in the other quickstarts.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.config import VisionDataConfig
from mmtrain.quickstart.budget import fit_steps, step_seconds
from mmtrain.quickstart.common import (
    ChatPaths,
    Phase,
    PhaseClock,
    StepHook,
    build_shards,
    check_out,
)
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.video_data import (
    EVAL_PROMPT,
    FPS,
    FRAMES,
    HELD_OUT,
    MOTIONS,
    REVERSED,
    SIDE,
    TRAINED,
    Clip,
    make_clips,
    write_attribution,
    write_split,
    write_tokenizer,
)
from mmtrain.quickstart.vlm_data import TokenizerFolder
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

# What OUT may hold besides a user's files (check_out refuses anything else).
OUTPUTS = ("data", "model.yaml", "run", "ATTRIBUTION.txt", "tokenizer")
PRESET = "tiny-qwen2-vl"


@dataclass
class VlmVideoConfig:
    """What `mmtrain quickstart --vlm-video` runs; the defaults fit 8 minutes on 2 idle cores."""

    out: Path = Path("runs/quickstart-vlm-video")
    # Held-out accuracy after 1,200 steps: 93.8% in order, 0.0% reversed (README; about 0.12 s
    # a step on 2 cores). In a run validating every 400 steps: 79.7% after 400 steps, 93.0%
    # after 800, 91.4% after 1,200, reversed 3.1%, 0.0%, 0.0%: the curve has flattened.
    steps: int = 1200
    minutes: float = 6.0  # upper bound on training time: fewer steps on a slower machine
    fit_budget: bool = True
    batch_size: int = 32
    lr: float = 2e-3
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    train_clips: int = 2400
    val_clips: int = 128
    vocab_size: int = 320  # at most: the conversations' BPE may end smaller
    rope_theta: float = 1e6  # the decoder's rotary base, the preset's: see `video_spec`
    sequence_length: int = 128  # a packed row's LM positions: 2 to 3 clips with their text
    eval_batch_size: int = 128
    build_workers: int = 2
    seed: int = 0

    def validate(self) -> None:
        for name in ("steps", "batch_size", "vocab_size", "sequence_length", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if not self.minutes > 0:
            raise FieldError("--minutes", f"must be positive, got {self.minutes}")
        least = max(len(TRAINED), self.batch_size)
        if self.train_clips < least:
            raise FieldError(
                "--limit",
                f"{self.train_clips} training clips are too few for batches of "
                f"{self.batch_size} and every trained (shape, motion) pair; give at least {least}",
            )
        if self.val_clips < len(HELD_OUT):
            raise FieldError(
                "val_clips", f"needs at least {len(HELD_OUT)} (one per held-out pair), "
                f"got {self.val_clips}"
            )  # fmt: skip
        self.vision().validate()

    def vision(self) -> VisionDataConfig:
        """`data.vision`: every frame of every clip, at the size it was drawn (4 x 4 tokens of
        8 x 8 pixels; the Qwen2-VL default of at least 128 tokens a frame would upscale it)."""
        tokens = (SIDE // 8) ** 2
        return VisionDataConfig(
            video_fps=FPS,
            video_min_frames=FRAMES,
            video_max_frames=FRAMES,
            frame_min_tokens=tokens,
            frame_max_tokens=tokens,
        )

    def budget(self) -> QuickstartConfig:
        """The step budget in the form `budget.plan_steps` reads."""
        return QuickstartConfig(steps=self.steps, minutes=self.minutes, batch_size=self.batch_size,
                                fit_budget=self.fit_budget)  # fmt: skip


@dataclass
class VideoPaths(ChatPaths):
    """Where `--vlm-video` writes, under `out`: data/, model.yaml, run/, plus the tokenizer."""


@dataclass
class VlmVideoResult:
    """What `--vlm-video` did: its steps, the held-out scores, how long."""

    paths: VideoPaths
    n_train: int
    steps: int
    video: dict[str, Any]  # eval.json "video"
    seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: float | None = None

    @property
    def eval_json(self) -> Path:
        return self.paths.eval_json


# ----------------------------------------------------------------------------- the model
def video_spec(tokens: TokenizerFolder, config: VlmVideoConfig) -> ModelSpec:
    """The tiny-qwen2-vl preset over the tokenizer's ids plus the image and video placeholders
    (the two ids past them), with the decoder's rotary base `config.rope_theta`.

    Why the preset's base (1e6) is kept, where `vlm_docs` lowers it to 3: M-RoPE turns each
    head's frequency pairs by a token's (time, row, column) positions in sections
    (`mrope_section` [2, 3, 3]), time first, on the highest frequencies: at 1e6 the time
    section still turns by 1 and 0.18 radians per temporal patch, so the decoder tells the
    clip's two halves apart, and the tower's patches (2 frames each) already show which way
    the shape went within each half. Measured on these clips in runs validating every few
    hundred steps: 91.4% held-out accuracy after 1,200 steps at base 1e6 against 93.8% at 3
    (117 and 120 of 128 clips; 0.0% reversed both), 79.7% against 84.4% after 400 steps: no
    clear difference, so the preset stays."""
    data = load_spec(PRESET).to_dict()
    data["name"] = "quickstart-vlm-video"
    data["vision_tokens"].update(
        image_token_id=tokens.vocab_size, video_token_id=tokens.vocab_size + 1
    )
    data["decoder"].update(
        vocab_size=tokens.vocab_size + 2,
        max_positions=config.sequence_length,
        bos_id=tokens.bos_id,
        eos_ids=[tokens.eos_id],
        rope_theta=config.rope_theta,
    )
    spec = ModelSpec.from_dict(data)
    spec.validate()
    return spec


def clip_shape(spec: ModelSpec, config: VlmVideoConfig):
    """A clip's (frames, height, width) at the tower under the run's budget: `visual_budget`'s
    rule, the loader's (every clip has the same size)."""
    from mmtrain.visual_budget import ClipSize, budget_of

    assert spec.vision is not None
    budget = budget_of(spec.vision, config.vision())
    return budget.shapes([ClipSize(FRAMES, float(FPS), SIDE, SIDE)])[0]


# ----------------------------------------------------------------------------- training
def train_config(
    config: VlmVideoConfig, paths: VideoPaths, tokens: TokenizerFolder, steps: int
) -> dict[str, Any]:
    """The `mmtrain train` config (as a dict): packed rows, the clips' budget, and validation
    with generation on the held-out clips at the end (eval.json)."""
    vision = config.vision()
    return {
        "model": str(paths.spec),
        "data": {
            "train": str(paths.train_shards),
            "val": str(paths.val_shards),
            "tokenizer": str(tokens.tokenizer),
            "chat_template": str(tokens.folder),
            "sequence_length": config.sequence_length,
            "pack": True,
            "vision": {
                "video_fps": vision.video_fps,
                "video_min_frames": vision.video_min_frames,
                "video_max_frames": vision.video_max_frames,
                "frame_min_tokens": vision.frame_min_tokens,
                "frame_max_tokens": vision.frame_max_tokens,
            },
            "workers": 0,  # 4 frames of 32 x 32 decode in far less than a step
            "shuffle_window": 4096,
        },
        "train": {
            "steps": steps,
            "batch_size": config.batch_size,
            "precision": "fp32",
            "lr": config.lr,
            "min_lr": config.lr / 100,
            "weight_decay": config.weight_decay,
            "warmup_steps": min(steps, max(1, round(config.warmup_fraction * steps))),
            "schedule": "cosine",
            "grad_clip": 1.0,
            "device": "cpu",
        },
        "eval": {"every_steps": None, "batch_size": config.eval_batch_size},  # at the end
        "checkpoint": {"every_steps": None, "every_minutes": 5, "keep": 1},
        "metrics": {"log_every": 10},
        "seed": config.seed,
        "out": str(paths.run),
    }


def time_video_steps(spec: ModelSpec, config: VlmVideoConfig) -> float:
    """Seconds per optimizer step on this CPU: a probe of up to 16 rows, each a clip at the
    run's size and its prompt, forward, backward and AdamW (timed as `budget.time_steps`
    does), scaled up linearly to `batch_size` samples."""
    import torch

    from mmtrain.models import create_model
    from mmtrain.train.measure_step import native_language_batch, next_token_loss

    assert spec.vision is not None
    shape = clip_shape(spec, config)
    positions = shape.tokens(spec.vision) + 16  # the prompt and the answer: about 16 ids
    probe = min(16, config.batch_size)
    model = create_model(spec, seed=0)
    batch = native_language_batch(spec, probe, positions,
                                  ((shape.frames, shape.height, shape.width),),
                                  torch.Generator().manual_seed(0))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss():
        return next_token_loss(model(batch), batch["labels"])

    return step_seconds(loss, optimizer) * config.batch_size / probe


# ----------------------------------------------------------------------------- the report
def clip_answers(
    config: VlmVideoConfig, paths: VideoPaths, tokens: TokenizerFolder
) -> list[dict[str, Any]]:
    """Every held-out clip's greedy answer, with its frames in order and reversed: the
    validation's evaluator (`VLMEvaluator`, the run's budget, template and seed) asked to keep
    all of them as examples, for the per-motion figures (the validation keeps eight)."""
    from mmtrain import load_model
    from mmtrain.eval.generation import VLMEvaluator
    from mmtrain.visual_budget import budget_of

    model = load_model(paths.run).eval()
    assert model.spec.vision is not None
    evaluator = VLMEvaluator(
        model.spec,
        paths.val_shards,
        batch_size=config.eval_batch_size,
        tokenizer=str(tokens.tokenizer),
        chat_template=str(tokens.folder),
        max_length=config.sequence_length,
        max_new_tokens=8,  # the longest answer is 3 to 4 ids and [EOT]
        examples=config.val_clips,
        seed=config.seed,
        rank=0,
        world_size=1,
        budget=budget_of(model.spec.vision, config.vision()),
    )
    try:
        return evaluator.report(model)["examples"]
    finally:
        evaluator.close()


def video_block(
    report: dict[str, Any], answers: list[dict[str, Any]], clips: list[Clip], tokens: int
) -> dict[str, Any]:
    """eval.json's `video`: the held-out clips' accuracy (exact match) with their frames in
    order, reversed and shuffled between clips, and how many (the validation's figures,
    `report["generation"]`); the same per motion (from `answers`, one per held-out clip of
    `clips`), how often a reversed clip is answered with the opposite motion, and the clips'
    LM tokens."""
    generation = report.get("generation", {})
    motion_of = {clip.key: clip.motion for clip in clips}
    by_motion: dict[str, dict[str, Any]] = {}
    for motion in MOTIONS:
        rows = [a for a in answers if motion_of.get(a["id"]) == motion]
        backwards = [a for a in rows if "generated_frames_reversed" in a]
        by_motion[motion] = {
            "n": len(rows),
            "accuracy": _mean([a["exact_match"] for a in rows]),
            "accuracy_frames_reversed": _mean(
                [float(a["generated_frames_reversed"] == motion) for a in backwards]
            ),
            "reversed_as_opposite": _mean(
                [float(a["generated_frames_reversed"] == REVERSED[motion]) for a in backwards]
            ),
        }
    backwards = [a for a in answers if "generated_frames_reversed" in a]
    opposite = [float(a["generated_frames_reversed"] == REVERSED[motion_of[a["id"]]])
                for a in backwards if a["id"] in motion_of]  # fmt: skip
    wrong = [
        {"id": a["id"], "motion": motion_of.get(a["id"]), "generated": a["generated"]}
        for a in answers if a["generated"] != a["reference"]
    ]  # fmt: skip
    return {
        "accuracy": generation.get("exact_match"),
        "accuracy_frames_reversed": generation.get("exact_match_frames_reversed"),
        "n": generation.get("n"),
        "n_frames_reversed": generation.get("n_frames_reversed"),
        # each question with another held-out clip: the answers depend on the clip at all
        "accuracy_shuffled_clips": generation.get("exact_match_shuffled_images"),
        "chance": 1 / len(MOTIONS),
        "reversed_as_opposite": _mean(opposite),
        "prompt": EVAL_PROMPT,
        "held_out": [f"{shape} {motion}" for shape, motion in HELD_OUT],
        "clip_tokens": tokens,
        "by_motion": by_motion,
        "wrong": wrong,
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_video(paths: VideoPaths, block: dict[str, Any]) -> dict[str, Any]:
    """Add the `video` block to OUT/run/eval.json (written by the validation), atomically;
    returns the whole document."""
    from mmtrain.atomic import atomic_write_text

    document = json.loads(paths.eval_json.read_text(encoding="utf-8"))
    document["video"] = block
    atomic_write_text(paths.eval_json, json.dumps(document, indent=2, default=str) + "\n")
    return document


# ----------------------------------------------------------------------------- the whole run
def run_vlm_video(
    config: VlmVideoConfig, on_phase: Phase | None = None, on_step: StepHook | None = None
) -> VlmVideoResult:
    """Data, calibration, training with the held-out validation, the video block; see the
    module docstring. Raises FieldError for bad settings (before writing anything)."""
    config.validate()
    check_out(config.out, OUTPUTS)
    paths = VideoPaths(config.out)
    for folder in (paths.out / "data", paths.run, paths.tokenizer):
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted run starts them afresh
    phase = on_phase or (lambda name, detail: None)
    lap = PhaseClock()

    phase(
        "clips",
        f"{config.train_clips} training and {config.val_clips} held-out clips, a BPE of the "
        "conversations, shards",
    )
    train_clips = make_clips(TRAINED, "train", config.train_clips, config.seed)
    val_clips = make_clips(HELD_OUT, "val", config.val_clips, config.seed)
    train_json, train_records = write_split(paths.raw / "train", train_clips)
    val_json, _ = write_split(paths.raw / "val", val_clips)
    write_attribution(paths.out, config.seed)
    tokens = write_tokenizer(paths.tokenizer, train_records, config.vocab_size)
    build_shards(train_json, paths.train_shards, config.build_workers, modalities="video,text")
    build_shards(val_json, paths.val_shards, config.build_workers, modalities="video,text")
    spec = video_spec(tokens, config)
    spec.save(paths.spec)
    assert spec.vision is not None
    clip_tokens = clip_shape(spec, config).tokens(spec.vision)
    lap("clips")

    steps, seconds = fit_steps(config.budget(), phase, lap, lambda: time_video_steps(spec, config))

    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    phase("train", f"{steps} steps of {config.batch_size} clips, then the held-out clips")
    hook = None if on_step is None else lambda row: on_step({**row, "total_steps": steps})
    train(config_from_dict(train_config(config, paths, tokens, steps)), on_step=hook)
    lap("train")

    phase("evaluate", "each held-out clip's answer, for the figures per motion")
    answers = clip_answers(config, paths, tokens)
    report = json.loads(paths.eval_json.read_text(encoding="utf-8"))
    block = video_block(report, answers, val_clips, clip_tokens)
    write_video(paths, block)
    shutil.copy2(paths.out / "ATTRIBUTION.txt", paths.run / "ATTRIBUTION.txt")
    lap("evaluate")
    return VlmVideoResult(
        paths=paths,
        n_train=len(train_clips),
        steps=steps,
        video=block,
        seconds=lap.seconds,
        step_seconds=seconds,
    )


__all__ = [
    "OUTPUTS",
    "PRESET",
    "VideoPaths",
    "VlmVideoConfig",
    "VlmVideoResult",
    "clip_answers",
    "clip_shape",
    "run_vlm_video",
    "time_video_steps",
    "train_config",
    "video_block",
    "video_spec",
    "write_video",
]
