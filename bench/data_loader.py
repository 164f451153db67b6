"""Data loader benchmark: decode throughput per worker, sampled video decoding, loader memory.

    .venv/bin/python bench/data_loader.py [--images 96] [--epochs 12] [--no-append]

Measures, in one run, on this machine (ratios are what matter; absolute numbers depend on it):

1. Images: samples/s of ONE worker process turning a 512x512 JPEG (+ caption) from a shard into a
   224 px training crop (random-resized-crop, bicubic, normalised) and token ids:
   - baseline: webdataset iterating the shards, Pillow decoding the full image (`.decode("pil")`),
     then the same crop/normalise/tokenise code (skipped, with a message, when webdataset is not
     installed: `.venv/bin/pip install webdataset`; it is not a project dependency);
   - mmtrain: `StreamingLoader` (num_workers=0) + `SampleDecoder` (the crop is drawn from the
     header's size, then the JPEG decoded at 1/2, 1/4 or 1/8 when that crop still covers 224 px);
   - mmtrain + `ImageCache` (pre-decoded, memory-mapped): training crops from a 256 px cache,
     and eval from a 224 px cache (no resampling left at all).
2. Video: clips/s for 16 frames at 224 px from a 6 s 720p H.264 clip (made here with PyAV,
   keyframe every second), `media.decode_video` (only the sampled frames converted, scaled in
   the decoder, seeking over gaps) vs decoding and converting every frame, then the same
   transform. Two samplings: 16 frames spread over the clip, and a 16-frame window at stride 2
   from a random start.
3. Memory: RSS (and PSS) of the main process + its persistent workers after epoch 1 and after
   the last epoch.

Prints a table and appends it (command, machine, figures) to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.decoded_cache import CachedDecoder, ImageCache
from mmtrain.data.stream.loader import StreamingLoader
from mmtrain.data.stream.media import decode_video
from mmtrain.data.stream.tokenizer import ByteTokenizer
from mmtrain.data.stream.transforms import (
    AugmentConfig,
    ImageTransform,
    SampleDecoder,
    VideoTransform,
)
from mmtrain.spec import ModelSpec, load_spec

RESULTS = Path(__file__).with_name("RESULTS.md")
SIZE = 224


# ----------------------------------------------------------------------------- data
def natural_jpeg(rng: np.random.Generator, side: int = 512) -> bytes:
    """A photo-like JPEG: smooth colour fields plus fine texture (not trivially compressible)."""
    coarse = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC))
    texture = rng.normal(0, 12, (side, side, 1))
    pixels = np.clip(base + texture, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


def image_shards(folder: Path, count: int, side: int = 512) -> ShardSet:
    rng = np.random.default_rng(0)
    with ShardWriter(folder, max_samples=32) as writer:
        for i in range(count):
            caption = f"a photo of thing number {i}"
            writer.write({"__key__": f"{i:06d}", "jpg": natural_jpeg(rng, side), "txt": caption})
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return ShardSet.open(folder)


def clip_spec(image_size: int) -> ModelSpec:
    """tiny-clip (byte-level text) with its image tower at `image_size`."""
    spec = load_spec("tiny-clip")
    image = spec.towers["image"]
    stem = dataclasses.replace(image.stem, image_size=image_size)
    towers = dict(spec.towers, image=dataclasses.replace(image, stem=stem))
    return dataclasses.replace(spec, towers=towers)


def h264_clip(seconds: float = 6.0, fps: int = 30, width: int = 1280, height: int = 720) -> bytes:
    """A moving gradient as 720p H.264 in MP4, one keyframe per second (as ingest writes)."""
    import av

    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack(
        [xx * 255 // width, yy * 255 // height, (xx + yy) * 255 // (width + height)], -1
    )
    base = base.astype(np.uint8)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.gop_size = fps
        stream.options = {"preset": "ultrafast", "crf": "23"}
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 8 * i, axis=1), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


# ----------------------------------------------------------------------------- timing
def rate(run: Callable[[], int], min_seconds: float = 2.0, warmup: bool = True) -> float:
    """Items per second of `run` (returns how many items it did), repeated for min_seconds."""
    if warmup:
        run()  # imports, page cache, allocator
    done, start = 0, time.perf_counter()
    while True:
        done += run()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return done / elapsed


def rates(runs: dict[str, Callable[[], int]], seconds: float, rounds: int = 5) -> dict[str, float]:
    """Median items/s of each run over `rounds` interleaved rounds: on a shared, noisy machine
    every method sees the same background load, so the ratios hold."""
    for run in runs.values():
        run()  # warm-up
    measured: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            measured[name].append(rate(run, seconds / rounds, warmup=False))
    return {name: float(np.median(values)) for name, values in measured.items()}


def count_batches(batches: Iterable[dict]) -> int:
    return sum(len(b["text"]) for b in batches)


# ----------------------------------------------------------------------------- 1. images
SQUARE = AugmentConfig(ratio=(1.0, 1.0))  # square crops: a 256 px decode still covers 224 px


def bench_images(folder: Path, count: int, seconds: float) -> list[tuple[str, float]]:
    sources = image_shards(folder / "shards", count)
    spec = clip_spec(SIZE)
    runs: dict[str, Callable[[], int]] = {}
    try:
        import webdataset as wds
    except ImportError:
        wds = None
        print("webdataset is not installed: baseline column skipped "
              "(.venv/bin/pip install webdataset)")  # fmt: skip
    if wds is not None:
        urls = [str(s.path) for s in sources.shards]
        transform = ImageTransform(SIZE, train=True)
        tokenizer = ByteTokenizer()

        def baseline() -> int:
            rng = np.random.default_rng(0)
            dataset = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode("pil")
            n = 0
            for image, caption in dataset.to_tuple("jpg", "txt"):
                transform(np.asarray(image.convert("RGB")), rng)
                tokenizer([caption], 48)
                n += 1
            return n

        runs["webdataset + Pillow (full decode), train crop"] = baseline

    def loader(decode) -> Callable[[], int]:
        stream = StreamingLoader(sources, decode, 16, seed=0, num_workers=0)
        return lambda: count_batches(stream)

    start = time.perf_counter()
    train_cache = ImageCache.build(sources, folder / "cache", 256)
    train_s = time.perf_counter() - start
    eval_cache = ImageCache.build(sources, folder / "cache", SIZE)
    runs["mmtrain, train crop (JPEG decoded at 1/2 when the drawn crop allows)"] = loader(
        SampleDecoder(spec, True)
    )
    runs["mmtrain, square train crop (always 256 px reduced decode)"] = loader(
        SampleDecoder(spec, True, augment=SQUARE)
    )
    runs[f"mmtrain + cache 256 px, train crop (cache built in {train_s:.1f} s)"] = loader(
        CachedDecoder(SampleDecoder(spec, True), train_cache)
    )
    runs["mmtrain + cache 224 px, eval"] = loader(
        CachedDecoder(SampleDecoder(spec, False), eval_cache)
    )
    runs["mmtrain eval, no cache (224 px reduced decode)"] = loader(SampleDecoder(spec, False))
    return list(rates(runs, seconds).items())


# ----------------------------------------------------------------------------- 2. video
def decode_every_frame(data: bytes, frames: int, picks: Callable[[int], np.ndarray]) -> np.ndarray:
    """The naive way: decode and convert every frame at full size, then pick `frames` of them."""
    import av

    with av.open(io.BytesIO(data)) as container:
        every = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return np.stack([every[i] for i in picks(len(every))])


def bench_video(seconds: float) -> tuple[list[tuple[str, float]], str]:
    made = time.perf_counter()
    data = h264_clip()
    note = f"6 s 720p H.264 clip, 30 fps, {len(data) / 1e6:.1f} MB, encoded in {time.perf_counter() - made:.1f} s"  # fmt: skip
    transform = VideoTransform(SIZE, 16, train=True)
    rng = np.random.default_rng(0)
    fps, frames_total = 30, 180

    def spread(n: int) -> np.ndarray:
        return np.floor((np.arange(16) + 0.5) * n / 16).astype(int)

    def window_start() -> int:
        return int(rng.integers(0, frames_total - 32))

    def sampled_spread() -> int:
        clip = decode_video(data, 16, short_side=transform.image.min_decode_size())
        transform(clip.frames, rng)
        return 1

    def all_spread() -> int:
        transform(decode_every_frame(data, 16, spread), rng)
        return 1

    def sampled_window() -> int:
        start = window_start() / fps
        clip = decode_video(data, 16, start_s=start, interval_s=2 / fps, short_side=transform.image.min_decode_size())  # fmt: skip
        transform(clip.frames, rng)
        return 1

    def all_window() -> int:
        start = window_start()
        transform(decode_every_frame(data, 16, lambda n: start + 2 * np.arange(16)), rng)
        return 1

    runs = {
        "16 frames spread: decode_video (sampled)": sampled_spread,
        "16 frames spread: decode every frame": all_spread,
        "16-frame window, stride 2: decode_video": sampled_window,
        "16-frame window, stride 2: decode every frame": all_window,
    }
    return list(rates(runs, seconds, rounds=3).items()), note


# ----------------------------------------------------------------------------- 3. memory
def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids += [int(k) for k in text]
    return kids


def _memory_mib(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of one process in MiB (PSS splits shared pages between their users)."""
    rss = pss = 0.0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Pss:"):
            pss = int(line.split()[1]) / 1024
    return rss, pss


