"""How many LM tokens a native-resolution VLM's images and clips become: one rule for the
loader, the planner and `data inspect` (torch-free, like spec.py).

The Qwen2-VL family reads each input at its own size, so a page's or a clip's tokens follow
from its size and a pixel budget:

- an image is resized by the processor's rule (`NativeVisionSpec.resized`) within
  [image_min_tokens, image_max_tokens] LM tokens (one token = merge_unit_pixels^2 pixels);
- a clip's frames are counted and sized by the video processor's rule (`frame_count`,
  `frame_size`: fps within min/max frames, whole temporal patches, each frame within its own
  budget, the clip within `max_video_tokens`);
- `sample_max_tokens` caps all images and clips of one sample together: when their tokens at
  the per-input budgets exceed it, every input's per-frame cap shrinks by the same factor
  (sample_max / total, in whole tokens), so large pages stay the larger ones. Sizes are
  floored by the resize, so the shrunk inputs fit; when that would take an input below its
  minimum (image_min_tokens, or a frame's minimum), or the minimums alone do not fit,
  `BudgetExceeded` says so and the loader refuses that sample (it never cuts an input, and
  never trains on a page too small to read).

Everything is a function of the inputs' header sizes and the settings, the same on every
worker, after every resume and in the planner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mmtrain.config import VisionDataConfig
from mmtrain.native_vision_spec import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, NativeVisionSpec

__all__ = [
    "FrameRule",
    "ImageSize",
    "ClipSize",
    "Shape",
    "VisualBudget",
    "BudgetExceeded",
    "budget_of",
    "frame_count",
    "frame_size",
]

DEFAULT_FPS = 2.0  # Qwen2-VL's processors sample two frames a second
MIN_FRAMES, MAX_FRAMES = 4, 768  # transformers' Qwen2VLVideoProcessor defaults
TOKEN_SHARE = 0.9  # transformers: 90 % of max_video_tokens go to the frames' patches


class BudgetExceeded(ValueError):
    """A sample whose inputs cannot fit `sample_max_tokens` even at their minimum size."""


@dataclass(frozen=True)
class FrameRule:
    fps: float = DEFAULT_FPS
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS  # per frame
    max_pixels: int = VIDEO_MAX_PIXELS  # per frame
    max_video_tokens: int | None = None  # a budget for the whole clip (None: per frame only)


@dataclass(frozen=True)
class ImageSize:
    """An image as its header gives it."""

    height: int
    width: int


@dataclass(frozen=True)
class ClipSize:
    """A clip as its header gives it: frames, frame rate and frame size."""

    frames: int
    fps: float
    height: int
    width: int


@dataclass(frozen=True)
class Shape:
    """An input at the tower's size: frames 1 for an image, sides multiples of the merge unit."""

    frames: int
    height: int
    width: int

    def tokens(self, spec: NativeVisionSpec) -> int:
        return spec.tokens(self.height, self.width, self.frames)


def frame_count(total: int, source_fps: float, rule: FrameRule, temporal_patch: int) -> int:
    """Frames to sample of a clip of `total` frames at `source_fps`; ValueError when it holds
    fewer than one temporal patch."""
    if total < temporal_patch:
        raise ValueError(f"a clip of {total} frames is shorter than a temporal patch "
                         f"({temporal_patch} frames)")  # fmt: skip
    ceiling = math.floor(min(rule.max_frames, total) / temporal_patch) * temporal_patch
    wanted = total / source_fps * rule.fps
    wanted = min(max(wanted, rule.min_frames), ceiling, total)
    return math.floor(wanted / temporal_patch) * temporal_patch


def frame_size(
    height: int, width: int, frames: int, rule: FrameRule, spec: NativeVisionSpec
) -> tuple[int, int]:
    """(height, width) each sampled frame is resized to."""
    cap = rule.max_pixels
    if rule.max_video_tokens is not None:
        unit = spec.merge_unit_pixels()
        total_pixels = int(rule.max_video_tokens * unit * unit * TOKEN_SHARE)
        share = total_pixels * spec.temporal_patch // frames
        cap = max(min(cap, share), int(rule.min_pixels * 1.05))
    return spec.resized(height, width, min_pixels=rule.min_pixels, max_pixels=cap)


