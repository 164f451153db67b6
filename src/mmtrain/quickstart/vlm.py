"""`mmtrain quickstart --vlm`: LLaVA's two-stage recipe in miniature, on the emoji, offline.

    stage 0  the image-text quickstart's CLIP (`image_text`, trained here into OUT/clip/, or an
             existing run given with --clip): its image tower becomes the vision tower
    data     each emoji a conversation, "<image>\\nWhat is this?" -> its name (`vlm_data`),
             ──mmtrain data build──▶ OUT/data/{train,val}/ conversation shards; a BPE trained on
             the training conversations, with its chat template, in OUT/tokenizer/
    stage 1  OUT/stage1/: only the projector trains (vision tower and LM frozen); the vision
             tower comes from stage 0 (`init: {image: CLIP run}`)
    stage 2  OUT/run/: the projector and the LM train (vision tower frozen), from stage 1
             (`init: OUT/stage1`)
    evaluate greedy answers to "What is this?" on the held-out emoji, scored against their
             names (token F1, exact match), and again with the images shuffled between the
             samples -> OUT/run/eval.json

The held-out emoji are the image-text quickstart's validation split (by key), so neither the
CLIP nor the VLM saw them. Shuffling the images keeps the prompts and moves each image to
another sample (`eval.generation.derangement`): a model that answers from the image scores
clearly higher with its own images than with another's, one that answers from the words of
the prompt alone scores the same.

The model: the CLIP's image tower (32 px, 8 px patches, 2 blocks of width 128) up to its last
block, its 16 patch tokens (the class token dropped, as LLaVA does) through a two-layer MLP
projector into a Llama-style LM of 2 blocks of width 128 with tied embeddings, over a 1,024-id
BPE plus the image placeholder. Where LLaVA starts from a pre-trained LM, this LM starts from
random weights, so stage 1 only teaches the projector to address it and most of the learning
is stage 2's. The step counts are fixed (deterministic results on any machine); `--minutes`
only cuts them on a machine too slow for them, as in the image-text quickstart.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmtrain.quickstart.budget import plan_steps, time_language_model_steps
from mmtrain.quickstart.common import (
    ChatPaths,
    Phase,
    PhaseClock,
    StepHook,
    build_shards,
    check_out,
)
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.emoji_data import check_packages
from mmtrain.quickstart.stage0 import clip_stage
from mmtrain.quickstart.vlm_data import (
    EVAL_PROMPT,
    TokenizerFolder,
    write_conversations,
    write_tokenizer,
)
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)

# What OUT may hold besides a user's files (check_out refuses anything else).
OUTPUTS = ("data", "model.yaml", "run", "ATTRIBUTION.txt", "clip", "stage1", "tokenizer")


@dataclass
class VlmConfig:
    """What `mmtrain quickstart --vlm` runs; the defaults fit 6 minutes on 2 idle cores."""

    out: Path = Path("runs/quickstart-vlm")
    clip: Path | None = None  # an image-text quickstart (OUT or OUT/run); None: train one
    clip_steps: int = 450  # the image-text quickstart's own default
    # VLM steps, stage 1 and stage 2 together: about 2 of the whole command's 3.6 minutes on
    # 2 lightly loaded cores (README), a margin under the 6 it is meant for.
    steps: int = 600
    stage1_fraction: float = 0.2  # of `steps`: the projector alone
    # Upper bound on training time, per model: the CLIP's steps, then the two VLM stages'.
    minutes: float = 4.0
    fit_budget: bool = True
    batch_size: int = 64
    stage1_lr: float = 2e-3  # the projector alone: few weights, a larger step
    stage2_lr: float = 1e-3
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    vocab_size: int = 1024  # BPE ids (the placeholder is one more)
    lm_width: int = 128
    lm_layers: int = 2
    lm_heads: int = 4
    lm_mlp_hidden: int = 352  # SwiGLU's usual 8/3 x width, rounded to a multiple of 32
    projector: str = "mlp"
    feature_layer: int = -1  # the last block: a 2-block tower's -2 is its first block
    keep_cls: bool = False
    sequence_length: int = 64  # LM positions: 16 image tokens + at most 40 ids (measured)
    max_new_tokens: int = 24  # the longest held-out name is 17 BPE ids, then [EOT]
    eval_batch_size: int = 128
    examples: int = 8  # answers kept in eval.json (and printed)
    limit: int | None = None  # an evenly spaced subset of this many emoji (tests)
    val_fraction: float = 0.1
    build_workers: int = 2
    seed: int = 0

    def stage_steps(self, steps: int | None = None) -> tuple[int, int]:
        """(stage 1, stage 2) steps out of `steps` (default `self.steps`), each at least 1."""
        total = self.steps if steps is None else steps
        first = max(1, round(self.stage1_fraction * total))
        return first, max(1, total - first)

    def validate(self) -> None:
        for name in ("clip_steps", "batch_size", "vocab_size", "max_new_tokens", "examples"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.steps < 2:
            raise FieldError("--steps", f"needs at least 2 (one per stage), got {self.steps}")
        if not 0 < self.stage1_fraction < 1:
            raise FieldError("stage1_fraction", f"must be in (0, 1), got {self.stage1_fraction}")
        if not self.minutes > 0:
            raise FieldError("--minutes", f"must be positive, got {self.minutes}")
        if self.limit is not None and self.limit < 20:
            raise FieldError("--limit", f"needs at least 20 emoji, got {self.limit}")
        if self.clip is not None and not self.clip.exists():
            raise FieldError("--clip", f"{self.clip} does not exist")

    def clip_config(self, out: Path) -> QuickstartConfig:
        """The image-text quickstart of stage 0, on the same emoji and split."""
        return QuickstartConfig(
            out=out,
            steps=self.clip_steps,
            minutes=self.minutes,
            fit_budget=self.fit_budget,
            limit=self.limit,
            val_fraction=self.val_fraction,
            build_workers=self.build_workers,
            seed=self.seed,
        )


@dataclass
class VlmPaths(ChatPaths):
    """Where `--vlm` writes, under `out`: the image-text demo's folders, plus the CLIP of stage
    0, the tokenizer and stage 1's run (`run` is stage 2's)."""

    @property
    def clip(self) -> Path:
        return self.out / "clip"

    @property
    def stage1(self) -> Path:
        return self.out / "stage1"


@dataclass
class VlmResult:
    """What `--vlm` did: the steps of each stage, the held-out answers' scores, how long."""

    paths: VlmPaths
    clip_run: Path
    n_train: int
    steps: dict[str, int | None]  # {"clip": N (None: given), "stage1": N, "stage2": N}
    generation: dict[str, Any]  # eval.json "generation"
    examples: list[dict[str, Any]]  # eval.json "examples"
    clip_retrieval: dict[str, dict[str, Any]] | None  # stage 0's held-out retrieval (trained here)
    seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: float | None = None  # the calibration's estimate for the VLM stages

    @property
    def eval_json(self) -> Path:
        return self.paths.eval_json


