"""What the planner sees of a model: a list of transformer stacks with their sizes and counts.

A `ModelSpec` (encoder towers) becomes one `Stack` per tower, taking parameters, tokens and
forward FLOPs from spec.py's counts; a language model its decoder (and vision tower and
projector, or a native-resolution tower with its merger: native_vision.py); a denoiser (spec.denoiser) one "diffusion" stack. Workload presets without a spec
(some diffusion transformers, a document model; see workloads.py) build stacks directly from
their published shapes. Everything downstream (memory, time, inference) reads stacks only, so
every kind of model is planned alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from mmtrain.denoiser_spec import TIMESTEP_FREQUENCIES
from mmtrain.hub_spec import TowerTrace
from mmtrain.plan import native_vision as nv
from mmtrain.spec import (
    DENOISER_PART,
    PROJECTOR_PART,
    VISION_TOWER,
    FusionSpec,
    ImageStem,
    ModelSpec,
    TextStem,
    TimeSeriesStem,
    TowerSpec,
    VideoStem,
)
from mmtrain.structured import FieldError, check_choice

MODES = ("train", "frozen", "lora")
# Stacks whose token sequence sequence parallelism (train.sequence_parallel) splits: a
# decoder's positions (images spliced in) and a denoiser's patches (and an MMDiT's text).
SEQUENCE_SPLIT_KINDS = ("decoder", "diffusion")
LORA_TARGETS = ("attn", "mlp")  # as train/lora.py's TARGET_LAYERS (plan imports no torch)
QUANTIZE_BASE = ("nf4",)  # train.towers.NAME.lora.quantize_base (plan/quantized.py)


@dataclass(frozen=True)
class Stack:
    """One transformer stack (a tower, a decoder, a DiT) and how it is trained.

    `tokens` is the sequence length per sample; `forward_flops` is per sample (2 x multiply-adds);
    `stem_elements` counts the non-block tensors autograd keeps per sample (input pixels,
    pre/final norm inputs, pooled token; see activations.py), `stem_int64` the integer ones.
    """

    name: str
    kind: str  # encoder | decoder | diffusion (a DiT) | projector
    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_hidden: int
    params: int
    forward_flops: int
    tokens: int
    gated: bool = False  # SwiGLU-style MLP (three f-wide matrices)
    norm: str = "layernorm"
    causal: bool = False
    key_mask: bool = False  # builds a padding mask per layer (bidirectional text)
    vocab: int = 0  # LM-head logits per token (decoders that predict tokens)
    mode: str = "train"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("attn", "mlp")  # train/lora.py's TARGET_LAYERS groups
    # QLoRA: the LoRA targets' frozen weights held quantized ("nf4": torchao's NF4 tensor,
    # train.towers.NAME.lora.quantize_base; plan/quantized.py); None: in the compute dtype.
    quantize_base: str | None = None
    stem_elements: int = 0
    stem_int64: int = 0
    padded: bool = False  # sequences carry padding (text): readers of its tokens need a mask
    keeps_final_tokens: bool = False  # pooling/projection saves the final norm's output
    unused_params: int = 0  # weights no loss reaches (no gradient, no optimizer state)
    # Partial freezing (train.towers.NAME.freeze_blocks / unlocked_blocks): None trains the whole
    # stack; N >= 0 freezes the stem (with norm_pre) and the first N blocks.
    frozen_blocks: int | None = None
    stem_params: int = 0  # stem and norm_pre: what partial freezing freezes besides blocks
    layer_params: int = 0  # one block, norms and biases included (exact, unlike block_params)
    stem_input_elements: int = 0  # of stem_elements: what a frozen stem no longer keeps
    stem_input_int64: int = 0
    proj_input_elements: int = 0  # of stem_elements: what a frozen projection does not keep
    # Of `params`, those the trainer keeps in fp32 when they are frozen under 16-bit autocast
    # (embedding and position tables, class tokens, norms: not a linear or convolution weight,
    # held in the compute dtype, train/model_setup.py), and of them the stem's and norm_pre's.
    fp32_params: int = 0
    stem_fp32_params: int = 0
    source: str = ""
    # Language models (decoder.py, vlm.py): how the module's own code keeps activations.
    per_sample: float = 1.0  # inputs of this stack per sample (images per row of a VLM)
    # Where DPO's rows share a native VLM's images (plan/preference.py): per input of this
    # stack, the int64 index each row takes the stack's output by (vlm.py `_image_embeds`: one
    # an image; visual_inputs.py `_taken`: one a merged token of a row's inputs)
    taken_index_int64: int = 0
    norm_copy: bool = False  # the (unfused) RMSNorm also keeps its normalised input
    rotary: bool = False  # q and k are rotated copies (rotary positions)
    document_mask: bool = False  # packed rows: an fp32 [b, 1, s, s] additive mask per layer
    logit_rows: int = 0  # rows of logits per sample (0: tokens); the loss scores rows - 1
    tied_head: bool = False  # the LM head is the token embedding (frozen with the stem)
    # Diffusion transformers (dit.py): adaLN-Zero conditioning per block (see activations.py).
    adaln: bool = False
    # An MMDiT (mmdit.py): two streams of weights per block (the image's, the text's), and the
    # last block's text stream, of `pre_only_tokens` tokens, ends at the attention.
    adaln_streams: int = 1
    pre_only_tokens: int = 0
    # A native-resolution vision tower (native_vision.py): attention over gathered groups
    # (windows, frames) whose output is gathered back (a copy the output projection reads),
    # keys per query of those groups (0: all tokens), quick_gelu's kept sigmoid, and what it
    # keeps outside its blocks in float32 (rotary tables) and as int64 gather indices shared
    # by its blocks (kept without checkpointing only).
    gathered_attention: bool = False
    attention_span: float = 0.0
    quick_gelu: bool = False
    stem_fp32: int = 0
    group_index_int64: int = 0
    # A denoiser under sequence parallelism: the elements of its output patches per sample,
    # which the ranks all-gather once per forward.
    output_elements: int = 0
    # A hub model's tower (plan/hub.py): what the trace counted, per row (its activations are
    # priced from it), and one block's linears as (group, out, in) (what LoRA adapts).
    traced: TowerTrace | None = None

    @property
    def sequence_split(self) -> bool:
        """Whether sequence parallelism splits this stack's tokens over its ranks."""
        return self.kind in SEQUENCE_SPLIT_KINDS and self.traced is None  # native-only

    def block_params(self) -> int:
        """Parameters of one block (what ZeRO-3 gathers at a time)."""
        attn = (
            self.width * self.heads * self.head_dim * 2
            + 2 * self.width * self.kv_heads * self.head_dim
        )
        mlp = (3 if self.gated else 2) * self.width * self.mlp_hidden
        modulation = 6 * self.width * self.width if self.adaln else 0  # shift, scale, gate x 2
        return (attn + mlp + modulation) * self.adaln_streams

    def lora_params(self) -> int:
        """Adapter parameters at rank r of every block: r x (in + out) per adapted linear, on
        the fused q/k/v projection and the attention output ("attn"), fc1 and fc2 ("mlp"; a
        gated fc1 yields gate and value, 2f). The same layers and shapes as train/lora.py's
        default targets, so `mmtrain plan --lora` counts what a LoRA run trains."""
        w, f, r = self.width, self.mlp_hidden, self.lora_rank
        if self.traced is not None:  # a hub block's own linears, by group
            dims = sum(o + i for g, o, i in self.traced.linears if g in self.lora_targets)
            return self.layers * r * dims
        inner = self.heads * self.head_dim
        per_block = 0
        if "attn" in self.lora_targets:
            qkv_out = inner + 2 * self.kv_heads * self.head_dim
            per_block += (w + qkv_out) + (inner + w)
        if "mlp" in self.lora_targets:
            per_block += (w + (2 if self.gated else 1) * f) + (f + w)
        return self.layers * r * per_block

    def front_frozen_params(self) -> int:
        """Parameters partial freezing freezes: the stem and the first `frozen_blocks` blocks."""
        if self.frozen_blocks is None:
            return 0
        return self.stem_params + self.frozen_blocks * self.layer_params

    def trainable_params(self) -> int:
        """Parameters that get gradients and optimizer states."""
        if self.mode == "train":
            return self.params - self.frozen_params()
        return 0 if self.mode == "frozen" else self.lora_params()

    def frozen_params(self) -> int:
        """Parameters held as weights only: a frozen or LoRA base stack, unused ones, or the
        front of a partially frozen stack."""
        if self.mode != "train":
            return self.params
        return min(self.params, self.unused_params + self.front_frozen_params())

    def frozen_fp32_params(self) -> int:
        """Of `frozen_params`, those held in fp32 under 16-bit autocast: all of a frozen or
        LoRA stack's `fp32_params`, or the stem's of a partially frozen one (the norms of its
        frozen blocks and of unused parts, a few widths each, are counted in the compute
        dtype)."""
        if self.mode != "train":
            return self.fp32_params
        return self.stem_fp32_params if self.frozen_blocks is not None else 0

    def head_trained(self) -> bool:
        """Whether an LM head's weight gets a gradient: the stack trains, and partial freezing
        did not freeze it with the stem (a tied head is the token embedding)."""
        return self.mode == "train" and not (self.frozen_blocks is not None and self.tied_head)

    def trained_layer_share(self) -> float:
        """Share of the blocks that train (partial freezing leaves the first ones out)."""
        if self.frozen_blocks is None or not self.layers:
            return 1.0
        return (self.layers - self.frozen_blocks) / self.layers

    def kv_bytes_per_token(self, bytes_per_element: float, tp: int = 1) -> float:
        """KV cache: K and V for every layer, `kv_heads x head_dim` each (grouped-query aware),
        on one GPU of a TP group of `tp`: ceil(kv_heads / tp) heads (a group wider than the kv
        heads replicates them)."""
        return 2 * self.layers * -(-self.kv_heads // tp) * self.head_dim * bytes_per_element


@dataclass(frozen=True)
class FusionHead:
    """The cross-attention fusion head (models/heads.py): `queries` learned vectors attend, in
    `layers` pre-norm blocks, over the concatenated token sequences of the fused towers."""

    towers: tuple[str, ...]
    width: int
    layers: int
    heads: int
    queries: int
    mlp_hidden: int
    num_outputs: int
    task: str  # classify (cross-entropy) | regress (MSE)


@dataclass(frozen=True)
class PlanModel:
    """Stacks plus what sits between them: contrastive pairs and head parameters."""

    name: str
    stacks: tuple[Stack, ...]
    embed_dim: int = 0
    pairs: int = 0  # contrastive pairs (each adds B_local x B_global logits)
    head_params: int = 0  # logit scale/bias, fusion head: trainable, small
    head_flops: int = 0  # forward FLOPs per sample outside the stacks (fusion head)
    fusion: FusionHead | None = None
    source: str = ""
    notes: tuple[str, ...] = field(default=())
    language_model: bool = False  # next-token objective: no contrastive embeddings
    loss_fp32_elements: int = 0  # per sample, what a regression loss keeps (a denoiser's MSE)

    def params(self) -> int:
        return sum(s.params for s in self.stacks) + self.head_params

    def trainable_params(self) -> int:
        return sum(s.trainable_params() for s in self.stacks) + self.head_params

    def frozen_params(self) -> int:
        return sum(s.frozen_params() for s in self.stacks)

    def frozen_fp32_params(self) -> int:
        """Of `frozen_params`, those the trainer keeps in fp32 under 16-bit autocast."""
        return sum(s.frozen_fp32_params() for s in self.stacks)

    def forward_flops(self) -> int:
        return sum(s.forward_flops for s in self.stacks) + self.head_flops

    def input_grads(self) -> tuple[bool, ...]:
        """Per stack, whether a gradient flows into its input: in a language model, whose
        stacks feed each other in order (image tower -> projector -> decoder), once a stack
        before it trains (or is LoRA-adapted); never in a contrastive or fusion model, whose
        towers are independent."""
        flows, upstream = [], False
        for stack in self.stacks:
            flows.append(upstream)
            upstream = self.language_model and (upstream or stack.mode != "frozen")
        return tuple(flows)

    def keeps_activations(self, stack: Stack) -> bool:
        """Whether autograd keeps activations of `stack`: it trains, or a gradient passes
        through it (a frozen decoder behind a trained projector)."""
        return stack.mode != "frozen" or self.input_grads()[self.stacks.index(stack)]

    def tokens_per_sample(self) -> dict[str, int]:
        return {s.name: s.tokens for s in self.stacks}

    def split_heads(self) -> list[int]:
        """Attention heads of the stacks sequence parallelism splits (empty: none)."""
        return [s.heads for s in self.stacks if s.sequence_split]

    def stack(self, name: str) -> Stack:
        for s in self.stacks:
            if s.name == name:
                return s
        names = [s.name for s in self.stacks]
        raise FieldError("tower", f"no tower named {name!r}; towers: {', '.join(names)}")

    def with_modes(
        self,
        modes: dict[str, str],
        lora_rank: int = 16,
        lora_targets: tuple[str, ...] = ("attn", "mlp"),
    ) -> PlanModel:
        """A copy with some stacks frozen or LoRA-adapted (`{"image": "frozen"}`)."""
        stacks = {s.name: s for s in self.stacks}
        for i, target in enumerate(lora_targets):
            check_choice(f"lora_targets[{i}]", target, LORA_TARGETS)
        for name, mode in modes.items():
            check_choice(f"towers.{name}.mode", mode, MODES)
            stack = self.stack(name)  # a FieldError naming the towers for an unknown name
            stacks[name] = replace(
                stack, mode=mode, lora_rank=lora_rank, lora_targets=tuple(lora_targets)
            )
        return replace(self, stacks=tuple(stacks[s.name] for s in self.stacks))

    def with_quantized_base(
        self, names: list[str] | tuple[str, ...], fmt: str = "nf4"
    ) -> PlanModel:
        """A copy whose LoRA stacks `names` hold their adapted linears' frozen weights quantized
        (`fmt` "nf4", QLoRA: train.towers.NAME.lora.quantize_base; plan/quantized.py)."""
        check_choice("lora.quantize_base", fmt, QUANTIZE_BASE)
        stacks = {s.name: s for s in self.stacks}
        for name in names:
            stack = self.stack(name)
            if stack.mode != "lora":
                raise FieldError(
                    f"towers.{name}.lora.quantize_base",
                    f"QLoRA quantizes the frozen base of a LoRA tower; {name!r} is trained as "
                    f"{stack.mode!r} (adapt it with LoRA: --qlora {name} does both)",
                )
            stacks[name] = replace(stack, quantize_base=fmt)
        return replace(self, stacks=tuple(stacks[s.name] for s in self.stacks))

    def with_frozen_blocks(self, frozen: dict[str, int]) -> PlanModel:
        """A copy with the stem and the first N blocks of some stacks frozen (`{"image": 2}`),
        as `train.towers.NAME.freeze_blocks: N` does (`unlocked_blocks: K` is N = L - K)."""
        stacks = {s.name: s for s in self.stacks}
        for name, n in frozen.items():
            stack = self.stack(name)
            if not 0 <= n <= stack.layers:
                raise FieldError(
                    f"towers.{name}.frozen_blocks",
                    f"must be between 0 and the tower's {stack.layers} blocks, got {n}",
                )
            stacks[name] = replace(stack, frozen_blocks=n)
        return replace(self, stacks=tuple(stacks[s.name] for s in self.stacks))


def _stem_input_saved(tower: TowerSpec) -> tuple[int, int]:
    """(float, int64 elements) of `_stem_saved` that a frozen stem does not keep: its input,
    and norm_pre's input and statistics (no gradient flows back to them)."""
    s, t, w = tower.stem, tower.tokens(), tower.width
    if isinstance(s, TextStem):
        return 0, s.context_length
    if isinstance(s, ImageStem):
        floats = s.channels * s.image_size**2
    elif isinstance(s, VideoStem):
        floats = s.channels * s.frames * s.image_size**2
    elif isinstance(s, TimeSeriesStem):
        floats = s.channels * s.length
    else:  # audio
        floats = s.n_mels * s.mel_frames()
    if tower.has_pre_norm():
        floats += t * w + (2 if tower.norm == "layernorm" else 1) * t
    return floats, 0


def _proj_input(tower: TowerSpec) -> int:
    """Elements per sample of `_stem_saved` kept only as the projection's input (a frozen
    projection's backward does not read them): the pooled token, or the final norm's output it
    is a view of (cls, last). Map pooling keeps its own inputs; no projection, nothing."""
    if not tower.output_proj:
        return 0
    if tower.pooling in ("cls", "last"):
        return tower.tokens() * tower.width
    return tower.width if tower.pooling in ("eot", "mean") else 0


def _stem_saved(tower: TowerSpec) -> tuple[int, int]:
    """(float elements, int64 elements) per sample that a tower keeps outside its blocks.

    Calibrated against mmtrain's module (train/measure_step.py): the stem's input to its patch
    projection, the inputs of norm_pre and norm_final (plus 2 fp32 statistics per token for
    LayerNorm), the pooled token (a view of the final norm's output for cls/last pooling, a
    gathered copy for eot, the mean for mean pooling), and text ids.
    """
    s, t, w = tower.stem, tower.tokens(), tower.width
    stats = 2 if tower.norm == "layernorm" else 1
    floats, ints = 0, 0
    if isinstance(s, ImageStem):
        floats += s.channels * s.image_size**2
    elif isinstance(s, VideoStem):
        floats += s.channels * s.frames * s.image_size**2
    elif isinstance(s, TimeSeriesStem):
        floats += s.channels * s.length
    elif isinstance(s, TextStem):
        ints += s.context_length
    else:  # audio: the log-mel spectrogram the patch conv reads
        floats += s.n_mels * s.mel_frames()
    norms = 2 if tower.has_pre_norm() else 1
    floats += norms * (t * w + stats * t)
    if tower.pooling in ("cls", "last"):
        floats += t * w  # the final norm's output, viewed by the projection
    elif tower.pooling == "eot":
        floats += w
        ints += 2
    elif tower.pooling == "mean":
        # masked mean (text): the [T, 1] weights and their sum; the mean itself saves nothing
        floats += w + (t + 1 if isinstance(s, TextStem) else 0)
    else:  # map: probe attention over the tokens, roughly one block's worth on one query
        floats += t * w + 3 * t * w + 4 * w
    return floats, ints


def _tower_fp32_params(tower: TowerSpec) -> tuple[int, int]:
    """(whole tower, stem and norm_pre) parameters that are not a linear or convolution
    layer's (models/towers.py, stems.py): token, position and class tables, norms, a MAP
    probe."""
    s, w = tower.stem, tower.width
    stem = tower.stem_params()
    if not isinstance(s, TextStem):  # the patch projection is a convolution or a linear
        stem -= s.patch_dim() * w + (w if s.patch_bias else 0)
    stem += tower.norm_params() if tower.has_pre_norm() else 0
    pool = w + tower.norm_params() if tower.pooling == "map" else 0
    norms = (2 * tower.layers + 1) * tower.norm_params()  # two a block and the final one
    return stem + norms + pool, stem


def _unused_params(spec: ModelSpec, name: str) -> int:
    """Parameters of tower `name` that no loss reaches: the pooling and projection of a tower
    that is in no contrastive pair (a fusion head reads its tokens, not its embedding), or the
    whole tower when nothing reads it. They get no gradient, so no optimizer state either."""
    tower = spec.towers[name]
    if any(name in pair for pair in spec.pairs):
        return 0
    if name in spec.fused_towers():
        return tower.pool_params() + tower.proj_params(spec.embed_dim)
    return tower.params(spec.embed_dim)


def _fusion_head(spec: ModelSpec) -> FusionHead | None:
    f: FusionSpec | None = spec.fusion
    if f is None:
        return None
    return FusionHead(
        towers=tuple(spec.fused_towers()),
        width=f.width,
        layers=f.layers,
        heads=f.heads,
        queries=f.queries,
        mlp_hidden=int(f.width * f.mlp_ratio),
        num_outputs=f.num_outputs,
        task=f.task,
    )


def from_spec(spec: ModelSpec, rows: Rows | None = None) -> PlanModel:
    """One stack per tower, with spec.py's parameter, token and FLOP counts; a language model
    (spec.decoder) plans `rows` (default: one row of `decoder.max_positions` positions holding
    one image per image tower, as spec.forward_flops counts it, or, for a native-resolution
    tower, one page at its largest size: `default_rows`); a denoiser (spec.denoiser) is one
    diffusion stack (`denoiser_model`)."""
    if spec.decoder is not None:
        return language_model(spec, rows or default_rows(spec))
    if spec.denoiser is not None:
        return denoiser_model(spec)
    stacks = [from_spec_tower(spec, name) for name in spec.towers]
    return PlanModel(
        name=spec.name,
        stacks=tuple(stacks),
        embed_dim=spec.embed_dim,
        pairs=len(spec.pairs),
        head_params=spec.head_params(),
        head_flops=spec.forward_flops() - sum(spec.tower_flops().values()),
        fusion=_fusion_head(spec),
    )


# ----------------------------------------------------------------------------- language models
@dataclass(frozen=True)
class Rows:
    """What one training row (one sample of the plan) of a language model holds.

    `positions` LM positions (images spliced in; memory is planned for this length), `images`
    images per row, `text_ids` ids per row (a placeholder counts one: the logits rows),
    `packed` rows of several documents (a block-diagonal mask per layer), and optionally the
    mean forward FLOPs of a row (`forward_flops`, from a length distribution: rows differ).

    A native-resolution tower (spec.vision) reads each input at its own size: `visual_inputs`
    are the (frames, height, width) in pixels of the row's images (frames 1) and clips, at
    the tower's size (plan/native_vision.py), their tokens counted in `positions`. Without
    them, `images` stands for that many default pages (`native_vision.default_page`)."""

    positions: int
    images: float = 0.0
    text_ids: int | None = None
    packed: bool = False
    forward_flops: float | None = None
    vision_flops: float | None = None  # of forward_flops: the image tower and projector
    mean_images: float | None = None  # images per row for FLOPs (None: `images`)
    visual_inputs: tuple[tuple[int, int, int], ...] = ()


def check_rows(spec: ModelSpec, rows: Rows) -> None:
    """A row must hold its images whole and at least two ids (a target needs a next id)."""
    if spec.vision is not None:
        _check_native_rows(spec, rows)
        return
    needed = int(math.ceil(rows.images)) * spec.image_tokens() + 2
    if rows.positions < needed:
        raise FieldError(
            "--context",
            f"{rows.positions} positions cannot hold {rows.images:g} image(s) of "
            f"{spec.image_tokens()} tokens and a target; give at least {needed}",
        )


def _check_native_rows(spec: ModelSpec, rows: Rows) -> None:
    nv.check_inputs(spec.vision, rows.visual_inputs, "visual_inputs")
    tokens = nv.visual_tokens(spec.vision, rows.visual_inputs)
    if rows.positions < tokens + 2:
        raise FieldError(
            "--context",
            f"{rows.positions} positions cannot hold the row's visual inputs "
            f"({nv.describe(rows.visual_inputs)}: {tokens} tokens) and a target; give at "
            f"least {tokens + 2}, or fewer or smaller --visual inputs",
        )


def default_rows(spec: ModelSpec) -> Rows:
    """One row of the decoder's `max_positions` with one image when the model has images: for
    a native-resolution tower, a square page at the spec's max_pixels (the default budget's
    worst case)."""
    assert spec.decoder is not None
    if spec.vision is not None:
        return native_rows(spec, Rows(positions=spec.decoder.max_positions, images=1))
    images = 1 if spec.projector is not None else 0
    return Rows(positions=spec.decoder.max_positions, images=images)


def native_rows(spec: ModelSpec, rows: Rows) -> Rows:
    """`rows` of a native-resolution VLM with its inputs spelled out: `images` default pages
    when it names none (whole pages: a fraction rounds up), `images` their count."""
    inputs = rows.visual_inputs
    if not inputs:
        inputs = (nv.default_page(spec.vision),) * int(math.ceil(rows.images))
    return replace(rows, visual_inputs=tuple(inputs), images=float(len(inputs)))


def _text_ids(spec: ModelSpec, rows: Rows) -> int:
    if rows.text_ids is not None:
        return rows.text_ids
    if spec.vision is not None:  # each input's placeholder becomes its own tokens
        extra = nv.visual_tokens(spec.vision, rows.visual_inputs) - len(rows.visual_inputs)
        return max(1, rows.positions - extra)
    extra = max(spec.image_tokens() - 1, 0)
    return max(1, int(round(rows.positions - rows.images * extra)))


def decoder_stack(spec: ModelSpec, rows: Rows, name: str = "text") -> Stack:
    """The decoder LM (models/decoder.py) as a stack over `rows.positions` positions.

    Outside its blocks it keeps (per row, calibrated with train/measure_step.py against vlm.py's
    LanguageModel): the token ids, the splice index (one per position) and the gather index
    of the text ids (int64); the rotary cos and sin tables (2 s d, shared by every layer); the
    final RMSNorm's input, statistic, normalised copy and output (the gather that picks the
    text ids' rows keeps its input); and the LM head's input at each text id but the last
    (the rows that predict a next id), which the chunked loss keeps to recompute each chunk's
    logits in backward (models/token_loss.py), also when the head is frozen."""
    d = spec.decoder
    s, text = rows.positions, _text_ids(spec, rows)
    flops = d.forward_flops(s)
    if rows.forward_flops is not None:
        flops = int(round(rows.forward_flops - (rows.vision_flops or 0)))
    floats = 2 * s * d.head_dim + s * (3 * d.width + 1) + (text - 1) * d.width
    ints = text + s + text
    return Stack(
        name=name,
        kind="decoder",
        layers=d.layers,
        width=d.width,
        heads=d.heads,
        kv_heads=d.kv_heads,
        head_dim=d.head_dim,
        mlp_hidden=d.mlp_hidden,
        params=d.params(),
        forward_flops=flops,
        tokens=s,
        gated=True,
        norm="rmsnorm",
        causal=True,
        vocab=d.vocab_size,
        stem_elements=floats,
        stem_int64=ints,
        padded=True,
        stem_params=d.embedding_params(),
        layer_params=d.block_params(),
        # the embedding table and the RMSNorms (two a block, the final one)
        fp32_params=d.embedding_params() + (2 * d.layers + 1) * d.width,
        stem_fp32_params=d.embedding_params(),
        stem_input_int64=text + s,  # a frozen embedding: neither the ids nor the splice index
        proj_input_elements=s * d.width,  # a frozen final norm weight's normalised copy
        norm_copy=True,
        rotary=True,
        document_mask=rows.packed,
        logit_rows=text,
        tied_head=d.tie_embeddings,
        source=f"decoder of {spec.name}",
    )


def _vision_stacks(spec: ModelSpec, rows: Rows) -> tuple[Stack, Stack]:
    """The image tower up to the feature layer and the projector, per image (`per_sample`
    images per row). Blocks after the feature layer and the final norm never run: weights
    only (vlm.py freezes them)."""
    p = spec.projector
    tower = spec.towers[p.tower]
    lm_width = spec.decoder.width
    used = p.blocks_used(tower)
    t = tower.tokens()
    flop_images = rows.images if rows.mean_images is None else rows.mean_images
    vision_flops, projector_flops = p.vision_flops(tower), p.mapping_flops(tower, lm_width)
    pixels = tower.stem.channels * tower.stem.image_size**2
    pre = t * tower.width + (2 if tower.norm == "layernorm" else 1) * t
    vision = replace(
        from_spec_tower(spec, p.tower),
        layers=used,
        forward_flops=int(round(flop_images * vision_flops)),
        stem_elements=pixels + (pre if tower.has_pre_norm() else 0),
        stem_int64=0,
        stem_input_elements=pixels + (pre if tower.has_pre_norm() else 0),
        keeps_final_tokens=False,
        proj_input_elements=0,
        unused_params=(tower.layers - used) * tower.block_params() + tower.norm_params(),
        per_sample=rows.images,
    )
    image_tokens = p.image_tokens(tower)
    # fc1 keeps the feature layer's output it reads (with the class token sliced off, the
    # contiguous copy the matmul makes of that view: image_tokens either way); the MLP keeps
    # GELU's input and fc2's input.
    kept = image_tokens * tower.width + (2 * image_tokens * lm_width if p.kind == "mlp" else 0)
    projector = Stack(
        name=PROJECTOR_PART,
        kind="projector",
        layers=0,
        width=lm_width,
        heads=0,
        kv_heads=0,
        head_dim=0,
        mlp_hidden=0,
        params=p.params(tower.width, lm_width),
        forward_flops=int(round(flop_images * projector_flops)),
        tokens=image_tokens,
        stem_elements=kept,
        per_sample=rows.images,
        taken_index_int64=1,
        source=f"{p.kind} projector of {spec.name}",
    )
    return vision, projector


def native_vision_stack(spec: ModelSpec, rows: Rows) -> Stack:
    """A native-resolution tower and its merger (models/native_vision.py) over the patches of
    one row's `visual_inputs`: `spec.vision`'s parameters and FLOPs, what it keeps as
    plan/native_vision.py counts it (its blocks as encoder blocks with gathered attention)."""
    v, inputs = spec.vision, rows.visual_inputs
    outside = nv.saved_outside_blocks(v, inputs)
    flops = nv.visual_flops(v, inputs) if rows.vision_flops is None else rows.vision_flops
    return Stack(
        name=VISION_TOWER,
        kind="encoder",
        layers=v.depth,
        width=v.width,
        heads=v.heads,
        kv_heads=v.heads,
        head_dim=v.head_dim(),
        mlp_hidden=v.mlp_hidden,
        params=v.params(),
        forward_flops=int(round(flops)),
        tokens=nv.visual_patches(v, inputs),
        gated=v.mlp == "swiglu",
        norm="rmsnorm" if v.norm == "rms_norm" else "layernorm",
        norm_copy=v.norm == "rms_norm",  # the unfused RMSNorm keeps its normalised input
        stem_elements=outside.floats,
        stem_fp32=outside.fp32,
        group_index_int64=outside.index_int64,
        stem_params=v.patch_params(),
        layer_params=v.block_params(),
        fp32_params=(2 * v.depth + 1) * v.norm_params(),  # two norms a block, the merger's
        stem_input_elements=outside.input_floats,
        proj_input_elements=outside.merger_inputs,
        gathered_attention=True,
        attention_span=nv.attention_span(v, inputs),
        taken_index_int64=nv.visual_tokens(v, inputs),
        quick_gelu=v.mlp == "gelu" and v.activation == "quick_gelu",
        source=f"native-resolution vision tower of {spec.name} ({nv.describe(inputs)})",
    )


def from_spec_tower(spec: ModelSpec, name: str) -> Stack:
    """The stack of one encoder tower, as `from_spec` builds it."""
    tower = spec.towers[name]
    floats, ints = _stem_saved(tower)
    input_floats, input_ints = _stem_input_saved(tower)
    text = isinstance(tower.stem, TextStem)
    fp32, stem_fp32 = _tower_fp32_params(tower)
    return Stack(
        name=name,
        kind="encoder",
        layers=tower.layers,
        width=tower.width,
        heads=tower.heads,
        kv_heads=tower.heads,
        head_dim=tower.head_dim(),
        mlp_hidden=tower.mlp_hidden(),
        params=tower.params(spec.embed_dim),
        forward_flops=tower.flops(spec.embed_dim),
        tokens=tower.tokens(),
        gated=tower.activation == "swiglu",
        norm=tower.norm,
        causal=text and tower.stem.causal,
        key_mask=text and not tower.stem.causal and tower.pooling != "last",
        stem_elements=floats,
        stem_int64=ints,
        padded=text,
        keeps_final_tokens=tower.pooling in ("cls", "last", "map"),
        unused_params=_unused_params(spec, name),
        stem_params=tower.stem_params() + (tower.norm_params() if tower.has_pre_norm() else 0),
        layer_params=tower.block_params(),
        stem_input_elements=input_floats,
        stem_input_int64=input_ints,
        proj_input_elements=_proj_input(tower),
        fp32_params=fp32,
        stem_fp32_params=stem_fp32,
    )


def language_model(spec: ModelSpec, rows: Rows) -> PlanModel:
    """A decoder LM (and, for a VLM, its image tower and projector) planning `rows`: one
    sample of the plan is one row."""
    if spec.vision is not None:
        rows = native_rows(spec, rows)
    check_rows(spec, rows)
    stacks: list[Stack] = []
    if spec.projector is not None:
        stacks += _vision_stacks(spec, rows)
    if spec.vision is not None:
        stacks.append(native_vision_stack(spec, rows))
    stacks.append(decoder_stack(spec, rows))
    return PlanModel(
        name=spec.name,
        stacks=tuple(stacks),
        embed_dim=spec.embed_dim,
        source=spec.name,
        language_model=True,
    )


# ----------------------------------------------------------------------------- denoisers
def denoiser_model(spec: ModelSpec) -> PlanModel:
    """A diffusion transformer (models/dit.py) as one "diffusion" stack named like its tower
    (`denoiser`), with denoiser_spec.py's parameter, token and FLOP counts, and its MSE loss.

    What the module keeps (calibrated with train/measure_step.py, per sample): in each block
    the pre-norm terms, the normalised copies the adaLN modulation multiplies (`norm_copy`),
    each gated branch's output and the block's modulation vectors (`adaln`; activations.py).
    Outside the blocks (`stem_elements`): the noisy input the patch projection reads, the
    timestep MLP's input (256 sinusoidal features), its hidden layer before and after SiLU,
    the conditioning vector c (one tensor, read by every block's SiLU: kept once), and the
    final layer's SiLU(c), norm input and statistics, normalised copy, (1 + scale) and output
    projection input; the class ids (int64). The loss keeps the fp32 error (prediction minus
    target, over the input's channels) and the per-sample weight.

    An MMDiT's joint blocks keep a DiT block's terms over its image and text tokens together
    (both streams, their modulations: `adaln_streams`), its last block less (its text stream
    ends at the attention: `pre_only_tokens`); its stem also keeps the pooled text's MLP
    input and hidden layer (before and after SiLU) and the text the projection reads."""
    d = spec.denoiser
    assert d is not None
    t, w = d.tokens(), d.width
    pixels = math.prod(d.sample_shape())  # [C, H, W], a video's [C, T, H, W]
    text = d.pooled_width + 2 * w + d.text_tokens * d.text_width if d.is_mmdit() else 0
    stem_inputs = pixels + TIMESTEP_FREQUENCIES + 3 * w + text  # patch input, time MLP, c
    final = w + (t * w + 2 * t) + t * w + w + t * w
    classes = 1 if d.num_classes else 0
    table = (d.num_classes + 1) * w if d.num_classes else 0  # the class embedding
    stack = Stack(
        name=DENOISER_PART,
        kind="diffusion",
        layers=d.layers,
        width=w,
        heads=d.heads,
        kv_heads=d.heads,
        head_dim=w // d.heads,
        mlp_hidden=d.mlp_hidden(),
        params=d.params(),
        forward_flops=d.forward_flops(),
        tokens=t + d.text_tokens,  # a DiT's text_tokens are 0
        stem_elements=stem_inputs + final,
        stem_int64=classes,
        stem_params=d.embedding_params(),
        layer_params=d.block_params(),
        # the class table and the q/k norms (one set per stream and block); its LayerNorms
        # have no weights and its positions are a buffer
        fp32_params=table + d.layers * d.qk_norm_params() * (2 if d.is_mmdit() else 1),
        stem_fp32_params=table,
        stem_input_elements=stem_inputs,
        stem_input_int64=classes,
        # a frozen final layer (LoRA) keeps neither its modulation's input, its normalised
        # copy nor its output projection's input
        proj_input_elements=2 * t * w + w,
        norm_copy=True,
        adaln=True,
        adaln_streams=2 if d.is_mmdit() else 1,
        # the last block's text queries do not attend: their q norm never runs (mmdit.py)
        unused_params=d.head_dim() if d.qk_norm == "rms_norm" else 0,
        pre_only_tokens=d.text_tokens,
        output_elements=t * d.out_channels() * d.patch_volume(),
        source=f"denoiser of {spec.name}",
    )
    return PlanModel(
        name=spec.name,
        stacks=(stack,),
        source=spec.name,
        loss_fp32_elements=pixels + 1,
    )
