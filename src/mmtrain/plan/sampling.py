"""Serving a generator: what sampling images costs on one GPU (`mmtrain plan --inference` for a
denoiser).

A sampler calls the denoiser once per step, twice with classifier-free guidance (the
conditional and the "no class" / empty-prompt prediction, batched together as pipelines do),
so an image costs steps x forwards x the stack's forward FLOPs. The time divides them by the
GPU's dense peak at the precision times the achievable fraction the training plan uses for the
workload family (compute.py: `efficiency`, a published figure moved to this GPU by MAMF, or
`--mfu`). No published sampling run stands behind that fraction: a forward over thousands of
tokens with no backward often runs faster than training does, a small batch of few tokens
slower (launch-bound kernels); pass `--mfu` with a figure measured on your sampler.

Memory: the weights at the serving precision, one block's working set per image and forward
(a forward frees each block's tensors before the next; activations.py's per-layer bytes, as
the LM serving plan counts its encoders), the CUDA context; the largest batch is what the rest
of the GPU holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.hardware import GPU
from mmtrain.plan.activations import ActivationOptions, layer_bytes
from mmtrain.plan.compute import efficiency
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.inference import WEIGHT_BYTES
from mmtrain.plan.memory import CUDA_CONTEXT_BYTES
from mmtrain.plan.model import PlanModel
from mmtrain.structured import FieldError


@dataclass(frozen=True)
class SamplingEstimate:
    steps: int
    forwards_per_step: int  # 2 with classifier-free guidance
    flops_per_image: float
    seconds_per_image: float  # on one GPU, at the achievable fraction of peak
    achievable_fraction: float
    efficiency_source: str
    weights_bytes: float
    activations_bytes: float  # for `batch` images
    overhead_bytes: float
    batch: int
    max_batch: int
    usable_bytes: float
    price_per_gpu_hour: float | None

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.activations_bytes + self.overhead_bytes

    @property
    def images_per_s(self) -> float:
        return 1.0 / self.seconds_per_image

    def gpu_hours(self, images: int) -> float:
        return images * self.seconds_per_image / 3600

    def to_dict(self) -> dict:
        price = self.price_per_gpu_hour
        per_million = self.gpu_hours(1_000_000)
        return {
            "steps": self.steps,
            "forwards_per_step": self.forwards_per_step,
            "flops_per_image": self.flops_per_image,
            "seconds_per_image": self.seconds_per_image,
            "images_per_s": self.images_per_s,
            "seconds_per_batch": self.seconds_per_image * self.batch,
            "gpu_hours_per_million_images": per_million,
            "cost_per_million_images": None if price is None else per_million * price,
            "achievable_fraction": self.achievable_fraction,
            "efficiency_source": self.efficiency_source,
            "weights_bytes": int(self.weights_bytes),
            "activations_bytes": int(self.activations_bytes),
            "overhead_bytes": int(self.overhead_bytes),
            "total_bytes": int(self.total_bytes),
            "batch": self.batch,
            "max_batch": self.max_batch,
            "usable_bytes": int(self.usable_bytes),
            "fits": self.total_bytes <= self.usable_bytes,
        }


def sampling_estimate(
    model: PlanModel,
    gpu: GPU,
    *,
    steps: int = 50,
    guidance: bool = True,
    batch: int = 1,
    precision: str = "bf16",
    mfu: float | None = None,
    price_per_gpu_hour: float | None = None,
) -> SamplingEstimate:
    """What sampling `batch` images in `steps` steps costs on one `gpu` (module docstring)."""
    stacks = [s for s in model.stacks if s.kind == "diffusion"]
    if not stacks:
        raise FieldError("--model", f"{model.name} has no denoiser to sample")
    if steps < 1:
        raise FieldError("--sampling-steps", f"must be at least 1, got {steps}")
    if batch < 1:
        raise FieldError("--batch", f"must be at least 1, got {batch}")
    if precision not in WEIGHT_BYTES:
        raise FieldError("--precision", f"{precision!r} is not one of {', '.join(WEIGHT_BYTES)}")
    forwards = 2 if guidance else 1
    flops = steps * forwards * sum(float(s.forward_flops) for s in stacks)
    compute_precision = "bf16" if precision in ("int8", "int4") else precision
    eff = efficiency(model, gpu, PlanConfig(gpu=gpu.key, precision=compute_precision, mfu=mfu))
    seconds = flops / (gpu.peak_flops(compute_precision) * eff.fraction)
    act = 4 if precision == "fp32" else 2
    per_image = forwards * max(layer_bytes(s, 1, ActivationOptions(act, act)) for s in stacks)
    weights = model.params() * WEIGHT_BYTES[precision]
    free = gpu.usable_bytes - weights - CUDA_CONTEXT_BYTES
    price = price_per_gpu_hour if price_per_gpu_hour is not None else gpu.price_per_gpu_hour
    return SamplingEstimate(
        steps=steps,
        forwards_per_step=forwards,
        flops_per_image=flops,
        seconds_per_image=seconds,
        achievable_fraction=eff.fraction,
        efficiency_source=eff.source,
        weights_bytes=weights,
        activations_bytes=per_image * batch,
        overhead_bytes=CUDA_CONTEXT_BYTES,
        batch=batch,
        max_batch=int(free // per_image) if free > 0 else 0,
        usable_bytes=gpu.usable_bytes,
        price_per_gpu_hour=price,
    )


__all__ = ["SamplingEstimate", "sampling_estimate"]
