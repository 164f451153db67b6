"""Transforms: a decoded array (see `media.py`) -> the tensor a tower's stem consumes.

One transform per modality, each with a train variant (random crops, flips, windows) and an
eval variant (deterministic and centred), configured from the tower's stem spec so the output
shapes always match the model:

    image       uint8 [H, W, 3]    -> float32 [C, H, W]      normalised (CLIP mean/std)
    video       uint8 [T', H, W, 3] -> float32 [T, C, H, W]  one crop/flip for the whole clip
    audio       float32 [S']        -> float32 [S]            S = AudioStem.samples()
    timeseries  float32 [C, L']     -> float32 [C, L]         standardised per channel
    text        str                 -> int64 [context_length] the tokenizer's ids

All randomness comes from the `numpy.random.Generator` passed to each call (the loader derives
it from seed, epoch and the sample's global position), so a sample's crop does not depend on
which worker or rank produced it, and a resumed run re-creates it exactly. Data that cannot
fit the stem (wrong channel count, empty) raises `MediaError`, which the loader counts as a
corrupt sample. Only numpy, Pillow and torch are used (no torchvision).

`SampleDecoder` joins the two halves for the loader: shard sample bytes -> decoders (media.py)
-> these transforms -> `{tower name: tensor}`; `collate` stacks such dicts into a batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from mmtrain.data.stream.media import (
    DEFAULT_MAX_PIXELS,
    LazyImage,
    MediaError,
    decode_audio,
    decode_text,
    decode_timeseries,
    decode_video,
    draft_reduction,
)
from mmtrain.data.stream.tokenizer import ByteTokenizer, Tokenizer
from mmtrain.spec import (
    AudioStem,
    ImageStem,
    ModelSpec,
    TextStem,
    TimeSeriesStem,
    TowerSpec,
    VideoStem,
)
from mmtrain.structured import FieldError

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "AugmentConfig",
    "Transform",
    "ImageTransform",
    "VideoTransform",
    "AudioTransform",
    "TimeSeriesTransform",
    "TextTransform",
    "make_transform",
    "make_transforms",
    "collate",
    "MODALITY_EXTENSIONS",
    "SampleDecoder",
]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class AugmentConfig:
    """Training augmentation and normalisation of images and video frames.

    `scale` is the range of the crop's area as a fraction of the image, `ratio` the range of
    its aspect ratio (width / height), as in random-resized-crop. The default scale (0.9-1.0)
    is mild, as contrastive image-text training wants (captions describe the whole image).
    `mean`/`std` default to CLIP's for 3 channels and to their averages for 1.
    """

    scale: tuple[float, float] = (0.9, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def validate(self, path: str = "augment") -> None:
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise FieldError(f"{path}.scale", f"needs 0 < low <= high <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise FieldError(f"{path}.ratio", f"needs 0 < low <= high, got {self.ratio}")


class Transform(Protocol):
    """array (or text) + generator -> tensor; eval transforms ignore the generator."""

    train: bool

    def __call__(self, value: Any, rng: np.random.Generator | None = None) -> torch.Tensor: ...


def _need_rng(rng: np.random.Generator | None, what: str) -> np.random.Generator:
    if rng is None:
        raise ValueError(
            f"the training {what} transform needs a numpy Generator (the loader derives one per "
            "sample from seed, epoch and position); eval transforms take none"
        )
    return rng


# ----------------------------------------------------------------------------- images
Box = tuple[float, float, float, float]  # left, top, right, bottom in source pixels


def random_resized_box(
    height: int,
    width: int,
    rng: np.random.Generator,
    scale: tuple[float, float],
    ratio: tuple[float, float],
) -> Box:
    """A random crop covering `scale` of the area with aspect ratio in `ratio`.

    Tries a few random shapes; when none fits inside the image (extreme aspect ratios), falls
    back to the largest centred crop whose aspect ratio is clamped into `ratio`.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, left + w, top + h
    aspect = min(max(width / height, ratio[0]), ratio[1])
    w, h = (width, width / aspect) if width / height < aspect else (height * aspect, height)
    return _centred(height, width, h, w)


def centre_square_box(height: int, width: int) -> Box:
    """The centred square of side min(H, W): resize-shorter-side + centre-crop in one step."""
    side = min(height, width)
    return _centred(height, width, side, side)


def _centred(height: int, width: int, h: float, w: float) -> Box:
    left, top = (width - w) / 2, (height - h) / 2
    return left, top, left + w, top + h


