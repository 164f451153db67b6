"""Activation memory: the bytes autograd keeps between forward and backward.

Per transformer layer we follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", arXiv 2205.05198, Table 2), itemised tensor by tensor so the same
terms can be checked against what PyTorch saves (train/measure_step.py). Per token, in elements:

    norm inputs 2h | qkv input h | q, k, v 3h | attention output h | fc1 input h |
    activation input f | fc2 input f                         (GELU MLP: 8h + 2f = 16h at f = 4h)

At 16-bit with dropout masks (1 byte each, after attention and MLP) this is Korthikanti's
`34 sbh`; mmtrain's blocks have no dropout, so 32 sbh. SwiGLU keeps fc1's 2f output, silu's
output and the product (h + 4f instead of h + 2f). Attention kernels add:
- math: the softmax output `a s^2 b` per layer (Korthikanti's quadratic term, without dropout);
- flash: only the fp32 log-sum-exp, `a s b` (the quadratic term is dropped);
- a padding mask (bidirectional text): `s b` fp32 per layer, the [b, 1, 1, s] additive mask
  SDPA makes of the boolean one (it broadcasts over heads and queries). A decoder's
  right-padded rows carry none (causal attention is exact for their real tokens);
- packed rows (block-diagonal attention): on CUDA flex attention, whose `BlockMask` is a few
  kilobytes per row (not counted); on the CPU (`dense_packed_mask`, the fallback of
  models/attention.py) SDPA's fp32 additive [b, 1, s, s] mask per layer.
Norms keep two fp32 statistics per token (LayerNorm) or one (RMSNorm).

A DiT block (adaLN-Zero, models/dit.py; `Stack.adaln`) keeps, besides these terms, what its
modulation needs for the gradients of its shift, scale and gate: both normalised copies (the
`(1 + scale)` product reads them; `norm_copy`, residual bytes: LayerNorm's output is fp32 under
autocast) and both branch outputs (the gate's product reads them), 4h per token, and per sample
the modulation Linear's input SiLU(c) and output (6h; the gates are views of it) and the two
`(1 + scale)` factors: 9h. Measured exact on the CPU (docs/PLANNER.md, "Denoisers").
An MMDiT's joint block (models/mmdit.py) keeps these over its image and text tokens together,
9h a sample per stream (`Stack.adaln_streams`), and the copy its output projections read of
the attention's merged heads; its last block less (`_pre_only_saving`). Measured exact on the
CPU in fp32 (tests/test_plan_dit.py); its q/k norms' tensors (`qk_norm`) are not counted.

A native-resolution vision tower (plan/native_vision.py; `Stack.gathered_attention`) attends
over gathered windows and frames: q, k and v are gathered copies (3h, what a fused projection
keeps) and the output is gathered back into patch order, a copy the output projection reads
(h more); quick_gelu keeps its sigmoid's output (f more); the gathers' int64 indices are kept
once for all blocks, without checkpointing only. Measured exact on the CPU in fp32.

Tensor parallel t divides everything except the norm inputs, qkv input and fc1 input (which
stay replicated: Korthikanti's "10" at 16-bit with dropout) unless Megatron's sequence
parallelism (`sp`) is on.

Sequence (context) parallelism over N ranks (`sequence_parallel`, train.sequence_parallel)
splits the token sequence of the decoder and denoiser stacks (`Stack.sequence_split`): each
rank keeps every per-token tensor of those stacks for T/N positions. The attention core sees
the full sequence for heads/N heads under all-to-all (DeepSpeed-Ulysses): its q, k, v, output
and log-sum-exp (or math softmax, heads/N x T x T) are the same element counts as T/N
positions of all heads; ring attention keeps its T/N queries' log-sum-exp and the local
k and v, and its per-block scores are transient (it is blockwise: no softmax or dense mask is
kept, whatever `attention` says). Per-sample tensors (a denoiser's conditioning, modulation,
class ids) are kept whole by every rank, as are the unsplit stacks (vision towers, projector).
The copies the all-to-alls may add around the kernel depend on the trainer's implementation
and are not counted.
Checkpointing: "selective" recomputes the attention sub-block (drops q/k/v, attention output,
softmax or lse, mask); "full" keeps only each block's input (h per token) and, during
backward, one block's activations are live again while it is recomputed.

Under bf16/fp16 autocast the residual stream (norm inputs) stays fp32 while the other tensors
are 16-bit copies; "residual bytes" and "activation bytes" are therefore kept apart. A model
that runs in bf16 itself (`bf16-weights`: DeepSpeed bf16, FSDP2 with bf16 parameters;
`bf16-pure`) keeps its residual stream in bf16 too: 2 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mmtrain.plan import preference as pref
from mmtrain.plan.model import FusionHead, PlanModel, Stack

FP32 = 4
BF16_MODEL = ("bf16-weights", "bf16-pure")  # the model runs in bf16: a 16-bit residual stream


@dataclass(frozen=True)
class ActivationOptions:
    """How activations are stored: bytes per element, kernel, checkpointing, parallelism."""

    act_bytes: int = 2  # 16-bit copies that matmuls and activations save
    residual_bytes: int = 4  # the residual stream (norm inputs): fp32 under autocast
    attention: str = "flash"
    ac: str = "none"
    tp: int = 1
    sp: bool = False
    dropout: bool = False
    dense_packed_mask: bool = False  # packed rows attend through a dense mask (the CPU's path)
    sequence_parallel: int = 1  # ranks splitting the sequence of the split stacks
    sp_attention: str = "all_to_all"  # their attention layout (resolved: all_to_all | ring)
    # "sft" a row a sample; "dpo" (plan/preference.py) two rows a pair, of which a native
    # VLM's vision stacks see the pair's inputs once, and at the LM head the chunked loss's
    # per-target NLL (a native decoder) or the whole logits and their log-softmax (a hub one)
    objective: str = "sft"


def activation_options(
    precision: str,
    attention: str,
    ac: str,
    tp: int,
    sp: bool,
    dense_packed_mask: bool = False,
    sequence_parallel: int = 1,
    sp_attention: str = "all_to_all",
    objective: str = "sft",
) -> ActivationOptions:
    """Byte sizes for a precision mode (fp8 keeps 16-bit activations: its casts are transient)."""
    act, residual = (4, 4) if precision == "fp32" else (2, 2 if precision in BF16_MODEL else 4)
    return ActivationOptions(
        act, residual, attention, ac, tp, sp, False, dense_packed_mask,
        sequence_parallel, sp_attention, objective,
    )  # fmt: skip


def split_degree(stack: Stack, o: ActivationOptions) -> int:
    """How many ranks share `stack`'s tokens: the sequence-parallel degree for a split stack
    (a decoder, a denoiser), 1 for the rest."""
    return o.sequence_parallel if stack.sequence_split else 1


def local_tokens(stack: Stack, o: ActivationOptions) -> float:
    """The tokens of `stack` one rank holds per sample (T/N for a split stack)."""
    return stack.tokens / split_degree(stack, o)


def _ring(stack: Stack, o: ActivationOptions) -> bool:
    """Ring attention over this stack's blocks (its scores and masks are per-block, transient)."""
    return split_degree(stack, o) > 1 and o.sp_attention == "ring"


