"""A diffusion transformer (DiT) built from a `DenoiserSpec` (denoiser_spec.py says what it is).

    DiffusionModel(spec).predict({"image": x_t, "timestep": t, "class": y}) -> [B, C', H, W]
    DiffusionModel(spec).predict({"latent": x_t, "timestep": t, "text_hidden": h,
                                  "text_pooled": p}) -> [B, C, H, W]      (an MMDiT, mmdit.py)

`x_t` is the noisy sample under the spec's input key ("image" pixels or "latent"), `t` the
timestep per sample as a float (in [0, 1000): a flow model's t in [0, 1] times 1000, a DDPM
step index as is), `y` int64 class ids (`num_classes` means "no class", what guidance dropout
feeds). The output is what `prediction` names, with DiT's learned-variance channels after it
when `learn_sigma`. `forward(batch)` returns {"prediction": that}, as other models return dicts.

The network is under `towers["denoiser"]` (its blocks at `.blocks`), so the trainer's
per-tower freezing, LoRA (`attn.qkv`, `attn.out`, `mlp.fc1`, `mlp.fc2`), activation
checkpointing, compile and FSDP apply to it as to any tower. Conventions that a checkpoint's
numbers depend on follow diffusers' `DiTTransformer2DModel`, so its checkpoints convert by
renaming: the timestep's sinusoid is [cos, sin] with frequencies exp(-ln(1e4) i / (half - 1)),
norms have no weights (eps 1e-6), the MLP's GELU is the tanh approximation, and the 2-D
positions are sine-cosine over (row, column), column features first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.denoiser_spec import TIMESTEP_FREQUENCIES, DenoiserSpec
from mmtrain.models.init_rules import apply_init_rules, init_rules
from mmtrain.models.layers import Attention, Mlp
from mmtrain.models.materialize import initialised_parameters
from mmtrain.spec import DENOISER_PART, ModelSpec

TIMESTEP = "timestep"
CLASS = "class"
TEXT_HIDDEN = "text_hidden"  # an MMDiT's text: the encoder's hidden states [B, L, text_width]
TEXT_POOLED = "text_pooled"  # and its pooled vector [B, pooled_width]
PREDICTION = "prediction"
MAX_PERIOD = 10_000


def timestep_features(t: Tensor, dim: int = TIMESTEP_FREQUENCIES, shift: int = 1) -> Tensor:
    """Sinusoidal features [B, dim] of float timesteps [B]: cosines, then sines, at frequencies
    exp(-ln(1e4) i / (half - shift)): DiT's shift is 1, SD3's 0."""
    half = dim // 2
    exponent = -math.log(MAX_PERIOD) * torch.arange(half, dtype=torch.float32, device=t.device)
    frequencies = torch.exp(exponent / (half - shift))
    angles = t.float()[:, None] * frequencies[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def position_table(width: int, grid: int, max_grid: int = 0) -> Tensor:
    """Fixed 2-D positions [side * side, width] of a grid of side `max_grid` (or `grid`): half
    the features encode the column, half the row, each as sines then cosines of the coordinate
    at frequencies 1 / 10000^(2i / (width / 2)). Coordinates are 0 .. grid - 1, or (SD3, a
    larger grid) spaced grid / max_grid apart, computed in float32 as diffusers computes them:
    a checkpoint's positions are those very numbers."""
    side = max_grid or grid
    quarter = width // 4
    omega = 1.0 / MAX_PERIOD ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    coords = (torch.arange(side, dtype=torch.float32) / (side / grid)).double()
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")

    def encode(pos: Tensor) -> Tensor:
        angles = pos.reshape(-1, 1) * omega[None, :]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    return torch.cat([encode(cols), encode(rows)], dim=1).float()


def sincos_positions(width: int, grid: int, max_grid: int = 0) -> Tensor:
    """The positions [grid * grid, width] of the sample's patches: `position_table`, or (SD3)
    the centre grid x grid of its larger table."""
    table = position_table(width, grid, max_grid)
    side = max_grid or grid
    start = (side - grid) // 2
    centre = table.reshape(side, side, width)[start : start + grid, start : start + grid]
    return centre.reshape(grid * grid, width)


