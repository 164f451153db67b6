"""The chunked next-token loss (models/token_loss.py, `LanguageModel.forward` with "labels")
equals the loss of the full logits, in value and in the gradient of every parameter, and keeps
no logits for backward.

Tolerance: float64 on both sides; the chunked sum adds the same per-token terms in another
grouping (a sum of chunk sums): each rounding ~1e-16 relative over a few hundred O(1..10)
terms, so ~1e-13 absolute; RTOL 1e-9 / ATOL 1e-12 leave orders of magnitude on any CPU, while
one token scored against the wrong target differs at ~1e-1.
"""

from __future__ import annotations

import pytest
import torch

import mmtrain
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.models.token_loss import chunk_nll_sum, chunked_nll_sum, default_chunk_rows
from mmtrain.spec import load_spec
from mmtrain.train.objectives import token_nll_sum

EXACT = {"rtol": 1e-9, "atol": 1e-12}
IMG = 258  # tiny-vlm's image_token_id


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("chunk", [1, 7, 40, 1000])
def test_chunks_sum_to_the_full_cross_entropy(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (40,), generator=g)
    targets[::3] = IGNORE_INDEX
    chunked = chunked_nll_sum(hidden, weight, targets, chunk)
    full = chunk_nll_sum(hidden, weight, targets)  # one chunk of all rows
    torch.testing.assert_close(chunked, full, **EXACT)
    for a, b in zip(
        torch.autograd.grad(chunked, (hidden, weight)),
        torch.autograd.grad(full, (hidden, weight)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, **EXACT)
    assert default_chunk_rows(128_256) == 523  # 2**26 logits of a Llama-3 vocabulary


def batches() -> dict[str, dict[str, torch.Tensor]]:
    """Right-padded rows with images, and packed rows of two documents."""
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1, 256, (3, 12), generator=g)
    text[0, 2], text[1, 5], text[1, 8] = IMG, IMG, IMG
    labels = torch.where(text == IMG, IGNORE_INDEX, text)
    labels[:, :3] = IGNORE_INDEX  # a prompt
    mask = torch.arange(12)[None] < torch.tensor([[12], [10], [4]])
    padded = {
        "text": text * mask,
        "labels": labels.masked_fill(~mask, IGNORE_INDEX),
        "attention_mask": mask,
        "image": torch.randn(3, 3, 64, 64, generator=g).double(),
    }
    documents = (torch.arange(12) >= 6).long().expand(3, 12)
    packed = {"text": text, "labels": labels, "document_ids": documents, "image": padded["image"]}
    return {"padded": padded, "packed": packed}


@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_the_models_chunked_loss_equals_the_full_logits_loss(kind):
    model = mmtrain.create_model(load_spec("tiny-vlm"), dtype=torch.float64, seed=2)
    model.loss_chunk_rows = 5  # 33 scored rows: 7 chunks, the last one short
    batch = batches()[kind]
    chunked = model(batch)["nll_sum"]
    chunked.backward()
    chunked_grads = grads(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    full = token_nll_sum(model(inputs)["logits"], batch["labels"])
    full.backward()
    torch.testing.assert_close(chunked, full, **EXACT)
    full_grads = grads(model)
    assert chunked_grads.keys() == full_grads.keys()
    assert "projector.fc1.weight" in full_grads and "towers.text.embed.weight" in full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, **EXACT, msg=name)


def saved_shapes(fn) -> list[torch.Size]:
    """Shapes of what autograd keeps for backward while `fn` runs (train/measure_step.py's way)."""
    kept: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.shape) or t, lambda t: t):
        fn()
    return kept


def test_no_logits_are_kept_for_backward():
    model = mmtrain.create_model(load_spec("tiny-vlm"), dtype=torch.float64, seed=2)
    model.loss_chunk_rows = 5
    batch = batches()["padded"]
    vocab = model.spec.decoder.vocab_size
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    full = saved_shapes(lambda: token_nll_sum(model(inputs)["logits"], batch["labels"]))
    assert any(s[-1] == vocab for s in full if s)  # the full loss keeps its log-softmax
    chunked = saved_shapes(lambda: model(batch))
    assert not any(s[-1] == vocab for s in chunked if s)


def test_under_autocast_the_chunks_recompute_in_the_autocast_dtype():
    """bf16 autocast on the CPU: the recomputation in backward runs under the forward's
    autocast state (checkpoint restores it), so the chunked loss matches the full one to bf16
    rounding (2**-8 relative per logit, averaged over a few hundred terms: rtol 1e-2)."""
    model = mmtrain.create_model(load_spec("tiny-vlm"), seed=2)
    model.loss_chunk_rows = 5
    batch = {k: v.float() if v.is_floating_point() else v for k, v in batches()["padded"].items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked = model(batch)["nll_sum"]
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        full = token_nll_sum(model(inputs)["logits"], batch["labels"])
    chunked.backward()
    chunked_grads = grads(model)
    full.backward()
    torch.testing.assert_close(chunked, full, rtol=1e-2, atol=0)
    for name, grad in grads(model).items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(chunked_grads[name], grad, rtol=0, atol=1e-2 * scale, msg=name)


def test_a_single_id_scores_nothing_and_backpropagates_zeros():
    model = mmtrain.create_model(load_spec("tiny-vlm"), dtype=torch.float64, seed=2)
    out = model({"text": torch.tensor([[5], [6]]), "labels": torch.tensor([[5], [6]])})
    assert float(out["nll_sum"].detach()) == 0.0
    out["nll_sum"].backward()
    assert all(torch.count_nonzero(g) == 0 for g in grads(model).values())


def test_under_autocast_the_head_gradient_adds_its_chunks_in_fp32():
    """fp32 head under bf16 autocast, 64 chunks: the head-weight gradient is the sum of the
    chunks' own gradients (each chunk's matmul and its bf16 rounding as they are) added in
    fp32, not a bf16 running sum of them (autocast's one cached bf16 copy of the weight for
    every chunk: against float64, 0.96% off at 64 chunks where one chunk is 0.26% off).

    The reference: each chunk alone, its gradient summed in float64. The tolerance: 64 fp32
    additions, each off by at most 2^-24 of the running sum, whose size is at most the chunks'
    summed norms; a bf16 running sum is off by 2^-9 per addition."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(256, 32, generator=g)
    weight = torch.randn(300, 32, generator=g) * 0.1
    targets = torch.randint(0, 300, (256,), generator=g)
    chunks = [slice(i, i + 4) for i in range(0, 256, 4)]

    def head_gradient(rows: slice, chunk_rows: int) -> torch.Tensor:
        w = weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            chunked_nll_sum(hidden[rows], w, targets[rows], chunk_rows=chunk_rows).backward()
        return w.grad

    each = [head_gradient(rows, 4).double() for rows in chunks]
    reference = torch.stack(each).sum(dim=0)
    got = head_gradient(slice(0, 256), 4).double()
    bound = len(chunks) * 2**-24 * float(sum(x.norm() for x in each))
    assert float((got - reference).norm()) <= bound
