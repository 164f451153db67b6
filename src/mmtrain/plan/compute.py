"""Step time, throughput, MFU, time and cost to train.

FLOPs per sample (2 x multiply-adds, spec.py's convention, attention counted non-causally as in
PaLM's MFU definition) are `spec.train_flops` over the stacks, the definition the trainer's MFU
uses too: a trainable stack costs 3x its forward (6N per token plus the attention term, PaLM
App. B: 6N + 12 L H Q T); a LoRA-adapted stack 2x (input gradients, no weight gradients); a
frozen stack 1x, 2x when a language model's gradient passes through it to a trained stack before
it. MFU counts model FLOPs only; hardware FLOPs add what activation checkpointing recomputes:
one more forward of the trained blocks with full recompute (Narayanan et al. 2021's 8N), the
attention sub-block's forward with selective recompute.

Achievable fraction of peak (default; `--mfu` overrides): the GPU's MAMF fraction (best
measured bf16 matmul over spec peak, stas00/ml-engineering "Maximum Achievable Matmul FLOPS")
times 0.65, the share of MAMF that large-model training reaches end to end: Korthikanti et al.
2022 report 54.2% MFU on A100 (MAMF 86.9%: 0.62 of it); Llama 3 (Dubey et al. 2024) 38-43%
BF16 MFU on H100 (MAMF 80.3%: 0.47-0.54). Small widths reach less; this model does not try to
predict that, so treat the time of sub-1B models as optimistic.

Communication (comm.py) overlaps with compute where frameworks overlap it: data-parallel
gradient reduction with the last micro-batch's backward, ZeRO-3 gathers with each micro-batch;
tensor-parallel all-reduces (4 per layer per micro-batch, 6 with full recompute) and the
ZeRO-1/2 parameter all-gather after the optimizer step are exposed. Overlap is capped at 80%
of the compute they hide behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mmtrain.hardware import CURRENCY, GPU, Catalog
from mmtrain.plan.comm import all_gather_s, all_reduce_s, group_link, reduce_scatter_s
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.model import PlanModel, Stack
from mmtrain.plan.states import state_bytes
from mmtrain.spec import FUSION_PART, PartTraining, train_flops

END_TO_END_SHARE_OF_MAMF = 0.65
OVERLAP = 0.8


def _attention_block_forward(stack: Stack) -> float:
    """Forward FLOPs per sample of the attention sub-blocks (what selective recompute redoes)."""
    s, h = stack.tokens, stack.width
    kv = stack.kv_heads * stack.head_dim
    return stack.layers * (
        2 * s * (2 * h * h + 2 * h * kv) + 4 * s * s * stack.heads * stack.head_dim
    )


@lru_cache(maxsize=256)
def flops_per_sample(model: PlanModel, ac: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per training sample."""
    forward = {s.name: float(s.forward_flops) for s in model.stacks}
    modes = {s.name: PartTraining(s.mode, s.trained_layer_share()) for s in model.stacks}
    if model.head_flops:
        forward[FUSION_PART] = float(model.head_flops)  # the fusion head trains
    chained = model.language_model
    model_flops = train_flops(forward, modes, chained=chained)
    if ac == "full":
        hardware = train_flops(forward, modes, chained=chained, recompute=list(forward))
    elif ac == "selective":
        redone = [_attention_block_forward(s) for s in model.stacks if s.mode != "frozen"]
        hardware = model_flops + sum(redone)
    else:
        hardware = model_flops
    return model_flops, hardware


def achievable_fraction(gpu: GPU, cfg: PlanConfig) -> float:
    return cfg.mfu if cfg.mfu is not None else gpu.mamf_fraction * END_TO_END_SHARE_OF_MAMF


@dataclass(frozen=True)
class TimeEstimate:
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    dp_exposed_s: float
    bubble_s: float
    step_time_s: float
    samples_per_s: float
    mfu: float
    achievable_fraction: float
    time_to_train_s: float
    cost: float
    price_per_gpu_hour: float
    price_source: str  # the catalog's indicative list price, the flag, or a user file
    intra_node: str
    dp_link: str

    def to_dict(self) -> dict:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        return {**out, "currency": CURRENCY}