def temporal_positions(width: int, times: int) -> Tensor:
    """Fixed 1-D positions [times, width] of the patches along time (sines, then cosines), as a
    video DiT adds to each patch's spatial ones."""
    half = width // 2
    omega = 1.0 / MAX_PERIOD ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(times, dtype=torch.float64)[:, None] * omega[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()


def positions_of(spec: DenoiserSpec) -> Tensor:
    """Every patch's fixed position [tokens, width]: 2-D over (row, column); a video's tokens,
    time-major, add the temporal position of their frame."""
    spatial = sincos_positions(spec.width, spec.grid(), spec.pos_embed_max_size)
    if not spec.is_video():
        return spatial
    temporal = temporal_positions(spec.width, spec.time_grid())
    return (temporal[:, None, :] + spatial[None, :, :]).reshape(-1, spec.width)


def unpatchify_image(patches: Tensor, grid: int, patch: int, channels: int) -> Tensor:
    """[B, grid * grid, p * p * C] -> [B, C, H, W]: token (i, j) holds pixels (i p + a, j p + b),
    channel last within a patch."""
    b = patches.shape[0]
    x = patches.reshape(b, grid, grid, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, grid * patch, grid * patch)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: the normalised tokens [B, T, W] scaled and shifted per sample ([B, W] each)."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class DiTBlock(nn.Module):
    """Attention and MLP, each under a LayerNorm modulated by the conditioning vector and
    gated (adaLN-Zero: the modulation starts at zero, so the block starts as the identity)."""

    def __init__(self, spec: DenoiserSpec, index: int = 0):
        super().__init__()
        w = spec.width
        self.group = spec.attention_group(index)  # all tokens, a frame's, or a place's
        self.time, self.space = spec.time_grid(), spec.grid() ** 2
        self.norm1 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.norm_eps)
        self.attn = Attention(w, spec.heads)
        self.norm2 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.mlp_norm_eps)
        self.mlp = Mlp(w, spec.mlp_hidden(), "gelu_tanh")
        self.modulation = nn.Linear(w, 6 * w)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(F.silu(c)).chunk(6, 1)
        x = x + gate_a[:, None, :] * self._attend(modulate(self.norm1(x), shift_a, scale_a))
        return x + gate_m[:, None, :] * self.mlp(modulate(self.norm2(x), shift_m, scale_m))

    def _attend(self, h: Tensor) -> Tensor:
        """Attention over all tokens, or within each frame / at each place (tokens time-major)."""
        if self.group == "all":
            return self.attn(h)
        b, _, w = h.shape
        grid = h.reshape(b, self.time, self.space, w)
        if self.group == "frame":
            return self.attn(grid.reshape(b * self.time, self.space, w)).reshape(h.shape)
        places = grid.transpose(1, 2).reshape(b * self.space, self.time, w)
        out = self.attn(places).reshape(b, self.space, self.time, w).transpose(1, 2)
        return out.reshape(h.shape)


