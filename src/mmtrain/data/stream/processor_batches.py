"""Conversation shards -> a hub model's inputs, made by the model folder's own processor.

A hub model (models/hub/) is trained on exactly what transformers feeds it: the loader's
workers read each conversation shard sample (the same shards `mmtrain data build` writes for
native VLMs), turn its turns into transformers' content lists (`<image>` tags become
`{"type": "image"}` items in place), render them with the processor's chat template, and call
the processor on the text and the decoded images (its pixel budget, image splitting, special
tokens and placeholder expansion are the folder's own).

Labels are the assistant's answers only, as for native models. The template is rendered once
per assistant turn up to that turn (with the generation prompt) and through it: the characters
between are the answer (with its end-of-turn marker, which the model must learn to emit). The
processor reports where its placeholder expansion moved the text (`offset_mapping` and
`text_replacement_offsets`), so every token of the expanded row knows whether it lies in an
answer. The first label is masked: nothing predicts a row's first token.

A row longer than `data.sequence_length` is cut after its last visual token, or refused
(`image_cut`: the cut would split an image's tokens; `truncated_no_targets`: no answer
left), counted by the loader like native refusals. Micro-batches are collated here, in the
workers: token-aligned tensors right-padded, per-image tensors concatenated (or padded on their
image axis where the processor keeps one row per sample, as Idefics3's), as the processor's own
batched call lays them out.
"""

from __future__ import annotations

import functools
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmtrain.config import DataConfig
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.data.stream.conversation_batches import SkippedSample, read_conversation
from mmtrain.data.stream.conversations import Conversation
from mmtrain.data.stream.hf_processor import load_processor
from mmtrain.data.stream.media import MediaError
from mmtrain.model_sources import resolve_folder
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

IMAGE_TAG = re.compile(r"<image>")
# Per-token tensors the collate right-pads, and their padding values (input_ids: the pad id).
TOKEN_PADDING = {"labels": IGNORE_INDEX, "attention_mask": 0, "document_ids": -1}
DEFAULT_SEQUENCE_LENGTH = 4096  # when data.sequence_length and the config leave it open


class ProcessorBatcher:
    """The conversation settings of a hub-model run (data.sequence_length), checked once: the
    workers' decoder and collate."""

    def __init__(self, data: DataConfig, spec: ModelSpec):
        assert spec.hub is not None
        self.folder = str(resolve_folder(spec.hub.source, "model"))
        self.sequence_length = data.sequence_length or _max_positions(Path(self.folder))
        self.pack = data.pack
        processor = load_processor(self.folder)  # fails here, not in a worker, when it cannot
        self.pad_id = _pad_id(processor.tokenizer)
        self.pixels = pixel_budget(processor.image_processor, data.vision)

    def decoder(self, spec: ModelSpec, train: bool = True, uint8: bool = False) -> ProcessorDecoder:
        return ProcessorDecoder(self.folder, self.sequence_length, self.pixels)

    def collate(self, spec: ModelSpec) -> functools.partial:
        if self.pack:
            return functools.partial(
                collate_packed, pad_id=self.pad_id, row_length=self.sequence_length
            )
        return functools.partial(collate_processed, pad_id=self.pad_id)


class ProcessorDecoder:
    """One conversation shard sample -> the processor's tensors (batch of one) + "labels"."""

    def __init__(self, folder: str, sequence_length: int, pixels: dict[str, int] | None = None):
        self.folder, self.sequence_length, self.pixels = folder, sequence_length, pixels
        self._processor: Any = None  # loaded in the worker that first needs it

    def __getstate__(self) -> dict[str, Any]:  # workers load their own processor
        return {**self.__dict__, "_processor": None}

    @property
    def processor(self) -> Any:
        if self._processor is None:
            self._processor = load_processor(self.folder)
            if self.pixels:
                _set_pixels(self._processor.image_processor, self.pixels)
        return self._processor

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        conversation, images, videos = read_conversation(sample)
        if conversation.is_preference():
            raise SkippedSample(
                "preference_pair",
                f"{conversation.key}: a preference pair (chosen / rejected): train.objective: "
                "dpo trains on it",
            )
        return self.encode_parsed(conversation, images, videos)

    def encode_parsed(
        self, conversation: Conversation, images: list[bytes], videos: list[bytes]
    ) -> dict[str, torch.Tensor]:
        """`__call__` of a conversation already read from its sample."""
        key = conversation.key
        if videos:
            raise SkippedSample("video", f"{key}: videos are not yet read for hub models")
        messages = [
            {"role": turn.role, "content": content_items(turn.text)} for turn in conversation.turns
        ]
        pictures = [_image(data, key, i) for i, data in enumerate(images)]
        out = encode(self.processor, messages, pictures, key)
        return _fit(out, self.sequence_length, _visual_ids(self.processor), key)


