"""One plan: a model, a strategy and a GPU -> memory, time and cost, as a JSON-ready dict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from mmtrain.hardware import GPU, Catalog
from mmtrain.plan.compute import TimeEstimate, flops_per_sample, training_time
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.memory import MemoryEstimate, training_memory
from mmtrain.plan.model import PlanModel


@dataclass(frozen=True)
class Plan:
    model: PlanModel
    config: PlanConfig
    gpu: GPU
    memory: MemoryEstimate
    time: TimeEstimate

    def to_dict(self) -> dict:
        model_flops, hardware_flops = flops_per_sample(self.model, self.config.ac)
        return {
            "model": {
                "name": self.model.name,
                "params": self.model.params(),
                "trainable_params": self.model.trainable_params(),
                "forward_flops_per_sample": self.model.forward_flops(),
                "train_flops_per_sample": model_flops,
                "hardware_flops_per_sample": hardware_flops,
                "tokens_per_sample": self.model.tokens_per_sample(),
                "towers": {
                    s.name: {
                        "params": s.params,
                        "mode": s.mode,
                        "layers": s.layers,
                        "width": s.width,
                    }
                    for s in self.model.stacks
                },
                "notes": list(self.model.notes),
            },
            "gpu": {
                "key": self.gpu.key,
                "name": self.gpu.name,
                "memory_nominal_gb": self.gpu.memory_nominal_gb,
                "memory_usable_gib": self.gpu.memory_usable_gib,
            },
            "inputs": {
                **asdict(self.config),
                "dp": self.config.dp,
                "accumulation": self.config.accumulation,
                "global_batch": self.config.effective_global_batch,
            },
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict(),
        }


def make_plan(model: PlanModel, cfg: PlanConfig, catalog: Catalog) -> Plan:
    """Validate `cfg` against the model and compute memory and time on `cfg.gpu`."""
    gpu = catalog.gpu(cfg.gpu)
    if cfg.gpus_per_node is None:
        cfg = replace(cfg, gpus_per_node=gpu.gpus_per_node)
    heads = [s.heads for s in model.stacks if s.mode != "frozen" or cfg.tp > 1]
    cfg.validate(heads, model.split_heads())
    if cfg.sequence_parallel > 1:  # the plan names the layout `auto` resolves to
        cfg = replace(cfg, sequence_parallel_attention=cfg.sp_attention(model.split_heads()))
    gpu.peak_flops(cfg.precision)  # raises for a precision the GPU lacks
    return Plan(
        model, cfg, gpu, training_memory(model, cfg, gpu), training_time(model, cfg, gpu, catalog)
    )
