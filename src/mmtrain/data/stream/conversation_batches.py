"""Conversation shards -> decoder-LM batches: one sample's ids, labels and images, then rows.

A conversation shard sample (`mmtrain data build` on LLaVA / ShareGPT files) is `{key}.json`
= {"id", "messages": [{"role", "content"}], "images": ["0.jpg", ...]} plus the members
`{key}.0.jpg`, ... `ConversationDecoder` turns it into a `ConversationSample`: ids and labels
from the chat template (`encode_conversation`: one `image_token_id` per image, labels on the
assistant's answers only, truncated to `max_length` LM positions, an image counting
`image_length`), and each image through the image tower's transform. A conversation that must
not be trained on (every label masked, an image cut by truncation, ...) raises `SkippedSample`,
whose `reason` is the refusal's kind: the streaming loader skips it and counts it under that
kind, exactly like a corrupt image, so nothing is trained on silently and resume stays exact.

Each sample's first label is masked: the loss scores the logits at t against labels[t + 1], so
nothing ever predicts a sample's first id. Masking it here keeps "target tokens" (what a
next-token loss is normalised by) equal to the labels actually scored, padded or packed.

`conversation_batch` lays out the samples of one micro-batch as the VLM contract's batch:
- padded: one row per sample, right-padded to the longest row; "attention_mask" is False on
  padding (its labels are -100 and causal attention never lets a real token see it).
- packed: `data.packing.pack_rows`, first-fit over the micro-batch's samples (all rows stay
  open, so it is true first-fit), into as few rows of `row_length` LM positions as possible;
  "document_ids" keep attention inside a sample (-1: padding), "position_ids" restart per
  sample, no label crosses a sample boundary, and a sample (with its images) is never split.
Both give "text" and "labels" int64 [R, T], "position_ids" int64 [R, T] (each id's first LM
position, an image counting `image_tokens`), and "image" [N, C, H, W] (float32, or uint8 for the device to normalise) in reading order
(row 0's placeholders left to right, then row 1's), absent for a text-only model.
"splice_sizes" holds the expanded rows' length, whether their padding is on the right and the
image count as host ints (`models.vlm.splice_sizes`), so the model's forward need not read
them from the device. Tensors are in placeholder space: a row with images holds fewer ids than positions, so rows are
padded to the most ids in the batch; each row's content is at most `row_length` positions and
everything after it is padding (label -100, document -1 / attention_mask False).

Why packing per micro-batch keeps resume exact: the micro-batch takes the valid samples of the
next `micro_batch` entries of the loader's stream (`ConversationBatcher.collate`, run in the
loader's workers), as without packing, so the loader's position and a resumed run's next
samples are unchanged. Packing is then a pure function of
those samples (no state carried between micro-batches, no look-ahead), so a resumed run packs
the same rows. The cost: rows do not span micro-batches, so the last row of each is partly
empty; with micro-batches of several rows that waste is a fraction of one row.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmtrain.config import DataConfig
from mmtrain.data.stream.chat_templates import (
    IGNORE_INDEX,
    TOO_LONG_KINDS,
    ChatTemplate,
    EncodedSample,
    Placeholders,
    RefusedSample,
    TextEncoder,
    encode_conversation,
    get_template,
    holds_chat_template,
    id_positions,
)
from mmtrain.data.stream.conversations import (
    Conversation,
    ConversationError,
    Turn,
    parse_conversation,
)
from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS, MediaError
from mmtrain.data.stream.native_inputs import Measured, NativeInputs, VisualInputs
from mmtrain.data.stream.packing import (
    PAD_DOCUMENT,
    PackedRow,
    SampleTooLong,
    pack_rows,
    sample_positions,
)
from mmtrain.data.stream.tokenizer import get_tokenizer
from mmtrain.data.stream.transforms import AugmentConfig, ImageTransform, make_transform
from mmtrain.models.splice import image_placeholders, splice_sizes, valid_ids
from mmtrain.models.visual_inputs import (
    IMAGE_SOURCES,
    IMAGES,
    VIDEO_FPS,
    VIDEO_SOURCES,
    VIDEOS,
)
from mmtrain.models.vlm import SPLICE_SIZES
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError
from mmtrain.visual_budget import BudgetExceeded, VisualBudget, budget_of

__all__ = [
    "NO_IMAGE_ID",
    "SkippedSample",
    "ConversationSample",
    "ConversationDecoder",
    "ConversationBatcher",
    "conversation_batch",
    "resolve_chat_template",
    "check_template_fits",
    "read_conversation",
]

# The placeholder id of a text-only LM: no tokenizer gives a negative id, so no text collides.
NO_IMAGE_ID = -1


class SkippedSample(ValueError):
    """A sample the loader skips and counts. `reason` is a short kind (the loader's counter key:
    no_targets, image_cut, image_count, ...); the message says what and where. `skip_kind`
    is what the loader counts it as: "too_long" for a conversation the row cannot hold
    (`TOO_LONG_KINDS`), else "corrupt"; `detail` carries a too-long one's numbers (positions
    needed, the row's, the largest input's) for the run's summary of them."""

    def __init__(self, reason: str, message: str, detail: dict[str, Any] | None = None):
        self.reason, self.detail = reason, detail
        self.skip_kind = "too_long" if reason in TOO_LONG_KINDS else "corrupt"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, str(self), self.detail))


