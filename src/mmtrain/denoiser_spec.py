"""The description of a diffusion transformer (DiT), as data.

`DenoiserSpec` is to a generator what `DecoderSpec` is to an LM: the planner counts parameters
and FLOPs from it alone (no torch here, like spec.py), `mmtrain.models.dit` builds the same shape
as a module, and a test holds the two together (the built module's parameter count equals
`DenoiserSpec.params()`).

The network is the DiT of Peebles & Xie 2023 ("Scalable Diffusion Models with Transformers",
arXiv 2212.09748), with its adaLN-Zero conditioning: the noisy input [C, H, W] (pixels, or the
latents of a VAE) is cut into p x p patches with fixed 2-D sine-cosine positions; the timestep
(a sinusoidal embedding through a two-layer MLP) plus a class embedding form one conditioning
vector c; each block regresses from c a shift, scale and gate for its attention and its MLP (the
gates start at zero, so every block starts as the identity); a final adaLN and linear layer map
each token back to its patch. With `num_classes`, the class table has one more row, the "no
class" a classifier-free-guidance dropout trains.

`prediction` is what the network outputs: `velocity` (rectified flow / flow matching: the
direction from data to noise, Liu et al. 2022, Esser et al. 2024), `epsilon` (the noise, DDPM,
Ho et al. 2020) or `v` (v-prediction, Salimans & Ho 2022). `learn_sigma` doubles the output
channels as DiT's checkpoints do (the second half interpolates the DDPM variance); a flow model
has no use for it.

A video DiT (`frames` > 1; Latte, Ma et al. 2024, its full-attention variant) cuts the clip
[C, T, H, W] into `temporal_patch` x p x p tubes and attends over all of them at once; its fixed
positions are the sum of the 2-D spatial ones and a 1-D temporal one. The clean sample is then
"video" pixels or a "latent" of [C, T, H, W].

An MMDiT (`architecture: mmdit`; Esser et al. 2024, "Scaling Rectified Flow Transformers",
arXiv 2403.03206, SD3's `SD3Transformer2DModel`) is conditioned on a text encoder's outputs,
cached beside the latents: its hidden states [L, text_width] enter as `text_tokens` tokens of
their own stream (a linear layer to the width), and the pooled text vector [pooled_width]
through a two-layer MLP is added to the timestep's, forming c. Each block holds two sets of
weights, one per stream (adaLN-Zero modulation, q/k/v, output, MLP), and one attention over
the image and text tokens together; the last block's text stream only gives keys and values
(SD3's `context_pre_only`: no text output, MLP or gates, a scale and shift alone). SD3 crops
its positions out of a larger fixed grid (`pos_embed_max_size`), and SD3.5 adds an RMSNorm of
each head's q and k (`qk_norm: rms_norm`).

`sample_size` (and `frames`) is the size the spec counts and the planner plans; the network
takes any size its patches divide (`grid_of`: shape buckets, data/stream/buckets.py), and
`tokens`, `block_flops` and `forward_flops` take that size too.

Counting conventions are spec.py's: FLOPs are 2 x multiply-adds of matmuls and attention (norms,
softmax, modulation and bias adds left out), attention counted in full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmtrain.structured import FieldError, check_choice, from_dict, to_dict

PREDICTIONS = ("velocity", "epsilon", "v")
ATTENTIONS = ("full", "factorised")  # a video DiT: every tube with every other, or in turns
INPUTS = ("image", "video", "latent")  # the batch key of the clean sample
# class-conditional DiT, SD3's joint image-text MMDiT, or a DiT whose blocks cross-attend the
# text (Wan 2.x: trained as diffusers' own class from its pipeline folder, models/hub/)
ARCHITECTURES = ("dit", "mmdit", "cross_attention")
QK_NORMS = ("none", "rms_norm")  # an MMDiT's per-head norm of q and k (SD3.5: rms_norm)
MMDIT_ONLY = ("text_width", "pooled_width", "text_tokens", "pos_embed_max_size")
TIMESTEP_FREQUENCIES = 256  # sinusoidal features of the timestep before its MLP (DiT's)


@dataclass(frozen=True)
class DenoiserSpec:
    sample_size: int = 32  # side of the (square) input: pixels, or latent positions
    channels: int = 4  # input channels: 3 for pixels, 4 for an SD-style VAE's latents
    patch_size: int = 2
    width: int = 1152
    layers: int = 28
    heads: int = 16
    mlp_ratio: float = 4.0
    num_classes: int = 0  # class-conditional when > 0 (plus one "no class" row); 0: none
    learn_sigma: bool = False
    prediction: str = "velocity"
    input: str = "image"
    frames: int = 1  # > 1: a video DiT over clips of this many frames (or latent frames)
    temporal_patch: int = 1  # frames per patch (a tube of temporal_patch x p x p)
    # factorised: even blocks attend within a frame, odd ones across frames at one place
    # (Latte's interleaved variant): attention costs T S^2 + S T^2 instead of (T S)^2
    attention: str = "full"
    norm_eps: float = 1e-6  # the attention's and the output's norms (DiT's)
    mlp_norm_eps: float = 1e-6  # the MLP's norm (diffusers' DiT configs: their norm_eps, 1e-5)
    architecture: str = "dit"
    text_width: int = 0  # mmdit: the text encoder's hidden width (diffusers' joint_attention_dim)
    pooled_width: int = 0  # mmdit: the pooled text vector's (pooled_projection_dim)
    text_tokens: int = 0  # mmdit: text tokens per sample (SD3: 77 CLIP + 256 T5 = 333)
    qk_norm: str = "none"
    # mmdit: side of the fixed position grid the sample's grid is the centre of (SD3: 192 for
    # 64 x 64 patches, so one checkpoint serves several sizes); 0: the sample's own grid
    pos_embed_max_size: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, path: str = "denoiser") -> None:
        for name in ("sample_size", "channels", "patch_size", "width", "layers", "heads"):
            if getattr(self, name) <= 0:
                raise FieldError(f"{path}.{name}", f"must be positive, got {getattr(self, name)}")
        if self.sample_size % self.patch_size:
            raise FieldError(
                f"{path}.patch_size",
                f"{self.patch_size} does not divide sample_size {self.sample_size}",
            )
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise FieldError(
                f"{path}.heads", f"{self.heads} heads must split width {self.width} evenly"
            )
        if self.width % 4:
            raise FieldError(f"{path}.width", "must be a multiple of 4 (2-D sine-cosine positions)")
        if self.num_classes < 0:
            raise FieldError(f"{path}.num_classes", f"must be 0 or more, got {self.num_classes}")
        if self.mlp_ratio <= 0:
            raise FieldError(f"{path}.mlp_ratio", f"must be positive, got {self.mlp_ratio}")
        check_choice(f"{path}.prediction", self.prediction, PREDICTIONS)
        check_choice(f"{path}.input", self.input, INPUTS)
        if self.frames < 1 or self.temporal_patch < 1 or self.frames % self.temporal_patch:
            raise FieldError(
                f"{path}.temporal_patch",
                f"{self.temporal_patch} does not divide frames {self.frames}",
            )
        check_choice(f"{path}.attention", self.attention, ATTENTIONS)
        if self.attention == "factorised" and self.time_grid() < 2:
            raise FieldError(
                f"{path}.attention", "factorised attention needs 2 patches in time or more"
            )
        if (self.input == "video") != (self.frames > 1) and self.input != "latent":
            raise FieldError(
                f"{path}.input",
                f"{self.input!r} with frames {self.frames}: video takes frames > 1, image frames 1",
            )
        check_choice(f"{path}.architecture", self.architecture, ARCHITECTURES)
        check_choice(f"{path}.qk_norm", self.qk_norm, QK_NORMS)
        if self.is_mmdit():
            self._validate_mmdit(path)
            return
        if self.architecture == "cross_attention":
            self._validate_cross_attention(path)
            return
        for name in (*MMDIT_ONLY, "qk_norm"):
            if getattr(self, name) != getattr(DenoiserSpec, name):
                raise FieldError(f"{path}.{name}", "is for architecture mmdit (a DiT has no text)")

    def _validate_mmdit(self, path: str) -> None:
        for name in ("text_width", "pooled_width", "text_tokens"):
            if getattr(self, name) <= 0:
                raise FieldError(f"{path}.{name}", f"an MMDiT needs it positive, got "
                                 f"{getattr(self, name)}")  # fmt: skip
        refused = {
            "num_classes": (self.num_classes, "an MMDiT is conditioned on text, not classes"),
            "frames": (self.frames != 1, "an MMDiT is an image model (frames 1)"),
            "learn_sigma": (self.learn_sigma, "an MMDiT has no learned-sigma channels"),
            "attention": (self.attention != "full", "an MMDiT attends over all tokens"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise FieldError(f"{path}.{name}", why)
        if self.pos_embed_max_size and self.pos_embed_max_size < self.grid():
            raise FieldError(
                f"{path}.pos_embed_max_size",
                f"{self.pos_embed_max_size} is smaller than the sample's grid of {self.grid()}",
            )

    def _validate_cross_attention(self, path: str) -> None:
        for name in ("text_width", "text_tokens"):
            if getattr(self, name) <= 0:
                raise FieldError(f"{path}.{name}", f"a cross-attention DiT needs it positive, got "
                                 f"{getattr(self, name)}")  # fmt: skip
        refused = {
            "pooled_width": (self.pooled_width, "a cross-attention DiT takes no pooled text"),
            "num_classes": (self.num_classes, "a cross-attention DiT is conditioned on text"),
            "learn_sigma": (self.learn_sigma, "a cross-attention DiT has no learned-sigma channels"),
            "pos_embed_max_size": (self.pos_embed_max_size, "is an MMDiT's (SD3's)"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise FieldError(f"{path}.{name}", why)

    # -- shapes
    def grid(self) -> int:
        return self.sample_size // self.patch_size

    def is_video(self) -> bool:
        return self.frames > 1

    def time_grid(self) -> int:
        return self.frames // self.temporal_patch

    def size(self) -> tuple[int, ...]:
        """The spec's own sample size: (H, W), or (T, H, W) for a video DiT."""
        s = self.sample_size
        return (self.frames, s, s) if self.is_video() else (s, s)

    def grid_of(self, size: Sequence[int] | None = None) -> tuple[int, int, int]:
        """(time, rows, columns) of the patches of a sample of `size` (H, W) or (T, H, W) (the
        network takes any size the patch divides: shape buckets; default the spec's own).
        ValueError naming the side the patch does not divide."""
        size = tuple(self.size() if size is None else size)
        if len(size) != len(self.size()):
            kind = "(T, H, W)" if self.is_video() else "(H, W)"
            raise ValueError(f"the denoiser takes samples of size {kind}, got {list(size)}")
        frames, height, width = size if self.is_video() else (1, *size)
        for side, value, step in (("height", height, self.patch_size),
                                  ("width", width, self.patch_size),
                                  ("frames", frames, self.temporal_patch)):  # fmt: skip
            if value <= 0 or value % step:
                raise ValueError(f"a sample's {side} {value} is not a positive multiple of "
                                 f"{step} (the denoiser's patch)")  # fmt: skip
        return frames // self.temporal_patch, height // self.patch_size, width // self.patch_size

    def tokens(self, size: Sequence[int] | None = None) -> int:
        return math.prod(self.grid_of(size))

    def patch_volume(self) -> int:
        """Positions of one patch: temporal_patch x p x p."""
        return self.temporal_patch * self.patch_size**2

    def patch_dim(self) -> int:
        return self.channels * self.patch_volume()

    def sample_shape(self, size: Sequence[int] | None = None) -> tuple[int, ...]:
        """[C, H, W], or [C, T, H, W] for a video DiT: one clean sample (of `size`)."""
        return (self.channels, *(self.size() if size is None else size))

    def is_mmdit(self) -> bool:
        return self.architecture == "mmdit"

    def takes_text(self) -> bool:
        """Conditioned on a text encoder's cached outputs (an MMDiT, a cross-attention DiT)."""
        return self.architecture in ("mmdit", "cross_attention")

    def text_members(self) -> tuple[str, ...]:
        """The batch keys of the text it takes: the hidden states, and the pooled vector where
        it takes one (an MMDiT; Wan's cross-attention takes the hidden states alone)."""
        if not self.takes_text():
            return ()
        return ("text_hidden", "text_pooled") if self.pooled_width else ("text_hidden",)

    def position_grid(self) -> int:
        """Side of the fixed position grid the sample's positions are the centre of."""
        return self.pos_embed_max_size or self.grid()

    def is_context_pre_only(self, block: int) -> bool:
        """An MMDiT's last block: its text stream gives keys and values, nothing after."""
        return self.is_mmdit() and block == self.layers - 1

    def head_dim(self) -> int:
        return self.width // self.heads

    def out_channels(self) -> int:
        return self.channels * (2 if self.learn_sigma else 1)

    def mlp_hidden(self) -> int:
        return int(self.width * self.mlp_ratio)

    # -- counts
    def embedding_params(self) -> int:
        """Patch embedding, timestep MLP, class table (positions are fixed, not learned)."""
        w = self.width
        patch = self.patch_dim() * w + w
        timestep = TIMESTEP_FREQUENCIES * w + w + w * w + w
        classes = (self.num_classes + 1) * w if self.num_classes else 0
        if not self.is_mmdit():
            return patch + timestep + classes
        pooled = self.pooled_width * w + w + w * w + w  # the pooled text's MLP
        context = self.text_width * w + w  # the text's hidden states to the width
        return patch + timestep + pooled + context

    def qk_norm_params(self) -> int:
        """One stream's per-head norms of q and k (a weight of head_dim each)."""
        return 2 * self.head_dim() if self.qk_norm == "rms_norm" else 0

    def block_params(self, block: int = 0) -> int:
        """Parameters of block `block`: an MMDiT's hold one set per stream (the last block's
        text stream only its q/k/v and a scale-and-shift modulation)."""
        w, h = self.width, self.mlp_hidden()
        modulation = w * 6 * w + 6 * w  # shift, scale, gate for attention and MLP
        attention = w * 3 * w + 3 * w + w * w + w
        mlp = w * h + h + h * w + w
        stream = modulation + attention + mlp + self.qk_norm_params()  # norms: no weights
        if not self.is_mmdit():
            return stream
        if not self.is_context_pre_only(block):
            return 2 * stream
        qkv_only = w * 3 * w + 3 * w + self.qk_norm_params()
        return stream + (w * 2 * w + 2 * w) + qkv_only

    def final_params(self) -> int:
        w, out = self.width, self.out_channels() * self.patch_volume()
        return w * 2 * w + 2 * w + w * out + out

    def params(self) -> int:
        blocks = sum(self.block_params(i) for i in range(self.layers))
        return self.embedding_params() + blocks + self.final_params()

    def attention_group(self, block: int) -> str:
        """What block `block` attends over: "all" tokens, a "frame" or a "place" (factorised)."""
        if self.attention == "full":
            return "all"
        return "frame" if block % 2 == 0 else "place"

    def block_flops(self, block: int = 0, size: Sequence[int] | None = None) -> int:
        """Forward FLOPs of block `block` for one sample (of `size`, default the spec's)."""
        w, h = self.width, self.mlp_hidden()
        time, rows, cols = self.grid_of(size)
        t = time * rows * cols
        per_token = 3 * w * w + w * w + 2 * w * h
        if self.is_mmdit():
            return self._mmdit_block_flops(block, per_token, t)
        group = {"all": t, "frame": rows * cols, "place": time}
        attention = 4 * t * group[self.attention_group(block)] * w  # groups of g tokens: t g
        return 2 * t * per_token + attention + 2 * w * 6 * w

    def _mmdit_block_flops(self, block: int, per_token: int, t: int) -> int:
        """Both streams' projections, one attention over image and text tokens together; the
        last block's text gives keys and values (its q is computed, unused), so only the image
        tokens query and its text stream has nothing after the attention."""
        n, w = self.text_tokens, self.width
        if not self.is_context_pre_only(block):
            return 2 * (t + n) * per_token + 4 * (t + n) ** 2 * w + 2 * 2 * w * 6 * w
        text = 2 * n * 3 * w * w
        return 2 * t * per_token + text + 4 * t * (t + n) * w + 2 * w * (6 + 2) * w

    def forward_flops(self, size: Sequence[int] | None = None) -> int:
        """Forward FLOPs of one sample (of `size`): embeddings, blocks, final layer."""
        t, w = self.tokens(size), self.width
        embed = 2 * t * self.patch_dim() * w + 2 * (TIMESTEP_FREQUENCIES * w + w * w)
        if self.is_mmdit():  # the pooled text's MLP, the text's projection to the width
            embed += (
                2 * (self.pooled_width * w + w * w) + 2 * self.text_tokens * self.text_width * w
            )
        final = 2 * w * 2 * w + 2 * t * w * self.out_channels() * self.patch_volume()
        blocks = sum(self.block_flops(i, size) for i in range(self.layers))
        return embed + blocks + final

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "denoiser") -> DenoiserSpec:
        return from_dict(cls, data, path)
