"""Where the ids of a vision-language batch land among the LM's positions, and the splice of
the image tokens into the text embeddings (models/vlm.py's batch contract).

A row of ids ("placeholder space") holds each image as ONE placeholder id; in the LM an image
takes its tokens' positions ("position space"): P for every image of a LLaVA tower, or each
image's own count for a native-resolution one. Each id owns a span of positions (`id_spans`),
`make_layout` says which id every position belongs to, and `splice` gathers the embeddings of
every position in one indexing op from [text embeddings; image tokens; a zero row for
padding]. Pure index computations on the device: nothing is read back but the expanded
length (a shape), which the loader's workers can give (`splice_sizes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mmtrain.models.token_loss import IGNORE_INDEX

PAD_DOCUMENT = -1  # data/stream/packing.py's document id of padding (models do not import data/)


@dataclass(frozen=True)
class Layout:
    """Where the ids of a batch [R, T] land among the LM's positions [R, L].

    Id t of row r owns positions `ends[r, t] - span + 1 .. ends[r, t]`. Position e of row r
    belongs to id `owner[r, e]` at `offset[r, e]` within its span; `valid` is False for the
    padding that makes every row L long (after a row's ids, or before them when the rows are
    right-aligned for generation, so that they all end at position L - 1).
    """

    ends: Tensor  # [R, T] last position of each id
    owner: Tensor  # [R, L] the id a position belongs to (clamped into 0..T-1 for padding)
    offset: Tensor  # [R, L] index of a position within its id's span (0 for a text id)
    valid: Tensor  # [R, L] False for padding
    # The ids' own key mask ("attention_mask") is False only after each row's real ids (right
    # padding; True without a mask) and the rows are left-aligned: see `_position_inputs`.
    right_padded: bool = False
    images: int = 0  # placeholders that take an image

    @property
    def length(self) -> int:
        return self.owner.shape[1]


def valid_ids(
    text: Tensor, attention_mask: Tensor | None = None, document_ids: Tensor | None = None
) -> Tensor:
    """Bool [R, T]: the ids that are not padding (masked keys, or the padding document)."""
    valid = torch.ones_like(text, dtype=torch.bool)
    if attention_mask is not None:
        valid &= attention_mask.bool()
    if document_ids is not None:
        valid &= document_ids != PAD_DOCUMENT
    return valid


def image_placeholders(
    text: Tensor,
    image_token_id: int | None,
    attention_mask: Tensor | None = None,
    document_ids: Tensor | None = None,
) -> Tensor:
    """Bool [R, T]: the ids of `text` that take an image (the placeholders not in padding)."""
    if image_token_id is None:
        return torch.zeros_like(text, dtype=torch.bool)
    return (text == image_token_id) & valid_ids(text, attention_mask, document_ids)


def id_spans(
    is_image: Tensor, image_tokens: int | Tensor, placeholders: int | None = None
) -> Tensor:
    """Positions [R, T] each id takes: 1 for text, an image's tokens for a placeholder.
    `image_tokens`: one count for every image, or int64 [N] per image in reading order
    (row-major: a native-resolution tower gives each image the tokens of its own size).
    `placeholders`: how many ids are images, when the host knows it (else read to check N)."""
    if isinstance(image_tokens, int):
        return torch.where(is_image, image_tokens, 1)
    if placeholders is None:
        placeholders = int(is_image.sum())
    if image_tokens.numel() != placeholders:
        raise ValueError(
            f"{image_tokens.numel()} image token counts for {placeholders} placeholders"
        )
    ones = torch.ones(is_image.shape, dtype=torch.long, device=is_image.device)
    return ones.masked_scatter(is_image, image_tokens.to(ones.device, torch.long))


def splice_sizes(
    is_image: Tensor, image_tokens: int | Tensor, key_mask: Tensor | None = None
) -> tuple[int, int, int]:
    """(length of the expanded rows, 1 if the padding is on the right, images): the shapes a
    layout needs, in one read of `is_image`'s device (none when it is the host's)."""
    totals = id_spans(is_image, image_tokens).sum(dim=1)
    trailing = totals.new_ones(())  # no real id after a padding one
    if key_mask is not None:
        key_mask = key_mask.bool()
        trailing = (key_mask[:, 1:] & ~key_mask[:, :-1]).any().logical_not().long()
    length, right_padded, images = torch.stack([totals.max(), trailing, is_image.sum()]).tolist()
    return length, right_padded, images


def make_layout(
    is_image: Tensor,
    image_tokens: int | Tensor,
    right_align: bool = False,
    key_mask: Tensor | None = None,
    sizes: tuple[int, int, int] | None = None,
) -> Layout:
    """The layout of rows whose ids are images where `is_image` [R, T] (bool) is True, each
    image taking `image_tokens` positions (`id_spans`); `key_mask` [R, T] (False: padding ids)
    only sets `Layout.right_padded`. `sizes`: what `splice_sizes` returns, when the host knows
    it already; else it is read from the device (the expanded length is a shape)."""
    length, right_padded, images = sizes or splice_sizes(is_image, image_tokens, key_mask)
    spans = id_spans(is_image, image_tokens, images)
    ends = spans.cumsum(dim=1) - 1
    totals = ends[:, -1] + 1
    shift = length - totals if right_align else torch.zeros_like(totals)
    e = torch.arange(length, device=is_image.device)[None, :] - shift[:, None]
    valid = (e >= 0) & (e < totals[:, None])
    e = e.clamp(min=0)
    # ends is strictly increasing along a row: the owner of position e is the first id whose
    # span ends at or after e.
    owner = torch.searchsorted(ends, e).clamp(max=is_image.shape[1] - 1)
    starts = (ends - spans + 1).gather(1, owner)
    return Layout(
        ends=ends + shift[:, None],
        owner=owner,
        offset=e - starts,
        valid=valid,
        right_padded=bool(right_padded) and not right_align,
        images=images,
    )


def splice(
    text_embeds: Tensor,
    image_embeds: Tensor,
    is_image: Tensor,
    layout: Layout,
    image_starts: Tensor | None = None,
) -> Tensor:
    """The LM's input embeddings [R, L, W]: each text id's embedding at its position, the
    tokens of the k-th image (reading order) at the k-th placeholder's span, zeros for padding.
    `image_embeds`: [N, P, W] (P tokens each), or every image's tokens one after another
    [sum of tokens, W] with `image_starts` [N], the row where image k's begin.

    One gather from the stacked sources, so autograd scatters the gradient back to the text
    embeddings and to the image tokens, even when there are none (the distributed rule in
    `LanguageModel._image_embeds`).
    """
    r, t, w = text_embeds.shape
    if image_starts is None:  # P tokens each
        n, p = image_embeds.shape[:2]
        image_starts = torch.arange(n, device=is_image.device) * p
        image_embeds = image_embeds.reshape(n * p, w)
    # The k-th placeholder in reading order (row-major) takes image k.
    slot = is_image.flatten().long().cumsum(0).view(r, t) - 1
    rows = torch.arange(r, device=is_image.device)[:, None]
    text_index = rows * t + layout.owner
    # (a trailing 0 keeps the lookup valid for text ids, and for rows with no image at all)
    starts = F.pad(image_starts.to(is_image.device), (0, 1))
    first = starts[slot.gather(1, layout.owner).clamp(min=0)]
    image_index = r * t + first + layout.offset
    index = torch.where(is_image.gather(1, layout.owner), image_index, text_index)
    index = torch.where(layout.valid, index, r * t + image_embeds.shape[0])  # the zero row
    sources = torch.cat(
        [
            text_embeds.reshape(r * t, w),
            image_embeds.to(text_embeds.dtype),
            text_embeds.new_zeros(1, w),
        ]
    )
    return sources[index]


def expand_per_id(values: Tensor, layout: Layout, fill: int | bool) -> Tensor:
    """A per-id tensor [R, T] repeated over each id's span [R, L]; `fill` at padding."""
    return torch.where(layout.valid, values.gather(1, layout.owner), fill)


def position_targets(labels: Tensor, layout: Layout) -> Tensor:
    """The next-token target of every position [R, L]: label t + 1 at the last position of id
    t (the position whose state predicts the next id, as `LanguageModel.nll_sum` scores it),
    -100 elsewhere (an image's other positions, the last id, padding). Each id's last position
    is its own (`ends` increases along a row), so no two labels land on one position."""
    targets = labels.new_full(layout.owner.shape, IGNORE_INDEX)
    return targets.scatter(1, layout.ends[:, :-1], labels[:, 1:])