def layer_terms(stack: Stack, micro_batch: int, o: ActivationOptions) -> dict[str, float]:
    """Bytes one layer keeps for `micro_batch` samples, itemised (without checkpointing)."""
    s, b, h, f, a = local_tokens(stack, o), micro_batch, stack.width, stack.mlp_hidden, stack.heads
    sb = s * b
    t = o.tp
    rep = t if o.sp else 1  # replicated terms are divided only under sequence parallelism
    inner = stack.heads * stack.head_dim  # the query heads' width (h unless head_dim is set)
    mlp = (2 * f + f + f) if stack.gated else (f + f + (f if stack.quick_gelu else 0))
    stats = (2 if stack.norm == "layernorm" else 1) * 2 * sb * FP32 / rep
    terms = {
        "norm_inputs": 2 * sb * h * o.residual_bytes / rep,
        "norm_stats": stats,
        "qkv_input": sb * h * o.act_bytes / rep,
        "qkv": sb * _qkv_elements(stack) * o.act_bytes / t,
        "attention_output": sb * inner * o.act_bytes / t,
        "mlp_input": sb * h * o.act_bytes / rep,
        "mlp_hidden": sb * mlp * o.act_bytes / t,
    }
    if stack.gathered_attention:  # the output gathered back into token order: a copy
        terms["attention_gathered"] = sb * inner * o.act_bytes / t
    if stack.norm_copy:
        terms["norm_copies"] = 2 * sb * h * o.residual_bytes / rep
    if stack.adaln:
        # adaLN-Zero (models/dit.py): each gate's product keeps its branch's output (the gate's
        # gradient reads it) and the modulation Linear's output (the gates are views of it);
        # per sample also the Linear's input SiLU(c) and the two (1 + scale) factors.
        terms["gated_outputs"] = 2 * sb * h * o.act_bytes / rep
        terms["modulation"] = b * (1 + 6 + 2) * h * o.act_bytes * stack.adaln_streams
        if stack.adaln_streams > 1:
            # An MMDiT's streams read SiLU(c) as one tensor, unless autocast gives each
            # modulation its own copy; its attention's output (laid out by head) is merged
            # into a copy whose two streams' slices the output projections read.
            if o.act_bytes >= o.residual_bytes:
                terms["modulation"] -= b * (stack.adaln_streams - 1) * h * o.act_bytes
            terms["attention_merged"] = sb * inner * o.act_bytes / t
    if o.attention == "flash" or _ring(stack, o):
        terms["attention_lse"] = a * sb * FP32 / t
    else:
        # windows: the keys of each query's group; else the whole row (all-to-all: full T)
        keys = stack.attention_span or stack.tokens
        terms["attention_softmax"] = a * keys * sb * o.act_bytes / t
        if o.dropout:
            terms["attention_softmax"] *= 2.5  # mask (1 byte) and dropout output (2 bytes)
    if stack.key_mask:
        terms["attention_mask"] = sb * FP32
    if stack.document_mask and o.dense_packed_mask and not _ring(stack, o):
        # SDPA turns the boolean block-diagonal mask into an fp32 additive one and keeps it
        # (under all-to-all over the full row: it broadcasts over the heads).
        terms["attention_mask"] = b * stack.tokens**2 * FP32
    if o.dropout:
        terms["dropout_masks"] = 2 * sb * h / rep
    if stack.mode == "lora":
        _lora_terms(terms, stack, b, s, o)
    return terms


