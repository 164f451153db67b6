"""A denoiser's inputs from shard samples: the clean image or latent and its condition.

Images are the centred square of the sample at the denoiser's `sample_size` (bicubic), in
[-1, 1] (mean 0.5, std 0.5 per channel), flipped at random in training as DiT trains; a latent
is a `.npy` (or `.latent.npy`) member holding exactly the denoiser's [C, H, W] (a VAE's
encoding made beforehand). A DiT's class comes from `.cls` or the `.json` member's
`label_field` (labels.py). A text-conditioned denoiser's text is its text encoders' outputs,
cached beside the latent as they are: `.text_hidden.npy` [text_tokens, text_width] and, for an
MMDiT, `.text_pooled.npy` [pooled_width] (float .npy arrays; their guidance dropout is the
objective's). A cross-attention DiT (Wan) takes the hidden states alone: its video latent is
[C, T, H, W] (`.latent.npy`, data/ingest/video_latents.py), and no pooled member is read.

With `buckets` (data.buckets, buckets.py) a sample keeps its own shape class: an image is
resized to cover its bucket and centre-cropped to it (flipped at random in training), a clip's
frames are its bucket's count, a latent is read at its own (bucket) shape.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.buckets import (
    LATENT_MEMBERS,
    NO_BUCKET,
    Buckets,
    cover_crop,
    npy_shape,
    probe_size,
    video_size,
)
from mmtrain.data.stream.labels import read_class
from mmtrain.data.stream.media import (
    DEFAULT_MAX_PIXELS,
    LazyImage,
    MediaError,
    decode_latent,
    decode_video,
)
from mmtrain.data.stream.transforms import (
    MODALITY_EXTENSIONS,
    AugmentConfig,
    ImageTransform,
    VideoTransform,
)
from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.spec import ModelSpec
from mmtrain.structured import FieldError

TEXT_MEMBERS = {"text_hidden": "text_hidden.npy", "text_pooled": "text_pooled.npy"}


class DenoiserDecoder:
    """A shard sample -> a denoiser's clean input and condition: "image" (the centred square at
    `sample_size`, in [-1, 1]; flipped at random in training) or "latent" (a `.npy` member of
    the denoiser's [C, (T,) H, W]), "class" when the denoiser is class-conditional, and the
    cached text it takes (`text_members`: "text_hidden", and "text_pooled" for an MMDiT). A video's
    frames are spread over its clip, or with `video_stride` a window of every stride-th frame
    (`decode_video`'s `window`) at a random place in training, the middle in evaluation."""

    def __init__(
        self,
        spec: ModelSpec,
        label_field: str = "label",
        class_names: Sequence[str] = (),
        uint8_pixels: bool = False,
        train: bool = True,
        video_stride: int | None = None,
        buckets: Buckets | None = None,
    ):
        assert spec.denoiser is not None
        self.train, self.video_stride, self.buckets = train, video_stride, buckets
        self.denoiser = spec.denoiser
        self.label_field, self.class_names = label_field, list(class_names)
        self.transform = self.video = None
        half = (0.5,) * self.denoiser.channels  # (x / 255 - 0.5) / 0.5: [-1, 1]
        # A full-area crop: the centred square of a non-square image; the flip in training.
        augment = AugmentConfig(scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=train, mean=half, std=half)
        d = self.denoiser
        if d.input == "image":
            self.transform = ImageTransform(d.sample_size, True, d.channels, augment, uint8_pixels)
        elif d.input == "video":  # one crop and flip for the whole clip; normalised here,
            # as the device's uint8 path normalises [..., C, H, W] and a clip is [C, T, H, W]
            self.video = VideoTransform(d.sample_size, d.frames, True, d.channels, augment)
        self.max_pixels = DEFAULT_MAX_PIXELS

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator) -> dict[str, torch.Tensor]:
        d = self.denoiser
        if self.buckets is not None:
            out = {d.input: self._in_bucket(sample, rng)}
        elif self.transform is not None:
            out = {"image": self.transform.decode(sample[_member(sample, "image")], rng)}
        elif self.video is not None:
            size = self.video.image.min_decode_size()
            data = sample[_member(sample, "video")]
            clip = decode_video(data, d.frames, short_side=size, max_pixels=self.max_pixels,
                                window=self._window(rng))  # fmt: skip
            out = {"video": self.video(clip.frames, rng).transpose(0, 1)}  # [C, T, H, W]
        else:
            member = next((m for m in LATENT_MEMBERS if m in sample), None)
            if member is None:
                raise MediaError("no .npy latent member (the denoiser's input is `latent`)")
            latent = decode_latent(sample[member], d.sample_shape())
            out = {"latent": torch.from_numpy(latent)}
        if d.num_classes:
            out["class"] = read_class(sample, d.num_classes, self.label_field, self.class_names)
        shapes = {"text_hidden": (d.text_tokens, d.text_width), "text_pooled": (d.pooled_width,)}
        for key in d.text_members():
            out[key] = torch.from_numpy(_cached_text(sample, TEXT_MEMBERS[key], shapes[key]))
        return out

    def _in_bucket(self, sample: dict[str, Any], rng: np.random.Generator) -> torch.Tensor:
        """The clean sample at the shape of its bucket (module docstring)."""
        d, buckets = self.denoiser, self.buckets
        assert buckets is not None
        if d.input == "latent":
            size = probe_size(sample, "latent")
            if buckets.assign(size) == NO_BUCKET:
                raise MediaError(f"latent of size {list(size)} is in none of data.buckets")
            member = next(m for m in LATENT_MEMBERS if m in sample)
            return torch.from_numpy(decode_latent(sample[member], (d.channels, *size)))
        data = sample[_member(sample, d.input)]
        if d.input == "image":
            image = LazyImage(data, self.max_pixels)
            shape = self._bucket_of(buckets, (image.height, image.width))
            return self._fit(image, shape, self._flip(rng))
        size = video_size(data, self.max_pixels)
        frames, height, width = self._bucket_of(buckets, size)
        scale = max(height / size[1], width / size[2])  # decode no larger than the crop needs
        clip = decode_video(data, frames, short_side=math.ceil(scale * min(size[1:])),
                            max_pixels=self.max_pixels, window=self._window(rng))  # fmt: skip
        flip = self._flip(rng)
        return torch.stack([self._fit(f, (height, width), flip) for f in clip.frames], dim=1)

    @staticmethod
    def _bucket_of(buckets: Buckets, size: tuple[int, ...]) -> tuple[int, ...]:
        bucket = buckets.assign(size)
        if bucket == NO_BUCKET:
            raise MediaError(f"a sample of size {list(size)} is in none of data.buckets")
        return buckets.shapes[bucket]

    def _flip(self, rng: np.random.Generator) -> bool:
        return self.train and bool(rng.random() < 0.5)

    def _fit(self, image: LazyImage | np.ndarray, shape: Sequence[int], flip: bool) -> torch.Tensor:
        """An image (or a decoded frame) covering `shape` (`cover_crop`), flipped, normalised as
        the square transform normalises."""
        out = cover_crop(image, shape, self.denoiser.channels)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = np.asarray(out)
        normalise = (self.transform or self.video.image).normalise  # type: ignore[union-attr]
        return normalise(pixels[:, :, None] if pixels.ndim == 2 else pixels)

    def _window(self, rng: np.random.Generator) -> tuple[float, int] | None:
        """Where a clip's frames come from: a window at a random place in training, the middle
        one in evaluation, or (no stride) the frames spread over the whole clip."""
        if self.video_stride is None:
            return None
        return (float(rng.random()) if self.train else 0.5), self.video_stride


def check_first_samples(
    sources: Sequence[ShardSet], spec: ModelSpec, buckets: Buckets | None = None
) -> None:
    """Before the first step: the first sample of each source against what the denoiser takes
    (a latent's [C, (T,) H, W], the cached text features' shapes), so that latents of another
    VAE or features of another text encoder fail at once with FieldError naming the spec field,
    the shard and the sample's shape, instead of being skipped one by one as corrupt."""
    d = spec.denoiser
    assert d is not None
    for i, source in enumerate(sources):
        if len(source) == 0:
            continue
        sample = source.read(0)
        where = f"data.train[{i}] ({source.shard_path(0).name}, sample {source.key(0)!r})"
        if d.input == "latent":
            _check_latent(sample, d, buckets, where)
        if d.takes_text():
            _check_text_features(sample, d, where, from_pipeline=spec.hub is not None)


def _check_latent(sample: dict[str, Any], d: DenoiserSpec, buckets: Buckets | None,
                  where: str) -> None:  # fmt: skip
    member = next((m for m in LATENT_MEMBERS if m in sample), None)
    if member is None:
        return  # no latent at all: a sample the loader counts as corrupt, like any other
    try:
        shape = npy_shape(sample[member])
    except MediaError:
        return
    want = d.sample_shape()
    if len(shape) != len(want):
        raise FieldError(
            "denoiser.frames",
            f"{where} holds a latent of shape {list(shape)}; the spec's denoiser takes "
            f"{list(want)} ([C, T, H, W] for a video denoiser, [C, H, W] otherwise)",
        )
    if shape[0] != d.channels:
        raise FieldError(
            "denoiser.channels",
            f"{where} holds a latent of shape {list(shape)}: {shape[0]} channels, the spec's "
            f"denoiser takes {d.channels}; latents of another VAE need a spec made for it",
        )
    size = tuple(shape[1:])
    if buckets is not None or size == tuple(want[1:]):
        return  # buckets take their own shapes (a sample in none is skipped and counted)
    field = "denoiser.frames" if d.is_video() and size[0] != d.frames else "denoiser.sample_size"
    raise FieldError(
        field,
        f"{where} holds a latent of shape {list(shape)}, the spec's denoiser takes "
        f"{list(want)}; set the spec's size to the latents' or give data.buckets: "
        f"[{list(size)}] (a bucket of the latents' size)",
    )


def _check_text_features(sample: dict[str, Any], d: DenoiserSpec, where: str,
                         from_pipeline: bool = False) -> None:  # fmt: skip
    """The text members the denoiser reads against its spec's widths and length (FieldError
    naming the field); `from_pipeline`: a hub model's spec, made from its pipeline folder, which
    has no spec file to edit: the advice is to encode the captions again."""
    fields = {
        "text_hidden": (
            ("denoiser.text_tokens", "denoiser.text_width"),
            (d.text_tokens, d.text_width),
        ),
        "text_pooled": (("denoiser.pooled_width",), (d.pooled_width,)),
    }
    for key in d.text_members():
        member = TEXT_MEMBERS[key]
        if member not in sample:
            continue
        try:
            shape = npy_shape(sample[member])
        except MediaError:
            continue
        names, want = fields[key]
        if tuple(shape) == want:
            continue
        wrong = [n for n, a, b in zip(names, shape, want, strict=False) if a != b] or [names[0]]
        if wrong[0] == "denoiser.text_tokens":  # the usual one: a spec converted elsewhere
            again = (f"encode the captions again for {want[0]} tokens (`encode-latents "
                     f"--max-sequence-length {want[0]}` with a pipeline)")  # fmt: skip
            # A pipeline's transformer takes any caption length: a spec file may say another
            # (a run folder's spec.yaml, edited, as `model:` beside `init: PIPELINE_DIR`).
            where_set = ("a spec file of the pipeline's transformer given as `model:` beside "
                         "`init:` (a run's spec.yaml is one)" if from_pipeline else "the spec")  # fmt: skip
            fix = f"set denoiser.text_tokens: {shape[0]} in {where_set}, or {again}"
            raise FieldError(
                wrong[0],
                f"{where}: `mmtrain data encode-latents` wrote {shape[0]} text tokens a caption "
                f"(.{member} {list(shape)}) and the spec's denoiser takes {want[0]}; {fix}",
            )
        raise FieldError(
            wrong[0],
            f"{where} holds .{member} of shape {list(shape)}, the spec's denoiser takes "
            f"{list(want)} ({', '.join(names)}); features of another text encoder need a spec "
            "made for it, or encode the captions again with the spec's encoders",
        )


def _member(sample: dict[str, Any], modality: str) -> str:
    ext = next((e for e in MODALITY_EXTENSIONS[modality] if e in sample), None)
    if ext is None:
        raise MediaError(
            f"no {modality} member (expected one of {', '.join(MODALITY_EXTENSIONS[modality])})"
        )
    return ext


def _cached_text(sample: dict[str, Any], member: str, shape: tuple[int, ...]) -> np.ndarray:
    """A text encoder's cached output: a float .npy member of exactly `shape`, as float32."""
    if member not in sample:
        raise MediaError(f"no .{member} member (the denoiser reads its text encoders' outputs)")
    try:
        array = np.load(io.BytesIO(sample[member]), allow_pickle=False)
    except MemoryError:
        raise
    except Exception as err:  # ValueError (pickled objects, bad header), EOFError (truncated)
        raise MediaError(f".{member} is not a readable .npy array: {err}") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind != "f":
        raise MediaError(f".{member} must be a float array, got {getattr(array, 'dtype', array)}")
    if tuple(array.shape) != shape:
        raise MediaError(
            f".{member} of shape {list(array.shape)}, the denoiser takes {list(shape)}"
        )
    if not np.isfinite(array).all():
        raise MediaError(f".{member} holds non-finite values")
    return array.astype(np.float32)
