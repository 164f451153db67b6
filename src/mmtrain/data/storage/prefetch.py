"""Fetch the shards a rank reads next, in the order it reads them, before it reaches them.

The loader knows a rank's stream in advance (the epoch order is a pure function of a few
integers), so the shards it will need are known too. Two walkers go over the same stream of
tasks:

- the *gate* runs in the main process just before each task is handed to the DataLoader: it makes
  sure the task's shards are in the cache (counting a hit when they already are, a miss and the
  seconds waited when not) and tells the background thread how far the reader has come;
- a background thread walks ahead and downloads the next `depth` shards (as many as fit in the
  cache beside the one in use), so the reader finds them on disk.

Both turn the tasks into the same sequence of shard *visits* (`_Visits`: a shard counts again
once other shards were read in between), so "the k-th visit" names the same shard on both sides.
A download error in the thread is only logged: the gate meets the same shard later and raises
the error (after its own retries) where the training loop sees it.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from mmtrain.data.storage.s3 import DownloadStopped

logger = logging.getLogger(__name__)

PREFETCH_SHARDS = 4  # visits ahead of the reader; fewer when the cache cannot hold them
_RECENT_VISITS = 4  # a shard among the last few visits is the same visit (window shuffles)

__all__ = ["Prefetcher", "PREFETCH_SHARDS"]

Task = tuple[int, int, list[int], list[int]]  # (epoch, first entry, positions, flat ids)


class _Visits:
    """Numbers the visits of shards in a stream of shard URLs."""

    def __init__(self) -> None:
        self.recent: collections.deque[str] = collections.deque(maxlen=_RECENT_VISITS)
        self.count = 0

    def add(self, url: str) -> int | None:
        """The number of a new visit, or None when `url` is part of a recent one."""
        if url in self.recent:
            return None
        self.recent.append(url)
        self.count += 1
        return self.count - 1


class Prefetcher:
    """Downloads ahead of one rank's reader (see the module docstring).

    shard_of(flat id) -> the sample's `RemoteShardIndex`, or None for a local shard.
    ahead: the same tasks the gate will see (a second, independent iterator).
    """

    def __init__(
        self,
        shard_of: Callable[[int], Any],
        ahead: Iterable[Task],
        depth: int = PREFETCH_SHARDS,
    ):
        self.shard_of = shard_of
        self.depth = depth
        self._reached = 0  # visits the gate has reached
        self._using: dict[str, int] = {}  # shards of the task the gate handed out last: bytes
        self._visits: list[Any] = []  # shards of the thread's visits, in order
        self._turn = threading.Condition()
        self._stop = False
        self._warned = False
        self._thread = threading.Thread(
            target=self._run, args=(iter(ahead),), name="shard-prefetch", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ reader side
    def gate(self, tasks: Iterable[Task]) -> Iterator[Task]:
        """`tasks`, each handed on once its shards are in the cache."""
        visits = _Visits()
        seen: set[str] = set()  # shards visited in this pass
        pinned: dict[str, Any] = {}
        try:
            for task in tasks:
                self._release(pinned)  # the reader moved on: the cache may now evict them
                pinned = self._admit(task, visits, seen)
                yield task
        finally:
            self._release(pinned)

    def _admit(self, task: Task, visits: _Visits, seen: set[str]) -> dict[str, Any]:
        """Make sure the shards of `task` are in the cache; pin them, and return them."""
        shards: dict[str, Any] = {}
        for flat in task[3]:
            shard = self.shard_of(flat)
            if shard is None:
                continue
            number = visits.add(shard.url)
            if number is not None:
                self._advance(number + 1)
                if shard.url in seen and not shard.cache.is_cached(shard.obj):
                    self._warn_thrashing(shard)
                seen.add(shard.url)
                shard.cache.need(shard.obj)  # a new visit: a hit, or a wait (a miss)
            shards[shard.url] = shard
        for shard in shards.values():
            shard.cache.ensure(shard.obj)  # present; fetched again only if evicted since
        with self._turn:
            self._using = {url: shard.obj.bytes for url, shard in shards.items()}
        # Pinned until the next task comes, so prefetching evicts neither these nor (through
        # `keep`) the shards due next.
        for url, shard in shards.items():
            shard.cache.pin([url])
        return shards

    @staticmethod
    def _release(pinned: dict[str, Any]) -> None:
        for url, shard in pinned.items():
            shard.cache.unpin([url])

    def _warn_thrashing(self, shard: Any) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s was evicted while the epoch still reads it: data.cache_max_gb (%.3g GB) "
                "holds fewer shards than one shuffle window spans; raise it or lower "
                "data.shuffle_window, else shards are downloaded again and again",
                shard.url, shard.cache.max_bytes / 1e9,
            )  # fmt: skip

    def _advance(self, reached: int) -> None:
        with self._turn:
            self._reached = max(self._reached, reached)
            self._turn.notify_all()

    def close(self) -> None:
        """Stop the thread (a download in progress is abandoned, its temporary file deleted)."""
        with self._turn:
            self._stop = True
            self._turn.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ thread
    def _run(self, ahead: Iterator[Task]) -> None:
        visits = _Visits()
        try:
            for task in ahead:
                for flat in task[3]:
                    shard = self.shard_of(flat)
                    if shard is None or visits.add(shard.url) is None:
                        continue
                    self._visits.append(shard)
                    if not self._fetch(len(self._visits) - 1):
                        return
        except DownloadStopped:
            return
        except Exception as err:  # the gate meets this shard too and raises there
            logger.warning("prefetching stopped: %s", err)

    def _fetch(self, number: int) -> bool:
        """Download visit `number` when its turn comes; False when the prefetcher stops."""
        shard = self._visits[number]
        while True:
            with self._turn:
                while not self._stop and not self._in_window(number):
                    self._turn.wait()
                if self._stop:
                    return False
                reached = self._reached
                ahead = self._visits[max(0, reached - 1) : number + 1]
                keep = [*self._using, *(s.url for s in ahead)]
            if shard.cache.prefetch(shard.obj, keep, stop=lambda: self._stop):
                return True
            with self._turn:  # no room yet: wait until the reader moves on
                while not self._stop and self._reached == reached:
                    self._turn.wait()

    def _in_window(self, number: int) -> bool:
        """Within `depth` visits of the reader, and the shards of the reader's task and those up
        to this one fit in the cache together."""
        current = max(0, self._reached - 1)
        if number - current > self.depth:
            return False
        window = dict(self._using)
        window.update({s.url: s.obj.bytes for s in self._visits[current : number + 1]})
        return sum(window.values()) <= self._visits[number].cache.max_bytes
