"""The description of a native-resolution vision tower (Qwen2-VL / Qwen2.5-VL), as data.

`NativeVisionSpec` is to a VLM's vision tower what `DecoderSpec` is to its LM: the planner counts
parameters and FLOPs from it alone (this module imports no torch, like spec.py), the processor's
resize rule lives here (how many tokens an image of a given size becomes), and
`mmtrain.models.native_vision` builds the same shape as a module; tests hold the three together
(transformers' `smart_resize`, its image processor's patches, its vision models' outputs and
parameter counts).

The tower (Wang et al. 2024, "Qwen2-VL", arXiv 2409.12191; Bai et al. 2025, "Qwen2.5-VL",
arXiv 2502.13923) takes each image at its own size, resized so that both sides are multiples
of patch_size x merge_size and its area lies in [min_pixels, max_pixels]. It is cut into
patch_size x patch_size patches of temporal_patch frames each (an image is repeated in time, a
clip's frames go temporal_patch at a time), embedded by a bias-free linear map (the checkpoints'
Conv3d), and run through pre-norm blocks whose attention carries 2-D rotary positions (a patch's
row and column, each rotating a quarter of the head's channels, twice over). Attention never
crosses inputs, nor the temporal patches of a clip (each attends within itself, as the
checkpoints' `cu_seqlens` do). Qwen2.5-VL restricts it further to windows of window_size pixels
in all blocks but `full_attention_blocks`. A merger then normalises each patch and concatenates
merge_size x merge_size neighbours into one LM token, mapped by a two-layer GELU MLP to the LM's
width (`out_width`).

Qwen2-VL's blocks are LayerNorm + a fc1/act/fc2 MLP with quick_gelu (`mlp: gelu`); Qwen2.5-VL's
are RMSNorm + a gated gate/up/down MLP with silu (`mlp: swiglu`), both with biases on every
linear layer but the patch embedding. Both norms use eps 1e-6, the merger's norm is the
blocks' kind, and its activation is the exact (erf) GELU in both families.

Sizes: `resized` is the processor's rule on an image's original size; `grid`, `tokens` and
`forward_flops` take the size the tower sees (already resized: sides multiples of
patch_size x merge_size) and refuse others. Counting conventions are spec.py's: FLOPs are
2 x multiply-adds of matmuls and attention (norms, softmax, rotary and bias adds left out),
attention counted over the pairs each window or frame holds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from mmtrain.structured import FieldError, check_choice, from_dict, to_dict

MLPS = ("gelu", "swiglu")  # fc1 / act / fc2 (Qwen2-VL), or act(gate) * up / down (Qwen2.5-VL)
NORMS = ("layer_norm", "rms_norm")
GELU_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_tanh")  # what `mlp: gelu` may apply
SWIGLU_ACTIVATIONS = ("silu",)  # SwiGLU's gate is silu by definition
MAX_ASPECT_RATIO = 200  # the processor refuses images more elongated than this

# The processors' pixel budgets, as transformers 5.23 ships them (models/qwen2_vl/): the image
# processor's `size = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}` (the spec's
# defaults), the video processor's `{"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 *
# 768}` per frame (pass them to `resized` for a clip's frames). The checkpoints' own
# preprocessor_config.json may widen them: Qwen2.5-VL-7B-Instruct's has max_pixels 12845056
# (28 * 28 * 16384).
IMAGE_MIN_PIXELS = 56 * 56
IMAGE_MAX_PIXELS = 28 * 28 * 1280
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 28 * 28 * 768


@dataclass(frozen=True)
class NativeVisionSpec:
    patch_size: int = 14
    temporal_patch: int = 2  # frames per patch; an image is repeated this many times
    merge_size: int = 2  # merge_size x merge_size patches become one LM token
    in_channels: int = 3
    width: int = 1280  # transformers' embed_dim (Qwen2-VL) / hidden_size (Qwen2.5-VL)
    depth: int = 32
    heads: int = 16
    mlp_hidden: int = 5120  # Qwen2-VL: embed_dim * mlp_ratio; Qwen2.5-VL: intermediate_size
    mlp: str = "gelu"
    activation: str = "quick_gelu"  # transformers' hidden_act: fc1's (gelu) or the gate's
    norm: str = "layer_norm"
    norm_eps: float = 1e-6
    out_width: int = 3584  # the LM's hidden size: what the merger outputs
    window_size: int = 0  # pixels per window side (Qwen2.5-VL: 112); 0: no windows
    full_attention_blocks: tuple[int, ...] = ()  # blocks attending over whole frames
    min_pixels: int = IMAGE_MIN_PIXELS
    max_pixels: int = IMAGE_MAX_PIXELS
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "full_attention_blocks", tuple(self.full_attention_blocks))
        self.validate()

    def validate(self, path: str = "") -> None:
        where = f"{path}." if path else ""
        for name in ("patch_size", "temporal_patch", "merge_size", "in_channels", "width",
                     "depth", "heads", "mlp_hidden", "out_width", "min_pixels", "max_pixels",
                     "norm_eps", "rope_theta"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise FieldError(where + name, f"must be positive, got {getattr(self, name)}")
        if self.width % self.heads or (self.width // self.heads) % 4:
            raise FieldError(
                where + "heads",
                f"{self.heads} heads must split width {self.width} into heads of a multiple of "
                "4 channels (2-D rotary positions rotate pairs, half for rows, half for columns)",
            )
        check_choice(where + "mlp", self.mlp, MLPS)
        allowed = SWIGLU_ACTIVATIONS if self.mlp == "swiglu" else GELU_ACTIVATIONS
        check_choice(where + "activation", self.activation, allowed)
        check_choice(where + "norm", self.norm, NORMS)
        if self.min_pixels > self.max_pixels:
            raise FieldError(
                where + "min_pixels",
                f"{self.min_pixels} is above max_pixels {self.max_pixels}",
            )
        self._validate_windows(where)

    def _validate_windows(self, where: str) -> None:
        unit = self.merge_unit_pixels()
        if self.window_size < 0 or self.window_size % unit:
            raise FieldError(
                where + "window_size",
                f"{self.window_size} is not 0 or a positive multiple of {unit} pixels "
                f"(patch_size {self.patch_size} x merge_size {self.merge_size}: windows hold "
                "whole merged tokens)",
            )
        blocks = self.full_attention_blocks
        if blocks and not self.window_size:
            raise FieldError(
                where + "full_attention_blocks",
                "only means something with windows (window_size > 0): every block attends "
                "over whole frames without them",
            )
        if list(blocks) != sorted(set(blocks)) or any(not 0 <= b < self.depth for b in blocks):
            raise FieldError(
                where + "full_attention_blocks",
                f"{list(blocks)} must be increasing block indices in 0 .. {self.depth - 1}",
            )

    # -- sizes
    def merge_unit_pixels(self) -> int:
        """Side in pixels of one LM token's patches: what every resized side is a multiple of."""
        return self.patch_size * self.merge_size

    def head_dim(self) -> int:
        return self.width // self.heads

    def patch_dim(self) -> int:
        """Values of one patch: in_channels x temporal_patch x patch_size x patch_size."""
        return self.in_channels * self.temporal_patch * self.patch_size**2

    def merged_width(self) -> int:
        """Width of one merged token before the merger's MLP: merge_size^2 patches side by side."""
        return self.merge_size**2 * self.width

    def is_windowed(self, block: int) -> bool:
        """Whether block `block` attends within windows (else over each whole frame)."""
        return self.window_size > 0 and block not in self.full_attention_blocks

    def resized(
        self,
        height: int,
        width: int,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> tuple[int, int]:
        """(height, width) the processor resizes an image of this size to: both sides multiples
        of patch_size x merge_size, the area within [min_pixels, max_pixels] (default the spec's),
        the aspect ratio kept as closely as that allows. The rounding is transformers'
        `smart_resize`, step for step (Python's round-half-even first; then, if the area is too
        large, both sides scaled by the same factor and floored, at least one unit; if too small,
        scaled up and ceiled), so the token counts the planner sees are the model's.
        ValueError for a non-positive side or an aspect ratio above 200."""
        low = self.min_pixels if min_pixels is None else min_pixels
        high = self.max_pixels if max_pixels is None else max_pixels
        if height <= 0 or width <= 0:
            raise ValueError(f"an image of {height} x {width} pixels has no area to resize")
        ratio = max(height, width) / min(height, width)
        if ratio > MAX_ASPECT_RATIO:
            raise ValueError(
                f"an image of {height} x {width} pixels has an aspect ratio of {ratio:.1f}; the "
                f"processor takes at most {MAX_ASPECT_RATIO}"
            )
        unit = self.merge_unit_pixels()
        rows, cols = round(height / unit) * unit, round(width / unit) * unit
        if rows * cols > high:
            beta = math.sqrt(height * width / high)
            rows = max(unit, math.floor(height / beta / unit) * unit)
            cols = max(unit, math.floor(width / beta / unit) * unit)
        elif rows * cols < low:
            beta = math.sqrt(low / (height * width))
            rows = math.ceil(height * beta / unit) * unit
            cols = math.ceil(width * beta / unit) * unit
        return rows, cols

    def grid(self, height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
        """(time, rows, columns) in patches of an input the tower sees: an image (frames 1, one
        temporal patch of its repeats) or a clip of `frames` frames (a multiple of
        temporal_patch), its sides already resized. ValueError naming the side that is not."""
        unit = self.merge_unit_pixels()
        for side, value in (("height", height), ("width", width)):
            if value <= 0 or value % unit:
                raise ValueError(
                    f"{side} {value} is not a positive multiple of {unit} pixels (patch_size "
                    f"{self.patch_size} x merge_size {self.merge_size}): resize it first"
                )
        if frames != 1 and (frames <= 0 or frames % self.temporal_patch):
            raise ValueError(
                f"a clip of {frames} frames: frames must be 1 (an image) or a positive multiple "
                f"of temporal_patch {self.temporal_patch}"
            )
        time = 1 if frames == 1 else frames // self.temporal_patch
        return time, height // self.patch_size, width // self.patch_size

    def patches(self, height: int, width: int, frames: int = 1) -> int:
        return math.prod(self.grid(height, width, frames))

    def tokens(self, height: int, width: int, frames: int = 1) -> int:
        """LM tokens of an input: its patches after the merge_size x merge_size merge."""
        return self.patches(height, width, frames) // self.merge_size**2

    def _window_sides(self, cells: int) -> list[int]:
        """Merged tokens along one side of each window row (or column) of a frame `cells`
        merged tokens long: whole windows, then the remainder at the bottom (right) edge."""
        if not self.window_size:
            return [cells]
        side = self.window_size // self.merge_unit_pixels()
        return [side] * (cells // side) + ([cells % side] if cells % side else [])

    def attention_pairs(self, block: int, height: int, width: int, frames: int = 1) -> int:
        """(query, key) pairs block `block` scores for one input: the squared patch count of
        each window, or of each frame (temporal patch) for a full-attention block."""
        time, rows, cols = self.grid(height, width, frames)
        if not self.is_windowed(block):
            return time * (rows * cols) ** 2
        m = self.merge_size
        row_sides = self._window_sides(rows // m)
        col_sides = self._window_sides(cols // m)
        # a window of r x c merged tokens holds r c m^2 patches; summed over the grid of windows
        return time * m**4 * sum(r * r for r in row_sides) * sum(c * c for c in col_sides)

    # -- parameters
    def norm_params(self) -> int:
        return (2 if self.norm == "layer_norm" else 1) * self.width  # LayerNorm has a bias

    def patch_params(self) -> int:
        return self.patch_dim() * self.width  # no bias

    def mlp_params(self) -> int:
        w, h = self.width, self.mlp_hidden
        inputs = 2 if self.mlp == "swiglu" else 1  # gate and up, or fc1
        return inputs * (w * h + h) + h * w + w

    def block_params(self) -> int:
        w = self.width
        attention = w * 3 * w + 3 * w + w * w + w
        return 2 * self.norm_params() + attention + self.mlp_params()

    def merger_params(self) -> int:
        merged, out = self.merged_width(), self.out_width
        return self.norm_params() + merged * merged + merged + merged * out + out

    def params(self) -> int:
        return self.patch_params() + self.depth * self.block_params() + self.merger_params()

    # -- FLOPs (2 x multiply-adds, forward, one input)
    def block_flops(self, block: int, height: int, width: int, frames: int = 1) -> int:
        w, h = self.width, self.mlp_hidden
        mlp_matrices = 3 if self.mlp == "swiglu" else 2
        per_patch = 3 * w * w + w * w + mlp_matrices * w * h
        attention = 2 * 2 * self.attention_pairs(block, height, width, frames) * w  # QK^T, AV
        return 2 * self.patches(height, width, frames) * per_patch + attention

    def forward_flops(self, height: int, width: int, frames: int = 1) -> int:
        """Forward FLOPs of one input (image or clip, already resized): the patch embedding,
        every block (attention within windows or frames), the merger's two linear layers."""
        patches, tokens = self.patches(height, width, frames), self.tokens(height, width, frames)
        merged = self.merged_width()
        embed = 2 * patches * self.patch_dim() * self.width
        blocks = sum(self.block_flops(i, height, width, frames) for i in range(self.depth))
        merger = 2 * tokens * (merged * merged + merged * self.out_width)
        return embed + blocks + merger

    # -- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = "") -> NativeVisionSpec:
        return from_dict(cls, data, path)

    def replace(self, **changes: Any) -> NativeVisionSpec:
        return dataclasses.replace(self, **changes)


# Qwen/Qwen2-VL-7B-Instruct, config.json "vision_config" (the defaults of transformers'
# Qwen2VLVisionConfig, whose docstring names that checkpoint): depth 32, embed_dim 1280,
# num_heads 16, mlp_ratio 4, hidden_act quick_gelu, hidden_size 3584 (the LM's), patch_size 14,
# temporal_patch_size 2, spatial_merge_size 2, in_chans 3; rotary theta 10000 (the vision
# config's rope_parameters). 675,759,104 parameters.
QWEN2_VL_7B_VISION = NativeVisionSpec(
    width=1280, depth=32, heads=16, mlp_hidden=4 * 1280, mlp="gelu", activation="quick_gelu",
    norm="layer_norm", out_width=3584,
)  # fmt: skip

# Qwen/Qwen2.5-VL-7B-Instruct, config.json "vision_config": depth 32, hidden_size 1280,
# num_heads 16, intermediate_size 3420, hidden_act silu, out_hidden_size 3584, patch_size 14,
# temporal_patch_size 2, spatial_merge_size 2, window_size 112, fullatt_block_indexes
# [7, 15, 23, 31]. 676,550,144 parameters.
QWEN2_5_VL_7B_VISION = NativeVisionSpec(
    width=1280, depth=32, heads=16, mlp_hidden=3420, mlp="swiglu", activation="silu",
    norm="rms_norm", out_width=3584, window_size=112, full_attention_blocks=(7, 15, 23, 31),
)  # fmt: skip
