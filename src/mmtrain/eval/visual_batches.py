"""The pixels of validation conversations, as the model's batch takes them.

Two kinds of VLM read images differently: a fixed-size tower (LLaVA) takes every image through
its eval transform (centre crop) as one tensor [N, C, H, W]; a native-resolution tower (the
Qwen2-VL family) takes each page and clip at the size the run's pixel budget gives it, as
lists (data/stream/native_inputs.py, the loader's own code, so validation sees what training
saw). Both return the batch entries and the samples whose inputs did not decode: shown as
zeros of the right shape, left out of the metrics. A VLM always gets its image entry, also
empty: under FSDP / DDP every rank must run the tower in every forward (models/vlm.py).
`reverse_frames` hands each clip over with its frames in reverse order (the evaluator's check
that a model reads time: eval/generation.py); a fixed-size tower takes no clips.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmtrain.data.stream.media import MediaError
from mmtrain.data.stream.native_inputs import NativeInputs
from mmtrain.data.stream.transforms import ImageTransform
from mmtrain.models.visual_inputs import IMAGES, VIDEO_FPS, VIDEOS

log = logging.getLogger(__name__)

__all__ = ["FixedImages", "NativeVisuals"]

# (position, key, image member names, video member names, the sample's members)
Item = tuple[int, str, Sequence[str], Sequence[str], Mapping[str, bytes]]


class FixedImages:
    """A fixed-size tower's images: "image" [N, C, H, W] in reading order."""

    def __init__(self, transform: ImageTransform):
        self.transform = transform

    def inputs(
        self, items: Sequence[Item], dtype: torch.dtype, reverse_frames: bool = False
    ) -> tuple[dict[str, Any], set[int]]:
        t = self.transform
        pixels, broken = [], set()
        for position, key, images, _, members in items:
            for name in images:
                try:
                    pixels.append(t.decode(members[name]))
                except (MediaError, KeyError, OSError, ValueError) as err:
                    log.warning("validation sample %s: image %s unreadable: %s", key, name, err)
                    pixels.append(torch.zeros(t.channels, t.size, t.size))
                    broken.add(position)
        if not pixels:
            return {IMAGES: torch.zeros(0, t.channels, t.size, t.size, dtype=dtype)}, broken
        return {IMAGES: torch.stack(pixels).to(dtype)}, broken


class NativeVisuals:
    """A native-resolution tower's pages and clips at their budgeted sizes, as lists."""

    def __init__(self, native: NativeInputs):
        self.native = native

    def inputs(
        self, items: Sequence[Item], dtype: torch.dtype, reverse_frames: bool = False
    ) -> tuple[dict[str, Any], set[int]]:
        out: dict[str, list[Any]] = {IMAGES: [], VIDEOS: [], VIDEO_FPS: []}
        broken = set()
        for position, key, image_names, video_names, members in items:
            images = [members[name] for name in image_names]
            videos = [members[name] for name in video_names]
            measured = self.native.measure(key, images, videos)  # read when it was encoded
            try:
                visual = self.native.decode(key, images, videos, measured)
            except MediaError as err:
                log.warning("validation sample %s: unreadable input: %s", key, err)
                broken.add(position)
                pages, clips = measured.shapes[: len(images)], measured.shapes[len(images) :]
                out[IMAGES] += [torch.zeros(3, s.height, s.width, dtype=dtype) for s in pages]
                out[VIDEOS] += [torch.zeros(s.frames, 3, s.height, s.width, dtype=dtype)
                                for s in clips]  # fmt: skip
                out[VIDEO_FPS] += [1.0] * len(clips)
                continue
            out[IMAGES] += [x.to(dtype) for x in visual.images]
            # [T, 3, H, W]: time is the first axis; the frame rate and the tokens stay
            out[VIDEOS] += [(x.flip(0) if reverse_frames else x).to(dtype) for x in visual.videos]
            out[VIDEO_FPS] += visual.video_fps
        return out, broken
