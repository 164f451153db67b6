"""The run's counters: where training stands, saved in every checkpoint ("counters")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Optimizer steps and samples done, steps skipped, rollbacks, the samples skipped before
    this process started (corrupt and too long: the loader counts the ones since), and the
    rollback guard's count of non-finite steps in a row (not saved: a resume starts anew)."""

    step: int = 0
    samples_seen: int = 0
    skipped: int = 0
    rollbacks: int = 0
    refused_before: dict[str, int] = field(default_factory=dict)  # {REFUSED counter: n}
    nonfinite_in_a_row: int = 0

    def counters(self, refused: dict[str, int]) -> dict[str, int]:
        """The checkpoint's "counters"; `refused`: the run's skipped samples over all ranks,
        {"corrupt_samples": n, "too_long_samples": m}."""
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "skipped_steps": self.skipped,
            **refused,
            "rollbacks": self.rollbacks,
        }

    def load_counters(self, counters: dict[str, Any]) -> None:
        self.step, self.samples_seen = counters["step"], counters["samples_seen"]
        self.skipped = counters["skipped_steps"]
        self.refused_before = {
            "corrupt_samples": counters["corrupt_samples"],
            "too_long_samples": counters.get("too_long_samples", 0),  # older checkpoints: none
        }
        self.rollbacks = counters.get("rollbacks", 0)

    def count_step(self, batch_size: int, stepped: bool, bad: bool) -> None:
        """After an optimizer step: `stepped` False for a skipped one; `bad` for a step the
        rollback guard counts (a non-finite loss, or gradient without a loss scaler)."""
        self.step += 1
        self.samples_seen += batch_size
        self.skipped += not stepped
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if bad else 0
