"""Multimodal rotary positions (M-RoPE) of the Qwen2-VL family: a (time, height, width)
position for every token of a row, for a decoder whose spec sets `mrope_section`.

Text tokens count up by one on all three axes, so a text-only row is 1-D RoPE. An image or a
video occupies `t * h * w / merge_size**2` consecutive placeholder tokens (its patch grid
(t, h, w) after the vision tower merged `merge_size` x `merge_size` patches), in (time, row,
column) order; its tokens take the position of their merged grid cell, offset on every axis by
the text position where it starts. Where the text after it continues is a rule of two kinds
(`VisionTokens.text_after`):
- "qwen" (the default): one past the largest position the image or clip took, on any axis:
  the rule the checkpoints were trained with (Qwen's reference code), which vLLM, SGLang and
  transformers up to 5.2 follow, and transformers' own next-token delta still does;
- "transformers": the start plus the larger of its merged rows and columns, its time left out:
  transformers' `get_rope_index` since 5.3 (the pinned 5.23), whose logits it equals.
For an image, and a clip whose time positions stay below its rows and columns, the two agree;
after a clip whose time reaches further (many steps, or Qwen2.5-VL's seconds-scaled time),
"transformers" puts the text on time positions the clip also took.

Time: Qwen2-VL numbers a video's temporal grid steps 0, 1, 2, ...; Qwen2.5-VL spaces them by
the seconds each step spans times `tokens_per_second` (so time positions measure seconds), the
product truncated to an integer as Qwen's reference does, in float32 like the float32
`second_per_grid_ts` tensor its processor makes. A still image has one time step either way.

Rows of a batch are independent; padding (an attention mask) takes no position (it holds 0), and
a packed row (document ids, see `models.decoder.document_positions`) restarts at every document.
A generator continues one past the prompt's largest position, on any axis (transformers'
`rope_deltas`, so past a clip's last time too): `models.decoder.next_positions`, or the per-row
delta `rope_index_batch` returns (next position = real tokens so far + delta).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

Grid = tuple[int, int, int]  # (t, h, w): temporal steps and patch rows / columns, before merging


class _Visuals:
    """The images and videos of a batch in the order their placeholders appear, consumed as
    the rows are walked; each video with its time step (None: Qwen2-VL's unscaled steps)."""

    def __init__(
        self,
        image_grids: Sequence[Sequence[int]],
        video_grids: Sequence[Sequence[int]],
        seconds_per_grid: Sequence[float] | None,
        tokens_per_second: float | None,
    ):
        if seconds_per_grid is not None:
            if tokens_per_second is None:
                raise ValueError(
                    "seconds_per_grid scales video time by tokens_per_second (Qwen2.5-VL); "
                    "give both or neither"
                )
            if len(seconds_per_grid) != len(video_grids):
                raise ValueError(
                    f"seconds_per_grid has {len(seconds_per_grid)} values for "
                    f"{len(video_grids)} videos"
                )
        steps: list[Tensor | None] = [None] * len(video_grids)
        if tokens_per_second is not None:
            seconds = [1.0] * len(video_grids) if seconds_per_grid is None else seconds_per_grid
            steps = [torch.tensor(s, dtype=torch.float32) * tokens_per_second for s in seconds]
        self.images: Iterator[tuple[Grid, None]] = iter([(tuple(g), None) for g in image_grids])
        self.videos: Iterator[tuple[Grid, Tensor | None]] = iter(
            zip([tuple(g) for g in video_grids], steps, strict=True)
        )
        self.counts = {"image": len(image_grids), "video": len(video_grids)}

    def next(self, kind: str, at: int) -> tuple[Grid, Tensor | None]:
        found = next(self.images if kind == "image" else self.videos, None)
        if found is None:
            raise ValueError(
                f"the {kind} placeholder at token {at} has no grid left: the ids hold more "
                f"{kind}s than the {self.counts[kind]} {kind} grids given"
            )
        return found

    def check_used(self) -> None:
        for kind, left in (("image", self.images), ("video", self.videos)):
            unused = sum(1 for _ in left)
            if unused:
                raise ValueError(
                    f"{unused} of the {self.counts[kind]} {kind} grids have no placeholder "
                    "tokens in the ids (were they truncated away?)"
                )


def grid_positions(grid: Grid, start: int, merge_size: int, time_step: Tensor | None) -> Tensor:
    """[3, t * h * w / merge_size**2] positions of one image or video's merged grid cells in
    (time, row, column) order, offset by `start`; time steps scaled by `time_step` and
    truncated when given."""
    t, h, w = grid
    if t <= 0 or h % merge_size or w % merge_size or h <= 0 or w <= 0:
        raise ValueError(
            f"grid (t, h, w) = {grid}: t must be positive and h, w positive multiples of "
            f"merge_size {merge_size}"
        )
    time = torch.arange(t)
    if time_step is not None:
        time = (time * time_step).long()  # float32 product, truncated: Qwen2.5-VL's reference
    rows, cols = torch.arange(h // merge_size), torch.arange(w // merge_size)
    cells = torch.meshgrid(time, rows, cols, indexing="ij")
    return torch.stack([axis.flatten() for axis in cells]) + start


def _positions(
    tokens: list[int],
    visuals: _Visuals,
    vision_ids: dict[int, str],
    merge_size: int,
    text_after: str = "qwen",
) -> Tensor:
    """[3, len(tokens)] positions of one document, consuming its grids from `visuals`;
    `text_after` the rule the text after an input follows (module docstring)."""
    pieces, start, i = [], 0, 0
    while i < len(tokens):
        kind = vision_ids.get(tokens[i])
        if kind is None:  # a text run, up to the next placeholder
            end = i + 1
            while end < len(tokens) and tokens[end] not in vision_ids:
                end += 1
            pieces.append(torch.arange(start, start + end - i).expand(3, -1))
            start += end - i
            i = end
            continue
        grid, time_step = visuals.next(kind, i)
        cells = grid_positions(grid, start, merge_size, time_step)
        count = cells.shape[1]
        if tokens[i : i + count] != [tokens[i]] * count:
            run = next((j for j in range(i, len(tokens)) if tokens[j] != tokens[i]), len(tokens))
            raise ValueError(
                f"the {kind} at token {i} has grid {grid}, {count} tokens after merging, but "
                f"{run - i} placeholder tokens"
            )
        pieces.append(cells)
        if text_after == "qwen":
            start = int(cells.max()) + 1  # past its furthest time, row or column
        else:
            start += max(grid[1], grid[2]) // merge_size  # its rows or columns; time left out
        i += count
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long)
    return torch.cat(pieces, dim=1)


def rope_index(
    ids: Tensor,
    image_grids: Sequence[Sequence[int]],
    video_grids: Sequence[Sequence[int]],
    *,
    image_token_id: int,
    video_token_id: int,
    merge_size: int,
    seconds_per_grid: Sequence[float] | None = None,
    tokens_per_second: float | None = None,
    text_after: str = "qwen",
) -> Tensor:
    """[3, T] M-RoPE positions of one row `ids` [T] whose images and videos are expanded to
    their placeholder tokens, `image_grids` / `video_grids` (t, h, w) in the order they appear.
    Qwen2.5-VL: `tokens_per_second` (its vision config's) and each video's
    `seconds_per_grid` (default 1.0). ValueError when placeholders and grids disagree."""
    visuals = _Visuals(image_grids, video_grids, seconds_per_grid, tokens_per_second)
    vision_ids = {image_token_id: "image", video_token_id: "video"}
    positions = _positions(ids.tolist(), visuals, vision_ids, merge_size, text_after)
    visuals.check_used()
    return positions.to(ids.device)


def rope_index_batch(
    ids: Tensor,
    image_grids: Sequence[Sequence[int]],
    video_grids: Sequence[Sequence[int]],
    *,
    image_token_id: int,
    video_token_id: int,
    merge_size: int,
    seconds_per_grid: Sequence[float] | None = None,
    tokens_per_second: float | None = None,
    attention_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
    text_after: str = "qwen",
) -> tuple[Tensor, Tensor]:
    """M-RoPE positions [3, B, T] of the rows `ids` [B, T], and each row's delta [B]: the next
    token's position minus the row's real tokens (a generator's next position is the tokens
    so far + delta, on every axis).

    Grids (and seconds) are those of the whole batch, row after row, as `rope_index` takes
    them for one row. `attention_mask` bool [B, T]: padding (False) takes no position and
    holds 0. `document_ids` [B, T]: positions restart at every document of a packed row (a new
    document wherever the id changes; its images must lie inside it)."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
    b, t = ids.shape
    visuals = _Visuals(image_grids, video_grids, seconds_per_grid, tokens_per_second)
    vision_ids = {image_token_id: "image", video_token_id: "video"}
    real = torch.ones(b, t, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    real = real.cpu()
    if document_ids is None:
        starts = torch.zeros(b, t, dtype=torch.bool)
    else:
        documents = document_ids.cpu()
        starts = F.pad(documents[:, 1:] != documents[:, :-1], (1, 0))
    positions = torch.zeros(3, b, t, dtype=torch.long)
    deltas = torch.zeros(b, dtype=torch.long)
    rows = ids.cpu().tolist()
    for row in range(b):
        kept = real[row].nonzero()[:, 0]
        # a document starts wherever the id changes (document_positions' rule), padding aside
        new_document = starts[row, kept].tolist()
        bounds = [i for i, new in enumerate(new_document) if new or i == 0] + [len(kept)]
        tokens = [rows[row][j] for j in kept.tolist()]
        next_position = 0
        for first, end in zip(bounds[:-1], bounds[1:], strict=True):
            document = _positions(tokens[first:end], visuals, vision_ids, merge_size, text_after)
            positions[:, row, kept[first:end]] = document
            next_position = int(document.max()) + 1 if document.numel() else 0
        deltas[row] = next_position - len(kept)
    visuals.check_used()
    return positions.to(ids.device), deltas.to(ids.device)