# ----------------------------------------------------------------------------- the model
def vlm_spec(clip: ModelSpec, tokens: TokenizerFolder, config: VlmConfig) -> ModelSpec:
    """The CLIP's image tower (without its projection into the shared embedding), the
    projector and a small Llama-style LM over the tokenizer's ids plus the placeholder."""
    if "image" not in clip.towers or clip.towers["image"].modality != "image":
        raise FieldError("--clip", f"model {clip.name!r} has no image tower named 'image'")
    tower = dict(clip.to_dict()["towers"]["image"])
    tower["output_proj"] = False  # the VLM reads hidden states, not the CLIP embedding
    data = {
        "name": "quickstart-vlm",
        "embed_dim": tower["width"],
        "objective": "next_token",
        "towers": {"image": tower},
        "decoder": {
            "vocab_size": tokens.vocab_size + 1,  # the image placeholder is the last id
            "width": config.lm_width,
            "layers": config.lm_layers,
            "heads": config.lm_heads,
            "mlp_hidden": config.lm_mlp_hidden,
            "tie_embeddings": True,
            "max_positions": config.sequence_length,
            "bos_id": tokens.bos_id,
            "eos_ids": [tokens.eos_id],
        },
        "projector": {
            "image_token_id": tokens.image_token_id,
            "kind": config.projector,
            "feature_layer": config.feature_layer,
            "keep_cls": config.keep_cls,
        },
    }
    spec = ModelSpec.from_dict(data)
    spec.validate()
    return spec


