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
from mmtrain.models.attention import AttentionKernel
from mmtrain.models.init_rules import apply_init_rules, init_rules
from mmtrain.models.layers import Attention, Mlp
from mmtrain.models.materialize import initialised_parameters
from mmtrain.models.sequence_split import SequenceSplit
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


def axis_coordinates(n: int, base: int) -> Tensor:
    """The coordinates of n patches along one axis: 0 .. n - 1 stretched to span `base` (the
    grid the model was configured for), in float32 as diffusers computes them (a checkpoint's
    positions are those very numbers). At n = base, 0 .. n - 1."""
    return (torch.arange(n, dtype=torch.float32) / (n / base)).double()


def position_table(width: int, rows: int, cols: int, base: int) -> Tensor:
    """Fixed 2-D positions [rows * cols, width] of a grid, row-major: half the features encode
    the column, half the row, each as sines then cosines of the coordinate (axis_coordinates)
    at frequencies 1 / 10000^(2i / (width / 2))."""
    quarter = width // 4
    omega = 1.0 / MAX_PERIOD ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    grid_rows, grid_cols = torch.meshgrid(
        axis_coordinates(rows, base), axis_coordinates(cols, base), indexing="ij"
    )

    def encode(pos: Tensor) -> Tensor:
        angles = pos.reshape(-1, 1) * omega[None, :]
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)

    return torch.cat([encode(grid_cols), encode(grid_rows)], dim=1).float()


def sincos_positions(width: int, rows: int, cols: int, base: int, max_grid: int = 0) -> Tensor:
    """The positions [rows * cols, width] of a sample's patches: DiT's `position_table` of its
    own grid, or (SD3, `max_grid`) the centre rows x cols of the max_grid-sided table."""
    if not max_grid:
        return position_table(width, rows, cols, base)
    if rows > max_grid or cols > max_grid:
        raise ValueError(
            f"a grid of {rows} x {cols} patches is larger than the position table's "
            f"{max_grid} x {max_grid} (pos_embed_max_size)"
        )
    table = position_table(width, max_grid, max_grid, base).reshape(max_grid, max_grid, width)
    top, left = (max_grid - rows) // 2, (max_grid - cols) // 2
    return table[top : top + rows, left : left + cols].reshape(rows * cols, width)


def temporal_positions(width: int, times: int) -> Tensor:
    """Fixed 1-D positions [times, width] of the patches along time (sines, then cosines), as a
    video DiT adds to each patch's spatial ones."""
    half = width // 2
    omega = 1.0 / MAX_PERIOD ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(times, dtype=torch.float64)[:, None] * omega[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1).float()


def positions_of(spec: DenoiserSpec, grid: tuple[int, int, int] | None = None) -> Tensor:
    """Every patch's fixed position [tokens, width] for a (time, rows, columns) grid (default
    the spec's own): 2-D over (row, column); a video's tokens, time-major, add the temporal
    position of their frame."""
    time, rows, cols = grid or spec.grid_of()
    spatial = sincos_positions(spec.width, rows, cols, spec.grid(), spec.pos_embed_max_size)
    if not spec.is_video():
        return spatial
    temporal = temporal_positions(spec.width, time)
    return (temporal[:, None, :] + spatial[None, :, :]).reshape(-1, spec.width)


def sample_grid(spec: DenoiserSpec, x: Tensor) -> tuple[int, int, int]:
    """The (time, rows, columns) patch grid of a batch of noisy samples [B, C, (T,) H, W];
    ValueError when its channels or a side do not fit the network."""
    if x.dim() != len(spec.sample_shape()) + 1 or x.shape[1] != spec.channels:
        layout = "[B, C, T, H, W]" if spec.is_video() else "[B, C, H, W]"
        raise ValueError(
            f"the denoiser takes {layout} with C = {spec.channels}, got {list(x.shape)}"
        )
    return spec.grid_of(x.shape[2:])


class PositionCache:
    """The fixed positions of each grid a network has seen, on its device (shape buckets
    change the grid from step to step; the table is computed once per grid, not per step)."""

    def __init__(self, spec: DenoiserSpec):
        self.spec = spec
        self.tables: dict[tuple[tuple[int, int, int], torch.device], Tensor] = {}

    @torch.compiler.disable  # a host computation, once per grid: not traced
    def __call__(self, grid: tuple[int, int, int], device: torch.device) -> Tensor:
        key = (grid, device)
        if key not in self.tables:
            self.tables[key] = positions_of(self.spec, grid).to(device)
        return self.tables[key]


