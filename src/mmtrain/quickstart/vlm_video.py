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
from mmtrain.quickstart.budget import fit_steps
from mmtrain.quickstart.common import ChatPaths, Phase, StepHook, build_shards
from mmtrain.quickstart.native_demo import (
    OUTPUTS,
    PRESET,
    NativeDemoConfig,
    add_eval_block,
    begin,
    held_out_answers,
    mean,
    native_spec,
    native_train_config,
    time_native_steps,
    train_run,
    vision_budget,
)
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
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)


@dataclass
class VlmVideoConfig(NativeDemoConfig):
    """What `mmtrain quickstart --vlm-video` runs; the defaults fit 8 minutes on 2 idle cores.
    The training settings it shares with `--vlm-docs` (batch 32, lr 2e-3, 128 positions a
    row, ...) are `native_demo.NativeDemoConfig`'s."""

    out: Path = Path("runs/quickstart-vlm-video")
    # Held-out accuracy after 1,200 steps: 93.8% in order, 0.0% reversed (README, two runs
    # with identical weights; about 0.12 s a step on 2 cores). In an earlier run validating
    # every 400 steps (before the clips' MP4 encoding was made deterministic: a few dozen of
    # the 2,400 clips differed from run to run): 79.7% after 400 steps, 93.0% after 800, 91.4%
    # after 1,200, reversed 3.1%, 0.0%, 0.0%: the curve has flattened.
    steps: int = 1200
    minutes: float = 6.0  # upper bound on training time: fewer steps on a slower machine
    train_clips: int = 2400
    val_clips: int = 128
    rope_theta: float = 1e6  # the decoder's rotary base, the preset's: see `video_spec`
    eval_batch_size: int = 128

    def validate(self) -> None:
        super().validate()
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
    (the two ids past them), with the decoder's rotary base `config.rope_theta`
    (`native_demo.native_spec`).

    Why the preset's base (1e6) is kept, where `vlm_docs` lowers it to 3: M-RoPE turns each
    head's frequency pairs by a token's (time, row, column) positions in sections
    (`mrope_section` [2, 3, 3]), time first, on the highest frequencies: at 1e6 the time
    section still turns by 1 and 0.18 radians per temporal patch, so the decoder tells the
    clip's two halves apart, and the tower's patches (2 frames each) already show which way
    the shape went within each half. Measured in those earlier runs (validating every few
    hundred steps): 91.4% held-out accuracy after 1,200 steps at base 1e6 against 93.8% at 3
    (117 and 120 of 128 clips; 0.0% reversed both), 79.7% against 84.4% after 400 steps: no
    clear difference, so the preset stays."""
    return native_spec("quickstart-vlm-video", tokens, config)


def clip_shape(spec: ModelSpec, config: VlmVideoConfig):
    """A clip's (frames, height, width) at the tower under the run's budget: `visual_budget`'s
    rule, the loader's (every clip has the same size)."""
    from mmtrain.visual_budget import ClipSize

    budget = vision_budget(spec, config.vision())
    return budget.shapes([ClipSize(FRAMES, float(FPS), SIDE, SIDE)])[0]


# ----------------------------------------------------------------------------- training
def train_config(
    config: VlmVideoConfig, paths: VideoPaths, tokens: TokenizerFolder, steps: int
) -> dict[str, Any]:
    """The `mmtrain train` config (as a dict): packed rows, the clips' budget, and validation
    with generation on the held-out clips at the end (eval.json). AdamW's betas and eps are
    left to the workload's defaults."""
    return native_train_config(config, paths, tokens, steps)


def time_video_steps(spec: ModelSpec, config: VlmVideoConfig) -> float:
    """Seconds per optimizer step on this CPU (`native_demo.time_native_steps`): rows of a
    clip at the run's size, scaled up to `batch_size` samples."""
    return time_native_steps(spec, config.batch_size, clip_shape(spec, config))


# ----------------------------------------------------------------------------- the report
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
            "accuracy": mean([a["exact_match"] for a in rows]),
            "accuracy_frames_reversed": mean(
                [float(a["generated_frames_reversed"] == motion) for a in backwards]
            ),
            "reversed_as_opposite": mean(
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
        "reversed_as_opposite": mean(opposite),
        "prompt": EVAL_PROMPT,
        "held_out": [f"{shape} {motion}" for shape, motion in HELD_OUT],
        "clip_tokens": tokens,
        "by_motion": by_motion,
        "wrong": wrong,
    }


# ----------------------------------------------------------------------------- the whole run
def run_vlm_video(
    config: VlmVideoConfig, on_phase: Phase | None = None, on_step: StepHook | None = None
) -> VlmVideoResult:
    """Data, calibration, training with the held-out validation, the video block; see the
    module docstring. Raises FieldError for bad settings (before writing anything)."""
    paths = VideoPaths(config.out)
    phase, lap = begin(config, paths, on_phase)

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

    phase("train", f"{steps} steps of {config.batch_size} clips, then the held-out clips")
    train_run(train_config(config, paths, tokens, steps), on_step)
    lap("train")

    phase("evaluate", "each held-out clip's answer, for the figures per motion")
    # max_new_tokens: the longest answer is 3 to 4 ids and [EOT]
    answers = held_out_answers(config, paths, tokens, config.val_clips, 8)
    report = json.loads(paths.eval_json.read_text(encoding="utf-8"))
    block = video_block(report, answers, val_clips, clip_tokens)
    add_eval_block(paths, "video", block)
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
    "clip_shape",
    "run_vlm_video",
    "time_video_steps",
    "train_config",
    "video_block",
    "video_spec",
]