# ----------------------------------------------------------------------------- stages
def stage_config(
    config: VlmConfig,
    paths: VlmPaths,
    tokens: TokenizerFolder,
    stage: int,
    steps: int,
    init: Any,
) -> dict[str, Any]:
    """The `mmtrain train` config (as a dict) of stage 1 (the projector alone) or stage 2
    (projector and LM); the vision tower stays frozen in both."""
    lr = config.stage1_lr if stage == 1 else config.stage2_lr
    towers: dict[str, Any] = {"image": {"freeze": True}}
    if stage == 1:
        towers["text"] = {"freeze": True}  # the LM: the decoder is the tower named "text"
    return {
        "model": str(paths.spec),
        "init": init,
        "data": {
            "train": str(paths.train_shards),
            "val": [],  # evaluated after stage 2 (`evaluate`), with generation
            "tokenizer": str(tokens.tokenizer),
            "chat_template": str(tokens.folder),
            "sequence_length": config.sequence_length,
            "workers": 0,
            "shuffle_window": 4096,
        },
        "train": {
            "steps": steps,
            "batch_size": config.batch_size,
            "precision": "fp32",
            "lr": lr,
            "min_lr": lr / 100,
            "weight_decay": config.weight_decay,
            # the AdamW settings its README figures were measured with
            "betas": [0.9, 0.98],
            "eps": 1e-6,
            "warmup_steps": min(steps, max(1, round(config.warmup_fraction * steps))),
            "schedule": "cosine",
            "grad_clip": 1.0,
            "device": "cpu",
            "towers": towers,
        },
        "eval": {"every_steps": None},
        "checkpoint": {"every_steps": None, "every_minutes": 5, "keep": 1},
        "metrics": {"log_every": 10},
        "seed": config.seed,
        "out": str(paths.stage1 if stage == 1 else paths.run),
    }


def fit_vlm_steps(
    config: VlmConfig, spec: ModelSpec, phase: Phase, lap: PhaseClock
) -> tuple[int, int, float | None]:
    """(stage 1 steps, stage 2 steps, seconds per step): `config.steps` split by
    `stage1_fraction`, or fewer when a timed step says they do not fit `config.minutes`."""
    if not config.fit_budget:
        return (*config.stage_steps(), None)
    phase(
        "calibrate", f"{config.steps} steps of {config.batch_size}, at most {config.minutes:g} min"
    )
    started = time.perf_counter()
    seconds = time_language_model_steps(spec, config.batch_size, config.sequence_length)
    budget = QuickstartConfig(steps=config.steps, minutes=config.minutes)
    steps = plan_steps(budget, seconds, time.perf_counter() - started)
    lap("calibrate")
    if steps < config.steps:
        log.warning(
            "%.2f s per step: only %d of %d VLM steps fit %g min; the model learns less",
            seconds, steps, config.steps, config.minutes,
        )  # fmt: skip
    return (*config.stage_steps(steps), seconds)


def evaluate(config: VlmConfig, paths: VlmPaths, tokens: TokenizerFolder, step: int) -> dict:
    """Perplexity and greedy answers on the held-out conversations, with their own images and
    with the images shuffled between samples; written to OUT/run/eval.json and returned."""
    from mmtrain import __version__, load_model
    from mmtrain.atomic import atomic_write_text
    from mmtrain.eval.generation import VLMEvaluator

    model = load_model(paths.run).eval()
    evaluator = VLMEvaluator(
        model.spec,
        paths.val_shards,
        batch_size=config.eval_batch_size,
        tokenizer=str(tokens.tokenizer),
        chat_template=str(tokens.folder),
        max_length=config.sequence_length,
        max_new_tokens=config.max_new_tokens,
        examples=config.examples,
        seed=config.seed,
        rank=0,
        world_size=1,
    )
    try:
        report = evaluator.report(model)
    finally:
        evaluator.close()
    document = {
        "schema_version": 1,
        "model": str(paths.run),
        "model_name": model.spec.name,
        "mmtrain_version": __version__,
        "step": step,
        "prompt": EVAL_PROMPT,
        **report,
    }
    atomic_write_text(paths.eval_json, json.dumps(document, indent=2) + "\n")
    return document


