"""One finding of `mmtrain doctor` (its kind, evidence, why and change) and the row helpers
every check shares."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mmtrain.report.rundata import RunData

WARMUP_STEPS = 1  # the first step pays for start-up (workers, caches, allocator): left out


@dataclass(frozen=True)
class Finding:
    kind: (
        str  # input_bound, communication, data_quality, non_finite, loss_spike, learning_rate, ...
    )
    severity: str  # info | warning | error
    evidence: dict[str, Any]  # metric names -> values, and the steps they came from
    why: str
    advice: str
    cost_s: float = 0.0  # step time the problem cost over the run (the findings' order)
    steps: list[int] = field(default_factory=list)

    def span(self) -> str:
        """The steps in a few words: `step 3`, `steps 2-9`, `steps 2, 4`, `12 steps in 2-90`."""
        steps = self.steps
        if not steps:
            return "no step"
        if len(steps) == 1:
            return f"step {steps[0]}"
        if steps == list(range(steps[0], steps[-1] + 1)):
            return f"steps {steps[0]}-{steps[-1]}"
        if len(steps) <= 6:
            return "steps " + ", ".join(map(str, steps))
        return f"{len(steps)} steps in {steps[0]}-{steps[-1]}"

    def evidence_text(self) -> str:
        """The evidence on one line, its steps included."""
        return "; ".join([*(f"{k}: {v}" for k, v in self.evidence.items()), self.span()])

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("steps")
        out["evidence"] = {**self.evidence, "steps": self.steps}
        return out


def steady_rows(run: RunData, key: str) -> list[dict[str, Any]]:
    """The training rows after the warm-up that carry `key` and a step time."""
    return [r for r in run.train_rows[WARMUP_STEPS:] if key in r and r.get("step_s")]


def config_value(run: RunData, section: str, key: str, default: Any) -> Any:
    return (run.config.get(section) or {}).get(key, default)