def _check_image(array: np.ndarray, what: str) -> None:
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise MediaError(f"{what} must be uint8 [H, W, 3], got {array.dtype} {list(array.shape)}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise MediaError(f"{what} is empty ({array.shape[1]} x {array.shape[0]} pixels)")


class ImageTransform:
    """uint8 [H, W, 3] -> float32 [C, size, size], normalised.

    Train: random resized crop + optional horizontal flip. Eval: resize the shorter side to
    `size` and centre-crop (done as one bicubic resize of the centred square, as CLIP's eval
    preprocessing up to sub-pixel rounding). `decode` does the same from encoded bytes,
    decoding JPEGs at the smallest size the crop allows.

    `uint8=True` stops before normalising: uint8 [C, size, size], a quarter of float32's bytes
    to pin and copy to the GPU, where `to_float` normalises them (the trainer does this on
    CUDA: train/inputs.py). `to_float` is the very float32 subtract and multiply the float
    output applies, so both give the same numbers bit for bit.
    """

    def __init__(
        self,
        size: int,
        train: bool,
        channels: int = 3,
        augment: AugmentConfig | None = None,
        uint8: bool = False,
    ):
        self.size = size
        self.train = train
        self.channels = channels
        self.uint8 = uint8
        self.augment = augment or AugmentConfig()
        self.augment.validate()
        if channels not in (1, 3):
            raise FieldError(
                "stem.channels", f"image transforms support 1 or 3 channels, got {channels}"
            )
        mean = self.augment.mean or (CLIP_MEAN if channels == 3 else (float(np.mean(CLIP_MEAN)),))
        std = self.augment.std or (CLIP_STD if channels == 3 else (float(np.mean(CLIP_STD)),))
        if len(mean) != channels or len(std) != channels:
            raise FieldError("augment.mean", f"mean and std need {channels} values each")
        self._mean = np.asarray(mean, dtype=np.float32) * 255.0
        self._inv_std = 1.0 / (np.asarray(std, dtype=np.float32) * 255.0)

    @classmethod
    def from_stem(
        cls, stem: ImageStem, train: bool, augment: AugmentConfig | None = None, uint8: bool = False
    ):
        return cls(stem.image_size, train, stem.channels, augment, uint8)

    def scale_and_shift(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean * 255, 1 / (std * 255)) per channel, float32: what `to_float` applies."""
        return self._mean, self._inv_std

    def min_decode_size(self) -> int:
        """The shortest source side that still gives full-resolution crops, whatever crop is
        drawn: for decoders that must pick their size before the crop (video). Images use
        `decode`, which picks the size from the crop actually drawn and so reduces more."""
        if not self.train:
            return self.size
        smallest = self.augment.scale[0] * min(self.augment.ratio[0], 1 / self.augment.ratio[1])
        return math.ceil(self.size / math.sqrt(smallest))

    def sample_params(self, height: int, width: int, rng: np.random.Generator | None):
        """(crop box, flip) for one image or one whole video clip."""
        if not self.train:
            return centre_square_box(height, width), False
        rng = _need_rng(rng, "image")
        box = random_resized_box(height, width, rng, self.augment.scale, self.augment.ratio)
        flip = bool(self.augment.flip and rng.random() < 0.5)
        return box, flip

    def apply(self, image: np.ndarray, box: Box, flip: bool) -> torch.Tensor:
        """Crop `box`, resize to size x size (bicubic, antialiased), flip, normalise -> [C, H, W]."""
        return self._resize(Image.fromarray(image), box, flip)

    def _resize(self, pil: Image.Image, box: Box, flip: bool) -> torch.Tensor:
        if self.channels == 1:
            pil = pil.convert("L")
        out = pil.resize((self.size, self.size), Image.Resampling.BICUBIC, box=box)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = np.asarray(out)
        return self.normalise(pixels[:, :, None] if pixels.ndim == 2 else pixels)

    def decode(
        self,
        data: bytes,
        rng: np.random.Generator | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> torch.Tensor:
        """Encoded image bytes -> float32 [C, size, size], decoding no more than the crop needs.

        Train: the crop and flip are drawn from `rng` for the full image size (read from the
        header), exactly as `self(decode_image(data), rng)` draws them; a JPEG is then decoded
        at the largest reduction (1/2, 1/4, 1/8) that leaves the crop at least `size` pixels on
        both sides (never upsampled), and cropped in reduced coordinates. The result equals the
        full decode's up to resampling differences, and bit for bit when nothing is reduced
        (crops under 2x the output, non-JPEG data). Eval: the centre square of the image
        decoded with `draft_size=size`, exactly what `ImageCache` stores.
        """
        image = LazyImage(data, max_pixels)
        box, flip = self.sample_params(image.height, image.width, rng)
        side = min(box[2] - box[0], box[3] - box[1])
        pil, reduced = image.decode_pil(draft_reduction(side / self.size))
        if not self.train:
            box = centre_square_box(pil.height, pil.width)
        elif reduced > 1:
            # Reduced pixel i covers full pixels [i * reduced, (i + 1) * reduced).
            box = (box[0] / reduced, box[1] / reduced, box[2] / reduced, box[3] / reduced)
        return self._resize(pil, box, flip)

    def normalise(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 [H, W, C] already at its final size -> normalised float32 [C, H, W] (uint8
        [C, H, W] with `uint8`).

        Bit-for-bit what `apply` computes after its resize (the same float32 subtract and
        multiply), in torch: about 4x faster than numpy's temporaries, which matters when the
        pixels come from a pre-decoded cache and nothing else is left to do.
        """
        if not pixels.flags.writeable or not pixels.flags.c_contiguous:
            pixels = np.array(pixels)  # torch wraps only writable arrays (a cache is read-only)
        x = torch.from_numpy(pixels).permute(2, 0, 1)
        if self.uint8:
            return x.contiguous()
        return self.to_float(x, torch.from_numpy(self._mean), torch.from_numpy(self._inv_std))

    @staticmethod
    def to_float(x: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor) -> torch.Tensor:
        """uint8 [..., C, H, W] -> normalised float32, on `x`'s device: (x - mean) * inv_std
        with `scale_and_shift`'s per-channel values (on that device already)."""
        x = x.to(torch.float32, memory_format=torch.contiguous_format)
        return x.sub_(mean.view(-1, 1, 1)).mul_(inv_std.view(-1, 1, 1))

    def __call__(self, image: np.ndarray, rng: np.random.Generator | None = None) -> torch.Tensor:
        _check_image(image, "image")
        box, flip = self.sample_params(image.shape[0], image.shape[1], rng)
        return self.apply(image, box, flip)


# ----------------------------------------------------------------------------- video
def even_indices(available: int, wanted: int) -> np.ndarray:
    """`wanted` frame indices spread evenly over `available` (repeating when there are fewer)."""
    return np.floor((np.arange(wanted) + 0.5) * available / wanted).astype(np.int64)


class VideoTransform:
    """uint8 [T', H, W, 3] -> float32 [frames, C, size, size], one crop and flip for the clip.

    The decoder normally returns exactly `frames` frames; other counts are resampled evenly in
    time, so the stem always sees `frames` frames.
    """

    def __init__(
        self,
        size: int,
        frames: int,
        train: bool,
        channels: int = 3,
        augment: AugmentConfig | None = None,
        uint8: bool = False,
    ):
        self.frames = frames
        self.train = train
        self.image = ImageTransform(size, train, channels, augment, uint8)

    @classmethod
    def from_stem(
        cls, stem: VideoStem, train: bool, augment: AugmentConfig | None = None, uint8: bool = False
    ):
        return cls(stem.image_size, stem.frames, train, stem.channels, augment, uint8)

    def __call__(self, clip: np.ndarray, rng: np.random.Generator | None = None) -> torch.Tensor:
        if clip.ndim != 4 or clip.shape[0] == 0:
            raise MediaError(
                f"video must be uint8 [T, H, W, 3] with T >= 1, got {list(clip.shape)}"
            )
        _check_image(clip[0], "video frame")
        if clip.shape[0] != self.frames:
            clip = clip[even_indices(clip.shape[0], self.frames)]
        box, flip = self.image.sample_params(clip.shape[1], clip.shape[2], rng)
        return torch.stack([self.image.apply(frame, box, flip) for frame in clip])


# ----------------------------------------------------------------------------- audio
def _window_start(
    have: int, want: int, train: bool, rng: np.random.Generator | None, what: str
) -> int:
    """Offset of a `want`-long window in `have` (or of `have` in `want` when shorter)."""
    slack = abs(have - want)
    if not train:
        return slack // 2
    return int(_need_rng(rng, what).integers(0, slack + 1))


class AudioTransform:
    """float32 [S'] mono -> float32 [samples]: a random (train) or centred (eval) crop of
    longer clips; shorter ones are zero-padded, placed randomly (train) or centred (eval)."""

    def __init__(self, samples: int, train: bool):
        self.samples = samples
        self.train = train

    @classmethod
    def from_stem(cls, stem: AudioStem, train: bool):
        return cls(stem.samples(), train)

    def __call__(self, wave: np.ndarray, rng: np.random.Generator | None = None) -> torch.Tensor:
        if wave.ndim != 1 or len(wave) == 0:
            raise MediaError(f"audio must be a non-empty mono waveform [S], got {list(wave.shape)}")
        start = _window_start(len(wave), self.samples, self.train, rng, "audio")
        out = np.zeros(self.samples, dtype=np.float32)
        if len(wave) >= self.samples:
            out[:] = wave[start : start + self.samples]
        else:
            out[start : start + len(wave)] = wave
        return torch.from_numpy(out)


# ----------------------------------------------------------------------------- time-series
class TimeSeriesTransform:
    """float32 [channels, L'] -> float32 [channels, length], each channel standardised.

    A random (train) or centred (eval) window of `length` steps; shorter series are padded
    with zeros (the channel mean after standardisation). Mean and std come from the window
    itself, so sensors with different units and offsets land on one scale; a constant channel
    becomes zeros.
    """

    def __init__(self, channels: int, length: int, train: bool):
        self.channels = channels
        self.length = length
        self.train = train

    @classmethod
    def from_stem(cls, stem: TimeSeriesStem, train: bool):
        return cls(stem.channels, stem.length, train)

    def __call__(self, series: np.ndarray, rng: np.random.Generator | None = None) -> torch.Tensor:
        if series.ndim != 2 or series.shape[1] == 0:
            raise MediaError(
                f"time-series must be [channels, length] with length >= 1, got {list(series.shape)}"
            )
        if series.shape[0] != self.channels:
            raise MediaError(
                f"time-series has {series.shape[0]} channels; the stem expects {self.channels}"
            )
        have = series.shape[1]
        start = _window_start(have, self.length, self.train, rng, "time-series")
        window = series[:, start : start + self.length] if have >= self.length else series
        window = window.astype(np.float64)  # accumulate the statistics in double precision
        mean = window.mean(axis=1, keepdims=True)
        std = window.std(axis=1, keepdims=True)
        std[std < 1e-8] = 1.0
        standard = ((window - mean) / std).astype(np.float32)
        out = np.zeros((self.channels, self.length), dtype=np.float32)
        if have >= self.length:
            out[:] = standard
        else:
            out[:, start : start + have] = standard
        return torch.from_numpy(out)


# ----------------------------------------------------------------------------- text
class TextTransform:
    """str -> int64 [context_length] with the tokenizer's layout (SOT, ids, EOT, zeros)."""

    train = False  # tokenisation has no randomness; the flag keeps the Transform shape

    def __init__(self, tokenizer: Tokenizer, context_length: int):
        self.tokenizer = tokenizer
        self.context_length = context_length

    @classmethod
    def from_stem(cls, stem: TextStem, tokenizer: Tokenizer, path: str = "stem"):
        if tokenizer.vocab_size > stem.vocab_size:
            raise FieldError(
                f"{path}.vocab_size",
                f"{stem.vocab_size} is smaller than the tokenizer's vocabulary "
                f"({tokenizer.vocab_size}); ids would overflow the token embedding",
            )
        return cls(tokenizer, stem.context_length)

    def __call__(self, text: str, rng: np.random.Generator | None = None) -> torch.Tensor:
        return self.tokenizer([text], self.context_length)[0]


# ----------------------------------------------------------------------------- factory
def make_transform(
    tower: TowerSpec,
    train: bool,
    tokenizer: Tokenizer | None = None,
    augment: AugmentConfig | None = None,
    name: str = "",
    uint8: bool = False,
) -> Transform:
    """The transform that feeds `tower`'s stem. Text towers need `tokenizer`, except with the
    byte tokenizer's vocabulary size (258), where the byte tokenizer is the default. `uint8`:
    image and video pixels stay uint8, to be normalised on the device (ImageTransform)."""
    stem = tower.stem
    path = f"towers.{name or tower.modality}.stem"
    if isinstance(stem, ImageStem):
        return ImageTransform.from_stem(stem, train, augment, uint8)
    if isinstance(stem, VideoStem):
        return VideoTransform.from_stem(stem, train, augment, uint8)
    if isinstance(stem, AudioStem):
        return AudioTransform.from_stem(stem, train)
    if isinstance(stem, TimeSeriesStem):
        return TimeSeriesTransform.from_stem(stem, train)
    if isinstance(stem, TextStem):
        if tokenizer is None:
            if stem.vocab_size != ByteTokenizer.vocab_size:
                raise FieldError(
                    "tokenizer",
                    f"{path} has vocab_size {stem.vocab_size}: give a tokenizer (a tokenizer.json "
                    "or a CLIP merges file); 'byte' fits only vocab_size 258",
                )
            tokenizer = ByteTokenizer()
        return TextTransform.from_stem(stem, tokenizer, path)
    raise FieldError(path, f"no transform for stem type {type(stem).__name__}")


def make_transforms(
    spec: ModelSpec,
    train: bool,
    tokenizer: Tokenizer | None = None,
    augment: AugmentConfig | None = None,
    uint8: bool = False,
) -> dict[str, Transform]:
    """One transform per tower of `spec`, keyed by tower name (the batch key)."""
    return {
        name: make_transform(tower, train, tokenizer, augment, name, uint8)
        for name, tower in spec.towers.items()
    }


# ----------------------------------------------------------------------------- samples
# Shard member extensions read for each modality, in order of preference.
MODALITY_EXTENSIONS = {
    "image": ("jpg", "jpeg", "png", "webp", "gif"),
    "video": ("mp4", "webm", "mkv", "m4v", "mov"),
    "audio": ("flac", "wav", "ogg", "mp3", "opus", "oga", "m4a"),
    "timeseries": ("npy", "csv"),
    "text": ("txt",),
}


class SampleDecoder:
    """A shard sample (`{"__key__", extension: bytes}`) -> `{tower name: tensor}`.

    Decodes the member of each tower's modality and applies the tower's transform: the
    `decode(sample, rng)` function the streaming loader takes. Decoders work at reduced size
    where they can (JPEGs decoded at 1/2, 1/4 or 1/8 when the crop drawn allows it, video
    scaled down to the smallest size any crop needs). Any problem (missing member, undecodable bytes) raises `MediaError`, which the
    loader counts as a corrupt sample.
    """

    def __init__(
        self,
        spec: ModelSpec,
        train: bool,
        tokenizer: Tokenizer | None = None,
        augment: AugmentConfig | None = None,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        uint8: bool = False,
    ):
        self.spec = spec
        self.transforms = make_transforms(spec, train, tokenizer, augment, uint8)
        self.max_pixels = max_pixels

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        return {name: self.decode_tower(name, sample, rng) for name in self.spec.towers}

    def decode_tower(
        self, name: str, sample: dict[str, Any], rng: np.random.Generator
    ) -> torch.Tensor:
        """The tensor of tower `name` alone (what `__call__` does for each tower, in order)."""
        tower = self.spec.towers[name]
        ext = next((e for e in MODALITY_EXTENSIONS[tower.modality] if e in sample), None)
        if ext is None:
            present = sorted(k for k in sample if k != "__key__")
            raise MediaError(
                f"no {tower.modality} member for tower {name!r} (has {', '.join(present)}; "
                f"expected one of {', '.join(MODALITY_EXTENSIONS[tower.modality])})"
            )
        transform = self.transforms[name]
        if isinstance(transform, ImageTransform):
            # Crop first, then decode only as many pixels as that crop needs.
            return transform.decode(sample[ext], rng, self.max_pixels)
        return transform(self._decode(transform, tower.stem, ext, sample[ext]), rng)

    def _decode(self, transform: Transform, stem: Any, ext: str, data: bytes) -> Any:
        if isinstance(transform, VideoTransform):
            size = transform.image.min_decode_size()
            clip = decode_video(data, transform.frames, short_side=size, max_pixels=self.max_pixels)
            return clip.frames
        if isinstance(transform, AudioTransform):
            return decode_audio(data, stem.sample_rate)
        if isinstance(transform, TimeSeriesTransform):
            return decode_timeseries(data, ext)
        return decode_text(data)


# ----------------------------------------------------------------------------- collate
def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack per-sample tensors into a batch, key by key.

    Every sample must have the same keys and, per key, the same tensor shape (the transforms
    guarantee it); other values (e.g. "__key__" strings) are gathered into lists.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    keys = list(samples[0])
    batch: dict[str, Any] = {}
    for i, sample in enumerate(samples):
        if set(sample) != set(keys):
            raise ValueError(f"sample {i} has keys {sorted(sample)}, sample 0 has {sorted(keys)}")
    for key in keys:
        values = [sample[key] for sample in samples]
        if not all(isinstance(v, torch.Tensor) for v in values):
            batch[key] = values
            continue
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(f"cannot stack {key!r}: samples have shapes {sorted(shapes)}")
        batch[key] = torch.stack(values)
    return batch
