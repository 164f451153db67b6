"""The native-resolution vision tower (native_vision_spec.py, models/native_vision.py) against
transformers' Qwen2-VL / Qwen2.5-VL: the resize rule is `smart_resize`'s, the patches are the
image (and video) processor's `pixel_values` and grids, the tower computes what transformers'
vision models compute from the same weights, and the spec counts what both hold and compute.

transformers' vision models are built from tiny configs (no download), every weight drawn from
N(0, 0.2) (norms away from 1 and biases away from 0, which would hide a swapped tensor), and
copied into ours by renaming (`our_state`).

Tolerances. In float64 both sides compute the same sums in different orders: each rounding is
~1e-16 relative, no sum here has more than a few hundred terms and the outputs are a few units,
so they agree to ~1e-14 (measured: 3e-15); FP64_ATOL 1e-10 leaves orders of magnitude on any
CPU. Two reference details would hide that agreement behind float32 rounding, so for the
float64 comparisons only `float64_reference` gives transformers the promotion our code does
(its formulas unchanged): its RMSNorm and its rotation of q and k cast a float64 input *down*
to float32 (they are meant to upcast bf16). The rotary angle tables are float32 on both sides whatever the dtype (the
checkpoints expect those rounded tables). One float32 comparison runs transformers as shipped,
within FP32_RTOL of the outputs' largest magnitude: float32 rounds each value to ~6e-8 relative
and a few layers of sums of a few hundred terms grow that to ~1e-6; 1e-4 is the interop
contract of DESIGN.md section 5.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl import modeling_qwen2_vl
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

from mmtrain.models.native_vision import NativeVisionTower
from mmtrain.native_vision_spec import (
    QWEN2_5_VL_7B_VISION,
    QWEN2_VL_7B_VISION,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    NativeVisionSpec,
)
from mmtrain.structured import FieldError

FP64_ATOL = 1e-10
FP32_RTOL = 1e-4

# Tiny towers: patches of 4 pixels, 2 x 2 merge, so a merged token is 8 x 8 pixels; Qwen2.5's
# windows are 16 pixels (2 x 2 merged tokens) and its block 1 attends over whole frames.
TINY_QWEN2 = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=4, hidden_size=24,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
TINY_QWEN2_5 = dict(depth=3, hidden_size=48, num_heads=4, intermediate_size=40,
                    out_hidden_size=24, patch_size=4, spatial_merge_size=2,
                    temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1])  # fmt: skip
FAMILIES = ("qwen2_vl", "qwen2_5_vl")


def tiny_spec(family: str) -> NativeVisionSpec:
    if family == "qwen2_vl":
        return NativeVisionSpec(patch_size=4, width=32, depth=2, heads=2, mlp_hidden=128,
                                out_width=24)  # fmt: skip
    return NativeVisionSpec(patch_size=4, width=48, depth=3, heads=4, mlp_hidden=40,
                            mlp="swiglu", activation="silu", norm="rms_norm", out_width=24,
                            window_size=16, full_attention_blocks=(1,))  # fmt: skip


def hf_tower(family: str, seed: int = 0, **config) -> torch.nn.Module:
    """transformers' vision model of the family, every weight random, in float64."""
    torch.manual_seed(seed)
    if family == "qwen2_vl":
        model = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(
            Qwen2VLVisionConfig(**{**TINY_QWEN2, **config})
        )
    else:
        model = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(
            Qwen2_5_VLVisionConfig(**{**TINY_QWEN2_5, **config})
        )
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.double().eval()


RENAMES = (
    ("patch_embed.proj.", "patch_embed."),
    (".attn.proj.", ".attn.out."),
    (".mlp.down_proj.", ".mlp.fc2."),
    ("merger.ln_q.", "merger.norm."),
    ("merger.mlp.0.", "merger.fc1."),
    ("merger.mlp.2.", "merger.fc2."),
)


def our_state(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' vision weights under our names: renames, and Qwen2.5's gate and up
    projections stacked (gate first) into mlp.fc1."""
    state = {}
    for name, value in hf_state.items():
        if ".mlp.up_proj." in name:
            continue  # stacked under its gate
        if ".mlp.gate_proj." in name:
            up = hf_state[name.replace("gate_proj", "up_proj")]
            name, value = name.replace("gate_proj", "fc1"), torch.cat([value, up])
        for old, new in RENAMES:
            name = name.replace(old, new)
        state[name] = value
    return state


def our_tower(family: str, hf: torch.nn.Module) -> NativeVisionTower:
    tower = NativeVisionTower(tiny_spec(family)).to(next(hf.parameters()).dtype)
    tower.load_state_dict(our_state(hf.state_dict()), strict=True)
    return tower.eval()


def rms_norm_in_input_precision(self, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm formula, normalising in at least float32 instead of always in
    float32 (which rounds a float64 input to float32)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def rotary_in_input_precision(q, k, cos, sin):
    """transformers' vision rotation of q and k in at least float32 instead of always in
    float32 (its angle tables stay float32 either way)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    cos, sin = cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)
    q, k = q.to(dtype), k.to(dtype)
    rotate = modeling_qwen2_vl.rotate_half
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


