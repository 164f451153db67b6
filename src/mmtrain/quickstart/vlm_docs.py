"""`mmtrain quickstart --vlm-docs`: a native-resolution VLM learns to read numbers off small
pages, offline.

    data     pages with a number of 3 or 4 digits, drawn with Pillow in DejaVu Sans at a few
             font sizes on pages of four aspect ratios (`docs_data`), each a LLaVA
             conversation "What is the number?\n<image>" -> "4721" ──mmtrain data build──▶
             OUT/data/{train,val}/ conversation shards; the held-out pages' numbers are on no
             training page. A BPE of the prompts, with its chat template, in OUT/tokenizer/
    model    the `tiny-qwen2-vl` preset (a native-resolution tower: patch 4 over 2 frames,
             2 x 2 merge, window attention; a 2-block M-RoPE decoder of width 64) over the
             tokenizer's ids plus the image and video placeholders, from scratch, with the
             decoder's rotary base lowered to 3 (`docs_spec` says why)
    train    OUT/run/: every page at its own size within `data.vision`'s budget, packed rows,
             fixed steps; validation at the end on the held-out pages (`VLMEvaluator`: greedy
             answers scored by ANLS and CER, once with each sample's own page and once with
             the pages shuffled between samples) -> OUT/run/eval.json
    report   OUT/run/eval.json gets a `documents` block (ANLS own / shuffled pages, CER, n,
             the pages' token counts against the budget), and the CLI prints it as a table

Shuffling the pages keeps each prompt and hands it another sample's page: every held-out page
is asked the same question, so a model that answers from the prompt alone gives every sample
the same answer and scores the same both ways; one that reads scores clearly higher with its
own pages. ANLS (Biten et al. 2019) is 1 - the normalised edit distance, 0 below 0.5: a 4-digit
answer with one digit wrong scores 0.75, with two wrong 0.

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
from mmtrain.quickstart.docs_data import (
    EVAL_PROMPT,
    SHAPES,
    Page,
    make_pages,
    split_numbers,
    write_attribution,
    write_split,
    write_tokenizer,
)
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
from mmtrain.quickstart.vlm_data import TokenizerFolder
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

log = logging.getLogger(__name__)


@dataclass
class VlmDocsConfig(NativeDemoConfig):
    """What `mmtrain quickstart --vlm-docs` runs; the defaults fit 6 minutes on 2 idle cores.
    The training settings it shares with `--vlm-video` (batch 32, lr 2e-3, 128 positions a
    row, ...) are `native_demo.NativeDemoConfig`'s."""

    out: Path = Path("runs/quickstart-vlm-docs")
    # Held-out ANLS measured at rope_theta 3: 59.5% after 1,000 steps, 97.9% after 2,000 (about
    # 0.11 s a step on 2 cores: 3 min 49 s with the validation, README).
    steps: int = 2000
    minutes: float = 5.0  # upper bound on training time: fewer steps on a slower machine
    train_pages: int = 4000
    val_pages: int = 100
    # The decoder's rotary base (the preset's 1e6 is for long contexts): see `docs_spec`.
    rope_theta: float = 3.0
    # data.vision: every page between these token counts (one token = 8 x 8 pixels here)
    image_min_tokens: int = 4
    image_max_tokens: int = 40
    sample_max_tokens: int = 40
    eval_batch_size: int = 100

    def validate(self) -> None:
        super().validate()
        if self.train_pages < max(len(SHAPES), self.batch_size):
            raise FieldError(
                "--limit",
                f"{self.train_pages} training pages are too few for batches of "
                f"{self.batch_size}; give at least {max(len(SHAPES), self.batch_size)}",
            )
        if self.val_pages < 2:
            raise FieldError("val_pages", f"needs at least 2 (to shuffle), got {self.val_pages}")
        self.vision().validate()

    def vision(self) -> VisionDataConfig:
        """`data.vision`, the pages' pixel budget."""
        return VisionDataConfig(
            image_min_tokens=self.image_min_tokens,
            image_max_tokens=self.image_max_tokens,
            sample_max_tokens=self.sample_max_tokens,
        )


@dataclass
class DocsPaths(ChatPaths):
    """Where `--vlm-docs` writes, under `out`: data/, model.yaml, run/, plus the tokenizer."""


