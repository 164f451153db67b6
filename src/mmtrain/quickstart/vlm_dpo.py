"""`mmtrain quickstart --vlm-dpo`: preference tuning after supervised fine-tuning, offline.

    stage 1  the `--vlm-docs` demo (a native-resolution VLM reading numbers off small pages;
             quickstart/vlm_docs.py) into OUT/sft/, its 2,000 steps: a reader (95% exact
             match on the held-out pages)
    pairs    each of its pages a preference pair: "What is the number?" with the page, the
             number as the chosen answer and a near miss (one digit changed) as the rejected
             one ──mmtrain data build──▶ OUT/data/{train,val}/ pair shards (the held-out pages'
             numbers are on no training page)
    train    OUT/run/: `train.objective: dpo` from the stage-1 run (`init:`), LoRA on the
             language model, the reference the same model without its adapters, and the
             chosen answers' next-token loss beside the pairs' (RPO, `sft_weight`): without it
             the tuned reader's exact match fell from 95% to 39%, DPO pushing the chosen
             answers down with the near misses
    evaluate on the held-out pairs: reward accuracy (the share of pairs whose chosen answer
             gets the higher implicit reward, beta times the log-ratio to the reference; a tie
             counts half, so the untuned model, equal to its reference, scores 50%), and exact
             match of the greedy answers before and after -> OUT/run/eval.json "preference"

The step counts are fixed (deterministic results on any machine).
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mmtrain.quickstart.common import (
    ChatPaths,
    Phase,
    PhaseClock,
    StepHook,
    build_shards,
    check_out,
)
from mmtrain.quickstart.native_demo import train_run, vision_budget
from mmtrain.quickstart.vlm_data import CONVERSATIONS_FILE
from mmtrain.quickstart.vlm_docs import DocsPaths, VlmDocsConfig, run_vlm_docs
from mmtrain.structured import FieldError

OUTPUTS = ("sft", "data", "run")


@dataclass
class VlmDpoConfig:
    """What `mmtrain quickstart --vlm-dpo` runs."""

    out: Path = Path("runs/quickstart-vlm-dpo")
    sft_steps: int = 2000
    steps: int = 600
    batch_size: int = 32
    lr: float = 1e-3
    beta: float = 0.1
    sft_weight: float = 1.0  # RPO: DPO alone lets the chosen answers fall too (README)
    lora_rank: int = 16
    train_pages: int = 4000
    val_pages: int = 100
    eval_batch_size: int = 50
    seed: int = 0
    sft: VlmDocsConfig = field(default_factory=VlmDocsConfig)

    def validate(self) -> None:
        for name in ("sft_steps", "steps", "batch_size", "lora_rank", "train_pages"):
            if getattr(self, name) < 1:
                raise FieldError(name, f"must be at least 1, got {getattr(self, name)}")
        if not self.beta > 0:
            raise FieldError("beta", f"must be positive, got {self.beta}")

    def docs_config(self) -> VlmDocsConfig:
        return replace(self.sft, out=self.out / "sft", steps=self.sft_steps,
                       train_pages=self.train_pages, val_pages=self.val_pages,
                       fit_budget=False, seed=self.seed)  # fmt: skip


@dataclass
class VlmDpoResult:
    paths: ChatPaths
    steps: int
    preference: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)


def near_miss(number: str, rng: random.Random) -> str:
    """`number` with one digit changed (never the first to 0): a misreading."""
    position = rng.randrange(len(number))
    digits = "123456789" if position == 0 else "0123456789"
    other = rng.choice([d for d in digits if d != number[position]])
    return number[:position] + other + number[position + 1 :]


def write_pairs(conversations: Path, out: Path, seed: int) -> Path:
    """The LLaVA records of `conversations` (the pages and their answers) as preference
    records beside the same images: the question and page, the answer chosen, a near miss
    rejected. Returns the new records' file."""
    rng = random.Random(seed)
    records = json.loads(conversations.read_text(encoding="utf-8"))
    pairs = []
    for record in records:
        question, answer = record["conversations"]
        pairs.append({"id": record["id"], "image": str(conversations.parent / record["image"]),
                      "conversations": [question], "chosen": answer["value"],
                      "rejected": near_miss(answer["value"], rng)})  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / CONVERSATIONS_FILE
    path.write_text(json.dumps(pairs, indent=1) + "\n", encoding="utf-8")
    return path


def train_config(config: VlmDpoConfig, sft: DocsPaths, paths: ChatPaths) -> dict[str, Any]:
    docs = config.docs_config()
    return {
        "model": str(sft.spec),
        "init": str(sft.run),
        "data": {"train": str(paths.train_shards), "tokenizer": str(sft.tokenizer / "tokenizer.json"),
                 "chat_template": str(sft.tokenizer), "sequence_length": docs.sequence_length,
                 "pack": False, "vision": _vision(docs), "workers": 0,
                 "shuffle_window": 4096},  # fmt: skip
        "train": {"steps": config.steps, "batch_size": config.batch_size, "precision": "fp32",
                  "lr": config.lr, "min_lr": config.lr / 10, "warmup_steps": config.steps // 10,
                  "schedule": "cosine", "grad_clip": 1.0, "device": "cpu", "objective": "dpo",
                  "dpo": {"beta": config.beta, "sft_weight": config.sft_weight},
                  "towers": {"text": {"lora": {"rank": config.lora_rank}}}},  # fmt: skip
        "checkpoint": {"every_steps": None, "every_minutes": 5, "keep": 1},
        "metrics": {"log_every": 10},
        "seed": config.seed,
        "out": str(paths.run),
    }


