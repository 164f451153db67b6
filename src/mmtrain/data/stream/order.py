"""The order of samples in an epoch, as pure functions of a few integers.

Global order: for epoch `e` of a dataset (one source, or several mixed by weight), `epoch_order`
returns an array `order` where `order[p]` is the flat sample id at *global position* p. It depends
only on (seed, epoch, shard sizes, weights) — never on ranks or workers:

1. per source: shuffle the shards, then shuffle samples within consecutive windows of
   `window` samples (reads stay close together on disk, yet batches mix many shards);
2. several sources: a deterministic schedule (from the seed and the weights) says which source
   each position draws from; each source walks through its own order, epoch after epoch.

Splitting: the positions not yet consumed form a *segment* (`Segment`: everything from `start`
on, minus a short list of positions consumed out of turn). Rank r of W reads the segment's
entries r, r+W, r+2W, ... and wraps around at the end, so every rank can always draw as many
samples as it needs: ranks step in lockstep and DDP never hangs on uneven shards.

Randomness of a sample (crop, flip, frame window) comes from `sample_rng(seed, epoch, position)`,
so it is the same whichever rank or worker decodes the sample, and after a resume.

Buckets (samples of several shapes, batches of one): `bucketed_order` regroups an epoch's order
into chunks of one bucket each, a chunk being one step's positions on all ranks; still a pure
function of the same integers plus each sample's bucket.

Balance (samples of very different cost, a VLM's pages: one rank's micro-batch of many pages
holds every other rank up at each collective): `balanced_order` deals the samples of each
chunk (one micro-batch on every rank) to the ranks so that their summed costs are as even as
a greedy longest-first deal makes them; a pure function of the order and each sample's cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Independent random streams for the same (seed, epoch): which purpose a generator serves.
_SHARD_STREAM = 1
_MIX_STREAM = 2
_SAMPLE_STREAM = 3
_BUCKET_STREAM = 4

__all__ = [
    "source_order",
    "apportion",
    "mixing_schedule",
    "epoch_order",
    "sample_rng",
    "bucketed_order",
    "balanced_order",
    "Segment",
    "steps_in",
]


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in words]))


def source_order(
    sizes: Sequence[int],
    seed: int,
    epoch: int,
    *,
    shuffle: bool = True,
    window: int = 1000,
    stream: int = 0,
) -> np.ndarray:
    """A permutation of `range(sum(sizes))`: shard-level shuffle, then shuffle within windows.

    `sizes` are samples per shard (sample ids run shard after shard); `stream` separates the
    orders of several sources sharing one seed.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if not shuffle or total == 0:
        return np.arange(total, dtype=np.int64)
    rng = _rng(seed, _SHARD_STREAM, stream, epoch)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    shards = rng.permutation(len(sizes))
    order = np.concatenate([np.arange(starts[s], starts[s] + sizes[s]) for s in shards])
    window = max(1, int(window))
    full = total // window * window
    if window > 1 and full:
        order[:full] = rng.permuted(order[:full].reshape(-1, window), axis=1).reshape(-1)
    order[full:] = rng.permutation(order[full:])
    return order


