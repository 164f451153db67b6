"""Evaluating a hub model (models/hub/: a transformers class trained as it is) on validation
conversations, with the metric names a native VLM's validation reports (eval/generation.py).

    shards of conversations ──ProcessorDecoder + collate_processed (training's own batches)──▶
        perplexity: exp(sum of the answers' token NLL / number of answer tokens), whole set
    the conversation up to its last answer ──processor: chat template with the generation
        prompt, the sample's images (or another sample's: shuffled)──▶ the class's own
        `generate`, greedy ──▶ scored against the last answer (eval/answers.py)

`HubEvaluator` is a `VLMEvaluator` whose samples, NLL and answers come from the folder's
processor and the transformers class; the split over ranks, the all-reduce of the NLL sums,
the image derangement, the scores, the summary and the examples are VLMEvaluator's, so the
two kinds of model report alike (eval.json, `val/...` rows). Under FSDP generation is skipped,
as for native models (the class's `generate` runs rank by rank).

`load_hub_model` opens a hub run folder (the class's transformers folder + spec.yaml) or any
transformers folder of a hub class; `hub_answer_ids` is `mmtrain generate`'s answer.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from mmtrain import distributed
from mmtrain.config import DataConfig
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.conversation_batches import SkippedSample, read_conversation
from mmtrain.data.stream.media import MediaError
from mmtrain.data.stream.processor_batches import ProcessorBatcher, content_items
from mmtrain.eval.generation import (
    DEFAULT_EXAMPLES,
    DEFAULT_MAX_NEW_TOKENS,
    FRAMES_REVERSED,
    SHUFFLED,
    EvalSample,
    VLMEvaluator,
    check_sizes,
    derangement,
    model_parts,
)
from mmtrain.folders import SPEC_FILE
from mmtrain.model_sources import HF_CONFIG_FILE
from mmtrain.models.build import unwrap_model
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.train.objectives import count_targets, token_nll_sum
from mmtrain.train.step import move_batch

log = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# ----------------------------------------------------------------------------- folders
def is_hub_folder(folder: Path) -> bool:
    """A transformers folder (config.json) whose model trains as a hub model: a hub run's
    folder (its spec.yaml says so), or a folder without spec.yaml of a class mmtrain has no
    native module for."""
    from mmtrain.models.model_source import load_model_spec

    if not (folder / HF_CONFIG_FILE).is_file():
        return False
    if (folder / SPEC_FILE).is_file():
        return ModelSpec.load(folder / SPEC_FILE).hub is not None
    try:
        return load_model_spec(str(folder)).hub is not None
    except (FieldError, ValueError, OSError):
        return False  # a folder no hub class builds: the caller's other paths say why


def load_hub_model(
    folder: Path, device: torch.device, dtype: torch.dtype | None = None
) -> nn.Module:
    """The HubModel of a hub run folder or a transformers folder, its weights read by the
    class's own `from_pretrained` (in `dtype`, default the folder's), on `device`."""
    from mmtrain.models.hub.model import HubModel, hub_spec_of
    from mmtrain.models.hub.source import model_class

    if (folder / SPEC_FILE).is_file():
        spec = ModelSpec.load(folder / SPEC_FILE)
    else:
        spec = hub_spec_of(folder, str(folder))
    cls = model_class(folder, "model")
    hf = cls.from_pretrained(str(folder), dtype=dtype or "auto")
    return HubModel(spec, hf.to(device)).eval()


def processor_folder(run_dir: Path, spec: ModelSpec) -> Path:
    """Where a hub run's processor is: the run folder (training copies the processor files
    in), else the folder the run started from."""
    from mmtrain.model_sources import resolve_folder

    if any((run_dir / name).is_file() for name in TOKENIZER_FILES):
        return run_dir
    return resolve_folder(spec.hub.source, "model")


def hub_batcher(
    spec: ModelSpec, folder: str | Path, sequence_length: int | None
) -> ProcessorBatcher:
    """Training's batches (ProcessorBatcher) with the processor of `folder`: a run folder
    holds the processor its source had, under the run's `data.sequence_length`."""
    source = dataclasses.replace(spec.hub, source=str(folder))
    data = DataConfig(train=[], sequence_length=sequence_length)
    return ProcessorBatcher(data, dataclasses.replace(spec, hub=source))


# ----------------------------------------------------------------------------- generation
def greedy_settings(
    hf: nn.Module, folder: str | Path | None, max_new_tokens: int, tokenizer: Any
) -> Any:
    """The generation config of `folder` (its generation_config.json, as `from_pretrained`
    reads it; without one, or no folder, the module's own) turned greedy: its end-of-turn ids
    and padding stay (a config without a pad id gets the tokenizer's, else its eos: what
    finished rows are filled with)."""
    import transformers

    if folder is not None and (Path(folder) / GENERATION_CONFIG).is_file():
        settings = transformers.GenerationConfig.from_pretrained(str(folder))
    else:
        settings = copy.deepcopy(hf.generation_config)
    settings.update(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None,
                    max_new_tokens=max_new_tokens)  # fmt: skip
    if settings.pad_token_id is None:
        settings.pad_token_id = next(
            (v for v in (tokenizer.pad_token_id, tokenizer.eos_token_id) if v is not None), 0
        )
    return settings


