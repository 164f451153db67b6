"""The decoder's attention paths (models/attention.py) compute what the dense-mask reference
computes: right-padded rows without a mask, packed rows through flex attention's BlockMask,
grouped-query attention with grouped k/v. The packed rows' BlockMask is flex attention's own
`create_block_mask` result, block for block, built from the documents' boundaries without any
tensor of B x T x T elements (a dispatch mode records the largest one made), once per forward.

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
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import mmtrain
from mmtrain.models import attention
from mmtrain.models.attention import (
    attend,
    attention_inputs,
    build_attention_mask,
    document_block_mask,
    document_runs,
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


def long_packed_documents() -> torch.Tensor:
    """Two rows of 1000 positions (8 blocks, the last partial): documents longer than a block
    (blocks wholly inside one), shorter ones, boundaries on and off block edges, padding."""
    first = [0] * 300 + [1] * 128 + [2] * 100 + [3] * 3 + [4] * 400 + [-1] * 69
    second = [5] * 128 + [6] * 256 + [5] * 600 + [-1] * 16
    return torch.tensor([first, second])


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operation returns inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.elements = max(self.elements, t.numel())
        return out


def eager_block_mask(docs: torch.Tensor) -> BlockMask:
    """The reference: flex attention's own `create_block_mask`, run eagerly on the mask."""
    runs = document_runs(docs)

    def same_document_causal(b, h, q, k):
        return (runs[b, q] == runs[b, k]) & (k <= q)

    b, t = runs.shape
    return create_block_mask(same_document_causal, b, None, t, t, device=docs.device)


def block_sets(counts: torch.Tensor, indices: torch.Tensor) -> list:
    return [[sorted(row[:n].tolist()) for row, n in zip(r[0], c[0], strict=True)]
            for r, c in zip(indices, counts, strict=True)]  # fmt: skip


@pytest.mark.parametrize("docs", [packed_documents(), long_packed_documents()], ids=["200", "1000"])
def test_block_mask_from_document_boundaries_is_create_block_masks(docs):
    reference = eager_block_mask(docs)
    with LargestTensor() as largest:
        mask = document_block_mask(docs)
    b, t = docs.shape
    # nothing quadratic in the tokens: [B, T] runs and [B, blocks, blocks] block tables
    assert largest.elements <= 2 * b * t < b * t * t
    with LargestTensor() as eager:
        eager_block_mask(docs)
    assert eager.elements >= b * t * t  # what it replaces: the whole mask, evaluated
    assert mask.seq_lengths == reference.seq_lengths == (t, t)
    assert mask.BLOCK_SIZE == reference.BLOCK_SIZE
    assert torch.equal(mask.to_dense(), reference.to_dense())
    for name in ("kv", "full_kv", "q", "full_q"):
        counts, indices = getattr(mask, f"{name}_num_blocks"), getattr(mask, f"{name}_indices")
        ref_counts = getattr(reference, f"{name}_num_blocks")
        assert torch.equal(counts, ref_counts), name
        assert block_sets(counts, indices) == block_sets(
            ref_counts, getattr(reference, f"{name}_indices")
        ), name
    if t == 1000:  # the long rows have whole blocks inside one document: skipped masking
        assert mask.full_kv_num_blocks.sum() > 0


def test_the_packed_decoder_builds_one_block_mask_for_all_its_layers(monkeypatch):
    model = decoder(seed=10, layers=4)
    docs = packed_documents()
    monkeypatch.setattr(attention, "flex_attention_trains", lambda device, dtype: True)
    built, used = [], []
    real_mask, real_flex = attention.document_block_mask, attention.flex_attention

    def counting_mask(document_ids):
        built.append(real_mask(document_ids))
        return built[-1]

    def recording_flex(q, k, v, block_mask, **kwargs):
        used.append(block_mask)
        return real_flex(q, k, v, block_mask=block_mask, **kwargs)

    monkeypatch.setattr(attention, "document_block_mask", counting_mask)
    monkeypatch.setattr(attention, "flex_attention", recording_flex)
    with torch.no_grad():
        model(token_ids(2, 200, seed=11), document_ids=docs)
    assert len(built) == 1 and len(used) == 4
    assert all(m is built[0] for m in used)


@pytest.mark.slow
def test_compiled_flex_attention_under_the_boundary_block_mask_equals_the_dense_mask():
    """Compiled flex attention reads the block tables (eager flex attention evaluates the
    mask_mod everywhere and ignores them): inductor's CPU kernel, fp32, against SDPA with the
    dense mask. Each output averages at most 1000 O(1) values in fp32 (6e-8 relative per
    rounding): ~1e-5 apart at worst, while a skipped or extra block moves outputs by ~1e-2."""
    docs = long_packed_documents()
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 1000, 16, generator=g)
    k, v = torch.randn(2, 2, 1000, 16, generator=g), torch.randn(2, 2, 1000, 16, generator=g)
    mask, _ = build_attention_mask(1000, 0, CPU, None, docs)
    dense = attend(q, k, v, mask, False)
    compiled = torch.compile(flex_attention)
    flex = compiled(q, k, v, block_mask=document_block_mask(docs), enable_gqa=True)
    torch.testing.assert_close(flex, dense, rtol=1e-4, atol=1e-4)


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
