"""`mmtrain doctor`'s memory finding on a real CUDA run (report/memory_check.py): the micro CLIP
trained by the real loop twice on one GPU, alone (no finding) and beside a ballast that leaves
the device under a tenth free in gaps: blocks of uneven sizes fill ~93% of it and every other
one is freed, so the caching allocator keeps their segments reserved with half of them in no
tensor. Doctor should name the headroom, the allocation past the plan and the fragmentation,
with `expandable_segments` as its first change. On a CPU (`gpu_bench.py --dry-run`) the plain
run alone: a CPU run has no allocator figures and gets no memory finding.

Called by bench/gpu_bench.py; the machine cannot reach a run folder of ours, so the note holds
the evidence doctor printed."""

from __future__ import annotations

import gc
import random
import sys
import tempfile
from pathlib import Path

import torch

from mmtrain.report.doctor import diagnose
from mmtrain.report.rundata import load_run
from mmtrain.train.loop import train

BALLAST_SHARE = 0.93  # of the device's memory, before every other block is freed
BLOCK_MIB = (64, 512)  # uneven block sizes: their freed gaps fit the run's tensors


def _memory_finding(folder: Path, shards: str) -> str:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from micro import micro_run

    train(micro_run(folder, shards, train={"steps": 4}))
    found = [f for f in diagnose(load_run(folder / "run")) if f.kind == "memory"]
    if not found:
        return "no memory finding"
    finding = found[0]
    return f"{finding.severity}: {finding.evidence_text()}; change: {finding.advice}"


def _ballast(device: torch.device) -> list[torch.Tensor]:
    """Uneven blocks up to BALLAST_SHARE of the device, every other one freed (kept reserved)."""
    total = torch.cuda.get_device_properties(device).total_memory
    rng, blocks = random.Random(0), []
    while torch.cuda.memory_reserved(device) < BALLAST_SHARE * total:
        size = rng.randint(*BLOCK_MIB) * 2**20
        blocks.append(torch.empty(size, dtype=torch.uint8, device=device))
    return blocks[::2]  # the others go: their segments stay with the caching allocator


def memory_doctor_note(device: torch.device) -> str:
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from micro import make_shards

    with tempfile.TemporaryDirectory() as tmp:
        shards = make_shards(Path(tmp) / "shards", 32)
        if device.type == "cuda":  # the earlier cases' cached segments would count as the run's
            gc.collect()
            torch.cuda.empty_cache()
        plain = _memory_finding(Path(tmp) / "plain", shards)
        if device.type != "cuda":
            return f"doctor memory on {device.type}: plain run: {plain} (CUDA rows only)"
        ballast = _ballast(device)
        try:
            tight = _memory_finding(Path(tmp) / "tight", shards)
        finally:
            del ballast
            torch.cuda.empty_cache()
    return f"doctor memory: plain run: {plain} | beside a fragmented ballast: {tight}"
