"""Shared by the benchmark scripts: the machine line, appending a section to RESULTS.md, and
the GPU checks' timing and sync counting (a CPU run proves they run)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "RESULTS.md"


def machine() -> str:
    """CPU model (lscpu), core count, GPU and torch version, in one line."""
    cpu = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
            cpu,
        )
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: how busy the (shared) machine was."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def command() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def append_results(
    title: str, rows: list[str], notes: list[str] = (), path: Path = RESULTS
) -> None:
    """Append `## title (date)`, the command, the machine, notes and the table rows."""
    lines = [
        f"\n## {title} ({datetime.date.today()})",
        "",
        f"command: `{command()}`",
        f"machine: {machine()}",
        "",
        *notes,
        *([""] if notes else []),
        *rows,
        "",
    ]
    with open(path, "a") as f:
        f.write("\n".join(lines))


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(step, device: torch.device, steps: int = 5, warmup: int = 1) -> float:
    """Median seconds of `step()` over `steps` calls after `warmup` untimed ones, each timed
    from an idle device to an idle device."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def count_syncs(step, device: torch.device) -> int | None:
    """Device->host synchronisations `step()` makes (torch's sync debug mode warns at each);
    None off CUDA, where there is nothing to count."""
    if device.type != "cuda":
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)