def encode(processor: Any, messages: list[dict], images: list, key: str = "") -> dict:
    """The processor's tensors of one conversation (batch of one) and its "labels": the
    answers' tokens, -100 elsewhere and at position 0."""
    text = processor.apply_chat_template(messages, tokenize=False)
    spans = answer_spans(processor, messages, text, key)
    bos = processor.tokenizer.bos_token
    # As transformers' own apply_chat_template(tokenize=True): a template that writes the BOS
    # itself gets none added.
    special = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
    out = dict(
        processor(
            text=[text],
            images=[images] if images else None,
            return_tensors="pt",
            return_offsets_mapping=True,
            return_text_replacement_offsets=True,
            **special,
        )
    )
    offsets = out.pop("offset_mapping")[0].tolist()
    moved = out.pop("text_replacement_offsets", None)
    moved = moved[0] if moved else []
    ids = out["input_ids"][0]
    labels = torch.full_like(ids, IGNORE_INDEX)
    for start, end in (_shifted(span, moved) for span in spans):
        for position, (first, last) in enumerate(offsets):
            if first < end and last > start:
                labels[position] = ids[position]
    labels[0] = IGNORE_INDEX
    out["labels"] = labels[None]
    return out


def answer_spans(processor: Any, messages: list[dict], text: str, key: str) -> list[tuple]:
    """(start, end) characters of each assistant answer in `text`, from the template rendered
    up to the answer (with the generation prompt) and through it."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = processor.apply_chat_template(
            messages[:i], tokenize=False, add_generation_prompt=True
        )
        through = processor.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through.rstrip())):
            raise FieldError(
                "init",
                f"{key}: the processor's chat template renders turn {i} differently in the "
                "whole conversation than up to it; mmtrain cannot tell its answer's tokens",
            )
        spans.append((len(before), len(through.rstrip())))
    if not spans:
        raise SkippedSample("no_targets", f"{key}: no assistant turn to learn from")
    return spans


def _shifted(span: tuple[int, int], moved: Sequence[dict]) -> tuple[int, int]:
    """`span` of the rendered text in the expanded text the processor tokenized: shifted by
    what every placeholder expansion before each end added."""
    out = []
    for char in span:
        gained = 0
        for replacement in moved:
            old, new = replacement["span"], replacement["new_span"]
            if old[1] <= char:
                gained = new[1] - old[1]
        out.append(char + gained)
    return out[0], out[1]


def _fit(out: dict, length: int, visual: set[int], key: str) -> dict[str, torch.Tensor]:
    ids = out["input_ids"][0]
    if (out["labels"][0] != IGNORE_INDEX).sum() == 0:
        raise SkippedSample("no_targets", f"{key}: every answer token is masked")
    if len(ids) <= length:
        return out
    detail = {"needed_positions": len(ids), "max_length": length}
    if visual and any(int(i) in visual for i in ids[length:].tolist()):
        raise SkippedSample(
            "image_cut",
            f"{key}: {len(ids)} positions; data.sequence_length {length} would cut an image",
            detail,
        )
    cut = {k: v[:, :length] if _per_token(v, len(ids)) else v for k, v in out.items()}
    if (cut["labels"][0] != IGNORE_INDEX).sum() == 0:
        raise SkippedSample(
            "truncated_no_targets",
            f"{key}: {len(ids)} positions; cut to {length} no answer is left",
            detail,
        )
    return cut


# ----------------------------------------------------------------------------- collation
def collate_processed(samples: list[dict[str, torch.Tensor]], pad_id: int) -> dict:
    """The micro-batch of processed samples, laid out as the processor's batched call does:
    per-token tensors ([1, T]) right-padded and stacked; tensors with a batch axis of one per
    sample ([1, N, ...]: images per sample) padded with zeros on N and stacked; the rest
    (patches, tiles, grids of all images) concatenated in sample order."""
    lengths = [s["input_ids"].shape[1] for s in samples]
    width = max(lengths)
    batch: dict[str, torch.Tensor] = {}
    for name in samples[0]:
        values = [s[name] for s in samples]
        if all(_per_token(v, n) for v, n in zip(values, lengths, strict=True)):
            fill = pad_id if name == "input_ids" else TOKEN_PADDING.get(name, 0)
            batch[name] = torch.cat([_pad_last(v, width, fill) for v in values])
        elif all(_images_of_sample(v, s) for v, s in zip(values, samples, strict=True)):
            most = max(v.shape[1] for v in values)
            batch[name] = torch.cat([_pad_axis1(v, most) for v in values])
        else:
            batch[name] = torch.cat(values)
    return batch


def collate_packed(samples: list[dict[str, torch.Tensor]], pad_id: int, row_length: int) -> dict:
    """The micro-batch's samples packed first-fit into as few rows of `row_length` positions
    as hold them (every row stays open: true first-fit; a sample is never split), each row's
    samples laid end to end as `collate_processed` lays out one sample. "document_ids" [R, T]
    numbers the samples of a row (-1: padding) and replaces the attention mask: the model
    keeps attention inside each sample and restarts its positions (models/hub/model.py). The
    images of all rows follow in row order, as their placeholders do."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index, sample in enumerate(samples):
        size = sample["input_ids"].shape[1]
        row = next((r for r, room in enumerate(free) if room >= size), None)
        if row is None:
            rows.append([])
            free.append(row_length)
            row = len(rows) - 1
        rows[row].append(index)
        free[row] -= size
    packed = [_one_row([samples[i] for i in members]) for members in rows]
    batch = collate_processed(packed, pad_id)
    batch.pop("attention_mask", None)
    return batch


