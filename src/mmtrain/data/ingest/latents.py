"""Image shards -> latent shards: every image encoded once by a VAE (models/vae.py), what a
latent denoiser then trains on without running the VAE at every step.

Each sample's image becomes the centred square at `size` (bicubic, [-1, 1]), its latent mean
scaled as the denoiser sees it (`to_diffusion`: the VAE's shift and scaling factor) and stored
as a float32 `.npy` member; the sample's other members (`.cls`, `.json`, `.txt`) are copied, so
its class or caption comes along. `flip` adds each image's mirror image as a sample of its own
(key + "_flip"): augmentation is stored as data, never baked in behind the user's back. A
sample whose image does not decode is skipped and counted; the manifest records the VAE, the
size and the counts.

With a `text_encoder` (data/ingest/text_features.py) each sample also gets an MMDiT's cached
text from its caption (`.txt`): `.text_hidden.npy` [text_tokens, text_width] and
`.text_pooled.npy` [pooled_width], float32, its mirror image the same arrays. A sample without
a readable caption is skipped and counted (`no_caption`), and the manifest's latent section
records the encoder. A pipeline's own encoders (data/ingest/pipeline_encoders.py) serve as
`text_encoder` too; `provenance` (the pipeline, each component's identity: its folder and
config sha256) goes into the manifest's latent section as it is.

With `buckets` (pixel shapes (H, W), multiples of the VAE's downscale) each image is encoded
at its aspect-ratio bucket instead of the square: the rule of `data.buckets`
(data/stream/buckets.py: the nearest aspect ratio, resized to cover it and centre-cropped),
so a latent denoiser trains on the latents with `data.buckets` of the latent shapes (each
side / the downscale; a latent's bucket is its own shape). Images are encoded in batches of
one bucket; the manifest lists the buckets and how many latents each holds.

Clips, through a video VAE (Wan's AutoencoderKLWan), are video_latents.py's; it shares the
batching and the caption stage here (`batches_of_one_shape`, `with_text`).
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmtrain.data.ingest.pipeline_encoders import PipelineTextEncoder
from mmtrain.data.ingest.text_features import TextEncoder
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.buckets import Buckets, cover_crop
from mmtrain.data.stream.media import LazyImage, MediaError, decode_text
from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS, AugmentConfig, ImageTransform
from mmtrain.models.vae import AutoencoderKL

IMAGE_EXTENSIONS = set(MODALITY_EXTENSIONS["image"])


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


class BucketCrop:
    """Image bytes -> float32 [3, H, W] in [-1, 1] at the image's bucket, as a VAE takes it."""

    def __init__(self, shapes: Sequence[Sequence[int]]):
        self.buckets = Buckets(tuple(tuple(shape) for shape in shapes), "image")

    def decode(self, data: bytes) -> torch.Tensor:
        image = LazyImage(data)
        shape = self.buckets.shapes[self.buckets.assign((image.height, image.width))]
        pixels = np.asarray(cover_crop(image, shape).convert("RGB"), dtype=np.float32)
        return torch.from_numpy(pixels / 127.5 - 1.0).permute(2, 0, 1).contiguous()


def _images(source: ShardSet, transform: Any, counts: dict[str, int]) -> Iterator:
    """(key, image [3, H, W] in [-1, 1], members to copy) per decodable sample."""
    for i in range(len(source)):
        sample = source.read(i)
        ext = next((e for e in MODALITY_EXTENSIONS["image"] if e in sample), None)
        _refuse_video(sample, ext, source.key(i))
        try:
            if ext is None:
                raise MediaError("no image member")
            image = transform.decode(sample[ext])
        except MediaError:
            counts["skipped"] += 1
            continue
        kept = {k: v for k, v in sample.items() if k != "__key__" and k not in IMAGE_EXTENSIONS}
        yield source.key(i), image, kept


def _refuse_video(sample: dict[str, Any], image: str | None, key: str) -> None:
    """A video clip is refused, not skipped as an unreadable image: an image VAE would leave
    the whole set out and report success with no latent written."""
    clip = next((e for e in MODALITY_EXTENSIONS["video"] if e in sample), None)
    if image is None and clip is not None:
        raise ValueError(
            f"sample {key} holds a video clip (.{clip}) and no image: the VAE encodes images, "
            "one at a time; video latents need a video VAE: give --pipeline a WanPipeline "
            "folder, or --vae a folder of diffusers' AutoencoderKLWan"
        )


