"""Where a native-resolution VLM's images and clips go in its text, and their 3-D positions.

The Qwen2-VL family reads each image and clip at its own size: input k gives `tokens[k]`
tokens (its merged patch grid t x h x w, `grid[k]`), so placeholders take spans of their own
length (models/vlm.py `id_spans`). The batch holds the images and the clips as two lists, in
the order of their placeholders (`image_token_id` once per image, `video_token_id` once per
clip); the tower encodes the images first, then the clips, and `visual_order` says which of
its inputs each placeholder takes, in reading order (row 0 left to right, then row 1, ...).

Positions are M-RoPE's (time, height, width) per position, computed from the layout in one
pass on the device, no loop over rows (`multimodal_positions`; models/mrope.py is the same
rule walked row by row on the host, held to transformers' `get_rope_index` in
tests/test_mrope.py, and this one to it). A text id's three positions are equal and count on
by one; an input's tokens start at the position the placeholder would have had as text
(`start`), token (i, j) of time step f at (start + floor(f x interval), start + i, start + j)
with `interval` 1 for an image and, for a Qwen2.5-VL clip, its seconds per temporal patch x
`tokens_per_second`, in float32; the text after it continues one past the largest position
it took ("qwen"), or at start + max(h, w) merged, its time left out, as transformers'
`get_rope_index` since 5.3 ("transformers"; mrope.py says more). Packed rows restart the count
at each document; ids in padding advance nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mmtrain.models.host_copy import to_device
from mmtrain.models.native_vision import NativeVisionTower
from mmtrain.models.splice import Layout, make_layout, splice
from mmtrain.spec import VisionTokens

IMAGES, VIDEOS = "image", "video"  # batch keys: lists of [3, H, W] / [T, 3, H, W] tensors
VIDEO_FPS = "video_fps"  # per clip, the frame rate its frames were sampled at (Qwen2.5-VL time)
# Host lists: for each image / clip placeholder in reading order, the batch's input it takes,
# where samples share inputs (a preference pair's two sides: each input encoded once). Absent,
# placeholder k takes input k.
IMAGE_SOURCES, VIDEO_SOURCES = "image_sources", "video_sources"
DEFAULT_VIDEO_FPS = 2.0  # Qwen2.5-VL's processor default


@dataclass(frozen=True)
class VisualSplice:
    """A native VLM's LM inputs: the embeddings [R, L, W], their layout and 3-D positions."""

    embeds: Tensor
    layout: Layout
    positions: Tensor  # int64 [3, R, L]


