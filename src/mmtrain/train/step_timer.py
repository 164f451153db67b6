"""The split of one optimizer step's time: waiting for data, forward+backward, the rest.

    timer = StepTimer(device)
    timer.start()            # before the next micro-batches are fetched
    timer.data_ready()       # they are on the device: forward+backward starts
    timer.compute_done()     # the last backward is launched
    ... optimizer_step (the step's one device->host read) ...
    times = timer.finish()   # {"data", "compute", "optimizer"} seconds; they sum to the step

On a CPU every op runs when it is called, so four host clock stamps split the step. On a GPU
the host only launches kernels: the forward and backward are launched in milliseconds and the
host then waits for them inside the step's one read (the NaN guard's flags), so host stamps
would call the launches "compute" and the wait "optimizer". There the forward+backward is
timed by two CUDA events recorded around it on the current stream (where the loop's kernels
run, and where DDP and FSDP2 make the stream wait for their collectives before the backward
returns), and `finish` reads them after that read: everything before it on the stream has run,
so the events are complete and reading them waits for nothing. No synchronisation is added.

The step is still the host's (`finish` - `start`): what a run's samples/s is made of. The
"optimizer" part is the rest of it: the gradient clip, the host's wait for the device at the
read, the optimizer's launches, the schedule and EMA. The optimizer's kernels run on after the
read, overlapping the next step's data fetch; when they are still running as the next step's
forward+backward is enqueued, its begin event fires after them, and the host's wait for them
lands in that step's "optimizer" part, not in its compute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class DeviceEvent(Protocol):
    """What StepTimer uses of `torch.cuda.Event(enable_timing=True)`."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: DeviceEvent) -> float: ...  # milliseconds


def cuda_timing_event() -> DeviceEvent:
    return torch.cuda.Event(enable_timing=True)


class StepTimer:
    """Times one step (see the module docstring). `event_factory` makes the device events
    (default: CUDA timing events on a CUDA device, none elsewhere); `clock` is the host clock."""

    def __init__(
        self,
        device: torch.device,
        event_factory: Callable[[], DeviceEvent] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if event_factory is None and device.type == "cuda":
            event_factory = cuda_timing_event
        self.event_factory = event_factory
        self.clock = clock
        self.stamps: list[float] = []
        self.events: list[DeviceEvent] = []

    def start(self) -> None:
        self.stamps = [self.clock()]
        self.events = []

    def data_ready(self) -> None:
        self._stamp(2)

    def compute_done(self) -> None:
        self._stamp(3)

    def finish(self) -> dict[str, float]:
        """The step's split in seconds; call after the step's device->host read."""
        if len(self.stamps) != 3:
            raise RuntimeError("StepTimer.finish before start, data_ready and compute_done")
        t0, t1, t2 = self.stamps
        t3 = self.clock()
        compute = self._device_compute_s(t3 - t1)
        if compute is None:
            compute = t2 - t1  # each op ran when it was called
        return {"data": t1 - t0, "compute": compute, "optimizer": (t3 - t1) - compute}

    def _stamp(self, expected: int) -> None:
        if len(self.stamps) != expected - 1:
            raise RuntimeError("StepTimer stamps out of order: start, data_ready, compute_done")
        self.stamps.append(self.clock())
        if self.event_factory is not None:
            event = self.event_factory()
            event.record()
            self.events.append(event)

    def _device_compute_s(self, host_s: float) -> float | None:
        """The device's forward+backward time, or None without device events. Bounded by the
        host's time for the same span (the events are inside it; clocks differ by microseconds)."""
        if self.event_factory is None:
            return None
        begin, end = self.events
        if not end.query():
            # Nothing read the device since compute_done (the loop always does): waiting here
            # would add the sync the loop avoids, so this step keeps the host's split.
            log.debug("step timing: forward+backward unfinished at the step's end; host split")
            return None
        seconds = begin.elapsed_time(end) / 1000.0
        return min(max(seconds, 0.0), host_s)