@dataclass(frozen=True, eq=False)
class ConversationSample(EncodedSample):
    """An encoded conversation and its images, float [n, C, H, W] in placeholder order
    (n == count of the image token in `input_ids`); None for a text-only model. A
    native-resolution VLM's are `visual`: images and clips at their own sizes."""

    images: torch.Tensor | None = None
    visual: VisualInputs | None = None


# ----------------------------------------------------------------------------- one sample
def read_conversation(sample: dict[str, Any]) -> tuple[Conversation, list[bytes], list[bytes]]:
    """The conversation of a shard sample and the bytes of its images and of its videos, each
    in tag order."""
    key = str(sample.get("__key__", "?"))
    if "json" not in sample:
        raise MediaError(f"{key}: no json member (a conversation shard sample needs one)")
    try:
        record = json.loads(sample["json"])
    except ValueError as err:
        raise MediaError(f"{key}.json: not valid JSON: {err}") from None
    try:
        conv = parse_conversation(record, file=f"{key}.json", origin=f"{key}.json")
    except ConversationError as err:
        raise SkippedSample(err.kind, f"{key}.json: {err.reason}") from None
    missing = [name for name in (*conv.images, *conv.videos) if name not in sample]
    if missing:
        raise MediaError(f"{key}: json lists member(s) {missing} that the sample lacks")
    return conv, [sample[name] for name in conv.images], [sample[name] for name in conv.videos]


def _largest_input(measured: Measured, tokens: Sequence[int]) -> dict[str, Any]:
    """The image or clip of a sample that takes the most LM positions: its size as stored
    and at the tower, for a message saying what does not fit."""
    index = max(range(len(tokens)), key=tokens.__getitem__, default=None)
    if index is None:
        return {}
    stored = [*measured.images, *measured.videos][index]
    shape = measured.shapes[index]
    kind = "image" if index < len(measured.images) else "video"
    frames = f"{stored.frames} frames of " if kind == "video" else ""
    return {
        "largest_input": f"{kind} of {frames}{stored.width}x{stored.height} px "
        f"({shape.width}x{shape.height} at the tower: {tokens[index]} positions)",
        "largest_input_positions": tokens[index],
    }


