"""Search strategies (GPU type and count, ZeRO stage, tensor parallel, checkpointing, micro-batch)
for a model and global batch; rank those that fit by cost or by time.

For each (GPU, count, ZeRO, TP, checkpointing) the largest power-of-two micro-batch that fits
is taken: the time model gives the same FLOPs per sample at any micro-batch, and fewer, larger
micro-batches mean fewer per-micro-batch collectives. Configurations whose model states alone
exceed the GPU are skipped before any activation is computed, which keeps a full search of the
catalog well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mmtrain.hardware import Catalog
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import Plan, make_plan
from mmtrain.plan.memory import CUDA_CONTEXT_BYTES, model_states, training_memory
from mmtrain.plan.model import PlanModel
from mmtrain.structured import FieldError

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TP_SIZES = (1, 2, 4, 8)
AC_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Recommendation:
    ranked: list[Plan]  # fitting plans, best first
    closest: Plan | None  # when nothing fits: the plan with the smallest memory overshoot
    by: str
    explanation: str
    searched: int


def _score(plan: Plan, by: str) -> float:
    t = plan.time
    if by == "time":
        return t.step_time_s / plan.config.effective_global_batch
    # cost per sample (the same ranking as the cost of any fixed number of samples)
    return (
        plan.config.gpus * t.price_per_gpu_hour * t.step_time_s / plan.config.effective_global_batch
    )


def _micro_batches(per_replica: int) -> list[int]:
    sizes, b = [], 1
    while b <= per_replica:
        if per_replica % b == 0:
            sizes.append(b)
        b *= 2
    return sizes


def _largest_fitting(
    model: PlanModel, cfg: PlanConfig, catalog: Catalog, sizes: list[int]
) -> tuple[Plan | None, Plan | None]:
    """(largest fitting plan, smallest non-fitting plan) by binary search over `sizes`; only
    memory is computed while searching, the full plan once at the end."""
    gpu = catalog.gpus[cfg.gpu]
    lo, hi, best, miss = 0, len(sizes) - 1, None, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if training_memory(model, replace(cfg, micro_batch=sizes[mid]), gpu).fits:
            best, lo = sizes[mid], mid + 1
        else:
            miss, hi = sizes[mid], mid - 1
    if best is not None:
        return make_plan(model, replace(cfg, micro_batch=best), catalog), None
    return None, make_plan(model, replace(cfg, micro_batch=miss), catalog)


def recommend(
    model: PlanModel,
    base: PlanConfig,
    catalog: Catalog,
    gpus: list[str] | None = None,
    max_gpus: int = 512,
    by: str = "cost",
) -> Recommendation:
    """Every strategy that fits, ranked by `by` ("cost" or "time")."""
    if by not in ("cost", "time"):
        raise FieldError("--rank-by", f"{by!r} is not one of cost, time")
    if base.global_batch is None:
        raise FieldError("--global-batch", "--recommend needs the global batch to search over")
    keys = [catalog.gpu(g).key for g in gpus] if gpus else list(catalog.gpus)
    heads = [s.heads for s in model.stacks]
    fitting: list[Plan] = []
    closest: Plan | None = None
    searched = 0
    for key in keys:
        gpu = catalog.gpus[key]
        try:
            gpu.peak_flops(base.precision)
        except FieldError:
            continue
        for count in (c for c in GPU_COUNTS if c <= max_gpus):
            for tp in TP_SIZES:
                if tp > min(count, gpu.gpus_per_node) or count % tp or any(h % tp for h in heads):
                    continue
                dp = count // tp
                if base.global_batch % dp:
                    continue
                sizes = _micro_batches(base.global_batch // dp)
                for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                    cfg = replace(
                        base,
                        gpu=key,
                        gpus=count,
                        tp=tp,
                        zero=zero,
                        gpus_per_node=gpu.gpus_per_node,
                        micro_batch=1,
                    )
                    states = sum(model_states(model, cfg)[:3])
                    if states + CUDA_CONTEXT_BYTES > gpu.usable_bytes * (1 - base.headroom):
                        continue
                    for ac in AC_ORDER:
                        searched += 1
                        best, miss = _largest_fitting(model, replace(cfg, ac=ac), catalog, sizes)
                        if best is not None:
                            fitting.append(best)
                            if best.config.micro_batch == sizes[-1]:
                                break  # more recomputation cannot buy a larger micro-batch
                        elif miss is not None and (
                            closest is None or _overshoot(miss) < _overshoot(closest)
                        ):
                            closest = miss
    if not fitting and closest is None:  # not even the model states fit anywhere: say by how much
        closest = _closest_states(model, base, catalog, keys, max_gpus)
    fitting.sort(key=lambda p: (round(_score(p, by), 12), p.config.gpus if by == "cost" else 0))
    return Recommendation(
        fitting, closest if not fitting else None, by, explain(fitting, by), searched
    )


def _overshoot(plan: Plan) -> float:
    return plan.memory.total_bytes / plan.memory.budget_bytes


def _closest_states(
    model: PlanModel, base: PlanConfig, catalog: Catalog, keys: list[str], max_gpus: int
) -> Plan | None:
    best = None
    for key in keys:
        gpu = catalog.gpus[key]
        count = max(c for c in GPU_COUNTS if c <= max_gpus)
        tp = max(
            t
            for t in TP_SIZES
            if t <= gpu.gpus_per_node and all(s.heads % t == 0 for s in model.stacks)
        )
        dp = count // tp
        gb = base.global_batch if base.global_batch % dp == 0 else dp
        try:
            plan = make_plan(
                model,
                replace(
                    base,
                    gpu=key,
                    gpus=count,
                    tp=tp,
                    zero=3 if dp > 1 else 0,
                    ac="full",
                    micro_batch=1,
                    global_batch=gb,
                    gpus_per_node=gpu.gpus_per_node,
                ),
                catalog,
            )
        except FieldError:
            continue
        if best is None or _overshoot(plan) < _overshoot(best):
            best = plan
    return best


def describe(plan: Plan) -> str:
    c = plan.config
    return f"{c.gpus} x {plan.gpu.key}, ZeRO-{c.zero}, TP {c.tp}, AC {c.ac}, micro-batch {c.micro_batch} (accumulation {c.accumulation})"


def explain(ranked: list[Plan], by: str) -> str:
    """One line on the winner, and why the runner-up lost."""
    if not ranked:
        return "nothing fits"
    win = ranked[0]
    w = win.time
    use = win.memory.total_bytes / win.memory.usable_bytes
    line = f"winner: {describe(win)}: {w.samples_per_s:,.3g} samples/s, MFU {w.mfu:.0%}, {use:.0%} of usable memory"
    if len(ranked) == 1:
        return line + "; the only strategy that fits"
    run = ranked[1]
    ratio = _score(run, by) / _score(win, by) - 1
    return (
        line
        + f"; runner-up {describe(run)} is {ratio:.1%} {'dearer' if by == 'cost' else 'slower'} per sample because {_why(win, run, by)}"
    )


def _why(win: Plan, run: Plan, by: str) -> str:
    w, r = win.time, run.time
    if by == "cost" and run.gpu.key != win.gpu.key:
        return f"its GPU-hours cost {r.price_per_gpu_hour:.2f} vs {w.price_per_gpu_hour:.2f} for {r.samples_per_s / run.config.gpus:,.3g} vs {w.samples_per_s / win.config.gpus:,.3g} samples/s per GPU"
    if (
        r.compute_s / run.config.effective_global_batch * run.config.gpus
        > 1.01 * w.compute_s / win.config.effective_global_batch * win.config.gpus
    ):
        if run.config.ac != win.config.ac:
            return f"activation checkpointing '{run.config.ac}' recomputes more of the forward pass"
        return "it computes more per sample (lower achievable FLOP rate)"
    comm_r = (r.tp_comm_s + r.dp_exposed_s + r.bubble_s) / r.step_time_s
    comm_w = (w.tp_comm_s + w.dp_exposed_s + w.bubble_s) / w.step_time_s
    if comm_r > comm_w:
        return f"{comm_r:.0%} of its step is exposed communication or pipeline bubble (winner {comm_w:.0%})"
    if by == "time":
        return f"it runs on {run.config.gpus} GPUs against {win.config.gpus}"
    return "its per-GPU throughput is lower"