@pytest.fixture
def float64_reference(monkeypatch):
    monkeypatch.setattr(
        modeling_qwen2_5_vl.Qwen2_5_VLRMSNorm, "forward", rms_norm_in_input_precision
    )
    for module in (modeling_qwen2_vl, modeling_qwen2_5_vl):
        monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", rotary_in_input_precision)


def pixels(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# Inputs of the tiny towers (sides multiples of 8): 1:1 with whole windows, 1:4, 3:1 with
# windows cut at the bottom and right edges, one merged token, a 4-frame clip.
CASES = {
    "square": [(3, 32, 32)],
    "tall_1_to_4": [(3, 16, 64)],
    "wide_3_to_1": [(3, 72, 24)],
    "several": [(3, 32, 32), (3, 72, 24), (3, 8, 8), (4, 3, 24, 40)],
    "clip": [(4, 3, 24, 40)],
}


def case_inputs(case: str, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [pixels(*shape, seed=i, dtype=dtype) for i, shape in enumerate(CASES[case])]


# ----------------------------------------------------------------------------- the resize rule
def reference_resize(height: int, width: int, **budget) -> tuple[int, int] | str:
    try:
        return smart_resize(height, width, factor=28, **budget)
    except ValueError:
        return "refused"


def our_resize(height: int, width: int, **budget) -> tuple[int, int] | str:
    try:
        return QWEN2_VL_7B_VISION.resized(height, width, **budget)
    except ValueError:
        return "refused"


def test_resized_is_transformers_smart_resize():
    named = [(1, 1), (10, 10), (27, 29), (56, 56), (100, 400), (224, 896), (300, 100),
             (999, 333), (4000, 3000), (8192, 8192), (20000, 100), (28, 5600), (28, 5601),
             (1, 300), (3, 7), (1080, 1920), (14, 14), (42, 42), (70, 98)]  # fmt: skip
    drawn = np.random.default_rng(0).integers(1, 6000, size=(400, 2)).tolist()
    budgets = [{}, {"min_pixels": VIDEO_MIN_PIXELS, "max_pixels": VIDEO_MAX_PIXELS},
               {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}]  # fmt: skip
    for budget in budgets:
        for height, width in named + drawn:
            expected = reference_resize(height, width, **budget)
            assert our_resize(height, width, **budget) == expected, (height, width, budget)
    assert reference_resize(28, 5601) == "refused"  # the aspect-ratio limit is in the sample


def test_resize_refuses_extreme_aspect_ratios_and_empty_images():
    with pytest.raises(ValueError, match="aspect ratio of 201.0"):
        QWEN2_VL_7B_VISION.resized(10, 2010)
    with pytest.raises(ValueError, match="no area"):
        QWEN2_VL_7B_VISION.resized(0, 100)


def test_grid_and_tokens_of_images_and_clips():
    spec = QWEN2_VL_7B_VISION
    assert spec.grid(56, 84) == (1, 4, 6) and spec.tokens(56, 84) == 6
    assert spec.grid(56, 84, frames=8) == (4, 4, 6) and spec.tokens(56, 84, frames=8) == 24
    # the largest image the default budget admits: at most 1280 LM tokens
    assert spec.tokens(*spec.resized(4000, 3000)) <= 1280


# ----------------------------------------------------------------------------- patches
def test_patchify_equals_the_image_processor():
    with torch.device("meta"):  # patchify needs no weights
        tower = NativeVisionTower(QWEN2_VL_7B_VISION)
    images = [pixels(3, h, w, seed=i, dtype=torch.float32)
              for i, (h, w) in enumerate([(56, 84), (28, 112), (84, 28), (28, 28)])]  # fmt: skip
    processor = Qwen2VLImageProcessorPil(
        do_resize=False, do_rescale=False, do_normalize=False, do_convert_rgb=False,
        patch_size=14, temporal_patch_size=2, merge_size=2,
    )  # fmt: skip
    expected = processor([x.numpy() for x in images], input_data_format="channels_first",
                         return_tensors="pt")  # fmt: skip
    patches, grid = tower.patchify(images)
    assert torch.equal(patches, expected["pixel_values"])
    assert torch.equal(grid, expected["image_grid_thw"])


def test_a_clip_patches_its_frames_as_the_image_processor_does_each():
    """The video processor's layout (transformers' Qwen2VLVideoProcessor.patchify): temporal
    patch by temporal patch, each laid out as an image's patches, frame j of the pair in the
    patch's values (channel, frame j, row, column). Checked frame by frame against the image
    processor, which needs no torchvision."""
    spec = QWEN2_VL_7B_VISION
    with torch.device("meta"):
        tower = NativeVisionTower(spec)
    clip = pixels(4, 3, 56, 84, dtype=torch.float32)
    patches, grid = tower.patchify([clip])
    assert grid.tolist() == [[2, 4, 6]]
    p, tp = spec.patch_size, spec.temporal_patch
    ours = patches.reshape(2, 24, 3, tp, p, p)
    processor = Qwen2VLImageProcessorPil(do_resize=False, do_rescale=False, do_normalize=False,
                                         do_convert_rgb=False)  # fmt: skip
    for frame in range(4):
        image = processor([clip[frame].numpy()], input_data_format="channels_first",
                          return_tensors="pt")["pixel_values"]  # fmt: skip
        time, j = divmod(frame, tp)
        assert torch.equal(ours[time, :, :, j], image.reshape(24, 3, tp, p, p)[:, :, 0])


def test_patchify_equals_the_video_processor():
    pytest.importorskip("torchvision")  # transformers' video processor imports it
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    with torch.device("meta"):
        tower = NativeVisionTower(QWEN2_VL_7B_VISION)
    clips = [pixels(4, 3, 56, 84, dtype=torch.float32), pixels(2, 3, 28, 112, seed=1,
                                                                dtype=torch.float32)]  # fmt: skip
    processor = Qwen2VLVideoProcessor(do_resize=False, do_rescale=False, do_normalize=False,
                                      do_convert_rgb=False, do_sample_frames=False)  # fmt: skip
    expected = processor(videos=clips, input_data_format="channels_first", return_tensors="pt",
                         cap_pixels_per_frame=False)  # fmt: skip
    patches, grid = tower.patchify(clips)
    assert torch.equal(patches, expected["pixel_values_videos"])
    assert torch.equal(grid, expected["video_grid_thw"])


# ----------------------------------------------------------------------------- transformers parity
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_equal_transformers_in_float64(family, case, float64_reference):
    hf = hf_tower(family)
    ours = our_tower(family, hf)
    patches, grid = ours.patchify(case_inputs(case))
    with torch.no_grad():
        expected = hf(patches, grid_thw=grid).pooler_output
        got = ours(patches, grid)
    assert got.shape == (sum(ours.spec.tokens(*x.shape[-2:], x.shape[0] if x.dim() == 4 else 1)
                             for x in case_inputs(case)), 24)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=FP64_ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_equal_transformers_as_shipped_in_float32(family):
    hf = hf_tower(family).float()
    ours = our_tower(family, hf)
    patches, grid = ours.patchify(case_inputs("several", torch.float32))
    with torch.no_grad():
        expected = hf(patches, grid_thw=grid).pooler_output
        got = ours(patches, grid)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=FP32_RTOL * scale, rtol=0)


def test_windows_change_the_output_and_inputs_do_not_see_each_other(float64_reference):
    hf = hf_tower("qwen2_5_vl")
    ours = our_tower("qwen2_5_vl", hf)
    images = case_inputs("several")
    alone = [ours.embed([x])[0] for x in images]
    together = ours.embed(images)
    for one, many in zip(alone, together, strict=True):
        torch.testing.assert_close(many, one, atol=FP64_ATOL, rtol=0)
    # the same weights with every block attending over whole frames: another output
    full = NativeVisionTower(dataclasses.replace(ours.spec, window_size=0,
                                                 full_attention_blocks=())).double()  # fmt: skip
    full.load_state_dict(ours.state_dict())
    assert not torch.allclose(full.embed(images[:1])[0], alone[0], atol=1e-3)


# ----------------------------------------------------------------------------- counts
@pytest.mark.parametrize(
    ("spec", "config", "expected"),
    [
        (QWEN2_VL_7B_VISION, Qwen2VLVisionConfig(), 675_759_104),
        (QWEN2_5_VL_7B_VISION, Qwen2_5_VLVisionConfig(hidden_size=1280, out_hidden_size=3584),
         676_550_144),
    ],
    ids=FAMILIES,
)  # fmt: skip
def test_params_count_what_transformers_and_the_module_hold(spec, config, expected):
    # the Qwen2.5 config: transformers' defaults but for the vision width (its default 3584 is
    # the LM's; the checkpoint's vision_config says hidden_size 1280)
    with torch.device("meta"):
        ours = NativeVisionTower(spec)
        if isinstance(config, Qwen2VLVisionConfig):
            hf = modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel(config)
        else:
            hf = modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel(config)
    assert spec.params() == sum(p.numel() for p in ours.parameters()) == expected
    assert sum(p.numel() for p in hf.parameters()) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_params_count_the_module(family):
    spec = tiny_spec(family)
    assert spec.params() == sum(p.numel() for p in NativeVisionTower(spec).parameters())


def counted_flops(tower: NativeVisionTower, inputs: list[torch.Tensor]) -> int:
    patches, grid = tower.patchify(inputs)
    # the math kernel: its matmuls are what the counter sees of attention
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        tower(patches, grid)
    return counter.get_total_flops()


def spec_flops(spec: NativeVisionSpec, inputs: list[torch.Tensor]) -> int:
    return sum(spec.forward_flops(*x.shape[-2:], x.shape[0] if x.dim() == 4 else 1) for x in inputs)


@pytest.mark.parametrize("case", ["square", "wide_3_to_1", "clip"])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_flops_equal_the_flop_counter(family, case):
    tower = NativeVisionTower(tiny_spec(family))
    inputs = case_inputs(case, torch.float32)
    assert counted_flops(tower, inputs) == spec_flops(tower.spec, inputs)


def test_forward_flops_of_the_qwen2_5_preset_at_a_real_size():
    """112-pixel windows cut at both edges (18 x 12 merged tokens: 4 + 4 + 4 + 4 + 2 by
    4 + 4 + 4), counted on the meta device (shapes only)."""
    spec = QWEN2_5_VL_7B_VISION
    height, width = spec.resized(500, 330)
    assert (height, width) == (504, 336)
    with torch.device("meta"):
        tower = NativeVisionTower(spec)
        patches = torch.empty(spec.patches(height, width), spec.patch_dim())
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        tower(patches, torch.tensor([spec.grid(height, width)]))
    assert counter.get_total_flops() == spec.forward_flops(height, width)
    # windows cost less than whole frames would
    unwindowed = dataclasses.replace(spec, window_size=0, full_attention_blocks=())
    assert spec.forward_flops(height, width) < unwindowed.forward_flops(height, width)


# ----------------------------------------------------------------------------- bad fields, inputs
def test_spec_round_trips_through_dicts():
    for spec in (QWEN2_VL_7B_VISION, QWEN2_5_VL_7B_VISION):
        data = spec.to_dict()
        assert data["full_attention_blocks"] == list(spec.full_attention_blocks)
        assert NativeVisionSpec.from_dict(data) == spec


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"width": 0}, "width"),
        ({"patch_size": -14}, "patch_size"),
        ({"heads": 3}, "heads"),
        ({"width": 40, "heads": 4}, "heads"),  # heads of 10 channels: not a multiple of 4
        ({"mlp": "relu"}, "mlp"),
        ({"mlp": "swiglu"}, "activation"),  # the default quick_gelu is not a SwiGLU gate
        ({"activation": "silu"}, "activation"),
        ({"norm": "batch_norm"}, "norm"),
        ({"window_size": 100}, "window_size"),
        ({"full_attention_blocks": [3]}, "full_attention_blocks"),  # no windows
        ({"window_size": 112, "full_attention_blocks": [40]}, "full_attention_blocks"),
        ({"window_size": 112, "full_attention_blocks": [15, 7]}, "full_attention_blocks"),
        ({"min_pixels": 10**7}, "min_pixels"),
        ({"widht": 1280}, "widht"),
    ],
)
def test_bad_fields_are_refused_by_name(changes, field):
    with pytest.raises(FieldError, match=rf"vision\.{field}"):
        NativeVisionSpec.from_dict(changes, path="vision")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (torch.zeros(3, 30, 32), r"pixels\[1\]: height 30 is not a positive multiple of 8"),
        (torch.zeros(3, 32, 36), r"pixels\[1\]: width 36"),
        (torch.zeros(4, 32, 32), r"pixels\[1\]: 4 channels"),
        (torch.zeros(3, 3, 32, 32), r"pixels\[1\]: a clip of 3 frames"),
        (torch.zeros(32, 32), r"pixels\[1\]: expected an image"),
    ],
)
def test_bad_inputs_are_refused_by_name(item, message):
    tower = NativeVisionTower(tiny_spec("qwen2_vl"))
    with pytest.raises(ValueError, match=message):
        tower.patchify([torch.zeros(3, 32, 32), item])


def test_bad_grids_and_sizes_are_refused():
    tower = NativeVisionTower(tiny_spec("qwen2_vl"))
    patches, grid = tower.patchify([torch.zeros(3, 32, 32)])
    with pytest.raises(ValueError, match="patches: expected"):
        tower(patches[:-4], grid)
    with pytest.raises(ValueError, match=r"grid\[0\]"):
        tower(patches, torch.tensor([[1, 8, 7]]))
    with pytest.raises(ValueError, match="height 30"):
        QWEN2_VL_7B_VISION.grid(30, 28)
    with pytest.raises(ValueError, match="a clip of 3 frames"):
        QWEN2_VL_7B_VISION.grid(28, 28, frames=3)
