"""Evaluation on 2 real gloo ranks gives the single-process result, every rank the same.

One spawn of two ranks checks both the metric maths (same embeddings on every rank, queries
split) and the whole evaluator (each rank embeds its share of real shards, gathered, deduped).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mmtrain
from dist_helpers import run_distributed
from mmtrain.eval import Evaluator, flatten_metrics, retrieval_metrics
from mmtrain.eval.zeroshot import zeroshot_metrics
from test_eval import make_shards


def _metrics() -> dict:
    g = torch.Generator().manual_seed(0)
    image = F.normalize(torch.randn(37, 8, generator=g), dim=-1)
    text = F.normalize(image + 0.8 * torch.randn(37, 8, generator=g), dim=-1)
    return {
        "retrieval": retrieval_metrics(
            {"image": image, "text": text}, [("image", "text")], chunk_elements=50
        ),
        "zeroshot": zeroshot_metrics(image, torch.arange(37) % 5, text[:5], ks=(1, 3)),
    }


def _report(model_dir: str, data: str) -> dict:
    # float64: 2 ranks embed in other batch compositions than 1 process, and CPU kernels may
    # round a float32 matmul differently by batch size; float64 rounding stays ~1e-15.
    model = mmtrain.load_model(model_dir, dtype=torch.float64)
    evaluator = Evaluator(model.spec, data, batch_size=3)
    report = evaluator.report(model)
    evaluator.close()
    return report


def _on_rank(rank: int, world_size: int, model_dir: str, data: str) -> tuple[dict, dict]:
    return _metrics(), _report(model_dir, data)


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path):
    data = make_shards(tmp_path / "d", 13, corrupt=(5,))
    model_dir = str(mmtrain.save_model(mmtrain.create_model("tiny-clip", seed=2), tmp_path / "m"))
    metrics, single = _metrics(), _report(model_dir, data)
    results = run_distributed(_on_rank, world_size=2, args=(model_dir, data))
    assert results[0][0] == results[1][0] == metrics
    assert single["n_samples"] == 12  # 13 minus the corrupt one, padding repeats removed
    assert flatten_metrics(results[0][1]) == flatten_metrics(results[1][1])
    got, want = flatten_metrics(results[0][1]), flatten_metrics(single)
    got.pop("corrupt_samples"), want.pop("corrupt_samples")
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
