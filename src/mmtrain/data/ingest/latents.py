"""Image shards -> latent shards: every image encoded once by a VAE (models/vae.py), what a
latent denoiser then trains on without running the VAE at every step.

Each sample's image becomes the centred square at `size` (bicubic, [-1, 1]), its latent mean
scaled as the denoiser sees it (`to_diffusion`: the VAE's shift and scaling factor) and stored
as a float32 `.npy` member; the sample's other members (`.cls`, `.json`, `.txt`) are copied, so
its class or caption comes along. `flip` adds each image's mirror image as a sample of its own
(key + "_flip"): augmentation is stored as data, never baked in behind the user's back. A
sample whose image does not decode is skipped and counted; the manifest records the VAE, the
size and the counts.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.media import MediaError
from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS, AugmentConfig, ImageTransform
from mmtrain.models.vae import AutoencoderKL

IMAGE_EXTENSIONS = set(MODALITY_EXTENSIONS["image"])


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def _images(source: ShardSet, transform: ImageTransform, counts: dict[str, int]) -> Iterator:
    """(key, image [3, size, size] in [-1, 1], members to copy) per decodable sample."""
    for i in range(len(source)):
        sample = source.read(i)
        ext = next((e for e in MODALITY_EXTENSIONS["image"] if e in sample), None)
        try:
            if ext is None:
                raise MediaError("no image member")
            image = transform.decode(sample[ext])
        except MediaError:
            counts["skipped"] += 1
            continue
        kept = {k: v for k, v in sample.items() if k != "__key__" and k not in IMAGE_EXTENSIONS}
        yield source.key(i), image, kept


@torch.no_grad()
def encode_latent_shards(
    source: str | Path,
    vae: AutoencoderKL,
    out: str | Path,
    *,
    size: int,
    flip: bool = False,
    batch_size: int = 16,
    vae_name: str = "",
) -> dict[str, Any]:
    """Encode the images of the shards at `source` into latent shards in `out`; the counts."""
    shards = ShardSet.open(source)
    half = (0.5, 0.5, 0.5)  # (x / 255 - 0.5) / 0.5: the [-1, 1] a VAE takes
    transform = ImageTransform(size, train=False, augment=AugmentConfig(mean=half, std=half))
    param = next(vae.parameters())
    counts = {"samples": 0, "skipped": 0}
    with ShardWriter(out) as writer:
        batch: list[tuple[str, torch.Tensor, dict]] = []
        for item in _images(shards, transform, counts):
            batch.append(item)
            if len(batch) == batch_size:
                counts["samples"] += _write(writer, vae, batch, flip, param)
                batch = []
        if batch:
            counts["samples"] += _write(writer, vae, batch, flip, param)
    latent = {"vae": vae_name, "size": size, "channels": vae.config.latent_channels,
              "scaling_factor": vae.config.scaling_factor, "flip": flip}  # fmt: skip
    write_manifest(out, writer.shards, modalities=["latent"], counts=counts, latent=latent)
    return counts


def _write(writer: ShardWriter, vae: AutoencoderKL, batch: list, flip: bool, param) -> int:
    images = torch.stack([image for _, image, _ in batch]).to(param.device, param.dtype)
    variants = [("", images)] + ([("_flip", images.flip(-1))] if flip else [])
    written = 0
    for suffix, pixels in variants:
        latents = vae.to_diffusion(vae.encode_latent(pixels)).float().cpu().numpy()
        for (key, _, kept), latent in zip(batch, latents, strict=True):
            writer.write({"__key__": key + suffix, "npy": _npy(latent), **kept})
            written += 1
    return written
