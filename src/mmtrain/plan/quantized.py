"""QLoRA's frozen base in 4-bit NF4, as torchao's `NF4Tensor` lays it out (Dettmers et al. 2023).

A LoRA tower trained with `train.towers.NAME.lora.quantize_base: nf4` (`mmtrain plan --qlora
NAME`) holds the weight of every linear of its blocks (`attn.qkv`, `attn.out`, `mlp.fc1`,
`mlp.fc2`, and a DiT block's adaLN modulation; the ones its adapters wrap and the others,
train/qlora.py) as torchao's NF4 tensor, converted from the compute dtype (`to_nf4(weight)`:
block size 64, scaler block size 256). For a weight of
N elements in a dtype of s bytes that tensor keeps (torchao
quantization/quantize_/workflows/nf4/nf4_tensor.py, `NF4Tensor.from_tensor`):
- `quantized_data`: two 4-bit codes a byte, N / 2 bytes;
- `quantized_scalers`: each 64-weight block's absmax, less their mean, as int8: N / 64 bytes;
- `quantization_factor`: one per 256 scalers, in the weight's dtype: N / (64 x 256) x s bytes;
- `scaler_mean` (one value) and the 16-entry `nf4` code table, in the weight's dtype: 17 s bytes.
About 4.13 bits a weight (4.127 for bf16). torchao refuses a weight whose elements are not a
multiple of 64 x 256 (its scalers must fill whole scaler blocks: Qwen2.5-VL-3B/7B's vision MLP,
1280 x 3420, is not), and under FSDP2 each rank's rows must hold whole blocks too (no vision
linear of the 72B does over 8 ranks): such a linear is planned in the compute dtype,
as a LoRA base (`unquantized_linears`), and the plan says so, as train/qlora.py keeps it.

Everything else of the tower (biases, norms, embeddings, the head, the vision tower's patch
projection and merger) stays as a LoRA base holds it (states.py: the compute dtype for linear
and convolution weights, fp32 for the rest under 16-bit autocast). Under FSDP2 the NF4 tensor
is sharded like any parameter (torchao implements FSDP2's all-gather hooks for it): each rank
holds 1/dp of the data, scalers and factors, and the table and mean whole.

A forward (and each backward) dequantizes one weight at a time to the compute dtype: the largest
NF4 linear in the compute dtype is a transient working set (`dequantized_bytes`).
"""

from __future__ import annotations

from mmtrain.plan.model import Stack

NF4_BLOCK = 64  # torchao to_nf4's block_size: weights sharing one absmax scaler
NF4_SCALER_BLOCK = 256  # scaler_block_size: scalers sharing one quantization factor
NF4_TABLE = 16  # entries of the NF4 code table, kept in the weight's dtype


def quantizable(rows: int, columns: int, shards: int = 1) -> bool:
    """Whether torchao holds a rows x columns weight in NF4 split by rows over `shards` ranks
    (FSDP2's shards; 1 without): rows that divide evenly, and each rank's share a whole number
    of scaler blocks (as train/qlora.py's `quantizable` decides)."""
    if rows % shards:
        return False
    return rows // shards * columns % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0


def nf4_bytes(numel: int, dtype_bytes: int, shards: int = 1) -> float:
    """Bytes one rank holds of an NF4 weight of `numel` elements converted from a dtype of
    `dtype_bytes` bytes, sharded over `shards` ranks (the codes, scalers and factors split; the
    mean and the code table whole on every rank)."""
    sharded = numel / 2 + numel / NF4_BLOCK + numel / (NF4_BLOCK * NF4_SCALER_BLOCK) * dtype_bytes
    return sharded / shards + (1 + NF4_TABLE) * dtype_bytes


def block_linear_shapes(stack: Stack) -> list[tuple[int, int]]:
    """(out, in) of the linear weights of one block of `stack` (models/layers.py, decoder.py,
    native_vision.py, dit.py): the fused q/k/v projection, the attention output, fc1 (gate and
    value together in a gated MLP), fc2, and a DiT block's adaLN modulation (shift, scale and
    gate of both branches), once per stream of an MMDiT block. Their elements add up to
    `Stack.block_params`."""
    if stack.traced is not None:  # a hub block's own linears (plan/hub.py)
        return [(o, i) for _, o, i in stack.traced.linears]
    w, f = stack.width, stack.mlp_hidden
    inner = stack.heads * stack.head_dim
    shapes = [(inner + 2 * stack.kv_heads * stack.head_dim, w), (w, inner)]
    shapes += [((2 if stack.gated else 1) * f, w), (w, f)]
    if stack.adaln:
        shapes.append((6 * w, w))
    return shapes * stack.adaln_streams


def nf4_weight_shapes(stack: Stack, shards: int = 1) -> list[tuple[int, int]]:
    """The linears of one block that a QLoRA stack holds in NF4 when FSDP2 splits them over
    `shards` ranks (those torchao accepts)."""
    if stack.quantize_base != "nf4" or stack.mode != "lora":
        return []
    return [s for s in block_linear_shapes(stack) if quantizable(*s, shards)]


def nf4_params(stack: Stack, shards: int = 1) -> int:
    """Weights of `stack` held in NF4 (every block's quantizable linears)."""
    return stack.layers * sum(o * i for o, i in nf4_weight_shapes(stack, shards))


def unquantized_linears(stack: Stack, shards: int = 1) -> list[tuple[int, int]]:
    """Block linears of a QLoRA stack that torchao cannot quantize (kept in the compute dtype)."""
    if stack.quantize_base != "nf4" or stack.mode != "lora":
        return []
    return [s for s in block_linear_shapes(stack) if not quantizable(*s, shards)]


def nf4_stack_bytes(stack: Stack, dtype_bytes: int, shards: int = 1) -> float:
    """Bytes one rank holds of `stack`'s NF4 weights (every block, sharded over `shards`)."""
    shapes = nf4_weight_shapes(stack, shards)
    return stack.layers * sum(nf4_bytes(o * i, dtype_bytes, shards) for o, i in shapes)


def dequantized_bytes(stack: Stack, dtype_bytes: int, shards: int = 1) -> float:
    """The transient working set of a QLoRA stack: its largest NF4 weight in the compute dtype
    (dequantized for one matmul at a time, forward and backward)."""
    shapes = nf4_weight_shapes(stack, shards)
    return max((o * i for o, i in shapes), default=0) * dtype_bytes
