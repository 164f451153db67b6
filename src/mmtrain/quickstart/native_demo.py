"""What the two native-resolution VLM demos share, `--vlm-docs` (`vlm_docs`) and `--vlm-video`
(`vlm_video`): the training settings they have in common, the `tiny-qwen2-vl` preset over a
demo's BPE, the `mmtrain train` config, the timed probe of a step, the held-out answers kept
for the per-kind figures, and the block each demo adds to eval.json.

What differs between them stays in each demo: its data, its `data.vision` budget (pages at
their own size, clips at a fixed frame count and size), why its rotary base, and the eval.json
block it builds from the answers. Nothing here imports a demo.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmtrain.config import VisionDataConfig
from mmtrain.quickstart.budget import step_seconds
from mmtrain.quickstart.common import ChatPaths, Phase, PhaseClock, StepHook, check_out
from mmtrain.quickstart.config import QuickstartConfig
from mmtrain.quickstart.vlm_data import TokenizerFolder
from mmtrain.spec import ModelSpec, load_spec
from mmtrain.structured import FieldError

if TYPE_CHECKING:
    from mmtrain.visual_budget import Shape, VisualBudget

# What OUT may hold besides a user's files (check_out refuses anything else).
OUTPUTS = ("data", "model.yaml", "run", "ATTRIBUTION.txt", "tokenizer")
PRESET = "tiny-qwen2-vl"


@dataclass(kw_only=True)  # so that the fields each demo gives a default may stand anywhere
class NativeDemoConfig:
    """The settings both native demos train with; each demo's config adds its data's sizes
    and gives `out`, `steps`, `minutes`, `rope_theta` and `eval_batch_size` their defaults."""

    out: Path
    steps: int
    minutes: float  # upper bound on training time: fewer steps on a slower machine
    fit_budget: bool = True
    batch_size: int = 32
    lr: float = 2e-3
    warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    vocab_size: int = 320  # at most: the BPE may end smaller (read TokenizerFolder.vocab_size)
    rope_theta: float  # the decoder's rotary base: each demo says why its value
    sequence_length: int = 128  # a packed row's LM positions: 2 to 3 samples with their text
    eval_batch_size: int
    build_workers: int = 2
    seed: int = 0

    def validate(self) -> None:
        """The checks of the shared settings; each demo checks its own after these."""
        for name in ("steps", "batch_size", "vocab_size", "sequence_length", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if not self.minutes > 0:
            raise FieldError("--minutes", f"must be positive, got {self.minutes}")

    def vision(self) -> VisionDataConfig:
        """`data.vision`: the budget the demo's pages or clips are read within (each demo's)."""
        raise NotImplementedError

    def budget(self) -> QuickstartConfig:
        """The step budget in the form `budget.plan_steps` reads."""
        return QuickstartConfig(steps=self.steps, minutes=self.minutes, batch_size=self.batch_size,
                                fit_budget=self.fit_budget)  # fmt: skip


def begin(
    config: NativeDemoConfig, paths: ChatPaths, on_phase: Phase | None
) -> tuple[Phase, PhaseClock]:
    """What both demos do first: check the settings and OUT (FieldError before anything is
    written), empty what an interrupted run left (data/, run/, tokenizer/: cheap to remake).
    Returns the phase callback (a no-op when none) and a started phase clock."""
    config.validate()
    check_out(config.out, OUTPUTS)
    for folder in (paths.out / "data", paths.run, paths.tokenizer):
        shutil.rmtree(folder, ignore_errors=True)
    return on_phase or (lambda name, detail: None), PhaseClock()


# ----------------------------------------------------------------------------- the model
def native_spec(name: str, tokens: TokenizerFolder, config: NativeDemoConfig) -> ModelSpec:
    """The tiny-qwen2-vl preset named `name`, over the tokenizer's ids plus the image and
    video placeholders (the two ids past them), with the decoder's rotary base
    `config.rope_theta` and `config.sequence_length` positions."""
    data = load_spec(PRESET).to_dict()
    data["name"] = name
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


def vision_budget(spec: ModelSpec, vision: VisionDataConfig) -> VisualBudget:
    """The run's `visual_budget.VisualBudget` (the loader's rule) for the spec's tower."""
    from mmtrain.visual_budget import budget_of

    assert spec.vision is not None
    return budget_of(spec.vision, vision)


