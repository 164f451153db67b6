"""The Fréchet distance between two sets of features (FD; FID with Inception's features,
Heusel et al. 2017): the squared distance between two Gaussians fitted to them,

    FD = |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2),

computed in float64; the trace of the matrix square root is the sum of the square roots of
the (clamped non-negative) eigenvalues of the symmetric S_a^1/2 S_b S_a^1/2. The figure depends
on the extractor and on how many samples estimate the moments, so it compares runs measured the
same way only (a floor: the FD between two halves of the real set).
"""

from __future__ import annotations

import torch
from torch import Tensor


def moments(features: Tensor) -> tuple[Tensor, Tensor]:
    """(mean [D], covariance [D, D], unbiased) of features [N, D], in float64."""
    x = features.double()
    if x.shape[0] < 2:
        raise ValueError(f"a covariance needs 2 samples or more, got {x.shape[0]}")
    return x.mean(dim=0), torch.cov(x.T)


def _psd_sqrt(matrix: Tensor) -> Tensor:
    values, vectors = torch.linalg.eigh(matrix)
    return (vectors * values.clamp(min=0).sqrt()) @ vectors.T


def frechet_from_moments(mu_a: Tensor, cov_a: Tensor, mu_b: Tensor, cov_b: Tensor) -> float:
    root_a = _psd_sqrt(cov_a)
    middle = root_a @ cov_b @ root_a
    middle = (middle + middle.T) / 2  # symmetric up to rounding
    cross = torch.linalg.eigvalsh(middle).clamp(min=0).sqrt().sum()
    value = (mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * cross
    return float(value.clamp(min=0))


def frechet_distance(a: Tensor, b: Tensor) -> float:
    """The FD between feature sets a [N, D] and b [M, D]."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"features of {a.shape[1]} and {b.shape[1]} dimensions")
    return frechet_from_moments(*moments(a), *moments(b))
