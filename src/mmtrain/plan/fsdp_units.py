"""What FSDP2 gathers at a time: the units train/parallel.py's `apply_fsdp` wraps, in bytes.

`apply_fsdp` makes each transformer block a unit, an untied decoder's embedding a unit of its
own, and the root takes the rest (stems, norms, heads, projectors, merger). A block unit is
all-gathered for its forward and again for its backward (reshard after forward); the root is
gathered once and stays gathered until its gradients are reduced at the end of the backward
(FSDP2's heuristic for the root); the embedding is gathered for the lookup and again for its
backward when it trains. Under ZeRO-3 a GPU therefore holds, besides its shards, the gathered
root (and its unsharded gradients while the backward runs) and either two gathered blocks (the
current one and the prefetched next) with one block's unsharded gradients, or the gathered
embedding with its gradients.

Dtypes: parameters are gathered in the compute dtype (MixedPrecisionPolicy's param_dtype: 2 bytes
under 16-bit autocast, 4 under fp32), unsharded gradients counted in the states convention's
gradient bytes; a QLoRA stack's NF4 weights are gathered as they are held (plan/quantized.py).
On the host (CPU offload, plan/offload.py) a trained parameter is kept as the model holds it
(fp32 under autocast) and a frozen one as a frozen weight is held (states.py), NF4 as NF4.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mmtrain.plan import quantized as q
from mmtrain.plan.activations import BF16_MODEL
from mmtrain.plan.model import PlanModel, Stack
from mmtrain.plan.states import compute_dtype_bytes, frozen_bytes


@dataclass(frozen=True)
class Unit:
    """`count` alike FSDP units: each with `params` parameters (`trainable` of them with
    gradients), `nf4` of them as NF4 weights, in tensors of `tensors` elements, gathered
    `gathers` times per micro-batch (forward and backward, or once for the root)."""

    name: str
    kind: str  # block | embedding | root
    count: int
    params: int
    trainable: int
    frozen_fp32: int  # of the frozen parameters, those held in fp32 under 16-bit autocast
    nf4_shapes: tuple[tuple[int, int], ...]  # NF4 weights (out, in), of `params`
    tensors: tuple[int, ...]  # element counts of its parameter tensors (for pinned memory)
    gathers: int

    @property
    def nf4(self) -> int:
        return sum(o * i for o, i in self.nf4_shapes)


def unit_gathered(unit: Unit, precision: str) -> float:
    """One unit's parameters gathered, in bytes (NF4 weights as held)."""
    dt = compute_dtype_bytes(precision)  # gathered in it, NF4 converted from it
    nf4 = sum(q.nf4_bytes(o * i, dt) for o, i in unit.nf4_shapes)
    return (unit.params - unit.nf4) * dt + nf4


def unit_frozen_held(unit: Unit, precision: str, shards: int = 1) -> float:
    """Bytes of one unit's frozen parameters as held, sharded over `shards` ranks."""
    frozen = unit.params - unit.trainable
    dense = frozen_bytes(frozen - unit.nf4, unit.frozen_fp32, precision) / shards
    dt = compute_dtype_bytes(precision)
    return dense + sum(q.nf4_bytes(o * i, dt, shards) for o, i in unit.nf4_shapes)


def _block_units(stack: Stack, shards: int) -> list[Unit]:
    """The blocks of `stack`: one kind, or two for a partially frozen stack (its frozen front
    and its trained rest). A LoRA block also holds its adapters (trainable, not in `params`)."""
    per_block = stack.layer_params or stack.block_params()
    linears = [o * i for o, i in q.block_linear_shapes(stack)]
    rest = max(per_block - sum(linears), 0)  # biases and norms
    tensors = tuple(linears) + ((rest,) if rest else ())
    norms = _block_fp32(stack)
    if stack.mode == "train" and stack.frozen_blocks is not None:
        front = stack.frozen_blocks
        units = [
            Unit(f"{stack.name} frozen block", "block", front, per_block, 0, norms, (), tensors, 2)
        ]
        units.append(Unit(f"{stack.name} block", "block", stack.layers - front, per_block, per_block,
                          0, (), tensors, 2))  # fmt: skip
        return [u for u in units if u.count]
    if stack.mode == "train":
        return [
            Unit(
                f"{stack.name} block",
                "block",
                stack.layers,
                per_block,
                per_block,
                0,
                (),
                tensors,
                2,
            )
        ]
    adapters = stack.lora_params() // stack.layers if stack.mode == "lora" else 0
    nf4 = tuple(q.nf4_weight_shapes(stack, shards))
    return [Unit(f"{stack.name} block", "block", stack.layers, per_block + adapters, adapters, norms,
                 nf4, tensors, 2)]  # fmt: skip