def end_ids(settings: Any, tokenizer: Any) -> tuple[int, ...]:
    """Ids that end an answer: the generation config's eos ids and the tokenizer's eos."""
    ids = settings.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [] if ids is None else [ids]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def prompt_inputs(
    processor: Any, prompts: Sequence[str], images: Sequence[Sequence[Image.Image]]
) -> dict[str, torch.Tensor]:
    """The processor's batched call on rendered prompts, left-padded for generation (a
    template that writes the BOS itself gets none added, as in training's `encode`)."""
    bos = processor.tokenizer.bos_token
    special = {"add_special_tokens": False} if bos and prompts[0].startswith(bos) else {}
    return dict(
        processor(
            text=list(prompts),
            images=[list(row) for row in images] if any(images) else None,
            padding=True,
            padding_side="left",
            return_tensors="pt",
            **special,
        )
    )


@torch.no_grad()
def generate_new_ids(hf: nn.Module, inputs: dict, settings: Any) -> list[list[int]]:
    """The class's own `generate` on processed prompts: each row's new ids (after its prompt)."""
    param = next(hf.parameters())
    moved = move_batch(inputs, param.device, param.dtype)
    out = hf.generate(**moved, generation_config=settings)
    return out[:, moved["input_ids"].shape[1] :].tolist()


def hub_answer_ids(
    model: nn.Module,
    processor: Any,
    messages: list[dict],
    images: Sequence[Image.Image],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    folder: str | Path | None = None,
) -> list[int]:
    """The new ids of a hub model's answer to `messages` (transformers' content lists) and
    `images`: the processor's prompt with the generation prompt, the class's `generate`,
    greedy at temperature 0, else sampled (nucleus `top_p`) from `seed`. `folder`: where the
    generation config is (default: the module's own, which `from_pretrained` read)."""
    hf = unwrap_model(model).hf
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    settings = greedy_settings(hf, folder, max_new_tokens, processor.tokenizer)
    if temperature > 0:
        settings.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    inputs = prompt_inputs(processor, [prompt], [list(images)])
    with torch.random.fork_rng(devices=[]):  # transformers samples from the global RNG
        torch.manual_seed(seed)
        return generate_new_ids(hf, inputs, settings)[0]


