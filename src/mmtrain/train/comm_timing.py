"""Communication time per training step: how long collectives were in flight, and how long the
step waited for them.

Two numbers per optimizer step (rows of metrics.jsonl, TensorBoard):

- `comm_s`: the length of the union of the intervals during which at least one collective of
  the step was in flight, whether or not computation ran at the same time. Two buckets reduced
  at once count once; a reduction hidden behind the backward counts in full.
- `comm_exposed_s`: the part of `comm_s` during which the step could do nothing but wait for
  communication (the union of the "exposed" parts below). `comm_s - comm_exposed_s` is the
  communication hidden behind computation. Always 0 <= comm_exposed_s <= comm_s <= step_s.

What is measured, and what "exposed" means for each kind of collective:

- DDP's gradient all-reduce, one interval per bucket, through a communication hook
  (`register_comm_hook`) that does what DDP's built-in reduction does (scale by 1 / world size,
  sum over ranks) and stamps each bucket's launch and completion. The backward keeps computing
  while buckets are reduced; once the last bucket is launched (all gradients are computed) it
  only waits. Exposed: from the launch of the step's last bucket to each bucket's completion.
- The contrastive loss's feature all-gathers (forward), the all-reduce of their gradients
  (backward) and the shape check (`mmtrain.distributed`), and the loop's all-reduce of the
  losses: blocking calls, the caller (or, on a GPU, the compute stream) waits for each in full.
  Exposed: all of it.
- FSDP2's all-gathers and reduce-scatters, through `FSDPModule.set_custom_all_gather` /
  `set_custom_reduce_scatter` with comms that issue the very collectives FSDP would. On a CPU
  (gloo) FSDP2 issues them as blocking calls on the training thread: exposed in full. On a GPU
  they run on FSDP's own streams and the compute stream waits for them at points FSDP chooses,
  which no public API shows: they count in `comm_s` but NOT in `comm_exposed_s`, which is
  then a lower bound (said in docs/TRAINING.md). Without these methods (older torch) FSDP's
  collectives are not measured at all (logged).

Not measured: FSDP's all-reduce of the 0-d logit scale's gradient (`parallel.py`, two scalars)
and the all-reduce inside `clip_grad_norm_` of sharded gradients (DTensor), both tiny.

Clocks. On a CPU each stamp is `time.perf_counter()`; a bucket's completion is stamped by a
callback on the work's future, which gloo runs on its own thread as soon as the reduction ends
(the backward runs in C++, mostly with the GIL released, so the callback is seldom held back). On a GPU a
wall-clock callback may run before the kernels end (NCCL's futures complete at launch), so
every stamp is a CUDA event: launches are recorded on the launching stream (the event fires when
the data the collective reads is ready), completions on the stream the future's callback runs
on, which CUDA makes wait for the collective's kernels. Events are read in `finish_step`, after
the loop's `torch.cuda.synchronize` at the end of the step: timing adds no synchronisation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmtrain import distributed

log = logging.getLogger(__name__)

# How much of an interval the step waited for (see the module docstring).
EXPOSED_ALL = distributed.EXPOSED_ALL  # blocking: the caller (or compute stream) waited throughout
EXPOSED_AFTER_LAST_LAUNCH = "tail"  # DDP bucket: waited from the last bucket's launch on
EXPOSED_UNKNOWN = distributed.EXPOSED_HIDDEN  # overlapped: its waiting is not observed here

Stamp = float | torch.cuda.Event
# Rows break comm_exposed_s down by collective: `comm_exposed_s/all_gather`, ... (each the union
# of its own exposed intervals: they sum to comm_exposed_s or more, where two overlap)
EXPOSED_PREFIX = "comm_exposed_s/"


@dataclass
class _Span:
    start: Stamp
    exposure: str
    collective: str  # its name in the rows' breakdown: ddp_all_reduce, all_gather, ...
    end: Stamp | None = None  # None while in flight


class CommTimer:
    """Collects the intervals of one step's collectives and turns them into `comm_s` and
    `comm_exposed_s`.

        timer = CommTimer(device, world_size).attach(trained)   # DDP hook / FSDP comms
        with timer:                                             # explicit collectives too
            for each step:
                timer.start_step()
                ... forward, backward, optimizer, torch.cuda.synchronize() ...
                row.update(timer.finish_step())                 # {} on one rank

    Only collectives between `start_step` and `finish_step` are counted; others (evaluation,
    checkpoints) pass through the same hooks untimed.
    """

    def __init__(self, device: torch.device, world_size: int):
        self.device = device
        self.world_size = world_size
        self.on_gpu = device.type == "cuda"
        self.in_step = False
        self._spans: list[_Span] = []
        self._origin: Stamp = 0.0

    # -- installation ------------------------------------------------------------------------
    def attach(self, module: nn.Module) -> CommTimer:
        """Time `module`'s own collectives: DDP's bucketed all-reduce, FSDP2's all-gathers and
        reduce-scatters. Call before the first forward; a plain module needs nothing."""
        if isinstance(module, nn.parallel.DistributedDataParallel):
            # DDP checks the hook's signature: a parameter named `bucket`, no string annotations.
            module.register_comm_hook(module.process_group, self._ddp_hook)
            return self
        from torch.distributed.fsdp import FSDPModule

        sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if sharded and (self.on_gpu or not hasattr(sharded[0], "set_custom_all_gather")):
            # On GPUs FSDP's own comms stay in place (stream and allocator choices we have not
            # measured there); its collectives are then not timed, and the row says so by
            # carrying only the loss's collectives.
            log.info("FSDP's collectives are not timed on this device/torch")
            return self
        for unit in sharded:
            unit.set_custom_all_gather(_TimedAllGather(self))
            unit.set_custom_reduce_scatter(_TimedReduceScatter(self))
        return self

    def __enter__(self) -> CommTimer:
        # mmtrain.distributed's collectives time themselves against the active timer.
        distributed.set_collective_timer(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        distributed.set_collective_timer(None, only_if=self)
        self.in_step = False
        self._spans = []

    # -- one step ----------------------------------------------------------------------------
    def start_step(self) -> None:
        """Open a new step: forget earlier intervals and set the time origin (now)."""
        self._spans = []
        self._origin = self.stamp()
        self.in_step = self.world_size > 1

    def finish_step(self) -> dict[str, float]:
        """`{"comm_s", "comm_exposed_s", "comm_exposed_s/NAME" per collective}` of the step
        (`{}` on one rank: no communication).

        On a GPU, call after the step's `torch.cuda.synchronize()`: the events are read then.
        """
        self.in_step = False
        if self.world_size == 1:
            return {}
        try:
            spans = [
                (s, self._seconds(s.start), self._seconds(s.end))
                for s in self._spans
                if s.end is not None
            ]
        except RuntimeError:  # events unreadable (e.g. on another device): no figure, no crash
            log.warning("communication time could not be read this step", exc_info=True)
            self._spans = []
            return {}
        self._spans = []
        in_flight = [(start, end) for _, start, end in spans]
        tails = [start for s, start, _ in spans if s.exposure == EXPOSED_AFTER_LAST_LAUNCH]
        last_launch = max(tails, default=0.0)
        exposed: dict[str, list[tuple[float, float]]] = {}
        for span, start, end in spans:
            if span.exposure == EXPOSED_ALL:
                exposed.setdefault(span.collective, []).append((start, end))
            elif span.exposure == EXPOSED_AFTER_LAST_LAUNCH:
                exposed.setdefault(span.collective, []).append((max(start, last_launch), end))
        every = [interval for intervals in exposed.values() for interval in intervals]
        row = {"comm_s": union_length(in_flight), "comm_exposed_s": union_length(every)}
        for name, intervals in sorted(exposed.items()):
            row[f"{EXPOSED_PREFIX}{name}"] = union_length(intervals)
        return row

    # -- stamps ------------------------------------------------------------------------------
    def stamp(self) -> Stamp:
        """Now: a perf_counter reading, or a CUDA event recorded on the current stream."""
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, exposure: str, collective: str) -> _Span:
        """A new interval of this step starting now; the caller sets its `end`."""
        span = _Span(self.stamp(), exposure, collective)
        self._spans.append(span)  # list.append is atomic: callbacks may run on other threads
        return span

    def _seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self._origin
        return self._origin.elapsed_time(stamp) / 1e3  # milliseconds between two events

    def _until_done(self, span: _Span, future: torch.futures.Future) -> torch.futures.Future:
        """`future` chained with a callback that stamps `span`'s end when the work completes
        and passes on the work's (first) tensor, as DDP expects of a hook's future."""

        def done(fut: torch.futures.Future) -> torch.Tensor:
            result = fut.value()[0]  # raises the collective's own error, if any
            try:
                span.end = self.stamp()  # on a GPU: on a stream that waits for the collective
            except RuntimeError:  # a metric must never fail the gradient reduction
                log.debug("could not time a collective", exc_info=True)
            return result

        return future.then(done)

    # -- DDP ---------------------------------------------------------------------------------
    def _ddp_hook(self, process_group, bucket):  # no annotations: DDP inspects them
        """DDP's default reduction, timed: scale by 1 / world size (as DDP's reducer does while
        copying gradients into the bucket), then sum over ranks."""
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        tensor.mul_(1.0 / group.size())
        if not self.in_step:  # a backward outside a timed step: reduce, untimed
            work = dist.all_reduce(tensor, group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        span = self.begin(EXPOSED_AFTER_LAST_LAUNCH, "ddp_all_reduce")
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return self._until_done(span, work.get_future())

    # -- FSDP2 -------------------------------------------------------------------------------
    def run_fsdp_collective(
        self, collective: Callable[[bool], dist.Work | None], async_op: bool, name: str
    ) -> dist.Work | None:
        """Issue one of FSDP2's collectives (`collective(async_op)`) as FSDP asked, timed
        within a step under `name`."""
        if not self.in_step:
            return collective(async_op)
        if not async_op:
            # Blocking on a CPU (the training thread waits); on a GPU it runs on FSDP's stream.
            span = self.begin(EXPOSED_UNKNOWN if self.on_gpu else EXPOSED_ALL, name)
            work = collective(False)
            span.end = self.stamp()  # on a GPU: FSDP's stream now waits for the collective
            return work
        span = self.begin(EXPOSED_UNKNOWN, name)  # FSDP waits on the work later, unseen
        work = collective(True)
        self._until_done(span, work.get_future())
        return work


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (start, end), overlaps counted once; an interval
    that ends before it starts (a DDP bucket done before the last launch) covers nothing."""
    total, reach = 0.0, -float("inf")
    for start, end in sorted(intervals):
        if end <= max(start, reach):
            continue
        total += end - max(start, reach)
        reach = end
    return total


# ----------------------------------------------------------------------------- FSDP2 comms
# FSDP2 calls `allocate` for the output (all-gather) or input (reduce-scatter) buffer, then the
# comm itself with these keyword arguments; the default comms allocate with torch.empty and
# call the same two collectives (named all_gather_single / reduce_scatter_single from torch 2.13,
# all_gather_into_tensor / reduce_scatter_tensor before).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _TimedComm:
    def __init__(self, timer: CommTimer):
        self.timer = timer

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _TimedAllGather(_TimedComm):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        def gather(async_op: bool) -> dist.Work | None:
            return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)

        return self.timer.run_fsdp_collective(gather, async_op, "fsdp_all_gather")


class _TimedReduceScatter(_TimedComm):
    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        def scatter(async_op: bool) -> dist.Work | None:
            return _REDUCE_SCATTER(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

        return self.timer.run_fsdp_collective(scatter, async_op, "fsdp_reduce_scatter")