class ConversationDecoder:
    """A conversation shard sample -> `ConversationSample` (`encode`), or the tensors the
    streaming loader stacks (`__call__`: "input_ids", "labels" [L] and "image" [n, C, H, W]).

    `image_transform` None: a text-only LM; a conversation with images is then skipped.
    `native`: a native-resolution VLM's images and clips (each its own size and tokens; the
    sample's `visual`, "image" / "video" lists in `__call__`).
    """

    def __init__(
        self,
        template: ChatTemplate,
        tokenizer: TextEncoder,
        *,
        max_length: int,
        image_token_id: int,
        image_length: int,
        image_transform: ImageTransform | None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        native: NativeInputs | None = None,
        video_token_id: int | None = None,
        wrap: tuple[int, int] | None = None,
    ):
        self.template = template
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.image_token_id = image_token_id
        self.image_length = image_length
        self.image_transform = image_transform
        self.max_pixels = max_pixels
        self.native = native
        self.video_token_id = video_token_id
        self.wrap = wrap

    @classmethod
    def for_spec(
        cls,
        spec: ModelSpec,
        tokenizer: TextEncoder,
        template: ChatTemplate,
        sequence_length: int,
        *,
        train: bool = True,
        augment: AugmentConfig | None = None,
        uint8: bool = False,
        budget: VisualBudget | None = None,
    ) -> ConversationDecoder:
        """The decoder for a decoder-LM spec: image token and length from its projector, the
        image tower's transform (train: random crop and flip; eval: centre crop; `uint8`:
        pixels left for the device to normalise). A native-resolution VLM's inputs follow
        `budget` (default: the spec's own)."""
        if spec.decoder is None:
            raise FieldError("decoder", "conversation batches are for a decoder LM spec")
        if spec.vision is not None:
            tokens = spec.vision_tokens
            assert tokens is not None
            wrap = None if tokens.start_id is None else (tokens.start_id, tokens.end_id)
            return cls(
                template,
                tokenizer,
                max_length=sequence_length,
                image_token_id=spec.vision_tokens.image_token_id,
                image_length=1,
                image_transform=None,
                native=NativeInputs(budget or budget_of(spec.vision, None), uint8=uint8),
                video_token_id=tokens.video_token_id,
                wrap=wrap,
            )
        transform = None
        image_token_id = NO_IMAGE_ID
        if spec.projector is not None:
            name = spec.projector.tower
            transform = make_transform(
                spec.towers[name], train, augment=augment, name=name, uint8=uint8
            )
            if not isinstance(transform, ImageTransform):
                raise FieldError(f"towers.{name}", "the projector's tower must take images")
            image_token_id = spec.projector.image_token_id
        return cls(
            template,
            tokenizer,
            max_length=sequence_length,
            image_token_id=image_token_id,
            image_length=max(1, spec.image_tokens()),
            image_transform=transform,
        )

    def encode(self, sample: dict[str, Any], rng: np.random.Generator | None) -> ConversationSample:
        """Ids, labels and transformed images of one shard sample; raises `SkippedSample`
        (refused conversation) or `MediaError` (broken member)."""
        conv, images, videos = read_conversation(sample)
        if conv.is_preference():
            raise SkippedSample(
                "preference_pair",
                f"{conv.key}: a preference pair (chosen / rejected): train.objective: dpo trains "
                "on it",
            )
        return self.encode_parsed(conv, images, videos, rng)

    def encode_parsed(
        self,
        conv: Conversation,
        images: list[bytes],
        videos: list[bytes],
        rng: np.random.Generator | None,
    ) -> ConversationSample:
        """`encode` of a conversation already read from its sample."""
        if self.native is not None:
            return self._encode_native(conv, images, videos)
        if images and self.image_transform is None:
            raise SkippedSample(
                "images_without_tower",
                f"{conv.key}: {len(images)} image(s), but the model has no image tower",
            )
        encoded = self._encode(conv, Placeholders(self.image_token_id, self.image_length))
        pixels = None
        if self.image_transform is not None:
            pixels = self._images(conv.key, images, rng)
        return ConversationSample(encoded.input_ids, encoded.labels, images=pixels)

    def encode_text(
        self, conv: Conversation, images: list[bytes], videos: list[bytes]
    ) -> EncodedSample:
        """The ids and labels of a conversation with the placeholders its inputs take, without
        decoding them (the other side of a preference pair shares the first side's inputs)."""
        if self.native is None:
            return self._encode(conv, Placeholders(self.image_token_id, self.image_length))
        return self._encode(conv, self._marks(conv.key, self._measured(conv.key, images, videos)))

    def _measured(self, key: str, images: list[bytes], videos: list[bytes]) -> Measured:
        assert self.native is not None
        try:
            return self.native.measure(key, images, videos)
        except BudgetExceeded as err:
            raise SkippedSample("visual_budget", f"{key}: {err}") from None

    def _marks(self, key: str, measured: Measured) -> Placeholders:
        assert self.native is not None
        image_tokens, video_tokens = measured.tokens(self.native.budget)
        return Placeholders(
            self.image_token_id,
            video_token_id=self.video_token_id,
            image_lengths=image_tokens,
            video_lengths=video_tokens,
            wrap=self.wrap,
        )

    def _encode_native(
        self, conv: Conversation, images: list[bytes], videos: list[bytes]
    ) -> ConversationSample:
        """Sizes first (headers), then the text with each input's tokens, then the pixels of
        a sample that is kept. Native inputs are resized, never cropped or flipped: a page's
        text and a clip's layout are what the model learns to read."""
        assert self.native is not None
        measured = self._measured(conv.key, images, videos)
        image_tokens, video_tokens = measured.tokens(self.native.budget)
        marks = self._marks(conv.key, measured)
        try:
            encoded = self._encode(conv, marks)
        except SkippedSample as err:
            if err.detail is not None:  # name the input that takes the most positions
                err.detail.update(_largest_input(measured, [*image_tokens, *video_tokens]))
            raise
        visual = self.native.decode(conv.key, images, videos, measured)
        return ConversationSample(encoded.input_ids, encoded.labels, encoded.spans, visual=visual)

    def _encode(self, conv: Conversation, marks: Placeholders) -> EncodedSample:
        try:
            encoded = encode_conversation(
                conv,
                self.template,
                self.tokenizer,
                self.max_length,
                self.image_token_id,
                placeholders=marks,
            )
        except RefusedSample as err:
            raise SkippedSample(err.kind, err.reason, err.detail) from None
        except FieldError as err:  # text ids equal to the image token: this sample's text
            raise SkippedSample(err.path, f"{conv.key}: {err.message}") from None
        labels = [IGNORE_INDEX, *encoded.labels[1:]]  # nothing predicts the first id
        if all(label == IGNORE_INDEX for label in labels):
            raise SkippedSample(
                "no_targets", f"{conv.key}: the only target is the first id, which nothing predicts"
            )
        return EncodedSample(encoded.input_ids, labels, encoded.spans)

    def _images(
        self, key: str, images: Sequence[bytes], rng: np.random.Generator | None
    ) -> torch.Tensor:
        assert self.image_transform is not None
        out = []
        for n, data in enumerate(images):
            try:
                out.append(self.image_transform.decode(data, rng, self.max_pixels))
            except MediaError as err:
                raise MediaError(f"{key} image {n}: {err}") from None
        if out:
            return torch.stack(out)
        t = self.image_transform
        return torch.empty(0, t.channels, t.size, t.size, dtype=torch.uint8 if t.uint8 else None)

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        return self.tensors(self.encode(sample, rng))

    @staticmethod
    def tensors(encoded: ConversationSample) -> dict[str, Any]:
        """What `__call__` hands the loader for an encoded sample."""
        out = {
            "input_ids": torch.tensor(encoded.input_ids, dtype=torch.long),
            "labels": torch.tensor(encoded.labels, dtype=torch.long),
        }
        if encoded.images is not None:
            out["image"] = encoded.images
        if encoded.visual is not None:
            out["spans"] = torch.tensor(encoded.spans, dtype=torch.long).reshape(-1, 2)
            out[IMAGES] = encoded.visual.images
            out[VIDEOS] = encoded.visual.videos
            out[VIDEO_FPS] = torch.tensor(encoded.visual.video_fps, dtype=torch.float64)
        return out

    @staticmethod
    def sample_of(out: dict[str, Any]) -> ConversationSample:
        """The sample back from what `__call__` returned for it."""
        ids, labels = out["input_ids"].tolist(), out["labels"].tolist()
        if "spans" not in out:
            return ConversationSample(ids, labels, images=out.get("image"))
        visual = VisualInputs(list(out[IMAGES]), list(out[VIDEOS]), out[VIDEO_FPS].tolist())
        spans = tuple((int(i), int(n)) for i, n in out["spans"].tolist())
        return ConversationSample(ids, labels, spans, visual=visual)


