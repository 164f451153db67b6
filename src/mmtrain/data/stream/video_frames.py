"""Which frames of a clip a native-resolution VLM reads, and at what size: the Qwen2-VL video
processor's rule, so a clip gives the tokens the model was trained on.

Frames: `fps` frames a second of the source (its frame count / its frame rate x fps), at least
`min_frames`, at most `max_frames` and the source's frames, rounded down to whole temporal
patches; frame i of n at index floor(i x total / n) (transformers' `sample_frames`, in float32 as
it computes them). Size: each frame resized as an image (`NativeVisionSpec.resized`) within
[`min_pixels`, `max_pixels`] per frame; with `max_video_tokens`, the per-frame cap also shrinks
to an even share of that many tokens over the clip (transformers' `cap_pixels_per_frame`).
Everything is a function of the clip's headers and the rule: the same sample gives the same
frames on every worker and after every resume. The counting rule itself is torch-free in
visual_budget.py (the planner's and `data inspect`'s too); this module decodes.
"""

from __future__ import annotations

import numpy as np
import torch

from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS, MediaError, decode_video, video_header
from mmtrain.native_vision_spec import NativeVisionSpec
from mmtrain.visual_budget import ClipSize, FrameRule, Shape, frame_count, frame_size

__all__ = [
    "FrameRule",
    "frame_count",
    "frame_indices",
    "frame_size",
    "clip_size",
    "decode_clip",
    "sample_clip",
]


def frame_indices(total: int, count: int) -> list[int]:
    """`count` source frame indices spread over `total`, as transformers computes them."""
    return torch.arange(0, total, total / count).int().tolist()


def clip_size(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ClipSize:
    """A clip's frames, frame rate and frame size from its header (nothing decoded)."""
    total, height, width, source_fps = video_header(data, max_pixels)
    return ClipSize(total, source_fps, height, width)


def decode_clip(
    data: bytes, size: ClipSize, shape: Shape, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[np.ndarray, float]:
    """(uint8 frames [T, H, W, 3] at `shape`, the rate they were sampled at: T / the clip's
    seconds) of a clip of `size` whose budget gave `shape` (visual_budget.py)."""
    from PIL import Image

    times = [(i + 0.5) / size.fps for i in frame_indices(size.frames, shape.frames)]  # inside i
    frames = decode_video(data, shape.frames, times_s=times, max_pixels=max_pixels).frames
    resized = [np.asarray(Image.fromarray(f).resize((shape.width, shape.height),
                                                    Image.Resampling.BICUBIC))
               for f in frames]  # fmt: skip
    return np.stack(resized), shape.frames / (size.frames / size.fps)


def sample_clip(
    data: bytes, rule: FrameRule, spec: NativeVisionSpec, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[np.ndarray, float]:
    """`decode_clip` of one clip under `rule` alone (no per-sample budget)."""
    size = clip_size(data, max_pixels)
    try:
        count = frame_count(size.frames, size.fps, rule, spec.temporal_patch)
    except ValueError as err:
        raise MediaError(str(err)) from None
    shape = Shape(count, *frame_size(size.height, size.width, count, rule, spec))
    return decode_clip(data, size, shape, max_pixels)
