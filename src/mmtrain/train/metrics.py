"""Training metrics: one JSON line per step in `OUT/metrics.jsonl`, the same scalars in
TensorBoard, and the throughput figures that say whether the accelerator is busy.

Per step: loss and loss per pair, learning rate per group, logit scale, grad norm, samples/s,
step time split into data wait / forward+backward / optimizer, the data-wait fraction, MFU
(model FLOPs over the device's peak, when a peak is known), peak memory (CUDA) or RSS (CPU),
skipped steps and corrupt samples.

On resume the writer drops the lines after the checkpoint's step (a crashed run may have logged
steps that the resumed run repeats) and TensorBoard purges its events after that step, so the
curves of an interrupted run look like one run.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from mmtrain.atomic import atomic_write_text

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def train_flops_per_sample(forward_flops: int, recompute: bool = False) -> int:
    """Forward + backward FLOPs per sample: backward is about twice the forward (gradients for
    inputs and for weights); activation checkpointing adds one more forward."""
    return forward_flops * (4 if recompute else 3)


def detect_peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of the current GPU from the hardware catalog, or None if unknown."""
    if device.type != "cuda":
        return None
    from mmtrain.hardware import get_gpu
    from mmtrain.structured import FieldError

    name = torch.cuda.get_device_name(device)
    try:
        return get_gpu(name).peak_flops("bf16" if precision == "fp8" else precision)
    except FieldError:
        log.info("no peak FLOP/s known for %r: MFU not reported (set metrics.peak_tflops)", name)
        return None


def memory_gib(device: torch.device) -> dict[str, float]:
    """Peak CUDA memory allocated since the last reset, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"peak_rss_gib": peak * scale / 2**30}


class MetricsWriter:
    """Appends metric rows to metrics.jsonl and TensorBoard (on rank 0 only; a no-op elsewhere)."""

    def __init__(
        self,
        out: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        resume_step: int = 0,
    ):
        self.enabled = enabled
        self.path = Path(out) / METRICS_FILE
        self._file = None
        self._tb = None
        if not enabled:
            return
        self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(out) / "tensorboard"), purge_step=resume_step + 1)

    def _truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if row.get("step", 0) <= step:
                kept.append(line)
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))

    def write(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **row}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if (
                    key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self._tb.add_scalar(key.replace(".", "/"), value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def throughput(
    samples: int,
    times: dict[str, float],
    *,
    flops_per_sample: int,
    peak_flops: float | None,
    world_size: int,
) -> dict[str, float]:
    """samples/s, step time and its split, data-wait fraction and MFU for one optimizer step.

    `times` holds seconds for "data", "compute" (forward+backward) and "optimizer"; `samples`
    is the global batch. MFU = achieved model FLOP/s per device / the device's peak.
    """
    step_s = sum(times.values())
    row = {
        "samples_per_s": samples / step_s if step_s > 0 else 0.0,
        "step_s": step_s,
        "data_wait_s": times["data"],
        "compute_s": times["compute"],
        "optimizer_s": times["optimizer"],
        "data_wait_fraction": times["data"] / step_s if step_s > 0 else 0.0,
    }
    if peak_flops and step_s > 0:
        row["mfu"] = samples * flops_per_sample / step_s / world_size / peak_flops
    return row


class LossSpikes:
    """Flags a step whose loss jumps far above its recent level, so dirty data can be traced.

    Keeps an exponential moving mean and variance of the loss; after `warmup` steps, a loss
    above mean + `sigmas` x std is a spike (the caller logs the batch's sample keys). Spikes do
    not update the statistics, so one bad batch does not raise the bar for the next.
    """

    def __init__(self, sigmas: float = 4.0, decay: float = 0.95, warmup: int = 20):
        self.sigmas, self.decay, self.warmup = sigmas, decay, warmup
        self.mean = 0.0
        self.var = 0.0
        self.seen = 0

    def check(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        spike = self.seen >= self.warmup and loss > self.mean + self.sigmas * math.sqrt(self.var)
        if not spike:
            if self.seen == 0:
                self.mean = loss
            delta = loss - self.mean
            self.mean += (1 - self.decay) * delta
            self.var = self.decay * (self.var + (1 - self.decay) * delta * delta)
            self.seen += 1
        return spike