# ----------------------------------------------------------------------------- batches
def conversation_batch(
    samples: Sequence[ConversationSample],
    *,
    pack: bool,
    row_length: int,
    image_token_id: int,
    image_tokens: int,
    pad_id: int = 0,
    video_token_id: int | None = None,
) -> dict[str, Any]:
    """One micro-batch of samples -> the model's batch, padded or packed (module docstring).

    `row_length`: LM positions a row holds (a sample longer than that raises SampleTooLong);
    `image_tokens`: positions one image takes; `pad_id` must not be `image_token_id`.
    Samples of a native-resolution VLM (their `visual`) give `native_batch`'s layout.
    """
    if not samples:
        raise ValueError("no samples to batch")
    if pad_id == image_token_id:
        raise ValueError(f"pad_id {pad_id} is the image token id; padding would count as images")
    length = max(1, image_tokens)
    if pack:
        packed = pack_rows(
            samples,
            row_length,
            image_token_id=image_token_id,
            image_length=length,
            pad_id=pad_id,
            open_rows=len(samples),
        )
        rows = [_content(row) for row in packed]
    else:
        rows = [
            _single_row(i, s, row_length, image_token_id, length) for i, s in enumerate(samples)
        ]
    width = max(len(row.input_ids) for row in rows)
    rows = [_pad(row, width, pad_id) for row in rows]
    if any(sample.visual is not None for sample in samples):
        return native_batch(samples, rows, pack, image_token_id, video_token_id)
    batch = _row_tensors(rows, pack)
    batch["position_ids"] = _tensor([row.position_ids for row in rows])
    images, sources = _images_in_reading_order(samples, rows)
    if images is not None:
        batch["image"] = images
    if sources is not None:
        batch[IMAGE_SOURCES] = sources
    # The splice's sizes, counted here on the host as the model would count them on the device.
    placeholders = image_placeholders(
        batch["text"], image_token_id, batch.get("attention_mask"), batch.get("document_ids")
    )
    batch[SPLICE_SIZES] = splice_sizes(placeholders, image_tokens, batch.get("attention_mask"))
    return batch


