"""Aspect-ratio and frames x resolution buckets: a denoiser trains on samples of many shapes in
batches of one.

A bucket is a shape the denoiser takes: (height, width) of an image or a latent, (frames,
height, width) of a clip, in the units of its input (pixels, or latent positions). Each sample
belongs to one bucket by a rule of its own size alone (`Buckets.assign`), so the loader's order
(`order.bucketed_order`), the decoder in a worker and a size index made beforehand agree
without talking to each other:

- an image goes to the bucket whose aspect ratio is nearest its own (in log ratio; ties: the
  bucket listed first), and is resized to cover the bucket and centre-cropped to it;
- a clip goes to a bucket whose frames it holds (`frames` source frames, or with `video_stride`
  S the (frames - 1) S + 1 a window spans), the nearest aspect ratio first, then the most
  frames; a clip shorter than every bucket belongs to none;
- a latent (encoded per bucket beforehand) goes to the bucket equal to its [H, W] / [T, H, W].

A sample in no bucket is left out of the order (and counted), never squeezed into a shape.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmtrain.data.stream.media import (
    DEFAULT_MAX_PIXELS,
    LazyImage,
    MediaError,
    draft_reduction,
    video_header,
)
from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS
from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.structured import FieldError

NO_BUCKET = -1
LATENT_MEMBERS = ("latent.npy", "npy")  # named, or the one .npy of a sample

__all__ = ["NO_BUCKET", "Buckets", "probe_size", "video_size", "centre_box", "cover_crop"]


@dataclass(frozen=True)
class Buckets:
    """The shapes of `data.buckets` for one denoiser, and the rule that puts a sample in one."""

    shapes: tuple[tuple[int, ...], ...]
    input: str  # the denoiser's input: image, video or latent
    video_stride: int | None = None

    @classmethod
    def for_denoiser(
        cls,
        shapes: Sequence[Sequence[int]],
        spec: DenoiserSpec,
        video_stride: int | None = None,
        field: str = "data.buckets",
    ) -> Buckets:
        """The buckets of `data.buckets`, checked against the denoiser (FieldError names the
        bucket): [H, W] for an image model, [T, H, W] for a video one, multiples of its patch."""
        rank = 3 if spec.is_video() else 2
        step = ((spec.temporal_patch,) if spec.is_video() else ()) + (spec.patch_size,) * 2
        if not shapes:
            raise FieldError(field, "give at least one bucket shape")
        checked = []
        for i, shape in enumerate(shapes):
            shape = tuple(int(n) for n in shape)
            if len(shape) != rank or any(n <= 0 for n in shape):
                what = "[frames, height, width]" if rank == 3 else "[height, width]"
                raise FieldError(f"{field}[{i}]", f"{list(shape)}: a bucket is {what} > 0")
            if any(n % m for n, m in zip(shape, step, strict=True)):
                raise FieldError(
                    f"{field}[{i}]", f"{list(shape)} is not a multiple of the patch {list(step)}"
                )
            checked.append(shape)
        if len(set(checked)) != len(checked):
            raise FieldError(field, f"a bucket is listed twice: {[list(s) for s in checked]}")
        return cls(tuple(checked), spec.input, video_stride)

    def assign(self, size: Sequence[int]) -> int:
        """The bucket of a sample of `size` ((H, W), or (frames, H, W) of a clip or a video
        latent), or NO_BUCKET (module docstring)."""
        size = tuple(int(n) for n in size)
        if self.input == "latent":
            return self.shapes.index(size) if size in self.shapes else NO_BUCKET
        ratio = math.log(size[-1] / size[-2])
        best, best_key = NO_BUCKET, None
        for i, shape in enumerate(self.shapes):
            if len(shape) == 3 and self._source_frames(shape[0]) > size[0]:
                continue  # the clip is too short for this bucket's window
            distance = round(abs(math.log(shape[-1] / shape[-2]) - ratio), 9)
            key = (distance, -shape[0] if len(shape) == 3 else 0)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _source_frames(self, frames: int) -> int:
        stride = self.video_stride
        return frames if stride is None else (frames - 1) * stride + 1

    def largest(self) -> tuple[int, ...]:
        """The bucket of the most positions (what a step's peak memory is sized by)."""
        return max(self.shapes, key=math.prod)


def centre_box(height: int, width: int, shape: Sequence[int]) -> tuple[float, float, float, float]:
    """The centred box (left, top, right, bottom) of an image of height x width with the aspect
    ratio of `shape` [..., H, W]: what covers the bucket after a resize, cropping the least."""
    target = shape[-1] / shape[-2]
    if width / height > target:  # wider than the bucket: crop the sides
        w = height * target
        return ((width - w) / 2, 0.0, (width + w) / 2, float(height))
    h = width / target
    return (0.0, (height - h) / 2, float(width), (height + h) / 2)


def cover_crop(image: LazyImage | np.ndarray, shape: Sequence[int], channels: int = 3) -> Any:
    """A PIL image of `shape` [..., H, W]: `image` (encoded bytes' `LazyImage`, decoded at the
    largest JPEG reduction the crop allows, or a uint8 [H, W, 3] frame) resized to cover the
    shape and centre-cropped to it (`centre_box`), bicubic; grey when `channels` is 1."""
    from PIL import Image

    height, width = shape[-2], shape[-1]
    if isinstance(image, LazyImage):
        box = centre_box(image.height, image.width, shape)
        reduce = draft_reduction(min((box[2] - box[0]) / width, (box[3] - box[1]) / height))
        pil, reduced = image.decode_pil(reduce)
        box = (box[0] / reduced, box[1] / reduced, box[2] / reduced, box[3] / reduced)
    else:
        pil = Image.fromarray(image)
        box = centre_box(pil.height, pil.width, shape)
    if channels == 1:
        pil = pil.convert("L")
    return pil.resize((width, height), Image.Resampling.BICUBIC, box=box)


def probe_size(sample: dict[str, Any], input: str) -> tuple[int, ...]:
    """A sample's size for `Buckets.assign`, read from headers only: (H, W) of an image,
    (frames, H, W) of a clip, the latent's dims after its channels. MediaError when the sample
    has no such member or it does not read."""
    if input == "latent":
        member = next((m for m in LATENT_MEMBERS if m in sample), None)
        if member is None:
            raise MediaError("no .npy latent member")
        return npy_shape(sample[member])[1:]
    ext = next((e for e in MODALITY_EXTENSIONS[input] if e in sample), None)
    if ext is None:
        raise MediaError(f"no {input} member")
    if input == "image":
        image = LazyImage(sample[ext])
        return (image.height, image.width)
    return video_size(sample[ext])


def video_size(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, int]:
    """(frames, height, width) of a clip's first video stream, from its headers
    (`media.video_header`)."""
    return video_header(data, max_pixels)[:3]


def npy_shape(data: bytes) -> tuple[int, ...]:
    """The shape in a .npy header (the array itself is not read)."""
    buffer = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buffer)
        read = np.lib.format.read_array_header_1_0
        shape, _, _ = (read if version == (1, 0) else np.lib.format.read_array_header_2_0)(buffer)
    except Exception as err:  # ValueError: not a .npy file
        raise MediaError(f"latent is not a .npy array: {err}") from None
    return tuple(shape)
