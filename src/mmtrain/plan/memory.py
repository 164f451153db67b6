"""Memory per GPU during training, itemised, against the GPU's usable (not nominal) memory.

Items: weights, gradients, optimizer states (ZeRO-sharded over the data-parallel x
sequence-parallel ranks, divided by tensor x pipeline parallel), activations (activations.py), communication buffers,
CUDA context, allocator fragmentation. Overheads, stated:
- CUDA context and kernels: 1000 MiB flat (vram.asmirnov.xyz's constant; PyTorch's first CUDA
  use takes 300 MiB to 2 GiB).
- Allocator fragmentation: 10% of the dynamic memory (activations, recompute, buffers): the
  reserved-minus-allocated gap the caching allocator leaves.
- Communication buffers: DDP's two 25 MiB buckets (gradient_as_bucket_view assumed); ZeRO-1/2
  reduce-scatter of two blocks' gradients; ZeRO-3 (FSDP2, train/parallel.py's units:
  fsdp_units.py) the gathered root (kept from its forward to the end of the backward) with its
  unsharded gradients, and the larger of the current and the prefetched block's gathered
  weights with one block's unsharded gradients, or an untied embedding's (gathered alone).
- CPU offload (FSDP2's CPUOffloadPolicy, `--offload`, train.offload; plan/offload.py): the
  sharded weights, gradients and optimizer states live in host memory, none on the GPU; the
  GPU keeps the ZeRO-3 buffers and the host-to-device copies of the current and the prefetched
  unit's shards, and the device copy of one unit's reduce-scattered gradient shard.
- QLoRA (plan/quantized.py): NF4 weights as torchao lays them out, gathered as they are held,
  and the largest of them dequantized to the compute dtype for one matmul at a time.
- DPO (`--objective dpo`, plan/preference.py): two rows a pair through the language model (a
  native VLM's vision stacks: one set of images a pair), at its LM head the per-target NLL of
  the chunked loss (a hub model: the whole logits), and, with `--reference copy`, the
  reference's frozen copy in the compute dtype (a cached reference's pass before training
  adds nothing to the peak: plan/preference.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from mmtrain.hardware import GPU
from mmtrain.plan import quantized as q
from mmtrain.plan.activations import (
    ActivationOptions,
    activation_options,
    contrastive_bytes,
    fusion_bytes,
    fusion_loss_bytes,
    regression_loss_bytes,
    stack_activations,
)
from mmtrain.plan.config import PlanConfig
from mmtrain.plan.fsdp_units import Unit, fsdp_units, host_param_bytes, unit_gathered
from mmtrain.plan.model import PlanModel
from mmtrain.plan.offload import grad_host_bytes
from mmtrain.plan.preference import reference_bytes, rows_per_sample
from mmtrain.plan.states import compute_dtype_bytes, frozen_model_bytes, shard, state_bytes

MIB = 1024**2
CUDA_CONTEXT_BYTES = 1000 * MIB
FRAGMENTATION = 0.10
DDP_BUCKETS_BYTES = 2 * 25 * MIB
FUSION_HEAD = "fusion head"  # its key among the per-tower activations


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float  # saved by autograd (incl. logits) + recompute working set
    comm_buffers_bytes: float
    cuda_context_bytes: float
    fragmentation_bytes: float
    usable_bytes: float
    headroom: float
    convention: str
    activations_by_stack: dict[str, float] = field(default_factory=dict)
    saved_activations_bytes: float = 0.0  # what autograd keeps (comparable with --measure)
    recompute_bytes: float = 0.0
    loss_bytes: float = 0.0
    dequantized_bytes: float = 0.0  # QLoRA: the largest NF4 weight in the compute dtype
    offload: bool = False  # model states in host memory (their GPU share is 0)
    reference_bytes: float = 0.0  # DPO's frozen reference copy (plan/preference.py)
    # of the activations: what the LM head's rows keep (the loss's targets; DPO's per-target
    # NLL beside them, or a hub model's whole logits)
    logits_bytes: float = 0.0

    @property
    def model_state_bytes(self) -> float:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def overhead_bytes(self) -> float:
        return self.comm_buffers_bytes + self.cuda_context_bytes + self.fragmentation_bytes

    @property
    def total_bytes(self) -> float:
        return (
            self.model_state_bytes
            + self.activations_bytes
            + self.dequantized_bytes
            + self.reference_bytes
            + self.overhead_bytes
        )

    @property
    def budget_bytes(self) -> float:
        return self.usable_bytes * (1 - self.headroom)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    def to_dict(self) -> dict:
        return {
            "weights_bytes": int(self.weights_bytes),
            "gradients_bytes": int(self.gradients_bytes),
            "optimizer_bytes": int(self.optimizer_bytes),
            "activations_bytes": int(self.activations_bytes),
            "saved_activations_bytes": int(self.saved_activations_bytes),
            "recompute_bytes": int(self.recompute_bytes),
            "loss_bytes": int(self.loss_bytes),
            "dequantized_bytes": int(self.dequantized_bytes),
            "reference_bytes": int(self.reference_bytes),
            "logits_bytes": int(self.logits_bytes),
            "offload": self.offload,
            "activations_by_tower": {k: int(v) for k, v in self.activations_by_stack.items()},
            "comm_buffers_bytes": int(self.comm_buffers_bytes),
            "cuda_context_bytes": int(self.cuda_context_bytes),
            "fragmentation_bytes": int(self.fragmentation_bytes),
            "overhead_bytes": int(self.overhead_bytes),
            "total_bytes": int(self.total_bytes),
            "usable_bytes": int(self.usable_bytes),
            "budget_bytes": int(self.budget_bytes),
            "headroom": self.headroom,
            "fits": self.fits,
            "state_convention": self.convention,
        }


def model_states(model: PlanModel, cfg: PlanConfig) -> tuple[float, float, float, str]:
    """(weights, gradients, optimizer) bytes per GPU and the convention used. ZeRO shards over
    every rank of a replica's data and sequence parallel groups (FSDP over dp x sp)."""
    return _model_states(
        model,
        cfg.precision,
        cfg.optimizer,
        cfg.bytes_per_param,
        cfg.tp * cfg.pp,
        cfg.zero,
        cfg.shard_ranks,
        cfg.offload,
    )


