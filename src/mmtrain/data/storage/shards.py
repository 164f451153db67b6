"""`ShardSet`: the indexed samples of a list of shards, local or in object storage, addressed by
one flat sample id.

Local shards are indexed in place (`tar_index.index_shard`); `s3://` shards through the local
cache tier (`remote_cache`), which keeps their indexes and fetches their bytes as they are read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from mmtrain.data.storage.remote_cache import ShardCache, default_cache, open_remote_indexes
from mmtrain.data.storage.s3 import list_shards
from mmtrain.data.storage.shard_lists import expand_shards
from mmtrain.data.storage.tar_index import (
    ShardIndex,
    SkippedMember,
    TruncatedShardError,
    index_shard,
)

__all__ = ["ShardSet", "open_remote_set"]


class ShardSet:
    """The indexed samples of a list of shards, addressed by one flat sample id.

    Sample ids run shard after shard in list order. File descriptors are opened lazily and per
    process (they are not pickled to DataLoader workers), and reads use `os.pread`, so processes
    and threads never share a file offset.
    """

    def __init__(self, shards: Sequence[ShardIndex]):
        self.shards = list(shards)
        counts = np.asarray([len(s) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._fds: dict[int, int] = {}

    @classmethod
    def open(
        cls, spec: str | Path | Sequence[str | Path], threads: int = 8, cache: Any = None
    ) -> ShardSet:
        """Expand `spec` (see `expand_shards`) and index every shard, `threads` at a time.

        `s3://` specs are read through `cache` (a `remote_cache.ShardCache`; default: the user's
        cache folder, see `remote_cache.default_cache`).
        """
        if not isinstance(spec, Path) and _names_remote(spec):
            return cls(open_remote_indexes(spec, cache, threads))
        paths = expand_shards(spec)
        with ThreadPoolExecutor(max(1, min(threads, len(paths)))) as pool:
            return cls(list(pool.map(index_shard, paths)))

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def remote(self) -> bool:
        return any(s.remote for s in self.shards)

    def sizes(self) -> list[int]:
        """Samples per shard, in list order."""
        return [len(s) for s in self.shards]

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard number, sample number inside that shard) of flat sample id `sample`."""
        if not 0 <= sample < len(self):
            raise IndexError(f"sample {sample} out of range 0..{len(self) - 1}")
        shard = int(np.searchsorted(self.starts, sample, side="right")) - 1
        return shard, sample - int(self.starts[shard])

    def key(self, sample: int) -> str:
        shard, local = self.locate(sample)
        return self.shards[shard].keys[local]

    def shard_path(self, sample: int) -> Path:
        return self.shards[self.locate(sample)[0]].path

    def read(self, sample: int) -> dict[str, Any]:
        """Sample `sample` as `{"__key__": key, ext: bytes}`."""
        shard, local = self.locate(sample)
        return self.shards[shard].read(local, self._fd(shard))

    def fingerprint(self) -> str:
        """Short hash of shard names and sample counts: which data a saved loader state is for."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(f"{shard.name}\0{len(shard)}\n".encode())
        return digest.hexdigest()[:16]

    def skipped(self) -> list[SkippedMember]:
        return [m for s in self.shards for m in s.skipped]

    def damaged(self) -> list[TruncatedShardError]:
        return [s.damage for s in self.shards if s.damage is not None]

    def _fd(self, shard: int) -> int:
        index = self.shards[shard]
        fd = self._fds.get(shard)
        if fd is not None and index.stale(fd):
            os.close(self._fds.pop(shard))
            fd = None
        if fd is None:
            if len(self._fds) >= index.open_limit:
                os.close(self._fds.pop(next(iter(self._fds))))  # the oldest opened
            fd = self._fds[shard] = os.open(index.local_path(), os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fds"] = {}
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except (OSError, AttributeError):
            pass


def _names_remote(spec: Any) -> bool:
    if isinstance(spec, (list, tuple)):
        return any(_names_remote(item) for item in spec)
    return isinstance(spec, str) and spec.startswith("s3://")


def open_remote_set(
    spec: str | Sequence[str | Path], cache: ShardCache | None = None, threads: int = 8
) -> tuple[ShardSet, dict[str, Any] | None]:
    """`ShardSet.open(spec)` for an s3:// spec, and the manifest of its folder (None when there
    is none, or `spec` is a list)."""
    cache = cache if cache is not None else default_cache()
    if isinstance(spec, str):
        objects, manifest = list_shards(spec, cache.store)
        return ShardSet(cache.index_all(objects, threads)), manifest
    return ShardSet(open_remote_indexes(spec, cache, threads)), None
