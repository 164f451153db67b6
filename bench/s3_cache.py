"""Shards from object storage through the local cache vs from the local disk, feeding tiny-clip.

    .venv/bin/python bench/s3_cache.py [--shards 16] [--samples-per-shard 64] [--no-append]

One run reads the same shards four ways with the loader that feeds tiny-clip (`StreamingLoader`,
num_workers=0, `SampleDecoder` with tiny-clip's train transforms: 64 px crops of 256 px JPEGs,
byte tokens), one epoch of batches of 32 each, and prints samples/s and the ratio to the disk:

1. disk: the shards in a local folder;
2. s3 cold: a moto S3 server in its own process on 127.0.0.1 and an empty cache; opening the set
   indexes every shard (downloads it), shown apart as `open s`;
3. s3 warm: again, every shard already in the cache;
4. s3 streaming: a cache bounded to a quarter of the data, indexes known, no shard on disk:
   every shard is fetched during the epoch, by the prefetcher ahead of the reader.

Also: the seconds the reader waited for a shard (`cache wait s`) and the hit rate. The server is
local, so the network is fast; what this measures is the cost of the cache tier itself and
whether prefetching hides the fetches. Prints a table and appends it to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import append_results, load_average, machine
from PIL import Image

from mmtrain.atomic import sha256_file
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.remote_cache import CacheStats, ShardCache
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.storage.tar_index import index_shard
from mmtrain.data.stream.loader import StreamingLoader
from mmtrain.data.stream.tokenizer import ByteTokenizer
from mmtrain.data.stream.transforms import SampleDecoder
from mmtrain.spec import load_spec

BATCH = 32
WINDOW = 64  # shuffle window: one shard, so the reader's working set is about 2 shards


def make_shards(folder: Path, shards: int, per_shard: int) -> None:
    rng = np.random.default_rng(0)
    with ShardWriter(folder, max_samples=per_shard) as writer:
        for i in range(shards * per_shard):
            small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            image = Image.fromarray(small).resize((256, 256), Image.Resampling.BICUBIC)
            grain = rng.integers(-20, 21, (256, 256, 3))
            pixels = np.clip(np.asarray(image) + grain, 0, 255).astype(np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
            writer.write({"__key__": f"s{i:06d}", "jpg": buffer.getvalue(), "txt": f"photo {i}"})
    entries = [
        {"name": p.name, "samples": len(index_shard(p)), "bytes": p.stat().st_size,
         "sha256": sha256_file(p)}
        for p in sorted(folder.glob("*.tar"))
    ]  # fmt: skip
    write_manifest(folder, entries)


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, endpoint
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("the moto server did not start")


def upload(endpoint: str, folder: Path) -> str:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket="bench")
    for path in sorted(folder.iterdir()):
        s3.upload_file(str(path), "bench", f"shards/{path.name}")
    return "s3://bench/shards/"


def epoch(sources: ShardSet, decode: SampleDecoder) -> tuple[float, dict[str, float]]:
    """samples/s of one epoch, and the cache counters of that epoch."""
    loader = StreamingLoader(sources, decode, BATCH, seed=0, shuffle_window=WINDOW)
    start = time.perf_counter()
    samples = sum(len(batch["text"]) for batch in loader)
    rate = samples / (time.perf_counter() - start)
    return rate, loader.cache_stats()


def timed_open(spec: str | Path, cache: ShardCache | None = None) -> tuple[ShardSet, float]:
    start = time.perf_counter()
    sources = ShardSet.open(spec, cache=cache)
    if cache is not None:
        cache.stats = CacheStats()  # count the epoch, not the indexing
    return sources, time.perf_counter() - start


def one_round(folder: Path, url: str, work: Path, decode: SampleDecoder) -> list[dict]:
    data_bytes = sum(p.stat().st_size for p in folder.glob("*.tar"))
    rows = [disk_row(folder, decode)]
    cache_dir = work / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)  # cold: no shard, no index
    for way in ("s3 cold", "s3 warm"):
        remote, opened = timed_open(url, ShardCache(cache_dir, 2 * data_bytes))
        rate, stats = epoch(remote, decode)
        rows.append({"way": way, "open_s": opened, "rate": rate, "stats": stats})
    shutil.rmtree(cache_dir / "objects")  # keep the indexes: a fresh node disk, a known data set
    remote, opened = timed_open(url, ShardCache(cache_dir, data_bytes // 4))
    rate, stats = epoch(remote, decode)
    rows.append({"way": "s3 streaming, cache 1/4", "open_s": opened, "rate": rate, "stats": stats})
    rows.append(disk_row(folder, decode))  # first and last: the disk sees the load s3 saw
    return rows


def disk_row(folder: Path, decode: SampleDecoder) -> dict:
    local, opened = timed_open(folder)
    rate, stats = epoch(local, decode)
    return {"way": "disk", "open_s": opened, "rate": rate, "stats": stats}


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    """The best of `args.rounds` rounds; the ways alternate inside each round, so a change of
    the machine's load hits them alike."""
    folder = work / "shards"
    make_shards(folder, args.shards, args.samples_per_shard)
    decode = SampleDecoder(load_spec("tiny-clip"), train=True, tokenizer=ByteTokenizer())
    server, endpoint = start_server()
    try:
        os.environ.update(
            AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
        )  # fmt: skip
        url = upload(endpoint, folder)
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for row in one_round(folder, url, work, decode):
                if row["way"] not in best or row["rate"] > best[row["way"]]["rate"]:
                    best[row["way"]] = row
    finally:
        server.kill()
        server.wait()
    return list(best.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-append", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args()
    load = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, Path(tmp))
    disk = rows[0]["rate"]
    table = [
        "| read from | open s | samples/s | / disk | cache wait s | hit rate | downloads |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        stats = row["stats"]
        wait = f"{stats['cache_wait_s']:.2f}" if stats else "-"
        hits = f"{stats['cache_hit_rate']:.0%}" if stats else "-"
        downloads = str(stats["cache_downloads"]) if stats else "-"
        table.append(
            f"| {row['way']} | {row['open_s']:.2f} | {row['rate']:,.0f} | "
            f"{row['rate'] / disk:.2f}x | {wait} | {hits} | {downloads} |"
        )
    notes = [
        f"{args.shards} shards x {args.samples_per_shard} samples (256 px JPEG + caption), one "
        f"epoch in batches of {BATCH} (shuffle window {WINDOW}), tiny-clip's train transforms, "
        f"num_workers=0, best of {args.rounds} rounds (each: disk, s3 cold, warm, streaming, "
        "disk again); moto S3 server in its own "
        f"process on 127.0.0.1; load average before: {load}. `open s` includes indexing (cold: "
        "downloading every shard); `downloads`, `cache wait s` and the hit rate count the epoch."
    ]
    print(machine())
    print("\n".join(table))
    if not args.no_append:
        append_results("s3_cache", table, notes)


if __name__ == "__main__":
    main()
