"""Every sample's size, read once from headers: what puts samples in buckets before the first
step (buckets.py), since the order of an epoch must know each sample's bucket up front.

`sample_sizes(shards, input)` reads each sample's image or video header or its latent's .npy
header (not its pixels) and returns an int64 [N, k] array in flat sample order, a row of -1
for a sample that does not read (the decoder will skip it as corrupt anyway). For local shards
the array is kept beside the first shard, `.sample-sizes-{input}-{fingerprint}.npy` (written
atomically; the fingerprint names the shards and their sample counts), so a restarted or
resumed run, and every rank of it, reads it instead of the headers. Remote shards are read
through the shard cache each time.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np

from mmtrain.atomic import atomic_save_npy
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.stream.buckets import NO_BUCKET, Buckets, probe_size

logger = logging.getLogger(__name__)

__all__ = ["sample_sizes", "bucket_ids"]


def _cache_path(shards: ShardSet, input: str) -> Path | None:
    if shards.remote or not shards.shards:
        return None
    return shards.shard_path(0).parent / f".sample-sizes-{input}-{shards.fingerprint()}.npy"


def sample_sizes(shards: ShardSet, input: str) -> np.ndarray:
    """int64 [len(shards), k]: each sample's size (`probe_size`), -1 where it does not read."""
    path = _cache_path(shards, input)
    if path is not None and path.exists():
        try:
            sizes = np.load(path, allow_pickle=False)
            if sizes.ndim == 2 and len(sizes) == len(shards):
                return sizes.astype(np.int64)
        except (OSError, ValueError):
            pass  # a damaged index is read again from the headers
    rank = 3 if input == "video" else 0
    rows: list[tuple[int, ...] | None] = []
    for i in range(len(shards)):
        try:
            rows.append(probe_size(shards.read(i), input))
        except ValueError:  # MediaError and friends: the sample's own fault
            rows.append(None)
    rank = rank or max((len(r) for r in rows if r is not None), default=2)
    sizes = np.asarray([r if r is not None and len(r) == rank else (-1,) * rank for r in rows],
                       dtype=np.int64).reshape(len(rows), rank)  # fmt: skip
    if path is not None and not atomic_save_npy(path, sizes):
        logger.info("sample sizes of %s not kept (a read-only folder)", path.parent)
    return sizes


def bucket_ids(sources: list[ShardSet], buckets: Buckets) -> tuple[np.ndarray, Counter]:
    """The bucket of every sample of `sources` (flat order, source after source) and how many
    samples each bucket holds (NO_BUCKET: those in none, or unreadable)."""
    ids = []
    for shards in sources:
        for size in sample_sizes(shards, buckets.input):
            ids.append(NO_BUCKET if size[0] < 0 else buckets.assign(size))
    array = np.asarray(ids, dtype=np.int64)
    return array, Counter(array.tolist())