def batches_of_one_shape(items: Iterator, batch_size: int) -> Iterator[list]:
    """Batches of (key, payload, ...) items whose payloads (images, or the clips of
    video_latents.py) have one `.shape`, in the order they fill up; the partial ones last."""
    pending: dict[tuple[int, ...], list] = {}
    for item in items:
        shape = tuple(item[1].shape)
        pending.setdefault(shape, []).append(item)
        if len(pending[shape]) == batch_size:
            yield pending.pop(shape)
    yield from pending.values()


@torch.no_grad()
def encode_latent_shards(
    source: str | Path,
    vae: AutoencoderKL,
    out: str | Path,
    *,
    size: int = 0,
    flip: bool = False,
    batch_size: int = 16,
    vae_name: str = "",
    text_encoder: TextEncoder | PipelineTextEncoder | None = None,
    buckets: Sequence[Sequence[int]] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Encode the images of the shards at `source` into latent shards in `out` (the square at
    `size`, or each at its pixel bucket of `buckets`; with `text_encoder`, their captions'
    cached text too); the counts."""
    shards = ShardSet.open(source)
    if len(shards):  # before anything is written
        first = shards.read(0)
        image = next((e for e in MODALITY_EXTENSIONS["image"] if e in first), None)
        _refuse_video(first, image, shards.key(0))
    if buckets:
        transform: Any = BucketCrop(buckets)
    else:
        half = (0.5, 0.5, 0.5)  # (x / 255 - 0.5) / 0.5: the [-1, 1] a VAE takes
        transform = ImageTransform(size, train=False, augment=AugmentConfig(mean=half, std=half))
    param = next(vae.parameters())
    counts = {"samples": 0, "skipped": 0}
    items = _images(shards, transform, counts)
    if text_encoder is not None:
        counts["no_caption"] = 0
        items = with_text(items, text_encoder, batch_size, counts)
    per_bucket: dict[str, int] = {}
    with ShardWriter(out) as writer:
        for batch in batches_of_one_shape(items, batch_size):
            written = _write(writer, vae, batch, flip, param)
            counts["samples"] += written
            shape = "x".join(map(str, batch[0][1].shape[1:]))
            per_bucket[shape] = per_bucket.get(shape, 0) + written
    latent = {"vae": vae_name, "size": size, "channels": vae.config.latent_channels,
              "scaling_factor": vae.config.scaling_factor, "flip": flip}  # fmt: skip
    if buckets:
        down = vae.config.downscale()
        latent["buckets"] = [{"pixels": list(b), "latent": [n // down for n in b],
                              "samples": per_bucket.get("x".join(map(str, b)), 0)}
                             for b in buckets]  # fmt: skip
    if text_encoder is not None:
        latent["text_encoder"] = text_encoder.record()
    latent.update(provenance or {})
    write_manifest(out, writer.shards, modalities=["latent"], counts=counts, latent=latent)
    return counts


def _write(writer: ShardWriter, vae: AutoencoderKL, batch: list, flip: bool, param) -> int:
    images = torch.stack([image for _, image, _ in batch]).to(param.device, param.dtype)
    variants = [("", images)] + ([("_flip", images.flip(-1))] if flip else [])
    written = 0
    for suffix, pixels in variants:
        latents = vae.to_diffusion(vae.encode_latent(pixels)).float().cpu().numpy()
        for (key, _, kept), latent in zip(batch, latents, strict=True):
            writer.write({"__key__": key + suffix, "npy": npy_bytes(latent), **kept})
            written += 1
    return written


def with_text(
    items: Iterator, encoder: TextEncoder | PipelineTextEncoder, batch_size: int, counts: dict
) -> Iterator:
    """`items` ((key, payload, members to copy)) with their caption's cached text members
    added to the members they copy, captions encoded `batch_size` at a time; a sample without a
    readable `.txt` is skipped and counted (a text-conditioned denoiser trains on none of them:
    refusing it here beats a hole in the data). The payload passes through untouched."""
    pending: list[tuple[str, torch.Tensor, dict, str]] = []

    def encoded() -> Iterator:
        hidden, pooled = encoder([caption for *_, caption in pending])
        for (key, image, kept, _), h, p in zip(pending, hidden, pooled, strict=True):
            arrays = {"text_hidden.npy": npy_bytes(h.numpy())}
            if encoder.shape.pooled_width:  # Wan's transformer takes none: no member
                arrays["text_pooled.npy"] = npy_bytes(p.numpy())
            yield key, image, {**kept, **arrays}

    for key, image, kept in items:
        try:
            caption = decode_text(kept["txt"], what="caption") if "txt" in kept else None
        except MediaError:
            caption = None
        if caption is None:
            counts["no_caption"] += 1
            continue
        pending.append((key, image, kept, caption))
        if len(pending) == batch_size:
            yield from encoded()
            pending = []
    if pending:
        yield from encoded()