@dataclass(frozen=True)
class VisualBudget:
    """The pixel budget of one run's images and clips (`data.vision`), in pixels per frame."""

    spec: NativeVisionSpec
    image_min_pixels: int
    image_max_pixels: int
    frames: FrameRule = FrameRule()
    sample_max_tokens: int | None = None

    @classmethod
    def from_tokens(
        cls,
        spec: NativeVisionSpec,
        *,
        image_min_tokens: int | None = None,
        image_max_tokens: int | None = None,
        sample_max_tokens: int | None = None,
        frames: FrameRule | None = None,
    ) -> VisualBudget:
        """Token limits (None: the spec's own pixel budget) as the pixels they allow."""
        unit = spec.merge_unit_pixels() ** 2
        low = spec.min_pixels if image_min_tokens is None else image_min_tokens * unit
        high = spec.max_pixels if image_max_tokens is None else image_max_tokens * unit
        return cls(spec, low, high, frames or FrameRule(), sample_max_tokens)

    def shapes(self, inputs: Sequence[ImageSize | ClipSize]) -> list[Shape]:
        """Each input's size at the tower, within the per-input and the per-sample budget."""
        shapes = [self._shape(item) for item in inputs]
        total = sum(shape.tokens(self.spec) for shape in shapes)
        limit = self.sample_max_tokens
        if limit is None or total <= limit:
            return shapes
        factor = limit / total
        shrunk = [self._shape(item, self._cap(shape, factor)) for item, shape in
                  zip(inputs, shapes, strict=True)]  # fmt: skip
        used = sum(shape.tokens(self.spec) for shape in shrunk)
        if used > limit or any(self._below_minimum(shape) for shape in shrunk):
            raise BudgetExceeded(
                f"{len(inputs)} image(s) / clip(s) of {total} tokens do not fit "
                f"sample_max_tokens {limit} at their minimum sizes (image_min_tokens, "
                "frame_min_tokens): raise it, lower the minimums, or split the sample"
            )
        return shrunk

    def _below_minimum(self, shape: Shape) -> bool:
        low = self.image_min_pixels if shape.frames == 1 else self.frames.min_pixels
        return shape.height * shape.width < low

    def tokens(self, inputs: Sequence[ImageSize | ClipSize]) -> list[int]:
        return [shape.tokens(self.spec) for shape in self.shapes(inputs)]

    def _cap(self, shape: Shape, factor: float) -> int:
        """Pixels per frame for an input shrunk to `factor` of its tokens (at least one)."""
        per_frame = self.spec.tokens(shape.height, shape.width)  # a clip keeps its frames
        return max(1, math.floor(per_frame * factor)) * self.spec.merge_unit_pixels() ** 2

    def _shape(self, item: ImageSize | ClipSize, cap: int | None = None) -> Shape:
        if isinstance(item, ImageSize):
            high = self.image_max_pixels if cap is None else min(cap, self.image_max_pixels)
            h, w = self.spec.resized(item.height, item.width, self.image_min_pixels, high)
            return Shape(1, h, w)
        rule = self.frames if cap is None else replace(
            self.frames, max_pixels=min(cap, self.frames.max_pixels), max_video_tokens=None
        )  # fmt: skip
        count = frame_count(item.frames, item.fps, rule, self.spec.temporal_patch)
        h, w = frame_size(item.height, item.width, count, rule, self.spec)
        return Shape(count, h, w)


def budget_of(spec: NativeVisionSpec, settings: VisionDataConfig | None) -> VisualBudget:
    """The budget `data.vision` sets for `spec` (None: the spec's and the processors' own)."""
    settings = settings or VisionDataConfig()
    unit = spec.merge_unit_pixels() ** 2
    rule = FrameRule(
        fps=settings.video_fps,
        min_frames=settings.video_min_frames,
        max_frames=settings.video_max_frames,
        min_pixels=settings.frame_min_tokens * unit,
        max_pixels=settings.frame_max_tokens * unit,
        max_video_tokens=settings.video_max_tokens,
    )
    return VisualBudget.from_tokens(
        spec,
        image_min_tokens=settings.image_min_tokens,
        image_max_tokens=settings.image_max_tokens,
        sample_max_tokens=settings.sample_max_tokens,
        frames=rule,
    )
