"""Search strategies (GPU type and count, DDP or FSDP2 with or without CPU offload, sequence
parallel, checkpointing, micro-batch) for a model and global batch; rank those that fit by cost
or by time.

Only layouts `mmtrain train` runs are searched: ZeRO-0 (DDP), ZeRO-3 (FSDP2), ZeRO-3 with CPU
offload (FSDP2's CPUOffloadPolicy, on any number of GPUs, one included), sequence parallelism and
activation checkpointing, with the towers trained as given (frozen, LoRA, QLoRA). Tensor
parallelism and ZeRO-1/2 stay in `mmtrain plan` for what-if questions, marked there as not run
by `mmtrain train`. An offloaded layout fits when its GPU memory does and a server's host memory
holds its ranks' states (plan/offload.py; unknown host memory is not held against it, and said).
When nothing fits, `changes.py` names the cheapest change that does.

Ranking policy (stated in every answer, see `Recommendation.policy`):
- by cost (the default when a sample count is given): the cheapest per sample among the
  strategies that train those samples within a deadline (`deadline_h`; by default 720 h, 30
  days), since the cheapest strategy overall is often a handful of GPUs running for a year.
  When nothing meets the deadline, the fastest strategies are listed instead, and said so.
- by time (the default without a sample count, when there is no cost to train to rank by).
Scores equal to three significant figures tie, and the tie goes to the faster (by cost) or the
cheaper (by time) strategy: 4 GPUs for 2,700 h and 128 GPUs for 85 h at the same cost are not
equally good.

Search: for each (GPU count, SP, layout, checkpointing) the memory of each power-of-two
micro-batch is computed once and shared by every GPU type (only the budget differs); each GPU
takes the largest micro-batch that fits (the time model gives the same FLOPs per sample at any
micro-batch, and fewer, larger micro-batches mean fewer per-micro-batch collectives and host
copies). Pruned without loss: configurations whose model states alone exceed every GPU; a
checkpointing mode that reaches no larger micro-batch than a lighter one (same work plus
recompute); CPU offload where FSDP2 without it reaches the same micro-batch (same work and
collectives, plus host copies and a host optimizer step); sequence parallel N at a micro-batch b >= 2, or wherever N/2 fits, when N/2 attends
the same way and there is no pipeline (`_halves_alike`).
Sequence parallelism (1, 2, 4, 8 ranks within a node) is tried only for models with a stack it
splits (a decoder, a denoiser), so every other model's search is unchanged: it is what lets rows
too long for one GPU's activations fit. A DPO plan (`--objective dpo`) searches no sequence
parallelism: the trainer does not run it with dpo (plan/preference.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from mmtrain.hardware import GPU, Catalog
from mmtrain.plan import preference as pref
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import Plan, make_plan
from mmtrain.plan.memory import CUDA_CONTEXT_BYTES, model_states, training_memory
from mmtrain.plan.model import PlanModel
from mmtrain.structured import FieldError

GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SP_SIZES = (1, 2, 4, 8)  # sequence-parallel ranks per row (within a node)
# (ZeRO stage, CPU offload) of the layouts `mmtrain train` runs: DDP, FSDP2, FSDP2 offloaded
LAYOUTS = ((0, False), (3, False), (3, True))
AC_ORDER = ("none", "selective", "full")
DEFAULT_DEADLINE_H = 720.0  # 30 days: about the longest single run teams plan for
TIE_DIGITS = 3  # scores equal to this many significant figures tie


@dataclass(frozen=True)
class Recommendation:
    ranked: list[Plan]  # fitting plans (meeting the deadline where one applies), best first
    closest: Plan | None  # when nothing fits: the plan with the smallest memory overshoot
    by: str  # "cost" | "time"
    explanation: str  # the winner in one line, and why the runner-up lost
    searched: int  # (GPU type, count, TP, ZeRO, AC) configurations whose memory was checked
    policy: str = ""  # how `ranked` was chosen and ordered, in words
    deadline_h: float | None = None  # the time-to-train bound applied (None: none)
    fitting: int = 0  # strategies that fit in memory (before the deadline)
    met_deadline: bool = True  # False: nothing met the deadline; `ranked` is the fastest
    host_short: Plan | None = None  # an offloaded layout whose GPUs fit but host memory not


def layouts(count: int) -> tuple[tuple[int, bool], ...]:
    """(ZeRO, offload) layouts `mmtrain train` runs on `count` GPUs: DDP and FSDP2 shard over
    several ranks; CPU offload runs on one too (FSDP2 over a group of one)."""
    return LAYOUTS if count > 1 else ((0, False), (3, True))


def _per_sample(plan: Plan, by: str) -> float:
    t = plan.time
    seconds = t.step_time_s / plan.config.effective_global_batch
    if by == "time":
        return seconds
    return plan.config.gpus * t.price_per_gpu_hour * seconds / 3600


def _rounded(x: float) -> float:
    if x <= 0:
        return 0.0
    return round(x, TIE_DIGITS - 1 - math.floor(math.log10(x)))


def _rank_key(plan: Plan, by: str) -> tuple[float, float]:
    other = "time" if by == "cost" else "cost"
    return _rounded(_per_sample(plan, by)), _per_sample(plan, other)


def _micro_batches(per_replica: int) -> list[int]:
    sizes, b = [], 1
    while b <= per_replica:
        if per_replica % b == 0:
            sizes.append(b)
        b *= 2
    return sizes


def _largest_fitting(total: Callable[[int], float], budget: float, n: int) -> int:
    """Index of the largest micro-batch whose memory `total(i)` fits `budget` (-1: none);
    totals grow with the micro-batch, so a binary search finds it."""
    lo, hi, best = 0, n - 1, -1
    while lo <= hi:
        mid = (lo + hi) // 2
        if total(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _search(
    model: PlanModel, base: PlanConfig, catalog: Catalog, gpus: list[GPU], max_gpus: int
) -> tuple[list[Plan], tuple[float, PlanConfig] | None, int, Plan | None]:
    """(fitting plans, (overshoot, config) of the nearest miss, configurations checked, the
    offloaded plan with the least host memory among those whose GPUs fit but host not)."""
    budgets = {g.key: g.usable_bytes * (1 - base.headroom) for g in gpus}
    biggest = max(budgets.values())
    fitting: list[Plan] = []
    closest: tuple[float, PlanConfig] | None = None
    host_short: Plan | None = None
    searched = 0
    for count in (c for c in GPU_COUNTS if c <= max_gpus):
        fits: set[tuple[int, bool, str, str, int]] = set()  # (zero, offload, ac, gpu, sp) that fit
        for sp in _sequence_sizes(model, base, count):
            dp = count // sp
            if base.global_batch % dp:
                continue
            on_node = [g for g in gpus if sp <= g.gpus_per_node]
            sizes = _micro_batches(base.global_batch // dp)
            alike = _halves_alike(model, base, sp)
            sizes = sizes[:1] if alike else sizes
            resident: dict[tuple[str, str], int] = {}  # (gpu, ac) -> FSDP2's micro-batch
            for zero, offload in layouts(count):
                cfg = replace(base, gpus=count, tp=1, zero=zero, offload=offload, micro_batch=1,
                              sequence_parallel=sp)  # fmt: skip
                states = sum(model_states(model, cfg)[:3]) + pref.reference_bytes(model, cfg)
                states += CUDA_CONTEXT_BYTES
                if states > biggest:
                    continue
                lighter: dict[str, int] = {}  # gpu -> micro-batch a lighter AC mode reached
                for ac in AC_ORDER:
                    acfg = replace(cfg, ac=ac)
                    total = _memory_by_size(model, acfg, sizes, gpus[0])
                    for gpu in on_node:
                        budget = budgets[gpu.key]
                        if states > budget or (offload and not gpu.host_link):
                            continue  # (a --hardware GPU without a host link: no offload)
                        key = (zero, offload, ac, gpu.key)
                        if alike and (*key, sp // 2) in fits:
                            fits.add((*key, sp))  # uses less memory
                            continue  # dominated by sequence parallel sp / 2
                        searched += 1
                        i = _largest_fitting(total, budget, len(sizes))
                        if i < 0:
                            over = total(0) / budget
                            if closest is None or over < closest[0]:
                                closest = (over, _on(acfg, gpu, sizes[0]))
                            continue
                        if sizes[i] <= lighter.get(gpu.key, 0):
                            fits.add((*key, sp))
                            continue  # a lighter mode already reaches this micro-batch
                        if offload and sizes[i] <= resident.get((gpu.key, ac), 0):
                            fits.add((*key, sp))
                            continue  # FSDP2 without offload runs it, with no host copies
                        plan = make_plan(model, _on(acfg, gpu, sizes[i]), catalog)
                        if not plan.fits:  # an offloaded layout short of host memory
                            if host_short is None or _host(plan) < _host(host_short):
                                host_short = plan
                            continue
                        fits.add((*key, sp))
                        lighter[gpu.key] = sizes[i]
                        if zero == 3 and not offload:
                            resident[gpu.key, ac] = sizes[i]
                        fitting.append(plan)
    return fitting, closest, searched, host_short


def _host(plan: Plan) -> float:
    return plan.host.server_bytes if plan.host else 0.0


def _sequence_sizes(model: PlanModel, base: PlanConfig, count: int) -> list[int]:
    """Sequence-parallel sizes the search tries on `count` GPUs (TP 1): those dividing the
    count; SP > 1 only for a model with a stack it splits, and, under
    `--sequence-parallel-attention all_to_all`, only where SP divides every split stack's
    heads."""
    split = model.split_heads()
    sizes = SP_SIZES if split and not pref.is_dpo(base) else (1,)  # dpo: rows are not split
    if base.sequence_parallel_attention == "all_to_all":
        sizes = tuple(n for n in sizes if all(h % n == 0 for h in split))
    return [n for n in sizes if n <= count and count % n == 0]


def _halves_alike(model: PlanModel, base: PlanConfig, n: int) -> bool:
    """Whether sequence parallel `n` is dominated by `n / 2` wherever that fits, at the same
    GPUs, TP, ZeRO and checkpointing: true when both attend the same way (or n / 2 is 1) and
    there is no pipeline. SP n/2 at micro-batch b/2 (or 1 where SP n runs 1) holds the same
    or more tokens per GPU in the same or fewer micro-steps, keeps no more memory than SP n
    at b (its unsplit stacks see half the rows), computes less (the unsplit stacks run on half
    as many ranks) and sends less ((n/2 - 1)/(n/2) of the same local bytes; its ring passes
    hide behind blocks twice as long). So SP n needs micro-batch 1 only, and only where SP
    n/2 does not fit. Where the layout changes (auto: all_to_all at n/2, ring at n) or a
    pipeline's bubble grows with the micro-step, nothing is pruned."""
    if n == 1 or base.pp > 1:
        return False
    split = model.split_heads()
    layout = replace(base, sequence_parallel=n).sp_attention(split)
    return n == 2 or replace(base, sequence_parallel=n // 2).sp_attention(split) == layout


def _memory_by_size(
    model: PlanModel, cfg: PlanConfig, sizes: list[int], gpu: GPU
) -> Callable[[int], float]:
    """`total(i)`: memory per GPU at micro-batch `sizes[i]`, computed once. It is the same on
    every GPU type (only the budget differs), so all of them share it."""
    totals: dict[int, float] = {}

    def total(i: int) -> float:
        if i not in totals:
            mb = replace(cfg, micro_batch=sizes[i])
            totals[i] = training_memory(model, mb, gpu).total_bytes
        return totals[i]

    return total


def _on(cfg: PlanConfig, gpu: GPU, micro_batch: int) -> PlanConfig:
    return replace(cfg, gpu=gpu.key, gpus_per_node=gpu.gpus_per_node, micro_batch=micro_batch)


def recommend(
    model: PlanModel,
    base: PlanConfig,
    catalog: Catalog,
    gpus: list[str] | None = None,
    max_gpus: int = 512,
    by: str | None = None,
    deadline_h: float | None = None,
) -> Recommendation:
    """Every strategy that fits, ranked by `by` ("cost" or "time"; default: cost when
    `base.samples` is set, else time). Ranking by cost keeps the strategies that train
    `base.samples` within `deadline_h` hours (default DEFAULT_DEADLINE_H)."""
    by = by or ("cost" if base.samples else "time")
    if by not in ("cost", "time"):
        raise FieldError("--rank-by", f"{by!r} is not one of cost, time")
    if base.global_batch is None:
        raise FieldError("--global-batch", "--recommend needs the global batch to search over")
    if deadline_h is not None and deadline_h <= 0:
        raise FieldError("--deadline", f"must be a positive number of hours, got {deadline_h}")
    if deadline_h is not None and not base.samples:
        raise FieldError("--deadline", "a deadline needs --samples (how much to train)")
    if deadline_h is None and by == "cost" and base.samples:
        deadline_h = DEFAULT_DEADLINE_H
    keys = [catalog.gpu(g).key for g in gpus] if gpus else list(catalog.gpus)
    usable = [g for g in (catalog.gpus[k] for k in keys) if _runs(g, base.precision)]
    if not usable:
        raise FieldError("--precision", f"none of {', '.join(keys)} runs {base.precision}")
    fitting, miss, searched, host_short = _search(model, base, catalog, usable, max_gpus)
    closest = None
    if not fitting:
        closest = (
            make_plan(model, miss[1], catalog)
            if miss is not None
            else _closest_states(model, base, catalog, [g.key for g in usable], max_gpus)
        )
    ranked, met = fitting, True
    if deadline_h is not None:
        ranked = [p for p in fitting if p.time.time_to_train_s <= deadline_h * 3600]
        if fitting and not ranked:
            ranked, met = fitting, False
    order = by if met else "time"
    ranked = sorted(ranked, key=lambda p: _rank_key(p, order))
    policy = _policy(by, deadline_h, base.samples, len(fitting), len(ranked), met)
    return Recommendation(
        ranked=ranked,
        closest=closest,
        by=order,
        explanation=explain(ranked, order) + _sequence_note(ranked, fitting, order),
        searched=searched,
        policy=policy,
        deadline_h=deadline_h,
        fitting=len(fitting),
        met_deadline=met,
        host_short=host_short,
    )


def _runs(gpu: GPU, precision: str) -> bool:
    try:
        gpu.peak_flops(precision)
    except FieldError:
        return False
    return True


def _policy(by: str, deadline_h, samples: int, fitting: int, meeting: int, met: bool) -> str:
    if by == "time":
        line = "ranked by time per sample (fastest first; ties go to the cheaper)"
        if not samples:
            line += "; give --samples N to rank by cost within a deadline"
        if deadline_h is not None:
            line += f"; {meeting} of {fitting} fitting strategies train {samples:,} samples within {deadline_h:,.0f} h"
        return line
    if deadline_h is None:  # by cost without --samples: no run to bound
        return "ranked by cost per sample (cheapest first; ties go to the faster)"
    bound = f"{deadline_h:,.0f} h ({deadline_h / 24:,.1f} days)"
    default = (
        " (the default; change it with --deadline HOURS)"
        if deadline_h == DEFAULT_DEADLINE_H
        else ""
    )
    if not met:
        return (
            f"none of the {fitting} fitting strategies trains {samples:,} samples within {bound}"
            f"{default}: listed fastest first instead"
        )
    return (
        f"ranked by cost per sample among the {meeting} of {fitting} fitting strategies that "
        f"train {samples:,} samples within {bound}{default}; ties go to the faster"
    )


def _sequence_note(ranked: list[Plan], fitting: list[Plan], by: str) -> str:
    """Why the winner splits its rows over sequence-parallel ranks, when it does: nothing
    without that split fits (or qualifies), or by how much it beats the best that does not."""
    if not ranked or ranked[0].config.sequence_parallel == 1:
        return ""
    win = ranked[0]
    c, t = win.config, win.time
    tokens = max(s.tokens for s in win.model.stacks if s.sequence_split)
    line = (
        f"; sequence parallel {c.sequence_parallel} ({c.sequence_parallel_attention}) splits "
        f"each row's {tokens:,} positions, {t.sp_comm_share:.1%} of its step exposed SP "
        "communication"
    )
    if not any(p.config.sequence_parallel == 1 for p in fitting):
        return line + ": no strategy without sequence parallelism fits in memory"
    unsplit = [p for p in ranked if p.config.sequence_parallel == 1]
    if not unsplit:
        return line + ": no strategy without sequence parallelism meets the deadline"
    best = min(unsplit, key=lambda p: _rank_key(p, by))
    ratio = _per_sample(best, by) / _per_sample(win, by) - 1
    worse = "dearer" if by == "cost" else "slower"
    return line + f": the best without it ({describe(best)}) is {ratio:.1%} {worse} per sample"


def _overshoot(plan: Plan) -> float:
    return plan.memory.total_bytes / plan.memory.budget_bytes


def _closest_states(
    model: PlanModel, base: PlanConfig, catalog: Catalog, keys: list[str], max_gpus: int
) -> Plan | None:
    """When no configuration's model states fit any GPU: the lightest layout the trainer runs
    (the most GPUs, CPU offload, the widest sequence split a node holds, full checkpointing,
    micro-batch 1) on each GPU type, the one that misses by the least."""
    best = None
    for key in keys:
        gpu = catalog.gpus[key]
        count = max(c for c in GPU_COUNTS if c <= max_gpus)
        within = min(gpu.gpus_per_node, count)
        sp = max(n for n in _sequence_sizes(model, base, count) if n <= within)
        dp = count // sp
        gb = base.global_batch if base.global_batch % dp == 0 else dp
        cfg = replace(base, gpu=key, gpus=count, tp=1, sequence_parallel=sp, zero=3,
                      offload=True, ac="full", micro_batch=1, global_batch=gb,
                      gpus_per_node=gpu.gpus_per_node)  # fmt: skip
        try:
            plan = make_plan(model, cfg, catalog)
        except FieldError:
            continue
        if best is None or _overshoot(plan) < _overshoot(best):
            best = plan
    return best


def describe(plan: Plan) -> str:
    c = plan.config
    sp = c.sequence_parallel
    seq = f", SP {sp} ({c.sequence_parallel_attention})" if sp > 1 else ""
    tp = f", TP {c.tp}" if c.tp > 1 else ""
    return (
        f"{c.gpus} x {plan.gpu.key}, {layout_name(c)}{tp}{seq}, AC {c.ac}, micro-batch "
        f"{c.micro_batch} (accumulation {c.accumulation})"
    )


def layout_name(c: PlanConfig) -> str:
    """`DDP`, `FSDP2`, `FSDP2 + CPU offload`, or `ZeRO-1/2` (a what-if)."""
    if c.offload:
        return "FSDP2 + CPU offload"
    return {0: "DDP", 3: "FSDP2"}.get(c.zero, f"ZeRO-{c.zero}")


def explain(ranked: list[Plan], by: str) -> str:
    """One line on the winner, and why the runner-up lost."""
    if not ranked:
        return "nothing fits"
    win = ranked[0]
    w = win.time
    use = win.memory.total_bytes / win.memory.usable_bytes
    line = f"winner: {describe(win)}: {w.samples_per_s:,.3g} samples/s, MFU {w.mfu:.0%}, {use:.0%} of usable memory"
    if len(ranked) == 1:
        return line + "; the only strategy that qualifies"
    run = ranked[1]
    if _rank_key(run, by)[0] == _rank_key(win, by)[0]:  # a tie on the ranked score
        other = "time" if by == "cost" else "cost"
        ratio = _per_sample(run, other) / _per_sample(win, other) - 1
        same = "costs the same per sample" if by == "cost" else "is as fast"
        worse = "slower" if by == "cost" else "dearer"
        return (
            line
            + f"; runner-up {describe(run)} {same} (to {TIE_DIGITS} significant figures) but is {ratio:.1%} {worse}"
        )
    ratio = _per_sample(run, by) / _per_sample(win, by) - 1
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
    comm_r = (r.tp_comm_s + r.dp_exposed_s + r.sp_exposed_s + r.bubble_s) / r.step_time_s
    comm_w = (w.tp_comm_s + w.dp_exposed_s + w.sp_exposed_s + w.bubble_s) / w.step_time_s
    if comm_r > comm_w:
        return f"{comm_r:.0%} of its step is exposed communication or pipeline bubble (winner {comm_w:.0%})"
    if by == "time":
        return f"it runs on {run.config.gpus} GPUs against {win.config.gpus}"
    return "its per-GPU throughput is lower"
