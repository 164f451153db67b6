"""Which frames of a clip a native-resolution VLM reads, and at what size: the Qwen2-VL video
processor's rule, so a clip gives the tokens the model was trained on.

Frames: `fps` frames a second of the source (its frame count / its frame rate x fps), at least
`min_frames`, at most `max_frames` and the source's frames, rounded down to whole temporal
patches; frame i of n at index floor(i x total / n) (transformers' `sample_frames`, in float32 as
it computes them). Size: each frame resized as an image (`NativeVisionSpec.resized`) within
[`min_pixels`, `max_pixels`] per frame; with `max_video_tokens`, the per-frame cap also shrinks
to an even share of that many tokens over the clip (transformers' `cap_pixels_per_frame`).
Everything is a function of the clip's headers and the rule: the same sample gives the same
frames on every worker and after every resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS, MediaError, decode_video, video_header
from mmtrain.native_vision_spec import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, NativeVisionSpec

DEFAULT_FPS = 2.0  # Qwen2-VL's processors sample two frames a second
MIN_FRAMES, MAX_FRAMES = 4, 768  # transformers' Qwen2VLVideoProcessor defaults
TOKEN_SHARE = 0.9  # transformers: 90 % of max_video_tokens go to the frames' patches


@dataclass(frozen=True)
class FrameRule:
    fps: float = DEFAULT_FPS
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS  # per frame
    max_pixels: int = VIDEO_MAX_PIXELS  # per frame
    max_video_tokens: int | None = None  # a budget for the whole clip (None: per frame only)


def frame_count(total: int, source_fps: float, rule: FrameRule, temporal_patch: int) -> int:
    """Frames to sample of a clip of `total` frames at `source_fps`; MediaError when it holds
    fewer than one temporal patch."""
    if total < temporal_patch:
        raise MediaError(f"a clip of {total} frames is shorter than a temporal patch "
                         f"({temporal_patch} frames)")  # fmt: skip
    ceiling = math.floor(min(rule.max_frames, total) / temporal_patch) * temporal_patch
    wanted = total / source_fps * rule.fps
    wanted = min(max(wanted, rule.min_frames), ceiling, total)
    return math.floor(wanted / temporal_patch) * temporal_patch


def frame_indices(total: int, count: int) -> list[int]:
    """`count` source frame indices spread over `total`, as transformers computes them."""
    return torch.arange(0, total, total / count).int().tolist()


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


def sample_clip(
    data: bytes, rule: FrameRule, spec: NativeVisionSpec, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[np.ndarray, float]:
    """(uint8 frames [T, H, W, 3] at their resized size, the rate they were sampled at: T / the
    clip's seconds) of a clip's bytes."""
    from PIL import Image

    total, height, width, source_fps = video_header(data, max_pixels)
    count = frame_count(total, source_fps, rule, spec.temporal_patch)
    times = [(i + 0.5) / source_fps for i in frame_indices(total, count)]  # inside frame i
    frames = decode_video(data, count, times_s=times, max_pixels=max_pixels).frames
    h, w = frame_size(height, width, count, rule, spec)
    resized = [np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC))
               for f in frames]  # fmt: skip
    return np.stack(resized), count / (total / source_fps)
