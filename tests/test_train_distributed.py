"""`train` on 2 real CPU processes (gloo, DDP): 2 ranks x B follow the loss of 1 rank x 2B, and
their checkpoint resumes on a different number of ranks to the same weights.

The runs compare in float64 (`train.precision: fp64`): 2 ranks and 1 rank sum the same numbers in
another order, which float32 rounds differently on different CPUs (a difference AdamW then
carries through every step). In float64 each operation rounds at ~1e-16 relative; a value here
goes through ~1e4 such operations per step and a few steps, so differences stay below ~1e-11,
and EXACT = 1e-9 keeps two orders of margin on any machine while still failing for any real
difference (a wrong normalisation or a lost micro-batch changes the loss at 1e-2).
"""

from __future__ import annotations

import json

import pytest
import torch

import mmtrain
from dist_helpers import run_distributed
from micro import MIXED_SPEC, make_mixed_sources, make_shards, micro_run
from mmtrain.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow


EXACT = {"rtol": 1e-9, "atol": 1e-12}


def _config(folder, shards: str, **train):
    return micro_run(folder, shards, train={"precision": "fp64", **train})


def _train_rank(rank: int, world_size: int, config, halt_after_step=None) -> list[float]:
    from mmtrain.train.loop import train

    result = train(config, halt_after_step=halt_after_step)
    return [row["loss"] for row in result.history]


def test_two_ranks_follow_one_rank_and_resume_on_one(tmp_path):
    shards = make_shards(tmp_path / "shards", 32)
    expected = _train_rank(0, 1, _config(tmp_path / "one", shards))
    assert len(expected) == 4 and expected[-1] < expected[0]  # it learns

    # 2 ranks x micro-batch 2 x 2 accumulation = the same global batch of 8. The run "crashes"
    # after step 3 (checkpoint at step 2) and is resumed by ONE process with micro-batch 8.
    double = _config(tmp_path / "two", shards, micro_batch=2)
    losses = run_distributed(_train_rank, world_size=2, args=(double, 3), timeout_s=240)
    assert losses[0] == losses[1]  # every rank logs the global loss
    torch.testing.assert_close(
        torch.tensor(losses[0], dtype=torch.float64),
        torch.tensor(expected[:3], dtype=torch.float64),
        **EXACT,
    )

    # Each rank's RNG states are saved, as a list by rank; ONE process resumes from entry 0.
    saved = load_checkpoint(tmp_path / "two" / "run" / "checkpoints" / "step_00000002")
    assert len(saved.state["rng"]) == 2

    resumed = _train_rank(0, 1, _config(tmp_path / "two", shards, micro_batch=8))
    torch.testing.assert_close(
        torch.tensor(resumed, dtype=torch.float64),
        torch.tensor(expected[2:], dtype=torch.float64),
        **EXACT,
    )

    one = mmtrain.load_model(tmp_path / "one" / "run").state_dict()
    two = mmtrain.load_model(tmp_path / "two" / "run").state_dict()
    for name, value in one.items():
        assert value.dtype == torch.float64, name
        torch.testing.assert_close(two[name], value, **EXACT, msg=name)
    rows = (tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(r)["step"] for r in rows if "kind" not in json.loads(r)]
    assert steps == [1, 2, 3, 4]  # rank 0 alone writes


def test_sources_of_different_modalities_train_on_two_ranks_as_on_one(tmp_path):
    """Image-text and timeseries-text sources, mixed by step: the tower a step leaves out has no
    gradient, which DDP must be told about; 2 ranks x 4 then follow 1 rank x 8."""
    images, series = make_mixed_sources(tmp_path)

    def config(folder, **train):
        return micro_run(
            folder,
            [{"path": str(images), "weight": 1}, {"path": str(series), "weight": 1}],
            spec=MIXED_SPEC,
            seed=2,
            data={"shuffle_window": 4},
            train={"steps": 6, "precision": "fp64", **train},
            checkpoint={"every_steps": None},
        )

    expected = _train_rank(0, 1, config(tmp_path / "one"))
    losses = run_distributed(
        _train_rank, world_size=2, args=(config(tmp_path / "two", micro_batch=4),), timeout_s=240
    )
    torch.testing.assert_close(
        torch.tensor(losses[0], dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        **EXACT,
    )