@dataclass
class VlmDocsResult:
    """What `--vlm-docs` did: its steps, the held-out scores, the pages' tokens, how long."""

    paths: DocsPaths
    n_train: int
    steps: int
    documents: dict[str, Any]  # eval.json "documents"
    examples: list[dict[str, Any]]  # eval.json "examples"
    seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: float | None = None

    @property
    def eval_json(self) -> Path:
        return self.paths.eval_json


# ----------------------------------------------------------------------------- the model
def docs_spec(tokens: TokenizerFolder, config: VlmDocsConfig) -> ModelSpec:
    """The tiny-qwen2-vl preset over the tokenizer's ids plus the image and video placeholders
    (the two ids past them), with the decoder's rotary base `config.rope_theta`
    (`native_demo.native_spec`).

    Why the base: M-RoPE gives a page's tokens (time, row, column) positions and turns the
    head's frequency pairs by them in sections (`mrope_section` [2, 3, 3] of a head of 16: time,
    then row, then column), the lowest frequencies last. At the preset's base of 1e6 the column
    section turns by 2e-4 to 6e-6 radians per column, so the decoder cannot tell one column of
    a page from another, and reading left to right has to be inferred from what each token
    shows. At base 3 it turns by 0.38 to 0.50 radians per column (and the row section by 0.58
    to 0.76 per row): the k-th digit of the answer can look k columns into the line. On these
    pages, 1,000 steps read 59.5% ANLS at base 3 against 8.1% at 1e6 (the same data, model and
    seed; 0.0% and 0.8% with shuffled pages)."""
    return native_spec("quickstart-vlm-docs", tokens, config)


def page_tokens(spec: ModelSpec, config: VlmDocsConfig, pages: list[Page]) -> list[int]:
    """LM tokens of each page under the run's budget: `visual_budget`'s rule, the loader's."""
    from mmtrain.visual_budget import ImageSize

    budget = vision_budget(spec, config.vision())
    return [budget.tokens([ImageSize(p.height, p.width)])[0] for p in pages]


# ----------------------------------------------------------------------------- training
def train_config(
    config: VlmDocsConfig, paths: DocsPaths, tokens: TokenizerFolder, steps: int
) -> dict[str, Any]:
    """The `mmtrain train` config (as a dict): packed rows, the pages' budget, and validation
    with generation on the held-out pages at the end (eval.json), with the AdamW settings its
    README figures were measured with."""
    return native_train_config(config, paths, tokens, steps, {"betas": [0.9, 0.98], "eps": 1e-6})


def time_docs_steps(spec: ModelSpec, config: VlmDocsConfig, pages: list[Page]) -> float:
    """Seconds per optimizer step on this CPU (`native_demo.time_native_steps`): rows of a
    page of the training pages' dearest size, scaled up to `batch_size` samples."""
    from mmtrain.visual_budget import ImageSize

    assert spec.vision is not None
    budget = vision_budget(spec, config.vision())
    shapes = [budget.shapes([ImageSize(p.height, p.width)])[0] for p in pages[: 4 * len(SHAPES)]]
    shape = max(shapes, key=lambda s: s.tokens(spec.vision))  # the dearest: a cautious estimate
    return time_native_steps(spec, config.batch_size, shape)


