"""The samples a loader skips: counted by kind and reason, and the point where skipping must
stop because no batch can ever be filled.

Two kinds of skipped sample: *corrupt* (a member that does not decode, a refused conversation)
and *too long* (a conversation the row of `data.sequence_length` positions cannot hold without
cutting an image, a clip or every answer). Both are skipped the same way, so the stream and an
exact resume do not depend on which; they are counted apart because they call for different
fixes (the data, or the row length).

Skipping stops when the samples refused in a row show that no batch can be filled
(`refusal_span`), or reach `max_in_a_row` first (the bound keeps a large data set from being
read through first). Without it, a run whose every sample is refused would cycle through its
epochs for ever (issue 40).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

KINDS = ("corrupt", "too_long")


@dataclass
class Refusal:
    """One skipped sample: where it is in the rank's stream and why."""

    entry: int  # index in its task
    position: int
    key: str
    shard: str
    reason: str
    message: str
    kind: str = "corrupt"  # "corrupt" or "too_long"
    detail: dict[str, Any] | None = None  # a too-long one's numbers (SkippedSample.detail)


def refusal_of(err: BaseException, entry: int, position: int, key: str, shard: str) -> Refusal:
    """The refusal a decode error makes: its `reason` (a short kind, or the error's class), its
    `skip_kind` ("too_long", or corrupt by default) and its `detail`."""
    reason = getattr(err, "reason", None)
    reason = reason if isinstance(reason, str) else type(err).__name__
    kind = getattr(err, "skip_kind", "corrupt")
    kind = kind if kind in KINDS else "corrupt"
    detail = getattr(err, "detail", None)
    detail = dict(detail) if isinstance(detail, dict) else None
    return Refusal(entry, position, key, shard, reason, str(err), kind, detail)


class NoValidSamples(RuntimeError):
    """Every sample of a whole epoch (or `max_in_a_row` in a row) was refused: no batch can be
    filled. `in_a_row` {kind: n} of the refusals in a row, `details` the too-long ones'
    numbers."""

    def __init__(self, message: str, in_a_row: dict[str, int], details: list[dict[str, Any]]):
        super().__init__(message)
        self.in_a_row, self.details = in_a_row, details


@dataclass
class Refusals:
    """A rank's skipped samples: totals per kind and reason (since the loader was made or
    `clear`ed), and the current run of refusals in a row, which lasts across epochs."""

    rank: int = 0
    max_in_a_row: int = 1000
    counts: dict[str, Counter[str]] = field(default_factory=lambda: {k: Counter() for k in KINDS})
    _run: Counter[tuple[str, str]] = field(default_factory=Counter)
    _details: list[dict[str, Any]] = field(default_factory=list)
    _too_long_logged: bool = False

    def accepted(self) -> None:
        """A valid sample: the run of refusals ends."""
        if self._run:
            self._run.clear()
            self._details.clear()

    def refused(self, bad: Refusal, epoch: int, span: int) -> None:
        """Count `bad` and log it (a too-long sample once per loader, with the count to come
        in the metrics); raise NoValidSamples once `span` refusals in a row (`refusal_span`)
        show that no batch can be filled."""
        self.counts[bad.kind][bad.reason] += 1
        self._run[(bad.kind, bad.reason)] += 1
        if bad.detail is not None and len(self._details) < self.max_in_a_row:
            self._details.append(bad.detail)
        self._log(bad, epoch)
        in_a_row = sum(self._run.values())
        limit = min(self.max_in_a_row, max(1, span))
        if in_a_row >= limit:
            raise self._error(bad, in_a_row, limit == self.max_in_a_row)

    def total(self, kind: str) -> int:
        return sum(self.counts[kind].values())

    def clear(self) -> None:
        """Totals restart at zero (a resume or a rollback: the run's counters hold the rest)."""
        for counts in self.counts.values():
            counts.clear()
        self.accepted()

    def _log(self, bad: Refusal, epoch: int) -> None:
        if bad.kind != "too_long":
            logger.warning(
                "skipped corrupt sample %r of %s (epoch %d, position %d): %s: %s",
                bad.key, bad.shard, epoch, bad.position, bad.reason, bad.message,
            )  # fmt: skip
        elif not self._too_long_logged:
            self._too_long_logged = True
            logger.warning(
                "skipped sample %r of %s: too long for the row (%s); samples too long for "
                "data.sequence_length are skipped and counted in the metrics as "
                "too_long_samples (said once)", bad.key, bad.shard, bad.message,
            )  # fmt: skip

    def _error(self, last: Refusal, in_a_row: int, bounded: bool) -> NoValidSamples:
        reasons = ", ".join(f"{n} {kind} ({reason})" for (kind, reason), n in self._run.items())
        span = f"{in_a_row} samples in a row" if bounded else "every sample of a whole epoch"
        message = (
            f"{span} on rank {self.rank} could not be trained on: {reasons}; last: "
            f"{last.key!r} of {last.shard}: {last.message}"
        )
        kinds = Counter[str]()
        for (kind, _), n in self._run.items():
            kinds[kind] += n
        return NoValidSamples(message, dict(kinds), list(self._details))


def refusal_span(remaining: int, epoch_length: int, world_size: int, whole_tasks: bool) -> int:
    """Refusals in a row on one rank after which no batch of that rank can be filled.

    Batches of the next valid samples (`whole_tasks` False): the rank reads entries r, r + W,
    ... of the epoch's `remaining` positions, wrapping around, and stays in the epoch until
    its batch is filled, so a run of refusals never crosses an epoch (a batch ends on a valid
    sample). Its entries repeat after remaining / gcd(remaining, W): that many refusals are
    every sample the rank can reach, which it would otherwise read for ever.

    One batch per task (a worker's collate, buckets): a task of refused samples gives no batch
    and the epoch moves on, so a run crosses epochs; a run of 2E - 1 entries in epochs of E
    holds one epoch from its start to its end, hence 2 x the rank's share of `epoch_length`.
    With one rank that is every sample of the data (every epoch is a permutation of the same
    samples); with several, every sample the rank drew in an epoch."""
    if not whole_tasks:
        return remaining // math.gcd(remaining, world_size)
    return 2 * math.ceil(epoch_length / world_size)