# The search (recommend.py) asks for the same few sub-results thousands of times across GPU
# types, counts and ZeRO stages; these caches key on what each one depends on. Models, options
# and the strings/ints are immutable, so a cached value can never go stale.
@lru_cache(maxsize=4096)
def _model_states(
    model: PlanModel,
    precision: str,
    optimizer: str,
    bytes_per_param: int,
    split: int,
    zero: int,
    dp: int,
    offload: bool = False,
) -> tuple[float, float, float, str]:
    b = state_bytes(precision, optimizer, bytes_per_param)
    if offload:  # every shard in host memory (plan/offload.py counts it there)
        return 0.0, 0.0, 0.0, b.convention + "; all of them in host memory (CPU offload)"
    trainable = shard(model.trainable_params() / split, b, zero, dp)
    frozen = frozen_model_bytes(model, precision, split * (dp if zero >= 3 else 1))
    # (torchao splits NF4 weights over FSDP2's ranks: `split x dp` decides which it can)
    return trainable.weights + frozen, trainable.gradients, trainable.optimizer, b.convention


def nf4_shards(cfg: PlanConfig) -> int:
    """Ranks FSDP2 splits each NF4 weight over (1 without it): which weights torchao holds."""
    return cfg.shard_ranks if cfg.zero >= 3 else 1


def comm_buffers(model: PlanModel, cfg: PlanConfig) -> float:
    if cfg.shard_ranks == 1 and not cfg.offload:
        return 0.0
    if cfg.zero == 0:
        return DDP_BUCKETS_BYTES
    b = state_bytes(cfg.precision, cfg.optimizer, cfg.bytes_per_param)
    if cfg.zero in (1, 2):
        return 2 * _largest_block(model) / cfg.tp * b.grads
    buffers = _fsdp_buffers(model, cfg.precision, b.grads, cfg.shard_ranks) / cfg.tp
    if cfg.offload:
        buffers += offload_staging(model, cfg.precision, cfg.shard_ranks) / cfg.tp
    return buffers


@lru_cache(maxsize=64)
def _largest_block(model: PlanModel) -> int:
    return max(s.block_params() for s in model.stacks)


def _held(unit: Unit, precision: str, grad_bytes: float) -> float:
    """One unit gathered, with its unsharded gradients."""
    return unit_gathered(unit, precision) + unit.trainable * grad_bytes


@lru_cache(maxsize=1024)
def _fsdp_buffers(model: PlanModel, precision: str, grad_bytes: float, shards: int) -> float:
    """What ZeRO-3 holds unsharded at its peak (module docstring; fsdp_units.py)."""
    units = fsdp_units(model, shards)
    root = sum(_held(u, precision, grad_bytes) for u in units if u.kind == "root")
    blocks = [
        2 * unit_gathered(u, precision) + u.trainable * grad_bytes
        for u in units
        if u.kind == "block"
    ]
    embeddings = [_held(u, precision, grad_bytes) for u in units if u.kind == "embedding"]
    return root + max(blocks + embeddings, default=0.0)


