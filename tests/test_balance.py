"""Dealing a step's samples to the ranks by cost (`data.balance`): a pure function of the order
and each sample's cost (data/stream/order.py `balanced_order`), whose ranks carry more even
work than the plain interleave, and a trainer that stays exact with it: 2 ranks balanced
against 1 rank, float64."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch

from dist_helpers import run_distributed
from mmtrain.data.storage.manifest import write_manifest
from mmtrain.data.storage.shard_writer import ShardWriter
from mmtrain.data.stream.order import balanced_order
from mmtrain.report.doctor import diagnose
from mmtrain.report.rundata import load_run
from mmtrain.train.loop import train
from mmtrain.train.recorder import MetricsRecorder
from test_train_native_vlm import COLOURS, EXACT, _config, _png, _weights, shards  # noqa: F401


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


def _recorded_balance(rank: int, world: int, out) -> float:
    """One row through the recorder, this rank's work rank + 1 (gathered in its all-reduce)."""
    (out / str(rank)).mkdir()
    recorder = MetricsRecorder(out / str(rank), rank=rank, log_every=1, tensorboard=False,
                               resume_step=0)  # fmt: skip
    recorder.add(1, {"step_s": 1.0}, {"loss": torch.tensor(2.0)}, {}, {}, [], work=rank + 1.0)
    recorder.flush()
    recorder.close()
    return recorder.history[0]["load_balance"]


@pytest.mark.slow
def test_the_recorder_gathers_every_ranks_work_in_its_one_all_reduce(tmp_path):
    # ranks of work 1 and 2: a mean of 1.5 over the heaviest 2, on both ranks
    assert run_distributed(_recorded_balance, world_size=2, args=(tmp_path,)) == [0.75, 0.75]


def _uneven_shards(folder):
    """Every other sample two 96 px pages and a 30-word answer, the others text-only and a
    word long: the heavy sample costs several light ones."""
    with ShardWriter(folder, max_samples=8) as writer:
        for i in range(32):
            name = list(COLOURS)[i % len(COLOURS)]
            sample = {"__key__": f"{i:09d}"}
            record = {"id": str(i), "messages": [{"role": "user", "content": f"Say {name}."},
                                                  {"role": "assistant", "content": name}]}  # fmt: skip
            if i % 2 == 0:
                sample |= {f"{n}.png": _png(COLOURS[name], (96, 96), i + n) for n in (0, 1)}
                record = {"id": str(i), "images": ["0.png", "1.png"], "messages": [
                    {"role": "user", "content": "<image><image>"},
                    {"role": "assistant", "content": f"a {name} page " * 10}]}  # fmt: skip
            writer.write({**sample, "json": json.dumps(record)})
    write_manifest(folder, writer.shards, modalities=["image", "text"])
    return folder


def _history(rank: int, world: int, config) -> int:
    return len(train(config).history)


@pytest.mark.slow
def test_uneven_ranks_are_a_scaling_finding_that_data_balance_fixes(tmp_path, shards):  # noqa: F811
    """2 ranks, 4 samples each per step (2 micro-batches of 2) of heavy and light samples:
    interleaved, the ranks do ~77% of the heaviest rank's FLOPs on average after the first
    step, and doctor asks for data.balance; dealt by cost, ~92%, and it asks nothing (FLOPs
    counted from the rows, not timed: the same on any machine)."""
    data = str(_uneven_shards(tmp_path / "uneven"))
    runs = {}
    for dealt in (False, True):
        config = _config(tmp_path / f"dealt-{dealt}", shards, data={"train": data, "balance": dealt},
                         train={"micro_batch": 2, "batch_size": 8, "steps": 6,
                                "parallel": "ddp", "precision": "fp32"})  # fmt: skip
        assert run_distributed(_history, world_size=2, args=(config,)) == [6, 6]
        runs[dealt] = load_run(tmp_path / f"dealt-{dealt}")
    (finding,) = [f for f in diagnose(runs[False]) if f.kind == "scaling"]
    balances = [r["load_balance"] for r in runs[False].train_rows[1:]]
    assert finding.evidence["load_balance_mean"] == round(statistics.fmean(balances), 4) < 0.8
    assert finding.steps == [2, 3, 4, 5, 6] and finding.evidence["world_size"] == 2
    assert finding.advice.startswith("deal each step's samples to the ranks by cost: "
                                     "data.balance=true")  # fmt: skip
    assert not [f for f in diagnose(runs[True]) if f.kind == "scaling"]
    dealt = statistics.fmean(r["load_balance"] for r in runs[True].train_rows[1:])
    assert dealt > finding.evidence["load_balance_mean"]
