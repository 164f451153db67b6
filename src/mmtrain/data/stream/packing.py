"""Packing encoded samples into fixed-length rows (LLaVA-style training without padding waste).

A row is `row_length` positions of the language model. An image's single placeholder id takes
`image_length` positions there (or, for a native-resolution tower, the positions its own input
takes: the sample's `spans`) (the model splices the image's tokens in at the placeholder), so
lengths, free room and `position_ids` count it as `image_length`; `input_ids`, `labels`,
`document_ids` and `position_ids` stay in placeholder space (one entry per id), and
`expand_images` gives the same row in position space, where every row is exactly `row_length`.

Placement: greedy first-fit over a window of `open_rows` rows. Each sample, in input order, goes
into the oldest open row with room for it; when none has room a row is opened, and when the
window is full the oldest row is closed and emitted first. Why not best-fit-decreasing: sorting
by length inside a window gains little on long-tailed lengths (the many short samples fill the
gaps first-fit leaves), while it groups long samples together, delays every row until the
window is read and makes a row's content depend on lengths seen later. First-fit keeps memory
bounded, emits rows as a stream and never reorders samples inside a row. No sample is split:
one longer than a row is refused (`SampleTooLong`); truncate it when encoding instead.

Exact resume: the rows are a pure function of the input sequence and the settings (no random
state, clock or hash order), so replaying the same samples in the same order from the same
start packs identically; a resumed run replays the stream and skips the rows already consumed.

Sample boundaries: labels are aligned with `input_ids` (`EncodedSample`) and the model's loss
shifts by one, so the last position of a sample would predict the label at the next sample's
first id. That label is set to -100 when packing. It costs no target: alone, nothing precedes a
sample's first id, so its first label is never a target either; the targets of a row are exactly
the targets of its samples, and a loss normalised by the step's target tokens (DESIGN.md 5) is
the same packed or padded. Attention stays inside a sample through `document_ids` (the decoder's
block-diagonal mask); padding is a document of its own (id -1) with labels -100.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from mmtrain.data.stream.chat_templates import IGNORE_INDEX, EncodedSample, id_positions

__all__ = [
    "PAD_DOCUMENT",
    "PackedRow",
    "SampleTooLong",
    "sample_positions",
    "pack_rows",
    "padded_batches",
    "expand_images",
]

PAD_DOCUMENT = -1  # document id of padding: never equal to a sample's input index


class SampleTooLong(ValueError):
    """A sample that takes more positions than a row; packing never splits one."""


@dataclass(frozen=True)
class PackedRow:
    """One row. `document_ids` holds each id's sample index in the input (PAD_DOCUMENT for
    padding); `position_ids` each id's first position in the model, restarting at 0 per sample
    and counting an image as `image_length` positions."""

    input_ids: list[int]
    labels: list[int]
    document_ids: list[int]
    position_ids: list[int]

    @property
    def targets(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)

    @property
    def samples(self) -> list[int]:
        """Input indices of the samples in this row, in row order."""
        return list(dict.fromkeys(d for d in self.document_ids if d != PAD_DOCUMENT))


@dataclass(eq=False)  # identity: `window.remove` must take this row, not an equal one
class _OpenRow:
    free: int  # positions left
    members: list[tuple[int, EncodedSample]] = field(default_factory=list)


def sample_positions(sample: EncodedSample, image_token_id: int, image_length: int) -> int:
    """Positions the sample takes in the model once its images are spliced in (each its own
    number where the sample has `spans`)."""
    if sample.spans:
        return len(sample.input_ids) + sum(n - 1 for _, n in sample.spans)
    images = sample.input_ids.count(image_token_id)
    return len(sample.input_ids) + images * (image_length - 1)


def pack_rows(
    samples: Iterable[EncodedSample],
    row_length: int,
    *,
    image_token_id: int,
    image_length: int = 1,
    pad_id: int = 0,
    open_rows: int = 16,
) -> Iterator[PackedRow]:
    """Rows of `row_length` positions, first-fit over `open_rows` open rows (module docstring).

    Raises `SampleTooLong` for a sample longer than a row and ValueError for a malformed one.
    """
    _check_settings(row_length, image_token_id, image_length)
    if open_rows < 1:
        raise ValueError(f"open_rows must be at least 1, got {open_rows}")
    window: list[_OpenRow] = []  # oldest first
    for index, sample in enumerate(samples):
        size = _checked_size(index, sample, row_length, image_token_id, image_length)
        row = next((r for r in window if r.free >= size), None)
        if row is None:
            if len(window) == open_rows:
                yield _build(
                    window.pop(0).members, row_length, image_token_id, image_length, pad_id
                )
            row = _OpenRow(free=row_length)
            window.append(row)
        row.members.append((index, sample))
        row.free -= size
        if row.free == 0:  # full: emit now rather than hold it in the window
            window.remove(row)
            yield _build(row.members, row_length, image_token_id, image_length, pad_id)
    for row in window:
        yield _build(row.members, row_length, image_token_id, image_length, pad_id)


def padded_batches(
    samples: Iterable[EncodedSample],
    batch_size: int,
    *,
    image_token_id: int,
    image_length: int = 1,
    pad_id: int = 0,
) -> Iterator[list[PackedRow]]:
    """The unpacked baseline: `batch_size` consecutive samples per batch, one per row, each
    padded (right) to the longest of its batch in positions; the last batch may be smaller."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    _check_settings(1, image_token_id, image_length)
    batch: list[tuple[int, EncodedSample, int]] = []
    for index, sample in enumerate(samples):
        size = _checked_size(index, sample, None, image_token_id, image_length)
        batch.append((index, sample, size))
        if len(batch) == batch_size:
            yield _padded(batch, image_token_id, image_length, pad_id)
            batch = []
    if batch:
        yield _padded(batch, image_token_id, image_length, pad_id)


