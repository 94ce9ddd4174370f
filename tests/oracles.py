"""Numerical references and test data shared by the codebook tests (imported as ``from oracles import ...``)."""

import numpy as np
import torch
from scipy import integrate, stats


def numeric_grid_cost(mu: float, sigma: float, levels: np.ndarray) -> float:
    """E[(Q(w) - w)^2] / sigma^2 by adaptive quadrature, cell by cell."""
    bounds = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    total = 0.0
    for c, a, b in zip(levels, bounds[:-1], bounds[1:]):
        f = lambda w, c=c: (c - w) ** 2 * stats.norm.pdf(w, mu, sigma)
        total += integrate.quad(f, a, b, epsabs=1e-14, epsrel=1e-12, limit=200)[0]
    return total / sigma**2


def weighted_rows(seed, rows=40, n=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=g, dtype=torch.float64)
    w[:, :3] *= 6  # outliers make clipping worthwhile
    weight = torch.rand(rows, n, generator=g, dtype=torch.float64).pow(3)
    return w, weight
