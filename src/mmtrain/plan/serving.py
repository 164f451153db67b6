"""Serving speed beside serving memory (inference.py): decode throughput and time to first token.

Decode is memory-bandwidth bound (kipply, "Transformer Inference Arithmetic"): each step reads,
on every GPU of a replica's TP group, its share of the decoder's weights (the input embedding
table apart: a step reads only its rows; a tied table is read as the head) and the cached keys
and values of every sequence of the batch, at the GPU's HBM bandwidth (hardware/gpus.csv
`mem_bw_tbps`, the peak: a roofline, which real kernels approach but do not reach). Each layer
adds two all-reduces of the batch's hidden states over the TP group (bandwidth only; their
latency, which dominates small messages, is not counted). The step is planned at the full
context (the slowest step of a sequence); a sequence gets one token a step, a replica `batch`.

Prefill is compute bound: a prompt of P tokens costs 2 x (the blocks' weights) x P, plus causal
attention (2 P^2 x heads x head_dim a layer: half of the non-causal 4 P^2), plus the head for the
last position (2 x vocab x width) and the image towers' forward over the prompt's images; run at
the dense peak of the serving precision times the achievable fraction of the model's training
family (compute.py; no serving-specific figure is published in the reference), split over the
TP group, with its two all-reduces a layer. The time to first token is that prefill alone (no
queueing, no tokenizer or image decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.hardware import GPU, Catalog, Interconnect
from mmtrain.plan.comm import all_reduce_s, group_link
from mmtrain.plan.compute import efficiency
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.fsdp_units import embedding_table
from mmtrain.plan.inference import WEIGHT_BYTES, InferenceEstimate, kv_cache_bytes
from mmtrain.plan.model import PlanModel
from mmtrain.plan.states import compute_dtype_bytes

TP_ALL_REDUCES = 2  # per layer: after the attention and after the MLP (Megatron-LM)
COMPUTE = ("fp32", "bf16", "fp16", "fp8")  # serving precisions that run matmuls; else weight-only


@dataclass(frozen=True)
class ServingSpeed:
    decode_bytes_per_gpu: float  # read by each GPU per decode step at the full context
    decode_step_s: float
    tokens_per_s_per_sequence: float
    tokens_per_s_per_replica: float  # at the served batch
    tokens_per_s: float  # all replicas
    max_batch_tokens_per_s: float  # all replicas at the largest batch (0: none fits)
    prompt_tokens: int
    prefill_flops: float
    ttft_s: float
    hbm_bytes_per_s: float
    compute_flops_per_s: float  # one GPU's: peak x achievable fraction
    achievable_fraction: float
    efficiency_source: str
    tp_link: str
    assumptions: tuple[str, ...]

    def to_dict(self) -> dict:
        out = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}
        out["assumptions"] = list(self.assumptions)
        return out


def decode_weight_bytes(model: PlanModel, precision: str) -> float:
    """Weight bytes a decode step reads: the decoder stacks' but an untied embedding table."""
    params = sum(s.params - embedding_table(s) for s in model.stacks if s.kind == "decoder")
    return params * WEIGHT_BYTES[precision]


def prefill_flops(model: PlanModel, prompt: int) -> float:
    """FLOPs of one prompt's prefill (module docstring)."""
    total = 0.0
    for s in model.stacks:
        if s.kind != "decoder":
            total += s.forward_flops  # the prompt's images (as many as a row holds)
            continue
        total += 2 * s.layers * s.block_params() * prompt
        total += 2 * s.layers * prompt**2 * s.heads * s.head_dim  # causal attention
        total += 2 * s.vocab * s.width  # logits of the last position
    return total


def _decode_step(
    model: PlanModel,
    precision: str,
    context: int,
    batch: int,
    tp: int,
    gpu: GPU,
    link: Interconnect,
) -> tuple[float, float]:
    """(bytes each GPU reads, seconds) of one decode step of `batch` sequences at `context`."""
    read = decode_weight_bytes(model, precision) / tp
    read += kv_cache_bytes(model, context, batch, precision, tp)
    comm = _tp_all_reduces_s(model, batch, precision, tp, link)
    return read, read / (gpu.mem_bw_tbps * 1e12) + comm


def _tp_all_reduces_s(
    model: PlanModel, tokens: int, precision: str, tp: int, link: Interconnect
) -> float:
    """The decoder layers' TP all-reduces of `tokens` hidden states (bandwidth only)."""
    act = compute_dtype_bytes(precision)
    return sum(
        s.layers * TP_ALL_REDUCES * all_reduce_s(tokens * s.width * act, tp, link)
        for s in model.stacks
        if s.kind == "decoder"
    )


def serving_speed(
    model: PlanModel,
    gpu: GPU,
    catalog: Catalog,
    memory: InferenceEstimate,
    precision: str = "bf16",
    prompt_tokens: int | None = None,
    mfu: float | None = None,
) -> ServingSpeed:
    """Decode tokens/s and time to first token of the layout `memory` plans (its TP, replicas,
    batch and context)."""
    tp, context, batch = memory.tp, memory.context, memory.batch
    prompt = prompt_tokens or context
    link = group_link(catalog, gpu, tp, gpu.gpus_per_node, None)
    read, step = _decode_step(model, precision, context, batch, tp, gpu, link)
    per_replica = batch / step
    largest = 0.0
    if memory.max_batch:
        big = _decode_step(model, precision, context, memory.max_batch, tp, gpu, link)[1]
        largest = memory.replicas * memory.max_batch / big
    compute_precision = precision if precision in COMPUTE else "bf16"
    eff = efficiency(model, gpu, PlanConfig(gpu=gpu.key, precision=compute_precision, mfu=mfu))
    rate = gpu.peak_flops(compute_precision) * eff.fraction
    flops = prefill_flops(model, prompt)
    ttft = flops / (rate * tp) + _tp_all_reduces_s(model, prompt, precision, tp, link)
    return ServingSpeed(
        decode_bytes_per_gpu=read,
        decode_step_s=step,
        tokens_per_s_per_sequence=1 / step,
        tokens_per_s_per_replica=per_replica,
        tokens_per_s=memory.replicas * per_replica,
        max_batch_tokens_per_s=largest,
        prompt_tokens=prompt,
        prefill_flops=flops,
        ttft_s=ttft,
        hbm_bytes_per_s=gpu.mem_bw_tbps * 1e12,
        compute_flops_per_s=rate,
        achievable_fraction=eff.fraction,
        efficiency_source=eff.source,
        tp_link=link.key if tp > 1 else "",
        assumptions=(
            "decode at the full context, memory-bound: weights and KV cache read once a step at "
            "the catalog's peak HBM bandwidth (a roofline)",
            "prefill compute-bound at the training family's achievable fraction of peak",
            "TP all-reduces by bandwidth only (no latency); weights split evenly over TP",
            f"{'weight-only ' + precision + ': matmuls in bf16' if precision not in COMPUTE else precision + ' matmuls'}",
        ),
    )