def bench_memory(folder: Path, epochs: int) -> list[tuple[int, int, float, float]]:
    """(epoch, processes, RSS MiB, PSS MiB) of main + persistent workers after each epoch."""
    sources = image_shards(folder / "small", 96, side=160)
    loader = StreamingLoader(
        sources,
        SampleDecoder(clip_spec(64), True),
        16,
        seed=0,
        num_workers=2,
        persistent_workers=True,
    )
    rows = []
    for epoch in range(1, epochs + 1):
        count_batches(loader)
        pids = [os.getpid(), *_children(os.getpid())]
        rss, pss = (sum(values) for values in zip(*map(_memory_mib, pids), strict=True))
        rows.append((epoch, len(pids), rss, pss))
    loader.close()
    return rows


# ----------------------------------------------------------------------------- report
def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")),
            platform.processor(),
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=96, help="512 px JPEGs in the image test")
    parser.add_argument("--epochs", type=int, default=12, help="epochs of the memory test")
    parser.add_argument("--seconds", type=float, default=6.0, help="timing per method")
    parser.add_argument("--no-append", action="store_true", help="do not write bench/RESULTS.md")
    args = parser.parse_args()
    # One intra-op thread, as in a DataLoader worker: "per worker" figures, and no thread
    # oversubscription on a shared machine.
    torch.set_num_threads(1)
    lines = [f"machine: {machine()}", ""]
    with tempfile.TemporaryDirectory(prefix="mmtrain-bench-") as tmp:
        images = bench_images(Path(tmp), args.images, args.seconds)
        videos, note = bench_video(args.seconds)
        memory = bench_memory(Path(tmp), args.epochs)

    base = images[0][1] if images[0][0].startswith("webdataset") else None
    lines += [f"Images: {args.images} x 512x512 JPEG -> 224 train crop + caption ids, one process",
              "", "| path | samples/s | vs webdataset |", "|---|---:|---:|"]  # fmt: skip
    for name, value in images:
        ratio = f"{value / base:.2f}x" if base else "n/a (webdataset absent)"
        lines.append(f"| {name} | {value:,.0f} | {ratio} |")
    lines += ["", f"Video: {note}; 16 frames -> [16, 3, 224, 224] train crop", "",
              "| path | clips/s | vs every frame |", "|---|---:|---:|"]  # fmt: skip
    for i, (name, value) in enumerate(videos):
        reference = videos[i | 1][1]
        lines.append(f"| {name} | {value:,.2f} | {value / reference:.2f}x |")
    first, last = memory[0], memory[-1]
    lines += ["", "Loader memory, 2 persistent workers, 96 samples x batch 16 per epoch", "",
              "| after epoch | processes | RSS MiB | PSS MiB |", "|---:|---:|---:|---:|"]  # fmt: skip
    for epoch, procs, rss, pss in (first, last):
        lines.append(f"| {epoch} | {procs} | {rss:,.0f} | {pss:,.0f} |")
    lines.append("")
    lines.append(f"RSS growth epoch 1 -> {last[0]}: {last[2] - first[2]:+.1f} MiB "
                 f"({(last[2] / first[2] - 1) * 100:+.1f}%)")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if not args.no_append:
        command = " ".join([Path(sys.executable).name, *sys.argv])
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        if not RESULTS.exists():
            RESULTS.write_text("# mmtrain benchmark results (appended by the scripts in bench/)\n")
        with RESULTS.open("a") as f:
            f.write(f"\n## data_loader ({stamp})\n\ncommand: `{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