# ----------------------------------------------------------------------------- the evaluator
class HubEvaluator(VLMEvaluator):
    """VLMEvaluator's report for a hub model (see the module docstring).

    data: the validation shards; batcher: training's ProcessorBatcher (its decoder and collate
    make the NLL batches; its processor folder renders the prompts). VLMEvaluator's own
    constructor reads a native model's tokenizer and template, so this one sets the state its
    report reads (samples, partners, stops, tokenizer, shards) from the processor instead.
    """

    def __init__(
        self,
        spec: ModelSpec,
        data: str | Path | Sequence[str | Path],
        *,
        batcher: ProcessorBatcher,
        batch_size: int,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        examples: int = DEFAULT_EXAMPLES,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if spec.hub is None:
            raise FieldError("model", f"{spec.name} is not a hub model: use VLMEvaluator")
        check_sizes(batch_size, max_new_tokens)
        self.spec, self.folder = spec, batcher.folder
        self.batch_size, self.max_new_tokens, self.examples = batch_size, max_new_tokens, examples
        self.rank = distributed.rank() if rank is None else rank
        self.world = distributed.world_size() if world_size is None else world_size
        self.decoder, self.collate = batcher.decoder(spec), batcher.collate(spec)
        self.processor = self.decoder.processor
        self.tokenizer = self.processor.tokenizer  # VLMEvaluator._scored decodes with it
        try:
            self.shards = ShardSet.open(data)
        except (FileNotFoundError, ValueError) as err:
            raise FieldError("data", f"{data!r}: {err}") from None
        self.samples, self.prompts, self.refused = self._read_samples()
        if not self.samples:
            raise FieldError(
                "data",
                f"{data!r}: no usable conversation among {len(self.shards)} samples "
                "(see the warnings above)",
            )
        self.stops: tuple[int, ...] = ()  # set from the model's generation config per report
        counts = [p["images"] for p in self.prompts]
        self.partners = derangement([c or None for c in counts], seed)
        for i, count in enumerate(counts):
            if not count:
                self.partners[i] = None  # text only: nothing to shuffle

    # -- samples
    def _read_samples(self) -> tuple[list[EvalSample], list[dict[str, Any]], int]:
        """Every conversation training's decoder accepts, in key order, with its prompt (the
        turns before the last answer, rendered with the generation prompt), and the number
        refused or unreadable."""
        found, refused = [], 0
        rng = np.random.default_rng(0)  # the decoder draws nothing; its signature takes one
        for index in range(len(self.shards)):
            sample = self.shards.read(index)
            try:
                self.decoder(sample, rng)
                found.append(self._prompt_of(index, sample))
            except (MediaError, SkippedSample, FieldError) as err:
                refused += 1
                log.warning("validation sample %s skipped: %s", sample["__key__"], err)
        found.sort(key=lambda pair: pair[0].key)
        return [s for s, _ in found], [p for _, p in found], refused

    def _prompt_of(self, index: int, sample: dict[str, Any]) -> tuple[EvalSample, dict]:
        conv, _, _ = read_conversation(sample)
        if conv.turns[-1].role != "assistant":
            raise SkippedSample("no_targets", f"{conv.key}: no assistant answer to generate")
        messages = [{"role": t.role, "content": content_items(t.text)} for t in conv.turns[:-1]]
        text = self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        images = sum(c["type"] == "image" for m in messages for c in m["content"])
        question = next((t.text for t in reversed(conv.turns) if t.role == "user"), "")
        evaluated = EvalSample(index, sample["__key__"], list(conv.images), [], [], text, [],
                               conv.turns[-1].text.strip(), question, id=conv.key)  # fmt: skip
        return evaluated, {"text": text, "images": images}

    def _batch(self, positions: Sequence[int]) -> dict[str, torch.Tensor]:
        """Training's micro-batch of the samples at `positions` (decoded again: pixels are
        not kept between reports)."""
        rng = np.random.default_rng(0)
        return self.collate([self.decoder(self.shards.read(self.samples[p].index), rng)
                             for p in positions])  # fmt: skip

    def _images(self, position: int, count: int) -> list[Image.Image]:
        _, images, _ = read_conversation(self.shards.read(self.samples[position].index))
        out = []
        for data in images[:count]:
            with Image.open(io.BytesIO(data)) as image:
                out.append(image.convert("RGB"))
        return out

    # -- the work of one rank (VLMEvaluator.report calls these)
    @torch.no_grad()
    def _nll(self, model: nn.Module, device: Any) -> tuple[float, int, set[int]]:
        device, dtype = model_parts(model, device)
        share, total, tokens = self._share(), 0.0, 0
        for step in range(self._steps()):
            positions = share[step * self.batch_size : (step + 1) * self.batch_size]
            weight = 1.0 if positions else 0.0
            positions = positions or [0]  # keeps this rank in step with the others
            batch = move_batch(self._batch(positions), device, dtype)
            out = model(batch)
            nll = (
                out["nll_sum"]
                if "nll_sum" in out
                else token_nll_sum(out["logits"], batch["labels"])
            )
            total += weight * float(nll.double())
            tokens += int(weight) * int(count_targets(batch["labels"]))
        return total, tokens, set()

    @torch.no_grad()
    def _answers(self, model: nn.Module, device: Any, variant: str) -> list[dict[str, Any]]:
        if variant == FRAMES_REVERSED:
            return []  # hub models read no clips yet (ProcessorDecoder refuses them)
        hf = unwrap_model(model).hf
        settings = greedy_settings(hf, self.folder, self.max_new_tokens, self.tokenizer)
        self.stops = end_ids(settings, self.tokenizer)
        share = self._share()
        if variant == SHUFFLED:
            share = [p for p in share if self.partners[p] is not None]
        out = []
        for start in range(0, len(share), self.batch_size):
            positions = share[start : start + self.batch_size]
            sources = [self.partners[p] if variant == SHUFFLED else p for p in positions]
            prompts = [self.prompts[p]["text"] for p in positions]
            images = [self._images(s, self.prompts[p]["images"])
                      for p, s in zip(positions, sources, strict=True)]  # fmt: skip
            for rows, new in self._generated(hf, prompts, images, settings):
                out += [self._scored(positions[r], ids) for r, ids in zip(rows, new, strict=True)]
        return out

    def _generated(
        self, hf: nn.Module, prompts: list[str], images: list[list], settings: Any
    ) -> Iterator[tuple[list[int], list[list[int]]]]:
        """(row indices, their new ids) per `generate` call: one call for the batch, or one
        per row where rows with and without images meet (a processor takes one or the other)."""
        if all(images) or not any(images):
            groups = [list(range(len(prompts)))]
        else:
            groups = [[r] for r in range(len(prompts))]
        for rows in groups:
            inputs = prompt_inputs(self.processor, [prompts[r] for r in rows],
                                   [images[r] for r in rows])  # fmt: skip
            yield rows, generate_new_ids(hf, inputs, settings)