def native_batch(
    samples: Sequence[ConversationSample],
    rows: Sequence[PackedRow],
    pack: bool,
    image_token_id: int,
    video_token_id: int | None,
) -> dict[str, Any]:
    """A native-resolution VLM's batch of laid-out rows: "text", "labels", "attention_mask"
    or "document_ids", and the inputs in reading order (row 0's placeholders left to right,
    then row 1's): "image" a list of [3, H, W], "video" a list of [T, 3, H, W], "video_fps"
    per clip. No "position_ids": the model computes M-RoPE's 3-D positions from the layout
    (restarting per packed document), so the host never numbers them."""
    batch: dict[str, Any] = _row_tensors(rows, pack)
    order = [index for row in rows for index in row.samples]
    visual = [samples[i].visual for i in order]
    distinct, taker = _distinct([v for v in visual if v is not None])
    batch[IMAGES] = [image for v in distinct for image in v.images]
    batch[VIDEOS] = [clip for v in distinct for clip in v.videos]
    batch[VIDEO_FPS] = [fps for v in distinct for fps in v.video_fps]
    if len(distinct) < len(taker):  # samples share their inputs: each is encoded once
        for key, per in ((IMAGE_SOURCES, "images"), (VIDEO_SOURCES, "videos")):
            counts = [len(getattr(v, per)) for v in distinct]
            starts = np.cumsum([0, *counts])
            batch[key] = [int(starts[d]) + k for d in taker for k in range(counts[d])]
    # Each placeholder's tokens in reading order: a row's samples follow one another in it.
    counts = [n for i in order for _, n in samples[i].spans]
    valid = valid_ids(batch["text"], batch.get("attention_mask"), batch.get("document_ids"))
    is_visual = (batch["text"] == image_token_id) & valid
    if video_token_id is not None:
        is_visual |= (batch["text"] == video_token_id) & valid
    tokens = torch.tensor(counts, dtype=torch.long)
    batch[SPLICE_SIZES] = splice_sizes(is_visual, tokens, batch.get("attention_mask"))
    return batch


def _row_tensors(rows: Sequence[PackedRow], pack: bool) -> dict[str, Any]:
    """ "text" and "labels" [R, T], and "document_ids" (packed) or "attention_mask" (padded)."""
    documents = _tensor([row.document_ids for row in rows])
    batch: dict[str, Any] = {
        "text": _tensor([row.input_ids for row in rows]),
        "labels": _tensor([row.labels for row in rows]),
    }
    if pack:
        batch["document_ids"] = documents
    else:
        batch["attention_mask"] = documents != PAD_DOCUMENT
    return batch


