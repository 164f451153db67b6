"""The Fréchet distance: zero between a set and itself, the closed form for Gaussians whose
covariances commute, symmetric, and blind to a rotation of both sets."""

import math

import torch

from mmtrain.eval.frechet import frechet_distance, frechet_from_moments


def test_a_set_is_at_distance_zero_from_itself():
    x = torch.randn(200, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert frechet_distance(x, x) < 1e-9


def test_diagonal_covariances_give_the_closed_form():
    # Commuting covariances: FD = |mu_a - mu_b|^2 + sum_i (sigma_a,i - sigma_b,i)^2.
    mu_a, mu_b = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1.0, 1.0, -1.0])
    var_a, var_b = torch.tensor([1.0, 4.0, 0.25]), torch.tensor([9.0, 1.0, 0.25])
    want = float((mu_a - mu_b).square().sum() + (var_a.sqrt() - var_b.sqrt()).square().sum())
    got = frechet_from_moments(mu_a.double(), torch.diag(var_a).double(),
                               mu_b.double(), torch.diag(var_b).double())  # fmt: skip
    assert math.isclose(got, want, rel_tol=1e-12)


def test_symmetric_and_unchanged_by_rotating_both_sets():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(300, 4, generator=g, dtype=torch.float64) * torch.tensor([1.0, 2.0, 0.5, 1.0])
    b = torch.randn(300, 4, generator=g, dtype=torch.float64) + 0.3
    rotation, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    fd = frechet_distance(a, b)
    assert math.isclose(fd, frechet_distance(b, a), rel_tol=1e-9)
    assert math.isclose(fd, frechet_distance(a @ rotation, b @ rotation), rel_tol=1e-9)
