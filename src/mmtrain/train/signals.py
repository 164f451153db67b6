"""Pre-emption: SIGTERM / SIGINT ask the run to finish its step, checkpoint and exit 0."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class StopOnSignal:
    """SIGTERM/SIGINT set `requested` (finish the step, checkpoint, exit 0); a second one exits
    at once. Installed only in the main thread (signals cannot be handled elsewhere).

    A copy that arrives within `ECHO_S` of the first is taken for the same request: under plain
    torchrun on Slurm a rank gets Slurm's SIGTERM and torchrun's forwarded one milliseconds
    apart, and must not lose its checkpoint to that echo (a person's second Ctrl-C is slower)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    ECHO_S = 1.0

    def __init__(self) -> None:
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
        log.warning(
            "received %s: finishing this step and writing a checkpoint", signal.Signals(signum).name
        )

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
