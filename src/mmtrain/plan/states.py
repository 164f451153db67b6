"""Model states per parameter (weights, gradients, optimizer) and their ZeRO partitioning.

Conventions (bytes per trainable parameter under mixed-precision AdamW):
- 16: 16-bit weights 2 + 16-bit grads 2 + fp32 master, momentum, variance 12 (ZeRO paper,
  Rajbhandari et al. 2019, "(2 + 2 + K) x Psi", K = 12): what `bf16-weights` (DeepSpeed bf16,
  FSDP2 with bf16 parameters) holds, the bf16 weights being the copy the model computes with.
  Also what torch autocast (`bf16`) holds: fp32 weights 4 + fp32 grads 4 + Adam 8.
- 18: fp32 gradients (Megatron-LM without distributed optimizer; DeepSpeed and HF docs).
- 20: 16-bit grads plus an fp32 gradient accumulation buffer (nanotron / Ultra-Scale Playbook).
The "8 bytes per parameter" rule (weights + grads + Adam in 16-bit) holds only for pure bf16.
Optimizer multipliers K (EleutherAI Transformer Math 101): AdamW 12, 8-bit AdamW 6, SGD with
momentum 8, each including the 4-byte fp32 master copy in mixed precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mmtrain.plan import quantized as q
from mmtrain.plan.model import PlanModel

# Optimizer bytes per parameter: with an fp32 master copy (mixed) / states in the weight dtype.
_OPTIMIZER_MIXED = {"adamw": 12, "adamw8bit": 6, "sgd": 8}
_OPTIMIZER_FP32 = {"adamw": 8, "adamw8bit": 2, "sgd": 4}
_OPTIMIZER_PURE16 = {"adamw": 4, "adamw8bit": 2, "sgd": 2}


@dataclass(frozen=True)
class StateBytes:
    """Bytes per trainable parameter, and the name of the convention that gave them."""

    weights: float
    grads: float
    optimizer: float
    convention: str

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


@lru_cache(maxsize=64)
def state_bytes(precision: str, optimizer: str, bytes_per_param: int = 16) -> StateBytes:
    """Weights, gradients and optimizer bytes per trainable parameter."""
    if precision == "fp32":
        return StateBytes(
            4, 4, _OPTIMIZER_FP32[optimizer], "fp32 weights, grads and optimizer states"
        )
    if precision == "bf16-pure":
        return StateBytes(
            2,
            2,
            _OPTIMIZER_PURE16[optimizer],
            "pure bf16: no fp32 master copy (the '8 bytes/param' rule for AdamW)",
        )
    grads = {16: 2, 18: 4, 20: 6}[bytes_per_param]
    names = {
        16: "16 B/param for AdamW: 16-bit weights and grads + fp32 master/momentum/variance (ZeRO paper)",
        18: "18 B/param for AdamW: fp32 grads (Megatron-LM, DeepSpeed, HF)",
        20: "20 B/param for AdamW: 16-bit grads + fp32 accumulation buffer (nanotron)",
    }
    return StateBytes(2, grads, _OPTIMIZER_MIXED[optimizer], names[bytes_per_param])


def compute_dtype_bytes(precision: str) -> int:
    """Bytes of an element in the compute dtype: 4 under fp32, else 2 (bf16 or fp16, and the
    bf16 of an fp8 run outside its matmuls). FSDP2 gathers parameters in it
    (MixedPrecisionPolicy's param_dtype), and QLoRA converts NF4 weights from it."""
    return 4 if precision == "fp32" else 2


def frozen_weight_bytes(precision: str) -> float:
    """A frozen (or LoRA base) weight is stored once, in the compute dtype."""
    return {"fp32": 4, "fp8": 1}.get(precision, 2)


# Autocast precisions under which the trainer holds frozen linear and convolution weights in
# the compute dtype and the rest of what is frozen (embedding tables, norms) in fp32.
AUTOCAST_16 = ("bf16", "fp16")


def frozen_bytes(params: float, fp32_params: float, precision: str) -> float:
    """Bytes of `params` frozen parameters of which `fp32_params` are not a linear or
    convolution layer's: under 16-bit autocast those stay fp32 (their outputs feed the fp32
    residual stream; train/model_setup.py), the others are held in the compute dtype."""
    b = frozen_weight_bytes(precision)
    if precision not in AUTOCAST_16:
        return params * b
    return params * b + fp32_params * (4 - b)


@dataclass(frozen=True)
class ShardedStates:
    weights: float
    gradients: float
    optimizer: float


def shard(params: float, b: StateBytes, zero: int, dp: int) -> ShardedStates:
    """Per-GPU model-state bytes for `params` (already divided by tp x pp) under ZeRO stage `zero`
    over `dp` data-parallel ranks (ZeRO-1 shards the optimizer, -2 also gradients, -3 also
    weights; FSDP's SHARD_GRAD_OP ~ ZeRO-2 and FULL_SHARD ~ ZeRO-3)."""
    return ShardedStates(
        weights=params * b.weights / (dp if zero >= 3 else 1),
        gradients=params * b.grads / (dp if zero >= 2 else 1),
        optimizer=params * b.optimizer / (dp if zero >= 1 else 1),
    )


def frozen_model_bytes(model: PlanModel, precision: str, shards: int = 1) -> float:
    """Bytes of `model`'s frozen parameters as the trainer holds them, over `shards` ranks
    (FSDP2's, which also decide which weights torchao can split in NF4; TP x PP for the rest):
    linear and convolution weights in the compute dtype, the rest in fp32 under 16-bit
    autocast (`frozen_bytes`), and a QLoRA stack's NF4 weights as torchao lays them out
    (plan/quantized.py: their codes, scalers and factors sharded, the table whole per rank)."""
    dtype_bytes = compute_dtype_bytes(precision)
    nf4 = sum(q.nf4_params(s, shards) for s in model.stacks)
    dense = frozen_bytes(model.frozen_params() - nf4, model.frozen_fp32_params(), precision)
    held = sum(q.nf4_stack_bytes(s, dtype_bytes, shards) for s in model.stacks)
    return dense / shards + held
