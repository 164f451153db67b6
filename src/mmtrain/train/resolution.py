"""Progressive resolution: train early steps on smaller images (and fewer video frames).

Smaller inputs mean fewer tokens, so early steps are cheap; the model learns coarse features
first and finishes at full size (as FLIP/"progressive resizing" recipes do). The model spec, and
so every parameter shape, stays at the full size: only the data transforms change size, and the
stems interpolate their learned position embeddings to the token grid they are given —
bicubic over the 2-D patch grid (images, video frames), linear over time (video tubelets). The
class token's position is kept as is. The interpolation is differentiable, so the full-size
embeddings are what is trained.

Schedules are `[[from_step, value], ...]` (`train.resolution_schedule`, `train.frames_schedule`):
optimizer step `s` (0-based) uses the value of the last entry with `from_step <= s`, and the
spec's full size before the first entry. Being a pure function of the step, a resumed run uses
the same size at the same step.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mmtrain.spec import ImageStem, ModelSpec, VideoStem, with_tower
from mmtrain.structured import FieldError


def value_at(schedule: Sequence[tuple[int, int]], step: int) -> int | None:
    """The scheduled value at 0-based optimizer step `step`, or None before the first entry."""
    current = None
    for start, value in schedule:
        if start <= step:
            current = value
    return current


def spec_at(
    spec: ModelSpec,
    step: int,
    resolution: Sequence[tuple[int, int]],
    frames: Sequence[tuple[int, int]],
) -> ModelSpec:
    """`spec` with the image size and frame count of step `step` (the data transforms' sizes)."""
    size, count = value_at(resolution, step), value_at(frames, step)
    for name, tower in spec.towers.items():
        stem = tower.stem
        changes = {}
        if size is not None and isinstance(stem, (ImageStem, VideoStem)):
            changes["image_size"] = size
        if count is not None and isinstance(stem, VideoStem):
            changes["frames"] = count
        if changes:
            spec = with_tower(spec, name, stem=changes)
    return spec


def check_schedules(
    spec: ModelSpec, resolution: Sequence[tuple[int, int]], frames: Sequence[tuple[int, int]]
) -> None:
    """Raise FieldError naming the schedule entry a tower of `spec` cannot use."""
    stems = {n: t.stem for n, t in spec.towers.items()}
    pixels = {n: s for n, s in stems.items() if isinstance(s, (ImageStem, VideoStem))}
    videos = {n: s for n, s in stems.items() if isinstance(s, VideoStem)}
    if resolution and not pixels:
        raise FieldError("train.resolution_schedule", "the model has no image or video tower")
    if frames and not videos:
        raise FieldError("train.frames_schedule", "the model has no video tower")
    for i, (_, size) in enumerate(resolution):
        for name, stem in pixels.items():
            if size < stem.patch_size:
                raise FieldError(
                    f"train.resolution_schedule[{i}]",
                    f"{size} px is smaller than tower {name!r}'s patch ({stem.patch_size})",
                )
    for i, (_, count) in enumerate(frames):
        for name, stem in videos.items():
            if count % stem.tubelet:
                raise FieldError(
                    f"train.frames_schedule[{i}]",
                    f"{count} frames: tower {name!r} needs a multiple of its tubelet {stem.tubelet}",
                )


# ----------------------------------------------------------------------------- interpolation
def resize_grid(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """Position embeddings of a square grid [g*g, width] -> [grid*grid, width], bicubic
    (antialiased when shrinking, so a smaller grid averages instead of skipping positions)."""
    old = math.isqrt(pos.shape[0])
    if old == grid:
        return pos
    image = pos.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    out = F.interpolate(
        image, size=(grid, grid), mode="bicubic", align_corners=False, antialias=grid < old
    )
    return out.permute(0, 2, 3, 1).reshape(grid * grid, -1).to(pos.dtype)


def resize_pos_embed(pos: torch.Tensor, grid: int, prefix: int) -> torch.Tensor:
    """[prefix + g*g, width] -> [prefix + grid*grid, width]: the grid part as `resize_grid`
    does, the `prefix` rows (a class token's position) kept as they are."""
    if math.isqrt(pos.shape[0] - prefix) ** 2 != pos.shape[0] - prefix:
        raise ValueError(f"{pos.shape[0]} - {prefix} position rows are not a square grid")
    return torch.cat([pos[:prefix], resize_grid(pos[prefix:], grid)])


def resize_time(pos: torch.Tensor, steps: int) -> torch.Tensor:
    """Temporal position embeddings [T, width] -> [steps, width], linear."""
    if pos.shape[0] == steps:
        return pos
    line = pos.t().unsqueeze(0).float()  # [1, width, T]
    out = F.interpolate(line, size=steps, mode="linear", align_corners=False)
    return out[0].t().to(pos.dtype)


def _image_forward(stem: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """ImagePatchStem.forward for any square size: the grid follows the input."""
    if x.shape[-1] == stem.spec.image_size and x.shape[-2] == stem.spec.image_size:
        return stem._full_size_forward(x)
    if x.dim() != 4 or x.shape[1] != stem.spec.channels or x.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"image input must be [B, {stem.spec.channels}, S, S], got {list(x.shape)}"
        )
    x = x.to(stem.patch_embed.weight.dtype)
    tokens = stem.patch_embed(x).flatten(2).transpose(1, 2)
    grid = x.shape[-1] // stem.spec.patch_size
    pos = resize_pos_embed(stem.pos_embed, grid, 1 if stem.cls_token is not None else 0)
    return stem._prepend_cls(tokens) + pos.to(tokens.dtype)


def _video_forward(stem: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """VideoStem.forward for any frame count (a multiple of the tubelet) and square size."""
    s = stem.spec
    if x.dim() == 5 and x.shape[1] == s.frames and x.shape[-1] == s.image_size:
        return stem._full_size_forward(x)
    if x.dim() != 5 or x.shape[2] != s.channels or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"video input must be [B, T, {s.channels}, S, S], got {list(x.shape)}")
    x = x.transpose(1, 2).to(stem.patch_embed.weight.dtype)
    tokens = stem.patch_embed(x).flatten(2).transpose(1, 2)
    spatial = resize_grid(stem.pos_spatial, x.shape[-1] // s.patch_size)
    temporal = resize_time(stem.pos_temporal, x.shape[2] // s.tubelet)
    pos = temporal[:, None, :] + spatial[None, :, :]
    return stem._prepend_cls(tokens + pos.flatten(0, 1).to(tokens.dtype))


def allow_any_resolution(model: nn.Module) -> nn.Module:
    """Let the image and video stems of `model` take smaller or larger inputs than the spec's,
    interpolating their position embeddings; full-size inputs run the original code unchanged.

    Like activation checkpointing, this sets `forward` on the stem instances, so parameter names
    and checkpoints stay the same. Idempotent.
    """
    from mmtrain.models.stems import ImagePatchStem, VideoStem

    for tower in model.towers.values():
        stem = tower.stem
        if hasattr(stem, "_full_size_forward"):
            continue
        if isinstance(stem, ImagePatchStem):
            stem._full_size_forward = stem.forward
            stem.forward = types.MethodType(_image_forward, stem)
        elif isinstance(stem, VideoStem):
            stem._full_size_forward = stem.forward
            stem.forward = types.MethodType(_video_forward, stem)
    return model
