"""bench/gpu.sh's checks run: its dry run (tiny sizes, on the CPU) goes through every case and
note of the GPU benchmark, so that a break shows here and not on a lent GPU's few minutes.
Nothing it measures on a CPU is asserted (the GPU's figures are what it is for)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent

pytestmark = pytest.mark.slow


def test_the_gpu_benchmark_runs_every_case_and_note_in_its_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO / 'bench'}"}
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_bench.py"), "--out", str(tmp_path),
         "--dry-run", "--budget-s", "600"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_results.json").read_text())
    notes = results["notes"]
    # every check of the GPU path reported (the last one drawn up: the VLM loader)
    assert any(n.startswith("VLM loader") for n in notes), notes
    assert not [n for n in notes if "skipped" in n]
    # a failure is a note naming the check; the one expected: QLoRA with offload on one rank,
    # which the trainer refuses by name (train.offload)
    failed = [n for n in notes if ": failed:" in n]
    assert all("train.offload" in n for n in failed), failed
    assert {r["impl"] for r in results["rows"]} >= {"mmtrain", "mmtrain LM", "mmtrain DiT"}
