"""Pre-emption: SIGTERM / SIGINT ask the run to finish its step, checkpoint and exit 0; with
nothing to save since the last checkpoint, the run stops at once, wherever it is."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class StopRequested(BaseException):
    """Raised by the signal handler where the run stops at once: nothing to save. A
    BaseException, so that no `except Exception` on the way (a sample's decode) takes it."""


class StopOnSignal:
    """SIGTERM/SIGINT set `requested` (finish the step, checkpoint, exit 0); a second one exits
    at once. Installed only in the main thread (signals cannot be handled elsewhere).

    `nothing_to_save()` True (no step completed since the last checkpoint) makes the first
    signal raise StopRequested wherever the main thread is: a step that cannot complete (data
    that never fills a batch, a stalled read) would otherwise hold the stop back for ever, and
    the scheduler's pre-emption notice would be lost. The trainer asks this of one process
    only: ranks of a job are a few milliseconds apart at a step's end, so one could stop at
    once while another, a step further, waits for it in the collective that agrees on the
    checkpoint. Several ranks agree on the stop at the step's end (`Checkpointer.due`); a step
    that cannot complete there ends with the scheduler's kill after its grace period, and the
    newest checkpoint stands.

    A copy that arrives within `ECHO_S` of the first is taken for the same request: under plain
    torchrun on Slurm a rank gets Slurm's SIGTERM and torchrun's forwarded one milliseconds
    apart, and must not lose its checkpoint to that echo (a person's second Ctrl-C is slower)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    ECHO_S = 1.0

    def __init__(self, nothing_to_save: Callable[[], bool] | None = None) -> None:
        self.nothing_to_save = nothing_to_save
        self.requested = False
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            if time.monotonic() - self._first_at < self.ECHO_S:
                return
            raise SystemExit(128 + signum)
        self.requested = True
        self._first_at = time.monotonic()
        name = signal.Signals(signum).name
        if self.nothing_to_save is not None and self.nothing_to_save():
            log.warning("received %s: no step since the last checkpoint, stopping now", name)
            raise StopRequested(name)
        log.warning("received %s: finishing this step and writing a checkpoint", name)

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
