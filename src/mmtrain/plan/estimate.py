"""One plan: a model, a strategy and a GPU -> memory, time and cost, as a JSON-ready dict.

A plan may be a what-if `mmtrain train` does not run: tensor or pipeline parallelism, ZeRO-1/2,
Megatron sequence parallelism, or a precision the trainer lacks (`not_run_by_train` names
them; `--recommend` searches only what the trainer runs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from mmtrain.hardware import GPU, Catalog
from mmtrain.plan import preference as pref
from mmtrain.plan import quantized as q
from mmtrain.plan.compute import TimeEstimate, micro_compute_s, objective_flops, training_time
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.memory import MemoryEstimate, nf4_shards, training_memory
from mmtrain.plan.model import PlanModel
from mmtrain.plan.offload import HostEstimate, host_estimate

TRAIN_PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # config.py's, less its fp64 test mode


def not_run_by_train(cfg: PlanConfig) -> list[str]:
    """What of `cfg` `mmtrain train` does not run (empty: the trainer runs it all): it trains
    with DDP (ZeRO-0) or FSDP2 (ZeRO-3, with CPU offload), sequence parallelism, activation
    checkpointing, LoRA and QLoRA, under torch autocast or fp32."""
    missing = []
    if cfg.tp > 1:
        missing.append(f"tensor parallelism (TP {cfg.tp})")
    if cfg.zero in (1, 2):
        missing.append(f"ZeRO-{cfg.zero}")
    if cfg.pp > 1:
        missing.append(f"pipeline parallelism (PP {cfg.pp})")
    if cfg.sp:
        missing.append("Megatron sequence parallelism (--sp)")
    if cfg.precision not in TRAIN_PRECISIONS:
        missing.append(f"precision {cfg.precision}")
    return missing


@dataclass(frozen=True)
class Plan:
    model: PlanModel
    config: PlanConfig
    gpu: GPU
    memory: MemoryEstimate
    time: TimeEstimate
    host: HostEstimate | None = None  # CPU offload: host memory and host-link traffic

    @property
    def not_run_by_train(self) -> list[str]:
        return not_run_by_train(self.config)

    @property
    def fits(self) -> bool:
        """GPU memory fits, and, under CPU offload, a server's host memory (where known)."""
        return self.memory.fits and (self.host is None or self.host.fits is not False)

    def to_dict(self) -> dict:
        c = self.config
        model_flops, hardware_flops = objective_flops(self.model, c)
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
                "notes": list(self.model.notes) + quantize_notes(self.model, self.config)
                + ([pref.describe(self.model, c)] if pref.is_dpo(c) else []),
            },
            "objective": objective_summary(self.model, c, self.memory),
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
            "host": self.host.to_dict() if self.host else None,
            "fits": self.fits,  # GPU memory and, under CPU offload, a server's host memory
            "time": self.time.to_dict(),
            "runs_in_mmtrain_train": not self.not_run_by_train,
            "not_run_by_train": self.not_run_by_train,
        }


def objective_summary(model: PlanModel, cfg: PlanConfig, memory: MemoryEstimate) -> dict:
    """What a sample of the plan is and, for DPO, what it adds (plan/preference.py): its
    reference, the reference's memory and its FLOPs in every step, or, cached, in its one pass
    before training (per pair, and over the run's --samples pairs; its time and cost are in
    "time")."""
    if not pref.is_dpo(cfg):
        return {"name": cfg.objective, "sample": "row", "rows_per_sample": 1}
    pass_flops = pref.reference_pass_flops(model, cfg)
    return {
        "name": "dpo",
        "sample": "pair",  # micro_batch, global_batch, samples and samples_per_s count pairs
        "rows_per_sample": pref.ROWS_PER_PAIR,
        "reference": pref.reference_kind(model, cfg),
        "reference_bytes": int(memory.reference_bytes),
        "reference_forward_flops_per_sample": pref.reference_forward_flops(model, cfg),
        "reference_pass_flops_per_sample": pass_flops,
        "reference_pass_flops": pass_flops * cfg.samples,
        "logits_bytes": int(memory.logits_bytes),
    }


def quantize_notes(model: PlanModel, cfg: PlanConfig) -> list[str]:
    """QLoRA stacks whose block linears torchao cannot quantize (kept in the compute dtype)."""
    notes = []
    for s in model.stacks:
        left = q.unquantized_linears(s, nf4_shards(cfg))
        if left:
            shapes = ", ".join(f"{o}x{i}" for o, i in left)
            notes.append(
                f"{s.name}: NF4 needs whole blocks of {q.NF4_BLOCK} x {q.NF4_SCALER_BLOCK} "
                f"weights on each of {nf4_shards(cfg)} rank(s); {shapes} kept in the compute dtype"
            )
    return notes


def make_plan(model: PlanModel, cfg: PlanConfig, catalog: Catalog) -> Plan:
    """Validate `cfg` against the model and compute memory and time on `cfg.gpu`."""
    gpu = catalog.gpu(cfg.gpu)
    if cfg.gpus_per_node is None:
        cfg = replace(cfg, gpus_per_node=gpu.gpus_per_node)
    heads = [s.heads for s in model.stacks if s.mode != "frozen" or cfg.tp > 1]
    cfg.validate(heads, model.split_heads())
    pref.check_preference(model, cfg)
    if cfg.sequence_parallel > 1:  # the plan names the layout `auto` resolves to
        cfg = replace(cfg, sequence_parallel_attention=cfg.sp_attention(model.split_heads()))
    gpu.peak_flops(cfg.precision)  # raises for a precision the GPU lacks
    host = None
    if cfg.offload:
        host = host_estimate(model, cfg, gpu, catalog, micro_compute_s(model, cfg, gpu))
    memory, time = training_memory(model, cfg, gpu), training_time(model, cfg, gpu, catalog)
    return Plan(model, cfg, gpu, memory, time, host)
