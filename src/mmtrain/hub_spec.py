"""What the spec of a hub model records: a transformers model trained as it is (models/hub/).

A hub model is transformers' own module class, built from the config.json of a user's folder
(or a name in the Hugging Face cache). Its spec is not a description mmtrain builds from (the
folder is); it records where the model comes from and what the meta-device build counted, so
the run folder, checkpoints, the resume check and the planner all say what was trained.
Torch-free, like spec.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mmtrain.structured import FieldError

HUB_TOWERS = ("vision", "text")  # the towers a hub model has (`train.towers` keys), in order
# A diffusers denoiser's towers (models/hub/denoiser.py): FLUX's double-stream blocks (with
# every part outside the blocks) and its single-stream blocks, each wrapped block by block.
DENOISER_TOWERS = ("denoiser", "denoiser_single")


@dataclass(frozen=True)
class HubSpec:
    """A transformers model by its source and class, with its counts per tower."""

    source: str  # the folder (absolute) or the hub name `org/name` the run started from
    architecture: str  # the transformers class (config.json's `architectures[0]`)
    model_type: str
    # Parameters of each tower, exact, from the meta-device build: "vision" (the visual
    # encoder with its merger / projector) and "text" (the language model with its head).
    tower_params: dict[str, int] = field(default_factory=dict)
    text_width: int = 0  # the language model's hidden size
    text_layers: int = 0
    vocab_size: int = 0
    tied_embeddings: bool = False  # the head shares the token embedding's weight
    # A diffusers denoiser (architecture in DENOISER_FAMILIES; `source` a pipeline folder):
    # whether it embeds the guidance scale (FLUX.1-dev), fed `train.diffusion.guidance`.
    guidance: bool = False

    def validate(self, path: str = "hub") -> None:
        if not self.source:
            raise FieldError(f"{path}.source", "a hub model needs the folder or name it comes from")
        names, needed = (
            (DENOISER_TOWERS, "denoiser") if self.is_denoiser() else (HUB_TOWERS, "text")
        )
        unknown = sorted(set(self.tower_params) - set(names))
        if unknown:
            raise FieldError(
                f"{path}.tower_params.{unknown[0]}",
                f"a {self.architecture}'s towers are {', '.join(names)}",
            )
        if needed not in self.tower_params:
            what = "a denoiser" if self.is_denoiser() else "a language model"
            raise FieldError(f"{path}.tower_params", f"a hub model has {what} ({needed})")
        if self.guidance and not self.is_denoiser():
            raise FieldError(f"{path}.guidance", "is for a diffusers denoiser (FLUX.1-dev)")

    def is_denoiser(self) -> bool:
        """A diffusers transformer trained as it is (a pipeline folder's `transformer/`)."""
        return self.architecture in DENOISER_FAMILIES

    def towers(self) -> list[str]:
        names = DENOISER_TOWERS if self.is_denoiser() else HUB_TOWERS
        return [name for name in names if name in self.tower_params]

    def params(self) -> int:
        return sum(self.tower_params.values())


# ----------------------------------------------------------------------------- traces
# What models/hub/trace.py counts of a hub model at one planned shape, for the planner (which
# imports no torch). Saved bytes are of a float32 trace: `floats` elements of floating dtypes
# (4 bytes each in the trace; the planner counts them at the plan's precision) and
# `other_bytes` of integer and boolean tensors (ids, indices, masks), deduplicated by storage.
TRACE_VERSION = 1  # bump when what a trace counts changes: cached traces are then redone


@dataclass(frozen=True)
class HubShape:
    """One planned row of a hub model: `positions` language-model positions (image tokens
    spliced in), `images` images of `image_height` x `image_width` pixels (before the
    processor's resizing)."""

    positions: int
    images: int = 0
    image_height: int = 0
    image_width: int = 0
    # A diffusers denoiser's row (DENOISER_FAMILIES): one sample of `frames` frames (1: an
    # image) of image_height x image_width pixels, `positions` text tokens; 0: not a denoiser.
    frames: int = 0

    def key(self) -> str:
        key = f"s{self.positions}-i{self.images}-{self.image_height}x{self.image_width}"
        return key + (f"-f{self.frames}" if self.frames else "")


@dataclass(frozen=True)
class Saved:
    """Bytes autograd keeps, split as the planner prices them."""

    floats: int = 0  # elements of floating dtypes
    other_bytes: int = 0  # integer and boolean tensors, as held

    def bytes(self, float_bytes: float) -> float:
        return self.floats * float_bytes + self.other_bytes

    def __add__(self, other: Saved) -> Saved:
        return Saved(self.floats + other.floats, self.other_bytes + other.other_bytes)


@dataclass(frozen=True)
class TowerTrace:
    """One tower of a traced hub model, per row of the traced shape.

    Blocks are the tower's `blocks` (models/hub/towers.py); `block_saved[i]` is what block i
    keeps without checkpointing, `attention_saved[i]` the part of it kept inside its attention
    module (what selective checkpointing recomputes), `attention_input` the elements of one
    attention module's input (kept instead), `block_input` those of one block's hidden-state
    input (what full checkpointing keeps per block), `shared_inputs` what the blocks' other
    inputs hold once for all (rotary tables, masks). `outside` is what the tower keeps outside
    its blocks (embeddings, patch projection, merger, final norm, the loss's inputs)."""

    name: str
    tokens: int  # the blocks' sequence length per row (patches of all images; positions)
    forward_flops: int  # per row, torch's FLOP counter (2 x multiply-adds)
    block_flops: tuple[int, ...] = ()
    block_saved: tuple[Saved, ...] = ()
    attention_saved: tuple[Saved, ...] = ()
    attention_input: int = 0
    block_input: int = 0
    shared_inputs: Saved = Saved()
    outside: Saved = Saved()
    # Parameters from the same meta build: one block's (exact, the first block's), the
    # modules before the first block (token table, patch projection), and the (out, in) of
    # one block's linears by group ("attn" in the attention module, "mlp" the rest), what
    # LoRA adapts (train/lora.py's target groups).
    params: int = 0  # the tower's, exact
    unused_params: int = 0  # of them, those the forward never reads (no gradient, no state)
    block_params: int = 0
    stem_params: int = 0
    norm_params: int = 0  # of the tower's parameters, those of norms and embedding tables
    linears: tuple[tuple[str, int, int], ...] = ()
    width: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    mlp_hidden: int = 0

    @property
    def blocks(self) -> int:
        return len(self.block_saved)


@dataclass(frozen=True)
class HubTrace:
    """A hub model traced at `shape` (models/hub/trace.py), with the parts frozen in the trace
    (`frozen`: tower names, and `tower:N` for a tower's first N blocks and its stem)."""

    architecture: str
    shape: HubShape
    towers: tuple[TowerTrace, ...]
    image_tokens: int = 0  # language-model positions the row's images fill
    vocab_size: int = 0
    frozen: tuple[str, ...] = ()
    dtype: str = "float32"
    version: int = TRACE_VERSION
    # A diffusers denoiser's trace: the latent it denoised ([C, T, H, W] of a video, [C, H,
    # W] of an image; `image_tokens` its tokens after patching); empty for a transformers model.
    latent_shape: tuple[int, ...] = ()

    def tower(self, name: str) -> TowerTrace:
        for t in self.towers:
            if t.name == name:
                return t
        raise KeyError(name)

    def forward_flops(self) -> int:
        return sum(t.forward_flops for t in self.towers)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HubTrace:
        def saved(x: dict) -> Saved:
            return Saved(int(x["floats"]), int(x["other_bytes"]))

        towers = []
        for t in d["towers"]:
            t = dict(t)
            for k in ("block_saved", "attention_saved"):
                t[k] = tuple(saved(x) for x in t[k])
            for k in ("shared_inputs", "outside"):
                t[k] = saved(t[k])
            t["block_flops"] = tuple(t["block_flops"])
            t["linears"] = tuple(tuple(x) for x in t["linears"])
            towers.append(TowerTrace(**t))
        return cls(
            architecture=d["architecture"],
            shape=HubShape(**d["shape"]),
            towers=tuple(towers),
            image_tokens=int(d["image_tokens"]),
            vocab_size=int(d["vocab_size"]),
            frozen=tuple(d["frozen"]),
            dtype=d["dtype"],
            version=int(d["version"]),
            latent_shape=tuple(int(n) for n in d.get("latent_shape", ())),
        )


# ----------------------------------------------------------------------------- denoisers
# The diffusers transformers the planner traces (models/hub/denoiser_trace.py), with what their
# pipelines feed them, which their config.json does not say: the VAE's compression and latent
# channels, the text encoders' token count, the pipeline's default sample size.
@dataclass(frozen=True)
class DenoiserFamily:
    pipeline: str  # the diffusers pipeline class that runs it
    temporal: int  # VAE: pixel frames per latent frame after the first (0: an image model)
    spatial: int  # VAE: pixels per latent row and column
    latent_channels: int
    patch: int  # latent rows and columns per token (the transformer's or the pipeline's packing)
    text_tokens: int  # the pipeline's default text length (what `--context` overrides)
    frames: int  # the pipeline's default sample
    height: int
    width: int
    text: str  # what the text tokens are, for the plan's note

    def latent(self, frames: int, height: int, width: int) -> tuple[int, ...]:
        """The VAE latent of a sample, [C, T, H, W] for video ([C, H, W] for an image);
        ValueError naming the rule a size breaks."""
        step = self.spatial * self.patch
        if height < step or width < step or height % step or width % step:
            raise ValueError(
                f"height and width must be multiples of {step} pixels (the VAE's {self.spatial}x "
                f"times the {self.patch}x{self.patch} patch), got {height}x{width}"
            )
        h, w = height // self.spatial, width // self.spatial
        if not self.temporal:
            if frames != 1:
                raise ValueError(f"{self.pipeline} makes images: --frames must be 1, got {frames}")
            return (self.latent_channels, h, w)
        if frames < 1 or (frames - 1) % self.temporal:
            raise ValueError(
                f"the VAE of {self.pipeline} takes 1 + {self.temporal}k frames (1, "
                f"{1 + self.temporal}, ..., 81), got {frames}"
            )
        return (self.latent_channels, 1 + (frames - 1) // self.temporal, h, w)

    def tokens(self, latent: tuple[int, ...]) -> int:
        frames = latent[1] if len(latent) == 4 else 1
        return frames * (latent[-2] // self.patch) * (latent[-1] // self.patch)


DENOISER_FAMILIES = {
    # WanPipeline: AutoencoderKLWan (4x temporal, 8x spatial, 16 channels); UMT5-XXL's hidden
    # states padded to max_sequence_length 512; 81 x 480 x 832 by default; patch (1, 2, 2).
    "WanTransformer3DModel": DenoiserFamily(
        pipeline="WanPipeline",
        temporal=4,
        spatial=8,
        latent_channels=16,
        patch=2,
        text_tokens=512,
        frames=81,
        height=480,
        width=832,
        text="UMT5-XXL hidden states (512 tokens, text_dim wide) in every block's cross-attention",
    ),
    # FluxPipeline: a 16-channel VAE at 8x, latents packed 2x2 into 64-wide tokens; T5-XXL's
    # hidden states (max_sequence_length 512) and CLIP-L's pooled vector; the guidance scale.
    "FluxTransformer2DModel": DenoiserFamily(
        pipeline="FluxPipeline",
        temporal=0,
        spatial=8,
        latent_channels=16,
        patch=2,
        text_tokens=512,
        frames=1,
        height=1024,
        width=1024,
        text="T5-XXL hidden states (512 tokens) in the joint attention, CLIP-L's pooled "
        "vector and the guidance scale in the conditioning",
    ),
    # StableDiffusion3Pipeline: a 16-channel VAE at 8x, patch 2; CLIP-L and CLIP-G's hidden
    # states (77 tokens, padded to 4096 wide) before T5-XXL's (max_sequence_length 256): 333
    # tokens; the two CLIPs' pooled vectors (768 + 1280).
    "SD3Transformer2DModel": DenoiserFamily(
        pipeline="StableDiffusion3Pipeline",
        temporal=0,
        spatial=8,
        latent_channels=16,
        patch=2,
        text_tokens=333,
        frames=1,
        height=1024,
        width=1024,
        text="CLIP-L + CLIP-G (77) and T5-XXL (256) hidden states in the joint attention, "
        "the pooled CLIPs (2048) in the conditioning",
    ),
    # LTXPipeline: AutoencoderKLLTXVideo (patch 4 x 2^3 = 32x spatial, 2^3 = 8x temporal, 128
    # channels), the transformer's patch 1 (latents packed 1 x 1 x 1 per token); T5-XXL's hidden
    # states and mask (max_sequence_length 128); 161 x 512 x 704 by default.
    "LTXVideoTransformer3DModel": DenoiserFamily(
        pipeline="LTXPipeline",
        temporal=8,
        spatial=32,
        latent_channels=128,
        patch=1,
        text_tokens=128,
        frames=161,
        height=512,
        width=704,
        text="T5-XXL hidden states (128 tokens) with their mask in every block's cross-attention",
    ),
    # CogVideoXPipeline: AutoencoderKLCogVideoX (2^(4 - 1) = 8x spatial, temporal_compression_ratio
    # 4, 16 channels), patch 2; T5-XXL's hidden states (max_sequence_length 226); the
    # transformer's sample_frames x sample_height x 8 x sample_width x 8, 49 x 480 x 720.
    "CogVideoXTransformer3DModel": DenoiserFamily(
        pipeline="CogVideoXPipeline",
        temporal=4,
        spatial=8,
        latent_channels=16,
        patch=2,
        text_tokens=226,
        frames=49,
        height=480,
        width=720,
        text="T5-XXL hidden states (226 tokens) in the full attention beside the video tokens",
    ),
    # HunyuanVideoPipeline: AutoencoderKLHunyuanVideo (8x spatial, 4x temporal, 16 channels),
    # patch 2 (1 in time); the Llama encoder's hidden states (max_sequence_length 256 after the
    # prompt template's 95 tokens are cropped) with their mask, CLIP-L's pooled vector, the
    # embedded guidance scale; 129 x 720 x 1280 by default.
    "HunyuanVideoTransformer3DModel": DenoiserFamily(
        pipeline="HunyuanVideoPipeline",
        temporal=4,
        spatial=8,
        latent_channels=16,
        patch=2,
        text_tokens=256,
        frames=129,
        height=720,
        width=1280,
        text="Llama hidden states (256 tokens, refined) in the joint attention, CLIP-L's "
        "pooled vector and the guidance scale in the conditioning",
    ),
}
