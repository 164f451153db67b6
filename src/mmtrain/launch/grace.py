"""How long before its end a job must tell the ranks to stop: enough to finish the step and
write a checkpoint, with a margin.

The checkpoint's size comes from the planner (parameters of the model spec, no torch): the
"full" format holds the weights and AdamW's two moments, each in the training dtype (float32,
float64 under `train.precision: fp64`), plus an EMA copy when `train.ema` is set. Writing it
at `write_gb_per_s` (a shared file system's rate for one writer; 0.5 GB/s by default, an
assumption the user overrides) gives the expected time; the lead time is twice that plus a
fixed allowance for finishing the step in flight and Slurm's signal resolution (Slurm may send
the signal up to 60 s early or late).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmtrain.config import RunConfig
from mmtrain.plan.model import from_spec
from mmtrain.spec import load_spec
from mmtrain.structured import FieldError

DEFAULT_WRITE_GB_PER_S = 0.5
STEP_AND_SIGNAL_ALLOWANCE_S = 120  # the step in flight + Slurm's up-to-60-s signal resolution
SAFETY_FACTOR = 2.0  # the write rate is a guess; a slow file system halves it


@dataclass(frozen=True)
class Grace:
    checkpoint_bytes: int
    write_s: float  # expected write time at the assumed rate
    seconds: int  # the lead time to signal the job with

    def describe(self) -> str:
        return (
            f"checkpoint ~{self.checkpoint_bytes / 1e9:.2f} GB, ~{self.write_s:.0f} s to write; "
            f"signal {self.seconds} s before the end"
        )


def checkpoint_bytes(config: RunConfig) -> int:
    """Bytes of one full checkpoint of the run (weights + optimizer moments [+ EMA])."""
    try:
        params = from_spec(load_spec(config.model)).params()
    except (ValueError, TypeError, KeyError) as err:
        raise FieldError(
            "model", f"the planner cannot size {config.model!r} ({err}); give --signal-seconds"
        ) from None
    element = 8 if config.train.precision == "fp64" else 4
    copies = 3 + (1 if config.train.ema is not None else 0)
    return params * element * copies


def grace_for(config: RunConfig, write_gb_per_s: float = DEFAULT_WRITE_GB_PER_S) -> Grace:
    if write_gb_per_s <= 0:
        raise ValueError(f"the checkpoint write rate must be positive, got {write_gb_per_s}")
    size = checkpoint_bytes(config)
    write_s = size / (write_gb_per_s * 1e9)
    seconds = math.ceil(SAFETY_FACTOR * write_s + STEP_AND_SIGNAL_ALLOWANCE_S)
    return Grace(size, write_s, seconds)
