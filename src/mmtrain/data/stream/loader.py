"""StreamingLoader: batches from WebDataset shards in a deterministic, resumable order.

The main process owns the order (`mmtrain.data.stream.order`): it cuts this rank's stream of global
positions into tasks of `batch_size` entries and hands them to a `torch.utils.data.DataLoader`
as explicit indices. Workers only read and decode the positions they are given and return them
in order, so `num_workers` never changes the stream.

A batch is the next `batch_size` *valid* samples of the rank's stream: a sample whose read or
decode raises is skipped (no sleep), counted per reason and logged with its shard and key. The
state counts the stream *entries* (valid or not) behind the batches handed out — not what the
workers prefetched — so a resumed run skips the same corrupt samples the same way.

With `collate` (a decoder LM's padded or packed rows: samples of different lengths that cannot
be stacked), the worker lays out each task's valid samples as one batch itself, so collation
runs beside the training step instead of in series with it. Such a batch holds the valid
samples among its `batch_size` stream entries: fewer when some were skipped (a next-token loss
is normalised by the target tokens of the step, so a smaller micro-batch is still exact), and
a task with no valid sample gives no batch. The state still counts entries: resume is exact.

Buckets (`buckets`: each flat sample's bucket, a shape class of a denoiser's inputs): the
epoch's order is regrouped so that one step's entries on all ranks (batch_size x world_size
positions) are of one bucket (`order.bucketed_order`), and a batch is one task's valid
samples, as with `collate`: a corrupt sample makes its batch smaller instead of pulling in a
sample of another bucket. The epoch's length then depends on the epoch (partial chunks are
topped up per bucket); the state is the same few integers.

Costs (`costs`: each flat sample's cost, a VLM's pages and text): each step's samples (`rounds`
micro-batches on every rank) are dealt to the ranks by cost (`order.balanced_order`), so no
rank's micro-batch of many pages keeps the others waiting at every collective; resumed only
on the same ranks, micro-batch and rounds (the fingerprint names the deal).

State (`state_dict()`): seed, epoch, the segment of the epoch not yet consumed, world size and
batch size at save time, and how many entries each rank consumed: a few integers. Loaded on the
same world size and batch size, every rank continues its stream exactly; on another, the
consumed positions are folded into the segment and the rest is split anew, so the run still
sees exactly the samples it had not seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mmtrain.data.storage.prefetch import Prefetcher
from mmtrain.data.storage.remote_cache import STORAGE_ERRORS, cache_stats
from mmtrain.data.storage.shards import ShardSet
from mmtrain.data.storage.tar_index import ShardIndex
from mmtrain.data.stream.order import (
    Segment,
    balanced_order,
    bucketed_order,
    epoch_order,
    sample_rng,
    steps_in,
)
from mmtrain.data.stream.refusals import (
    NoValidSamples,
    Refusal,
    Refusals,
    refusal_of,
    refusal_span,
)

logger = logging.getLogger(__name__)

STATE_VERSION = 1
Decode = Callable[[dict[str, Any], np.random.Generator], dict[str, torch.Tensor]]
Collate = Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]

__all__ = [
    "StreamingLoader",
    "NoValidSamples",
    "merge_rank_states",
    "planned_samples",
    "Collate",
    "Decode",
]


# ----------------------------------------------------------------------------- the plan
class _Plan:
    """The pure part of the loader: sources, order per epoch, sizes. Shared with `data order`."""

    def __init__(
        self,
        sources: Sequence[ShardSet],
        seed: int,
        weights: Sequence[float] | None,
        epoch_samples: int | None,
        shuffle: bool,
        window: int,
        buckets: np.ndarray | None = None,
        chunk: int = 1,
        drop_partial: bool = False,
        costs: np.ndarray | None = None,
        world: int = 1,
        rounds: int = 1,
    ):
        if not sources:
            raise ValueError("no data sources")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.sources = list(sources)
        self.seed = seed
        self.weights = None if weights is None else [float(w) for w in weights]
        self.shuffle = shuffle
        self.window = window
        totals = [len(s) for s in self.sources]
        self.source_starts = np.concatenate([[0], np.cumsum(totals)]).astype(np.int64)
        self.length = int(sum(totals) if epoch_samples is None else epoch_samples)
        self.buckets, self.chunk, self.drop_partial = buckets, chunk, drop_partial
        if buckets is not None and len(buckets) != int(sum(totals)):
            raise ValueError(f"{len(buckets)} bucket ids for {int(sum(totals))} samples")
        if costs is not None and len(costs) != int(sum(totals)):
            raise ValueError(f"{len(costs)} sample costs for {int(sum(totals))} samples")
        self.costs, self.world, self.rounds = costs, world, rounds
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            order = epoch_order(
                [s.sizes() for s in self.sources],
                self.seed,
                epoch,
                weights=self.weights,
                epoch_samples=self.length,
                shuffle=self.shuffle,
                window=self.window,
            )
            if self.buckets is not None:
                order = bucketed_order(order, self.buckets, self.chunk, self.seed, epoch,
                                       drop_partial=self.drop_partial, shuffle=self.shuffle)  # fmt: skip
            if self.costs is not None:
                per_rank = self.chunk // self.world
                order = balanced_order(order, self.costs, self.world, per_rank, self.rounds)
            self._cached = (epoch, order)
        return self._cached[1]

    def epoch_length(self, epoch: int) -> int:
        """Positions in `epoch`: `length`, or with buckets its bucketed order's length."""
        return self.length if self.buckets is None else len(self.order(epoch))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cached"] = None  # workers get positions, not the order: keep their copy small
        return state

    def fingerprint(self) -> str:
        parts = [s.fingerprint() for s in self.sources]
        text = ",".join(parts) + (f";w={self.weights}" if self.weights else "")
        if self.buckets is not None:  # which samples share a bucket is part of the order
            digest = hashlib.sha256(np.ascontiguousarray(self.buckets, dtype=np.int64)).hexdigest()
            text += f";buckets={digest[:16]}"
        if self.costs is not None:  # how samples are dealt to ranks is part of the order
            digest = hashlib.sha256(np.ascontiguousarray(self.costs, dtype=np.float64)).hexdigest()
            text += (
                f";costs={digest[:16]};deal={self.world}x{self.chunk // self.world}x{self.rounds}"
            )
        return text

    def locate(self, flat: int) -> tuple[ShardSet, int]:
        source = int(np.searchsorted(self.source_starts, flat, side="right")) - 1
        return self.sources[source], flat - int(self.source_starts[source])

    @property
    def remote(self) -> bool:
        return any(s.remote for s in self.sources)

    def remote_shard(self, flat: int) -> ShardIndex | None:
        """The shard of flat id `flat` when it lies in object storage (else None)."""
        source, local = self.locate(flat)
        shard = source.shards[source.locate(local)[0]]
        return shard if shard.remote else None