def unpatchify_image(patches: Tensor, rows: int, cols: int, patch: int, channels: int) -> Tensor:
    """[B, rows * cols, p * p * C] -> [B, C, H, W]: token (i, j) holds pixels
    (i p + a, j p + b), channel last within a patch."""
    b = patches.shape[0]
    x = patches.reshape(b, rows, cols, patch, patch, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(b, channels, rows * patch, cols * patch)


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
        self.norm1 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.norm_eps)
        self.attn = Attention(w, spec.heads)
        self.norm2 = nn.LayerNorm(w, elementwise_affine=False, eps=spec.mlp_norm_eps)
        self.mlp = Mlp(w, spec.mlp_hidden(), "gelu_tanh")
        self.modulation = nn.Linear(w, 6 * w)

    def forward(
        self, x: Tensor, c: Tensor, time: int = 1, kernel: AttentionKernel | None = None
    ) -> Tensor:
        """Tokens [B, time x space, W] (time-major: `time` patches along a video's frames);
        `kernel`: they are this rank's slice (sequence parallelism), attended over all ranks'."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.modulation(F.silu(c)).chunk(6, 1)
        h = modulate(self.norm1(x), shift_a, scale_a)
        x = x + gate_a[:, None, :] * self._attend(h, time, kernel)
        return x + gate_m[:, None, :] * self.mlp(modulate(self.norm2(x), shift_m, scale_m))

    def _attend(self, h: Tensor, time: int, kernel: AttentionKernel | None = None) -> Tensor:
        """Attention over all tokens, or within each frame / at each place (tokens time-major)."""
        if self.group == "all":
            return self.attn(h, kernel=kernel)
        b, n, w = h.shape
        space = n // time
        grid = h.reshape(b, time, space, w)
        if self.group == "frame":
            return self.attn(grid.reshape(b * time, space, w)).reshape(h.shape)
        places = grid.transpose(1, 2).reshape(b * space, time, w)
        out = self.attn(places).reshape(b, space, time, w).transpose(1, 2)
        return out.reshape(h.shape)


class PatchNetwork(nn.Module):
    """What a DiT and an MMDiT share: fixed positions for the patch grid of any sample size,
    the spec's own in a buffer (not in checkpoints) and other sizes' in a cache, computed where
    the weights are: after a meta build, once they have memory."""

    spec: DenoiserSpec
    patch: nn.Module

    def init_positions(self) -> None:
        table = torch.empty(self.spec.tokens(), self.spec.width)
        self.register_buffer("positions", table, persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        device = self.patch.weight.device
        self.other_positions = PositionCache(self.spec)
        if device.type != "meta":
            self.positions = positions_of(self.spec).to(device)

    def positions_for(self, grid: tuple[int, int, int]) -> Tensor:
        if grid == self.spec.grid_of():
            return self.positions
        return self.other_positions(grid, self.positions.device)


class DiT(PatchNetwork):
    """Patches in, conditioning vector, blocks, patches out (the network of one DenoiserSpec)."""

    # What runs before the first block (train/optim.py: frozen with the first blocks, layer 0
    # of layer-wise LR decay).
    INPUT_MODULES = ("patch", "time_fc1", "time_fc2", "classes")
    # Set by train/sequence_parallel.py: this rank then runs the blocks on its slice of tokens.
    sequence_split: SequenceSplit | None = None

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
        self.init_positions()

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
        grid = sample_grid(self.spec, x)
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = tokens + self.positions_for(grid).to(tokens.dtype)
        c = self.condition(t, y)
        split, kernel = self.sequence_split, None
        if split is not None:  # (full attention only: a slice of tokens has no frame grid)
            tokens, kernel = split.split_tokens(tokens), split.full_attention()
        for block in self.blocks:
            tokens = block(tokens, c, grid[0], kernel)
        shift, scale = self.modulation_out(F.silu(c)).chunk(2, dim=1)
        patches = self.out(modulate(self.norm_out(tokens), shift, scale))
        if split is not None:
            patches = split.gather_tokens(patches)
        return self._unpatchify(patches, grid)

    def _unpatchify(self, patches: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """[B, T, patch values] -> the sample: token (i, j) of an image holds pixels
        (i p + a, j p + b), channel last within a patch; a video's tokens are time-major and
        hold temporal_patch frames each."""
        s, b = self.spec, patches.shape[0]
        (tg, rows, cols), p, c = grid, s.patch_size, s.out_channels()
        if not s.is_video():
            return unpatchify_image(patches, rows, cols, p, c)
        tp = s.temporal_patch
        x = patches.reshape(b, tg, rows, cols, tp, p, p, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, c, tg * tp, rows * p, cols * p)


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
