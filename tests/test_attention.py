"""The decoder's attention paths (models/attention.py) compute what the dense-mask reference
computes: right-padded rows without a mask, packed rows through flex attention's BlockMask,
grouped-query attention with grouped k/v.

Tolerance: float64 on both sides. The paths run the same attention sums over the same keys
(masked keys contribute exact zeros), in possibly another order: each rounding ~1e-16
relative over sums of at most a few hundred O(1) terms, so ~1e-13; ATOL 1e-12 / RTOL 1e-9
leave orders of magnitude on any CPU, while attending one wrong key changes an output at ~1e-2.
On CUDA (fp32 flex kernel against fp32 SDPA) each side rounds at 6e-8 relative over sums of
a few hundred O(1) terms: at most ~1e-5, so 1e-4 (DESIGN.md's fp32 interop bound).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

import mmtrain
from mmtrain.models import attention
from mmtrain.models.attention import (
    attend,
    attention_inputs,
    build_attention_mask,
    document_block_mask,
    flex_attention_trains,
)
from mmtrain.models.decoder import Decoder, document_positions
from mmtrain.spec import load_spec

EXACT = {"rtol": 1e-9, "atol": 1e-12}
CPU = torch.device("cpu")


def decoder(seed: int = 0, **changes) -> Decoder:
    spec = load_spec("tiny-vlm").decoder.replace(**changes)  # 4 query heads, 2 kv heads
    model = Decoder(spec).double()
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def token_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


# ----------------------------------------------------------------------------- right padding
def test_right_padded_rows_attend_causally_without_a_mask():
    model = decoder(seed=1)
    ids = token_ids(3, 20, seed=2)
    lengths = torch.tensor([20, 13, 5])
    mask = torch.arange(20)[None] < lengths[:, None]
    real = mask[..., None]
    weights = torch.randn(3, 20, model.spec.vocab_size, dtype=torch.float64)  # a loss on reals
    outputs = {}
    for right_padded in (False, True):
        logits = model(ids, attention_mask=mask, right_padded=right_padded)
        (logits * weights * real).sum().backward()
        outputs[right_padded] = (logits.detach() * real, grads(model))
    torch.testing.assert_close(outputs[True][0], outputs[False][0], **EXACT)
    for name, grad in outputs[False][1].items():
        torch.testing.assert_close(outputs[True][1][name], grad, **EXACT, msg=name)
    # ... and it is the mask-free path: no mask, SDPA's causal kernel.
    assert attention_inputs(20, 0, CPU, torch.float64, mask, None, True) == (None, True)
    # With a KV cache the mask stays (the cached keys are not causal to the new ones).
    kept, causal = attention_inputs(1, 19, CPU, torch.float64, mask, None, True)
    assert kept is not None and not causal


def test_the_language_model_recognises_right_padding_only():
    model = mmtrain.create_model(load_spec("tiny-vlm"), dtype=torch.float64, seed=3)
    text = token_ids(2, 9, seed=4)
    right = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    left = right.flip(1)
    _, layout, kwargs = model._decoder_inputs({"text": text, "attention_mask": right})
    assert layout.right_padded and kwargs["right_padded"] is True
    _, layout, kwargs = model._decoder_inputs({"text": text, "attention_mask": left})
    assert not layout.right_padded and kwargs["right_padded"] is False
    # Left padding keeps its mask: row 1's real ids give the logits they give alone.
    together = model.logits({"text": text, "attention_mask": left})
    alone = model.logits({"text": text[1:, 3:]})
    torch.testing.assert_close(together[1, 3:], alone[0], **EXACT)


# ----------------------------------------------------------------------------- packed rows
def packed_documents() -> torch.Tensor:
    """Two rows of 200 positions (two 128-blocks, the second partial): documents across the
    block boundary, an id that comes back (a new document), and trailing padding (-1)."""
    first = [0] * 90 + [1] * 70 + [0] * 30 + [-1] * 10
    second = [3] * 150 + [4] * 50
    return torch.tensor([first, second])


def test_block_mask_attention_equals_the_dense_mask():
    docs = packed_documents()
    q = torch.randn(2, 4, 200, 16, dtype=torch.float64)
    k = torch.randn(2, 2, 200, 16, dtype=torch.float64)
    v = torch.randn(2, 2, 200, 16, dtype=torch.float64)
    mask, causal = build_attention_mask(200, 0, CPU, None, docs)
    dense = attend(q, k, v, mask, causal)
    flex = attend(q, k, v, document_block_mask(docs), False)  # eager flex attention, forward
    torch.testing.assert_close(flex, dense, **EXACT)


def test_packed_decoder_logits_through_flex_equal_the_dense_path(monkeypatch):
    """The whole decoder forward with the flex path forced on the CPU (eager flex attention:
    forward only, as torch 2.13 has no CPU flex backward) against the dense fallback."""
    model = decoder(seed=5)
    ids = token_ids(2, 200, seed=6)
    docs = packed_documents()
    with torch.no_grad():
        dense = model(ids, document_ids=docs)
        monkeypatch.setattr(attention, "flex_attention_trains", lambda device, dtype: True)
        mask, _ = attention_inputs(200, 0, CPU, torch.float64, None, docs)
        assert isinstance(mask, BlockMask)
        flex = model(ids, document_ids=docs)
    torch.testing.assert_close(flex, dense, **EXACT)


def test_flex_attention_trains_on_cuda_only_and_not_in_float64():
    """The explicit fallback: packed rows use the dense mask on the CPU (no flex backward in
    torch 2.13; inductor's CPU flex kernel refuses float64) and in float64 on CUDA."""
    cuda = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert flex_attention_trains(cuda, dtype)
        assert not flex_attention_trains(CPU, dtype)
    assert not flex_attention_trains(cuda, torch.float64)
    mask, causal = attention_inputs(200, 0, CPU, torch.float32, None, packed_documents())
    assert isinstance(mask, torch.Tensor) and mask.shape == (2, 1, 200, 200) and not causal


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention trains on CUDA")
def test_packed_rows_on_cuda_train_through_flex_like_the_dense_mask():
    model = decoder(seed=7).float().cuda()
    ids, docs = token_ids(2, 200, seed=8).cuda(), packed_documents().cuda()
    weights = torch.randn(2, 200, model.spec.vocab_size, device="cuda")
    mask, _ = attention_inputs(200, 0, ids.device, torch.float32, None, docs)
    assert isinstance(mask, BlockMask)
    flex_logits = model(ids, document_ids=docs)
    (flex_logits * weights).sum().backward()
    flex = grads(model)
    # The reference: the same block-diagonal causal mask, dense, given per query.
    dense, _ = build_attention_mask(200, 0, ids.device, None, docs)
    reference = model(ids, attention_mask=dense[:, 0], position_ids=document_positions(docs))
    (reference * weights).sum().backward()
    torch.testing.assert_close(flex_logits, reference, rtol=1e-4, atol=1e-4)
    for name, grad in grads(model).items():
        torch.testing.assert_close(flex[name], grad, rtol=1e-4, atol=1e-4, msg=name)


# ----------------------------------------------------------------------------- grouped queries
@pytest.mark.parametrize("masked", [False, True])
def test_grouped_kv_equal_repeated_kv(masked):
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 6, 12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    key_mask = torch.arange(12)[None] < torch.tensor([[12], [7]]) if masked else None
    mask, causal = build_attention_mask(12, 0, CPU, key_mask)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
        grouped = attend(q, k, v, mask, causal)
    assert (2, 2, 12, 8) in kept  # the kernel keeps k, v kv_heads wide (nothing repeated)
    repeated = F.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask, is_causal=causal
    )
    torch.testing.assert_close(grouped, repeated, **EXACT)
    w = torch.randn(grouped.shape, dtype=torch.float64, generator=g)
    first = torch.autograd.grad((grouped * w).sum(), (q, k, v))
    second = torch.autograd.grad((repeated * w).sum(), (q, k, v))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, **EXACT)


def test_planner_keeps_the_dense_packed_mask_on_the_cpu_only():
    from mmtrain.plan.activations import ActivationOptions, layer_terms
    from mmtrain.plan.workloads import load_model

    stack = load_model("tiny-vlm", context=192, packed=True).stack("text")
    assert stack.document_mask
    gpu = layer_terms(stack, 2, ActivationOptions())
    cpu = layer_terms(stack, 2, dataclasses.replace(ActivationOptions(), dense_packed_mask=True))
    assert "attention_mask" not in gpu
    assert cpu["attention_mask"] == 2 * 192 * 192 * 4  # SDPA's fp32 [b, 1, s, s] mask
