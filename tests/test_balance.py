"""Dealing a step's samples to the ranks by cost (`data.balance`): a pure function of the order
and each sample's cost (data/stream/order.py `balanced_order`), whose ranks carry more even
work than the plain interleave, and a trainer that stays exact with it: 2 ranks balanced
against 1 rank, float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_helpers import run_distributed
from mmtrain.data.stream.order import balanced_order
from mmtrain.train.loop import train
from test_train_native_vlm import EXACT, _config, _weights, shards  # noqa: F401 (fixture)


def _loads(order: np.ndarray, cost: np.ndarray, world: int, per_rank: int) -> np.ndarray:
    """[chunks, world]: each rank's summed cost per micro-batch (rank r reads entries r, r+W)."""
    chunks = len(order) // (world * per_rank)
    picked = cost[order[: chunks * world * per_rank]].reshape(chunks, per_rank, world)
    return picked.sum(axis=1)


def test_a_chunk_is_dealt_longest_first_to_the_lightest_rank():
    cost = np.array([9.0, 1.0, 1.0, 8.0, 2.0, 2.0, 1.0, 1.0])
    order = np.arange(8)
    out = balanced_order(order, cost, world=2, per_rank=4)
    # longest first: 9 -> r0, 8 -> r1, 2 -> r1, 2 -> r1 (10 < 11 < ...), then the 1s
    loads = _loads(out, cost, 2, 4)[0]
    assert sorted(loads.tolist()) == [12.0, 13.0]  # the interleave gives 13 and 12 too ...
    heavy = np.array([9.0, 8.0, 7.0, 6.0, 1.0, 1.0, 1.0, 1.0])
    plain = _loads(order, heavy, 2, 4)[0]  # ... but here 9+7+1+1 against 8+6+1+1
    dealt = _loads(balanced_order(order, heavy, 2, 4), heavy, 2, 4)[0]
    assert plain.max() - plain.min() == 2 and dealt.max() - dealt.min() == 0
    assert sorted(out.tolist()) == list(range(8))  # the same samples, each once


def test_accumulation_rounds_pair_samples_of_like_cost():
    """Micro-batches of one sample: within a step of 2 rounds the heavy samples share a round,
    so each micro-batch's two ranks wait for each other less (9 + 2 against 9 + 8)."""
    cost = np.array([9.0, 1.0, 8.0, 2.0])
    order = np.arange(4)
    out = balanced_order(order, cost, world=2, per_rank=1, rounds=2)
    assert sorted(out.tolist()) == [0, 1, 2, 3]
    heaviest = lambda o: sum(cost[o[k : k + 2]].max() for k in (0, 2))  # noqa: E731
    assert heaviest(order) == 17.0 and heaviest(out) == 11.0


def test_each_chunk_keeps_its_samples_and_one_rank_keeps_the_order():
    rng = np.random.default_rng(0)
    order = rng.permutation(103)  # 12 whole chunks of 8 and a tail of 7
    cost = rng.exponential(size=103) * (rng.random(103) < 0.3)  # a few heavy pages
    out = balanced_order(order, cost, world=4, per_rank=2)
    for lo in range(0, 96, 8):
        assert sorted(out[lo : lo + 8]) == sorted(order[lo : lo + 8])
    assert np.array_equal(out[96:], order[96:])  # the partial tail stays
    assert np.array_equal(balanced_order(order, cost, 1, 8), order)
    plain, dealt = _loads(order, cost, 4, 2), _loads(out, cost, 4, 2)
    assert dealt.max(axis=1).sum() < plain.max(axis=1).sum()  # the slowest rank, step by step


def _losses(rank: int, world: int, config) -> list[float]:
    return [row["loss"] for row in train(config).history]


@pytest.mark.slow
def test_two_balanced_ranks_follow_one(tmp_path, shards):  # noqa: F811
    """Balanced, the step's samples are the same, only dealt otherwise (1 rank: 2 rounds of
    accumulation, 2 ranks: 1): 2 ranks give 1 rank's losses and weights (float64, 1e-9); a
    resume with another micro-batch is refused by name."""
    settings = {"micro_batch": 2, "batch_size": 4, "steps": 3}
    one = train(_config(tmp_path / "one", shards, data={"balance": True}, train=settings))
    config = _config(tmp_path / "two", shards, data={"balance": True},
                     train={**settings, "parallel": "ddp"})  # fmt: skip
    for got in run_distributed(_losses, world_size=2, args=(config,)):
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor([r["loss"] for r in one.history]), **EXACT
        )
    a, b = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for name in a:
        torch.testing.assert_close(b[name], a[name], **EXACT, msg=name)
    more = _config(tmp_path / "one", shards, data={"balance": True},
                   train={**settings, "steps": 4, "micro_batch": 1})  # fmt: skip
    with pytest.raises(ValueError, match="data.balance"):
        train(more)