@lru_cache(maxsize=1024)
def offload_staging(model: PlanModel, precision: str, shards: int) -> float:
    """GPU bytes of CPU offload's copies: the current and the prefetched unit's shards copied
    in for their all-gathers, and one unit's reduce-scattered gradient shard (in the reduce
    dtype, plan/offload.py's `grad_host_bytes`) before it is copied out."""
    units = fsdp_units(model, shards)
    staged = [u for u in units if u.kind != "root"] or list(units)
    copied_in = max(host_param_bytes(u, precision) for u in staged) / shards
    copied_out = max(u.trainable for u in staged) * grad_host_bytes(precision) / shards
    return 2 * copied_in + copied_out


def dequantized_working_set(
    model: PlanModel, precision: str, tp: int = 1, shards: int = 1
) -> float:
    """QLoRA: the largest NF4 weight dequantized to the compute dtype for its matmul."""
    dtype_bytes = compute_dtype_bytes(precision)
    largest = max((q.dequantized_bytes(s, dtype_bytes, shards) for s in model.stacks), default=0)
    return largest / tp


@dataclass(frozen=True)
class _Activations:
    by_stack: tuple[tuple[str, float], ...]
    saved: float  # without the loss, which also depends on the data-parallel size
    recompute: float
    logits: float = 0.0  # of `saved`: what the LM heads' rows keep


@lru_cache(maxsize=8192)
def _activations(
    model: PlanModel, o: ActivationOptions, micro_batch: int, pp: int, accumulation: int
) -> _Activations:
    by_stack, saved, recompute, logits = [], 0.0, 0.0, 0.0
    for stack, input_grad in zip(model.stacks, model.input_grads(), strict=True):
        a = stack_activations(stack, micro_batch, o, pp, accumulation, input_grad)
        by_stack.append((stack.name, a.saved))
        saved += a.saved
        logits += a.logits_bytes
        recompute = max(recompute, a.recompute_bytes)  # one layer at a time is recomputed
    if model.fusion is not None:
        by_stack.append((FUSION_HEAD, fusion_bytes(model, micro_batch, o)))
        saved += by_stack[-1][1]
    return _Activations(tuple(by_stack), saved, recompute, logits)


def training_memory(
    model: PlanModel, cfg: PlanConfig, gpu: GPU | None, usable_bytes: float | None = None
) -> MemoryEstimate:
    """Per-GPU training memory for `model` under strategy `cfg` on `gpu` (None: CPU, no CUDA
    context, `usable_bytes` given by the caller). Under `--objective dpo` a sample is a pair:
    its activations are those of two rows (a native VLM's images once), with DPO's log-probs,
    and a `copy` reference holds its frozen copy (plan/preference.py)."""
    weights, grads, optimizer, convention = model_states(model, cfg)
    # On the CPU packed rows attend through a dense mask (models/attention.py's fallback).
    o = activation_options(
        cfg.precision,
        cfg.attention,
        cfg.ac,
        cfg.tp,
        cfg.sp,
        dense_packed_mask=gpu is None,
        sequence_parallel=cfg.sequence_parallel,
        sp_attention=cfg.sp_attention(model.split_heads()),
        objective=cfg.objective,
    )
    rows = cfg.micro_batch * rows_per_sample(cfg.objective)
    acts = _activations(model, o, rows, cfg.pp, cfg.accumulation if cfg.pp > 1 else 1)
    saved, recompute = acts.saved, acts.recompute
    loss = contrastive_bytes(model, cfg.micro_batch, cfg.dp) + fusion_loss_bytes(
        model, cfg.micro_batch
    )
    loss += regression_loss_bytes(model, cfg.micro_batch)
    saved += loss
    buffers = comm_buffers(model, cfg)
    dequantized = dequantized_working_set(model, cfg.precision, cfg.tp, nf4_shards(cfg))
    dynamic = saved + recompute + buffers + dequantized
    return MemoryEstimate(
        weights_bytes=weights,
        gradients_bytes=grads,
        optimizer_bytes=optimizer,
        activations_bytes=saved + recompute,
        comm_buffers_bytes=buffers,
        cuda_context_bytes=CUDA_CONTEXT_BYTES if gpu is not None else 0.0,
        fragmentation_bytes=FRAGMENTATION * dynamic if gpu is not None else 0.0,
        usable_bytes=gpu.usable_bytes if gpu is not None else (usable_bytes or 0.0),
        headroom=cfg.headroom,
        convention=convention,
        activations_by_stack=dict(acts.by_stack),
        saved_activations_bytes=saved,
        recompute_bytes=recompute,
        loss_bytes=loss,
        dequantized_bytes=dequantized,
        offload=cfg.offload,
        reference_bytes=reference_bytes(model, cfg),
        logits_bytes=acts.logits,
    )
