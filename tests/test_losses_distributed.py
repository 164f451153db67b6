"""Distributed contrastive losses with two real gloo processes.

Claim under test (the scaling convention, stated once): with features gathered with gradient,
for both variants,
- loss: "local" -> the MEAN of the ranks' losses equals the single-process loss on the
  concatenated batch; "full" -> every rank's loss equals it;
- features: the gradient a rank gets for its own features, divided by the world size (DDP's
  averaging), equals the single-process gradient for those rows;
- logit scale / bias: the mean over ranks of their gradients (DDP's averaging) equals the
  single-process gradient.
A real DDP model checks the end-to-end consequence: its parameter gradients equal one process's.

All ranks run in ONE spawn (module fixture) to keep the suite fast; tests then compare each case.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_helpers import DistributedTestError, run_distributed
from mmtrain.losses import ContrastiveLoss

# Spawning two torch processes takes 5-20 s on a busy 2-core machine.
pytestmark = pytest.mark.slow

WORLD = 2
B = 3  # per-rank live batch
E = 2  # per-rank cached extra samples
DIM = 5
TOWERS = ("image", "text", "audio")
PAIRS = [("image", "text"), ("audio", "text")]
DT = torch.float64
CASES = [
    (objective, variant, extras)
    for objective in ("clip", "siglip", "triplet")
    for variant in ("local", "full")
    for extras in (False, True)
]


def global_batch(seed: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: F.normalize(torch.randn(rows, DIM, generator=g, dtype=DT), dim=1) for k in TOWERS}


def make_loss(objective: str, variant: str, distributed: bool | None) -> ContrastiveLoss:
    return ContrastiveLoss(objective, variant=variant, margin=0.5, distributed=distributed)


def compute(loss, live, extra):
    """Loss and gradients w.r.t. the live features, logit scale and bias."""
    live = {k: v.clone().requires_grad_() for k, v in live.items()}
    scale = torch.nn.Parameter(torch.tensor(math.log(10), dtype=DT))
    bias = torch.nn.Parameter(torch.tensor(-2.0, dtype=DT))
    total, per_pair = loss(live, PAIRS, scale, bias, extra_negatives=extra)
    total.backward()
    zero = torch.zeros((), dtype=DT)
    return {
        "loss": total.detach(),
        "per_pair": {k: v.detach() for k, v in per_pair.items()},
        "grads": {k: v.grad for k, v in live.items()},
        "scale_grad": zero if scale.grad is None else scale.grad,
        "bias_grad": zero if bias.grad is None else bias.grad,
    }


def split(batch: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * size : (rank + 1) * size] for k, v in batch.items()}


class Towers(torch.nn.Module):
    """One linear encoder per tower; forward returns normalised embeddings by tower name."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.towers = torch.nn.ModuleDict({k: torch.nn.Linear(4, DIM, dtype=DT) for k in TOWERS})
        with torch.no_grad():
            for p in self.towers.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=DT))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: F.normalize(self.towers[k](x), dim=1) for k, x in batch.items()}


def model_grads(model: torch.nn.Module, batch, loss) -> dict[str, torch.Tensor]:
    """Parameter gradients under `loss` (scale fixed at 10); through DDP's forward if wrapped."""
    loss(model(batch), PAIRS, math.log(10))[0].backward()
    return {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}


def rank_main(rank: int, world: int) -> dict:
    """Everything the ranks compute, in one process group."""
    results = {}
    live_all, extra_all = global_batch(0, world * B), global_batch(1, world * E)
    for objective, variant, extras in CASES:
        loss = make_loss(objective, variant, distributed=True)
        extra = split(extra_all, rank, E) if extras else None
        results[objective, variant, extras] = compute(loss, split(live_all, rank, B), extra)

    g = torch.Generator().manual_seed(2)
    inputs = {k: torch.randn(world * B, 4, generator=g, dtype=DT) for k in TOWERS}
    model = torch.nn.parallel.DistributedDataParallel(Towers(seed=3))
    results["ddp"] = model_grads(model, split(inputs, rank, B), make_loss("clip", "local", True))

    # Unequal per-rank batch sizes: a clear error on every rank, not a hang.
    uneven = global_batch(4, B + rank)
    try:
        make_loss("clip", "local", True)(uneven, PAIRS, 1.0)
        results["uneven"] = "no error"
    except ValueError as error:
        results["uneven"] = str(error)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_distributed(rank_main, world_size=WORLD, timeout_s=180)


@pytest.mark.parametrize(("objective", "variant", "extras"), CASES)
def test_two_ranks_match_one_process_on_the_concatenated_batch(ranks, objective, variant, extras):
    live_all, extra_all = global_batch(0, WORLD * B), global_batch(1, WORLD * E)
    # One process sees every rank's live samples and every rank's cached ones.
    reference = compute(
        make_loss(objective, variant, distributed=False),
        live_all,
        extra_all if extras else None,
    )
    got = [r[objective, variant, extras] for r in ranks]

    tight = {"rtol": 1e-10, "atol": 1e-12}
    losses = torch.stack([g["loss"] for g in got])
    if variant == "full":
        for value in losses:
            torch.testing.assert_close(value, reference["loss"], **tight)
    else:
        torch.testing.assert_close(losses.mean(), reference["loss"], **tight)
        assert not torch.allclose(losses[0], losses[1])  # each rank really holds only its share
    for name in ("scale_grad", "bias_grad"):
        mean = torch.stack([g[name] for g in got]).mean()
        torch.testing.assert_close(mean, reference[name], **tight)
    for rank, g in enumerate(got):
        for tower in TOWERS:
            expected = reference["grads"][tower][rank * B : (rank + 1) * B]
            torch.testing.assert_close(g["grads"][tower] / WORLD, expected, **tight)


def test_ddp_model_gradients_equal_one_process(ranks):
    g = torch.Generator().manual_seed(2)
    inputs = {k: torch.randn(WORLD * B, 4, generator=g, dtype=DT) for k in TOWERS}
    expected = model_grads(Towers(seed=3), inputs, make_loss("clip", "local", False))
    for r in ranks:
        assert r["ddp"].keys() == expected.keys()
        for name, grad in r["ddp"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)


def test_unequal_rank_batches_fail_clearly_on_every_rank(ranks):
    for r in ranks:
        assert "same tensor shape on every rank" in r["uneven"]
        assert "rank 0: [3, 5], rank 1: [4, 5]" in r["uneven"]


def fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the helper's clean-up


def test_helper_reports_the_failing_rank_and_does_not_hang():
    with pytest.raises(DistributedTestError, match="rank 1 raised") as info:
        run_distributed(fail_on_rank_one, world_size=WORLD, timeout_s=60)
    assert "deliberate failure on rank 1" in str(info.value)
