"""Attention runs in one dtype: with fp32 parameters under bf16 autocast (DDP or one GPU), every
attention kernel of every model receives q, k and v in the autocast dtype.

Flex attention is not covered by autocast: handed bf16 v beside fp32 q and k it refuses (torch
<= 2.10) or runs in fp32. SDPA is covered, but the decoder's choice of kernel (grouped k/v with
`enable_gqa`, or k/v repeated to every query head) is made on the dtype it is handed: fp32 q
on CUDA repeats k and v. So the dtypes are recorded where the models hand q, k and v to the
kernel (SDPA's and flex attention's Python entry points, wrapped: the real kernels still run),
on the CPU under `torch.autocast("cpu", torch.bfloat16)`, which casts like CUDA's autocast.

Rotary numerics: q and k are rotated in float32 from float32 angle tables and rounded once to
their dtype, so a bf16 result is the exact rotation of its bf16 input within one bf16 rounding
(unit roundoff 2^-8, relative to each result) plus float32's rounding of the two products and
their sum (a few 2^-24 of the terms' magnitudes); bf16 angle tables (the old path in a bf16
model) miss that bound by their own 2^-8 rounding of cos and sin.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as flex_module

import mmtrain
from mmtrain.models import attention
from mmtrain.models.attention import attention_dtype, sdpa_groups_kv
from mmtrain.models.decoder import (
    ROTARY_DTYPE,
    Decoder,
    apply_rotary,
    rope_frequencies,
    rotary_cos_sin,
)
from mmtrain.models.native_vision import NativeVisionTower
from mmtrain.spec import ModelSpec, load_spec

BF16 = torch.bfloat16


class KernelInputs:
    """Records the dtypes of (q, k, v) at every call of SDPA and flex attention, then calls
    the real function."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[str, tuple[torch.dtype, ...], tuple[int, ...], tuple[int, ...]]]
        self.calls = []
        sdpa, flex = F.scaled_dot_product_attention, flex_module.flex_attention

        def recording(name, real):
            def call(q, k, v, *args, **kwargs):
                self.calls.append((name, (q.dtype, k.dtype, v.dtype), q.shape, k.shape))
                return real(q, k, v, *args, **kwargs)

            return call

        monkeypatch.setattr(F, "scaled_dot_product_attention", recording("sdpa", sdpa))
        monkeypatch.setattr(attention, "flex_attention", recording("flex", flex))

    def dtypes(self) -> set[tuple[torch.dtype, ...]]:
        return {dtypes for _, dtypes, _, _ in self.calls}

    def kernels(self) -> set[str]:
        return {name for name, *_ in self.calls}