def _qkv_elements(stack: Stack) -> int:
    """Per token, what attention keeps of q, k and v. Plain blocks: the fused projection's
    output (q, k and v are views of it). Rotary (decoder.py): the rotated copies of q and k
    and the projection's output (v is a view of it). Grouped-query attention keeps k and v
    `kv_heads` wide: the kernels take them grouped (models/attention.py: SDPA's
    `enable_gqa` on the CPU and in 16-bit on CUDA, flex attention); only fp32 on CUDA repeats
    them to every query head (2 (heads - kv_heads) head_dim more per token, not counted)."""
    kv = stack.kv_heads * stack.head_dim
    inner = stack.heads * stack.head_dim
    if not stack.rotary:
        return inner + 2 * kv
    return (inner + 2 * kv) + inner + kv


def _lora_first_layer_unsaved(stack: Stack, micro_batch: int, o: ActivationOptions) -> float:
    """What the first layer of a LoRA stack keeps less than the others: its input comes from a
    frozen stem without gradient, so its first norm keeps nothing; without attention adapters
    the whole attention sub-block and the second norm run without gradient too (under
    selective checkpointing the attention's terms are kept in no layer, and the first one's
    checkpoint drops its input: nothing in it needs a gradient)."""
    terms = layer_terms(stack, micro_batch, o)
    one_norm = terms["norm_inputs"] / 2 + terms["norm_stats"] / 2
    if stack.adaln:  # the first modulation's (1 + scale) multiplies a tensor without gradient
        one_norm += micro_batch * stack.width * o.act_bytes
    if "attn" in stack.lora_targets:
        return one_norm
    if o.ac == "selective":
        rep = o.tp if o.sp else 1
        return 2 * one_norm + local_tokens(stack, o) * micro_batch * stack.width * o.act_bytes / rep
    attention = ("qkv", "attention_output", "attention_gathered", "attention_lse",
                 "attention_softmax", "attention_mask")  # fmt: skip
    return 2 * one_norm + sum(terms.get(k, 0.0) for k in attention)


