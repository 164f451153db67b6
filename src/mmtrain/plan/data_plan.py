"""`mmtrain plan --data`: plan a language model's training from the data's own lengths.

For each layout (padded, packed; plan/lengths.py) the rows become the plan's samples: memory
is planned for the layout's worst micro-batch (its longest row, most ids and most images),
time from the mean computed FLOPs of a row, and the global batch (given in samples, i.e.
conversations) becomes rows: `global_batch / samples per row`, rounded to whole micro-batches
on every data-parallel rank. A native-resolution VLM's (spec.vision) time counts its tower's
FLOPs over every sample's own pages and clips (the layouts' `vision_flops`), and its tower's
memory is planned for the heaviest row's inputs (the laid-out row with the most visual
patches) in every row of the micro-batch: an upper bound when rows differ, as the decoder's
longest row is. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from mmtrain.hardware import Catalog
from mmtrain.lengths import Lengths
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.estimate import Plan, make_plan
from mmtrain.plan.lengths import RowLayout, packed_layout, padded_layout
from mmtrain.plan.model import PlanModel, Rows, from_spec
from mmtrain.spec import ModelSpec


@dataclass(frozen=True)
class DataPlan:
    """A layout of the data and the plan that trains on it; `samples` the samples to train."""

    layout: RowLayout
    plan: Plan
    samples: int

    @property
    def hours(self) -> float:
        return self.plan.time.time_to_train_s / 3600

    def to_dict(self) -> dict:
        t = self.plan.time
        return {
            **self.layout.to_dict(),
            "samples_to_train": self.samples,
            "rows_to_train": self.plan.config.samples,
            "global_batch_rows": self.plan.config.effective_global_batch,
            "micro_batch_rows": self.plan.config.micro_batch,
            "accumulation": self.plan.config.accumulation,
            "fits": self.plan.memory.fits,
            "memory_total_bytes": int(self.plan.memory.total_bytes),
            "memory_budget_bytes": int(self.plan.memory.budget_bytes),
            "step_time_s": t.step_time_s,
            "mfu": round(t.mfu, 4),
            "achievable_fraction": round(t.achievable_fraction, 4),
            "efficiency_family": t.efficiency_family,
            "time_to_train_h": round(self.hours, 3),
            "cost": round(t.cost, 2),
            "price_per_gpu_hour": t.price_per_gpu_hour,
            "price_source": t.price_source,
        }


def layout_model(spec: ModelSpec, layout: RowLayout) -> PlanModel:
    """The plan model of one row of `layout`: memory for its worst micro-batch (a native VLM's
    tower: the heaviest row's inputs), FLOPs of a mean row."""
    native = spec.vision is not None
    rows = Rows(
        positions=layout.max_positions,
        images=len(layout.max_visual_inputs) if native else layout.max_images / layout.micro_batch,
        text_ids=layout.max_ids,
        packed=layout.name == "packed",
        forward_flops=layout.computed_flops / layout.rows,
        vision_flops=layout.vision_flops / layout.rows,
        mean_images=layout.images / layout.rows,
        visual_inputs=layout.max_visual_inputs,
    )
    return from_spec(spec, rows)


def rows_batch(cfg: PlanConfig, layout: RowLayout) -> int:
    """The global batch in rows: as many samples per step as `cfg.global_batch` asks for
    (at least one micro-batch per data-parallel rank), in whole micro-batches per rank."""
    per_step = cfg.micro_batch * cfg.dp
    wanted = (cfg.global_batch or per_step) / layout.samples_per_row
    return max(1, round(wanted / per_step)) * per_step


def plan_from_data(
    spec: ModelSpec,
    lengths: Lengths,
    cfg: PlanConfig,
    catalog: Catalog,
    *,
    sequence_length: int,
    samples: int | None = None,
    pad_to: str = "longest",
    adapt: Callable[[PlanModel], PlanModel] = lambda m: m,
    seed: int = 0,
) -> list[DataPlan]:
    """Padded and packed plans for training `samples` samples (default: the data once) drawn
    from `lengths`. `adapt` applies the run's freezing / LoRA to the plan model."""
    total = samples or len(lengths.positions)
    plans = []
    for layout in (
        padded_layout(spec, lengths, sequence_length, cfg.micro_batch, pad_to, seed),
        packed_layout(spec, lengths, sequence_length, cfg.micro_batch, seed),
    ):
        model = adapt(layout_model(spec, layout))
        rows = round(total / layout.samples_per_row)
        row_cfg = replace(cfg, global_batch=rows_batch(cfg, layout), samples=rows)
        plans.append(DataPlan(layout, make_plan(model, row_cfg, catalog), total))
    return plans
