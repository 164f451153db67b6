"""Evaluation: exact retrieval metrics, zero-shot classification, CLIP score, linear probe.

`evaluate(model, batches, pairs)` returns flat metrics for logging; `Evaluator` replays a
validation set for periodic evaluation in the training loop; `mmtrain eval` writes `eval.json`.
"""

from mmtrain.eval.clipscore import clip_score
from mmtrain.eval.probe import linear_probe, macro_f1
from mmtrain.eval.retrieval import rank_metrics, retrieval_metrics, retrieval_ranks
from mmtrain.eval.run import (
    Evaluator,
    ZeroShotConfig,
    eval_loader,
    evaluate,
    evaluate_report,
    flatten_metrics,
)
from mmtrain.eval.zeroshot import class_embeddings, zeroshot_metrics

__all__ = [
    "Evaluator",
    "ZeroShotConfig",
    "class_embeddings",
    "clip_score",
    "eval_loader",
    "evaluate",
    "evaluate_report",
    "flatten_metrics",
    "linear_probe",
    "macro_f1",
    "rank_metrics",
    "retrieval_metrics",
    "retrieval_ranks",
    "zeroshot_metrics",
]
