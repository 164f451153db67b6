"""Planning a language model from the data: a distribution of tokens per sample, laid out in
rows padded or packed, as the loader will feed them.

A sample is one conversation: `positions` LM positions (its text ids, plus `image_tokens - 1`
more per image, since the placeholder id becomes the image's tokens) and `images` images.
Two layouts, both simulated sample by sample on the real lengths (no averages), in a fixed
shuffled order (seeded; the loader's order is another shuffle of the same samples):

- padded: `micro_batch` samples per micro-batch, each row padded to the longest of its
  micro-batch (`pad_to="longest"`, what a collate does) or to `sequence_length` ("max");
- packed: rows of exactly `sequence_length` positions, filled first-fit over a window of
  `open_rows` rows, the rule data/stream/packing.py's `pack_rows` uses (held together by a test).

A native-resolution VLM (spec.vision) reads each page and clip at its own size: a sample's
`Lengths.visual_shapes` give its inputs at the tower's size, so its visual tokens, patches and
tower FLOPs are its own (`NativeVisionSpec.tokens`, `.patches`, `.forward_flops` per input)
instead of `images x` one image's; its ids are its positions less its visual tokens plus one
placeholder per input. Each layout also keeps its heaviest row's inputs (the row with the most
visual patches: one sample padded, a packed row's members together), which memory is planned
for.

Samples longer than `sequence_length` are truncated to it (as encoding with `max_length`
does; the count is reported). Per row the module computes every position of the row: padding
costs as much as text, and a packed row's attention is computed over the whole row (the
block-diagonal mask is applied to a dense s x s score matrix), so "computed" FLOPs count whole
rows and "useful" FLOPs only each sample alone. Pure Python, no torch.

The distribution (`Lengths`) and its statistics (`summarize`) are in `mmtrain.lengths`, below
both the planner and `data/`, whose `data inspect` reports the same statistics.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mmtrain.lengths import Lengths, Visual
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

LAYOUTS = ("padded", "packed")
PAD_TO = ("longest", "max")
OPEN_ROWS = 16  # data/stream/packing.py's default window


@dataclass(frozen=True)
class RowLayout:
    """The rows one pass over the samples makes, and what they cost.

    `rows` rows; per micro-batch at worst `max_positions` positions per row, `max_ids` ids per
    row (placeholder space: the logits' rows) and `max_images` images in the micro-batch
    (memory is planned for that worst micro-batch); `computed_flops` / `useful_flops` the
    forward FLOPs of all rows (whole rows / each sample alone); `vision_flops` the image
    tower's and projector's share (the same in both; a native tower's: the sum of its FLOPs
    over every laid-out sample's own inputs); `positions` real and computed.
    `max_visual_inputs`: a native VLM's heaviest row's inputs (most patches,
    `max_visual_patches`), what memory is planned for; () otherwise."""

    name: str
    samples: int
    rows: int
    micro_batch: int
    sequence_length: int
    max_positions: int
    max_ids: int
    max_images: int
    images: int
    real_positions: int
    computed_positions: int
    computed_flops: float
    useful_flops: float
    vision_flops: float
    truncated: int
    max_visual_inputs: tuple[Visual, ...] = ()
    max_visual_patches: int = 0

    @property
    def samples_per_row(self) -> float:
        return self.samples / self.rows

    @property
    def fill(self) -> float:
        """Share of the computed positions that hold a sample (1 - padding)."""
        return self.real_positions / self.computed_positions

    def to_dict(self) -> dict:
        return {
            "layout": self.name,
            "samples": self.samples,
            "rows": self.rows,
            "samples_per_row": round(self.samples_per_row, 3),
            "micro_batch": self.micro_batch,
            "sequence_length": self.sequence_length,
            "max_positions": self.max_positions,
            "max_ids": self.max_ids,
            "max_images_per_micro_batch": self.max_images,
            "fill": round(self.fill, 4),
            "useful_flop_share": round(self.useful_flops / self.computed_flops, 4),
            "forward_flops_per_row": self.computed_flops / self.rows,
            "vision_flops": self.vision_flops,
            "vision_flops_per_row": self.vision_flops / self.rows,
            "truncated_samples": self.truncated,
        } | (
            {
                "heaviest_row_inputs": [list(v) for v in self.max_visual_inputs],
                "heaviest_row_patches": self.max_visual_patches,
            }
            if self.max_visual_inputs
            else {}
        )


@dataclass(frozen=True)
class _Sample:
    """One sample as the layouts see it: `positions`, `images`, its `inputs` (placeholders in
    its ids: images, and a native VLM's clips), `extra` positions beyond its ids (visual
    tokens less one per input), the tower's FLOPs over its inputs, and a native VLM's inputs
    (`visual`) and their patches."""

    positions: int
    images: int
    inputs: int
    extra: int
    vision_flops: int
    visual: tuple[Visual, ...] = ()
    patches: int = 0

    @property
    def ids(self) -> int:
        return self.positions - self.extra

    @property
    def visual_positions(self) -> int:
        return self.extra + self.inputs


def _per_image_flops(spec: ModelSpec) -> int:
    return spec.sequence_flops(1, 1) - spec.sequence_flops(1, 0) if spec.projector else 0


def _samples(spec: ModelSpec, lengths: Lengths) -> list[_Sample]:
    """Every sample of `lengths` with its own visual terms (module docstring)."""
    if spec.vision is None:
        extra, image_flops = max(spec.image_tokens() - 1, 0), _per_image_flops(spec)
        return [
            _Sample(p, i, i, i * extra, i * image_flops)
            for p, i in zip(lengths.positions, lengths.images, strict=True)
        ]
    v = spec.vision
    shapes = lengths.visual_shapes or ((),) * len(lengths.positions)
    if not lengths.visual_shapes and any(lengths.images):
        raise FieldError(
            "--data",
            f"{spec.name} reads each page at its own size: its lengths need each sample's "
            "visual shapes (conversation_counts with a budget)",
        )
    out = []
    for p, i, visual in zip(lengths.positions, lengths.images, shapes, strict=True):
        tokens = sum(v.tokens(h, w, f) for f, h, w in visual)
        out.append(
            _Sample(
                positions=p,
                images=i,
                inputs=len(visual),
                extra=tokens - len(visual),
                vision_flops=sum(v.forward_flops(h, w, f) for f, h, w in visual),
                visual=tuple(visual),
                patches=sum(v.patches(h, w, f) for f, h, w in visual),
            )
        )
    return out


def _shuffled(spec: ModelSpec, lengths: Lengths, seed: int) -> list[_Sample]:
    samples = _samples(spec, lengths)
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    return [samples[i] for i in order]


def _truncated(samples: list[_Sample], limit: int) -> tuple[list[_Sample], int]:
    """Samples cut to `limit` positions; one whose images alone exceed it keeps its images
    (encoding refuses to cut an image; such a sample is the user's to drop)."""
    out, cut = [], 0
    for s in samples:
        if s.positions > limit:
            cut += 1
            s = replace(s, positions=max(limit, s.visual_positions + 1))
        out.append(s)
    return out, cut


def _heaviest(rows: Sequence[Sequence[_Sample]]) -> tuple[tuple[Visual, ...], int]:
    """The inputs of the row with the most visual patches (the first such row), and those
    patches; ((), 0) when no row has any."""
    best: tuple[tuple[Visual, ...], int] = ((), 0)
    for row in rows:
        patches = sum(s.patches for s in row)
        if patches > best[1]:
            best = (tuple(v for s in row for v in s.visual), patches)
    return best


def padded_layout(
    spec: ModelSpec,
    lengths: Lengths,
    sequence_length: int,
    micro_batch: int,
    pad_to: str = "longest",
    seed: int = 0,
) -> RowLayout:
    """One sample per row, `micro_batch` rows padded together (module docstring)."""
    _check(sequence_length, micro_batch)
    if pad_to not in PAD_TO:
        raise FieldError("--pad-to", f"{pad_to!r} is not one of {', '.join(PAD_TO)}")
    samples, cut = _truncated(_shuffled(spec, lengths, seed), sequence_length)
    lm = spec.decoder
    worst = [0, 0, 0]
    computed = useful = 0.0
    vision = real = positions_total = images_total = 0
    for start in range(0, len(samples), micro_batch):
        batch = samples[start : start + micro_batch]
        width = sequence_length if pad_to == "max" else max(s.positions for s in batch)
        ids = max(s.ids for s in batch)
        images = sum(s.images for s in batch)
        worst = [max(worst[0], width), max(worst[1], ids), max(worst[2], images)]
        computed += len(batch) * lm.forward_flops(width)
        useful += sum(lm.forward_flops(s.positions) for s in batch)
        vision += sum(s.vision_flops for s in batch)
        real += sum(s.positions for s in batch)
        positions_total += len(batch) * width
        images_total += images
    heaviest, patches = _heaviest([[s] for s in samples])
    return RowLayout(
        name="padded",
        samples=len(samples),
        rows=len(samples),
        micro_batch=micro_batch,
        sequence_length=sequence_length,
        max_positions=worst[0],
        max_ids=worst[1],
        max_images=worst[2],
        images=images_total,
        real_positions=real,
        computed_positions=positions_total,
        computed_flops=computed + vision,
        useful_flops=useful + vision,
        vision_flops=vision,
        truncated=cut,
        max_visual_inputs=heaviest,
        max_visual_patches=patches,
    )


def first_fit_rows(
    sizes: Sequence[int], row_length: int, open_rows: int = OPEN_ROWS
) -> list[list[int]]:
    """Sample indices per row, placed first-fit over a window of `open_rows` open rows, rows
    emitted when full or pushed out of the window (data/stream/packing.py's `pack_rows` rule)."""
    window: list[list] = []  # [free, members]
    rows: list[list[int]] = []
    for index, size in enumerate(sizes):
        if size > row_length:
            raise ValueError(
                f"sample {index} takes {size} positions, more than a row's {row_length}"
            )
        row = next((r for r in window if r[0] >= size), None)
        if row is None:
            if len(window) == open_rows:
                rows.append(window.pop(0)[1])
            row = [row_length, []]
            window.append(row)
        row[1].append(index)
        row[0] -= size
        if row[0] == 0:
            window.remove(row)
            rows.append(row[1])
    rows += [r[1] for r in window]
    return rows


def packed_layout(
    spec: ModelSpec,
    lengths: Lengths,
    sequence_length: int,
    micro_batch: int,
    seed: int = 0,
    open_rows: int = OPEN_ROWS,
) -> RowLayout:
    """Rows of `sequence_length` positions packed first-fit (module docstring)."""
    _check(sequence_length, micro_batch)
    samples, cut = _truncated(_shuffled(spec, lengths, seed), sequence_length)
    whole = [s.positions for s in samples if s.positions > sequence_length]
    if whole:  # truncation kept their images and clips whole: no packed row holds them
        raise FieldError(
            "--sequence-length",
            f"{len(whole)} sample(s) hold more image / clip tokens than a row of "
            f"{sequence_length} positions (the largest needs {max(whole)}); the loader refuses "
            "them (image_cut, video_cut): give a longer --sequence-length, or a smaller "
            "--budget for a native-resolution VLM",
        )
    rows = [
        [samples[i] for i in members]
        for members in first_fit_rows([s.positions for s in samples], sequence_length, open_rows)
    ]
    lm = spec.decoder
    row_ids = [sum(s.ids for s in row) for row in rows]
    row_images = [sum(s.images for s in row) for row in rows]
    max_ids = max_images = 0
    for start in range(0, len(rows), micro_batch):
        # the collate pads the ids of a micro-batch's rows to the longest (placeholder space)
        max_ids = max(max_ids, max(row_ids[start : start + micro_batch]))
        max_images = max(max_images, sum(row_images[start : start + micro_batch]))
    images_total = sum(row_images)
    vision = sum(s.vision_flops for s in samples)
    real = sum(s.positions for s in samples)
    heaviest, patches = _heaviest(rows)
    return RowLayout(
        name="packed",
        samples=len(samples),
        rows=len(rows),
        micro_batch=micro_batch,
        sequence_length=sequence_length,
        max_positions=sequence_length,
        max_ids=max_ids,
        max_images=max_images,
        images=images_total,
        real_positions=real,
        computed_positions=len(rows) * sequence_length,
        computed_flops=len(rows) * lm.forward_flops(sequence_length) + vision,
        useful_flops=sum(lm.forward_flops(s.positions) for s in samples) + vision,
        vision_flops=vision,
        truncated=cut,
        max_visual_inputs=heaviest,
        max_visual_patches=patches,
    )


def _check(sequence_length: int, micro_batch: int) -> None:
    if sequence_length < 2:
        raise FieldError("--sequence-length", f"must be at least 2, got {sequence_length}")
    if micro_batch < 1:
        raise FieldError("--micro-batch", f"must be at least 1, got {micro_batch}")