def training_time(model: PlanModel, cfg: PlanConfig, gpu: GPU, catalog: Catalog) -> TimeEstimate:
    model_flops, hw_flops = flops_per_sample(model, cfg.ac)
    fraction = achievable_fraction(gpu, cfg)
    rate = gpu.peak_flops(cfg.precision) * fraction
    m = cfg.accumulation
    # One micro-batch on one GPU: TP splits each layer, PP splits the layers.
    micro_compute = hw_flops * cfg.micro_batch / (rate * cfg.tp * cfg.pp)
    gpn = cfg.gpus_per_node or gpu.gpus_per_node
    tp_link = group_link(catalog, gpu, cfg.tp, gpn, cfg.network)
    act_bytes = 4 if cfg.precision == "fp32" else 2
    tp_comm = 0.0
    if cfg.tp > 1:
        per_layer = 6 if cfg.ac == "full" else 4
        for s in model.stacks:
            size = cfg.micro_batch * s.per_sample * s.tokens * s.width * act_bytes
            calls = per_layer if s.mode != "frozen" else 2
            tp_comm += s.layers / cfg.pp * calls * all_reduce_s(size, cfg.tp, tp_link)
    dp_link = group_link(catalog, gpu, cfg.gpus, gpn, cfg.network)
    b = state_bytes(cfg.precision, cfg.optimizer, cfg.bytes_per_param)
    shard_params = model.trainable_params() / (cfg.tp * cfg.pp)
    grads = shard_params * min(b.grads, 4)
    weights = shard_params * b.weights
    backward = micro_compute * 2 / 3
    if cfg.zero == 0:
        dp_comm = all_reduce_s(grads, cfg.dp, dp_link)
        exposed = max(0.0, dp_comm - OVERLAP * backward)
    elif cfg.zero in (1, 2):
        rs = reduce_scatter_s(grads, cfg.dp, dp_link)
        ag = all_gather_s(weights, cfg.dp, dp_link)
        dp_comm = rs + ag
        exposed = max(0.0, rs - OVERLAP * backward) + ag
    else:  # ZeRO-3: gather weights for forward and backward, reduce-scatter grads, per micro-batch
        frozen = model.frozen_params() / (cfg.tp * cfg.pp) * b.weights
        per_micro = 2 * all_gather_s(weights + frozen, cfg.dp, dp_link) + reduce_scatter_s(
            grads, cfg.dp, dp_link
        )
        dp_comm = m * per_micro
        exposed = m * max(0.0, per_micro - OVERLAP * micro_compute)
    bubble = (cfg.pp - 1) * (micro_compute + tp_comm) if cfg.pp > 1 else 0.0
    step = m * (micro_compute + tp_comm) + exposed + bubble
    global_batch = cfg.effective_global_batch
    samples_per_s = global_batch / step
    peak_total = gpu.peak_flops(cfg.precision) * cfg.gpus
    mfu = model_flops * samples_per_s / peak_total
    if cfg.price_per_gpu_hour is not None:
        price, price_source = cfg.price_per_gpu_hour, "--price-per-gpu-hour"
    elif gpu.price_per_gpu_hour is not None:
        price, price_source = gpu.price_per_gpu_hour, gpu.price_source
    else:
        price, price_source = 0.0, "no price in the catalog: pass --price-per-gpu-hour"
    time_to_train = cfg.samples / samples_per_s if cfg.samples else 0.0
    return TimeEstimate(
        compute_s=m * micro_compute,
        tp_comm_s=m * tp_comm,
        dp_comm_s=dp_comm,
        dp_exposed_s=exposed,
        bubble_s=bubble,
        step_time_s=step,
        samples_per_s=samples_per_s,
        mfu=mfu,
        achievable_fraction=fraction,
        time_to_train_s=time_to_train,
        cost=time_to_train / 3600 * cfg.gpus * price,
        price_per_gpu_hour=price,
        price_source=price_source,
        intra_node=tp_link.key if cfg.tp > 1 else gpu.intra_node,
        dp_link=dp_link.key,
    )
