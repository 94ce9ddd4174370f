"""Closed-form expected cost of a uniform grid under a Gaussian posterior vs numerical integration,
known tables and brute force (bayesq/grid_cost.py)."""

import numpy as np
import pytest
import torch

from bayesq.grid_cost import (
    SMOOTH_MAX_STEP, grid_cost, grid_cost_chunked, grid_cost_fast, optimal_uniform_range, uniform_gaussian_mse,
)
from oracles import numeric_grid_cost


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("alpha", [0.5, 1.7, 3.0])
def test_uniform_gaussian_mse_vs_numerical_integration(bits, alpha):
    k = 2**bits
    step = 2 * alpha / k
    levels = -alpha + (np.arange(k) + 0.5) * step
    assert uniform_gaussian_mse(bits, alpha) == pytest.approx(numeric_grid_cost(0.0, 1.0, levels), rel=1e-9)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_optimal_uniform_range_vs_known_table(bits):
    alpha, mse = optimal_uniform_range(bits)
    step, table_mse = MAX_TABLE[bits]
    assert 2 * alpha / 2**bits == pytest.approx(step, abs=6e-4)
    assert mse == pytest.approx(table_mse, rel=2e-3)


@pytest.mark.parametrize("bits", [2, 3, 5])
def test_optimal_uniform_range_vs_brute_force_grid(bits):
    alpha, mse = optimal_uniform_range(bits)
    grid = np.linspace(0.5, 6.0, 2201)
    values = [uniform_gaussian_mse(bits, a) for a in grid]
    best = int(np.argmin(values))
    assert mse <= values[best] + 1e-12
    assert alpha == pytest.approx(grid[best], abs=2 * (grid[1] - grid[0]))


def test_uniform_gaussian_mse_rejects_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        uniform_gaussian_mse(2, 0.0)


def test_grid_cost_vs_numerical_integration():
    lo = torch.tensor([-0.31, -1.0], dtype=torch.float64)
    step = torch.tensor([0.09, 0.5], dtype=torch.float64)
    k = 8
    # inside, at a boundary, clipped beyond both ends; sigma from far below to far above the step
    mu = torch.tensor([[0.02, -0.31 + 0.045, 0.7, -0.6, 0.1, 0.0],
                       [0.3, -1.2, 5.0, 0.25, -3.0, 0.75]], dtype=torch.float64)
    sigma = torch.tensor([[1e-3, 0.02, 0.05, 0.3, 2.0, 40.0],
                          [0.7, 0.05, 2.0, 1e-2, 0.4, 10.0]], dtype=torch.float64)
    got = grid_cost(mu, sigma, lo, step, k)
    for g in range(2):
        levels = lo[g].item() + step[g].item() * np.arange(k)
        for i in range(mu.shape[1]):
            want = numeric_grid_cost(mu[g, i].item(), sigma[g, i].item(), levels)
            assert got[g, i].item() == pytest.approx(want, rel=1e-7, abs=1e-10)


def test_grid_cost_small_sigma_is_whitened_rounding_error():
    # sigma << step: cost -> 1 + ((Q(mu) - mu) / sigma)^2
    mu = torch.tensor([[0.013]], dtype=torch.float64)
    sigma = torch.tensor([[1e-5]], dtype=torch.float64)
    got = grid_cost(mu, sigma, torch.tensor([-0.2], dtype=torch.float64), torch.tensor([0.1], dtype=torch.float64), 4)
    assert got.item() == pytest.approx(1 + ((0.0 - 0.013) / 1e-5) ** 2, rel=1e-12)


@pytest.mark.parametrize("levels", [4, 8, 16, 256])
def test_grid_cost_fast_vs_boundary_sum(levels):
    # the Euler-Maclaurin path (sigma >> step) and the boundary sum (the rest) against grid_cost:
    # weights inside the range, clipped beyond both ends, sigma from far below to far above the
    # step; one row with a zero step
    gen = torch.Generator().manual_seed(3)
    mu = torch.randn(6, 64, generator=gen, dtype=torch.float64) * 0.05
    mu[:, :4] = torch.tensor([0.4, -0.4, 3.0, -2.0], dtype=torch.float64)  # beyond the grid
    sigma = 10.0 ** (torch.rand(6, 64, generator=gen, dtype=torch.float64) * 6 - 4)  # 1e-4 .. 1e2
    lo = mu[:, 4:].min(1).values * 0.8
    step = (mu[:, 4:].max(1).values * 0.8 - lo) / (levels - 1)
    step[5] = 0.0
    smooth = step[:, None] <= SMOOTH_MAX_STEP * sigma
    assert 0.2 < smooth.double().mean() < 0.8  # both paths are exercised
    want = grid_cost(mu, sigma, lo, step, levels)
    got = grid_cost_fast(mu, sigma, lo, step, levels)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)
    mask = (torch.rand(6, 64, generator=gen) > 0.2).double()
    assert torch.allclose(grid_cost_chunked(mu, sigma, lo, step, levels, mask), (want * mask).sum(1), rtol=1e-12)


# Max (1960) / Jayant & Noll: optimal uniform quantiser of N(0,1): step and MSE.
MAX_TABLE = {1: (1.5958, 0.3634), 2: (0.9957, 0.1188), 3: (0.5860, 0.03744), 4: (0.3352, 0.01154)}