def _single_row(
    index: int, sample: EncodedSample, row_length: int, image_token_id: int, image_length: int
) -> PackedRow:
    size = sample_positions(sample, image_token_id, image_length)
    if size > row_length:
        raise SampleTooLong(
            f"sample {index} takes {size} positions, more than a row's {row_length}; "
            "truncate when encoding (max_length)"
        )
    if len(sample.input_ids) != len(sample.labels) or not sample.input_ids:
        raise ValueError(
            f"sample {index}: {len(sample.input_ids)} ids, {len(sample.labels)} labels"
        )
    positions, position = [], 0
    for step in id_positions(sample, image_token_id, image_length):
        positions.append(position)
        position += step
    labels = [IGNORE_INDEX, *sample.labels[1:]]
    return PackedRow(list(sample.input_ids), labels, [index] * len(sample.input_ids), positions)


def _content(row: PackedRow) -> PackedRow:
    """A packed row without its trailing padding (re-padded to the batch's width later)."""
    end = len(row.document_ids)
    while end and row.document_ids[end - 1] == PAD_DOCUMENT:
        end -= 1
    return PackedRow(
        row.input_ids[:end], row.labels[:end], row.document_ids[:end], row.position_ids[:end]
    )


def _pad(row: PackedRow, width: int, pad_id: int) -> PackedRow:
    """Right padding as a document of its own (positions from 0, as the decoder numbers one)."""
    pad = width - len(row.input_ids)
    return PackedRow(
        row.input_ids + [pad_id] * pad,
        row.labels + [IGNORE_INDEX] * pad,
        row.document_ids + [PAD_DOCUMENT] * pad,
        row.position_ids + list(range(pad)),
    )