def apportion(total: int, weights: Sequence[float]) -> np.ndarray:
    """Split `total` into integer counts proportional to `weights` (largest remainder)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or not np.isfinite(w).all() or w.sum() <= 0:
        raise ValueError(
            f"weights must be non-negative, finite and not all zero, got {list(weights)}"
        )
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    extra = total - int(counts.sum())
    # Ties broken by source order, so the result is a pure function of the inputs.
    by_remainder = np.argsort(-(exact - counts), kind="stable")
    counts[by_remainder[:extra]] += 1
    return counts


def mixing_schedule(counts: Sequence[int], seed: int, epoch: int) -> np.ndarray:
    """Source id of each position: source s appears counts[s] times, spread evenly.

    Draw i of source s sits at (i + u_s) / counts[s] of the epoch, with u_s a random phase per
    source and epoch: every stretch of the epoch holds each source close to its proportion.
    """
    counts = np.asarray(counts, dtype=np.int64)
    phases = _rng(seed, _MIX_STREAM, epoch).random(len(counts))
    when = np.concatenate(
        [(np.arange(n) + phases[s]) / n for s, n in enumerate(counts) if n > 0] or [np.empty(0)]
    )
    source = np.concatenate(
        [np.full(n, s, dtype=np.int64) for s, n in enumerate(counts) if n > 0]
        or [np.empty(0, dtype=np.int64)]
    )
    return source[np.argsort(when, kind="stable")]


def epoch_order(
    sources: Sequence[Sequence[int]],
    seed: int,
    epoch: int,
    *,
    weights: Sequence[float] | None = None,
    epoch_samples: int | None = None,
    shuffle: bool = True,
    window: int = 1000,
) -> np.ndarray:
    """Flat sample id at each global position of `epoch` (ids of source s follow those of s-1).

    `sources` holds the shard sizes of each source. With one source and no `epoch_samples` this
    is `source_order`. With several, the epoch has `epoch_samples` positions (default: all
    samples of all sources) shared by `weights` (default: by source size); a source drawn more
    often than it has samples continues into its next pass, one drawn less continues next epoch
    where it stopped, so over epochs every sample of every source is seen.
    """
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}")
    totals = [int(sum(s)) for s in sources]
    if weights is None:
        weights = totals
    if len(weights) != len(sources):
        raise ValueError(f"{len(weights)} weights for {len(sources)} sources")
    length = sum(totals) if epoch_samples is None else int(epoch_samples)
    counts = apportion(length, weights)
    empty = [s for s, n in enumerate(counts) if n > 0 and totals[s] == 0]
    if empty:
        raise ValueError(f"source {empty[0]} has weight but no samples")
    offsets = np.concatenate([[0], np.cumsum(totals)]).astype(np.int64)
    if len(sources) == 1 and length == totals[0]:
        return source_order(sources[0], seed, epoch, shuffle=shuffle, window=window)
    schedule = mixing_schedule(counts, seed, epoch) if shuffle else _round_robin(counts)
    order = np.empty(length, dtype=np.int64)
    for s, n in enumerate(counts):
        if n == 0:
            continue
        draws = np.arange(epoch * int(n), (epoch + 1) * int(n))  # over all epochs of the mixture
        passes = draws // totals[s]
        ids = np.empty(n, dtype=np.int64)
        for p in np.unique(passes):
            own = source_order(sources[s], seed, int(p), shuffle=shuffle, window=window, stream=s)
            hit = passes == p
            ids[hit] = own[draws[hit] % totals[s]]
        order[schedule == s] = ids + offsets[s]
    return order


def _round_robin(counts: np.ndarray) -> np.ndarray:
    """The evenly spread schedule without randomness (phase 0.5 for every source)."""
    when = np.concatenate([(np.arange(n) + 0.5) / n for n in counts if n > 0] or [np.empty(0)])
    source = np.concatenate([np.full(n, s) for s, n in enumerate(counts) if n > 0] or [np.empty(0)])
    return source[np.argsort(when, kind="stable")].astype(np.int64)


def bucketed_order(
    order: np.ndarray,
    bucket_of: np.ndarray,
    chunk: int,
    seed: int,
    epoch: int,
    *,
    drop_partial: bool = False,
    shuffle: bool = True,
) -> np.ndarray:
    """`order` regrouped into chunks of `chunk` ids of one bucket each (`bucket_of[id]`; -1:
    in no bucket, left out).

    Each bucket keeps its samples in `order`'s order and is cut into chunks; a bucket's last,
    partial chunk is topped up from the start of the bucket's own samples this epoch (as the
    loader pads an epoch's tail), or dropped with `drop_partial`. The chunks are then shuffled
    (seeded by seed and epoch), or without `shuffle` laid out by when their last sample comes
    in `order`. With `chunk` = batch per rank x ranks, every step's batches on every rank hold
    one bucket's shape; the result's length is a multiple of `chunk`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    order = np.asarray(order, dtype=np.int64)
    buckets = np.asarray(bucket_of, dtype=np.int64)[order]
    chunks: list[tuple[int, np.ndarray]] = []  # (position in `order` of its last id, ids)
    for bucket in np.unique(buckets[buckets >= 0]):
        where = np.flatnonzero(buckets == bucket)
        full = len(where) // chunk * chunk
        for lo in range(0, full, chunk):
            chunks.append((int(where[lo + chunk - 1]), order[where[lo : lo + chunk]]))
        if full < len(where) and not drop_partial:
            tail = np.resize(order[where], full + chunk)[full:]  # wraps over the bucket's own
            chunks.append((int(where[-1]), tail))
    if not chunks:
        return np.empty(0, dtype=np.int64)
    chunks.sort(key=lambda c: c[0])
    if shuffle:
        picks = _rng(seed, _BUCKET_STREAM, epoch).permutation(len(chunks))
        chunks = [chunks[i] for i in picks]
    return np.concatenate([ids for _, ids in chunks])