def splice_visual_inputs(
    tower: NativeVisionTower,
    tokens: VisionTokens,
    text_embeds: Tensor,
    batch: Mapping[str, object],
    valid_ids: Tensor,
    *,
    right_align: bool = False,
    key_mask: Tensor | None = None,
    sizes: tuple[int, int, int] | None = None,
    document_ids: Tensor | None = None,
) -> VisualSplice:
    """Encode the batch's images and clips at their own sizes and splice each at its
    placeholder (`valid_ids`: False for ids in padding); an input several placeholders take
    (IMAGE_SOURCES, VIDEO_SOURCES) is encoded once."""
    distinct = [*(batch.get(IMAGES) or []), *(batch.get(VIDEOS) or [])]
    images, videos, fps, sources = placeholder_inputs(batch)
    text = batch["text"]
    _check_counts(text, tokens, valid_ids, len(images), len(videos), sizes)
    is_visual, order = visual_order(
        text, tokens.image_token_id, tokens.video_token_id, valid_ids, len(images),
        inputs=len(images) + len(videos),
    )  # fmt: skip
    spec, device = tower.spec, text.device
    grids = [spec.grid(x.shape[-2], x.shape[-1], 1 if x.dim() == 3 else x.shape[0])
             for x in (*images, *videos)]  # fmt: skip
    # The merged grids are the inputs' shapes, known on the host: one asynchronous copy.
    merged = torch.tensor(
        [(t, h // spec.merge_size, w // spec.merge_size) for t, h, w in grids], dtype=torch.long
    ).reshape(-1, 3)
    merged = to_device(merged, device)
    counts = merged.prod(dim=1)
    starts = (counts.cumsum(0) - counts)[order]
    layout = make_layout(is_visual, counts[order], right_align, key_mask, sizes)
    features = _features(tower, distinct)
    if sources is not None:
        each = [spec.tokens(x.shape[-2], x.shape[-1], 1 if x.dim() == 3 else x.shape[0])
                for x in distinct]  # fmt: skip
        features = _taken(features, sources, each)
    embeds = splice(text_embeds, features, is_visual, layout, starts)
    if not grids:  # the tower ran on a stand-in: its zero contribution keeps it in the graph
        embeds = embeds + 0 * features.sum()
    intervals = _intervals(tokens, spec.temporal_patch, len(images), fps, videos)
    positions = multimodal_positions(
        layout, is_visual, merged[order], to_device(intervals, device)[order], valid_ids,
        document_ids, text_after=tokens.text_after,
    )  # fmt: skip
    return VisualSplice(embeds, layout, positions)


def placeholder_inputs(
    batch: Mapping[str, object],
) -> tuple[list[Tensor], list[Tensor], list[float] | None, list[int] | None]:
    """(images, clips, the clips' fps) each placeholder takes, in reading order, and for each
    of them (images first) its index among the batch's distinct inputs (None: one each)."""
    images, videos = list(batch.get(IMAGES) or []), list(batch.get(VIDEOS) or [])
    fps = batch.get(VIDEO_FPS)
    image_sources, video_sources = batch.get(IMAGE_SOURCES), batch.get(VIDEO_SOURCES)
    if image_sources is None and video_sources is None:
        return images, videos, fps, None
    image_sources, video_sources = list(image_sources or []), list(video_sources or [])
    sources = [*image_sources, *(len(images) + i for i in video_sources)]
    taken_fps = None if fps is None else [fps[i] for i in video_sources]
    return [images[i] for i in image_sources], [videos[i] for i in video_sources], taken_fps, sources


def _taken(features: Tensor, sources: Sequence[int], counts: Sequence[int]) -> Tensor:
    """The token rows of `features` (the distinct inputs', `counts` tokens each, one after
    another) that each taking placeholder gets, in order; gradients add up over the takers."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    pieces = [torch.arange(starts[i], starts[i + 1]) for i in sources]
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return features.index_select(0, to_device(index, features.device))


def _check_counts(
    text: Tensor,
    tokens: VisionTokens,
    valid: Tensor,
    images: int,
    videos: int,
    sizes: tuple[int, int, int] | None = None,
) -> None:
    """Placeholders against the inputs given: with the loader's `sizes` (its placeholder count,
    both kinds) on the host; else each kind's, in one read of the device."""
    if sizes is not None:
        if sizes[2] != images + videos:
            raise ValueError(
                f"the rows hold {sizes[2]} image and video placeholders (splice_sizes) but the "
                f"batch has {images} image(s) under {IMAGES!r} and {videos} clip(s) under "
                f"{VIDEOS!r}: each needs exactly one placeholder, in reading order"
            )
        return
    found = torch.stack(
        [
            ((text == tokens.image_token_id) & valid).sum(),
            ((text == tokens.video_token_id) & valid).sum(),
        ]
    ).tolist()
    for kind, placeholders, given, token in (("image", found[0], images, tokens.image_token_id),
                                             ("video", found[1], videos, tokens.video_token_id)):  # fmt: skip
        if placeholders != given:
            raise ValueError(
                f"the text holds {placeholders} {kind} placeholder(s) (id {token}) but the "
                f"batch has {given} {kind}(s) under {kind!r}: each needs exactly one "
                "placeholder, in reading order"
            )


def _features(tower: NativeVisionTower, inputs: Sequence[Tensor]) -> Tensor:
    """[sum of tokens, out_width] of the inputs, images first; with none, one token of a
    blank stand-in image: under FSDP2 every rank must run the same sharded modules, and DDP
    waits for a gradient of every trained parameter (the splice adds it times 0)."""
    if not inputs:
        unit = tower.spec.merge_unit_pixels()
        weight = tower.patch_embed.weight
        inputs = [weight.new_zeros(tower.spec.in_channels, unit, unit)]
    patches, grid = tower.patchify(inputs)
    return tower(patches, grid)


def _intervals(
    tokens: VisionTokens, temporal_patch: int, images: int, fps: object, videos: Sequence[Tensor]
) -> Tensor:
    """float32 [images + clips]: each input's time step in positions (1 for an image; a clip's
    seconds per temporal patch x tokens_per_second for Qwen2.5-VL, else 1)."""
    steps = [1.0] * (images + len(videos))
    if tokens.tokens_per_second is not None and videos:
        rates = list(fps) if fps is not None else [DEFAULT_VIDEO_FPS] * len(videos)
        if len(rates) != len(videos):
            raise ValueError(f"{VIDEO_FPS!r}: {len(rates)} rates for {len(videos)} clips")
        seconds = torch.tensor([temporal_patch / float(r) for r in rates], dtype=torch.float32)
        steps[images:] = (seconds * tokens.tokens_per_second).tolist()
    return torch.tensor(steps, dtype=torch.float32)


def visual_order(
    text: Tensor,
    image_token_id: int,
    video_token_id: int,
    valid: Tensor,
    images: int,
    inputs: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(is_visual [R, T], input [N]): the placeholders that take an input (`valid`: not in
    padding), and for the k-th of them in reading order the index of its input among the
    tower's (the images 0 .. images - 1, then the clips). `inputs`: N when the host knows it
    (the images and clips given): the inputs are then scattered to their slots, with no
    boolean mask whose size the device would have to report."""
    is_image = (text == image_token_id) & valid
    is_video = (text == video_token_id) & valid
    image_rank = is_image.flatten().long().cumsum(0) - 1
    video_rank = is_video.flatten().long().cumsum(0) - 1 + images
    is_visual = is_image | is_video
    index = torch.where(is_image.flatten(), image_rank, video_rank)
    if inputs is None:
        return is_visual, index[is_visual.flatten()]
    flat = is_visual.flatten()
    slot = torch.where(flat, flat.long().cumsum(0) - 1, inputs)  # the rest: a discarded slot
    order = index.new_zeros(inputs + 1).scatter(0, slot, index)
    return is_visual, order[:inputs]


def multimodal_positions(
    layout: Layout,
    is_visual: Tensor,
    grids: Tensor,
    intervals: Tensor,
    valid_ids: Tensor,
    document_ids: Tensor | None = None,
    text_after: str = "qwen",
) -> Tensor:
    """int64 [3, R, L]: the (time, height, width) position of every position of the layout.
    `grids` [N, 3] are the merged grids (t, h, w) of the placeholders' inputs in reading order,
    `intervals` [N] float32 their time step (1 for an image); `valid_ids` [R, T] False for
    ids in padding; `document_ids` [R, T] restart the positions per packed document;
    `text_after` the rule the text after an input follows (VisionTokens.text_after)."""
    r, t = is_visual.shape
    device = is_visual.device
    slot = (is_visual.flatten().long().cumsum(0) - 1).clamp(min=0).view(r, t)
    grids = torch.cat([grids.to(device).long(), grids.new_ones(1, 3).to(device)])  # text: 1x1x1
    slot = torch.where(is_visual, slot, grids.shape[0] - 1)
    grid = grids[slot]  # [R, T, 3]
    step = torch.cat([intervals.to(device, torch.float32), intervals.new_ones(1).to(device)])
    step = step[slot]  # [R, T] each id's time interval (1 for text)
    extent = grid[..., 1:].amax(dim=-1)  # an input's rows or columns, its time left out
    if text_after == "qwen":  # or one past its last time position, where that is further
        last_time = ((grid[..., 0] - 1) * step).long()  # float32, truncated: as Qwen quantises
        extent = torch.maximum(last_time + 1, extent)
    advance = torch.where(is_visual, extent, 1) * valid_ids
    start = advance.cumsum(dim=1) - advance  # exclusive: the count before each id
    if document_ids is not None:
        start = start - _document_base(start, document_ids)
    # every position of the layout: its id's start and grid, and its place in the grid
    owner, offset = layout.owner, layout.offset
    base = start.gather(1, owner)
    h, w = grid[..., 1].gather(1, owner), grid[..., 2].gather(1, owner)
    frame, row, col = offset // (h * w), (offset // w) % h, offset % w
    time = (frame * step.gather(1, owner)).long()  # float32, truncated: as Qwen quantises
    positions = torch.stack([base + time, base + row, base + col])
    return torch.where(layout.valid, positions, 0)


def _document_base(start: Tensor, document_ids: Tensor) -> Tensor:
    """[R, T] the start of each id's document (its first id's count), to subtract."""
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    index = torch.arange(start.shape[1], device=start.device).expand_as(start)
    first_index = torch.where(first, index, 0).cummax(dim=1).values
    return start.gather(1, first_index)
