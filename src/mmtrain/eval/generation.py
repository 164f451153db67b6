"""Evaluating a (vision-)language model on validation conversations: perplexity and answers.

    shards of conversations ──parse, render with the chat template, tokenize──▶ EvalSample each
        ──▶ perplexity: exp(sum of the answers' token NLL / number of answer tokens), whole set
        ──▶ generation: prompt = the conversation up to its last answer plus the generation
            prompt; greedy decoding; the answer against the reference (exact match, token F1),
            once with the sample's own images and once with another sample's images
        ──▶ nested report (eval.json) / flat metrics (metrics.jsonl)

`token_f1_shuffled_images` is the check that the model looks at the image: the prompts stay,
the images move between samples by a fixed derangement (seeded; among samples with the same
number of images and clips, so every prompt still gets as many inputs as it has tags; a
native VLM's pages keep their own sizes and tokens, eval/visual_batches.py). A model that
ignores its images scores the same with both; one that uses them scores lower shuffled.
`exact_match_frames_reversed` is the same check for time: each sample with a clip keeps its
own clips with their frames in reverse order (the tokens, sizes and frame rates stay). A model
that reads one frame, or ignores their order, scores the same both ways; on clips whose answer
depends on the direction of time (moves left / right, grows / shrinks), one that reads the
order scores lower reversed.

Distributed: every rank reads the list of conversations (the same on all ranks), takes every
`world_size`-th one from its rank on, and runs the same number of forward passes (a rank short
of samples repeats one with weight 0), so sharded models stay in step. NLL sums and token counts
are all-reduced in float64; generated answers are gathered and put in key order, so the report
does not depend on the number of ranks or the batch size. Generation calls the model's own
`generate` (no collectives), so it runs for single-process and DDP models; a model sharded with
FSDP cannot decode rank by rank, and its report says generation was skipped.

For the training loop (same interface as `eval.run.Evaluator`):

    evaluator = VLMEvaluator(spec, "val/", batch_size=8, tokenizer="tok.json", chat_template="chatml")
    metrics = evaluator(model)   # {"perplexity": 7.1, "generation/token_f1": 0.42, ...}
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mmtrain import distributed
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.chat_templates import (
    IGNORE_INDEX,
    ChatTemplate,
    JinjaTemplate,
    NamedTemplate,
    Placeholders,
    RefusedSample,
    Segment,
    encode_conversation,
    encode_segments,
    get_template,
)
from mmtrain.data.stream.conversation_batches import NO_IMAGE_ID, SkippedSample, read_conversation
from mmtrain.data.stream.conversations import Conversation
from mmtrain.data.stream.media import MediaError
from mmtrain.data.stream.native_inputs import NativeInputs
from mmtrain.data.stream.tokenizer import Tokenizer, get_tokenizer
from mmtrain.data.stream.transforms import ImageTransform
from mmtrain.eval.answers import (
    anls,
    character_edits,
    choice_accuracy,
    exact_match,
    relaxed_accuracy,
    token_f1,
)
from mmtrain.eval.run import flatten_metrics, spec_of
from mmtrain.eval.visual_batches import FixedImages, NativeVisuals
from mmtrain.models.build import unwrap_model
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.visual_budget import BudgetExceeded, VisualBudget, budget_of

log = logging.getLogger(__name__)

__all__ = [
    "EvalSample",
    "VLMEvaluator",
    "derangement",
    "perplexity",
    "prompt_and_reference",
    "stop_ids",
    "target_nll",
]

DEFAULT_MAX_NEW_TOKENS = 32
DEFAULT_EXAMPLES = 8
# What generation shows each sample (`VLMEvaluator._answers`).
OWN = "own"  # its own images and clips
SHUFFLED = "shuffled_images"  # another sample's (`partners`)
FRAMES_REVERSED = "frames_reversed"  # its own clips, last frame first; samples with clips only


# ----------------------------------------------------------------------------- pure pieces
def target_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """(sum of the negative log-likelihood of every target, number of targets) of one batch.

    logits [R, T, vocab], labels [R, T] aligned with the input (HF convention: position t's
    logits score labels[t + 1]; -100 is no target). Row by row, in at least float32 (float64
    stays float64), summed in float64: a large vocabulary upcast at once would double memory.
    """
    total, count = 0.0, 0
    for row_logits, row_labels in zip(logits, labels, strict=True):
        targets = row_labels[1:]
        mask = targets != IGNORE_INDEX
        if not bool(mask.any()):
            continue
        scores = row_logits[:-1][mask]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        total += float(F.cross_entropy(scores, targets[mask], reduction="sum").double())
        count += int(mask.sum())
    return total, count


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(mean NLL per target token); nan without a token (nothing was measured)."""
    return math.exp(nll_sum / tokens) if tokens else math.nan