def _tensor(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def _images_in_reading_order(
    samples: Sequence[ConversationSample], rows: Sequence[PackedRow]
) -> tuple[torch.Tensor | None, list[int] | None]:
    """The images of the rows' samples, each sample's once where samples share them (a
    preference pair's sides), and, then, which image each placeholder takes (IMAGE_SOURCES)."""
    if all(sample.images is None for sample in samples):
        return None, None
    order = [index for row in rows for index in row.samples]
    distinct, taker = _distinct([samples[i].images for i in order if samples[i].images is not None])
    if not distinct:
        return None, None
    if len(distinct) == len(taker):
        return torch.cat(distinct), None
    starts = np.cumsum([0, *(len(x) for x in distinct)])
    sources = [int(starts[d]) + k for d in taker for k in range(len(distinct[d]))]
    return torch.cat(distinct), sources


def _distinct(inputs: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """(the distinct objects of `inputs`, by identity, in first-seen order; for each input its
    index among them): the sides of a preference pair hold the very same inputs."""
    distinct: list[Any] = []
    seen: dict[int, int] = {}
    taker = []
    for x in inputs:
        if id(x) not in seen:
            seen[id(x)] = len(distinct)
            distinct.append(x)
        taker.append(seen[id(x)])
    return distinct, taker


# ----------------------------------------------------------------------------- settings
class ConversationBatcher:
    """The conversation settings of a decoder-LM run (data.chat_template, data.tokenizer,
    data.sequence_length, data.pack, and a native-resolution VLM's data.vision), checked once:
    decoders and batch layout."""

    def __init__(self, data: DataConfig, spec: ModelSpec):
        if spec.decoder is None:
            raise FieldError("decoder", "conversation batches are for a decoder LM spec")
        try:
            self.tokenizer = get_tokenizer(data.tokenizer, language_model=True)
        except FieldError as err:
            raise FieldError("data.tokenizer", err.message) from None
        self.template = resolve_chat_template(data.chat_template, data.tokenizer)
        self.sequence_length = _sequence_length(data, spec)
        self.pack = data.pack
        projector, tokens = spec.projector, spec.vision_tokens
        self.image_token_id = NO_IMAGE_ID if projector is None else projector.image_token_id
        self.video_token_id: int | None = None
        self.budget: VisualBudget | None = None
        if spec.vision is not None and tokens is not None:
            self.image_token_id, self.video_token_id = tokens.image_token_id, tokens.video_token_id
            self.budget = budget_of(spec.vision, data.vision)
        elif data.vision is not None:
            raise FieldError("data.vision", "only a native-resolution VLM (spec.vision) reads it")
        check_template_fits(self.template, self.tokenizer, self.image_token_id)
        # Padding is masked everywhere; its id only has to differ from the placeholders.
        self.pad_id = min({0, 1, 2} - {self.image_token_id, self.video_token_id})

    def decoder(
        self, spec: ModelSpec, train: bool = True, uint8: bool = False
    ) -> ConversationDecoder:
        """The decoder of `spec` (train: random crops and flips; eval: centre crops; `uint8`:
        images left for the device to normalise)."""
        return ConversationDecoder.for_spec(
            spec,
            self.tokenizer,
            self.template,
            self.sequence_length,
            train=train,
            uint8=uint8,
            budget=self.budget,
        )

    def collate(self, spec: ModelSpec) -> functools.partial:
        """The streaming loader's `collate` for `spec`: the decoded samples of one task (what
        `ConversationDecoder.__call__` returns) -> their micro-batch, laid out in the worker."""
        return functools.partial(_collate_decoded, self, spec)

    def batch(
        self, samples: Sequence[ConversationSample], spec: ModelSpec
    ) -> dict[str, torch.Tensor]:
        """`conversation_batch` with the run's settings (data.pack, data.sequence_length)."""
        return conversation_batch(
            samples,
            pack=self.pack,
            row_length=self.sequence_length,
            image_token_id=self.image_token_id,
            image_tokens=spec.image_tokens(),
            pad_id=self.pad_id,
            video_token_id=self.video_token_id,
        )


def _collate_decoded(
    batcher: ConversationBatcher, spec: ModelSpec, outputs: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    # Module level, so the partial pickles into the loader's worker processes.
    return batcher.batch([ConversationDecoder.sample_of(out) for out in outputs], spec)


def _sequence_length(data: DataConfig, spec: ModelSpec) -> int:
    assert spec.decoder is not None
    limit = spec.decoder.max_positions
    if data.sequence_length is None:
        return limit
    if data.sequence_length < 1:
        raise FieldError("data.sequence_length", f"must be at least 1, got {data.sequence_length}")
    if data.sequence_length > limit:
        raise FieldError(
            "data.sequence_length",
            f"{data.sequence_length} is more than the decoder's max_positions {limit}; lower it "
            "or raise decoder.max_positions in the spec",
        )
    images = spec.image_tokens()
    if images and data.sequence_length <= images:
        raise FieldError(
            "data.sequence_length",
            f"{data.sequence_length} leaves no room for text beside one image of {images} "
            "tokens; every image-bearing sample would be refused",
        )
    return data.sequence_length


def resolve_chat_template(chat_template: str | None, tokenizer: str) -> ChatTemplate:
    """`data.chat_template`: a name or a path; None takes the template stored with
    `data.tokenizer` (the tokenizer_config.json / chat_template.jinja of its folder)."""
    try:
        if chat_template is not None:
            return get_template(chat_template)
        path = Path(tokenizer)
        folder = path if path.is_dir() else path.parent
        if tokenizer.lower() == "byte" or not holds_chat_template(folder):
            raise FieldError(
                "data.chat_template",
                f"not set, and data.tokenizer {tokenizer!r} has no chat template beside it "
                "(tokenizer_config.json or chat_template.jinja); set one of plain, chatml, "
                "llama-3, vicuna-v1 or a path",
            )
        return get_template(folder)
    except FieldError as err:
        if err.path == "data.chat_template":
            raise
        raise FieldError("data.chat_template", err.message) from None


def check_template_fits(
    template: ChatTemplate, tokenizer: TextEncoder, image_token_id: int
) -> None:
    """Fail at start-up, naming data.chat_template, when the tokenizer splits one of the
    template's special tokens (otherwise every sample would be skipped one by one)."""
    probe = Conversation("probe", [Turn("user", "Hi"), Turn("assistant", "Hello.")])
    try:
        encode_conversation(probe, template, tokenizer, 1 << 20, image_token_id)
    except FieldError as err:
        raise FieldError("data.chat_template", err.message) from None
    except RefusedSample as err:
        raise FieldError(
            "data.chat_template", f"{template.name} trains nothing on a plain exchange: {err}"
        ) from None