def _lora_terms(
    terms: dict[str, float], stack: Stack, b: float, s: float, o: ActivationOptions
) -> None:
    """A LoRA layer (train/lora.py) keeps what a trained one does, less the inputs of frozen
    linears that have no adapter (a frozen weight's backward needs only the weight), plus each
    adapter's rank-r intermediate A x, which B's matmul saves. An adapted linear's input is
    kept all the same: A's weight gradient reads it. (The attention output stays: the
    attention kernel keeps it for its own backward, and the output projection reads a view.)
    `b` samples of `s` tokens on this rank."""
    sb = b * s
    adapted = 0
    if "attn" not in stack.lora_targets:
        terms["qkv_input"] = 0.0
        terms.pop("attention_gathered", None)  # the frozen output projection's input
    else:
        adapted += 2
    terms.pop("norm_copies", None)  # a frozen norm weight's backward needs no normalised copy
    if stack.adaln:  # frozen modulation: the gates and scales need no gradient
        terms.pop("gated_outputs")
        terms["modulation"] -= b * stack.width * o.act_bytes  # SiLU(c)
    if "mlp" not in stack.lora_targets:
        terms["mlp_input"] = 0.0
        terms["mlp_hidden"] -= sb * stack.mlp_hidden * o.act_bytes / o.tp  # fc2's input
    else:
        adapted += 2
    terms["lora_intermediate"] = adapted * sb * stack.lora_rank * o.act_bytes / o.tp


_SELECTIVE_DROPS = (
    "qkv",
    "attention_output",
    "attention_gathered",
    "attention_merged",
    "attention_lse",
    "attention_softmax",
    "attention_mask",
)


def layer_bytes(stack: Stack, micro_batch: int, o: ActivationOptions) -> float:
    """Bytes one layer keeps under the checkpointing mode `o.ac`."""
    sb = local_tokens(stack, o) * micro_batch
    if o.ac == "full":
        return sb * stack.width * o.residual_bytes / (o.tp if o.sp else 1)
    terms = layer_terms(stack, micro_batch, o)
    if o.ac == "selective":
        kept = {k: v for k, v in terms.items() if k not in _SELECTIVE_DROPS}
        if stack.mode == "lora":
            # The checkpointed attention keeps its input, adapted or not, and recomputes its
            # adapters' rank-r intermediates (q/k/v and output projection).
            kept["qkv_input"] = sb * stack.width * o.act_bytes / (o.tp if o.sp else 1)
            if "attn" in stack.lora_targets:
                r = stack.lora_rank
                kept["lora_intermediate"] -= 2 * sb * r * o.act_bytes / o.tp
        return sum(kept.values())
    return sum(terms.values())


def _pre_only_saving(stack: Stack, micro_batch: float, o: ActivationOptions) -> float:
    """What an MMDiT's last block keeps less than a joint block (models/mmdit.py): its text
    stream ends at the attention (no second norm, MLP or gates; its modulation, of which only
    one (1 + scale) is kept, 7h a sample less), and only the image tokens query: no attention
    output or statistics for the text, and the image's q is a view of its q/k/v output (kept
    whole, 3h a token, beside the joined k and v), so the output is laid out by token and the
    output projection reads a view of it (no merged copy)."""
    if o.ac == "full":
        return 0.0  # every block keeps its input: image and text tokens alike
    split = split_degree(stack, o)  # the per-token terms at this rank's share of the tokens
    n, b, h, f = stack.pre_only_tokens / split, micro_batch, stack.width, stack.mlp_hidden
    t, rep = (stack.tokens - stack.pre_only_tokens) / split, o.tp if o.sp else 1
    text = n * b * (2 * h * o.residual_bytes + 2 * FP32) / rep  # second norm: input, stats, copy
    text += n * b * (h / rep + 2 * f / o.tp + 2 * h / rep) * o.act_bytes  # MLP input, MLP, gates
    text += b * 7 * h * o.act_bytes  # its modulation's 6h and one (1 + scale)
    if o.ac == "selective":
        return text  # the attention's saved tensors are recomputed, in every block alike
    attention = n * b * (h * o.act_bytes + stack.heads * FP32) / o.tp  # text rows: output, lse
    merged = (t + n) * b * h * o.act_bytes / o.tp
    qkv = b * (n * h - 2 * t * h) * o.act_bytes / o.tp  # 3h (t + n) joined -> 5h t + 2h n
    return text + attention + merged + qkv


