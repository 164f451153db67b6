"""`mmtrain doctor` on a DPO run (train.objective: dpo): what its rewards say (TRL's metrics,
train/dpo.py).

Two failures the field reports, each read over the last quarter of the run (at least
`WINDOW` steps) against the run so far:

- the margin collapses: rewards/margins (chosen minus rejected reward) rose and then fell back
  under `COLLAPSE_SHARE` of its best window: the policy has stopped separating the pairs, the
  mark of a step too large for beta;
- both rewards fall: rewards/chosen and rewards/rejected both below zero and the chosen
  answers' log-probability lower than at the start: the policy pushes the rejected answers
  down by pushing everything down (likelihood displacement), the chosen ones too, so a larger
  margin no longer means better chosen answers.
"""

from __future__ import annotations

import statistics

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import RunData

WINDOW = 3  # rows a window of the run holds at least
COLLAPSE_SHARE = 0.25  # a margin back under a quarter of its best window has collapsed
KEYS = ("rewards/margins", "rewards/chosen", "rewards/rejected", "logps/chosen")


def preference_rewards(run: RunData) -> Finding | None:
    rows = [r for r in run.train_rows if all(k in r for k in KEYS)]
    window = max(WINDOW, len(rows) // 4)
    if len(rows) < 2 * window:
        return None
    last = rows[-window:]
    mean = {k: statistics.fmean(r[k] for r in last) for k in KEYS}
    margins = [statistics.fmean(r["rewards/margins"] for r in rows[i : i + window])
               for i in range(len(rows) - window + 1)]  # fmt: skip
    best = max(margins)
    beta = float((config_value(run, "train", "dpo", {}) or {}).get("beta", 0.1))
    lr = float(config_value(run, "train", "lr", 0.0))
    evidence = {f"{k}_last": round(v, 4) for k, v in mean.items()}
    steps = [r["step"] for r in last]
    cost = sum(r.get("step_s", 0.0) for r in last)
    if best > 0 and mean["rewards/margins"] < COLLAPSE_SHARE * best:
        return Finding(
            kind="preference",
            severity="warning",
            evidence={**evidence, "rewards/margins_best": round(best, 4), "train.lr": lr},
            why=(f"the reward margin fell from {best:.3g} to {mean['rewards/margins']:.3g}: the "
                 "policy no longer separates chosen from rejected answers"),  # fmt: skip
            advice=f"train again with train.lr={lr / 3:.3g} (now {lr:g})",
            cost_s=cost,
            steps=steps,
        )
    start = statistics.fmean(r["logps/chosen"] for r in rows[:window])
    falling = mean["logps/chosen"] < start
    if mean["rewards/chosen"] < 0 and mean["rewards/rejected"] < 0 and falling:
        return Finding(
            kind="preference",
            severity="warning",
            evidence={**evidence, "logps/chosen_first": round(start, 4), "train.dpo.beta": beta},
            why=("both rewards fell below zero and the chosen answers grew less likely "
                 f"({start:.4g} -> {mean['logps/chosen']:.4g}): the margin grows by pushing every "
                 "answer down, the chosen ones too"),  # fmt: skip
            advice=(f"raise train.dpo.beta to {2 * beta:g} (now {beta:g}), which holds the "
                    f"policy closer to the reference, or lower train.lr to {lr / 2:.3g}"),  # fmt: skip
            cost_s=cost,
            steps=steps,
        )
    return None
