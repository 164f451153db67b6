"""What per-item processing takes and gives back, shared by every kind of item.

`ProcessOptions` goes to the build's worker processes, an `Outcome` (samples and filter features,
or a reject) comes back; both are picklable. `sample_key`, `json_bytes` and `reencode_image` are
how every kind of item makes its samples: `process.process_item` for files and table rows,
`conversation_items.process_conversation` for chat data. They live here, below both, so that
neither imports the other's internals.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmtrain.data.ingest.filters import Features
from mmtrain.data.ingest.video_clips import ClipOptions
from mmtrain.data.stream.media import DEFAULT_MAX_PIXELS

__all__ = ["ENCODERS", "ProcessOptions", "Outcome", "sample_key", "json_bytes", "reencode_image"]

# Re-encoding keeps the source format; quality high enough that training does not see artefacts.
ENCODERS = {"jpg": ("JPEG", {"quality": 95}), "png": ("PNG", {}), "webp": ("WEBP", {"quality": 95})}


@dataclass(frozen=True)
class ProcessOptions:
    """What a worker needs to turn an item into samples (picklable)."""

    modalities: tuple[str, ...]
    image_max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    audio_rate: int = 16000
    timeseries_window: int | None = None
    video: ClipOptions | None = None  # split and/or re-encode videos (None: stored as they are)
    fix_text: bool = False
    sharpness: bool = False  # measure the Laplacian variance (blur filter on)
    phash: bool = False  # compute the perceptual hash (near-duplicate filter on)
    relevance_size: int | None = None  # return a square thumbnail for the relevance model


@dataclass
class Outcome:
    """The result of one item: samples and features, or a reject (path and reason)."""

    index: int
    origin: str
    samples: list[dict[str, Any]] = field(default_factory=list)
    features: Features | None = None
    reject: tuple[str, str, str] | None = None  # (kind, path, reason)
    thumb: np.ndarray | None = None


def sample_key(index: int) -> str:
    """Keys are source positions: unique, dot-free, and sorted like the source."""
    return f"{index:09d}"


def json_bytes(meta: dict[str, Any]) -> bytes:
    """A sample's json member: sorted keys, UTF-8 (the same bytes for the same metadata)."""
    return json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")


def reencode_image(pixels: np.ndarray, ext: str, max_side: int) -> tuple[bytes, tuple[int, int]]:
    """`pixels` (uint8 [H, W, 3]) resized to `max_side` on the longer side and encoded in the
    format of `ext` (`ENCODERS`; PNG for others): the bytes and the new (width, height)."""
    from PIL import Image

    height, width = pixels.shape[:2]
    scale = max_side / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    # reducing_gap: a cheap integer downscale first, then Lanczos (visually identical, faster).
    image = Image.fromarray(pixels).resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
    fmt, kwargs = ENCODERS.get(ext, ENCODERS["png"])
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue(), size