def _loss_bytes(stack: Stack, micro_batch: float, o: ActivationOptions) -> float:
    """The next-token loss keeps the int64 targets of the scored rows (each row's ids but the
    last, whose target is outside the row). No logits and no log-softmax: the head and the
    cross-entropy run a chunk of positions at a time and are recomputed in backward
    (models/token_loss.py); what they keep is the head's input, counted with the stem. One
    chunk's working set is live at a time (`loss_chunk_bytes`)."""
    return micro_batch * scored_rows(stack, o) * 8


def scored_rows(stack: Stack, o: ActivationOptions) -> float:
    """Per sample, the positions one rank's LM head scores: each text id but the last or,
    when the stack is split over ranks, every position this rank holds (models/vlm.py's
    `_split_nll_sum`: the positions that predict an id are not evenly spread over the ranks,
    so the head runs on each and the non-targets are ignored)."""
    if split_degree(stack, o) > 1:
        return local_tokens(stack, o)
    return (stack.logit_rows or stack.tokens) - 1


def loss_chunk_bytes(stack: Stack, micro_batch: float, o: ActivationOptions) -> float:
    """The chunked loss's transient working set, one chunk at a time (in forward, and again
    in backward while a chunk is recomputed): its logits in the activation dtype, their fp32
    copy and log-softmax, and the fp32 gradient of the logits, for
    `token_loss.CHUNK_ELEMENTS` logits (fewer when the micro-batch has fewer)."""
    chunk_elements = 2**26  # models/token_loss.py's CHUNK_ELEMENTS (the planner imports no torch)
    scored = micro_batch * scored_rows(stack, o) * stack.vocab
    return min(chunk_elements, scored) * (o.act_bytes + 3 * FP32) / o.tp


@dataclass(frozen=True)
class StackActivations:
    layers_bytes: float  # all layers of the stack on this GPU
    stem_bytes: float  # stem, pre/final norms, pooling
    logits_bytes: float  # LM-head logits (decoders)
    recompute_bytes: float  # one layer live again during backward (full checkpointing)

    @property
    def saved(self) -> float:
        return self.layers_bytes + self.stem_bytes + self.logits_bytes


def _frozen_layer_terms(stack: Stack, micro_batch: float, o: ActivationOptions) -> dict[str, float]:
    """A frozen block whose input needs a gradient (a VLM's decoder behind a trained projector,
    frozen or not) keeps what the input's gradient needs: norm inputs and statistics,
    attention's q, k, v, output and statistics, the MLP activation's input (and, gated, its
    output); not the inputs of its frozen linears or the normalised copies its frozen norm
    weights scale (a frozen weight's backward reads only the weight). Itemised, without
    checkpointing."""
    terms = layer_terms(stack, micro_batch, o)
    sb = micro_batch * local_tokens(stack, o)
    f = sb * stack.mlp_hidden * o.act_bytes / o.tp
    terms["mlp_hidden"] = 3 * f if stack.gated else (2 * f if stack.quick_gelu else f)
    for name in ("qkv_input", "mlp_input", "norm_copies", "lora_intermediate",
                 "attention_gathered"):  # fmt: skip
        terms.pop(name, None)
    if stack.rotary and split_degree(stack, o) > 1 and not _ring(stack, o):
        # all-to-all: the kernel keeps the exchanged q, k and v; nothing keeps the rotated
        # copies before the exchange (rotary's products keep only the tables) or the
        # projection's output (v's exchange copies it; the frozen projection reads no output).
        kv = stack.kv_heads * stack.head_dim
        terms["qkv"] = sb * (stack.heads * stack.head_dim + 2 * kv) * o.act_bytes / o.tp
    return terms


