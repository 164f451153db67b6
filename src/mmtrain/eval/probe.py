"""Linear probe: how much of a labelled task frozen embeddings make linearly separable.

Multinomial logistic regression on standardised features (mean and std of the training set),
with an L2 penalty, fitted full-batch by L-BFGS from zero weights. The objective is convex and
the start is fixed, so the fit needs no random numbers and is the same on every run and every
rank. Reports accuracy and macro-F1 (the unweighted mean of per-class F1 over the classes that
occur in the labels or the predictions, so rare classes count as much as common ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ProbeConfig", "LinearProbe", "fit_probe", "macro_f1", "linear_probe"]


@dataclass(frozen=True)
class ProbeConfig:
    weight_decay: float = 1e-3  # L2 penalty on the weights (not the bias), per sample
    max_iter: int = 100  # L-BFGS iterations
    tolerance: float = 1e-5  # stop when the gradient's largest entry falls below this


@dataclass
class LinearProbe:
    """A fitted probe: standardisation and the linear layer."""

    mean: torch.Tensor  # [D]
    std: torch.Tensor  # [D]
    weight: torch.Tensor  # [C, D]
    bias: torch.Tensor  # [C]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        x = (features.double() - self.mean) / self.std
        return x @ self.weight.t() + self.bias

    def predict(self, features: torch.Tensor) -> torch.Tensor:
        return self.logits(features).argmax(dim=1)


def fit_probe(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int | None = None,
    config: ProbeConfig | None = None,
) -> LinearProbe:
    """Fit the probe on features [N, D] and int labels [N] (float64, on the features' device)."""
    config = config or ProbeConfig()
    if features.dim() != 2 or labels.shape != (features.shape[0],):
        raise ValueError(
            f"features must be [N, D] and labels [N], got {list(features.shape)} and "
            f"{list(labels.shape)}"
        )
    if features.shape[0] == 0:
        raise ValueError("no training samples for the linear probe")
    labels = labels.long().to(features.device)
    num_classes = int(labels.max()) + 1 if num_classes is None else num_classes
    x = features.double()
    mean = x.mean(dim=0)
    std = x.std(dim=0, unbiased=False).clamp(min=1e-8)  # constant features stay at zero
    x = (x - mean) / std
    weight = torch.zeros(
        num_classes, x.shape[1], dtype=x.dtype, device=x.device, requires_grad=True
    )
    bias = torch.zeros(num_classes, dtype=x.dtype, device=x.device, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        max_iter=config.max_iter,
        tolerance_grad=config.tolerance,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight.t() + bias, labels)
        loss = loss + 0.5 * config.weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    with torch.enable_grad():  # callers often evaluate under no_grad
        optimizer.step(closure)
    return LinearProbe(mean, std, weight.detach(), bias.detach())


def macro_f1(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """Unweighted mean F1 over the classes present in `labels` or `predictions`."""
    predictions, labels = predictions.long().cpu(), labels.long().cpu()
    classes = torch.unique(torch.cat([predictions, labels]))
    scores = []
    for c in classes.tolist():
        tp = int(((predictions == c) & (labels == c)).sum())
        fp = int(((predictions == c) & (labels != c)).sum())
        fn = int(((predictions != c) & (labels == c)).sum())
        scores.append(2 * tp / (2 * tp + fp + fn))  # > 0 denominators: c occurs somewhere
    return float(sum(scores) / len(scores)) if scores else 0.0


def linear_probe(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    num_classes: int | None = None,
    config: ProbeConfig | None = None,
) -> dict[str, float | int]:
    """Fit on the training set, score the test set: `accuracy`, `macro_f1`, sample counts."""
    if num_classes is None:
        num_classes = int(max(int(train_labels.max()), int(test_labels.max()))) + 1
    probe = fit_probe(train_features, train_labels, num_classes, config)
    predictions = probe.predict(test_features.to(probe.weight.device)).cpu()
    test_labels = test_labels.long().cpu()
    return {
        "accuracy": float((predictions == test_labels).double().mean()),
        "macro_f1": macro_f1(predictions, test_labels),
        "n_train": int(train_labels.numel()),
        "n_test": int(test_labels.numel()),
    }