def _one_row(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Samples end to end as one sample: per-token tensors concatenated on the token axis,
    images of five axes on their image axis, the rest (patches, tiles, grids) on the first."""
    lengths = [s["input_ids"].shape[1] for s in samples]
    row: dict[str, torch.Tensor] = {}
    for name in samples[0]:
        values = [s[name] for s in samples]
        if all(_per_token(v, n) for v, n in zip(values, lengths, strict=True)):
            row[name] = torch.cat(values, dim=1)
        elif all(_images_of_sample(v, s) for v, s in zip(values, samples, strict=True)):
            row[name] = torch.cat(values, dim=1)
        else:
            row[name] = torch.cat(values)
    row["document_ids"] = torch.cat(
        [torch.full((1, n), i, dtype=torch.long) for i, n in enumerate(lengths)], dim=1
    )
    return row


def _images_of_sample(value: torch.Tensor, sample: dict[str, torch.Tensor]) -> bool:
    """A tensor laid out [1, images, ...] beside pixels of five axes ([1, images, C, H, W]:
    a processor that keeps one row of images per sample, as Idefics3's)."""
    pixels = sample.get("pixel_values")
    if pixels is None or pixels.dim() != 5:
        return False
    return value.dim() >= 3 and tuple(value.shape[:2]) == tuple(pixels.shape[:2])


def _per_token(value: torch.Tensor, length: int) -> bool:
    return value.dim() == 2 and value.shape[0] == 1 and value.shape[1] == length


def _pad_last(value: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    extra = width - value.shape[-1]
    if extra == 0:
        return value
    return torch.cat([value, value.new_full((*value.shape[:-1], extra), fill)], dim=-1)


def _pad_axis1(value: torch.Tensor, most: int) -> torch.Tensor:
    extra = most - value.shape[1]
    if extra == 0:
        return value
    return torch.cat([value, value.new_zeros((1, extra, *value.shape[2:]))], dim=1)


# ----------------------------------------------------------------------------- pixel budget
def pixel_budget(images: Any, vision: Any) -> dict[str, int] | None:
    """`data.vision`'s image token range as the image processor's pixel range: a processor
    that sizes images by pixel count in merged patches (Qwen-VL's: `patch_size` x `merge_size`
    pixels a side per token) takes `shortest_edge` / `longest_edge` as its least and most
    pixels. Other processors size images their own way (tiles, a fixed size): refused."""
    if vision is None:
        return None
    extra = [name for name in ("sample_max_tokens", "video_max_tokens") if getattr(vision, name)]
    if extra:
        raise FieldError(
            f"data.vision.{extra[0]}",
            "a hub model's budget is per image (image_min_tokens, image_max_tokens)",
        )
    side = getattr(images, "patch_size", None), getattr(images, "merge_size", None)
    if not all(isinstance(n, int) for n in side):
        raise FieldError(
            "data.vision",
            f"{type(images).__name__} sizes images its own way (tiles or a fixed size), not by "
            "a token budget; set its own settings in the folder's processor config instead",
        )
    token = (side[0] * side[1]) ** 2  # pixels one merged token covers
    pixels = {}
    if vision.image_min_tokens:
        pixels["shortest_edge"] = vision.image_min_tokens * token
    if vision.image_max_tokens:
        pixels["longest_edge"] = vision.image_max_tokens * token
    return pixels or None


def _set_pixels(images: Any, pixels: dict[str, int]) -> None:
    size = dict(images.size) if images.size is not None else {}
    size = {k: v for k, v in size.items() if v is not None}
    images.size = type(images.size)(**{**size, **pixels}) if images.size is not None else pixels


# ----------------------------------------------------------------------------- helpers
def content_items(text: str) -> list[dict[str, str]]:
    """A turn's text with `<image>` tags as transformers' content list."""
    parts: list[dict[str, str]] = []
    for i, piece in enumerate(IMAGE_TAG.split(text)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _image(data: bytes, key: str, index: int) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a bad file
        raise MediaError(f"{key}: image {index} cannot be decoded ({err})") from None


def _visual_ids(processor: Any) -> set[int]:
    """Token ids that stand for visual content (the processor's image / video tokens)."""
    found = set()
    for name in ("image_token_id", "video_token_id", "image_token", "video_token"):
        value = getattr(processor, name, None)
        if isinstance(value, str):
            value = processor.tokenizer.convert_tokens_to_ids(value)
        if isinstance(value, int) and value >= 0:
            found.add(value)
    return found


def _pad_id(tokenizer: Any) -> int:
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            return value
    return 0


def _max_positions(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    section = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return int(section.get("max_position_embeddings") or DEFAULT_SEQUENCE_LENGTH)
