"""A native VLM's clips: frames by fps within min/max and whole temporal patches, spread as
transformers' Qwen2-VL video processor spreads them, resized within the per-frame budget (or an
even share of a clip budget), decoded from the frames the rule names (hand-computed cases)."""

from __future__ import annotations

import numpy as np
import pytest

from mmtrain.data.stream.media import encode_video, video_header
from mmtrain.data.stream.video_frames import (
    FrameRule,
    frame_count,
    frame_indices,
    frame_size,
    sample_clip,
)
from mmtrain.spec import load_spec

SPEC = load_spec("Qwen2.5-VL-7B").vision  # patch 14, merge 2: sides in multiples of 28


@pytest.mark.parametrize(
    "total, fps, rule, frames",
    [
        (250, 25.0, FrameRule(), 20),  # 10 s at 2 fps
        (251, 25.0, FrameRule(), 20),  # 20.08 rounds down to whole patches
        (30, 30.0, FrameRule(), 4),  # 1 s: min_frames 4
        (3, 30.0, FrameRule(), 2),  # fewer frames than min_frames: the source's, whole patches
        (9000, 30.0, FrameRule(max_frames=64), 64),  # 5 minutes capped
        (100, 25.0, FrameRule(fps=0.5), 4),  # 2 frames at 0.5 fps: min_frames
    ],
)
def test_frame_counts_follow_fps_within_the_bounds(total, fps, rule, frames):
    assert frame_count(total, fps, rule, temporal_patch=2) == frames


def test_indices_spread_as_transformers_computes_them():
    assert frame_indices(250, 20) == [int(i * 12.5) for i in range(20)]  # every 12.5th
    assert frame_indices(10, 4) == [0, 2, 5, 7]  # 0, 2.5, 5, 7.5 truncated
    with pytest.raises(ValueError, match="shorter than a temporal patch"):
        frame_count(1, 25.0, FrameRule(), temporal_patch=2)


def test_frame_size_keeps_the_per_frame_and_the_clip_budget():
    # 1280 x 720 within the per-frame budget of 28 x 28 x 768 pixels
    h, w = frame_size(720, 1280, 20, FrameRule(), SPEC)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= 28 * 28 * 768
    assert (h, w) == SPEC.resized(720, 1280, min_pixels=128 * 28 * 28, max_pixels=28 * 28 * 768)
    # a clip budget of 2000 tokens over 64 frames: 2000 x 784 x 0.9 x 2 / 64 pixels a frame,
    # below the per-frame minimum x 1.05, so the minimum x 1.05 caps it
    small = frame_size(720, 1280, 64, FrameRule(max_video_tokens=2000), SPEC)
    cap = max(min(28 * 28 * 768, int(2000 * 784 * 0.9) * 2 // 64), int(128 * 28 * 28 * 1.05))
    assert small == SPEC.resized(720, 1280, min_pixels=128 * 28 * 28, max_pixels=cap)
    assert small[0] * small[1] < h * w


def test_a_clip_decodes_the_frames_the_rule_names():
    # 24 frames at 8 fps (3 s), frame i filled with grey level 10 i: the sampled frames' levels
    # tell which source frames were read
    frames = np.stack([np.full((56, 84, 3), 10 * i, np.uint8) for i in range(24)])
    data = encode_video(frames, fps=8)
    assert video_header(data)[:3] == (24, 56, 84)
    rule = FrameRule(fps=2.0, min_pixels=28 * 28, max_pixels=56 * 84)
    clip, rate = sample_clip(data, rule, SPEC)
    assert clip.shape == (6, 56, 84, 3) and rate == pytest.approx(2.0)  # 3 s x 2 fps
    levels = clip[..., 0].mean(axis=(1, 2)) / 10
    assert np.abs(levels - np.array(frame_indices(24, 6))).max() < 0.5  # lossy codec: near
