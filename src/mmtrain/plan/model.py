"""What the planner sees of a model: a list of transformer stacks with their sizes and counts.

A `ModelSpec` (encoder towers) becomes one `Stack` per tower, taking parameters, tokens and
forward FLOPs from spec.py's counts. Workload presets (decoder LMs, diffusion transformers;
see workloads.py) build stacks directly from their published shapes. Everything downstream
(memory, time, inference) reads stacks only, so both kinds of model are planned alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from mmtrain.spec import ImageStem, ModelSpec, TextStem, TimeSeriesStem, TowerSpec, VideoStem
from mmtrain.structured import FieldError, check_choice

MODES = ("train", "frozen", "lora")


@dataclass(frozen=True)
class Stack:
    """One transformer stack (a tower, a decoder, a DiT) and how it is trained.

    `tokens` is the sequence length per sample; `forward_flops` is per sample (2 x multiply-adds);
    `stem_elements` counts the non-block tensors autograd keeps per sample (input pixels,
    pre/final norm inputs, pooled token; see activations.py), `stem_int64` the integer ones.
    """

    name: str
    kind: str  # encoder | decoder | diffusion | projector
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
    stem_elements: int = 0
    stem_int64: int = 0
    source: str = ""

    def block_params(self) -> int:
        """Parameters of one block (what ZeRO-3 gathers at a time)."""
        attn = (
            self.width * self.heads * self.head_dim * 2
            + 2 * self.width * self.kv_heads * self.head_dim
        )
        mlp = (3 if self.gated else 2) * self.width * self.mlp_hidden
        return attn + mlp

    def lora_params(self) -> int:
        """Adapter parameters at rank r on q/k/v, output, fc1 and fc2 of every block."""
        w, f, r = self.width, self.mlp_hidden, self.lora_rank
        return self.layers * r * (4 * w + 2 * w + (w + f) + (f + w))

    def trainable_params(self) -> int:
        return {"train": self.params, "frozen": 0, "lora": self.lora_params()}[self.mode]

    def kv_bytes_per_token(self, bytes_per_element: float) -> float:
        """KV cache: K and V for every layer, `kv_heads x head_dim` each (grouped-query aware)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_element


@dataclass(frozen=True)
class PlanModel:
    """Stacks plus what sits between them: contrastive pairs and head parameters."""

    name: str
    stacks: tuple[Stack, ...]
    embed_dim: int = 0
    pairs: int = 0  # contrastive pairs (each adds B_local x B_global logits)
    head_params: int = 0  # logit scale/bias, fusion head: trainable, small
    head_flops: int = 0  # forward FLOPs per sample outside the stacks (fusion head)
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def params(self) -> int:
        return sum(s.params for s in self.stacks) + self.head_params

    def trainable_params(self) -> int:
        return sum(s.trainable_params() for s in self.stacks) + self.head_params

    def frozen_params(self) -> int:
        return sum(s.params for s in self.stacks if s.mode != "train")

    def forward_flops(self) -> int:
        return sum(s.forward_flops for s in self.stacks) + self.head_flops

    def tokens_per_sample(self) -> dict[str, int]:
        return {s.name: s.tokens for s in self.stacks}

    def stack(self, name: str) -> Stack:
        for s in self.stacks:
            if s.name == name:
                return s
        names = [s.name for s in self.stacks]
        raise FieldError("tower", f"no tower named {name!r}; towers: {', '.join(names)}")

    def with_modes(self, modes: dict[str, str], lora_rank: int = 16) -> PlanModel:
        """A copy with some stacks frozen or LoRA-adapted (`{"image": "frozen"}`)."""
        stacks = {s.name: s for s in self.stacks}
        for name, mode in modes.items():
            check_choice(f"towers.{name}.mode", mode, MODES)
            stacks[self.stack(name).name] = replace(stacks[name], mode=mode, lora_rank=lora_rank)
        return replace(self, stacks=tuple(stacks[s.name] for s in self.stacks))


def _stem_saved(tower: TowerSpec) -> tuple[int, int]:
    """(float elements, int64 elements) per sample that a tower keeps outside its blocks.

    Calibrated against mmtrain's module (plan/measure.py): the stem's input to its patch
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
    elif tower.pooling in ("eot", "mean"):
        floats += w
        ints += 2 if tower.pooling == "eot" else 0
    else:  # map: probe attention over the tokens, roughly one block's worth on one query
        floats += t * w + 3 * t * w + 4 * w
    return floats, ints


def from_spec(spec: ModelSpec) -> PlanModel:
    """One stack per tower, with spec.py's parameter, token and FLOP counts."""
    stacks = []
    for name, tower in spec.towers.items():
        floats, ints = _stem_saved(tower)
        text = isinstance(tower.stem, TextStem)
        stacks.append(
            Stack(
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
            )
        )
    notes = ("fusion head activations are not modelled",) if spec.fusion is not None else ()
    return PlanModel(
        name=spec.name,
        stacks=tuple(stacks),
        embed_dim=spec.embed_dim,
        pairs=len(spec.pairs),
        head_params=spec.head_params(),
        head_flops=spec.forward_flops() - sum(spec.tower_flops().values()),
        notes=notes,
    )
