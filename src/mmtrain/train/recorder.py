"""The metrics recorder: every step's row, read from the device only on logging steps.

A step hands over its measurements in two kinds (`add`): host values (counters, times, the
learning rate) and device tensors (losses, the gradient norm, token counts), which stay where
they are. Every `metrics.log_every` steps, and whenever the run needs its rows written (a
checkpoint, validation, a rollback, the end), `flush` reduces the pending steps' device values
over the ranks in ONE all-reduce, reads them in ONE transfer, and writes each step's row to
metrics.jsonl and TensorBoard (rank 0), to the bounded in-memory history and to the `on_step`
callback, in step order. So a row per step is kept, while the host waits for the device once
per logging interval instead of several times per step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmtrain.distributed import sum_tensor_over_ranks, world_size
from mmtrain.train.metrics import LossSpikes, MetricsWriter

log = logging.getLogger(__name__)

HISTORY_ROWS = 10_000  # rows kept in memory (TrainResult.history); metrics.jsonl keeps all
# The counters of skipped samples each row carries, the run's totals over all ranks: samples
# that did not decode or were refused, and samples too long for the row (data/stream/refusals.py).
REFUSED = ("corrupt_samples", "too_long_samples")


@dataclass
class _Pending:
    step: int
    host: dict[str, Any]
    mean: dict[str, torch.Tensor]  # averaged over ranks (each rank's share of a loss)
    local: dict[str, torch.Tensor]  # the same on every rank (gradient norm, global counts)
    refused: dict[str, int]  # this rank's skipped samples so far by counter (summed over ranks)
    keys: list[str]  # the step's sample keys, to name the culprits of a loss spike
    work: float | None  # this rank's share of the step's model FLOPs (gathered: load_balance)


class MetricsRecorder:
    """Collects step rows (`add`) and writes them on logging steps (`flush`)."""

    def __init__(
        self,
        out: Path,
        *,
        rank: int,
        log_every: int,
        tensorboard: bool,
        resume_step: int,
        refused_before: dict[str, int] | None = None,
        skipped_before: int = 0,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.writer = MetricsWriter(
            out, enabled=rank == 0, tensorboard=tensorboard, resume_step=resume_step
        )
        self.rank, self.log_every, self.on_step = rank, log_every, on_step
        # The run's skipped samples (REFUSED counters) before this process counted any.
        self.refused_before = {name: 0 for name in REFUSED} | dict(refused_before or {})
        self.spikes = LossSpikes()
        self.skipped_before = skipped_before  # the run's skipped steps at the last row written
        self.pending: list[_Pending] = []
        self.history: list[dict[str, Any]] = []

    def add(
        self,
        step: int,
        host: dict[str, Any],
        mean: dict[str, torch.Tensor],
        local: dict[str, torch.Tensor],
        refused: dict[str, int],
        keys: list[str],
        work: float | None = None,
    ) -> None:
        """`refused`: this rank's skipped samples so far, {REFUSED counter: n}. `work`: this rank's model FLOPs of the step, where ranks' inputs differ in cost (a
        language model's rows); the row then carries `load_balance`, the ranks' mean work over
        the heaviest rank's (1.0: even; a step lasts as long as its heaviest rank)."""
        self.pending.append(_Pending(step, host, mean, local, refused, keys, work))

    def due(self, step: int) -> bool:
        return step % self.log_every == 0

    def flush(self) -> None:
        """Reduce, read and write the pending rows (a collective: every rank calls it)."""
        if not self.pending:
            return
        values = self._read_pending()
        for pending, (mean, local, refused, loads) in zip(self.pending, values, strict=True):
            row = {**mean, **local, **pending.host, **refused}
            if loads and max(loads) > 0:
                row["load_balance"] = sum(loads) / len(loads) / max(loads)
            if "target_tokens" in row and row.get("step_s"):
                row["target_tokens_per_s"] = row["target_tokens"] / row["step_s"]
            self._record_events(pending, row)
            self._write(pending.step, row)
        self.pending.clear()

    def _record_events(self, pending: _Pending, row: dict[str, Any]) -> None:
        """A skipped (non-finite) step or a loss spike becomes a record of its own with the
        batch's sample keys (`mmtrain doctor` traces dirty data by them)."""
        skipped = row.get("skipped_steps", 0) > self.skipped_before
        self.skipped_before = row.get("skipped_steps", self.skipped_before)
        event = {"loss": row["loss"], "samples": list(pending.keys)}
        if skipped or not math.isfinite(row["loss"]):
            self.writer.record("non_finite", pending.step, event)
        elif self.spikes.check(row["loss"]):
            log.warning(
                "step %d: loss spike %.4f; samples: %s",
                pending.step, row["loss"], ", ".join(pending.keys),
            )  # fmt: skip
            self.writer.record("loss_spike", pending.step, event)

    def _read_pending(self) -> list[tuple[dict[str, float], dict[str, float], dict, list]]:
        """The pending steps' values as numbers: means over ranks, local values, the
        skipped-sample totals and every rank's work, from one all-reduce and one device->host
        transfer (each rank's work travels in its own slot of a zero vector: the sum gathers)."""
        pending, world = self.pending, world_size()
        means = [v.reshape(()).double() for p in pending for v in p.mean.values()]
        locals_ = [v.reshape(()).double() for p in pending for v in p.local.values()]
        device = (means + locals_)[0].device if means or locals_ else torch.device("cpu")
        refused = [p.refused.get(name, 0) for p in pending for name in REFUSED]
        parts = [torch.stack(means).to(device)] if means else []
        parts.append(torch.tensor(refused, dtype=torch.float64, device=device))
        gather = world > 1 and all(p.work is not None for p in pending)
        if gather:
            slots = torch.zeros(len(pending), world, dtype=torch.float64)
            slots[:, self.rank] = torch.tensor([p.work for p in pending], dtype=torch.float64)
            parts.append(slots.flatten().to(device))
        summed = sum_tensor_over_ranks(torch.cat(parts))
        flat = torch.cat([summed, torch.stack(locals_).to(device)]) if locals_ else summed
        numbers = flat.tolist()  # the one read of the logging interval
        n_mean, n, n_refused = len(means), len(pending), len(pending) * len(REFUSED)
        mean_values = iter(v / world for v in numbers[:n_mean])
        refused_totals = iter(numbers[n_mean : n_mean + n_refused])
        n_work = n * world if gather else 0
        works = numbers[n_mean + n_refused : n_mean + n_refused + n_work]
        loads = [works[i * world : (i + 1) * world] for i in range(n)] if gather else [[]] * n
        local_values = iter(numbers[n_mean + n_refused + n_work :])
        return [
            (
                {name: next(mean_values) for name in p.mean},
                {name: next(local_values) for name in p.local},
                {
                    name: self.refused_before[name] + int(round(next(refused_totals)))
                    for name in REFUSED
                },
                load,
            )
            for p, load in zip(pending, loads, strict=True)
        ]

    def _write(self, step: int, row: dict[str, Any]) -> None:
        self.writer.write(step, row)
        self.history.append({"step": step, **row})
        if len(self.history) > HISTORY_ROWS:
            del self.history[: len(self.history) - HISTORY_ROWS]
        if self.on_step is not None and self.rank == 0:
            self.on_step({"step": step, **row})

    def rewind(self, step: int) -> None:
        """Forget the rows after `step` (a rollback to the checkpoint of `step`)."""
        self.pending = [p for p in self.pending if p.step <= step]
        self.flush()
        self.writer.rewind(step)
        self.history = [row for row in self.history if row["step"] <= step]

    def record(self, kind: str, step: int, data: dict[str, Any]) -> None:
        self.writer.record(kind, step, data)

    def close(self) -> None:
        self.writer.close()
