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

Counting conventions are spec.py's: FLOPs are 2 x multiply-adds of matmuls and attention (norms,
softmax, modulation and bias adds left out), attention counted in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmtrain.structured import FieldError, check_choice, from_dict, to_dict

PREDICTIONS = ("velocity", "epsilon", "v")
ATTENTIONS = ("full", "factorised")  # a video DiT: every tube with every other, or in turns
INPUTS = ("image", "video", "latent")  # the batch key of the clean sample
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

    # -- shapes
    def grid(self) -> int:
        return self.sample_size // self.patch_size

    def is_video(self) -> bool:
        return self.frames > 1

    def time_grid(self) -> int:
        return self.frames // self.temporal_patch

    def tokens(self) -> int:
        return self.time_grid() * self.grid() ** 2

    def patch_volume(self) -> int:
        """Positions of one patch: temporal_patch x p x p."""
        return self.temporal_patch * self.patch_size**2

    def patch_dim(self) -> int:
        return self.channels * self.patch_volume()

    def sample_shape(self) -> tuple[int, ...]:
        """[C, H, W], or [C, T, H, W] for a video DiT: one clean sample."""
        s = self.sample_size
        return (self.channels, self.frames, s, s) if self.is_video() else (self.channels, s, s)

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
        return patch + timestep + classes

    def block_params(self) -> int:
        w, h = self.width, self.mlp_hidden()
        modulation = w * 6 * w + 6 * w  # shift, scale, gate for attention and MLP
        attention = w * 3 * w + 3 * w + w * w + w
        mlp = w * h + h + h * w + w
        return modulation + attention + mlp  # its norms have no weights (adaLN gives them)

    def final_params(self) -> int:
        w, out = self.width, self.out_channels() * self.patch_volume()
        return w * 2 * w + 2 * w + w * out + out

    def params(self) -> int:
        return self.embedding_params() + self.layers * self.block_params() + self.final_params()

    def attention_group(self, block: int) -> str:
        """What block `block` attends over: "all" tokens, a "frame" or a "place" (factorised)."""
        if self.attention == "full":
            return "all"
        return "frame" if block % 2 == 0 else "place"

    def block_flops(self, block: int = 0) -> int:
        """Forward FLOPs of block `block` for one sample."""
        t, w, h = self.tokens(), self.width, self.mlp_hidden()
        per_token = 3 * w * w + w * w + 2 * w * h
        group = {"all": t, "frame": self.grid() ** 2, "place": self.time_grid()}
        attention = 4 * t * group[self.attention_group(block)] * w  # groups of g tokens: t g
        return 2 * t * per_token + attention + 2 * w * 6 * w

    def forward_flops(self) -> int:
        """Forward FLOPs of one sample: embeddings, blocks, final layer."""
        t, w = self.tokens(), self.width
        embed = 2 * t * self.patch_dim() * w + 2 * (TIMESTEP_FREQUENCIES * w + w * w)
        final = 2 * w * 2 * w + 2 * t * w * self.out_channels() * self.patch_volume()
        return embed + sum(self.block_flops(i) for i in range(self.layers)) + final

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "denoiser") -> DenoiserSpec:
        return from_dict(cls, data, path)