def _vision(docs: VlmDocsConfig) -> dict[str, int]:
    from dataclasses import asdict

    return asdict(docs.vision())


def held_out_rewards(config: VlmDpoConfig, sft: DocsPaths, paths: ChatPaths) -> dict[str, Any]:
    """Reward accuracy on the held-out pairs: the tuned model's log-ratios to the stage-1 model
    (its reference), a tie counting half; and the same of the stage-1 model itself (50%)."""
    import numpy as np
    import torch

    from mmtrain import load_model
    from mmtrain.config import DataConfig, VisionDataConfig
    from mmtrain.data.storage.shards import ShardSet
    from mmtrain.data.stream.conversation_batches import ConversationBatcher
    from mmtrain.data.stream.preference_batches import PairDecoder, collate_pairs
    from mmtrain.train.dpo import sequence_logps

    reference, tuned = load_model(sft.run).eval(), load_model(paths.run).eval()
    docs = config.docs_config()
    data = DataConfig(train=str(paths.val_shards), tokenizer=str(sft.tokenizer / "tokenizer.json"),
                      chat_template=str(sft.tokenizer), sequence_length=docs.sequence_length,
                      vision=VisionDataConfig(**_vision(docs)))  # fmt: skip
    batcher = ConversationBatcher(data, reference.spec)
    decode = PairDecoder(batcher.decoder(reference.spec, train=False))
    collate = collate_pairs(reference.spec, batcher)
    shards = ShardSet.open(paths.val_shards)
    margins = []
    for start in range(0, len(shards), config.eval_batch_size):
        outs = [decode(shards.read(i), np.random.default_rng(0))
                for i in range(start, min(len(shards), start + config.eval_batch_size))]  # fmt: skip
        batch = collate(outs)
        inputs = {k: v for k, v in batch.items() if k != "labels"}  # the logits, not the loss
        with torch.no_grad():
            ratios = [sequence_logps(m(inputs)["logits"], batch["labels"]) for m in (tuned, reference)]
        rewards = config.beta * (ratios[0] - ratios[1])
        n = len(outs)
        margins += (rewards[:n] - rewards[n:]).tolist()
    score = [1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins]
    return {"reward_accuracy": sum(score) / len(score), "reward_accuracy_before": 0.5,
            "reward_margin_mean": sum(margins) / len(margins), "n": len(margins)}  # fmt: skip


def exact_match(config: VlmDpoConfig, run: Path, sft: DocsPaths) -> float:
    """Greedy answers of the run's model on the held-out pages, scored by exact match."""
    from mmtrain import load_model
    from mmtrain.eval.generation import VLMEvaluator

    docs = config.docs_config()
    model = load_model(run).eval()
    evaluator = VLMEvaluator(
        model.spec, sft.val_shards, batch_size=config.eval_batch_size,
        tokenizer=str(sft.tokenizer / "tokenizer.json"), chat_template=str(sft.tokenizer),
        max_length=docs.sequence_length, max_new_tokens=8, examples=0, seed=config.seed,
        rank=0, world_size=1, budget=vision_budget(model.spec, docs.vision()),
    )  # fmt: skip
    try:
        return float(evaluator.report(model)["generation"]["exact_match"])
    finally:
        evaluator.close()


def run_vlm_dpo(
    config: VlmDpoConfig, on_phase: Phase | None = None, on_step: StepHook | None = None
) -> VlmDpoResult:
    """Stage 1, pairs, DPO, the held-out figures (module docstring)."""
    config.validate()
    check_out(config.out, OUTPUTS)
    paths = ChatPaths(config.out)
    for name in OUTPUTS:
        shutil.rmtree(paths.out / name, ignore_errors=True)
    phase = on_phase or (lambda name, detail: None)
    lap = PhaseClock()

    sft = run_vlm_docs(config.docs_config(), on_phase=lambda n, d: phase(f"sft:{n}", d),
                       on_step=on_step).paths  # fmt: skip
    lap("sft")

    phase("pairs", "each page's number chosen, a near miss rejected")
    for split, shards in (("train", paths.train_shards), ("val", paths.val_shards)):
        records = write_pairs(sft.raw / split / CONVERSATIONS_FILE, paths.raw / split,
                              config.seed + (split == "val"))  # fmt: skip
        build_shards(records, shards, 2, modalities="image,text")
    lap("pairs")

    phase("train", f"{config.steps} steps of {config.batch_size} pairs (dpo, LoRA)")
    train_run(train_config(config, sft, paths), on_step)
    lap("train")

    phase("evaluate", "held-out pairs' rewards, and the pages read before and after")
    block = held_out_rewards(config, sft, paths)
    block["exact_match_before"] = exact_match(config, sft.run, sft)
    block["exact_match"] = exact_match(config, paths.run, sft)
    block["beta"] = config.beta
    (paths.run / "eval.json").write_text(json.dumps({"preference": block}, indent=2) + "\n")
    lap("evaluate")
    return VlmDpoResult(paths=paths, steps=config.steps, preference=block, seconds=lap.seconds)
