"""The next-token objective gives the gradient of ONE batch of the whole optimizer step.

K micro-batches x W ranks hold different numbers of target tokens. Normalising each
micro-batch by its own count (a mean of means) weighs a token of a short micro-batch more than
one of a long micro-batch; the objective divides every share by the step's count on all ranks
instead. Compared in float64: each value goes through ~1e4 roundings of ~1e-16, so rtol 1e-9
keeps orders of magnitude of margin on any CPU while a wrong normalisation differs at ~1e-2.
"""

from __future__ import annotations

import pytest
import torch

from dist_helpers import run_distributed
from mmtrain.data.stream.chat_templates import IGNORE_INDEX
from mmtrain.models import create_model
from mmtrain.spec import load_spec
from mmtrain.train.loop import forward_backward
from mmtrain.train.objectives import NextTokenObjective, count_targets, token_nll_sum
from mmtrain.train.precision import make_precision

EXACT = {"rtol": 1e-9, "atol": 1e-12}
FP64 = make_precision("fp64", torch.device("cpu"))


def _model():
    model = create_model(load_spec("tiny-vlm"), seed=3, dtype=torch.float64)
    # The trainer's forward sums the NLL in chunks of positions; 7 (prime) splits the rows of
    # every batch here unevenly, so the references below (full logits) check the chunking too.
    model.loss_chunk_rows = 7
    return model


def _text_batch(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Text-only rows whose targets differ a lot in number (1 to ~30 per row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (rows, 32), generator=g)
    labels = ids.clone()
    for r in range(rows):
        masked = int(torch.randint(1, 31, (1,), generator=g))  # a prompt of this many ids
        labels[r, :masked] = IGNORE_INDEX
    return {"text": ids, "labels": labels}


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, micro_batches, world: int = 1):
    model.zero_grad(set_to_none=True)
    loss, _ = forward_backward(model, [NextTokenObjective(world)], micro_batches, FP64)
    return loss, _grads(model)


def test_micro_batches_give_the_gradient_of_one_batch():
    model = _model()
    batch = _text_batch(8, seed=0)
    big_loss, big = _step(model, [batch])
    # the loss is the mean NLL over the step's target tokens
    logits = model.logits(batch)  # the full logits: the unchunked reference
    expected = token_nll_sum(logits, batch["labels"]) / count_targets(batch["labels"])
    torch.testing.assert_close(big_loss.double(), expected.detach(), **EXACT)

    micro = [{k: v[i : i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    acc_loss, acc = _step(model, micro)
    torch.testing.assert_close(acc_loss, big_loss, **EXACT)
    assert acc.keys() == big.keys()
    for name in big:
        torch.testing.assert_close(acc[name], big[name], **EXACT, msg=name)

    # A mean of per-micro-batch means is another gradient: the normalisation matters.
    model.zero_grad(set_to_none=True)
    for b in micro:
        nll = token_nll_sum(model.logits(b), b["labels"]) / count_targets(b["labels"])
        (nll / len(micro)).backward()
    naive = _grads(model)
    name = "towers.text.embed.weight"
    assert not torch.allclose(naive[name], big[name], rtol=1e-3, atol=0)


def test_a_step_without_targets_trains_nothing():
    model = _model()
    batch = _text_batch(2, seed=1)
    batch["labels"][:] = IGNORE_INDEX
    loss, grads = _step(model, [batch])
    assert float(loss) == 0.0
    assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def _ranks_step(rank: int, world: int, micro_per_rank: int) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel

    model = _model()
    # These text-only rows come without an "image" key (the loader would give [0, 3, H, W]),
    # so the image tower and projector get no gradient: DDP must look for them.
    trained = DistributedDataParallel(model, find_unused_parameters=True)
    batch = _text_batch(8, seed=0)
    share = 8 // world
    mine = {k: v[rank * share : (rank + 1) * share] for k, v in batch.items()}
    step = share // micro_per_rank
    micro = [{k: v[i : i + step] for k, v in mine.items()} for i in range(0, share, step)]
    model.zero_grad(set_to_none=True)
    loss, _ = forward_backward(trained, [NextTokenObjective(world)], micro, FP64)
    loss = loss.double()
    torch.distributed.all_reduce(loss)
    return {"loss": loss / world, **_grads(model)}


@pytest.mark.slow
def test_ranks_and_micro_batches_give_the_gradient_of_one_batch():
    """2 ranks x 2 micro-batches (DDP, gloo) == 1 process x 1 batch of the same 8 rows."""
    model = _model()
    big_loss, big = _step(model, [_text_batch(8, seed=0)])
    results = run_distributed(_ranks_step, world_size=2, args=(2,))
    for result in results:
        torch.testing.assert_close(result["loss"], big_loss.double(), **EXACT)
        for name in big:
            torch.testing.assert_close(result[name], big[name], **EXACT, msg=name)
