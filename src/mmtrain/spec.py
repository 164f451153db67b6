"""The one model description: towers (a modality stem plus a transformer stack) and a head.

The planner counts parameters, tokens and FLOPs from a `ModelSpec` alone (this module imports no
torch); `mmtrain.models.build` turns the same spec into a `torch.nn.Module`, and tests hold the
two together (the built module's parameter count equals `ModelSpec.params()` for every preset).

Counting conventions (shared by the builder and the planner):
- FLOPs are 2 x multiply-adds of matmuls and attention (bias adds, norms and softmax are left
  out), as fvcore-based profiles such as OpenCLIP's model profile count them.
- Attention is counted in full also when causal (kernels that skip the masked half do less).
- Training FLOPs (`train_flops`, what MFU divides by peak) are counted here once for the planner
  and the trainer, part by part, from each part's forward FLOPs and how it trains.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from mmtrain.decoder_spec import DecoderSpec
from mmtrain.denoiser_spec import DenoiserSpec
from mmtrain.hub_spec import HubSpec
from mmtrain.native_vision_spec import NativeVisionSpec
from mmtrain.structured import FieldError, check_choice, closest, from_dict, to_dict

MODALITIES = ("image", "video", "audio", "timeseries", "text")
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POOLINGS = ("cls", "mean", "map", "eot", "last")
OBJECTIVES = ("clip", "siglip", "triplet", "next_token", "flow_matching", "diffusion")
GENERATIVE_OBJECTIVES = {"flow_matching": ("velocity",), "diffusion": ("epsilon", "v")}
PROJECTORS = ("linear", "mlp")
DECODER_TOWER = "text"  # the decoder LM's name among a model's towers (and its batch key)
PROJECTOR_PART = "projector"  # a VLM's projector among the parts FLOPs are counted by
FUSION_PART = "fusion"  # the fusion head among them
VISION_TOWER = "vision"  # a native-resolution VLM's vision tower (with its merger)
DENOISER_PART = "denoiser"  # a diffusion transformer (denoiser_spec.py) among them
TRAIN_MODES = ("train", "frozen", "lora")  # how a part trains (the planner's stack modes)
FUSION_TASKS = ("classify", "regress")

PRESET_DIR = Path(__file__).parent / "presets"


# ----------------------------------------------------------------------------- stems
@dataclass(frozen=True)
class ImageStem:
    """Square images cut into non-overlapping patches (a strided conv)."""

    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    patch_bias: bool = False  # OpenCLIP's conv1 has none; SigLIP's patch embedding has one

    def grid(self) -> int:
        return self.image_size // self.patch_size

    def patches(self) -> int:
        return self.grid() ** 2

    def patch_dim(self) -> int:
        return self.channels * self.patch_size**2

    def validate(self, path: str) -> None:
        # A size that the patch does not divide loses its border, as a strided conv does
        # (SigLIP's 384 px at patch 14 sees a 27 x 27 grid).
        _positive(path, self, "image_size", "patch_size", "channels")
        if self.patch_size > self.image_size:
            raise FieldError(
                f"{path}.patch_size",
                f"{self.patch_size} is larger than image_size {self.image_size}",
            )


@dataclass(frozen=True)
class VideoStem:
    """Clips of `frames` frames cut into tubelets of `tubelet` frames x patch x patch pixels."""

    frames: int = 8
    tubelet: int = 2
    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    patch_bias: bool = False

    def grid(self) -> int:
        return self.image_size // self.patch_size

    def time_steps(self) -> int:
        return self.frames // self.tubelet

    def patches(self) -> int:
        return self.time_steps() * self.grid() ** 2

    def patch_dim(self) -> int:
        return self.channels * self.tubelet * self.patch_size**2

    def validate(self, path: str) -> None:
        _positive(path, self, "frames", "tubelet", "image_size", "patch_size", "channels")
        if self.patch_size > self.image_size:
            raise FieldError(
                f"{path}.patch_size",
                f"{self.patch_size} is larger than image_size {self.image_size}",
            )
        if self.frames % self.tubelet:
            raise FieldError(
                f"{path}.tubelet", f"{self.tubelet} does not divide frames {self.frames}"
            )


@dataclass(frozen=True)
class AudioStem:
    """Waveform -> log-mel spectrogram (computed in torch) -> patch x patch (mel x time) patches."""

    sample_rate: int = 16000
    n_mels: int = 64
    n_fft: int = 400
    hop: int = 160
    clip_seconds: float = 4.0
    patch: int = 16
    patch_bias: bool = False

    def samples(self) -> int:
        return int(round(self.sample_rate * self.clip_seconds))

    def mel_frames(self) -> int:
        # torch.stft(center=True) yields 1 + samples // hop frames; the stem drops the ragged tail.
        return 1 + self.samples() // self.hop

    def patches(self) -> int:
        return (self.n_mels // self.patch) * (self.mel_frames() // self.patch)

    def patch_dim(self) -> int:
        return self.patch * self.patch

    def validate(self, path: str) -> None:
        _positive(path, self, "sample_rate", "n_mels", "n_fft", "hop", "clip_seconds", "patch")
        if self.n_mels % self.patch:
            raise FieldError(f"{path}.patch", f"{self.patch} does not divide n_mels {self.n_mels}")
        if self.mel_frames() < self.patch:
            raise FieldError(
                f"{path}.clip_seconds",
                f"{self.clip_seconds}s gives {self.mel_frames()} frames, fewer than one patch ({self.patch})",
            )
        if self.n_fft // 2 + 1 < self.n_mels:
            raise FieldError(
                f"{path}.n_mels", f"{self.n_mels} mel bands need n_fft >= {2 * (self.n_mels - 1)}"
            )


@dataclass(frozen=True)
class TimeSeriesStem:
    """Multichannel sensor windows (channels x length) cut into 1-D patches mixing all channels."""

    channels: int = 3
    length: int = 256
    patch: int = 16
    patch_bias: bool = True

    def patches(self) -> int:
        return self.length // self.patch

    def patch_dim(self) -> int:
        return self.channels * self.patch

    def validate(self, path: str) -> None:
        _positive(path, self, "channels", "length", "patch")
        if self.length % self.patch:
            raise FieldError(f"{path}.patch", f"{self.patch} does not divide length {self.length}")


@dataclass(frozen=True)
class TextStem:
    """Token ids (0 = padding) with learned positions; causal mask for CLIP-style text towers.

    `eot_token` is where "eot" pooling reads: None, the last non-padding token (mmtrain's and
    OpenCLIP's tokenizers pad with 0 after the end-of-text token); an id, the first position
    holding it (Hugging Face CLIP, whose tokenizer may pad with the end-of-text id itself);
    "argmax", the position of the largest id (OpenAI's rule, where end-of-text is the last id;
    HF CLIP configs with the legacy `eos_token_id` 2).
    """

    vocab_size: int = 49408
    context_length: int = 77
    causal: bool = True
    eot_token: int | str | None = None

    def patches(self) -> int:
        return self.context_length

    def patch_dim(self) -> int:
        return 0

    def validate(self, path: str) -> None:
        _positive(path, self, "vocab_size", "context_length")
        eot = self.eot_token
        if isinstance(eot, str) and eot != "argmax":
            raise FieldError(f"{path}.eot_token", f"a token id, argmax or null, got {eot!r}")
        if isinstance(eot, int) and not 0 <= eot < self.vocab_size:
            raise FieldError(
                f"{path}.eot_token", f"{eot} is not an id of the {self.vocab_size}-token vocabulary"
            )


StemSpec = ImageStem | VideoStem | AudioStem | TimeSeriesStem | TextStem
STEMS: dict[str, type] = {
    "image": ImageStem,
    "video": VideoStem,
    "audio": AudioStem,
    "timeseries": TimeSeriesStem,
    "text": TextStem,
}


# ----------------------------------------------------------------------------- towers
@dataclass(frozen=True)
class TowerSpec:
    """One encoder: a modality stem, `layers` pre-norm transformer blocks, pooling, projection."""

    modality: str
    stem: StemSpec
    width: int
    layers: int
    heads: int
    mlp_ratio: float = 4.0
    activation: str = "gelu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    qkv_bias: bool = True
    pooling: str = "cls"
    output_proj: bool = True  # linear map width -> embed_dim (else width must equal embed_dim)
    proj_bias: bool = False
    pre_norm: bool | None = None  # norm before the blocks; None: patch towers yes, text no

    # -- derived sizes
    def mlp_hidden(self) -> int:
        return int(self.width * self.mlp_ratio)

    def head_dim(self) -> int:
        return self.width // self.heads

    def has_cls_token(self) -> bool:
        return self.pooling == "cls" and self.modality != "text"

    def has_pre_norm(self) -> bool:
        """Patch-based towers normalise the token sequence before the blocks (OpenCLIP's ln_pre)
        unless `pre_norm` says otherwise (SigLIP's vision tower has none)."""
        return self.modality != "text" if self.pre_norm is None else self.pre_norm

    def tokens(self) -> int:
        """Sequence length the transformer sees per sample (patches plus a class token)."""
        return self.stem.patches() + int(self.has_cls_token())

    # -- parameters
    def norm_params(self) -> int:
        return 2 * self.width if self.norm == "layernorm" else self.width

    def mlp_params(self, width: int | None = None, hidden: int | None = None) -> int:
        w = width or self.width
        h = hidden or self.mlp_hidden()
        if self.activation == "swiglu":
            return 2 * (w * h + h) + h * w + w
        return w * h + h + h * w + w

    def attention_params(self) -> int:
        w = self.width
        return 3 * w * w + (3 * w if self.qkv_bias else 0) + w * w + w

    def block_params(self) -> int:
        return 2 * self.norm_params() + self.attention_params() + self.mlp_params()

    def stem_params(self) -> int:
        w, s = self.width, self.stem
        if isinstance(s, TextStem):
            return s.vocab_size * w + s.context_length * w
        proj = s.patch_dim() * w + (w if s.patch_bias else 0)
        cls = w if self.has_cls_token() else 0
        if isinstance(s, VideoStem):
            pos = s.grid() ** 2 * w + s.time_steps() * w  # factorised: spatial + temporal
        else:
            pos = self.tokens() * w
        return proj + cls + pos

    def pool_params(self) -> int:
        if self.pooling != "map":
            return 0
        # attention-pooling head: a learned probe, attention, norm and MLP (SigLIP's MAP head)
        return self.width + self.attention_params() + self.norm_params() + self.mlp_params()

    def proj_params(self, embed_dim: int) -> int:
        if not self.output_proj:
            return 0
        return self.width * embed_dim + (embed_dim if self.proj_bias else 0)

    def params(self, embed_dim: int) -> int:
        pre = self.norm_params() if self.has_pre_norm() else 0
        return (
            self.stem_params()
            + pre
            + self.layers * self.block_params()
            + self.norm_params()  # final norm
            + self.pool_params()
            + self.proj_params(embed_dim)
        )

    # -- FLOPs (2 x multiply-adds, forward, one sample)
    def block_flops(self) -> int:
        t, w = self.tokens(), self.width
        mlp_mats = 3 if self.activation == "swiglu" else 2
        linear = 2 * t * (4 * w * w + mlp_mats * w * self.mlp_hidden())
        attention = 2 * 2 * t * t * w  # QK^T and attention x V
        return linear + attention

    def flops(self, embed_dim: int) -> int:
        t, w = self.tokens(), self.width
        stem = 2 * self.stem.patches() * self.stem.patch_dim() * w
        pool = 0
        if self.pooling == "map":
            mlp_mats = 3 if self.activation == "swiglu" else 2
            pool = (
                2 * (w * w + t * 2 * w * w + w * w + mlp_mats * w * self.mlp_hidden())
                + 2 * 2 * t * w
            )
        proj = 2 * w * embed_dim if self.output_proj else 0
        return stem + self.layers * self.block_flops() + pool + proj

    def validate(self, path: str, embed_dim: int) -> None:
        check_choice(f"{path}.modality", self.modality, MODALITIES)
        expected = STEMS[self.modality]
        if not isinstance(self.stem, expected):
            raise FieldError(
                f"{path}.stem", f"a {self.modality} tower needs {expected.__name__} fields"
            )
        self.stem.validate(f"{path}.stem")
        _positive(path, self, "width", "layers", "heads", "mlp_ratio", "norm_eps")
        check_choice(f"{path}.activation", self.activation, ACTIVATIONS)
        check_choice(f"{path}.norm", self.norm, NORMS)
        check_choice(f"{path}.pooling", self.pooling, POOLINGS)
        if self.width % self.heads:
            raise FieldError(f"{path}.heads", f"{self.heads} does not divide width {self.width}")
        if self.pooling == "eot" and self.modality != "text":
            raise FieldError(
                f"{path}.pooling", "'eot' pooling needs a text tower; use cls, mean or map"
            )
        if not self.output_proj and self.width != embed_dim:
            raise FieldError(
                f"{path}.output_proj",
                f"false needs width ({self.width}) == embed_dim ({embed_dim})",
            )


# ----------------------------------------------------------------------------- fusion head
@dataclass(frozen=True)
class FusionSpec:
    """Cross-attention fusion: learned queries attend over the towers' token sequences, then a
    classifier or regressor reads the pooled queries."""

    num_outputs: int
    task: str = "classify"
    width: int = 256
    layers: int = 2
    heads: int = 4
    queries: int = 8
    mlp_ratio: float = 4.0
    towers: list[str] = field(default_factory=list)  # empty: every tower

    def params(self, tower_widths: dict[str, int]) -> int:
        w = self.width
        h = int(w * self.mlp_ratio)
        inputs = sum(
            tw * w + w for tw in tower_widths.values()
        )  # per-tower linear into fusion width
        modality_embeddings = len(tower_widths) * w
        queries = self.queries * w
        layer = (
            2 * (2 * w)  # norm of queries, norm of memory
            + 4 * w * w
            + 4 * w  # q, k, v, out projections with biases
            + 2 * w  # norm before the MLP
            + w * h
            + h
            + h * w
            + w
        )
        head = 2 * w + w * self.num_outputs + self.num_outputs  # final norm + linear
        return inputs + modality_embeddings + queries + self.layers * layer + head

    def flops(self, tower_tokens: dict[str, int], tower_widths: dict[str, int]) -> int:
        w, q = self.width, self.queries
        h = int(w * self.mlp_ratio)
        memory = sum(tower_tokens.values())
        inputs = sum(2 * tower_tokens[n] * tower_widths[n] * w for n in tower_tokens)
        layer = (
            2 * (q * w * w + 2 * memory * w * w + q * w * w)
            + 2 * 2 * q * memory * w
            + 2 * 2 * q * w * h
        )
        return inputs + self.layers * layer + 2 * w * self.num_outputs

    def validate(self, path: str, tower_names: list[str]) -> None:
        check_choice(f"{path}.task", self.task, FUSION_TASKS)
        _positive(path, self, "num_outputs", "width", "layers", "heads", "queries", "mlp_ratio")
        if self.width % self.heads:
            raise FieldError(f"{path}.heads", f"{self.heads} does not divide width {self.width}")
        for i, name in enumerate(self.towers):
            if name not in tower_names:
                raise FieldError(
                    f"{path}.towers[{i}]", f"no tower named {name!r}{closest(name, tower_names)}"
                )


# ----------------------------------------------------------------------------- native vision (VLM)
TEXT_AFTER_RULES = ("transformers", "qwen")  # VisionTokens.text_after


@dataclass(frozen=True)
class VisionTokens:
    """How a native-resolution tower's inputs enter the LM (the Qwen2-VL family): one
    `image_token_id` per image and one `video_token_id` per clip in the data's ids, each taking
    the tokens of its own size in the LM (`NativeVisionSpec.tokens`); `tokens_per_second`
    (Qwen2.5-VL) spaces a clip's time positions by its seconds (None: one per time step).
    `start_id` / `end_id`: the ids the chat format puts around each placeholder
    (`<|vision_start|>`, `<|vision_end|>`), which the data encoder adds; None: none.
    `text_after`: where the text after an image or clip continues (models/mrope.py): "qwen"
    one past its largest position, time included, as the checkpoints were trained (Qwen's
    reference code; vLLM, SGLang, transformers up to 5.2 and transformers' own next-token
    delta); "transformers" at its start plus its larger merged side, time left out, as
    transformers' get_rope_index places prompt text since 5.3. The two differ only after a
    clip whose time positions reach past its sides (docs/VLM.md)."""

    image_token_id: int
    video_token_id: int
    tokens_per_second: float | None = None
    start_id: int | None = None
    end_id: int | None = None
    text_after: str = "qwen"

    def validate(self, path: str, decoder: DecoderSpec) -> None:
        if (self.start_id is None) != (self.end_id is None):
            raise FieldError(f"{path}.end_id", "start_id and end_id go together (both or none)")
        for name in ("image_token_id", "video_token_id", "start_id", "end_id"):
            value = getattr(self, name)
            if value is None:
                continue
            if not 0 <= value < decoder.vocab_size:
                raise FieldError(
                    f"{path}.{name}",
                    f"{value} is outside the vocabulary (0..{decoder.vocab_size - 1})",
                )
        if self.image_token_id == self.video_token_id:
            raise FieldError(f"{path}.video_token_id", "must differ from image_token_id")
        if self.tokens_per_second is not None and self.tokens_per_second <= 0:
            raise FieldError(f"{path}.tokens_per_second", "must be positive")
        check_choice(f"{path}.text_after", self.text_after, TEXT_AFTER_RULES)


# ----------------------------------------------------------------------------- projector (VLM)
@dataclass(frozen=True)
class ProjectorSpec:
    """How images enter a decoder LM (LLaVA): the vision tower's hidden states at
    `feature_layer`, the class token dropped unless `keep_cls`, mapped to the LM's width by a
    linear layer or a two-layer MLP with GELU ("mlp": LLaVA-1.5's mlp2x_gelu), and spliced into
    the text at each `image_token_id` (one placeholder id per image in the data).

    `feature_layer` counts as Hugging Face's `hidden_states` do: 0 is the embeddings (after the
    pre-norm), k the output of block k, negative from the end (-1: the last block, -2: the one
    before, LLaVA's choice). The tower's final norm is not applied (HF's post_layernorm is not
    either); blocks after the feature layer are kept (checkpoints hold them) but never run."""

    image_token_id: int
    kind: str = "mlp"
    feature_layer: int = -2
    keep_cls: bool = False
    tower: str = "image"

    def blocks_used(self, tower: TowerSpec) -> int:
        """How many of the tower's blocks run to reach the feature layer."""
        return (
            self.feature_layer if self.feature_layer >= 0 else tower.layers + 1 + self.feature_layer
        )

    def image_tokens(self, tower: TowerSpec) -> int:
        """Positions one image takes in the LM."""
        return tower.stem.patches() + int(self.keep_cls and tower.has_cls_token())

    def params(self, vision_width: int, lm_width: int) -> int:
        first = vision_width * lm_width + lm_width
        return first if self.kind == "linear" else first + lm_width * lm_width + lm_width

    def flops(self, tower: TowerSpec, lm_width: int) -> int:
        """Forward FLOPs per image: the vision tower up to the feature layer, then the projector."""
        return self.vision_flops(tower) + self.mapping_flops(tower, lm_width)

    def vision_flops(self, tower: TowerSpec) -> int:
        """Forward FLOPs per image of the vision tower's stem and blocks up to the feature layer."""
        stem = 2 * tower.stem.patches() * tower.stem.patch_dim() * tower.width
        return stem + self.blocks_used(tower) * tower.block_flops()

    def mapping_flops(self, tower: TowerSpec, lm_width: int) -> int:
        """Forward FLOPs per image of the projector's own matmuls."""
        mats = tower.width * lm_width + (lm_width * lm_width if self.kind == "mlp" else 0)
        return 2 * self.image_tokens(tower) * mats

    def validate(self, path: str, towers: dict[str, TowerSpec], decoder: DecoderSpec) -> None:
        check_choice(f"{path}.kind", self.kind, PROJECTORS)
        if self.tower not in towers:
            raise FieldError(
                f"{path}.tower",
                f"no tower named {self.tower!r}{closest(self.tower, list(towers))}",
            )
        tower = towers[self.tower]
        if tower.modality != "image":
            raise FieldError(
                f"{path}.tower",
                f"{self.tower!r} is a {tower.modality} tower; the projector takes an image tower",
            )
        if not 0 <= self.blocks_used(tower) <= tower.layers:
            raise FieldError(
                f"{path}.feature_layer",
                f"{self.feature_layer} is outside the tower's hidden states "
                f"({-(tower.layers + 1)} .. {tower.layers})",
            )
        if not 0 <= self.image_token_id < decoder.vocab_size:
            raise FieldError(
                f"{path}.image_token_id",
                f"{self.image_token_id} is not an id of the {decoder.vocab_size}-token vocabulary",
            )


# ----------------------------------------------------------------------------- training FLOPs
@dataclass(frozen=True)
class PartTraining:
    """How one part trains: `mode` (train, frozen, lora) and, for partial freezing (frozen
    stem and first blocks), the share of its blocks that train."""

    mode: str = "train"
    trained_share: float = 1.0


def train_flops(
    forward: Mapping[str, float],
    modes: Mapping[str, str | PartTraining] | None = None,
    *,
    chained: bool = False,
    recompute: Collection[str] = (),
) -> float:
    """Model FLOPs of one training pass over parts whose forward FLOPs are `forward` (in
    forward order); the one definition the planner's MFU and the trainer's share.

    Backward costs about twice the forward, once for the input gradients and once for the
    weight gradients (PaLM App. B's 6N per token). So a trained part costs 3x its forward; a
    frozen part 1x, or 2x when a gradient must pass through it to a trained part before it
    (`chained`: each part feeds the next, as in a VLM); a LoRA part 2x (forward and input
    gradients down to its first adapter; the adapters' own FLOPs are negligible); the frozen
    front of a partially frozen part like a frozen part. Parts missing from `modes` train.

    Recomputation is not model work (MFU excludes it): `recompute` names the parts whose
    blocks run their forward again in backward, and the result then counts hardware FLOPs
    (HFU), one more forward of each such part's blocks that keep activations: its trained
    ones, and its frozen ones when a gradient passes through them (else they keep nothing).
    """
    modes = modes or {}
    total = 0.0
    upstream = False  # an earlier part trains, so a gradient flows back through this one
    for name, flops in forward.items():
        part = modes.get(name, PartTraining())
        part = PartTraining(part) if isinstance(part, str) else part
        check_choice(f"train.towers.{name}.mode", part.mode, TRAIN_MODES)
        passes = 2 if upstream else 1  # forward, and the input gradient when one flows
        share = part.trained_share if part.mode == "train" else 0.0
        factor = {"train": 3 * share + passes * (1 - share), "lora": 2, "frozen": passes}
        total += factor[part.mode] * flops
        if name in recompute and (part.mode != "frozen" or upstream):
            # the blocks that keep activations recompute: a gradient passing through keeps
            # them in frozen blocks too
            total += flops * (share if part.mode == "train" and not upstream else 1.0)
        upstream = chained and (upstream or part.mode != "frozen")
    return total


# ----------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSpec:
    """Towers by name (the name is the batch key; usually the modality), the shared embedding
    width, the contrastive objective over `pairs`, and an optional fusion head.

    A language model sets `decoder` (objective `next_token`, batch key "text"); a
    vision-language model (LLaVA) adds an image tower and the `projector` that splices its
    tokens into the text. Their towers have no pairs and no fusion head. A generator sets
    `denoiser` (a DiT; objective `flow_matching` or `diffusion`) and has no towers."""

    name: str
    embed_dim: int
    towers: dict[str, TowerSpec]
    pairs: list[tuple[str, str]] = field(default_factory=list)
    objective: str = "clip"
    logit_scale_init: float = math.log(1 / 0.07)
    logit_bias_init: float | None = None  # SigLIP: -10
    fusion: FusionSpec | None = None
    decoder: DecoderSpec | None = None
    projector: ProjectorSpec | None = None
    denoiser: DenoiserSpec | None = None
    vision: NativeVisionSpec | None = None  # a native-resolution tower (Qwen2-VL) beside a decoder
    vision_tokens: VisionTokens | None = None
    # A transformers model trained as it is (models/hub/): it has no towers, decoder or
    # projector of mmtrain's; `hub` records its source and counts (hub_spec.py).
    hub: HubSpec | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _positive("", self, "embed_dim")
        if self.hub is not None:
            self._validate_hub()
            return
        if self.denoiser is not None or self.objective in GENERATIVE_OBJECTIVES:
            self._validate_generator()
            return
        if not self.towers and self.decoder is None:
            raise FieldError("towers", "a model needs at least one tower")
        for name, tower in self.towers.items():
            tower.validate(f"towers.{name}", self.embed_dim)
        check_choice("objective", self.objective, OBJECTIVES)
        if self.decoder is not None or self.objective == "next_token":
            self._validate_language_model()
            return
        names = list(self.towers)
        for i, pair in enumerate(self.pairs):
            for j, name in enumerate(pair):
                if name not in self.towers:
                    raise FieldError(
                        f"pairs[{i}][{j}]",
                        f"no tower named {name!r}{closest(name, names)}; towers: {', '.join(names)}",
                    )
            if pair[0] == pair[1]:
                raise FieldError(f"pairs[{i}]", f"a pair needs two different towers, got {pair}")
        # One tower alone is an encoder (e.g. a vision backbone to start a tower from).
        if not self.pairs and self.fusion is None and len(self.towers) > 1:
            raise FieldError(
                "pairs", "give the tower pairs to align (e.g. [[image, text]]) or a fusion head"
            )
        if self.fusion is not None:
            self.fusion.validate("fusion", names)

    def _validate_language_model(self) -> None:
        if self.decoder is None:
            raise FieldError("decoder", "objective next_token needs a decoder (the language model)")
        self.decoder.validate("decoder")
        if self.objective != "next_token":
            raise FieldError(
                "objective", f"a decoder trains with next_token, not {self.objective!r}"
            )
        if self.pairs or self.fusion is not None:
            raise FieldError(
                "pairs" if self.pairs else "fusion",
                "a language model has no contrastive pairs or fusion head",
            )
        if self.vision is not None or self.vision_tokens is not None:
            self._validate_native_vision()
            return
        if self.projector is None:
            if self.towers:
                raise FieldError(
                    "projector",
                    "towers beside a decoder need a projector (how their tokens enter the text)",
                )
            return
        if DECODER_TOWER in self.towers:
            raise FieldError(
                f"towers.{DECODER_TOWER}", "the decoder LM takes this name; rename the tower"
            )
        self.projector.validate("projector", self.towers, self.decoder)
        extra = sorted(set(self.towers) - {self.projector.tower})
        if extra:
            raise FieldError(f"towers.{extra[0]}", "a vision-language model has one image tower")

    def _validate_hub(self) -> None:
        self.hub.validate("hub")
        if self.hub.is_denoiser():
            self._validate_hub_denoiser()
            return
        if self.objective != "next_token":
            raise FieldError(
                "objective", f"a hub model trains with next_token, not {self.objective!r}"
            )
        for name in ("decoder", "projector", "fusion", "denoiser", "vision", "vision_tokens"):
            if getattr(self, name) is not None:
                raise FieldError(name, "a hub model is its transformers class: it has none")
        if self.towers or self.pairs:
            raise FieldError(
                "towers" if self.towers else "pairs",
                "a hub model's towers are its class's (hub.tower_params)",
            )

    def _validate_hub_denoiser(self) -> None:
        """A diffusers denoiser (models/hub/denoiser.py): its `denoiser` describes what it takes
        and predicts (the data and the objective read it); the hub counts its parameters."""
        if self.denoiser is None:
            raise FieldError("denoiser", f"a {self.hub.architecture} needs its inputs described")
        self.denoiser.validate("denoiser")
        if self.objective != "flow_matching" or self.denoiser.prediction != "velocity":
            raise FieldError(
                "objective",
                f"a {self.hub.architecture} trains with flow_matching (a velocity prediction), "
                f"not {self.objective!r} ({self.denoiser.prediction!r})",
            )
        for name in ("decoder", "projector", "fusion", "vision", "vision_tokens"):
            if getattr(self, name) is not None:
                raise FieldError(name, "a hub denoiser is its diffusers class: it has none")
        if self.towers or self.pairs:
            raise FieldError(
                "towers" if self.towers else "pairs",
                "a hub model's towers are its class's (hub.tower_params)",
            )

    def _validate_native_vision(self) -> None:
        if self.vision is None or self.vision_tokens is None:
            missing = "vision" if self.vision is None else "vision_tokens"
            raise FieldError(missing, "a native-resolution VLM needs vision and vision_tokens")
        if self.towers or self.projector is not None:
            raise FieldError(
                "towers" if self.towers else "projector",
                "a native-resolution VLM's vision is its `vision` tower and merger (no towers "
                "or projector beside it)",
            )
        self.vision.validate("vision")
        if self.vision.out_width != self.decoder.width:
            raise FieldError(
                "vision.out_width",
                f"{self.vision.out_width} is not the decoder's width {self.decoder.width}",
            )
        self.vision_tokens.validate("vision_tokens", self.decoder)

    def _validate_generator(self) -> None:
        if self.denoiser is None:
            raise FieldError("denoiser", f"objective {self.objective} needs a denoiser (a DiT)")
        self.denoiser.validate("denoiser")
        predictions = GENERATIVE_OBJECTIVES.get(self.objective)
        if predictions is None:
            raise FieldError(
                "objective",
                f"a denoiser trains with {' or '.join(GENERATIVE_OBJECTIVES)}, not "
                f"{self.objective!r}",
            )
        if self.denoiser.prediction not in predictions:
            raise FieldError(
                "denoiser.prediction",
                f"{self.objective} trains a {' or '.join(predictions)} prediction, not "
                f"{self.denoiser.prediction!r}",
            )
        for name in ("decoder", "projector", "fusion"):
            if getattr(self, name) is not None:
                raise FieldError(name, "a denoiser model has none (it is the whole network)")
        if self.towers or self.pairs:
            raise FieldError(
                "towers" if self.towers else "pairs",
                "a denoiser has no encoder towers: a DiT is conditioned on classes, an MMDiT "
                "(denoiser.architecture: mmdit) on its text encoders' outputs, cached in the "
                "shards as .text_hidden.npy / .text_pooled.npy",
            )

    def tower_names(self) -> list[str]:
        """The model's towers by the names its module and `train.towers` use: the encoders,
        "text" for a decoder LM (the batch key of its ids), "denoiser" for a DiT."""
        if self.hub is not None:
            return self.hub.towers()
        vision = [VISION_TOWER] if self.vision is not None else []
        parts = [*self.towers, *vision, *([DECODER_TOWER] if self.decoder is not None else [])]
        return parts + ([DENOISER_PART] if self.denoiser is not None else [])

    def is_language_model(self) -> bool:
        return self.decoder is not None or (self.hub is not None and self.denoiser is None)

    def is_generator(self) -> bool:
        """A denoiser trained to generate (flow matching or DDPM)."""
        return self.denoiser is not None

    def image_tokens(self) -> int:
        """Positions one image takes in the language model (0 without a projector)."""
        if self.projector is None:
            return 0
        return self.projector.image_tokens(self.towers[self.projector.tower])

    def sequence_flops(self, positions: int, images: int = 0) -> int:
        """Forward FLOPs of a language model for one sequence of `positions` positions (image
        tokens included) holding `images` images."""
        assert self.decoder is not None
        return self.decoder.forward_flops(positions) + images * self.image_flops()

    def image_flops(self) -> int:
        """Forward FLOPs of one image: the vision tower to the feature layer and the projector
        (0 without a projector)."""
        if self.projector is None or self.decoder is None:
            return 0
        return self.projector.flops(self.towers[self.projector.tower], self.decoder.width)

    # -- counts
    def fused_towers(self) -> list[str]:
        if self.fusion is None:
            return []
        return list(self.fusion.towers) or list(self.towers)

    def tower_params(self) -> dict[str, int]:
        if self.hub is not None:
            return dict(self.hub.tower_params)
        return {name: t.params(self.embed_dim) for name, t in self.towers.items()}

    def head_params(self) -> int:
        """Parameters outside the towers: logit scale (and SigLIP's bias), the fusion head, the
        decoder LM and its projector."""
        n = 0
        if self.pairs:
            n += 1 + int(self.logit_bias_init is not None)
        if self.fusion is not None:
            widths = {name: self.towers[name].width for name in self.fused_towers()}
            n += self.fusion.params(widths)
        if self.denoiser is not None:
            n += self.denoiser.params()
        if self.vision is not None:
            n += self.vision.params()
        if self.decoder is not None:
            n += self.decoder.params()
            if self.projector is not None:
                vision = self.towers[self.projector.tower].width
                n += self.projector.params(vision, self.decoder.width)
        return n

    def params(self) -> int:
        return sum(self.tower_params().values()) + self.head_params()

    def tokens_per_sample(self) -> dict[str, int]:
        return {name: t.tokens() for name, t in self.towers.items()}

    def tower_flops(self) -> dict[str, int]:
        return {name: t.flops(self.embed_dim) for name, t in self.towers.items()}

    def forward_flops(self) -> int:
        """Forward FLOPs per sample (one input per tower), fusion head included; a language
        model: one sequence of `decoder.max_positions` positions with one image per image
        tower (the loop counts a step's real positions instead)."""
        return sum(self.forward_flops_by_part().values())

    def forward_flops_by_part(self) -> dict[str, int]:
        """`forward_flops()` split by the parts that train differently, in forward order:
        each tower and the fusion head (`fusion`); a language model: its vision tower,
        `projector` and the decoder (`text`)."""
        if self.decoder is not None:
            positions, images = self.counted_row()
            return self.sequence_flops_by_part([positions], images)
        if self.denoiser is not None:
            return {DENOISER_PART: self.denoiser.forward_flops()}
        parts = dict(self.tower_flops())
        if self.fusion is not None:
            fused = self.fused_towers()
            parts[FUSION_PART] = self.fusion.flops(
                {n: self.towers[n].tokens() for n in fused},
                {n: self.towers[n].width for n in fused},
            )
        return parts

    def counted_row(self) -> tuple[int, int]:
        """The row a language model's `forward_flops()` counts, as (positions, images):
        `decoder.max_positions` positions holding one image per tower with a projector, none
        without (a native-resolution VLM's images have no fixed size)."""
        assert self.decoder is not None
        return self.decoder.max_positions, len(self.towers) if self.projector is not None else 0

    def sequence_flops_by_part(
        self,
        positions: list[int],
        images: int,
        visual: Sequence[tuple[int, int, int]] = (),
    ) -> dict[str, int]:
        """Forward FLOPs of a language model's rows of `positions` positions each (image tokens
        included) holding `images` images in all, by part (see forward_flops_by_part); a
        native-resolution VLM's images and clips are `visual`, (frames, height, width) each at
        the tower's size."""
        assert self.decoder is not None
        parts = {}
        if self.vision is not None:
            parts[VISION_TOWER] = sum(self.vision.forward_flops(h, w, t) for t, h, w in visual)
        if self.projector is not None:
            tower = self.towers[self.projector.tower]
            parts[self.projector.tower] = images * self.projector.vision_flops(tower)
            parts[PROJECTOR_PART] = images * self.projector.mapping_flops(tower, self.decoder.width)
        parts[DECODER_TOWER] = sum(self.decoder.forward_flops(n) for n in positions)
        return parts

    def train_flops(
        self,
        forward: Mapping[str, float],
        modes: Mapping[str, str | PartTraining] | None = None,
        recompute: Collection[str] = (),
    ) -> float:
        """Training FLOPs of this model's parts (`forward`: forward FLOPs by part, from
        forward_flops_by_part or sequence_flops_by_part); see `train_flops`. A language
        model's parts feed each other in order (vision -> projector -> decoder)."""
        return train_flops(forward, modes, chained=self.is_language_model(), recompute=recompute)

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "") -> ModelSpec:
        try:
            return _model_from_dict(data)
        except FieldError as err:
            if source:
                raise FieldError(err.path, f"{err.message} (in {source})") from None
            raise

    def save(self, path: str | Path) -> None:
        path = Path(path)
        data = self.to_dict()
        text = (
            json.dumps(data, indent=2)
            if path.suffix == ".json"
            else yaml.safe_dump(data, sort_keys=False)
        )
        path.write_text(text)

    @classmethod
    def load(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as err:
            raise FieldError("", f"cannot read model spec {path}: {err.strerror}") from None
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as err:
            raise FieldError(
                "", f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {err}"
            ) from None
        return cls.from_dict(data, source=str(path))


def _model_from_dict(data: Any) -> ModelSpec:
    if not isinstance(data, dict):
        raise FieldError("", f"a model spec is a mapping, got {type(data).__name__}")
    data = dict(data)
    if isinstance(data.get("denoiser"), dict):  # a generator: no towers, no shared embedding
        data.setdefault("towers", {})
        data.setdefault("embed_dim", data["denoiser"].get("width", DenoiserSpec.width))
    towers = data.get("towers")
    if not isinstance(towers, dict):
        raise FieldError("towers", "expected a mapping of tower name -> tower spec")
    data["towers"] = {name: _tower_from_dict(t, f"towers.{name}") for name, t in towers.items()}
    if isinstance(data.get("decoder"), dict):
        data["decoder"] = DecoderSpec.from_dict(data["decoder"], "decoder")
    if isinstance(data.get("denoiser"), dict):
        data["denoiser"] = DenoiserSpec.from_dict(data["denoiser"], "denoiser")
    if isinstance(data.get("vision"), dict):
        data["vision"] = NativeVisionSpec.from_dict(data["vision"], "vision")
    return from_dict(ModelSpec, data)


def _tower_from_dict(data: Any, path: str) -> TowerSpec:
    if isinstance(data, TowerSpec):
        return data
    if not isinstance(data, dict):
        raise FieldError(path, "expected a mapping")
    data = dict(data)
    modality = data.get("modality")
    if modality is None:
        raise FieldError(f"{path}.modality", f"missing; one of {', '.join(MODALITIES)}")
    check_choice(f"{path}.modality", modality, MODALITIES)
    data["stem"] = from_dict(STEMS[modality], data.get("stem") or {}, f"{path}.stem")
    return from_dict(TowerSpec, data, path)


def _positive(path: str, obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise FieldError(f"{path}.{name}" if path else name, f"must be positive, got {value}")


# ----------------------------------------------------------------------------- presets
def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_spec(name_or_path: str | Path) -> ModelSpec:
    """A preset by name (case-insensitive: `ViT-B-32`, `vit-b-32`) or a YAML/JSON spec file."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    text = str(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return ModelSpec.load(path)
    by_lower = {n.lower(): n for n in preset_names()}
    if text.lower() not in by_lower:
        raise FieldError(
            "model",
            f"unknown preset {text!r}{closest(text, preset_names())}; presets: {', '.join(preset_names())}",
        )
    return ModelSpec.load(PRESET_DIR / f"{by_lower[text.lower()]}.yaml")


def with_tower(spec: ModelSpec, name: str, **changes: Any) -> ModelSpec:
    """A copy of `spec` with fields of one tower (or its stem, via `stem={...}`) changed."""
    tower = spec.towers[name]
    if "stem" in changes and isinstance(changes["stem"], dict):
        changes["stem"] = replace(tower.stem, **changes["stem"])
    towers = dict(spec.towers)
    towers[name] = replace(tower, **changes)
    return replace(spec, towers=towers)


def with_input_sizes(
    spec: ModelSpec,
    image_size: int | None = None,
    frames: int | None = None,
    context: int | None = None,
) -> ModelSpec:
    """`spec` with every image/video tower at `image_size`, video towers at `frames` frames and
    text towers at `context` tokens (None leaves a size as it is): the planner's size flags."""
    for tower_name, tower in spec.towers.items():
        stem: dict[str, int] = {}
        if image_size and tower.modality in ("image", "video"):
            stem["image_size"] = image_size
        if frames and tower.modality == "video":
            stem["frames"] = frames
        if context and tower.modality == "text":
            stem["context_length"] = context
        if stem:
            spec = with_tower(spec, tower_name, stem=stem)
    return spec