def balanced_order(
    order: np.ndarray, cost: np.ndarray, world: int, per_rank: int, rounds: int = 1
) -> np.ndarray:
    """`order` with each step's positions dealt to the ranks by cost (`cost[id]`): a step is
    `rounds` micro-batches (gradient accumulation) of `per_rank` samples on each of `world`
    ranks, and rank r reads the entries r, r + world, ... of each micro-batch's chunk.

    The step keeps its samples (its gradient is the same sum); by decreasing cost they are cut
    into its rounds, so each micro-batch's ranks get samples of like cost, and within a
    round dealt longest first, each to the rank with the least cost so far among those with
    room. With one rank and one round nothing moves. A partial tail stays as it is.
    """
    if world < 1 or per_rank < 1 or rounds < 1:
        raise ValueError(f"world {world}, per_rank {per_rank}, rounds {rounds} must be positive")
    order = np.asarray(order, dtype=np.int64)
    cost = np.asarray(cost, dtype=np.float64)
    out = order.copy()
    chunk = world * per_rank
    for lo in range(0, len(order) - chunk * rounds + 1, chunk * rounds):
        step = order[lo : lo + chunk * rounds]
        if rounds > 1:
            step = step[np.argsort(-cost[step], kind="stable")]
        for k in range(rounds):
            ids = step[k * chunk : (k + 1) * chunk]
            if rounds > 1:
                ids = np.sort(ids)  # a round's samples in a fixed order before the deal
            out[lo + k * chunk : lo + (k + 1) * chunk] = _dealt(ids, cost, world, per_rank)
    return out


def _dealt(ids: np.ndarray, cost: np.ndarray, world: int, per_rank: int) -> np.ndarray:
    """One micro-batch's chunk laid out so that rank r's entries hold its dealt samples."""
    loads, slots = [0.0] * world, [[] for _ in range(world)]
    for i in np.argsort(-cost[ids], kind="stable").tolist():
        rank = min((r for r in range(world) if len(slots[r]) < per_rank),
                   key=lambda r: (loads[r], r))  # fmt: skip
        slots[rank].append(i)
        loads[rank] += float(cost[ids[i]])
    out = np.empty_like(ids)
    for rank, picked in enumerate(slots):
        out[rank + world * np.arange(per_rank)] = ids[sorted(picked)]
    return out


def sample_rng(seed: int, epoch: int, position: int) -> np.random.Generator:
    """The generator a decoder uses for the sample at global `position` of `epoch`."""
    return _rng(seed, _SAMPLE_STREAM, epoch, position)


def steps_in(remaining: int, world_size: int, batch_size: int, drop_tail: bool) -> int:
    """Batches every rank yields over `remaining` positions: the tail dropped, or padded."""
    per_step = world_size * batch_size
    return remaining // per_step if drop_tail else -(-remaining // per_step)


@dataclass(frozen=True)
class Segment:
    """The positions of an epoch not yet consumed: [start, length) minus `skip` (sorted).

    Entry j of the segment is its j-th remaining position; entries past the end wrap around,
    so the tail can be padded with samples from the segment's beginning.
    """

    length: int
    start: int = 0
    skip: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return self.length - self.start - len(self.skip)

    def positions(self, entries: np.ndarray) -> np.ndarray:
        """Global positions of segment entries (any non-negative ints; they wrap around)."""
        if self.size <= 0:
            raise ValueError("the segment is empty: no positions left in this epoch")
        j = np.asarray(entries, dtype=np.int64) % self.size
        if not self.skip:
            return self.start + j
        skip = np.asarray(self.skip, dtype=np.int64)
        # Position of entry j is start + j + (skips at or before it): iterate to the fixed point.
        guess = self.start + j
        while True:
            better = self.start + j + np.searchsorted(skip, guess, side="right")
            if np.array_equal(better, guess):
                return guess
            guess = better

    def rank_positions(self, rank: int, world_size: int, first: int, count: int) -> np.ndarray:
        """Positions of rank `rank`'s entries number first, first+1, ... (entries r + k*W)."""
        k = np.arange(first, first + count, dtype=np.int64)
        return self.positions(rank + k * world_size)

    def after(self, world_size: int, consumed: Sequence[int]) -> Segment:
        """The segment left once rank r consumed its first `consumed[r]` entries."""
        if len(consumed) != world_size:
            raise ValueError(f"{len(consumed)} consumed counts for world size {world_size}")
        if self.size <= 0:
            return self
        done = [self.rank_positions(r, world_size, 0, c) for r, c in enumerate(consumed) if c]
        if not done:
            return self
        done_set = np.union1d(np.concatenate(done), np.asarray(self.skip, dtype=np.int64))
        # The new start: the first position of [start, length) consumed by nobody.
        gaps = np.setdiff1d(np.arange(self.start, done_set[-1] + 2), done_set)
        start = min(int(gaps[0]), self.length)
        skip = done_set[done_set > start]
        return Segment(self.length, start, tuple(int(p) for p in skip))
