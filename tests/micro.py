"""The smallest real CLIP run the tests train: a two-tower spec (16 px images, byte-level text)
and shards of coloured squares with captions, shared by the train, parallel, report and fault
tests so that they all break the same thing."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmtrain.data.storage.shard_writer import ShardWriter

COLORS = ("red", "green", "blue", "white")


def micro_spec(
    name: str = "micro-clip",
    *,
    embed_dim: int = 32,
    layers: int = 2,
    context_length: int = 16,
    text_pooling: str | None = "eot",
) -> dict[str, Any]:
    """A ModelSpec dict: image (16 px, patch 8) and text towers of width 32, two heads."""
    text: dict[str, Any] = {
        "modality": "text",
        "stem": {"vocab_size": 258, "context_length": context_length},
        "width": 32,
        "layers": layers,
        "heads": 2,
    }
    if text_pooling is not None:
        text["pooling"] = text_pooling
    image = {
        "modality": "image",
        "stem": {"image_size": 16, "patch_size": 8},
        "width": 32,
        "layers": layers,
        "heads": 2,
    }
    return {
        "name": name,
        "embed_dim": embed_dim,
        "pairs": [["image", "text"]],
        "towers": {"image": image, "text": text},
    }


MICRO_SPEC = micro_spec()


def make_shards(
    folder: Path | str,
    samples: int = 48,
    corrupt: tuple[int, ...] = (),
    mismatched: tuple[int, ...] = (),
    placeholders: tuple[int, ...] = (),
) -> str:
    """PNG + caption shards of noisy coloured 20x24 squares, 16 samples per shard; samples
    listed in `corrupt` get a truncated PNG (the decoder refuses it), those in `mismatched`
    the caption of the next colour (a dirty pair that decodes fine), those in `placeholders`
    one flat grey (a web page's "image not available") with their caption."""
    rng = np.random.default_rng(0)
    with ShardWriter(folder, max_samples=16) as writer:
        for i in range(samples):
            c = i % len(COLORS)
            pixels = np.zeros((20, 24, 3), np.uint8)
            pixels[..., c % 3] = 180 + 20 * c
            pixels = (pixels + rng.integers(0, 40, pixels.shape)).astype(np.uint8)
            if i in placeholders:
                pixels[...] = 128
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="PNG")
            png = buffer.getvalue()
            if i in corrupt:
                png = png[: len(png) // 2]
            caption = COLORS[(c + 1) % len(COLORS)] if i in mismatched else COLORS[c]
            writer.write(
                {"__key__": f"s{i:05d}", "png": png, "txt": f"a {caption} square".encode()}
            )
    return str(folder)


# Two sources of different modalities (mixed by step): image-text and timeseries-text.
MIXED_SPEC = {
    "name": "mixed",
    "embed_dim": 16,
    "pairs": [["image", "text"], ["timeseries", "text"]],
    "towers": {
        "image": {"modality": "image", "stem": {"image_size": 8, "patch_size": 4},
                  "width": 16, "layers": 1, "heads": 2},
        "timeseries": {"modality": "timeseries", "stem": {"channels": 2, "length": 8, "patch": 4},
                       "width": 16, "layers": 1, "heads": 2, "pooling": "mean"},
        "text": {"modality": "text", "stem": {"vocab_size": 258, "context_length": 8},
                 "width": 16, "layers": 1, "heads": 2},
    },
}  # fmt: skip


def make_mixed_sources(root: Path) -> tuple[Path, Path]:
    """20 image-text samples and 12 timeseries-text samples, in two shard folders."""
    images, series = root / "images", root / "series"
    with ShardWriter(images, max_samples=8) as writer:
        for i in range(20):
            png = io.BytesIO()
            Image.new("RGB", (8, 8), (i * 10, 0, 0)).save(png, format="PNG")
            writer.write({"__key__": f"img{i:02d}", "png": png.getvalue(), "txt": b"red"})
    with ShardWriter(series, max_samples=8) as writer:
        for i in range(12):
            npy = io.BytesIO()
            np.save(npy, np.random.default_rng(i).normal(size=(2, 8)).astype(np.float32))
            writer.write({"__key__": f"ts{i:02d}", "npy": npy.getvalue(), "txt": b"walking"})
    return images, series


def micro_run(
    folder: Path, shards: str, *, spec: dict[str, Any] = MICRO_SPEC, seed: int = 1, **sections
) -> Any:
    """A RunConfig training `spec` on `shards` into `folder/run`: 4 steps of 8, checkpoints at
    every 2nd step (keep 2), no TensorBoard. `sections` update the config's sections, e.g.
    train={"parallel": "fsdp"}, checkpoint={"format": "full"}."""
    import yaml

    from mmtrain.config import config_from_dict

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.yaml").write_text(yaml.safe_dump(spec))
    config: dict[str, Any] = {
        "model": str(folder / "spec.yaml"),
        "data": {"train": shards, "shuffle_window": 8},
        "train": {"steps": 4, "batch_size": 8, "lr": 2e-3, "warmup_steps": 1},
        "checkpoint": {"every_steps": 2, "keep": 2},
        "metrics": {"tensorboard": False},
        "seed": seed,
        "out": str(folder / "run"),
    }
    for name, values in sections.items():  # a section's keys are updated; a value is set
        config[name] = {**config.get(name, {}), **values} if isinstance(values, dict) else values
    return config_from_dict(config)


class BuildCrash(Exception):
    """What `crash_at_write` raises: a build that dies mid-way, as a killed process would."""


def crash_at_write(monkeypatch, n: int):
    """Make the n-th sample a data build writes raise BuildCrash (samples before it, and the
    shards they completed, are written as usual). Returns the function that ends it (and only
    it: the test's other patches, such as environment variables, stay)."""
    from mmtrain.data.ingest import pipeline

    real_write = pipeline.ShardWriter.write
    writes = [0]

    def crashing_write(self, sample):
        writes[0] += 1
        if writes[0] == n:
            raise BuildCrash
        return real_write(self, sample)

    monkeypatch.setattr(pipeline.ShardWriter, "write", crashing_write)
    return lambda: monkeypatch.setattr(pipeline.ShardWriter, "write", real_write)


def matmul_tflops() -> float:
    """This CPU's dense fp32 matmul rate, the best of ten 1024 x 1024 products: the peak a user
    of a device the catalog does not know gives as metrics.peak_tflops."""
    import time

    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = 0.0
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * 1024**3 / (time.perf_counter() - start))
    return best / 1e12
