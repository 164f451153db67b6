"""What a CUDA run's memory says (`mmtrain doctor`): its measured peak against the planner's,
the device memory it leaves free, and what the caching allocator holds outside any tensor.

The loop records, per step, CUDA's peak allocated bytes (`max_memory_allocated`: tensors only,
the planner's `predicted_allocated_bytes` is the figure to compare) and peak reserved bytes
(`max_memory_reserved`: the segments the allocator holds from the driver, what an OOM runs
out of), and the device's total memory in the plan record (train/metrics.py). A CPU run records
its process's resident set, which holds the Python runtime and no allocator of its own: no
memory finding reads it.

- Over the plan: a run that allocates well past the planner's figure holds tensors the plan
  does not count (references kept across steps, caches, a second copy of a model), and the next
  larger micro-batch or sequence the planner says fits may not.
- Headroom: under a tenth of the device free at the reserved peak, a longer row, a larger image
  or a different allocation order in a later step is an out-of-memory away.
- Fragmentation: reserved memory outside any tensor at the peak is memory the allocator cannot
  give to a block that does not fit its free pieces; expandable segments let it grow segments
  in place instead (PyTorch's CUDA memory management notes).
"""

from __future__ import annotations

from typing import Any

from mmtrain.report.finding import Finding, config_value
from mmtrain.report.rundata import GIB, RunData

OVER_PLAN = 1.25  # measured allocated peak above 1.25x the plan: beyond the planner's error
# ... and above it by more than a GiB: what every CUDA process allocates besides its model
# (cuBLAS and cuDNN workspaces, tens of MiB, which the planner leaves out) stays under it, and
# a smaller excess does not change what fits on a datacenter GPU.
OVER_PLAN_MIN_BYTES = GIB
HEADROOM = 0.10  # less than a tenth of the device free at the reserved peak: tight
# A fifth of the reserved bytes in no tensor at the peak: twice the planner's allowance
# (plan/memory.py FRAGMENTATION, a tenth of activations and buffers) over all reserved bytes.
FRAGMENTED_SHARE = 0.2
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def memory(run: RunData) -> Finding | None:
    """A finding when the run allocated well past its plan (by a ratio and a GiB) or left the
    device under a tenth free; fragmentation is named as its first change when it is high."""
    rows = [r for r in run.train_rows if "peak_reserved_bytes" in r and "peak_memory_bytes" in r]
    planned = run.plan.get("predicted_allocated_bytes")
    total = run.plan.get("device_memory_bytes")
    if not rows or not planned or not total:
        return None
    peak = max(rows, key=lambda r: r["peak_reserved_bytes"])
    allocated = max(r["peak_memory_bytes"] for r in rows)
    reserved = peak["peak_reserved_bytes"]
    over = allocated / planned
    past_plan = over > OVER_PLAN and allocated - planned > OVER_PLAN_MIN_BYTES
    headroom = 1.0 - reserved / total
    fragmented = (reserved - peak["peak_memory_bytes"]) / reserved if reserved else 0.0
    if not past_plan and headroom >= HEADROOM:
        return None
    evidence = {
        "peak_allocated_gib": round(allocated / GIB, 3),
        "predicted_allocated_gib": round(planned / GIB, 3),
        "measured_over_planned": round(over, 3),
        "peak_reserved_gib": round(reserved / GIB, 3),
        "device_memory_gib": round(total / GIB, 3),
        "headroom_fraction": round(headroom, 4),
        "fragmentation_fraction": round(fragmented, 4),
        "micro_batch": run.plan.get("micro_batch"),
        "recompute": list(run.plan.get("recompute") or []),
        "world_size": run.world_size(),
        "train.parallel": config_value(run, "train", "parallel", "auto"),
    }
    return Finding(
        kind="memory",
        severity="warning" if headroom < HEADROOM else "info",
        evidence=evidence,
        why=_why(over if past_plan else None, headroom, fragmented),
        advice=_advice(run, evidence, tight=headroom < HEADROOM),
        steps=[int(peak["step"])],
    )


def _why(over: float | None, headroom: float, fragmented: float) -> str:
    parts = []
    if over is not None:
        parts.append(
            f"the run allocated {over:.2f}x the planner's figure (above {OVER_PLAN}x): it holds "
            "tensors the plan does not count, and a larger micro-batch or sequence the planner "
            "says fits may not"
        )
    if headroom < HEADROOM:
        parts.append(
            f"{headroom:.0%} of the device was free at the reserved peak (under "
            f"{HEADROOM:.0%}): a longer row, a larger image or a later step's allocation order "
            "is an out-of-memory away"
        )
    if fragmented > FRAGMENTED_SHARE:
        parts.append(f"{fragmented:.0%} of the reserved memory was in no tensor at the peak")
    return "; ".join(parts)


def _advice(run: RunData, evidence: dict[str, Any], *, tight: bool) -> str:
    """The changes, the cheapest first: free the allocator's gaps, then trade compute for
    memory (recompute the tower that saves the most), then shard the states, then halve the
    micro-batch (gradient accumulation keeps the batch)."""
    changes = []
    if evidence["fragmentation_fraction"] > FRAGMENTED_SHARE:
        changes.append(f"launch with {EXPANDABLE} (the allocator grows segments in place)")
    if not tight:
        changes.append(
            "find what the plan misses before scaling up: torch.cuda.memory._record_memory_"
            "history() then _dump_snapshot() shows every live block and its stack"
        )
        return "; then ".join(changes)
    tower = _costliest_tower(run, evidence["recompute"])
    if tower is not None:
        changes.append(f"recompute activations: train.towers.{tower}.activation_checkpointing"
                       "=true (the tower whose activations the plan puts highest)")  # fmt: skip
    if evidence["world_size"] > 1 and evidence["train.parallel"] != "fsdp":
        changes.append(
            f"shard weights, gradients and optimizer state over the {evidence['world_size']} "
            "ranks: train.parallel=fsdp"
        )
    micro = evidence["micro_batch"]
    if isinstance(micro, int) and micro > 1:
        changes.append(f"train.micro_batch={micro // 2} (gradient accumulation keeps "
                       "train.batch_size)")  # fmt: skip
    return "; then ".join(changes) or "the run is at its smallest layout: plan a larger device"


def _costliest_tower(run: RunData, recompute: list[str]) -> str | None:
    """The tower the plan saves the most activations for, among those not yet recomputed."""
    prefix = "activations_by_tower/"
    saved = {
        key[len(prefix) :]: value
        for key, value in run.plan.items()
        if key.startswith(prefix) and key[len(prefix) :] not in recompute
    }
    return max(saved, key=saved.get) if saved else None