def expand_images(row: PackedRow, image_token_id: int, image_length: int) -> PackedRow:
    """The row in model positions: each placeholder repeated `image_length` times (where a
    splicer writes the image's tokens), labels -100 there, positions counting on."""
    out = PackedRow([], [], [], [])
    for token, label, doc, pos in zip(
        row.input_ids, row.labels, row.document_ids, row.position_ids, strict=True
    ):
        n = image_length if token == image_token_id and doc != PAD_DOCUMENT else 1
        out.input_ids.extend([token] * n)
        out.labels.extend([label] + [IGNORE_INDEX] * (n - 1))
        out.document_ids.extend([doc] * n)
        out.position_ids.extend(range(pos, pos + n))
    return out


# ----------------------------------------------------------------------------- helpers
def _check_settings(row_length: int, image_token_id: int, image_length: int) -> None:
    if row_length < 1:
        raise ValueError(f"row_length must be at least 1, got {row_length}")
    if image_length < 1:
        raise ValueError(f"image_length must be at least 1, got {image_length}")
    if image_token_id == IGNORE_INDEX:
        raise ValueError(f"image_token_id {IGNORE_INDEX} is the ignored label; use another id")


def _checked_size(
    index: int,
    sample: EncodedSample,
    row_length: int | None,
    image_token_id: int,
    image_length: int,
) -> int:
    if len(sample.input_ids) != len(sample.labels):
        raise ValueError(
            f"sample {index}: {len(sample.input_ids)} input ids but {len(sample.labels)} labels"
        )
    if not sample.input_ids:
        raise ValueError(f"sample {index}: no input ids")
    size = sample_positions(sample, image_token_id, image_length)
    if row_length is not None and size > row_length:
        images = sample.input_ids.count(image_token_id)
        raise SampleTooLong(
            f"sample {index} takes {size} positions ({len(sample.input_ids)} ids, {images} "
            f"image(s) of {image_length}), more than a row's {row_length}; packing never splits "
            "a sample: truncate when encoding (max_length) or use longer rows"
        )
    return size


def _build(
    members: Sequence[tuple[int, EncodedSample]],
    length: int,
    image_token_id: int,
    image_length: int,
    pad_id: int,
) -> PackedRow:
    """The row of `members` in order, padded to `length` positions."""
    row = PackedRow([], [], [], [])
    used = 0
    for index, sample in members:
        row.input_ids.extend(sample.input_ids)
        # The previous position would predict this label across the boundary (module docstring).
        row.labels.extend([IGNORE_INDEX, *sample.labels[1:]])
        row.document_ids.extend([index] * len(sample.input_ids))
        position = 0
        for size in id_positions(sample, image_token_id, image_length):
            row.position_ids.append(position)
            position += size
        used += position
    pad = length - used
    row.input_ids.extend([pad_id] * pad)
    row.labels.extend([IGNORE_INDEX] * pad)
    row.document_ids.extend([PAD_DOCUMENT] * pad)
    row.position_ids.extend(range(pad))  # a document of its own, as the decoder would number it
    return row


def _padded(
    batch: Sequence[tuple[int, EncodedSample, int]],
    image_token_id: int,
    image_length: int,
    pad_id: int,
) -> list[PackedRow]:
    length = max(size for _, _, size in batch)
    return [
        _build([(index, sample)], length, image_token_id, image_length, pad_id)
        for index, sample, _ in batch
    ]