def planned_samples(
    sources: ShardSet | Sequence[ShardSet],
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    skip: int = 0,
    batch_size: int = 1,
    drop_tail: bool = False,
    shuffle: bool = True,
    shuffle_window: int = 1000,
    weights: Sequence[float] | None = None,
    epoch_samples: int | None = None,
    buckets: np.ndarray | None = None,
    costs: np.ndarray | None = None,
) -> Iterator[tuple[int, str, str]]:
    """(global position, shard path, key) of the samples rank `rank` reads in `epoch`, in order.

    `skip` global positions are taken as consumed (what `world_size x entries per rank` a
    resumed loader has behind it). Corrupt samples are listed too: the loader skips them when
    decoding fails, pulling the next entries of the same stream (bucketed: leaving their
    batch smaller).
    """
    sets = [sources] if isinstance(sources, ShardSet) else list(sources)
    plan = _Plan(sets, seed, weights, epoch_samples, shuffle, shuffle_window,
                 buckets, batch_size * world_size, drop_tail, costs, world_size)  # fmt: skip
    _check_rank(rank, world_size)
    length = plan.epoch_length(epoch)
    segment = Segment(length, start=min(max(0, skip), length))
    if segment.size <= 0:
        return
    entries = steps_in(segment.size, world_size, batch_size, drop_tail) * batch_size
    order = plan.order(epoch)
    for first in range(0, entries, 4096):
        positions = segment.rank_positions(rank, world_size, first, min(4096, entries - first))
        for position in positions.tolist():
            source, local = plan.locate(int(order[position]))
            yield position, str(source.shard_path(local)), source.key(local)


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..world_size-1 (world_size {world_size})")