def frozen_layer_bytes(stack: Stack, micro_batch: float, o: ActivationOptions) -> float:
    """Bytes a frozen block on the gradient's path keeps under the checkpointing mode `o.ac`:
    "full" its input, as a trained block; "selective" its terms less the attention's, plus
    the checkpointed attention's input (the first norm's output, which the frozen q/k/v
    projection alone would not keep)."""
    sb = local_tokens(stack, o) * micro_batch
    rep = o.tp if o.sp else 1
    if o.ac == "full":
        return sb * stack.width * o.residual_bytes / rep
    terms = _frozen_layer_terms(stack, micro_batch, o)
    if o.ac == "selective":
        kept = {k: v for k, v in terms.items() if k not in _SELECTIVE_DROPS}
        kept["qkv_input"] = sb * stack.width * o.act_bytes / rep
        return sum(kept.values())
    return sum(terms.values())


def _per_sample_stem_bytes(stack: Stack, micro_batch: float, o: ActivationOptions) -> float:
    """Of what a split stack keeps outside its blocks, the per-sample part every sequence-
    parallel rank keeps whole: a denoiser's stem inputs, unless its stem is frozen (the noisy
    sample and an MMDiT's text, read by the projections before the tokens are split; the
    timestep and pooled-text MLPs' tensors and c; c alone under full checkpointing then), its
    final layer's SiLU(c) (not when LoRA freezes the layer) and (1 + scale), and its class ids.
    A decoder keeps nothing per row that is not per position."""
    if not stack.adaln:
        return 0.0
    frozen_stem = stack.mode == "lora" or stack.frozen_blocks is not None
    floats = stack.width if stack.mode == "lora" else 2 * stack.width  # the final layer
    ints = stack.stem_int64
    if frozen_stem:
        floats += stack.width if o.ac == "full" else 0
        ints -= stack.stem_input_int64
    else:
        floats += stack.stem_input_elements
    return micro_batch * (floats * o.act_bytes + ints * 8)


