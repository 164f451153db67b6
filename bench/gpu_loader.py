"""GPU-machine check (e) of issue 41: how many document pages a second the training loader of
a native-resolution VLM gives with 14 worker processes (the GPU machine's 16 cores, less the
trainer's), pages read from shards at their own size within Qwen2.5-VL-7B's budget, decoded,
resized and packed into rows, uint8 pixels for the device to normalise (as on CUDA).

    vlm_loader_note(torch.device("cuda"), dry_run=False)   # from bench/gpu_bench.py
"""

from __future__ import annotations

import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from mmtrain.config import config_from_dict
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.tokenizer import train_bpe
from mmtrain.spec import load_spec
from mmtrain.train.data import TrainData

SIZES = [(1100, 850), (842, 595), (1400, 1000), (600, 1200)]  # letter, A4 at 72 dpi, ...


def _page(size: tuple[int, int], seed: int) -> bytes:
    """A page of text-like lines: dark strokes on white, PNG."""
    height, width = size
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for y in range(40, height - 40, 24):
        x = 40
        while x < width - 80:
            word = int(rng.integers(20, 80))
            draw.rectangle([x, y, x + word, y + 10], fill=(30, 30, 30))
            x += word + 12
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _shards(folder: Path, pages: int) -> None:
    train_bpe(["Read the page. The page says hello."] * 8, vocab_size=300,
              out_path=folder / "tokenizer.json")  # fmt: skip
    with ShardWriter(folder, max_samples=64) as writer:
        for i in range(pages):
            record = {"id": str(i), "images": ["0.png"], "messages": [
                {"role": "user", "content": "<image>Read the page."},
                {"role": "assistant", "content": "The page says hello."},
            ]}  # fmt: skip
            writer.write({"__key__": f"{i:06d}", "json": json.dumps(record),
                          "0.png": _page(SIZES[i % len(SIZES)], i)})  # fmt: skip
    write_manifest(folder, writer.shards, modalities=["image", "text"])


def vlm_loader_note(device: torch.device, dry_run: bool) -> str:
    workers, pages, micro_batch = (2, 32, 4) if dry_run else (14, 512, 8)
    row = 1024 if dry_run else 4096  # LM positions a packed row holds
    spec = load_spec("tiny-qwen2-vl" if dry_run else "Qwen2.5-VL-7B")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _shards(folder, pages)
        config = config_from_dict({
            "model": spec.name,
            "data": {"train": str(folder), "tokenizer": str(folder / "tokenizer.json"),
                     "chat_template": "plain", "sequence_length": row,
                     "pack": True,
                     "workers": workers, "vision": {"image_max_tokens": 1024}},
            "train": {"steps": 1, "batch_size": micro_batch},
            "out": str(folder / "run"),
        })  # fmt: skip
        data = TrainData(config, spec, rank=0, world_size=1, micro_batch=micro_batch,
                         uint8_pixels=True, pin_memory=device.type == "cuda")  # fmt: skip
        try:
            data.next_batch()  # workers started, first batches prefetched
            batches = pages // micro_batch - 1
            start = time.perf_counter()
            for _ in range(batches):
                data.next_batch()
            seconds = time.perf_counter() - start
        finally:
            data.close()
    return (f"VLM loader ({spec.name} budget, {workers} workers, packed rows of {row}): "
            f"{batches * micro_batch / seconds:,.1f} pages/s of 595-1400 px pages")  # fmt: skip