# ----------------------------------------------------------------------------- workers
@dataclass
class _TaskResult:
    """Decoded samples of one task: rows of `tensors` are the valid entries, in order."""

    first: int  # stream entry of the task's first sample
    count: int
    valid: list[int]  # task entry of each row
    tensors: dict[str, torch.Tensor]
    keys: list[str]
    flat_ids: list[int]  # each row's sample id over all sources (the plan's flat id)
    corrupt: list[Refusal] = field(default_factory=list)

    def pin_memory(self) -> _TaskResult:
        """The result with page-locked tensors: the DataLoader's pin thread calls this, so a
        batch reaches the main process ready for an asynchronous copy to the GPU."""
        pinned = {n: _pinned(v) for n, v in self.tensors.items()}
        return dataclasses.replace(self, tensors=pinned)


def _pinned(value: Any) -> Any:
    """`value` in page-locked memory when it is a tensor (host values such as a collated
    batch's sizes pass as they are)."""
    if isinstance(value, torch.Tensor) and not value.is_pinned():
        return value.pin_memory()
    if isinstance(value, list):  # a native VLM's images / clips, each its own size
        return [_pinned(v) for v in value]
    return value


class _TaskDataset(torch.utils.data.Dataset):
    """Reads and decodes the samples of a task `(epoch, first entry, positions, flat ids)`;
    stacks them, or lays them out with `collate`."""

    def __init__(self, plan: _Plan, decode: Decode, collate: Collate | None = None):
        self.plan = plan
        self.decode = decode
        self.collate = collate

    def __getitem__(self, task: tuple[int, int, list[int], list[int]]) -> _TaskResult:
        epoch, first, positions, flat_ids = task
        outputs, valid, keys, ids, corrupt = [], [], [], [], []
        for entry, (position, flat) in enumerate(zip(positions, flat_ids, strict=True)):
            source, local = self.plan.locate(flat)
            key, shard = source.key(local), source.shard_path(local).name
            try:
                sample = source.read(local)
                out = self.decode(sample, sample_rng(self.plan.seed, epoch, position))
            except STORAGE_ERRORS:
                raise  # the storage failed, not the sample: skipping would change the stream
            except Exception as err:  # any failure of one sample's bytes is that sample's fault
                corrupt.append(refusal_of(err, entry, position, key, shard))
                continue
            outputs.append(_check_output(out, key))
            valid.append(entry)
            keys.append(key)
            ids.append(int(flat))
        if self.collate is None:
            tensors = _stack(outputs)
        else:
            tensors = self.collate(outputs) if outputs else {}
        return _TaskResult(first, len(positions), valid, tensors, keys, ids, corrupt)


def _check_output(out: Any, key: str) -> dict[str, torch.Tensor]:
    if not isinstance(out, dict):
        raise TypeError(
            f"decode must return a dict of tensors, got {type(out).__name__} for {key!r}"
        )
    tensors = {}
    for name, value in out.items():
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(value)
        # A list of tensors: inputs of their own sizes (a native VLM's pages and clips), which
        # only a `collate` lays out.
        is_list = isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value)
        if not isinstance(value, torch.Tensor) and not is_list:
            raise TypeError(
                f"decode returned {type(value).__name__} for {name!r} of {key!r}; expected a "
                "tensor or a list of tensors"
            )
        tensors[name] = value
    return tensors