# ----------------------------------------------------------------------------- training
def native_train_config(
    config: NativeDemoConfig,
    paths: ChatPaths,
    tokens: TokenizerFolder,
    steps: int,
    adamw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `mmtrain train` config (as a dict): packed rows within the demo's budget
    (`config.vision()`: `data.vision`), and validation with generation on the held-out samples
    at the end (eval.json). `adamw`: betas / eps a demo's figures were measured with (none:
    the workload's defaults)."""
    return {
        "model": str(paths.spec),
        "data": {
            "train": str(paths.train_shards),
            "val": str(paths.val_shards),
            "tokenizer": str(tokens.tokenizer),
            "chat_template": str(tokens.folder),
            "sequence_length": config.sequence_length,
            "pack": True,
            "vision": dataclasses.asdict(config.vision()),
            "workers": 0,  # a small page or a 4-frame clip decodes in far less than a step
            "shuffle_window": 4096,
        },
        "train": {
            "steps": steps,
            "batch_size": config.batch_size,
            "precision": "fp32",
            "lr": config.lr,
            "min_lr": config.lr / 100,
            "weight_decay": config.weight_decay,
            **(adamw or {}),
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


def time_native_steps(spec: ModelSpec, batch_size: int, shape: Shape) -> float:
    """Seconds per optimizer step on this CPU: a probe of up to 16 rows, each one visual
    input of `shape` (`visual_budget.Shape`: frames 1 for a page, the clip's frames for a clip)
    and its prompt, forward, backward and AdamW (timed as `budget.time_steps` does), scaled up
    linearly to `batch_size` samples."""
    import torch

    from mmtrain.models import create_model
    from mmtrain.train.measure_step import native_language_batch, next_token_loss

    assert spec.vision is not None
    positions = shape.tokens(spec.vision) + 16  # the prompt and the answer: about 16 ids
    probe = min(16, batch_size)
    model = create_model(spec, seed=0)
    batch = native_language_batch(spec, probe, positions,
                                  ((shape.frames, shape.height, shape.width),),
                                  torch.Generator().manual_seed(0))  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss():
        return next_token_loss(model(batch), batch["labels"])

    return step_seconds(loss, optimizer) * batch_size / probe


def train_run(run: dict[str, Any], on_step: StepHook | None) -> None:
    """`mmtrain train` on the config dict `run`, each step's row handed to `on_step` with
    the run's "total_steps"."""
    from mmtrain.config import config_from_dict
    from mmtrain.train.loop import train

    steps = run["train"]["steps"]
    hook = None if on_step is None else lambda row: on_step({**row, "total_steps": steps})
    train(config_from_dict(run), on_step=hook)


# ----------------------------------------------------------------------------- the report
def held_out_answers(
    config: NativeDemoConfig,
    paths: ChatPaths,
    tokens: TokenizerFolder,
    examples: int,
    max_new_tokens: int,
) -> list[dict[str, Any]]:
    """Every held-out sample's greedy answer (`examples` of them), with the evaluator's
    variants (shuffled images, clips reversed): the validation's evaluator (`VLMEvaluator`,
    the run's budget, template and seed) asked to keep all of them as examples, for the
    per-kind figures (the validation keeps eight)."""
    from mmtrain import load_model
    from mmtrain.eval.generation import VLMEvaluator

    model = load_model(paths.run).eval()
    evaluator = VLMEvaluator(
        model.spec,
        paths.val_shards,
        batch_size=config.eval_batch_size,
        tokenizer=str(tokens.tokenizer),
        chat_template=str(tokens.folder),
        max_length=config.sequence_length,
        max_new_tokens=max_new_tokens,
        examples=examples,
        seed=config.seed,
        rank=0,
        world_size=1,
        budget=vision_budget(model.spec, config.vision()),
    )
    try:
        return evaluator.report(model)["examples"]
    finally:
        evaluator.close()


def mean(values: list[float]) -> float | None:
    """The mean of `values`, None for none (a kind with no held-out sample)."""
    return sum(values) / len(values) if values else None


def add_eval_block(paths: ChatPaths, name: str, block: dict[str, Any]) -> dict[str, Any]:
    """Add `block` as `name` to OUT/run/eval.json (written by the validation), atomically;
    returns the whole document."""
    from mmtrain.atomic import atomic_write_text

    document = json.loads(paths.eval_json.read_text(encoding="utf-8"))
    document[name] = block
    atomic_write_text(paths.eval_json, json.dumps(document, indent=2, default=str) + "\n")
    return document


__all__ = [
    "OUTPUTS",
    "PRESET",
    "NativeDemoConfig",
    "add_eval_block",
    "begin",
    "held_out_answers",
    "mean",
    "native_spec",
    "native_train_config",
    "time_native_steps",
    "train_run",
    "vision_budget",
]
