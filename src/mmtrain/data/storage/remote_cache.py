"""The local cache tier in front of object storage: shards fetched whole, checked, evicted LRU.

Layout of a cache folder (node-local disk; several ranks and processes of one node share it):

    objects/BUCKET/KEY       complete, verified shards (the only files a reader opens)
    objects/.../.NAME.part.PID.TID.BYTES   a download in progress (never opened by a reader)
    index/HASH.npz           the tar index of each shard, kept after the shard is evicted
    locks/                   flock files: one per shard (one download at a time), one for space

A shard is downloaded under a temporary name, its size and sha256 (from the manifest, when there
is one) are checked, it is fsynced and renamed: a reader never sees half a shard. A download that
fails is deleted, and leftovers of a killed process are deleted the next time a cache opens.
Space is reserved before a download, under one lock, counting the downloads in flight at their
final size, so `max_bytes` bounds the folder; to make room, the least recently used complete
shards go first (a read touches the file's mtime). Prefetching never evicts a pinned shard (one
the reader is on) nor the shards due before the one it fetches.

The index of a shard is what `ShardSet` needs to plan an epoch (keys, sizes, member offsets). It
is computed once per shard from its bytes and kept under `index/`, so a rerun or another rank
plans without downloading anything; shards are then fetched as the epoch reaches them, ahead of
time by `prefetch.Prefetcher`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from mmtrain.atomic import atomic_write_bytes, fsync_dir
from mmtrain.data.storage.s3 import (
    RemoteError,
    RemoteObject,
    S3Store,
    is_remote,
    list_shards,
    local_name,
)
from mmtrain.data.storage.shard_lists import expand_shards
from mmtrain.data.storage.tar_index import (
    ShardIndex,
    SkippedMember,
    TruncatedShardError,
    index_shard,
)
from mmtrain.structured import FieldError

logger = logging.getLogger(__name__)

DEFAULT_MAX_GB = 100.0
GB = 10**9  # data.cache_max_gb counts decimal gigabytes, like disk labels
_TOUCH_EVERY_S = 1.0  # a shard read many times a second updates its mtime once a second
_ROOM_WAIT_S = 60.0  # how long a needed download waits for pinned shards to be released
_INDEX_VERSION = 1

__all__ = [
    "ShardCache",
    "CacheStats",
    "RemoteShardIndex",
    "CacheTooSmall",
    "default_cache_dir",
    "default_cache",
    "open_cache",
    "open_remote_indexes",
    "cache_stats",
]


class CacheTooSmall(FieldError):
    """A shard does not fit into `data.cache_max_gb` beside the shards in use."""


# Failures of the storage or the cache, not of a sample's bytes: the loader raises them.
STORAGE_ERRORS = (RemoteError, CacheTooSmall)


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/mmtrain/shards`, else `~/.cache/mmtrain/shards`."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mmtrain" / "shards"


def open_cache(cache_dir: str | Path | None, max_gb: float | None) -> ShardCache:
    """The cache a run config asks for (`data.cache_dir`, `data.cache_max_gb`; None: defaults)."""
    if max_gb is not None and not max_gb > 0:
        raise FieldError("data.cache_max_gb", f"must be positive, got {max_gb}")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return ShardCache(root, int((max_gb or DEFAULT_MAX_GB) * GB))


def default_cache() -> ShardCache:
    return open_cache(None, None)


@dataclass
class CacheStats:
    """What the cache did in this process. `hits`/`misses` count the shards a reader needed as
    the epoch reached them (present, or waited for); `wait_s` is the time readers waited."""

    hits: int = 0
    misses: int = 0
    wait_s: float = 0.0
    downloads: int = 0
    downloaded_bytes: int = 0
    prefetched: int = 0
    evictions: int = 0
    retries: int = 0

    def add(self, **amounts: float) -> None:
        with _STATS_LOCK:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, float]:
        row = {f"cache_{f.name}": getattr(self, f.name) for f in fields(self)}
        needed = self.hits + self.misses
        row["cache_hit_rate"] = self.hits / needed if needed else 1.0
        return row


_STATS_LOCK = threading.Lock()


def cache_stats(caches: Sequence[ShardCache]) -> dict[str, float]:
    """The stats of several caches, summed (each counted once); empty without a cache."""
    total = CacheStats()
    for cache in {id(c): c for c in caches}.values():
        total.add(**{f.name: getattr(cache.stats, f.name) for f in fields(CacheStats)})
    return total.as_dict() if caches else {}


class ShardCache:
    """Shards of object storage as local files, within `max_bytes` (see the module docstring)."""

    def __init__(self, root: str | Path, max_bytes: int, store: S3Store | None = None):
        if max_bytes <= 0:
            raise FieldError("data.cache_max_gb", f"must be positive, got {max_bytes} bytes")
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.store = store if store is not None else S3Store()
        self._init_process_state()

    def _init_process_state(self) -> None:
        self.stats = CacheStats()
        self._pins: Counter[str] = Counter()
        self._pins_lock = threading.Lock()  # guards the pins
        self._touched: dict[str, float] = {}
        self._cleaned = False

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "max_bytes": self.max_bytes, "store": self.store}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    # ------------------------------------------------------------------ paths
    def path_for(self, obj: RemoteObject) -> Path:
        return self.root / "objects" / local_name(obj.url)

    def _lock_path(self, what: str) -> Path:
        return self.root / "locks" / (hashlib.sha256(what.encode()).hexdigest()[:32] + ".lock")

    def _index_path(self, obj: RemoteObject) -> Path:
        return self.root / "index" / (hashlib.sha256(obj.url.encode()).hexdigest()[:32] + ".npz")

    @contextlib.contextmanager
    def _flock(self, what: str) -> Iterator[None]:
        """An exclusive lock between threads and processes (flock per open file description)."""
        path = self._lock_path(what)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ reading
    def is_cached(self, obj: RemoteObject) -> bool:
        try:
            return self.path_for(obj).stat().st_size == obj.bytes
        except FileNotFoundError:
            return False

    def ensure(self, obj: RemoteObject) -> Path:
        """The local file of `obj`, downloaded first when it is not in the cache."""
        path = self.path_for(obj)
        if not self.is_cached(obj):
            with self._flock(obj.url):  # one download of a shard at a time, node-wide
                if not self.is_cached(obj):
                    self._download(obj, path, keep=(), blocking=True)
        self._touch(path)
        return path

    def need(self, obj: RemoteObject) -> Path:
        """`ensure` for a reader that reached `obj` in its epoch: counts a hit or a miss."""
        if self.is_cached(obj):
            self.stats.add(hits=1)
            return self.ensure(obj)
        start = time.perf_counter()
        path = self.ensure(obj)
        self.stats.add(misses=1, wait_s=time.perf_counter() - start)
        return path

    def prefetch(
        self, obj: RemoteObject, keep: Sequence[str], stop: Callable[[], bool] | None = None
    ) -> bool:
        """Download `obj` ahead of its reader unless that would evict a shard of `keep` (URLs:
        those in use and those due sooner) or a pinned one; False when there was no room.
        `stop()` turning true abandons the download (DownloadStopped)."""
        if self.is_cached(obj):
            return True
        with self._flock(obj.url):
            if self.is_cached(obj):
                return True
            if not self._download(obj, self.path_for(obj), keep, blocking=False, stop=stop):
                return False
        self.stats.add(prefetched=1)
        return True

    @contextlib.contextmanager
    def pinned(self, urls: Sequence[str]) -> Iterator[None]:
        """Keep these shards from eviction by this process while the block runs."""
        self.pin(urls)
        try:
            yield
        finally:
            self.unpin(urls)

    def pin(self, urls: Sequence[str]) -> None:
        with self._pins_lock:
            self._pins.update(urls)

    def unpin(self, urls: Sequence[str]) -> None:
        with self._pins_lock:
            self._pins.subtract(urls)
            self._pins += Counter()  # drop zero counts

    def _touch(self, path: Path) -> None:
        now = time.monotonic()
        key = str(path)
        if now - self._touched.get(key, -_TOUCH_EVERY_S) >= _TOUCH_EVERY_S:
            self._touched[key] = now
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)

    # ------------------------------------------------------------------ downloading
    def _download(
        self,
        obj: RemoteObject,
        path: Path,
        keep: Sequence[str],
        blocking: bool,
        stop: Callable[[], bool] | None = None,
    ) -> bool:
        self._remove_orphans()
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(
            f".{path.name}.part.{os.getpid()}.{threading.get_ident()}.{obj.bytes}"
        )
        if not self._reserve(obj, part, keep, blocking):
            return False
        try:
            tries = self.store.download(obj, part, stop=stop)
            os.replace(part, path)
        except FileNotFoundError as err:  # listed when the set was opened, gone now
            part.unlink(missing_ok=True)
            raise RemoteError(f"{err}; it was there when the shards were listed") from None
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        fsync_dir(path.parent)
        self.stats.add(downloads=1, downloaded_bytes=obj.bytes, retries=tries - 1)
        return True

    def _reserve(self, obj: RemoteObject, part: Path, keep: Sequence[str], blocking: bool) -> bool:
        """Make room for `obj` (evicting LRU shards) and claim it with an empty `part` file.

        Pins keep shards from prefetching (`blocking=False`), not from a reader that needs a
        shard now: it evicts unpinned shards first, then pinned ones (an open file stays
        readable), and waits only for downloads in flight to finish."""
        if obj.bytes > self.max_bytes:
            raise CacheTooSmall(
                "data.cache_max_gb",
                f"{self.max_bytes / GB:g} GB cannot hold {obj.url} ({obj.bytes / GB:g} GB); "
                "raise it above the size of the largest shard (a few shards is better)",
            )
        deadline = time.monotonic() + _ROOM_WAIT_S
        protected = {str(self.path_for(RemoteObject(url, 0))) for url in keep}
        while True:
            with self._pins_lock:
                pinned = {str(self.path_for(RemoteObject(url, 0))) for url in self._pins}
            with self._flock("space"):
                if blocking and self._make_room(obj.bytes, protected, last=pinned):
                    part.touch()
                    return True
                if not blocking and self._make_room(obj.bytes, protected | pinned, last=set()):
                    part.touch()
                    return True
            if not blocking:
                return False
            if time.monotonic() > deadline:
                raise CacheTooSmall(
                    "data.cache_max_gb",
                    f"{self.max_bytes / GB:g} GB is full of downloads in flight; {obj.url} "
                    f"({obj.bytes / GB:g} GB) does not fit beside them: raise it",
                )
            time.sleep(0.05)  # another thread's or process's download is still running

    def _make_room(self, need: int, protected: set[str], last: set[str]) -> bool:
        """Evict complete shards, least recently used first and those in `last` after the rest,
        never those in `protected`, until `need` bytes fit; False if they cannot."""
        used, complete = self._usage()
        for _, _, size, path in sorted((p in last, t, n, p) for t, n, p in complete):
            if used + need <= self.max_bytes:
                break
            if path in protected:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                used -= size
                self.stats.add(evictions=1)
                logger.debug("evicted %s from the shard cache", path)
        return used + need <= self.max_bytes

    def _usage(self) -> tuple[int, list[tuple[float, int, str]]]:
        """Bytes in use (downloads in flight at their final size) and the complete shards as
        (mtime, size, path)."""
        used = 0
        complete = []
        for folder, _, names in os.walk(self.root / "objects"):
            for name in names:
                path = os.path.join(folder, name)
                if ".part." in name and name.startswith("."):
                    used += int(name.rsplit(".", 1)[1])
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = os.stat(path)
                    used += st.st_size
                    complete.append((st.st_mtime, st.st_size, path))
        return used, complete

    def _remove_orphans(self) -> None:
        """Delete the temporary files of downloads whose process is gone (killed mid-download)."""
        if self._cleaned:
            return
        self._cleaned = True
        with self._flock("space"):
            for folder, _, names in os.walk(self.root / "objects"):
                for name in names:
                    if not (name.startswith(".") and ".part." in name):
                        continue
                    try:
                        pid = int(name.rsplit(".", 3)[1])
                    except (ValueError, IndexError):
                        continue  # not one of ours
                    if not _alive(pid):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(folder, name))

    # ------------------------------------------------------------------ indexes
    def index(self, obj: RemoteObject) -> RemoteShardIndex:
        """The shard's index: kept from an earlier run, or computed from its bytes now."""
        index = self._load_index(obj)
        if index is None:
            with self.pinned([obj.url]):
                index = index_shard(self.ensure(obj))
            self._save_index(obj, index)
        return RemoteShardIndex.of(index, obj, self)

    def index_all(self, objects: Sequence[RemoteObject], threads: int) -> list[RemoteShardIndex]:
        self._remove_orphans()
        largest = max((o.bytes for o in objects), default=1)
        # Each indexing thread pins one shard: no more of them than fit side by side.
        workers = max(1, min(threads, len(objects), self.max_bytes // max(1, largest)))
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(self.index, objects))

    def _identity(self, obj: RemoteObject) -> dict[str, Any]:
        return {"version": _INDEX_VERSION, "url": obj.url, "bytes": obj.bytes,
                "etag": obj.etag, "sha256": obj.sha256}  # fmt: skip

    def _save_index(self, obj: RemoteObject, index: ShardIndex) -> None:
        meta = {
            **self._identity(obj),
            "file_bytes": index.file_bytes,
            "skipped": [[m.member, m.reason] for m in index.skipped],
            "damage": None if index.damage is None else [index.damage.offset, index.damage.reason],
        }
        buffer = io.BytesIO()
        np.savez(
            buffer,
            meta=np.array(json.dumps(meta)),
            keys=np.array(index.keys, dtype=str),
            exts=np.array(index.exts, dtype=str),
            bounds=index.bounds,
            ext_ids=index.ext_ids,
            offsets=index.offsets,
            sizes=index.sizes,
        )
        path = self._index_path(obj)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buffer.getvalue())

    def _load_index(self, obj: RemoteObject) -> ShardIndex | None:
        try:
            with np.load(self._index_path(obj), allow_pickle=False) as saved:
                meta = json.loads(str(saved["meta"]))
                if {k: meta.get(k) for k in self._identity(obj)} != self._identity(obj):
                    return None  # the object changed (or another one had this URL)
                damage = meta["damage"]
                return ShardIndex(
                    path=self.path_for(obj),
                    file_bytes=int(meta["file_bytes"]),
                    keys=saved["keys"].tolist(),
                    bounds=saved["bounds"],
                    ext_ids=saved["ext_ids"],
                    exts=tuple(saved["exts"].tolist()),
                    offsets=saved["offsets"],
                    sizes=saved["sizes"],
                    skipped=tuple(SkippedMember(obj.url, m, r) for m, r in meta["skipped"]),
                    damage=None if damage is None else TruncatedShardError(obj.url, *damage),
                )
        except (OSError, ValueError, KeyError):  # missing or unreadable: compute it again
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RemoteShardIndex(ShardIndex):
    """The index of a shard in object storage; its bytes are read from the cache."""

    obj: RemoteObject | None = None
    cache: ShardCache | None = field(default=None, repr=False)
    remote: ClassVar[bool] = True
    # Few open files: an evicted shard's disk space is freed only when its last file closes.
    open_limit: ClassVar[int] = 4

    @classmethod
    def of(cls, index: ShardIndex, obj: RemoteObject, cache: ShardCache) -> RemoteShardIndex:
        values = {f.name: getattr(index, f.name) for f in fields(ShardIndex)}
        values["path"] = cache.path_for(obj)
        values["skipped"] = tuple(SkippedMember(obj.url, m.member, m.reason) for m in index.skipped)
        if index.damage is not None:
            values["damage"] = TruncatedShardError(
                obj.url, index.damage.offset, index.damage.reason
            )
        return cls(**values, obj=obj, cache=cache)

    @property
    def url(self) -> str:
        return self.obj.url

    def local_path(self) -> Path:
        return self.cache.ensure(self.obj)

    def stale(self, fd: int) -> bool:
        return os.fstat(fd).st_nlink == 0  # evicted: reopen (and fetch again) to free its space


def open_remote_indexes(
    spec: str | Sequence[str | Path], cache: ShardCache | None, threads: int
) -> list[ShardIndex]:
    """The indexes of the shards `spec` names (s3:// URLs, and local items of a list)."""
    cache = cache if cache is not None else default_cache()
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    indexes: list[ShardIndex] = []
    for item in items:
        if is_remote(item):
            objects, _ = list_shards(str(item), cache.store)
            indexes += cache.index_all(objects, threads)
        else:
            indexes += [index_shard(p) for p in expand_shards(item)]
    return indexes