def derangement(groups: Sequence[Any], seed: int) -> list[int | None]:
    """For each item, the index of another item of the same group (None when its group has
    one item): within each group a seeded random order is rotated by one, so no item keeps
    its own place and the result depends only on `groups` and `seed`."""
    rng = np.random.default_rng(seed)
    partner: list[int | None] = [None] * len(groups)
    members: dict[Any, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    for group in sorted(members, key=repr):  # a fixed order of draws from `rng`
        indices = members[group]
        if len(indices) < 2:
            continue
        order = [indices[j] for j in rng.permutation(len(indices))]
        for j, i in enumerate(order):
            partner[i] = order[(j + 1) % len(order)]
    return partner


def prompt_and_reference(conv: Conversation, template: ChatTemplate) -> tuple[list[Segment], str]:
    """The segments before the last answer (they end with the generation prompt: the
    assistant header) and the last answer's text, which the generated answer is scored on."""
    segments = template.segments(conv)
    trained = [i for i, segment in enumerate(segments) if segment.train]
    if not trained or conv.turns[-1].role != "assistant":
        raise RefusedSample("no_targets", f"{conv.key}: no assistant answer to generate")
    return segments[: trained[-1]], conv.turns[-1].text.strip()


def _end_of_turn(template: ChatTemplate) -> str | None:
    """The text a template puts after an answer (where generation should stop)."""
    if isinstance(template, NamedTemplate):
        return template.assistant.split("{text}", 1)[1] or None
    if isinstance(template, JinjaTemplate):
        return template.tokens.get("eos_token")
    return None


def stop_ids(template: ChatTemplate, tokenizer: Any, eos_ids: Sequence[int]) -> tuple[int, ...]:
    """Ids that end an answer: the decoder's `eos_ids` and the template's end of turn (when
    the tokenizer gives it one id), so generation stops where the template ends an answer."""
    ids = list(eos_ids)
    end = _end_of_turn(template)
    if end is not None:
        encoded = tokenizer.encode(end)
        if len(encoded) == 1:
            ids.append(encoded[0])
    return tuple(dict.fromkeys(ids))


# ----------------------------------------------------------------------------- samples
@dataclass
class EvalSample:
    """One validation conversation, encoded. `index` is its flat id in the shards."""

    index: int
    key: str
    images: list[str]  # member names of its images, in order
    input_ids: list[int]  # the whole conversation (perplexity)
    labels: list[int]
    prompt: str  # rendered text before the last answer, `<image>` tags in place
    prompt_ids: list[int]
    reference: str
    question: str  # the last user turn's text, for eyes (examples, the report's gallery)
    id: str = ""  # the conversation's own "id" (the source record's), for readers
    videos: list[str] = field(default_factory=list)  # member names of its clips, in order


class _Encoder:
    """Conversation -> `EvalSample` with the run's template and tokenizer (a native VLM's
    inputs each with the tokens of their budgeted size, `native`)."""

    def __init__(
        self,
        spec: ModelSpec,
        tokenizer: Any,
        template: ChatTemplate,
        max_length: int,
        native: NativeInputs | None = None,
    ):
        self.spec, self.tokenizer, self.template = spec, tokenizer, template
        self.max_length, self.native = max_length, native
        projector, tokens = spec.projector, spec.vision_tokens
        self.image_token_id = projector.image_token_id if projector is not None else NO_IMAGE_ID
        self.video_token_id, self.wrap = None, None
        if native is not None and tokens is not None:
            self.image_token_id, self.video_token_id = tokens.image_token_id, tokens.video_token_id
            self.wrap = None if tokens.start_id is None else (tokens.start_id, tokens.end_id)
        self.image_length = max(1, spec.image_tokens())

    def _placeholders(
        self, conv: Conversation, images: list[bytes], videos: list[bytes]
    ) -> Placeholders:
        if self.native is None:
            if conv.images and self.spec.projector is None:
                raise RefusedSample("image_count", f"{conv.key}: images, but the model takes none")
            return Placeholders(self.image_token_id, self.image_length)
        try:
            measured = self.native.measure(conv.key, images, videos)
        except BudgetExceeded as err:
            raise RefusedSample("visual_budget", f"{conv.key}: {err}") from None
        image_tokens, video_tokens = measured.tokens(self.native.budget)
        return Placeholders(self.image_token_id, video_token_id=self.video_token_id,
                            image_lengths=image_tokens, video_lengths=video_tokens,
                            wrap=self.wrap)  # fmt: skip

    def __call__(self, index: int, sample: dict[str, Any]) -> EvalSample:
        conv, images, videos = read_conversation(sample)
        marks = self._placeholders(conv, images, videos)
        record_id = conv.key  # the source record's own id, for readers
        conv.key = sample["__key__"]  # the shard key: unique, and what reports name
        encoded = encode_conversation(
            conv, self.template, self.tokenizer, self.max_length, self.image_token_id,
            placeholders=marks,
        )  # fmt: skip
        segments, reference = prompt_and_reference(conv, self.template)
        prompt = encode_segments(
            segments, self.tokenizer, self.image_token_id, self.video_token_id, self.wrap
        )
        return EvalSample(
            index,
            conv.key,
            list(conv.images),
            encoded.input_ids,
            encoded.labels,
            "".join(segment.text for segment in segments),
            prompt.input_ids,
            reference,
            _last_user_text(conv),
            id=record_id,
            videos=list(conv.videos),
        )


def _last_user_text(conv: Conversation) -> str:
    return next((t.text for t in reversed(conv.turns) if t.role == "user"), "")


def _read_samples(shards: ShardSet, encoder: _Encoder) -> tuple[list[EvalSample], int]:
    """Every usable conversation in key order, and how many were refused or unreadable."""
    samples, refused = [], 0
    for index in range(len(shards)):
        sample = shards.read(index)
        try:
            samples.append(encoder(index, sample))
        except (MediaError, RefusedSample, SkippedSample) as err:
            refused += 1
            log.warning("validation sample %s skipped: %s", sample["__key__"], err)
        except FieldError as err:
            if err.path in ("chat_template", "data.chat_template", "max_length"):
                raise  # a setting that fits no sample: stop with its name
            refused += 1  # this sample's own problem (text ids equal to the image token, ...)
            log.warning("validation sample %s skipped: %s", sample["__key__"], err)
    samples.sort(key=lambda s: s.key)
    return samples, refused


# ----------------------------------------------------------------------------- batches
def _padded(
    rows: Sequence[Sequence[int]], pad: int, left: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ids [R, T] and bool mask [R, T] (False: padding), padded on the left or right."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[r, span] = torch.tensor(row, dtype=torch.long)
        mask[r, span] = True
    return ids, mask


def model_parts(
    model: nn.Module, device: torch.device | str | None = None
) -> tuple[torch.device, torch.dtype]:
    """Where inputs go (`device`, else the weights' device) and the dtype of float inputs."""
    param = next(model.parameters(), None)
    if param is None:
        return torch.device(device or "cpu"), torch.float32
    dtype = param.dtype if param.is_floating_point() else torch.float32
    return torch.device(device) if device is not None else param.device, dtype


def _generating_module(model: nn.Module) -> nn.Module:
    """The module with `generate` inside torch.compile / DDP wrappers."""
    inner = unwrap_model(model)
    if not hasattr(inner, "generate"):
        raise TypeError(f"{type(model).__name__} has no generate (not a language model?)")
    return inner


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


# ----------------------------------------------------------------------------- the evaluator
def check_sizes(batch_size: int, max_new_tokens: int) -> None:
    """An evaluator's batch size and answer length, each at least 1."""
    if batch_size < 1:
        raise FieldError("batch_size", f"must be positive, got {batch_size}")
    if max_new_tokens < 1:
        raise FieldError("max_new_tokens", f"must be positive, got {max_new_tokens}")


class VLMEvaluator:
    """Perplexity and answer quality on validation conversations; `eval.run.Evaluator`'s
    interface: `report(model)` (nested, eval.json), `model -> flat metrics` (call), `close()`.

    data: the validation shards (one conversation per sample, as `mmtrain data build` writes
    them). tokenizer / chat_template: the run's (`data.tokenizer`, `data.chat_template`).
    max_length: positions of the LM a conversation may take (default the decoder's
    `max_positions`; longer ones are truncated, never cutting an image). max_new_tokens: the
    answer's length limit. examples: answers kept in the report (the first by key), for
    eyes and the report's gallery. seed: the image derangement. Every rank must call `report`
    at the same time (it is a collective).
    """

    def __init__(
        self,
        spec: ModelSpec,
        data: str | Path | Sequence[str | Path],
        *,
        batch_size: int,
        tokenizer: Tokenizer | str = "byte",
        chat_template: ChatTemplate | str = "chatml",
        max_length: int | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        examples: int = DEFAULT_EXAMPLES,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        budget: VisualBudget | None = None,
    ):
        if spec.decoder is None:
            raise FieldError("model", f"{spec.name} has no decoder: use eval.run.Evaluator")
        check_sizes(batch_size, max_new_tokens)
        self.spec = spec
        self.batch_size, self.max_new_tokens, self.examples = batch_size, max_new_tokens, examples
        self.rank = distributed.rank() if rank is None else rank
        self.world = distributed.world_size() if world_size is None else world_size
        self.tokenizer = (
            get_tokenizer(tokenizer, language_model=True)
            if isinstance(tokenizer, (str, Path))
            else tokenizer
        )
        self.template = (
            get_template(chat_template) if isinstance(chat_template, (str, Path)) else chat_template
        )
        native = None
        if spec.vision is not None:
            native = NativeInputs(budget or budget_of(spec.vision, None))
        encoder = _Encoder(
            spec, self.tokenizer, self.template, max_length or spec.decoder.max_positions, native
        )
        try:
            self.shards = ShardSet.open(data)
        except (FileNotFoundError, ValueError) as err:
            raise FieldError("data", f"{data!r}: {err}") from None
        self.samples, self.refused = _read_samples(self.shards, encoder)
        if not self.samples:
            raise FieldError(
                "data",
                f"{data!r}: no usable conversation among {len(self.shards)} samples "
                "(see the warnings above)",
            )
        self.stops = stop_ids(self.template, self.tokenizer, spec.decoder.eos_ids)
        # Never a placeholder's id: padding would be counted as images.
        self.pad_id = min({0, 1, 2} - {encoder.image_token_id, encoder.video_token_id})
        groups = [(len(s.images), len(s.videos)) for s in self.samples]
        self.partners = derangement([g if any(g) else None for g in groups], seed)
        for i, group in enumerate(groups):
            if not any(group):
                self.partners[i] = None  # text only: nothing to shuffle
        tower = spec.towers.get(spec.projector.tower) if spec.projector is not None else None
        self.visuals: FixedImages | NativeVisuals | None = None
        if native is not None:
            self.visuals = NativeVisuals(native)
        elif tower is not None:
            self.visuals = FixedImages(ImageTransform.from_stem(tower.stem, False))

    # -- the work of one rank
    def _share(self) -> list[int]:
        return list(range(self.rank, len(self.samples), self.world))

    def _steps(self) -> int:
        per_rank = math.ceil(len(self.samples) / self.world)
        return math.ceil(per_rank / self.batch_size)

    def _inputs(
        self, positions: Sequence[int], dtype: torch.dtype, reverse_frames: bool = False
    ) -> tuple[dict, set[int]]:
        """The pixels of the samples at `positions` (of `self.samples`) as batch entries, in
        reading order (each clip's frames in reverse order with `reverse_frames`), and the
        positions whose inputs did not decode (eval/visual_batches)."""
        if self.visuals is None:
            return {}, set()
        items = []
        for position in positions:
            sample = self.samples[position]
            if sample.images or sample.videos:
                members = self.shards.read(sample.index)
                items.append((position, sample.key, sample.images, sample.videos, members))
        return self.visuals.inputs(items, dtype, reverse_frames=reverse_frames)

    @torch.no_grad()
    def _nll(self, model: nn.Module, device: Any) -> tuple[float, int, set[int]]:
        device, dtype = model_parts(model, device)
        share, total, tokens, broken = self._share(), 0.0, 0, set()
        for step in range(self._steps()):
            positions = share[step * self.batch_size : (step + 1) * self.batch_size]
            weight = 1.0 if positions else 0.0
            positions = positions or [0]  # keeps this rank in step with the others
            inputs, bad = self._inputs(positions, dtype)
            rows = [self.samples[p] for p in positions]
            text, mask = _padded([s.input_ids for s in rows], self.pad_id, left=False)
            labels, _ = _padded([s.labels for s in rows], IGNORE_INDEX, left=False)
            for r, position in enumerate(positions):
                if position in bad:
                    labels[r] = IGNORE_INDEX  # an undecodable image: not measured
            batch = {"text": text.to(device), "attention_mask": mask.to(device)}
            batch |= _on_device(inputs, device)
            logits = model(batch)["logits"]
            nll, count = target_nll(logits, labels.to(logits.device))
            total, tokens = total + weight * nll, tokens + int(weight) * count
            broken |= bad if weight else set()
        return total, tokens, broken

    @torch.no_grad()
    def _answers(self, model: nn.Module, device: Any, variant: str) -> list[dict[str, Any]]:
        """This rank's generated answers, one dict per sample, shown what `variant` says:
        OWN, SHUFFLED (the samples that have a partner) or FRAMES_REVERSED (those with a
        clip)."""
        generator = _generating_module(model)
        device, dtype = model_parts(model, device)
        share = self._share()
        if variant == SHUFFLED:
            share = [p for p in share if self.partners[p] is not None]
        elif variant == FRAMES_REVERSED:
            share = [p for p in share if self.samples[p].videos]
        out = []
        for start in range(0, len(share), self.batch_size):
            positions = share[start : start + self.batch_size]
            sources = [self.partners[p] if variant == SHUFFLED else p for p in positions]
            inputs, bad = self._inputs(sources, dtype, reverse_frames=variant == FRAMES_REVERSED)
            ids, mask = _padded([self.samples[p].prompt_ids for p in positions], self.pad_id, True)
            batch = {"text": ids.to(device), "attention_mask": mask.to(device)}
            batch |= _on_device(inputs, device)
            new = generator.generate(
                batch,
                self.max_new_tokens,
                eos_ids=self.stops,
                pad_id=self.stops[0] if self.stops else self.pad_id,
            )
            for position, source, row in zip(positions, sources, new.tolist(), strict=True):
                if source in bad:
                    continue
                out.append(self._scored(position, row))
        return out

    def _scored(self, position: int, row: list[int]) -> dict[str, Any]:
        stop = next((i for i, token in enumerate(row) if token in self.stops), len(row))
        answer = self.tokenizer.decode(row[:stop]).strip()
        sample = self.samples[position]
        edits, chars = character_edits(answer, sample.reference)
        return {
            "key": sample.key,
            "generated": answer,
            "token_f1": token_f1(answer, sample.reference),
            "exact_match": exact_match(answer, sample.reference),
            "anls": anls(answer, sample.reference),
            "relaxed_accuracy": relaxed_accuracy(answer, sample.reference),
            "char_edits": edits,
            "reference_chars": chars,
            "choice_accuracy": choice_accuracy(answer, sample.reference),
        }

    # -- the report
    def report(self, model: nn.Module, device: torch.device | str | None = None) -> dict[str, Any]:
        """The nested report; a collective: every rank calls it and gets the same numbers.
        Inputs go to `device` (default: where the weights are)."""
        was_training = model.training
        model.eval()
        try:
            nll, tokens, broken = self._nll(model, device)
            nll, tokens, broken_count = distributed.sum_over_ranks([nll, tokens, len(broken)])
            report: dict[str, Any] = {
                "n_samples": len(self.samples),
                "target_tokens": int(tokens),
                "nll_per_token": nll / tokens if tokens else math.nan,
                "perplexity": perplexity(nll, int(tokens)),
            }
            if _is_sharded(model):
                report["generation"] = {
                    "skipped": "the model is sharded with FSDP; generate with one process "
                    "(mmtrain eval RUN_DIR) on the final weights"
                }
            else:
                own = _gather_by_key(self._answers(model, device, OWN))
                moved = _gather_by_key(self._answers(model, device, SHUFFLED))
                backwards = _gather_by_key(self._answers(model, device, FRAMES_REVERSED))
                report["generation"] = self._generation_summary(own, moved, backwards)
                report["examples"] = self._examples(own, moved, backwards)
            report["skipped_samples"] = self.refused
            report["corrupt_samples"] = int(broken_count)
            return report
        finally:
            model.train(was_training)

    def _generation_summary(
        self,
        own: dict[str, dict[str, Any]],
        moved: dict[str, dict[str, Any]],
        backwards: dict[str, dict[str, Any]],
    ) -> dict[str, Any]:
        def mean(results: dict[str, dict[str, Any]], name: str) -> float | None:
            values = [r[name] for r in results.values() if r[name] is not None]
            return float(np.mean(values)) if values else None

        chars = sum(r["reference_chars"] for r in own.values())
        choices = sum(r["choice_accuracy"] is not None for r in own.values())
        return {
            "token_f1": mean(own, "token_f1"),
            "token_f1_shuffled_images": mean(moved, "token_f1"),
            "exact_match": mean(own, "exact_match"),
            "exact_match_shuffled_images": mean(moved, "exact_match"),
            # document and video benchmarks' own scores (eval/answers.py)
            "anls": mean(own, "anls"),
            "anls_shuffled_images": mean(moved, "anls"),
            "relaxed_accuracy": mean(own, "relaxed_accuracy"),
            "cer": sum(r["char_edits"] for r in own.values()) / chars if chars else None,
            "choice_accuracy": mean(own, "choice_accuracy"),
            "n_choice": choices,
            # the samples with clips, each with its clips' frames in reverse order
            "exact_match_frames_reversed": mean(backwards, "exact_match"),
            "token_f1_frames_reversed": mean(backwards, "token_f1"),
            "n": len(own),
            "n_shuffled": len(moved),
            "n_frames_reversed": len(backwards),
            "max_new_tokens": self.max_new_tokens,
        }

    def _examples(
        self,
        own: dict[str, dict[str, Any]],
        moved: dict[str, dict[str, Any]],
        backwards: dict[str, dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The first `examples` samples by key: what the report's gallery shows."""
        out = []
        for position, sample in enumerate(self.samples):
            if len(out) >= self.examples:
                break
            if sample.key not in own:
                continue
            example = {
                "key": sample.key,
                "id": sample.id,
                "images": sample.images,
                "videos": sample.videos,
                "question": sample.question,
                "prompt": sample.prompt,
                "reference": sample.reference,
                **{k: v for k, v in own[sample.key].items() if k != "key"},
            }
            partner = self.partners[position]
            if sample.key in moved and partner is not None:
                example["shuffled_images_from"] = self.samples[partner].key
                example["generated_shuffled_images"] = moved[sample.key]["generated"]
            if sample.key in backwards:
                example["generated_frames_reversed"] = backwards[sample.key]["generated"]
            out.append(example)
        return out

    def __call__(
        self, model: nn.Module, device: torch.device | str | None = None
    ) -> dict[str, float]:
        return flatten_metrics(self.report(model, device))

    def close(self) -> None:
        """Close the shard files."""
        self.shards.close()


def _on_device(inputs: dict[str, Any], device: Any) -> dict[str, Any]:
    """Batch entries on `device`: tensors, and lists of them (a native VLM's inputs)."""

    def move(value: Any) -> Any:
        if isinstance(value, list):
            return [v.to(device) if isinstance(v, torch.Tensor) else v for v in value]
        return value.to(device)

    return {name: move(value) for name, value in inputs.items()}


def _gather_by_key(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every rank's results on every rank, keyed (and ordered) by sample key."""
    if distributed.world_size() > 1:
        parts: list[Any] = [None] * distributed.world_size()
        torch.distributed.all_gather_object(parts, results)
        results = [r for part in parts for r in part]
    return {r["key"]: r for r in sorted(results, key=lambda r: r["key"])}


def is_language_model(model_or_spec: nn.Module | ModelSpec) -> bool:
    """True for a model (or spec) with a decoder: evaluated by `VLMEvaluator`."""
    spec = model_or_spec if isinstance(model_or_spec, ModelSpec) else spec_of(model_or_spec)
    return spec.decoder is not None