class DiT(nn.Module):
    """Patches in, conditioning vector, blocks, patches out (the network of one DenoiserSpec)."""

    # What runs before the first block (train/optim.py: frozen with the first blocks, layer 0
    # of layer-wise LR decay).
    INPUT_MODULES = ("patch", "time_fc1", "time_fc2", "classes")

    def __init__(self, spec: DenoiserSpec):
        super().__init__()
        self.spec = spec
        w, p = spec.width, spec.patch_size
        if spec.is_video():  # tubes of temporal_patch frames x p x p
            kernel = (spec.temporal_patch, p, p)
            self.patch = nn.Conv3d(spec.channels, w, kernel_size=kernel, stride=kernel)
        else:
            self.patch = nn.Conv2d(spec.channels, w, kernel_size=p, stride=p)
        self.time_fc1 = nn.Linear(TIMESTEP_FREQUENCIES, w)
        self.time_fc2 = nn.Linear(w, w)
        self.classes = nn.Embedding(spec.num_classes + 1, w) if spec.num_classes else None
        self.blocks = nn.ModuleList(DiTBlock(spec, i) for i in range(spec.layers))
        self.norm_out = nn.LayerNorm(w, elementwise_affine=False, eps=spec.norm_eps)
        self.modulation_out = nn.Linear(w, 2 * w)
        self.out = nn.Linear(w, spec.patch_volume() * spec.out_channels())
        self.register_buffer("positions", torch.empty(spec.tokens(), w), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The fixed positions (a buffer, not in checkpoints), computed where the weights are:
        after a meta build, once they have memory."""
        device = self.patch.weight.device
        if device.type != "meta":
            self.positions = positions_of(self.spec).to(device)

    def condition(self, t: Tensor, y: Tensor | None) -> Tensor:
        """The conditioning vector [B, W]: the timestep's MLP plus the class embedding."""
        c = self.time_fc2(
            F.silu(self.time_fc1(timestep_features(t).to(self.time_fc1.weight.dtype)))
        )
        if self.classes is not None:
            if y is None:
                raise KeyError(f"a class-conditional denoiser needs {CLASS!r} in the batch")
            c = c + self.classes(y)
        return c

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None) -> Tensor:
        s = self.spec
        if tuple(x.shape[1:]) != s.sample_shape():
            raise ValueError(
                f"the denoiser takes [B, {', '.join(map(str, s.sample_shape()))}], got "
                f"{list(x.shape)}"
            )
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = tokens + self.positions.to(tokens.dtype)
        c = self.condition(t, y)
        for block in self.blocks:
            tokens = block(tokens, c)
        shift, scale = self.modulation_out(F.silu(c)).chunk(2, dim=1)
        patches = self.out(modulate(self.norm_out(tokens), shift, scale))
        return self._unpatchify(patches)

    def _unpatchify(self, patches: Tensor) -> Tensor:
        """[B, T, patch values] -> the sample: token (i, j) of an image holds pixels
        (i p + a, j p + b), channel last within a patch; a video's tokens are time-major and
        hold temporal_patch frames each."""
        s, b = self.spec, patches.shape[0]
        g, p, c = s.grid(), s.patch_size, s.out_channels()
        if not s.is_video():
            return unpatchify_image(patches, g, p, c)
        tg, tp = s.time_grid(), s.temporal_patch
        x = patches.reshape(b, tg, g, g, tp, p, p, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, c, tg * tp, g * p, g * p)


class DiffusionModel(nn.Module):
    """A generator: the denoiser of `spec.denoiser` (a DiT, or an MMDiT) under
    `towers["denoiser"]`."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        if spec.denoiser is None:
            raise ValueError(f"spec {spec.name!r} has no denoiser")
        # mmdit.py builds on this module's layers: imported here, so neither imports the other
        # while it loads.
        from mmtrain.models.mmdit import MMDiT

        self.spec = spec
        network = MMDiT if spec.denoiser.is_mmdit() else DiT
        self.towers = nn.ModuleDict({DENOISER_PART: network(spec.denoiser)})

    @property
    def denoiser(self) -> nn.Module:
        return self.towers[DENOISER_PART]

    def predict(self, batch: Mapping[str, Tensor]) -> Tensor:
        """The network's output for the noisy input under the spec's key (module docstring)."""
        key = self.spec.denoiser.input
        needed = [key, TIMESTEP]
        if self.spec.denoiser.is_mmdit():
            needed += [TEXT_HIDDEN, TEXT_POOLED]
        if any(name not in batch for name in needed):
            raise KeyError(
                f"the denoiser needs {', '.join(map(repr, needed))}; got {sorted(batch)}"
            )
        if self.spec.denoiser.is_mmdit():
            return self.denoiser(
                batch[key], batch[TIMESTEP], batch[TEXT_HIDDEN], batch[TEXT_POOLED]
            )
        return self.denoiser(batch[key], batch[TIMESTEP], batch.get(CLASS))

    def forward(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {PREDICTION: self.predict(batch)}

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """DiT's init (init_rules.py): Xavier-variance normal matrices, the timestep MLP and the
        class table (an MMDiT: the pooled text's MLP) N(0, 0.02), the modulations and the
        output layer zero."""
        apply_init_rules(initialised_parameters(self), init_rules(self), generator)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        self.denoiser.reset_buffers()