# ----------------------------------------------------------------------------- the whole run
def run_vlm(
    config: VlmConfig, on_phase: Phase | None = None, on_step: StepHook | None = None
) -> VlmResult:
    """Stage 0 (CLIP), data, calibration, stage 1, stage 2, evaluation; see the module
    docstring. Raises `emoji_data.MissingPackages` (before writing anything) when the
    quickstart's packages are missing and FieldError for bad settings."""
    config.validate()
    check_packages()
    check_out(config.out, OUTPUTS)
    paths = VlmPaths(config.out)
    stale = [paths.out / "data", paths.stage1, paths.run, paths.tokenizer]
    if config.clip is None:
        stale.append(paths.clip)  # an interrupted run's CLIP: stage 0 trains it again
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)  # an interrupted run starts them afresh
    phase = on_phase or (lambda name, detail: None)
    lap = PhaseClock()

    clip = clip_stage(config.clip, config.clip_config(paths.clip), paths.out, phase, on_step,
                      images=paths.raw)  # fmt: skip
    clip_run, raw = clip.run, clip.raw
    lap("clip")

    phase("data", "emoji conversations, a BPE tokenizer with its chat template, shards")
    train_json, train_records = write_conversations(raw / "train", held_out=False)
    val_json, _ = write_conversations(raw / "val", held_out=True)
    tokens = write_tokenizer(paths.tokenizer, train_records, config.vocab_size)
    build_conversation_shards(train_json, paths.train_shards, config.build_workers)
    build_conversation_shards(val_json, paths.val_shards, config.build_workers)
    spec = vlm_spec(load_spec(clip_run / "spec.yaml"), tokens, config)
    spec.save(paths.spec)
    lap("data")

    steps1, steps2, step_seconds = fit_vlm_steps(config, spec, phase, lap)

    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    phase("stage1", f"{_steps(steps1)} of {config.batch_size}: the projector alone")
    hook = _hook(on_step, steps1)
    run1 = stage_config(config, paths, tokens, 1, steps1, {"image": str(clip_run)})
    train(config_from_dict(run1), on_step=hook)
    lap("stage1")

    phase("stage2", f"{_steps(steps2)} of {config.batch_size}: the projector and the LM")
    run2 = stage_config(config, paths, tokens, 2, steps2, str(paths.stage1))
    result = train(config_from_dict(run2), on_step=_hook(on_step, steps2))
    lap("stage2")

    phase("evaluate", f'"{EVAL_PROMPT}" on the held-out emoji, own and shuffled images')
    document = evaluate(config, paths, tokens, result.step)
    lap("evaluate")
    shutil.copy2(paths.out / "ATTRIBUTION.txt", paths.run / "ATTRIBUTION.txt")
    return VlmResult(
        paths=paths,
        clip_run=clip_run,
        n_train=len(train_records),
        steps={"clip": clip.steps, "stage1": steps1, "stage2": steps2},
        generation=document.get("generation", {}),
        examples=document.get("examples", []),
        clip_retrieval=clip.retrieval,
        seconds=lap.seconds,
        step_seconds=step_seconds,
    )


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _hook(on_step: StepHook | None, steps: int) -> StepHook | None:
    return None if on_step is None else lambda row: on_step({**row, "total_steps": steps})


def build_conversation_shards(source: Path, out: Path, workers: int) -> dict[str, Any]:
    """`mmtrain data build CONVERSATIONS.json --out OUT`: one sample per conversation, its
    images as members (data/ingest/pipeline.py)."""
    return build_shards(source, out, workers, modalities="image,text")


__all__ = [
    "OUTPUTS",
    "VlmConfig",
    "VlmPaths",
    "VlmResult",
    "build_conversation_shards",
    "evaluate",
    "fit_vlm_steps",
    "run_vlm",
    "stage_config",
    "vlm_spec",
]