def _block_fp32(stack: Stack) -> int:
    """Parameters of one block held in fp32 when frozen under 16-bit autocast (its norms: the
    stack's fp32 parameters but the stem's, shared by its blocks; a few widths a block)."""
    if not stack.layers:
        return 0
    per_block = stack.layer_params or stack.block_params()
    rest = max(per_block - stack.block_params(), 0)
    return min(rest, max(stack.fp32_params - stack.stem_fp32_params, 0) // stack.layers)


def _outside_blocks(stack: Stack) -> int:
    """Parameters of `stack` outside its blocks (stem, final norm, head, merger...)."""
    per_block = stack.layer_params or stack.block_params()
    return max(stack.params - stack.layers * per_block, 0)


def embedding_table(stack: Stack) -> int:
    """Parameters of an untied decoder's input embedding (its own FSDP unit), else 0: untied
    when the parameters outside the blocks hold the table twice (embedding and head)."""
    if stack.kind != "decoder" or not stack.stem_params:
        return 0
    return stack.stem_params if _outside_blocks(stack) >= 2 * stack.stem_params else 0


def _frozen_outside(stack: Stack) -> tuple[int, int]:
    """(parameters, of them held in fp32 when frozen under 16-bit autocast) outside `stack`'s
    blocks that are frozen: all of a frozen or LoRA stack's; a partly frozen stack's stem,
    frozen with its first blocks (its final norm and head train); none of a trained one's."""
    if stack.mode != "train":
        fp32 = max(stack.fp32_params - stack.layers * _block_fp32(stack), 0)
        return _outside_blocks(stack), fp32
    if stack.frozen_blocks is None:
        return 0, 0
    return stack.stem_params, stack.stem_fp32_params


@lru_cache(maxsize=256)
def fsdp_units(model: PlanModel, shards: int = 1) -> tuple[Unit, ...]:
    """Every FSDP unit of `model` as apply_fsdp wraps it (blocks, embeddings, then the root),
    over `shards` ranks (which NF4 weights torchao can split)."""
    units: list[Unit] = []
    root_params = root_trainable = root_fp32 = 0
    root_tensors: list[int] = []
    for s in model.stacks:
        if s.layers:
            units += _block_units(s, shards)
        embedding = embedding_table(s)
        # frozen tables and norms outside the blocks stay fp32 under autocast (states.py)
        frozen, fp32 = _frozen_outside(s)
        if embedding:  # the stem: frozen whenever anything outside the blocks is
            trains = frozen < embedding
            units.append(Unit(f"{s.name} embedding", "embedding", 1, embedding, embedding if trains else 0,
                              0 if trains else embedding, (), (embedding,), 2 if trains else 1))  # fmt: skip
            frozen, fp32 = max(frozen - embedding, 0), max(fp32 - embedding, 0)
        outside = _outside_blocks(s) - embedding
        root_params += outside
        root_trainable += outside - min(frozen, outside)
        root_fp32 += min(fp32, outside)
        if outside:
            root_tensors.append(outside)
    root_params += model.head_params
    root_trainable += model.head_params
    if model.head_params:
        root_tensors.append(model.head_params)
    units.append(Unit("root", "root", 1, root_params, root_trainable, root_fp32, (),
                      tuple(root_tensors), 1))  # fmt: skip
    return tuple(units)


def host_param_bytes(unit: Unit, precision: str) -> float:
    """Bytes of one unit's parameters as the model holds them (what CPU offload keeps on the
    host and copies in for each all-gather): trained ones as the model's parameters are (fp32
    under autocast; 2 bytes for the bf16 modes), frozen ones as held (`unit_frozen_held`)."""
    return unit.trainable * trained_param_bytes(precision) + unit_frozen_held(unit, precision)


def trained_param_bytes(precision: str) -> int:
    """Bytes of a trained parameter as the model holds it: fp32 under torch autocast (bf16,
    fp16, fp8) and fp32; bf16 where the model itself is bf16 (bf16-weights, bf16-pure)."""
    return 2 if precision in BF16_MODEL else 4


def frozen_gathered_bytes(model: PlanModel, precision: str, shards: int = 1) -> float:
    """Bytes of `model`'s frozen parameters as all-gathered over `shards` ranks (compute dtype;
    NF4 as held)."""
    total = 0.0
    for u in fsdp_units(model, shards):
        frozen = u.params - u.trainable
        gathered = unit_gathered(u, precision) - u.trainable * compute_dtype_bytes(precision)
        total += u.count * (gathered if frozen else 0.0)
    return total