def stack_activations(
    stack: Stack,
    micro_batch: int,
    o: ActivationOptions,
    pp: int = 1,
    pp_microbatches: int = 1,
    input_grad: bool = False,
) -> StackActivations:
    """Activations of one stack on one GPU.

    `input_grad`: a gradient flows into the stack's input from a trained stack before it (a
    VLM's decoder behind a trained projector or image tower). Autograd then keeps, in every
    block the gradient passes through, what that gradient needs, trained or frozen: a frozen
    stack on the gradient's path keeps `frozen_layer_bytes` per block (LLaVA's stage 1: the
    frozen LM behind the trained projector), and so do the frozen front blocks of a partially
    frozen stack; a LoRA stack's first block keeps its full terms. A frozen stack with nothing
    trained before it runs without autograd and keeps nothing (its transient working set is in
    the recompute/working term).

    Pipeline parallel p: the first 1F1B stage holds p micro-batches of L/p layers, i.e. one
    micro-batch of the whole stack, scaled by min(1, m/p) (Megatron-LM).
    """
    rows = micro_batch
    # a VLM's image tower sees images, not rows; under DPO a native one each pair's once
    micro_batch = micro_batch * stack.per_sample * pref.row_share(stack, o.objective)
    if stack.traced is not None:  # a hub model's tower: priced from its trace (plan/hub.py)
        from mmtrain.plan.hub import traced_activations

        working = head_working_bytes(stack, micro_batch, o)
        traced = traced_activations(stack, micro_batch, o, working)
        if stack.vocab and o.objective == "dpo":  # the trace counted the loss's targets
            return replace(traced, logits_bytes=pref.token_nll_bytes(stack, micro_batch))
        return traced
    working = layer_bytes(stack, micro_batch, ActivationOptions(**{**o.__dict__, "ac": "none"}))
    frozen = stack.mode == "frozen"
    if frozen and not input_grad:
        return StackActivations(0, 0, 0, working)
    in_flight = min(1.0, pp_microbatches / pp) if pp > 1 else 1.0
    # Blocks that train, and frozen ones the gradient passes through (frozen front blocks
    # before which nothing trains keep nothing).
    trained = 0 if frozen else stack.layers * stack.trained_layer_share()
    passed = 0
    if input_grad:
        passed = stack.layers if frozen else stack.frozen_blocks or 0
    layers = trained * layer_bytes(stack, micro_batch, o) * in_flight
    if stack.pre_only_tokens and trained:  # an MMDiT's last block (always a trained one)
        layers -= _pre_only_saving(stack, micro_batch, o) * in_flight
    if passed:
        layers += passed * frozen_layer_bytes(stack, micro_batch, o) * in_flight
    if frozen:  # the block live again while it is recomputed is a frozen one
        working = frozen_layer_bytes(
            stack, micro_batch, ActivationOptions(**{**o.__dict__, "ac": "none"})
        )
    floats, ints = stack.stem_elements, stack.stem_int64
    if frozen or stack.mode == "lora" or stack.frozen_blocks is not None:  # a frozen stem
        floats, ints = floats - stack.stem_input_elements, ints - stack.stem_input_int64
        if stack.adaln and o.ac == "full":
            floats += stack.width  # the conditioning vector: every checkpointed block's input
        if input_grad and stack.kind == "decoder":
            ints += stack.tokens  # the splice index: the image tokens' gradient reads it
    if stack.group_index_int64 and o.ac == "none" and (trained or stack.mode == "lora"):
        ints += stack.group_index_int64  # the gathers' indices, kept once for all blocks
    stem = micro_batch * (floats * o.act_bytes + ints * 8 + stack.stem_fp32 * FP32)
    if frozen or stack.mode == "lora":
        stem -= micro_batch * stack.proj_input_elements * o.act_bytes  # a frozen projection
    if stack.mode == "lora":
        if o.ac != "full" and not input_grad:
            layers -= _lora_first_layer_unsaved(stack, micro_batch, o) * in_flight
    split = split_degree(stack, o) > 1
    if split:  # each rank keeps its share of the per-token tensors
        whole = _per_sample_stem_bytes(stack, micro_batch, o)
        stem = whole + (stem - whole) / split_degree(stack, o)
        if stack.vocab:  # the head reads the final norm's output itself, not a gathered copy
            stem -= (
                micro_batch
                * ((stack.logit_rows or stack.tokens) - 1)
                * stack.width
                * (o.act_bytes / split_degree(stack, o))
            )
    if stack.document_mask and o.dense_packed_mask and o.ac != "none" and not split:
        # the boolean [b, 1, s, s] mask is an input of every checkpointed block (kept once);
        # a split stack's attention kernel holds it instead (train/sequence_parallel.py)
        stem += micro_batch * stack.tokens**2
    if o.objective == "dpo" and pref.shares_inputs(stack):  # each row takes the pair's output
        stem += pref.taken_index_bytes(stack, rows)
    logits = head_kept_bytes(stack, micro_batch, o)
    recompute = working if o.ac != "none" else 0
    # the loss's working set is live before any block is recomputed: the larger
    recompute = max(recompute, head_working_bytes(stack, micro_batch, o))
    return StackActivations(layers, stem, logits, recompute)


def head_kept_bytes(stack: Stack, micro_batch: float, o: ActivationOptions) -> float:
    """What the objective keeps at an LM head's rows until the backward (0 without a head): the
    next-token loss its int64 targets; DPO (plan/preference.py) those and the per-target NLL
    of the same chunked head."""
    if not stack.vocab:
        return 0.0
    if o.objective == "dpo":
        return _loss_bytes(stack, micro_batch, o) + pref.token_nll_bytes(stack, micro_batch)
    return _loss_bytes(stack, micro_batch, o)


def head_working_bytes(stack: Stack, micro_batch: float, o: ActivationOptions) -> float:
    """The transient working set at an LM head (0 without one): one chunk of the next-token
    loss (with DPO, beside the gradient of the per-target NLL its chunks read)."""
    if not stack.vocab:
        return 0.0
    chunk = loss_chunk_bytes(stack, micro_batch, o)
    if o.objective == "dpo":
        return chunk + pref.token_nll_gradient_bytes(stack, micro_batch)
    return chunk