def _stack(outputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not outputs:
        return {}
    names = list(outputs[0])
    for out in outputs[1:]:
        if list(out) != names:
            raise ValueError(f"decode returned keys {list(out)} and {names} for different samples")
    stacked = {}
    for name in names:
        shapes = {tuple(o[name].shape) for o in outputs}
        if len(shapes) > 1:
            raise ValueError(
                f"decode returned {name!r} of different shapes {sorted(shapes)}: pad or crop to one"
            )
        stacked[name] = torch.stack([o[name] for o in outputs])
    return stacked


def _tasks(
    plan: _Plan, epoch: int, segment: Segment, rank: int, world_size: int, size: int, first: int
) -> Iterator[tuple[int, int, list[int], list[int]]]:
    """Endless tasks of `size` entries of a rank's stream, from entry `first` on.

    A plain function, not a method: a generator holding the loader would make a reference
    cycle, and DataLoader workers freed by the cycle collector take seconds to stop.
    """
    order = plan.order(epoch)
    while True:
        positions = segment.rank_positions(rank, world_size, first, size)
        yield epoch, first, positions.tolist(), order[positions].tolist()
        first += size


def _as_is(x: Any) -> Any:
    return x


class _TaskSampler(torch.utils.data.Sampler):
    """Hands the DataLoader the tasks the main process planned (set before each iteration)."""

    def __init__(self) -> None:
        super().__init__()
        self.tasks: Iterator[Any] = iter(())

    def __iter__(self) -> Iterator[Any]:
        return self.tasks


# ----------------------------------------------------------------------------- loader
class StreamingLoader:
    """Batches of decoded samples for one rank, in an order that resumes exactly.

    sources: one `ShardSet`, or several mixed by `weights` (default: by size) into epochs of
      `epoch_samples` positions (default: all samples).
    decode: `decode(sample, rng) -> {name: tensor}`; raising marks the sample corrupt (or too
      long, for an error whose `skip_kind` says so: refusals.py). `rng` is seeded from (seed,
      epoch, global position): random crops are the same after a resume.
    max_consecutive_corrupt: refusals in a row past which iterating raises NoValidSamples (also
      earlier, once the refusals show that no batch can ever be filled: refusals.refusal_span).
    batch_size: samples per batch on this rank.
    drop_tail: the last positions of an epoch that do not fill a batch on every rank are left
      out; by default they are padded with samples from the start of the epoch (wrap-around).
    with_keys: add `"__key__"` to each batch: the sample keys, for logging and debugging; and
      `"__index__"`: each sample's id over all sources (flat ids: sources in order, each's
      samples shard after shard), which names a sample whatever the order or batching.
    pin_memory: page-locked batches (when CUDA is available), for asynchronous copies; pinned
        in the DataLoader's pin thread, beside the training step.
    collate: lay out each task's valid samples in the worker (module docstring); None: stack.
    Iterating yields the rest of the current epoch, then moves on to the next.
    """

    def __init__(
        self,
        sources: ShardSet | Sequence[ShardSet],
        decode: Decode,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        weights: Sequence[float] | None = None,
        epoch_samples: int | None = None,
        shuffle: bool = True,
        shuffle_window: int = 1000,
        drop_tail: bool = False,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        persistent_workers: bool = False,
        with_keys: bool = False,
        pin_memory: bool = False,
        max_consecutive_corrupt: int = 1000,
        multiprocessing_context: Any = None,
        collate: Collate | None = None,
        buckets: np.ndarray | None = None,
        costs: np.ndarray | None = None,
        rounds: int = 1,
    ):
        _check_rank(rank, world_size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        sets = [sources] if isinstance(sources, ShardSet) else list(sources)
        self.plan = _Plan(sets, seed, weights, epoch_samples, shuffle, shuffle_window,
                          buckets, batch_size * world_size, drop_tail, costs, world_size,
                          rounds)  # fmt: skip
        self.decode = decode
        self.collate = collate
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_tail = drop_tail
        self.with_keys = with_keys
        # Page-locked batches copy to the GPU asynchronously; meaningless without CUDA.
        self.pin_memory = pin_memory and torch.cuda.is_available()
        if steps_in(self.plan.epoch_length(0), world_size, batch_size, drop_tail) == 0:
            raise ValueError(
                f"{self.plan.epoch_length(0)} samples per epoch give no batch of {world_size} ranks x "
                f"{batch_size}: lower the batch size or keep the tail (drop_tail=False)"
            )
        self.refusals = Refusals(rank, max_consecutive_corrupt)
        self._workers = dict(
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            multiprocessing_context=multiprocessing_context,
        )
        self._sampler = _TaskSampler()
        self._dataloader: torch.utils.data.DataLoader | None = None
        self.set_epoch(0)

    # --------------------------------------------------------------- position
    @property
    def corrupt_counts(self) -> Counter[str]:
        """Corrupt samples skipped, per reason (since made or `refusals.clear()`)."""
        return self.refusals.counts["corrupt"]

    @property
    def too_long_counts(self) -> Counter[str]:
        """Samples skipped as too long for the row, per reason (refusals.py)."""
        return self.refusals.counts["too_long"]

    @property
    def seed(self) -> int:
        return self.plan.seed

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning."""
        self.epoch = epoch
        self._segment = Segment(self.plan.epoch_length(epoch))
        self._entry = 0  # stream entries of this rank consumed in the segment
        self._batches = 0  # batches every rank yielded in the segment

    def __len__(self) -> int:
        """Batches in the current epoch, from its start (the same on every rank)."""
        return steps_in(self._segment.length, self.world_size, self.batch_size, self.drop_tail)

    def remaining(self) -> int:
        """Batches left in the current epoch."""
        steps = steps_in(self._segment.size, self.world_size, self.batch_size, self.drop_tail)
        return steps - self._batches

    # --------------------------------------------------------------- state
    def rank_state(self) -> dict[str, Any]:
        """This rank's part of the state; `merge_rank_states` joins those of all ranks."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "epoch": self.epoch,
            "fingerprint": self.plan.fingerprint(),
            "length": self._segment.length,
            "start": self._segment.start,
            "skip": list(self._segment.skip),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "batches": self._batches,
            "rank": self.rank,
            "entries": self._entry,
        }

    def state_dict(self) -> dict[str, Any]:
        """The state of all ranks (a collective under torch.distributed: call it on every rank)."""
        if self.world_size == 1:
            return merge_rank_states([self.rank_state()])
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise RuntimeError(
                "state_dict() with world_size > 1 gathers every rank's state and needs "
                "torch.distributed; without it, merge the rank_state() of each rank yourself"
            )
        states: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, self.rank_state())
        return merge_rank_states(states)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` stopped (see the module docstring for other world sizes)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"loader state version {state.get('version')!r}, expected {STATE_VERSION}"
            )
        self._check_buckets(state)
        for name, mine in (
            ("seed", self.seed),
            ("fingerprint", self.plan.fingerprint()),
            ("length", self.plan.epoch_length(int(state["epoch"]))),
        ):
            if state[name] != mine:
                raise ValueError(
                    f"loader state was saved with {name} {state[name]!r}, this loader has {mine!r}: "
                    "the data or its order changed, so the run cannot resume exactly"
                )
        self.epoch = int(state["epoch"])
        segment = Segment(int(state["length"]), int(state["start"]), tuple(state["skip"]))
        consumed = [int(c) for c in state["consumed"]]
        if state["world_size"] == self.world_size and state["batch_size"] == self.batch_size:
            self._segment, self._entry = segment, consumed[self.rank]
            self._batches = int(state["batches"])
        else:
            self._segment = segment.after(int(state["world_size"]), consumed)
            self._entry = self._batches = 0
        if self.remaining() <= 0:
            self.set_epoch(self.epoch + 1)

    def _check_buckets(self, state: dict[str, Any]) -> None:
        """Bucketed chunks are one step of all ranks: their size must not change on resume."""
        saved = int(state["batch_size"]) * int(state["world_size"])
        if self.plan.buckets is not None and saved != self.plan.chunk:
            raise ValueError(
                f"the loader state was saved with {state['batch_size']} samples per rank x "
                f"{state['world_size']} ranks = {saved} a step, this run takes "
                f"{self.batch_size} x {self.world_size} = {self.plan.chunk}: bucketed data "
                "resumes exactly only with the same samples a step (keep the global batch and "
                "the gradient accumulation)"
            )
        same = (int(state["batch_size"]), int(state["world_size"])) == (
            self.batch_size,
            self.world_size,
        )
        if self.plan.costs is not None and not same:
            raise ValueError(
                f"the loader state was saved with {state['batch_size']} samples per rank x "
                f"{state['world_size']} ranks, this run takes {self.batch_size} x "
                f"{self.world_size}: samples dealt to ranks by cost (data.balance) resume "
                "exactly only on as many ranks with the same micro-batch"
            )

    # --------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        steps = steps_in(self._segment.size, self.world_size, self.batch_size, self.drop_tail)
        if self._batches >= steps:
            self.set_epoch(self.epoch + 1)
            return
        stream = (self.plan, self.epoch, self._segment, self.rank, self.world_size)
        tasks = _tasks(*stream, self.batch_size, self._entry)
        prefetcher = None
        if self.plan.remote:  # fetch shards in the order this rank reaches them
            # A batch takes one task or more (corrupt samples); steps + 1 covers the usual case.
            ahead = itertools.islice(
                _tasks(*stream, self.batch_size, self._entry), steps - self._batches + 1
            )
            prefetcher = Prefetcher(self.plan.remote_shard, ahead)
            tasks = prefetcher.gate(tasks)
        self._sampler.tasks = tasks
        results = iter(self._loader())
        try:
            whole = self.collate is not None or self.plan.buckets is not None
            assemble = self._whole_tasks if whole else self._assemble
            for batch, entries in assemble(results, self._entry):
                self._entry = entries
                self._batches += 1
                last = self._batches == steps
                if last:
                    self.set_epoch(self.epoch + 1)
                if batch is not None:  # None: a collated task without one valid sample
                    yield batch
                if last:
                    return
        finally:
            del results  # shuts down non-persistent workers and drops what they prefetched
            self._sampler.tasks = iter(())
            if prefetcher is not None:
                prefetcher.close()

    def cache_stats(self) -> dict[str, float]:
        """Counters of the shard caches of remote sources (`CacheStats.as_dict`: cache_hits,
        cache_misses, cache_hit_rate, cache_wait_s, ...); empty when every shard is local."""
        caches = [s.cache for src in self.plan.sources for s in src.shards if s.remote]
        return cache_stats(caches)

    def close(self) -> None:
        """Stop persistent workers now (otherwise they stop when the loader is freed)."""
        self._dataloader = None

    def _loader(self) -> torch.utils.data.DataLoader:
        if self._dataloader is None or not self._workers["persistent_workers"]:
            workers = self._workers["num_workers"]
            extra = {}
            if workers > 0:
                extra = {
                    "prefetch_factor": self._workers["prefetch_factor"],
                    "persistent_workers": self._workers["persistent_workers"],
                    "multiprocessing_context": self._workers["multiprocessing_context"],
                }
            self._dataloader = torch.utils.data.DataLoader(
                _TaskDataset(self.plan, self.decode, self.collate),
                batch_size=None,
                sampler=self._sampler,
                num_workers=workers,
                collate_fn=_as_is,
                pin_memory=self.pin_memory,
                # Its own generator: creating worker seeds must not draw from torch's global RNG.
                generator=torch.Generator().manual_seed(self.seed),
                **extra,
            )
        return self._dataloader

    def _assemble(
        self, results: Iterator[_TaskResult], entry: int
    ) -> Iterator[tuple[dict[str, Any], int]]:
        """Batches of the next `batch_size` valid samples, with the stream entry after each."""
        pieces: list[tuple[_TaskResult, int, int]] = []  # (result, first row, end row)
        have = 0
        for result in results:
            if result.first != entry:
                raise RuntimeError(f"task for entry {result.first} arrived, expected {entry}")
            corrupt = {c.entry: c for c in result.corrupt}
            row = lo = 0
            for i in range(result.count):
                if i in corrupt:
                    self._report(corrupt[i], whole_tasks=False)
                    continue
                self.refusals.accepted()
                row += 1
                have += 1
                if have == self.batch_size:
                    pieces.append((result, lo, row))
                    lo, have = row, 0
                    yield self._collate(pieces), entry + i + 1
                    pieces = []
            if row > lo:
                pieces.append((result, lo, row))
            entry += result.count

    def _whole_tasks(
        self, results: Iterator[_TaskResult], entry: int
    ) -> Iterator[tuple[dict[str, Any] | None, int]]:
        """One batch per task, collated by the worker (None when no sample of it was valid),
        with the stream entry after it."""
        for result in results:
            if result.first != entry:
                raise RuntimeError(f"task for entry {result.first} arrived, expected {entry}")
            corrupt = {c.entry: c for c in result.corrupt}
            for i in range(result.count):
                if i in corrupt:
                    self._report(corrupt[i], whole_tasks=True)
                else:
                    self.refusals.accepted()
            entry += result.count
            yield (self._collate([(result, 0, len(result.valid))]) if result.valid else None), entry

    def _report(self, bad: Refusal, whole_tasks: bool) -> None:
        """Count and log a skipped sample; NoValidSamples once no batch can be filled."""
        length = self._segment.length
        span = refusal_span(self._segment.size, length, self.world_size, whole_tasks)
        self.refusals.refused(bad, self.epoch, span)

    def _collate(self, pieces: list[tuple[_TaskResult, int, int]]) -> dict[str, Any]:
        if len(pieces) == 1 and pieces[0][1] == 0 and pieces[0][2] == len(pieces[0][0].valid):
            result = pieces[0][0]  # the common case: one whole task, no copy
            batch: dict[str, Any] = dict(result.tensors)
        else:
            names = list(pieces[0][0].tensors)
            batch = {n: torch.cat([r.tensors[n][lo:hi] for r, lo, hi in pieces]) for n in names}
        if self.pin_memory:  # tasks come pinned (the pin thread); a batch cut from several not
            batch = {n: _pinned(v) for n, v in batch.items()}
        if self.with_keys:
            batch["__key__"] = [k for r, lo, hi in pieces for k in r.keys[lo:hi]]
            batch["__index__"] = [i for r, lo, hi in pieces for i in r.flat_ids[lo:hi]]
        return batch


def merge_rank_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Join the `rank_state()` of every rank into one loader state (what a checkpoint saves)."""
    if not states:
        raise ValueError("no rank states to merge")
    common = ("version", "seed", "epoch", "fingerprint", "length", "start", "skip", "batch_size", "world_size", "batches")  # fmt: skip
    first = states[0]
    world = int(first["world_size"])
    consumed: list[int | None] = [None] * world
    for state in states:
        for name in common:
            if state[name] != first[name]:
                raise ValueError(
                    f"rank {state['rank']} has {name}={state[name]!r}, rank {first['rank']} "
                    f"has {first[name]!r}: ranks must save their state at the same step"
                )
        consumed[int(state["rank"])] = int(state["entries"])
    if any(c is None for c in consumed):
        missing = [r for r, c in enumerate(consumed) if c is None]
        raise ValueError(f"no state from rank(s) {missing} of world size {world}")
    merged = {name: first[name] for name in common}
    merged["consumed"] = consumed
    return merged