def fp32_decoder(seed: int = 0) -> Decoder:
    model = Decoder(load_spec("tiny-vlm").decoder)  # 4 query heads, 2 kv heads
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def ids(rows: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def packed_ids() -> torch.Tensor:
    return torch.tensor([[0] * 90 + [1] * 70 + [0] * 40, [3] * 150 + [4] * 50])


def decoder_case(case: str, model: Decoder):
    """One decoder forward of `case` (each an attention path of models/attention.py)."""
    if case == "causal":
        return model(ids(2, 24))
    if case == "padded_mask":  # left padding: the dense boolean mask
        mask = torch.arange(24)[None] >= torch.tensor([[0], [5]])
        return model(ids(2, 24), attention_mask=mask)
    if case == "packed_dense":  # the CPU's packed path
        return model(ids(2, 200), document_ids=packed_ids())
    if case == "generate":  # a KV cache (in the parameters' fp32) beside bf16 queries
        return model.generate(ids(2, 6), 3)
    raise ValueError(case)


@pytest.mark.parametrize("case", ["causal", "padded_mask", "packed_dense", "generate"])
def test_the_decoder_hands_sdpa_one_dtype_under_autocast(monkeypatch, case):
    model = fp32_decoder()
    recorded = KernelInputs(monkeypatch)
    with torch.autocast("cpu", dtype=BF16):
        out = decoder_case(case, model)
    if case != "generate":
        out.float().sum().backward()  # and it trains
    assert recorded.kernels() == {"sdpa"}
    assert recorded.dtypes() == {(BF16, BF16, BF16)}
    # grouped-query attention: k and v stay 2 heads wide for the 4 query heads
    assert {(q[1], k[1]) for _, _, q, k in recorded.calls} == {(4, 2)}


def test_packed_rows_reach_flex_attention_in_the_autocast_dtype(monkeypatch):
    """The flex path (forced on the CPU: eager flex attention, forward only): flex attention is
    not covered by autocast, so mixed q/k/v would reach it as they are."""
    model = fp32_decoder()
    monkeypatch.setattr(attention, "flex_attention_trains", lambda device, dtype: True)
    recorded = KernelInputs(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        model(ids(2, 200), document_ids=packed_ids())
    assert recorded.kernels() == {"flex"}
    assert recorded.dtypes() == {(BF16, BF16, BF16)}


def test_grouped_kv_stay_grouped_for_cuda_sdpa_in_the_autocast_dtype():
    """On CUDA SDPA takes grouped k/v (`enable_gqa`) in 16-bit without a mask: the dtype the
    decoder now hands it under autocast (above). fp32 (the old q and k) repeated them."""
    cuda = torch.device("cuda")
    assert sdpa_groups_kv(cuda, BF16, None)
    assert not sdpa_groups_kv(cuda, torch.float32, None)
    assert not sdpa_groups_kv(cuda, BF16, torch.ones(1, 1, 2, 2, dtype=torch.bool))
    assert sdpa_groups_kv(torch.device("cpu"), torch.float32, torch.ones(1, dtype=torch.bool))


def test_attention_dtype_is_the_autocast_dtype_or_the_common_one():
    f32, f64 = torch.ones(1), torch.ones(1, dtype=torch.float64)
    half = torch.ones(1, dtype=BF16)
    assert attention_dtype(f32, f32, half) == torch.float32  # no autocast: the common dtype
    with torch.autocast("cpu", dtype=BF16):
        assert attention_dtype(f32, f32, half) == BF16
        assert attention_dtype(f32, f32, f32) == BF16
        assert attention_dtype(f64, f64, f64) == torch.float64  # autocast leaves float64 alone


# ----------------------------------------------------------------------------- other towers
def tiny_mmdit() -> ModelSpec:
    d = {"architecture": "mmdit", "sample_size": 8, "channels": 4, "patch_size": 2, "width": 32,
         "layers": 2, "heads": 2, "text_width": 24, "pooled_width": 20, "text_tokens": 5,
         "pos_embed_max_size": 6, "input": "latent", "qk_norm": "rms_norm"}  # fmt: skip
    return ModelSpec.from_dict({"name": "tiny-mmdit", "objective": "flow_matching", "denoiser": d})


def tower_case(case: str):
    g = torch.Generator().manual_seed(2)
    if case == "native_vision":  # Qwen2.5-VL's layout: windowed and full-attention blocks
        tower = NativeVisionTower(load_spec("tiny-qwen2-vl").vision)
        return lambda: tower.embed([torch.rand(3, 32, 48, generator=g)])[0]
    if case == "dit":
        model = mmtrain.create_model(load_spec("tiny-dit"), seed=0)
        batch = {"image": torch.randn(2, 3, 32, 32, generator=g),
                 "timestep": torch.tensor([1.0, 500.0]), "class": torch.tensor([0, 1])}  # fmt: skip
        return lambda: model.predict(batch)
    model = mmtrain.create_model(tiny_mmdit(), seed=0)
    batch = {"latent": torch.randn(2, 4, 8, 8, generator=g), "timestep": torch.tensor([3.0, 900.0]),
             "text_hidden": torch.randn(2, 5, 24, generator=g),
             "text_pooled": torch.randn(2, 20, generator=g)}  # fmt: skip
    return lambda: model.predict(batch)


@pytest.mark.parametrize("case", ["native_vision", "dit", "mmdit"])
def test_every_tower_hands_attention_one_dtype_under_autocast(monkeypatch, case):
    forward = tower_case(case)
    recorded = KernelInputs(monkeypatch)
    with torch.autocast("cpu", dtype=BF16):
        forward().float().sum().backward()
    assert recorded.calls
    assert recorded.dtypes() == {(BF16, BF16, BF16)}


# ----------------------------------------------------------------------------- rotary numerics
def rotary_bound(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, reference: torch.Tensor):
    """One rounding to x's dtype of each result, plus float32's rounding of the two products
    and their sum (3 roundings at 2^-24 of the terms' magnitude)."""
    first, second = x.double().chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    terms = (x.double() * cos[:, None]).abs() + (rotated * sin[:, None]).abs()
    unit = torch.finfo(x.dtype).eps / 2
    return unit * reference.abs() + 3 * 2**-24 * terms


def test_rotary_rounds_once_to_the_input_dtype():
    spec = load_spec("tiny-vlm").decoder
    # long positions: large angles, where a bf16 angle table is far off
    positions = torch.arange(4000, 4064).expand(2, 64)
    cos, sin = rotary_cos_sin(rope_frequencies(spec), positions)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 4, 64, spec.head_dim, generator=g) * 8).to(BF16)
    reference = apply_rotary(x.double(), cos.double(), sin.double())  # exact up to 1e-16
    rotated = apply_rotary(x, cos, sin)
    assert rotated.dtype == BF16
    error = (rotated.double() - reference).abs()
    assert torch.all(error <= rotary_bound(x, cos.double(), sin.double(), reference))
    # the bound is tight enough to tell: bf16 angle tables (as a bf16 model built them) miss it
    first, second = x.chunk(2, dim=-1)
    old = x * cos.to(BF16)[:, None] + torch.cat([-second, first], -1) * sin.to(BF16)[:, None]
    old_error = (old.double() - reference).abs()
    assert not torch.all(old_error <= rotary_bound(x, cos.double(), sin.double(), reference))


def test_the_decoder_rotates_in_float32_whatever_its_dtype(monkeypatch):
    """A bf16 model and an fp32 model under autocast both get their rotated q and k from the
    float32 tables (the angle tables are never rounded to 16 bits)."""
    seen = []
    real = attention.attend

    def recording(q, k, v, mask, is_causal):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, mask, is_causal)

    import mmtrain.models.decoder as decoder_module

    monkeypatch.setattr(decoder_module, "attend", recording)
    tables = []
    real_tables = decoder_module.rotary_cos_sin

    def recording_tables(*args, **kwargs):
        cos, sin = real_tables(*args, **kwargs)
        tables.append(cos.dtype)
        return cos, sin

    monkeypatch.setattr(decoder_module, "rotary_cos_sin", recording_tables)
    model = fp32_decoder()
    for context, m in ((torch.autocast("cpu", dtype=BF16), model),
                       (contextlib.nullcontext(), fp32_decoder().to(BF16))):  # fmt: skip
        with context, torch.no_grad():
            m(ids(2, 16))
    assert set(tables) == {ROTARY_DTYPE}
    assert set(seen) == {(BF16, BF16, BF16)}
