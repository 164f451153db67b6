"""A native-resolution vision tower (`spec.vision`: Qwen2-VL / Qwen2.5-VL) as the planner sees
one row's images and clips: their sizes, LM tokens, FLOPs and what the module keeps for backward.

Each input of a row is (frames, height, width) in pixels at the size the tower sees (frames 1
for an image, a multiple of temporal_patch for a clip; sides multiples of patch_size x
merge_size), so every count is `NativeVisionSpec`'s own (`tokens`, `patches`, `forward_flops`),
which refuse other sizes. `parse_visual` turns the CLI's original sizes into such inputs by the
processor's rule (`NativeVisionSpec.resized`: the spec's image budget, the video processor's
per-frame budget for clips).

What `models/native_vision.py` keeps, counted with train/measure_step.py's saved-tensor hooks
(fp32, CPU; tests/test_plan_native_vision.py). Per block and patch the encoder terms of
activations.py, with two differences its `Stack` flags carry: attention runs over index groups
(windows or frames), so q, k and v are gathered copies (3 w, as a fused projection's output
would be) and its output is gathered back into patch order, a copy the output projection reads
(`gathered_attention`: w more); and quick_gelu (`x * sigmoid(1.702 x)`) keeps its sigmoid's
output too (`quick_gelu`: f more). Outside the blocks (`saved_outside_blocks`): the patches the
patch embedding reads, the rotary cos and sin tables (float32, shared by every block), the
merger's norm input, statistics and (RMSNorm) normalised copy, its fc1 input, GELU input and
fc2 input; and, once per tower, the gather indices of each group kind (windows, frames) and
their inverse, shared by the blocks of that kind and recomputed under checkpointing, with the
patches' positions, which share their buffer. (A LoRA tower without attention adapters runs its
first block's attention without gradient: when that block is the only one of its kind, its
indices are counted but not kept, 2 int64 a patch.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from mmtrain.native_vision_spec import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, NativeVisionSpec
from mmtrain.structured import FieldError

Visual = tuple[int, int, int]  # (frames, height, width) in pixels at the tower's size
DEFAULT_PAGE_SIDE = 4096  # a page this large is resized down to the spec's max_pixels
FLAG = "--visual"


def default_page(vision: NativeVisionSpec) -> Visual:
    """The default budget's worst case: a square page resized to the spec's max_pixels."""
    height, width = vision.resized(DEFAULT_PAGE_SIDE, DEFAULT_PAGE_SIDE)
    return 1, height, width


def check_inputs(vision: NativeVisionSpec, inputs: Sequence[Visual], path: str) -> None:
    """FieldError naming `path[i]` for an input the tower cannot take as it is."""
    for i, item in enumerate(inputs):
        try:
            frames, height, width = item
            vision.grid(height, width, frames)
        except (TypeError, ValueError) as err:
            raise FieldError(
                f"{path}[{i}]",
                f"{item!r} is not (frames, height, width) at the tower's size: {err}",
            ) from None


def visual_patches(vision: NativeVisionSpec, inputs: Sequence[Visual]) -> int:
    return sum(vision.patches(h, w, f) for f, h, w in inputs)


def visual_tokens(vision: NativeVisionSpec, inputs: Sequence[Visual]) -> int:
    """LM positions the inputs take (each input's merged patches)."""
    return sum(vision.tokens(h, w, f) for f, h, w in inputs)


def visual_flops(vision: NativeVisionSpec, inputs: Sequence[Visual]) -> int:
    """Forward FLOPs of the tower (merger included) over the inputs."""
    return sum(vision.forward_flops(h, w, f) for f, h, w in inputs)


def attention_span(vision: NativeVisionSpec, inputs: Sequence[Visual]) -> float:
    """Keys a query attends to, averaged over blocks and patches (windows are small, frames
    large): what a math kernel's softmax keeps per query and head."""
    patches = visual_patches(vision, inputs)
    if not patches:
        return 0.0
    pairs = sum(
        vision.attention_pairs(block, h, w, f)
        for block in range(vision.depth)
        for f, h, w in inputs
    )
    return pairs / (vision.depth * patches)


@dataclass(frozen=True)
class OutsideBlocks:
    """Elements one row keeps outside the tower's blocks (module docstring)."""

    floats: int  # in the activation dtype: patches and the merger's tensors
    fp32: int  # rotary cos and sin, the merger norm's statistics
    input_floats: int  # of `floats`: the patches (a frozen patch embedding keeps none)
    merger_inputs: int  # of `floats`: what a frozen merger keeps not (its linears' inputs)
    index_int64: int  # the attention's gather indices, without checkpointing only


def saved_outside_blocks(vision: NativeVisionSpec, inputs: Sequence[Visual]) -> OutsideBlocks:
    n, w = visual_patches(vision, inputs), vision.width
    rms = vision.norm == "rms_norm"
    stats = 1 if rms else 2  # RMSNorm: one statistic; LayerNorm: mean and rstd
    copy = 1 if rms else 0  # the (unfused) RMSNorm's normalised copy its weight scales
    # the merger: norm input, copy, fc1 input, GELU input, fc2 input (w per patch each: a merged
    # token is merge_size^2 patches side by side)
    merger = (1 + copy + 3) * n * w
    kinds = len({vision.is_windowed(block) for block in range(vision.depth)})
    return OutsideBlocks(
        floats=n * vision.patch_dim() + merger,
        fp32=2 * n * vision.head_dim() + stats * n,
        input_floats=n * vision.patch_dim(),
        merger_inputs=(copy + 2) * n * w,
        # each kind's indices and their inverse, in one buffer with the patches' positions
        # [n, 2] (models/native_vision.py `VisionLayout.to`): a kept index keeps it whole
        index_int64=2 * n * kinds + 2 * n,
    )


# ----------------------------------------------------------------------------- the CLI's sizes
_SPEC = re.compile(r"^(?:(\d+)x)?(\d+)x(\d+)$")


def parse_visual(vision: NativeVisionSpec, text: str) -> Visual:
    """`HxW` (an image of that original size) or `FxHxW` (a clip of F frames) as the tower sees
    it: resized by the processor's rule (an image within the spec's pixel budget, a clip's
    frames within the video processor's, VIDEO_MIN_PIXELS .. VIDEO_MAX_PIXELS), a clip's frames
    rounded down to whole temporal patches. FieldError naming --visual otherwise."""
    match = _SPEC.match(text.strip().lower())
    if match is None:
        raise FieldError(
            FLAG,
            f"{text!r} is not HxW (an image, e.g. 1024x768) or FxHxW (a clip of F frames, "
            "e.g. 16x480x640), in pixels",
        )
    frames_text, height, width = match.group(1), int(match.group(2)), int(match.group(3))
    try:
        if frames_text is None:
            return 1, *vision.resized(height, width)
        frames = int(frames_text) // vision.temporal_patch * vision.temporal_patch
        if frames == 0:
            raise ValueError(
                f"a clip of {frames_text} frame(s) holds no whole temporal patch of "
                f"{vision.temporal_patch} frames"
            )
        return frames, *vision.resized(height, width, VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS)
    except ValueError as err:
        raise FieldError(FLAG, f"{text!r}: {err}") from None


def describe(inputs: Sequence[Visual]) -> str:
    """`image 980x980, clip 16x448x448`: what a row holds, for messages."""
    parts = [f"image {h}x{w}" if f == 1 else f"clip {f}x{h}x{w}" for f, h, w in inputs]
    return ", ".join(parts) or "no image"
