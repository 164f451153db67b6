"""Serving memory: weights by precision, KV cache (grouped-query aware) for decoder stacks,
encoder activations, the largest batch that fits, and the MIG profile that holds it.

KV cache bytes = 2 (K and V) x L x kv_heads x head_dim x bytes x tokens x batch (kipply,
"Transformer Inference Arithmetic"), with head_dim from the config, not width / heads.
Encoders and the current decoder layer need one layer's working set at a time.

Tensor parallelism (`tp`, Megatron-style as vLLM and TensorRT-LLM serve): each GPU of a TP group
holds 1/tp of the weights (split evenly: the column- and row-parallel linears and a vocab-split
embedding and head; the norms, a few widths, are counted split too), ceil(kv_heads / tp) of each
layer's key/value heads (a group wider than the kv heads replicates them), and 1/tp of a layer's
working set (its heads split). `gpus` / `tp` replicas serve side by side; `batch` and the
largest batch are per replica. MIG sizes a single-GPU replica only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mmtrain.hardware import GPU, MigProfile
from mmtrain.plan.activations import ActivationOptions, layer_bytes
from mmtrain.plan.memory import CUDA_CONTEXT_BYTES
from mmtrain.plan.model import PlanModel
from mmtrain.structured import FieldError

WEIGHT_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5625,
}  # int4 incl. scales


@dataclass(frozen=True)
class InferenceEstimate:
    weights_bytes: float
    kv_cache_bytes: float
    kv_bytes_per_token: float
    activations_bytes: float
    overhead_bytes: float
    batch: int
    context: int
    max_batch: int
    usable_bytes: float
    mig_profile: str | None
    mig_instances: int
    tp: int = 1
    replicas: int = 1

    @property
    def total_bytes(self) -> float:
        return (
            self.weights_bytes + self.kv_cache_bytes + self.activations_bytes + self.overhead_bytes
        )

    def to_dict(self) -> dict:
        return {
            "weights_bytes": int(self.weights_bytes),
            "kv_cache_bytes": int(self.kv_cache_bytes),
            "kv_bytes_per_token": int(self.kv_bytes_per_token),
            "activations_bytes": int(self.activations_bytes),
            "overhead_bytes": int(self.overhead_bytes),
            "total_bytes": int(self.total_bytes),
            "batch": self.batch,
            "context": self.context,
            "max_batch": self.max_batch,
            "usable_bytes": int(self.usable_bytes),
            "fits": self.total_bytes <= self.usable_bytes,
            "mig_profile": self.mig_profile,
            "mig_instances": self.mig_instances,
            "tp": self.tp,
            "replicas": self.replicas,
            "gpus": self.tp * self.replicas,
            "per": "GPU (weights, KV cache, activations of one GPU of a replica's TP group)",
        }


def kv_cache_bytes(
    model: PlanModel, tokens: int, batch: int, precision: str = "bf16", tp: int = 1
) -> float:
    """KV cache of all decoder stacks for `batch` sequences of `tokens` tokens, on one GPU of a
    TP group of `tp` (ceil(kv_heads / tp) heads a layer)."""
    b = kv_element_bytes(precision)
    per_token = sum(s.kv_bytes_per_token(b, tp) for s in model.stacks if s.kind == "decoder")
    return per_token * tokens * batch


def kv_element_bytes(precision: str) -> float:
    """Bytes of a cached key or value: the weights' dtype, 16-bit under weight-only int4."""
    return WEIGHT_BYTES[precision] if precision != "int4" else 2.0


def _per_sequence(
    model: PlanModel, context: int, precision: str, tp: int = 1
) -> tuple[float, float]:
    """(KV bytes, activation working-set bytes) for one sequence on one GPU of a TP group."""
    kv = kv_cache_bytes(model, context, 1, precision, tp)
    act = 2 if precision != "fp32" else 4
    o = ActivationOptions(act, act)
    work = 0.0
    for s in model.stacks:
        if s.kind == "decoder":
            # prefill of one sequence: one layer's working set over the context
            work = max(work, layer_bytes(replace(s, tokens=context), 1, o))
        else:
            work = max(work, layer_bytes(s, 1, o))
    return kv, work / tp


def _mig(gpu: GPU, needed: float) -> MigProfile | None:
    fitting = [p for p in gpu.mig_profiles if p.memory_gib * 1024**3 >= needed]
    return min(fitting, key=lambda p: p.memory_gib) if fitting else None


def check_serving_layout(model: PlanModel, gpus: int, tp: int) -> None:
    """FieldError (naming the flag) unless `tp` divides `gpus` and every stack's heads."""
    if gpus < 1 or tp < 1:
        raise FieldError("--gpus" if gpus < 1 else "--tp", "must be at least 1")
    if gpus % tp:
        raise FieldError("--tp", f"{tp} does not divide --gpus {gpus} (replicas of {tp} GPUs)")
    for s in model.stacks:
        if s.heads and s.heads % tp:
            raise FieldError(
                "--tp",
                f"tensor parallel {tp} does not divide the {s.heads} attention heads of {s.name}",
            )


def inference_memory(
    model: PlanModel,
    gpu: GPU,
    context: int,
    batch: int,
    precision: str = "bf16",
    tp: int = 1,
    gpus: int | None = None,
) -> InferenceEstimate:
    """Memory to serve `batch` sequences of `context` tokens on each replica of `tp` GPUs
    (`gpus` in all, default `tp`): per GPU of a replica."""
    if precision not in WEIGHT_BYTES:
        raise FieldError("--precision", f"{precision!r} is not one of {', '.join(WEIGHT_BYTES)}")
    if context < 1 or batch < 1:
        raise FieldError("--context" if context < 1 else "--batch", "must be at least 1")
    gpus = tp if gpus is None else gpus
    check_serving_layout(model, gpus, tp)
    weights = model.params() * WEIGHT_BYTES[precision] / tp
    kv_one, work_one = _per_sequence(model, context, precision, tp)
    overhead = CUDA_CONTEXT_BYTES
    usable = gpu.usable_bytes
    free = usable - weights - overhead
    max_batch = int(free // (kv_one + work_one)) if free > 0 else 0
    needed = weights + overhead + batch * (kv_one + work_one)
    profile = _mig(gpu, needed) if tp == 1 else None
    instances = profile.instances if profile else 0
    return InferenceEstimate(
        weights_bytes=weights,
        kv_cache_bytes=kv_one * batch,
        kv_bytes_per_token=kv_one / context,
        activations_bytes=work_one * batch,
        overhead_bytes=overhead,
        batch=batch,
        context=context,
        max_batch=max_batch,
        usable_bytes=usable,
        mig_profile=profile.name if profile else None,
        mig_instances=instances,
        tp=tp,
        replicas=gpus // tp,
    )
