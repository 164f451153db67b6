"""A native-resolution VLM's images and clips in the loader: sizes from the headers, the budget,
then pixels at exactly those sizes.

The Qwen2-VL family reads every page and clip at its own size, so a conversation's token count
is known only once its inputs' sizes are: `NativeInputs.measure` reads the headers (nothing
decoded), and the budget (visual_budget.py, the planner's rule too) gives each input its size
at the tower and its LM tokens; the text is then encoded and truncated with those counts
(chat_templates.Placeholders), and only a sample that is kept is decoded (`decode`): images by
Pillow, resized bicubic as the Qwen2-VL image processor resizes them, clips at the frames the
video rule names (video_frames.py). Pixels are normalised as the processors do (x / 255 minus
the OpenAI CLIP mean, over its std), or left uint8 for the device to normalise with the same
float32 arithmetic (`ImageTransform.to_float`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS, LazyImage, MediaError
from mmtrain.data.stream.transforms import CLIP_MEAN, CLIP_STD, ImageTransform
from mmtrain.data.stream.video_frames import clip_size, decode_clip
from mmtrain.visual_budget import BudgetExceeded, ClipSize, ImageSize, Shape, VisualBudget

__all__ = ["Measured", "VisualInputs", "NativeInputs"]


@dataclass(frozen=True)
class Measured:
    """One sample's inputs as their headers give them, and their sizes at the tower."""

    images: list[ImageSize]
    videos: list[ClipSize]
    shapes: list[Shape]  # images first, then clips

    def tokens(self, budget: VisualBudget) -> tuple[list[int], list[int]]:
        """LM tokens of each image and of each clip."""
        counts = [shape.tokens(budget.spec) for shape in self.shapes]
        return counts[: len(self.images)], counts[len(self.images) :]


@dataclass(frozen=True)
class VisualInputs:
    """Pixels of one sample: images [3, H, W] and clips [T, 3, H, W] in tag order, the rate
    each clip's frames were sampled at."""

    images: list[torch.Tensor]
    videos: list[torch.Tensor]
    video_fps: list[float]


class NativeInputs:
    """Measures and decodes a sample's images and clips under one budget."""

    def __init__(
        self, budget: VisualBudget, uint8: bool = False, max_pixels: int = DEFAULT_MAX_PIXELS
    ):
        self.budget = budget
        self.uint8 = uint8
        self.max_pixels = max_pixels
        self.mean = np.asarray(CLIP_MEAN, dtype=np.float32) * 255.0
        self.inv_std = 1.0 / (np.asarray(CLIP_STD, dtype=np.float32) * 255.0)

    def scale_and_shift(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean * 255, 1 / (std * 255)) per channel: what the device applies to uint8 pixels."""
        return self.mean, self.inv_std

    def measure(self, key: str, images: Sequence[bytes], videos: Sequence[bytes]) -> Measured:
        """Header sizes and budgeted shapes; MediaError naming the input for a bad header,
        `visual_budget.BudgetExceeded` when the sample cannot fit its budget."""
        image_sizes = []
        for n, data in enumerate(images):
            try:
                lazy = LazyImage(data, self.max_pixels)
            except MediaError as err:
                raise MediaError(f"{key} image {n}: {err}") from None
            image_sizes.append(ImageSize(lazy.height, lazy.width))
        clip_sizes = []
        for n, data in enumerate(videos):
            try:
                clip_sizes.append(clip_size(data, self.max_pixels))
            except MediaError as err:
                raise MediaError(f"{key} video {n}: {err}") from None
        try:
            shapes = self.budget.shapes([*image_sizes, *clip_sizes])
        except BudgetExceeded:
            raise
        except ValueError as err:  # a clip shorter than a temporal patch, an aspect over 200
            raise MediaError(f"{key}: {err}") from None
        return Measured(image_sizes, clip_sizes, shapes)

    def decode(
        self, key: str, images: Sequence[bytes], videos: Sequence[bytes], measured: Measured
    ) -> VisualInputs:
        """The pixels of the inputs at their measured shapes."""
        from PIL import Image

        shapes = iter(measured.shapes)
        out_images = []
        for n, data in enumerate(images):
            shape = next(shapes)
            try:
                picture, _ = LazyImage(data, self.max_pixels).decode_pil()
            except MediaError as err:
                raise MediaError(f"{key} image {n}: {err}") from None
            resized = picture.resize((shape.width, shape.height), Image.Resampling.BICUBIC)
            out_images.append(self._tensor(np.asarray(resized)[None])[0])
        out_videos, rates = [], []
        for n, (data, size) in enumerate(zip(videos, measured.videos, strict=True)):
            try:
                frames, fps = decode_clip(data, size, next(shapes), self.max_pixels)
            except MediaError as err:
                raise MediaError(f"{key} video {n}: {err}") from None
            out_videos.append(self._tensor(frames))
            rates.append(fps)
        return VisualInputs(out_images, out_videos, rates)

    def _tensor(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [T, H, W, 3] -> [T, 3, H, W], uint8 or normalised float32."""
        pixels = torch.from_numpy(np.ascontiguousarray(frames.transpose(0, 3, 1, 2)))
        if self.uint8:
            return pixels
        mean, inv_std = (torch.from_numpy(v) for v in self.scale_and_shift())
        return ImageTransform.to_float(pixels, mean, inv_std)
