"""Contrastive losses in one process: closed forms, references, clamp, extra negatives and
contrastive-correct gradient accumulation. (Real multi-process checks: test_losses_distributed.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmtrain import distributed
from mmtrain.losses import (
    MAX_LOGIT_SCALE,
    ContrastiveLoss,
    _triplet_direction,
    clip_loss,
    siglip_loss,
    triplet_loss,
)
from mmtrain.structured import FieldError

DT = torch.float64


def unit(rows: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=g, dtype=DT), dim=1)


def t(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=DT)


# ---- independent references, written as plain loops over the definitions -------------------


def clip_reference(a, b, scale):
    n = len(a)
    total = 0.0
    for i in range(n):
        row = [scale * float(a[i] @ b[j]) for j in range(n)]
        col = [scale * float(b[i] @ a[j]) for j in range(n)]
        total += math.log(sum(map(math.exp, row))) - row[i]
        total += math.log(sum(map(math.exp, col))) - col[i]
    return total / (2 * n)


def siglip_reference(a, b, scale, bias):
    n = len(a)
    total = 0.0
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            total -= math.log(1 / (1 + math.exp(-z * (scale * float(a[i] @ b[j]) + bias))))
    return total / n


def triplet_reference(a, b, margin, negatives):
    def direction(q, k):
        out = []
        for i in range(len(q)):
            d_pos = 1 - float(q[i] @ k[i])
            d_negs = [1 - float(q[i] @ k[j]) for j in range(len(k)) if j != i]
            semi = [d for d in d_negs if d_pos < d < d_pos + margin]
            d_neg = min(semi) if negatives == "semi-hard" and semi else min(d_negs)
            out.append(max(0.0, d_pos - d_neg + margin))
        return sum(out) / len(out)

    return (direction(a, b) + direction(b, a)) / 2


# ---- closed forms ----------------------------------------------------------------------------


def test_clip_aligned_features_with_large_scale_give_zero_loss():
    a = torch.eye(4, dtype=DT)
    # Diagonal logits = scale, others 0: loss = log(1 + 3 e^-scale) (1e-43 at scale 100).
    assert clip_loss(a, a.clone(), t(MAX_LOGIT_SCALE)).item() < 1e-12
    moderate = clip_loss(a, a.clone(), t(math.log(5)))
    assert moderate.item() == pytest.approx(math.log1p(3 * math.exp(-5)), rel=1e-12)


def test_clip_hand_computed_two_by_two():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=DT)
    b = torch.tensor([[0.6, 0.8], [0.8, 0.6]], dtype=DT)
    # scale 1: every row and column has logits {0.6 (positive), 0.8}: CE = log(1 + e^0.2).
    assert clip_loss(a, b, t(0.0)).item() == pytest.approx(math.log1p(math.exp(0.2)), rel=1e-12)


def test_siglip_hand_computed_two_by_two():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=DT)
    b = torch.tensor([[0.6, 0.8], [0.8, 0.6]], dtype=DT)
    # Per row: one positive logit 0.6 and one negative logit 0.8; divided by 2 rows.
    expected = math.log1p(math.exp(-0.6)) + math.log1p(math.exp(0.8))
    assert siglip_loss(a, b, t(0.0), t(0.0)).item() == pytest.approx(expected, rel=1e-12)


def test_triplet_hardest_and_semi_hard_hand_computed():
    # Anchor at angle 0; candidates at cosines 0.9 (positive), 0.95, 0.8 and 0.0.
    cosines = torch.tensor([0.9, 0.95, 0.8, 0.0], dtype=DT)
    keys = torch.stack([cosines, (1 - cosines**2).sqrt()], dim=1)
    query = torch.tensor([[1.0, 0.0]], dtype=DT)
    rows = torch.tensor([0])
    # d_pos = 0.1. Hardest negative: d = 0.05 -> 0.1 - 0.05 + 0.2 = 0.25.
    hardest = _triplet_direction(query, keys, rows, margin=0.2, negatives="hardest")
    assert hardest.item() == pytest.approx(0.25, rel=1e-12)
    # Semi-hard: farther than 0.1 but within 0.3 -> d = 0.2 -> 0.1 - 0.2 + 0.2 = 0.1.
    semi = _triplet_direction(query, keys, rows, margin=0.2, negatives="semi-hard")
    assert semi.item() == pytest.approx(0.1, rel=1e-12)
    # A margin too small for any semi-hard negative falls back to the hardest one.
    fallback = _triplet_direction(query, keys, rows, margin=0.05, negatives="semi-hard")
    assert fallback.item() == pytest.approx(0.1 - 0.05 + 0.05, rel=1e-12)


def test_triplet_is_zero_when_negatives_are_beyond_the_margin():
    a = torch.eye(3, dtype=DT)
    assert triplet_loss(a, a.clone(), margin=0.5).item() == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_objectives_match_loop_references(seed):
    a, b = unit(6, 5, seed), unit(6, 5, seed + 100)
    assert clip_loss(a, b, t(math.log(10))).item() == pytest.approx(
        clip_reference(a, b, 10.0), rel=1e-12
    )
    assert siglip_loss(a, b, t(math.log(10)), t(-10.0)).item() == pytest.approx(
        siglip_reference(a, b, 10.0, -10.0), rel=1e-12
    )
    for negatives in ("hardest", "semi-hard"):
        got = triplet_loss(a, b, margin=0.5, negatives=negatives).item()
        assert got == pytest.approx(triplet_reference(a, b, 0.5, negatives), rel=1e-12)


# ---- properties ------------------------------------------------------------------------------


@pytest.mark.parametrize("objective", ["clip", "siglip", "triplet"])
def test_losses_are_symmetric_and_permutation_invariant(objective):
    a, b = unit(7, 4, 3), unit(7, 4, 4)
    loss = ContrastiveLoss(objective)
    args = (t(math.log(10)), t(-3.0))
    ab, _ = loss({"p": a, "q": b}, [("p", "q")], *args)
    ba, _ = loss({"p": a, "q": b}, [("q", "p")], *args)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    shuffled, _ = loss({"p": a[perm], "q": b[perm]}, [("p", "q")], *args)
    assert ab.item() == pytest.approx(ba.item(), rel=1e-12)
    assert ab.item() == pytest.approx(shuffled.item(), rel=1e-12)


@pytest.mark.parametrize("objective", ["clip", "siglip"])
def test_logit_scale_is_clamped_in_the_loss_not_in_the_parameter(objective):
    a, b = unit(5, 4, 5), unit(5, 4, 6)
    loss = ContrastiveLoss(objective)
    feats, pairs, bias = {"x": a, "y": b}, [("x", "y")], t(-5.0)

    high = torch.nn.Parameter(t(math.log(1000)))
    value, _ = loss(feats, pairs, high, bias)
    value.backward()
    at_cap, _ = loss(feats, pairs, t(MAX_LOGIT_SCALE), bias)
    assert value.item() == pytest.approx(at_cap.item(), rel=1e-12)
    assert high.item() == pytest.approx(math.log(1000))  # untouched
    assert high.grad.item() == 0.0  # clamped: no gradient pushes it further

    low, _ = loss(feats, pairs, t(-2.0), bias)
    at_floor, _ = loss(feats, pairs, t(0.0), bias)
    assert low.item() == pytest.approx(at_floor.item(), rel=1e-12)

    inside = torch.nn.Parameter(t(math.log(20)))
    loss(feats, pairs, inside, bias)[0].backward()
    assert inside.grad.item() != 0.0


def test_siglip_loss_is_small_for_aligned_features_and_uses_the_bias():
    a = torch.eye(4, dtype=DT)
    loss = ContrastiveLoss("siglip")
    # scale 100, bias -50: positives at +50, negatives at -50 -> loss ~ 4 e^-50.
    aligned, _ = loss({"i": a, "t": a.clone()}, [("i", "t")], t(MAX_LOGIT_SCALE), t(-50.0))
    assert aligned.item() < 1e-20
    bias = torch.nn.Parameter(t(-10.0))
    random_feats = {"i": unit(4, 4, 7), "t": unit(4, 4, 8)}
    value, _ = loss(random_feats, [("i", "t")], t(math.log(10)), bias)
    value.backward()
    # At bias -10 the positives dominate: raising the bias lowers the loss.
    assert bias.grad.item() < 0


def test_pairs_are_generic_and_the_total_is_their_mean():
    feats = {"left": unit(4, 3, 1), "middle": unit(4, 3, 2), "right": unit(4, 3, 3)}
    pairs = [("left", "middle"), ("right", "middle")]
    total, per_pair = ContrastiveLoss("clip")(feats, pairs, t(math.log(10)))
    assert list(per_pair) == ["left-middle", "right-middle"]
    assert per_pair["left-middle"].item() == pytest.approx(
        clip_reference(feats["left"], feats["middle"], 10.0), rel=1e-12
    )
    assert total.item() == pytest.approx(sum(v.item() for v in per_pair.values()) / 2)


def test_bad_input_is_reported_with_the_name_at_fault():
    feats = {"image": unit(3, 4, 0), "text": unit(3, 4, 1)}
    with pytest.raises(FieldError, match="objective"):
        ContrastiveLoss("infonce")
    with pytest.raises(FieldError, match="variant"):
        ContrastiveLoss(variant="ring")
    with pytest.raises(ValueError, match="'audio'"):
        ContrastiveLoss()(feats, [("audio", "text")], t(1.0))
    with pytest.raises(ValueError, match="logit_bias"):
        ContrastiveLoss("siglip")(feats, [("image", "text")], t(1.0))
    with pytest.raises(ValueError, match="logit_scale"):
        ContrastiveLoss("clip")(feats, [("image", "text")])
    with pytest.raises(ValueError, match="empty"):
        ContrastiveLoss()(feats, [], t(1.0))
    with pytest.raises(ValueError, match="same shape"):
        ContrastiveLoss()({"image": unit(3, 4, 0), "text": unit(2, 4, 1)}, [("image", "text")], 1.0)
    with pytest.raises(ValueError, match="extra_negatives has no tower 'text'"):
        ContrastiveLoss()(feats, [("image", "text")], 1.0, extra_negatives={"image": unit(2, 4, 2)})
    with pytest.raises(RuntimeError, match="init_process_group"):
        ContrastiveLoss(distributed=True)(feats, [("image", "text")], 1.0)


@pytest.mark.parametrize("objective", ["clip", "siglip", "triplet"])
def test_bfloat16_features_are_reduced_in_float32(objective):
    a, b = unit(8, 16, 40), unit(8, 16, 41)
    scale = torch.nn.Parameter(torch.tensor(math.log(20)))  # float32, as in a model
    loss = ContrastiveLoss(objective)
    low, _ = loss({"x": a.bfloat16(), "y": b.bfloat16()}, [("x", "y")], scale, -5.0)
    high, _ = loss({"x": a, "y": b}, [("x", "y")], math.log(20), -5.0)
    assert low.dtype == torch.float32
    assert low.item() == pytest.approx(high.item(), rel=0.05, abs=0.01)


def test_distributed_helpers_without_a_process_group():
    x = torch.randn(3, 2, requires_grad=True)
    assert not distributed.is_initialized()
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    assert distributed.all_gather_with_grad(x) is x
    assert distributed.all_gather(x) is x


# ---- extra negatives and gradient accumulation ------------------------------------------------


@pytest.mark.parametrize("objective", ["clip", "siglip", "triplet"])
def test_extra_negatives_join_the_batch_and_get_no_gradient(objective):
    live = {"image": unit(3, 4, 10), "text": unit(3, 4, 11)}
    extra = {k: unit(2, 4, 12 + i).requires_grad_() for i, k in enumerate(live)}
    loss = ContrastiveLoss(objective, margin=0.5)
    args = (t(math.log(10)), t(-2.0))

    with_extra, _ = loss(live, [("image", "text")], *args, extra_negatives=extra)
    joined = {k: torch.cat([live[k], extra[k].detach()]) for k in live}
    expected, _ = loss(joined, [("image", "text")], *args)
    assert with_extra.item() == pytest.approx(expected.item(), rel=1e-12)

    live = {k: v.clone().requires_grad_() for k, v in live.items()}
    loss(live, [("image", "text")], *args, extra_negatives=extra)[0].backward()
    assert all(v.grad is None for v in extra.values())
    assert all(v.grad is not None for v in live.values())


def test_hard_extra_negatives_raise_the_clip_loss():
    live = {"image": unit(4, 8, 20), "text": unit(4, 8, 20) + 0.1 * unit(4, 8, 21)}
    live["text"] = F.normalize(live["text"], dim=1)
    # Near-copies of the live images paired with unrelated texts: confusable negatives.
    extra = {
        "image": F.normalize(live["image"] + 0.05 * unit(4, 8, 22), dim=1),
        "text": unit(4, 8, 23),
    }
    loss = ContrastiveLoss("clip")
    base, _ = loss(live, [("image", "text")], t(math.log(50)))
    harder, _ = loss(live, [("image", "text")], t(math.log(50)), extra_negatives=extra)
    assert harder.item() > base.item() + 0.5


class TwoTowers(torch.nn.Module):
    """Two linear encoders plus the scale and bias parameters, in float64."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.towers = torch.nn.ModuleDict(
            {name: torch.nn.Linear(6, 4, dtype=DT) for name in ("image", "text")}
        )
        with torch.no_grad():
            for p in self.towers.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=DT))
        self.logit_scale = torch.nn.Parameter(t(math.log(10)))
        self.logit_bias = torch.nn.Parameter(t(-3.0))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: F.normalize(self.towers[k](x), dim=1) for k, x in batch.items()}


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("objective", "negatives"),
    [("clip", "hardest"), ("siglip", "hardest"), ("triplet", "semi-hard")],
)
def test_accumulation_with_cached_features_equals_one_big_batch(objective, negatives):
    g = torch.Generator().manual_seed(30)
    batch = {k: torch.randn(12, 6, generator=g, dtype=DT) for k in ("image", "text")}
    pairs = [("image", "text")]
    loss = ContrastiveLoss(objective, margin=0.5, negatives=negatives)

    model = TwoTowers(seed=1)
    full, _ = loss(model(batch), pairs, model.logit_scale, model.logit_bias)
    full.backward()
    expected = grads(model)

    model.zero_grad()
    k = 3
    micro = [{name: x[i::k] for name, x in batch.items()} for i in range(k)]
    with torch.no_grad():
        cached = [model(m) for m in micro]
    for i in range(k):
        others = {n: torch.cat([c[n] for j, c in enumerate(cached) if j != i]) for n in batch}
        value, _ = loss(model(micro[i]), pairs, model.logit_scale, model.logit_bias, others)
        assert value.item() == pytest.approx(full.item(), rel=1e-12)
        value.backward()  # summed over micro-batches, no division by k

    accumulated = grads(model)
    assert accumulated.keys() == expected.keys()
    assert ("logit_scale" in expected) == (objective != "triplet")
    for name, grad in accumulated.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-10, atol=1e-12, msg=name)
