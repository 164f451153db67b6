"""When nothing fits: the changes to a run that make it fit, cheapest first.

`--recommend` searches the layouts `mmtrain train` runs for the model trained as given. When none
fits, each of these changes is searched the same way (same GPU types, global batch, deadline):
- a server with more host memory, where an offloaded layout fits its GPUs but not the host
  (`--host-memory-gib`): the same training;
- more GPUs (`--max-gpus`, up to the search's largest count): the same training;
- LoRA on the largest trained tower, then on every trained tower (`--lora`): the base frozen in
  the compute dtype, only adapters train;
- QLoRA on the same towers (`--qlora`): the base's block linears in 4-bit NF4 too.
Each change's best strategy is compared by cost per sample (GPU-hours at the catalog's or the
given price); ties go to the faster, then to the change that departs least from the run asked
for (the order above: the same training before a different one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmtrain.hardware import GIB, Catalog
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import Plan
from mmtrain.plan.model import PlanModel
from mmtrain.plan.recommend import GPU_COUNTS, Recommendation, _per_sample, _rounded, recommend


@dataclass(frozen=True)
class Change:
    """One change to the run (`flags` to add to the command) and the best strategy it gets."""

    what: str
    flags: tuple[str, ...]
    same_training: bool  # False: LoRA/QLoRA train something else than the run asked for
    plan: Plan

    @property
    def cost_per_sample(self) -> float:
        return _per_sample(self.plan, "cost")

    @property
    def time_per_sample(self) -> float:
        return _per_sample(self.plan, "time")

    def to_dict(self) -> dict:
        return {
            "what": self.what,
            "flags": list(self.flags),
            "same_training": self.same_training,
            "cost_per_1000_samples": self.cost_per_sample * 1000,
            "plan": self.plan.to_dict(),
        }


def _trained_towers(model: PlanModel) -> list[str]:
    """Stacks with blocks that train whole or in part, largest first (LoRA adapts blocks)."""
    stacks = [s for s in model.stacks if s.mode == "train" and s.layers]
    return [s.name for s in sorted(stacks, key=lambda s: -s.params)]


def _adapter_candidates(model: PlanModel, rank: int, targets: tuple[str, ...]):
    """(what, flags, model) for LoRA and QLoRA on the largest trained tower, then on all."""
    trained = _trained_towers(model)
    adapted = [s.name for s in model.stacks if s.mode == "lora" and s.quantize_base is None]
    sets = [trained[:1], trained] if len(trained) > 1 else [trained]
    out = []
    for names in (n for n in sets if n):
        flags = tuple(f for name in names for f in ("--lora", name))
        lora = model.with_modes({name: "lora" for name in names}, rank, targets)
        out.append((f"LoRA on {', '.join(names)}", flags, lora))
    for names in (n for n in [*sets, adapted] if n):
        both = sorted(set(names) | set(adapted), key=[s.name for s in model.stacks].index)
        flags = tuple(f for name in both for f in ("--qlora", name))
        qlora = model.with_modes({name: "lora" for name in both}, rank, targets)
        out.append((f"QLoRA on {', '.join(both)}", flags, qlora.with_quantized_base(both)))
    seen, unique = set(), []
    for what, flags, m in out:  # LoRA on all = on the largest when there is one tower
        if flags not in seen:
            seen.add(flags)
            unique.append((what, flags, m))
    return unique


def _best(rec: Recommendation) -> Plan | None:
    return rec.ranked[0] if rec.ranked else None


def cheapest_changes(
    model: PlanModel,
    base: PlanConfig,
    catalog: Catalog,
    gpus: list[str] | None,
    max_gpus: int,
    rec: Recommendation,
    deadline_h: float | None = None,
    lora_rank: int = 16,
    lora_targets: tuple[str, ...] = ("attn", "mlp"),
) -> list[Change]:
    """The changes that make `model` fit where `rec` found nothing, cheapest first."""
    changes: list[Change] = []
    short = rec.host_short
    if short is not None and short.host is not None:
        need = short.host.server_bytes / (1 - short.config.headroom) / GIB
        gib = math.ceil(need / 64) * 64  # a round DIMM population
        flags = ("--host-memory-gib", str(gib))
        changes.append(Change(f"a server with {gib:,} GiB of host memory", flags, True, short))
    if max_gpus < GPU_COUNTS[-1]:
        more = _best(recommend(model, base, catalog, gpus, GPU_COUNTS[-1], "cost", deadline_h))
        if more is not None:
            flags = ("--max-gpus", str(more.config.gpus))
            changes.append(Change(f"{more.config.gpus} GPUs", flags, True, more))
    for what, flags, adapted in _adapter_candidates(model, lora_rank, lora_targets):
        plan = _best(recommend(adapted, base, catalog, gpus, max_gpus, "cost", deadline_h))
        if plan is not None:
            changes.append(Change(what, flags, False, plan))
    order = {id(c): i for i, c in enumerate(changes)}
    return sorted(
        changes, key=lambda c: (_rounded(c.cost_per_sample), c.time_per_sample, order[id(c)])
    )
