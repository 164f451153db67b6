"""The native-resolution vision tower of Qwen2-VL / Qwen2.5-VL, built from a `NativeVisionSpec`
(native_vision_spec.py says what it is).

    tower = NativeVisionTower(spec)
    patches, grid = tower.patchify([image_chw, clip_tchw, ...])   # sides already resized
    tokens = tower(patches, grid)                                  # [sum of tokens, out_width]
    per_input = tower.embed([image_chw, clip_tchw, ...])           # the same, split per input

Read top to bottom: patches (the processor's layout), the attention layout of a batch of grids
(positions, frames, windows), rotary positions, attention within groups of patches, the block,
the merger, the tower.

Patches are laid out as transformers' Qwen2VLImageProcessor / Qwen2VLVideoProcessor emit their
`pixel_values`: per input, temporal patch by temporal patch, then merge window by merge window
(merge_size x merge_size patches, row-major), each patch's values ordered (channel, frame,
row, column). So the merger's merge_size^2 neighbours are consecutive rows, and the LM tokens
come out row-major per temporal patch, input after input.

Attention groups instead of a reordering: Qwen2.5-VL's reference permutes the patches so that
each window is contiguous, attends over contiguous segments and permutes back. Here every
block attends over index groups (all windows, or all frames, of one length gathered into one
batch for `scaled_dot_product_attention`), and the results are put back in patch order by the
inverse of the same gather; a window lists its patches in the reference's order (merged tokens
row-major, then within each), so the sums are the reference's. No mask, no padding: the FLOPs
are the ones the spec counts.

Parameter names follow the encoder blocks of layers.py (`norm1`, `attn.qkv`, `attn.out`,
`norm2`, `mlp.fc1`, `mlp.fc2`), so LoRA targets and the trainer's per-block wrapping know one
shape. They map to the checkpoints' names (under `visual.` in the Hub's safetensors) by
renaming, with one concatenation:

    patch_embed.weight          patch_embed.proj.weight (the Conv3d's, same shape)
    blocks.i.norm1 / norm2      blocks.i.norm1 / norm2 (LayerNorm weight and bias, or RMSNorm)
    blocks.i.attn.qkv           blocks.i.attn.qkv (rows q, k, v)
    blocks.i.attn.out           blocks.i.attn.proj
    blocks.i.mlp.fc1            blocks.i.mlp.fc1 (Qwen2-VL); rows [gate_proj; up_proj] (Qwen2.5)
    blocks.i.mlp.fc2            blocks.i.mlp.fc2 (Qwen2-VL); blocks.i.mlp.down_proj (Qwen2.5)
    merger.norm                 merger.ln_q
    merger.fc1 / merger.fc2     merger.mlp.0 / merger.mlp.2

Numerics follow the checkpoints' implementation: rotary angles are computed in float32
whatever the dtype and applied in at least float32, RMSNorm normalises in at least float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmtrain.models.decoder import ROTARY_DTYPE, RMSNorm, apply_rotary
from mmtrain.models.host_copy import to_device
from mmtrain.models.layers import Mlp
from mmtrain.native_vision_spec import NativeVisionSpec


# ----------------------------------------------------------------------------- patches
def as_clip(spec: NativeVisionSpec, pixels: Tensor, index: int) -> Tensor:
    """An input as frames [T, C, H, W]: an image [C, H, W] repeated temporal_patch times (as the
    processor does), a clip as it is. ValueError naming the input and what does not fit."""
    if pixels.dim() not in (3, 4):
        raise ValueError(
            f"pixels[{index}]: expected an image [C, H, W] or a clip [T, C, H, W], got shape "
            f"{list(pixels.shape)}"
        )
    clip = pixels.expand(spec.temporal_patch, *pixels.shape) if pixels.dim() == 3 else pixels
    frames, channels, height, width = clip.shape
    if channels != spec.in_channels:
        raise ValueError(
            f"pixels[{index}]: {channels} channels in shape {list(pixels.shape)}; the tower "
            f"takes in_channels {spec.in_channels}"
        )
    if frames == 0 or frames % spec.temporal_patch:
        raise ValueError(
            f"pixels[{index}]: a clip of {frames} frames; frames must be a positive multiple of "
            f"temporal_patch {spec.temporal_patch}"
        )
    try:
        spec.grid(height, width, frames)
    except ValueError as err:
        raise ValueError(f"pixels[{index}]: {err}") from None
    return clip


def clip_patches(spec: NativeVisionSpec, clip: Tensor) -> Tensor:
    """Frames [T, C, H, W] -> patches [T/tp * H/p * W/p, C * tp * p * p] in the processor's
    order: temporal patch, merge window (row-major), patch within it (row-major); each patch's
    values (channel, frame, row, column)."""
    frames, c, height, width = clip.shape
    p, m, tp = spec.patch_size, spec.merge_size, spec.temporal_patch
    rows, cols = height // (p * m), width // (p * m)  # merge windows
    x = clip.reshape(frames // tp, tp, c, rows, m, p, cols, m, p)
    # (time, tp, C, rows, m, p, cols, m, p) -> (time, rows, cols, m, m, C, tp, p, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(-1, spec.patch_dim())


# ----------------------------------------------------------------------------- layout
@dataclass
class AttentionGroups:
    """Who attends to whom in a block: `indices` are [segments, length] patch indices, one
    tensor per segment length (each row one window or frame); `inverse` puts the gathered
    patches, in the order of the rows flattened one tensor after another, back in patch order."""

    indices: list[Tensor]
    inverse: Tensor

    def tensors(self) -> list[Tensor]:
        """The index tensors, then the inverse (`from_tensors` takes them back)."""
        return [*self.indices, self.inverse]

    @staticmethod
    def from_tensors(tensors: Sequence[Tensor]) -> AttentionGroups:
        return AttentionGroups(list(tensors[:-1]), tensors[-1])


@dataclass
class VisionLayout:
    """What the grids of a batch decide: every patch's (row, column) [N, 2] and the attention
    groups of full-attention blocks (`frames`) and of windowed blocks (`windows`, None without
    windows)."""

    positions: Tensor
    frames: AttentionGroups
    windows: AttentionGroups | None

    def to(self, device: torch.device) -> VisionLayout:
        """The layout on `device` in one asynchronous copy (every index tensor is int64: one
        host buffer, split back into views on the device), so the host never waits."""
        windows = self.windows.tensors() if self.windows is not None else []
        host = [self.positions, *self.frames.tensors(), *windows]
        flat = to_device(torch.cat([t.flatten() for t in host]), device)
        pieces = flat.split([t.numel() for t in host])
        moved = [p.view(t.shape) for p, t in zip(pieces, host, strict=True)]
        frames = len(self.frames.tensors())
        return VisionLayout(
            positions=moved[0],
            frames=AttentionGroups.from_tensors(moved[1 : 1 + frames]),
            windows=AttentionGroups.from_tensors(moved[1 + frames :]) if windows else None,
        )


def attention_groups(segment: Tensor) -> AttentionGroups:
    """The groups of patches sharing a segment id (ids 0 .. S - 1, each used): per distinct
    segment length, one [segments, length] tensor of patch indices, ascending in each row."""
    order = torch.argsort(segment, stable=True)
    lengths = torch.bincount(segment)
    starts = torch.cumsum(lengths, 0) - lengths
    indices = []
    for length in torch.unique(lengths).tolist():  # a few distinct lengths: loop over them
        first = starts[lengths == length]
        indices.append(order[first[:, None] + torch.arange(length)])
    inverse = torch.argsort(torch.cat([i.flatten() for i in indices]))
    return AttentionGroups(indices, inverse)


def input_layout(
    spec: NativeVisionSpec, time: int, rows: int, cols: int
) -> tuple[Tensor, Tensor, int, Tensor | None, int]:
    """One input's patches, in patch order: (row, column) [n, 2], the temporal patch each
    belongs to (its full-attention segment) and its window within all the input's windows."""
    m = spec.merge_size
    grid_rows, grid_cols = rows // m, cols // m
    frame, unit_row, unit_col, sub_row, sub_col = (
        axis.flatten()
        for axis in torch.meshgrid(
            *(torch.arange(n) for n in (time, grid_rows, grid_cols, m, m)), indexing="ij"
        )
    )
    positions = torch.stack([unit_row * m + sub_row, unit_col * m + sub_col], dim=1)
    if not spec.window_size:
        return positions, frame, time, None, 0
    side = spec.window_size // spec.merge_unit_pixels()  # merged tokens per window side
    per_row = -(-grid_cols // side)
    windows = -(-grid_rows // side) * per_row
    window = frame * windows + (unit_row // side) * per_row + unit_col // side
    return positions, frame, time, window, time * windows


def vision_layout(spec: NativeVisionSpec, grid: Sequence[Sequence[int]]) -> VisionLayout:
    """The layout of a batch of inputs of (time, rows, columns) patches each, on the CPU."""
    positions, frames, windows = [], [], []
    frame_base = window_base = 0
    for time, rows, cols in grid:
        pos, frame, n_frames, window, n_windows = input_layout(spec, time, rows, cols)
        positions.append(pos)
        frames.append(frame + frame_base)
        frame_base += n_frames
        if window is not None:
            windows.append(window + window_base)
            window_base += n_windows
    return VisionLayout(
        positions=torch.cat(positions),
        frames=attention_groups(torch.cat(frames)),
        windows=attention_groups(torch.cat(windows)) if windows else None,
    )


# ----------------------------------------------------------------------------- rotary positions
def rotary_cos_sin(spec: NativeVisionSpec, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin [N, head_dim] in float32 of each patch's 2-D angles: head_dim / 4
    frequencies 1 / theta^(2i / (head_dim / 2)) times the row, the same times the column,
    that half repeated (channels i and i + head_dim / 2 rotate as a pair)."""
    half = spec.head_dim() // 2
    exponents = torch.arange(0, half, 2, dtype=ROTARY_DTYPE, device=positions.device) / half
    inv_freq = 1.0 / (spec.rope_theta**exponents)
    angles = positions.to(ROTARY_DTYPE)[:, :, None] * inv_freq  # [N, (row, col), head_dim / 4]
    angles = angles.flatten(1)  # the row's angles, then the column's
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


# ----------------------------------------------------------------------------- attention
# Eager under torch.compile: the groups' count and lengths follow the batch's page sizes, so a
# traced loop over them would recompile the block for every new layout (past dynamo's recompile
# limit, the block then runs uncompiled). Each group is one SDPA kernel either way; the rest
# of the block (norms, projections, rotary, MLP) compiles once with the patch count dynamic.
@torch.compiler.disable
def attend_in_groups(q: Tensor, k: Tensor, v: Tensor, groups: AttentionGroups) -> Tensor:
    """Attention of q, k, v [N, heads, d] within each group's rows, back in patch order."""
    outputs = []
    for index in groups.indices:  # [segments, length]: one batched call per length
        qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [segments, heads, len, d]
        out = F.scaled_dot_product_attention(qs, ks, vs)
        outputs.append(out.transpose(1, 2).flatten(0, 1))
    return torch.cat(outputs)[groups.inverse]


class VisionAttention(nn.Module):
    def __init__(self, spec: NativeVisionSpec):
        super().__init__()
        self.heads = spec.heads
        self.qkv = nn.Linear(spec.width, 3 * spec.width)
        self.out = nn.Linear(spec.width, spec.width)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: AttentionGroups) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(1)  # [N, heads, d]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.out(attend_in_groups(q, k, v, groups).flatten(1))


def make_norm(spec: NativeVisionSpec, width: int) -> nn.Module:
    if spec.norm == "layer_norm":
        return nn.LayerNorm(width, eps=spec.norm_eps)
    return RMSNorm(width, spec.norm_eps)


class VisionBlock(nn.Module):
    """Pre-norm: x + attn(norm1(x)) within the block's groups, then x + mlp(norm2(x))."""

    def __init__(self, spec: NativeVisionSpec):
        super().__init__()
        self.norm1 = make_norm(spec, spec.width)
        self.attn = VisionAttention(spec)
        self.norm2 = make_norm(spec, spec.width)
        activation = "swiglu" if spec.mlp == "swiglu" else spec.activation
        self.mlp = Mlp(spec.width, spec.mlp_hidden, activation)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: AttentionGroups) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each patch normalised, merge_size^2 neighbours (consecutive in patch order) side by
    side, a two-layer exact-GELU MLP to the LM's width."""

    def __init__(self, spec: NativeVisionSpec):
        super().__init__()
        merged = spec.merged_width()
        self.norm = make_norm(spec, spec.width)
        self.fc1 = nn.Linear(merged, merged)
        self.fc2 = nn.Linear(merged, spec.out_width)

    def forward(self, x: Tensor) -> Tensor:
        merged = self.norm(x).reshape(-1, self.fc1.in_features)
        return self.fc2(F.gelu(self.fc1(merged)))


# ----------------------------------------------------------------------------- the tower
class NativeVisionTower(nn.Module):
    """Images and clips at their own sizes in, one LM-width vector per merged token out."""

    # What freezing "the stem and the first N blocks" freezes (train/optim.py): the patches'
    # embedding (the tower's `embed` is a method, not a module).
    INPUT_MODULES = ("patch_embed",)

    def __init__(self, spec: NativeVisionSpec):
        super().__init__()
        self.spec = spec
        kernel = (spec.temporal_patch, spec.patch_size, spec.patch_size)
        self.patch_embed = nn.Conv3d(spec.in_channels, spec.width, kernel, kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = PatchMerger(spec)

    def patchify(self, pixels: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Images [C, H, W] and clips [T, C, H, W] (sides multiples of patch_size x merge_size:
        resized by the caller, `spec.resized`; T a multiple of temporal_patch) -> patches
        [N, C * tp * p * p] in the processor's `pixel_values` order and the grid [inputs, 3]
        int64 of (time, rows, columns) patches, as its `image_grid_thw` / `video_grid_thw`."""
        if not pixels:
            raise ValueError("pixels: no image or clip to patchify")
        pieces, grid = [], []
        for index, item in enumerate(pixels):
            clip = as_clip(self.spec, item, index)
            frames, _, height, width = clip.shape
            grid.append(self.spec.grid(height, width, frames))
            pieces.append(clip_patches(self.spec, clip))
        return torch.cat(pieces), torch.tensor(grid, dtype=torch.int64)

    def check_inputs(self, patches: Tensor, grid: Tensor) -> list[list[int]]:
        """The grid as host integers; ValueError when it does not describe `patches`."""
        s = self.spec
        if grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(
                f"grid: expected [inputs, 3] (time, rows, columns), got {list(grid.shape)}"
            )
        rows = grid.tolist()  # a few integers read on the host: they decide the layout
        for index, (time, height, width) in enumerate(rows):
            positive = time > 0 and height > 0 and width > 0
            if not positive or height % s.merge_size or width % s.merge_size:
                raise ValueError(
                    f"grid[{index}]: {[time, height, width]} patches; time, rows and columns "
                    f"must be positive, rows and columns multiples of merge_size {s.merge_size}"
                )
        total = sum(t * h * w for t, h, w in rows)
        if patches.shape != (total, s.patch_dim()):
            raise ValueError(
                f"patches: expected [{total}, {s.patch_dim()}] for grid {rows}, got "
                f"{list(patches.shape)}"
            )
        return rows

    def forward(self, patches: Tensor, grid: Tensor) -> Tensor:
        """patches [N, C * tp * p * p] and grid [inputs, 3] (as `patchify` returns them; keep
        the grid on the CPU, it is read on the host) -> [sum of tokens, out_width]."""
        rows = self.check_inputs(patches, grid)
        layout = vision_layout(self.spec, rows).to(patches.device)  # built on the host
        weight = self.patch_embed.weight
        # The Conv3d's kernel is the whole patch: a matmul with its flattened weight (the
        # checkpoint's [W, C, tp, p, p] kept as it is; a GEMM, faster than a strided Conv3d).
        x = F.linear(patches.to(weight.dtype), weight.flatten(1))
        cos, sin = rotary_cos_sin(self.spec, layout.positions)
        for varies in (x, cos, sin):  # the patch count: compiled blocks trace it as a size
            torch._dynamo.maybe_mark_dynamic(varies, 0)
        frames, windows = layout.frames, layout.windows
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, windows if self.spec.is_windowed(index) else frames)
        return self.merger(x)

    def embed(self, pixels: Sequence[Tensor]) -> list[Tensor]:
        """One [tokens, out_width] per image or clip (sides already resized)."""
        patches, grid = self.patchify(pixels)
        tokens = (grid.prod(dim=1) // self.spec.merge_size**2).tolist()
        return list(self(patches, grid).split(tokens))