def fusion_bytes(model: PlanModel, micro_batch: int, o: ActivationOptions) -> float:
    """What the cross-attention fusion head (models/heads.py) keeps for `micro_batch` samples.

    Per sample, with Q queries, M memory tokens (all fused towers), width w, MLP hidden f,
    h heads, in the activation dtype unless marked fp32:
    - once: each fused tower's final tokens as its input projection reads them (unless the
      tower's own pooling already keeps that very tensor), the concatenated memory M w;
    - per block: the memory's norm statistics 2M (fp32) and normalised copy M w, its k/v 2M w,
      the padding mask M (fp32, when a fused tower is text), the queries' norm input Q w (not
      in the first block: there it is the learned parameter) and statistics, q input and
      output 2Q w, attention output Q w and log-sum-exp h Q (fp32; math attention: the
      softmax h Q M instead of the log-sum-exp), MLP norm input and statistics, fc1 input
      Q w, GELU input and output 2Q f;
    - the final norm's input and statistics, and the pooled vector w the output layer reads.
    The head is not checkpointed (train/parallel.py wraps tower blocks only) and is replicated
    under tensor parallelism (it is small).
    """
    f: FusionHead | None = model.fusion
    if f is None:
        return 0.0
    b, a, w, q = micro_batch, o.act_bytes, f.width, f.queries
    fused = [model.stack(name) for name in f.towers]
    m = sum(s.tokens for s in fused)
    total = 0.0
    for s in fused:
        # Under autocast the projection saves a fresh 16-bit copy; in one dtype it shares the
        # storage the tower's pooling/projection already keeps (cls, last and map pooling).
        shared = s.keeps_final_tokens and s.mode != "frozen" and o.act_bytes == o.residual_bytes
        if not shared:
            total += s.tokens * s.width * a
    total += m * w * a  # the concatenated memory
    stats = 2 * FP32
    block = m * (stats + 3 * w * a) + q * (stats + 2 * w * a + w * a) + q * (stats + w * a)
    block += q * w * a + 2 * q * f.mlp_hidden * a  # fc1 input, GELU input and output
    if any(s.padded for s in fused):
        block += m * FP32
    if o.attention == "flash":
        block += f.heads * q * FP32
    else:
        block += f.heads * q * m * a
    total += f.layers * block + (f.layers - 1) * q * w * a  # queries' norm input after block 0
    total += q * (w * a + stats) + w * a
    return b * total


def fusion_loss_bytes(model: PlanModel, micro_batch: int) -> float:
    """The fusion objective: cross-entropy keeps the fp32 log-softmax and the int64 labels;
    MSE keeps the prediction and the target."""
    f = model.fusion
    if f is None:
        return 0.0
    if f.task == "classify":
        return micro_batch * (f.num_outputs * FP32 + 8)
    return 2 * micro_batch * f.num_outputs * FP32


def regression_loss_bytes(model: PlanModel, micro_batch: float) -> float:
    """A denoiser's MSE (train/diffusion.py) keeps the fp32 error and the per-sample weight
    (`loss_fp32_elements` per sample)."""
    return micro_batch * model.loss_fp32_elements * FP32


def contrastive_bytes(model: PlanModel, micro_batch: int, dp: int) -> float:
    """Loss-side activations: per tower the normalised embedding (input and output), per pair
    the gathered rows (2 b E) and four B_local x B_global fp32 matrices (logits and
    log-softmax, both directions), as the local-loss variant keeps them. Without pairs (a
    fusion-only model) the towers still normalise their embeddings: input and norm, b (E + 2)."""
    b, e, g = micro_batch, model.embed_dim, micro_batch * dp
    if model.language_model:
        return 0.0  # the next-token loss is the decoder stack's (stack_activations)
    if not model.pairs:
        trainable = sum(1 for s in model.stacks if s.kind == "encoder" and s.mode != "frozen")
        return FP32 * trainable * b * (e + 2)
    towers = sum(1 for s in model.stacks if s.kind == "encoder")
    per_tower = 2 * b * e + (dp - 1) * b * e  # + gathered embeddings of the other ranks
    per_pair = 2 * b * e + 4 * b * g
    return FP32 * (towers * per_tower + model.pairs * per_pair)
