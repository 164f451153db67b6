"""Clip shards -> video latent shards: every clip encoded once by a diffusers video VAE (Wan
2.x's AutoencoderKLWan, run as diffusers' own class), what a latent video denoiser then trains
on without running the VAE at every step.

Frames: the clip's first F frames, consecutive at its own rate. By default F is every frame
that fits the VAE's rule F = 1 + k x step (step: its `scale_factor_temporal`, 4 for Wan;
`VideoVAE.frame_step` says when the encoder needs more); `frames` takes exactly that many, and a
clip shorter than it is refused by key (never skipped: a set of short clips would otherwise
end as a set of nothing). Each frame is resized to cover `size` x `size` and centre-cropped
(bicubic), or with `buckets` (frames x height x width) the clip goes to its bucket by the rule
of data/stream/buckets.py (the nearest aspect ratio among the buckets whose frames it holds,
then the most frames) and takes that bucket's frames and size. An image is a 1-frame clip, as
Wan trains on images: [3, 1, H, W] at `size`, or in a 1-frame bucket.

Pixels in [-1, 1], [B, 3, F, H, W], go into `vae.encode(...).latent_dist.mean`, normalised as
WanPipeline un-normalises its latents before decoding: (z - latents_mean) / latents_std, per
channel. Each sample stores `.latent.npy` float32 [C, 1 + (F - 1) / T, H / s, W / s] (T the
temporal factor, s the spatial) and copies its other members (.txt, .json); with a text
encoder, its caption's cached text too (latents.py's `with_text`). Clips are planned from their
headers, captions encoded, and only then decoded, batch by batch of one shape (a decoded clip
is large; its plan is its bytes). A sample that does not decode is skipped and counted. The
manifest's latent section records the VAE and its normalisation, the frames asked for, and the
shapes (pixels, latent, samples) written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from mmtrain.data.ingest.latents import batches_of_one_shape, npy_bytes, with_text
from mmtrain.data.ingest.pipeline_encoders import PipelineTextEncoder
from mmtrain.data.ingest.text_features import TextEncoder
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.buckets import NO_BUCKET, Buckets, cover_crop
from mmtrain.data.stream.media import LazyImage, MediaError, decode_video, video_header
from mmtrain.data.stream.transforms import MODALITY_EXTENSIONS

__all__ = [
    "VIDEO_VAES",
    "VideoVAE",
    "VideoVAEError",
    "encode_video_latent_shards",
    "load_video_vae",
    "vae_class_name",
]

log = logging.getLogger(__name__)

VIDEO_VAES = ("AutoencoderKLWan",)  # diffusers classes whose normalisation mmtrain knows
LATENT_MEMBER = "latent.npy"
CONFIG_FILE = "config.json"


class VideoVAEError(ValueError):
    """A folder that cannot serve as a video VAE; the message names it and why."""


def vae_class_name(folder: str | Path) -> str | None:
    """The `_class_name` of a diffusers VAE folder's config.json; None when it has no readable
    one (the native AutoencoderKL reader then says what is wrong)."""
    try:
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    name = config.get("_class_name") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


@dataclass
class VideoVAE:
    """A diffusers video VAE in eval mode and what encoding with it takes."""

    model: Any  # diffusers' AutoencoderKLWan
    folder: Path
    class_name: str
    temporal: int  # scale_factor_temporal: source frames per latent frame after the first
    spatial: int  # scale_factor_spatial: pixels per latent position, each side
    channels: int
    frame_step: int  # frames the encoder consumes per latent frame group (_measured_frame_step)

    def rule(self) -> str:
        """The clip lengths it takes, as a reader sees them."""
        s = self.frame_step
        text = f"1 + {s}k frames (1, {1 + s}, {1 + 2 * s}, ...)"
        if s != self.temporal:
            text += (f": its scale_factor_temporal is {self.temporal}, and its encoder takes the "
                     f"frames after the first {s} at a time")  # fmt: skip
        return text

    def check_frames(self, frames: int) -> None:
        """ValueError naming the rule when `frames` is no clip length the VAE takes."""
        if frames < 1 or (frames - 1) % self.frame_step:
            raise ValueError(f"the VAE ({self.class_name} of {self.folder}) takes {self.rule()}")

    def frames_that_fit(self, total: int) -> int:
        """The longest clip length the VAE takes within `total` frames."""
        return 1 + (total - 1) // self.frame_step * self.frame_step

    def latent_shape(self, pixels: Sequence[int]) -> tuple[int, int, int]:
        """(T', H', W') of a clip of (F, H, W) pixels."""
        frames, height, width = pixels
        return 1 + (frames - 1) // self.temporal, height // self.spatial, width // self.spatial

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, F, H, W] in [-1, 1] -> the normalised latent mean [B, C, T', H', W'], in the
        VAE's dtype on its device."""
        param = next(self.model.parameters())
        z = self.model.encode(pixels.to(param.device, param.dtype)).latent_dist.mean
        config, shape = self.model.config, (1, self.channels, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, dtype=z.dtype, device=z.device).view(shape)
        std = torch.tensor(config.latents_std, dtype=z.dtype, device=z.device).view(shape)
        return (z - mean) / std

    def record(self) -> dict[str, Any]:
        """What the manifest keeps of its encoding."""
        config = self.model.config
        return {"vae_class": self.class_name, "channels": self.channels,
                "latents_mean": list(config.latents_mean), "latents_std": list(config.latents_std),
                "normalised": "(z - latents_mean) / latents_std"}  # fmt: skip


def load_video_vae(
    folder: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> VideoVAE:
    """The video VAE of a diffusers VAE folder (a class of VIDEO_VAES), loaded by diffusers'
    own class in `dtype` on `device`; VideoVAEError naming the class otherwise."""
    import diffusers

    folder = Path(folder)
    name = vae_class_name(folder)
    if name not in VIDEO_VAES:
        raise VideoVAEError(f"{folder}: {CONFIG_FILE} names {name!r}; mmtrain encodes clips with "
                            f"{', '.join(VIDEO_VAES)}")  # fmt: skip
    try:
        model = getattr(diffusers, name).from_pretrained(folder, torch_dtype=dtype,
                                                         local_files_only=True)  # fmt: skip
    except (OSError, ValueError) as err:
        raise VideoVAEError(f"{folder}: {name} does not load ({err})") from None
    model = model.to(device).eval()
    config = model.config
    temporal, spatial = int(config.scale_factor_temporal), int(config.scale_factor_spatial)
    step = _measured_frame_step(model, temporal, spatial)
    if step != temporal:
        log.info("%s of %s: clips of 1 + %dk frames (its encoder's chunks), not 1 + %dk",
                 name, folder, step, temporal)  # fmt: skip
    return VideoVAE(model, folder, name, temporal, spatial, int(config.z_dim), step)


@torch.no_grad()
def _measured_frame_step(model: Any, temporal: int, spatial: int) -> int:
    """The clip lengths the encoder consumes whole: 1 + k x step frames give 1 + k x step /
    temporal latent frames. The config's temporal factor, unless the encoder reads the frames
    in larger chunks (diffusers' AutoencoderKLWan encodes the frames after the first 4 at a
    time, so a VAE with a factor of 2 silently drops the last 2 of 7 frames): measured once on
    a blank clip two latent positions wide."""
    param = next(model.parameters())
    side = 2 * spatial
    for multiple in range(1, 9):
        frames = 1 + multiple * temporal
        blank = torch.zeros(1, 3, frames, side, side, device=param.device, dtype=param.dtype)
        if model.encode(blank).latent_dist.mean.shape[2] == 1 + multiple:
            return multiple * temporal
    raise VideoVAEError(
        f"{type(model).__name__}: no clip of up to 1 + 8 x {temporal} frames encodes into "
        f"1 + frames / {temporal} latent frames; its scale_factor_temporal does not describe it"
    )


class ClipPlan(NamedTuple):
    """What to decode of a sample: its bytes, and the frames and size it is encoded at."""

    data: bytes
    kind: str  # "video" or "image"
    frames: int  # the clip's first `frames` frames (1: an image)
    fps: float
    size: tuple[int, int]  # (H, W) pixels after the cover crop

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (3, self.frames, *self.size)

    def decode(self) -> torch.Tensor:
        """float32 [3, F, H, W] in [-1, 1]; MediaError when the bytes do not decode."""
        if self.kind == "image":
            frames = [np.asarray(cover_crop(LazyImage(self.data), self.size).convert("RGB"))]
        else:
            times = [(i + 0.5) / self.fps for i in range(self.frames)]  # inside frame i
            clip = decode_video(self.data, self.frames, times_s=times)
            frames = [np.asarray(cover_crop(f, self.size)) for f in clip.frames]
        pixels = np.stack(frames).astype(np.float32)
        return torch.from_numpy(pixels / 127.5 - 1.0).permute(3, 0, 1, 2).contiguous()


class _Shapes:
    """How each sample's frames and size are chosen (module docstring)."""

    def __init__(self, vae: VideoVAE, size: int, frames: int | None,
                 buckets: Sequence[Sequence[int]] | None):  # fmt: skip
        self.vae, self.size, self.frames = vae, size, frames
        self.buckets = Buckets(tuple(tuple(b) for b in buckets), "video") if buckets else None

    def of_image(self, key: str, height: int, width: int) -> tuple[int, int, int]:
        if self.buckets is None:
            return (1, self.size, self.size)
        bucket = self.buckets.assign((1, height, width))
        if bucket == NO_BUCKET:
            raise ValueError(f"sample {key} is an image, a 1-frame clip, and --buckets lists no "
                             "bucket of 1 frame (1xHxW): add one, or leave images out")  # fmt: skip
        return self.buckets.shapes[bucket]

    def of_clip(self, key: str, total: int, height: int, width: int) -> tuple[int, int, int]:
        if total < 1:
            raise MediaError("the clip's headers count no frames")
        if self.buckets is not None:
            bucket = self.buckets.assign((total, height, width))
            if bucket == NO_BUCKET:
                fewest = min(shape[0] for shape in self.buckets.shapes)
                raise ValueError(f"sample {key}: a clip of {total} frames, shorter than every "
                                 f"bucket of --buckets (the fewest: {fewest} frames); give "
                                 "longer clips or a bucket of fewer frames")  # fmt: skip
            return self.buckets.shapes[bucket]
        if self.frames is None:
            return (self.vae.frames_that_fit(total), self.size, self.size)
        if total < self.frames:
            raise ValueError(f"sample {key}: a clip of {total} frames, shorter than --frames "
                             f"{self.frames}; give clips of {self.frames} frames or more, or "
                             f"fewer --frames (the VAE takes {self.vae.rule()})")  # fmt: skip
        return (self.frames, self.size, self.size)


def _plans(source: ShardSet, shapes: _Shapes, counts: dict[str, int]) -> Iterator:
    """(key, ClipPlan, members to copy) per sample whose headers read (the others counted)."""
    for i in range(len(source)):
        sample, key = source.read(i), source.key(i)
        clip = next((e for e in MODALITY_EXTENSIONS["video"] if e in sample), None)
        image = next((e for e in MODALITY_EXTENSIONS["image"] if e in sample), None)
        try:
            if clip is not None:
                total, height, width, fps = video_header(sample[clip])
                frames, *size = shapes.of_clip(key, total, height, width)
                plan = ClipPlan(sample[clip], "video", frames, fps, tuple(size))
            elif image is not None:
                picture = LazyImage(sample[image])
                frames, *size = shapes.of_image(key, picture.height, picture.width)
                plan = ClipPlan(sample[image], "image", 1, 0.0, tuple(size))
            else:
                raise MediaError("no clip or image member")
        except MediaError:
            counts["skipped"] += 1
            continue
        kept = {k: v for k, v in sample.items() if k not in ("__key__", clip, image)}
        yield key, plan, kept


@torch.no_grad()
def encode_video_latent_shards(
    source: str | Path,
    vae: VideoVAE,
    out: str | Path,
    *,
    size: int = 0,
    frames: int | None = None,
    buckets: Sequence[Sequence[int]] | None = None,
    batch_size: int = 1,
    text_encoder: TextEncoder | PipelineTextEncoder | None = None,
    text_batch_size: int = 16,
    provenance: Mapping[str, Any] | None = None,
    vae_name: str = "",
) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Encode the clips (and images, as 1-frame clips) of the shards at `source` into latent
    shards in `out`, `batch_size` clips of one shape a VAE call (module docstring); (the
    counts, the shapes written: {"pixels": [F, H, W], "latent": [T', H', W'], "samples"})."""
    shards = ShardSet.open(source)
    counts = {"samples": 0, "skipped": 0}
    items = _plans(shards, _Shapes(vae, size, frames, buckets), counts)
    if text_encoder is not None:
        counts["no_caption"] = 0
        items = with_text(items, text_encoder, text_batch_size, counts)
    written: dict[tuple[int, ...], int] = {tuple(b): 0 for b in buckets or ()}
    with ShardWriter(out) as writer:
        for batch in batches_of_one_shape(items, batch_size):
            n = _write(writer, vae, batch, counts)
            shape = batch[0][1].shape[1:]
            written[shape] = written.get(shape, 0) + n
            counts["samples"] += n
    shapes = [{"pixels": list(pixels), "latent": list(vae.latent_shape(pixels)), "samples": n}
              for pixels, n in written.items()]  # fmt: skip
    latent_frames = None if frames is None else vae.latent_shape((frames, 0, 0))[0]
    latent = {"vae": vae_name or str(vae.folder), **vae.record(), "size": size, "flip": False,
              "video": {"frames": frames, "latent_frames": latent_frames,
                        "frame_step": vae.frame_step, "scale_factor_temporal": vae.temporal,
                        "scale_factor_spatial": vae.spatial},
              "buckets": shapes}  # fmt: skip
    if text_encoder is not None:
        latent["text_encoder"] = text_encoder.record()
    latent.update(provenance or {})
    write_manifest(out, writer.shards, modalities=["latent"], counts=counts, latent=latent)
    return counts, shapes


def _write(writer: ShardWriter, vae: VideoVAE, batch: list, counts: dict[str, int]) -> int:
    """Decode, encode and write one batch of plans of one shape; those that do not decode
    are skipped and counted."""
    decoded = []
    for key, plan, kept in batch:
        try:
            decoded.append((key, plan.decode(), kept))
        except MediaError:
            counts["skipped"] += 1
    if not decoded:
        return 0
    pixels = torch.stack([clip for _, clip, _ in decoded])
    latents = vae.encode(pixels)
    expected = (vae.channels, *vae.latent_shape(pixels.shape[2:]))
    if tuple(latents.shape[1:]) != expected:  # frames or pixels the encoder left out
        raise VideoVAEError(f"{vae.class_name} of {vae.folder} encoded {list(pixels.shape[1:])} "
                            f"pixels into {list(latents.shape[1:])}, not {list(expected)}")  # fmt: skip
    for (key, _, kept), latent in zip(decoded, latents.float().cpu().numpy(), strict=True):
        writer.write({"__key__": key, LATENT_MEMBER: npy_bytes(latent), **kept})
    return len(decoded)
