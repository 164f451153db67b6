"""Shared by the benchmark scripts: the machine line and appending a section to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
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