# ----------------------------------------------------------------------------- the report
def documents_block(
    report: dict[str, Any],
    answers: list[dict[str, Any]],
    pages: list[Page],
    tokens: list[int],
    config: VlmDocsConfig,
) -> dict[str, Any]:
    """eval.json's `documents`: the held-out pages' ANLS with their own and with shuffled
    pages, CER and how many (the validation's figures, `report["generation"]`), the same per
    page shape (from `answers`, one per held-out page), the pages misread, and the pages' LM
    tokens (`tokens`, one per page of `pages`) against the budget."""
    from mmtrain.eval.answers import anls

    generation = report.get("generation", {})
    shape_of = {page.key: page.shape for page in pages}
    tokens_of = {page.key: n for page, n in zip(pages, tokens, strict=True)}
    by_shape: dict[str, dict[str, Any]] = {}
    for shape in SHAPES:
        rows = [a for a in answers if shape_of.get(a["id"]) == shape.name]
        moved = [a for a in rows if "generated_shuffled_images" in a]
        by_shape[shape.name] = {
            "n": len(rows),
            "tokens": tokens_of[rows[0]["id"]] if rows else None,
            "anls": mean([a["anls"] for a in rows]),
            "anls_shuffled_pages": mean(
                [anls(a["generated_shuffled_images"], a["reference"]) for a in moved]
            ),
            "exact_match": mean([a["exact_match"] for a in rows]),
        }
    misread = [
        {"id": a["id"], "shape": shape_of.get(a["id"]), "reference": a["reference"],
         "generated": a["generated"], "anls": a["anls"]}
        for a in answers if a["generated"] != a["reference"]
    ]  # fmt: skip
    return {
        "anls": generation.get("anls"),
        "anls_shuffled_pages": generation.get("anls_shuffled_images"),
        "cer": generation.get("cer"),
        "exact_match": generation.get("exact_match"),
        "exact_match_shuffled_pages": generation.get("exact_match_shuffled_images"),
        "n": generation.get("n"),
        "n_shuffled": generation.get("n_shuffled"),
        "prompt": EVAL_PROMPT,
        "by_shape": by_shape,
        "misread": misread,
        "page_tokens": {
            "min": min(tokens),
            "mean": sum(tokens) / len(tokens),
            "max": max(tokens),
            "image_min_tokens": config.image_min_tokens,
            "image_max_tokens": config.image_max_tokens,
            "sample_max_tokens": config.sample_max_tokens,
            "pages": len(tokens),
        },
    }


# ----------------------------------------------------------------------------- the whole run
def run_vlm_docs(
    config: VlmDocsConfig, on_phase: Phase | None = None, on_step: StepHook | None = None
) -> VlmDocsResult:
    """Data, calibration, training with the held-out validation, the documents block; see the
    module docstring. Raises FieldError for bad settings (before writing anything)."""
    paths = DocsPaths(config.out)
    phase, lap = begin(config, paths, on_phase)

    phase(
        "pages",
        f"{config.train_pages} training and {config.val_pages} held-out pages, a BPE of the "
        "prompts, shards",
    )
    pool, held_out = split_numbers(config.seed, config.val_pages)
    train_pages = make_pages(pool, "train", config.train_pages, config.seed)
    val_pages = make_pages(held_out, "val", config.val_pages, config.seed)
    train_json, train_records = write_split(paths.raw / "train", train_pages)
    val_json, _ = write_split(paths.raw / "val", val_pages)
    write_attribution(paths.out, config.seed, config.val_pages)
    tokens = write_tokenizer(paths.tokenizer, train_records, config.vocab_size)
    build_shards(train_json, paths.train_shards, config.build_workers, modalities="image,text")
    build_shards(val_json, paths.val_shards, config.build_workers, modalities="image,text")
    spec = docs_spec(tokens, config)
    spec.save(paths.spec)
    counts = page_tokens(spec, config, train_pages + val_pages)
    lap("pages")

    steps, step_seconds = fit_steps(
        config.budget(), phase, lap, lambda: time_docs_steps(spec, config, train_pages)
    )

    phase("train", f"{steps} steps of {config.batch_size} pages, then the held-out pages")
    train_run(train_config(config, paths, tokens, steps), on_step)
    lap("train")

    phase("evaluate", "each held-out page's answer, for the figures per page shape")
    # max_new_tokens: 4 digits, the space before them and [EOT], with room to spare
    answers = held_out_answers(config, paths, tokens, config.val_pages, 8)
    report = json.loads(paths.eval_json.read_text(encoding="utf-8"))
    block = documents_block(report, answers, train_pages + val_pages, counts, config)
    document = add_eval_block(paths, "documents", block)
    shutil.copy2(paths.out / "ATTRIBUTION.txt", paths.run / "ATTRIBUTION.txt")
    lap("evaluate")
    return VlmDocsResult(
        paths=paths,
        n_train=len(train_pages),
        steps=steps,
        documents=block,
        examples=document.get("examples", []),
        seconds=lap.seconds,
        step_seconds=step_seconds,
    )


__all__ = [
    "OUTPUTS",
    "PRESET",
    "DocsPaths",
    "VlmDocsConfig",
    "VlmDocsResult",
    "docs_spec",
    "documents_block",
    "page_tokens",
    "run_vlm_docs",
    "time_docs_steps",
    "train_config",
]
