import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from bayesq.codebook import (
    SMOOTH_MAX_STEP, dequantize, fit_uniform_grids, grid_cost, grid_cost_chunked, grid_cost_fast, grids_from_range,
    lloyd_max_gaussian, minmax_grids, optimal_uniform_range, quantize, search_range, uniform_gaussian_mse,
)


def _numeric_cost(mu: float, sigma: float, levels: np.ndarray) -> float:
    """E[(Q(w) - w)^2] / sigma^2 by adaptive quadrature, cell by cell."""
    bounds = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    total = 0.0
    for c, a, b in zip(levels, bounds[:-1], bounds[1:]):
        f = lambda w, c=c: (c - w) ** 2 * stats.norm.pdf(w, mu, sigma)
        total += integrate.quad(f, a, b, epsabs=1e-14, epsrel=1e-12, limit=200)[0]
    return total / sigma**2


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("alpha", [0.5, 1.7, 3.0])
def test_uniform_gaussian_mse_vs_numerical_integration(bits, alpha):
    k = 2**bits
    step = 2 * alpha / k
    levels = -alpha + (np.arange(k) + 0.5) * step
    assert uniform_gaussian_mse(bits, alpha) == pytest.approx(_numeric_cost(0.0, 1.0, levels), rel=1e-9)


# Max (1960) / Jayant & Noll: optimal uniform quantiser of N(0,1): step and MSE.
MAX_TABLE = {1: (1.5958, 0.3634), 2: (0.9957, 0.1188), 3: (0.5860, 0.03744), 4: (0.3352, 0.01154)}


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
            want = _numeric_cost(mu[g, i].item(), sigma[g, i].item(), levels)
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


def test_grids_from_range_scale_is_fp16_and_zero_in_range():
    lo = torch.tensor([-0.3, 0.1, 0.0], dtype=torch.float64)
    hi = torch.tensor([0.5, 0.4, 0.0], dtype=torch.float64)
    g = grids_from_range(lo, hi, 3)
    assert torch.equal(g.scale, g.scale.half().double())
    assert ((g.zero >= 0) & (g.zero <= 7)).all()
    assert g.scale[2] == 0  # an all-zero group


def test_quantize_dequantize_roundtrip_of_levels():
    torch.manual_seed(0)
    w = torch.randn(5, 64, dtype=torch.float64)
    g = minmax_grids(w, 4)
    codes = quantize(w, g)
    assert codes.min() >= 0 and codes.max() <= 15
    w_hat = dequantize(codes, g)
    assert torch.equal(quantize(w_hat, g), codes)  # levels map to themselves
    err = (w_hat - w).abs()
    assert (err <= g.scale[:, None] / 2 + 1e-12).all()  # no clipping for a min/max range


def test_fit_uniform_grids_vs_brute_force_ratio():
    torch.manual_seed(1)
    mu = torch.randn(6, 64, dtype=torch.float64) * 0.05
    mu[0, 3] = 0.6  # an outlier makes clipping worthwhile
    sigma = torch.exp(torch.randn(6, 64, dtype=torch.float64)) * 0.01
    mask = torch.ones_like(mu)
    grids, cost = fit_uniform_grids(mu, sigma, mask, 2, iters=30)
    wmin, wmax = mu.min(1).values, mu.max(1).values
    best = torch.full((6,), math.inf, dtype=torch.float64)
    for rho in np.linspace(0.2, 1.0, 801):
        g = grids_from_range(rho * wmin, rho * wmax, 2)
        best = torch.minimum(best, grid_cost(mu, sigma, g.lo, g.scale, 4).sum(1))
    assert (cost <= best * (1 + 1e-3)).all()
    minmax = minmax_grids(mu, 2)
    assert (cost <= grid_cost(mu, sigma, minmax.lo, minmax.scale, 4).sum(1) + 1e-9).all()
    got = grid_cost(mu, sigma, grids.lo, grids.scale, 4).sum(1)
    assert torch.allclose(got, cost)


# Max (1960): Lloyd-Max quantiser of N(0, 1): positive levels and MSE.
LLOYD_MAX_TABLE = {
    1: ([0.7979], 0.3634),
    2: ([0.4528, 1.510], 0.1175),
    3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
    4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497),
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_gaussian_vs_known_table(bits):
    levels, mse = lloyd_max_gaussian(bits)
    pos, table_mse = LLOYD_MAX_TABLE[bits]
    assert levels[2 ** (bits - 1):].tolist() == pytest.approx(pos, abs=2e-3)
    assert torch.allclose(levels, -levels.flip(0), atol=1e-10)
    assert mse == pytest.approx(table_mse, rel=2e-3)


@pytest.mark.parametrize("bits", [2, 3])
def test_lloyd_max_gaussian_mse_vs_numerical_integration_and_uniform(bits):
    levels, mse = lloyd_max_gaussian(bits)
    assert mse == pytest.approx(_numeric_cost(0.0, 1.0, levels.numpy()), rel=1e-9)
    assert mse < optimal_uniform_range(bits)[1]  # non-uniform beats the best uniform grid


# --- deployed objective: weighted squared error of Q(mu) ---------------------------------------

from bayesq.codebook import (  # noqa: E402
    fit_uniform_grids_deployed, fit_uniform_grids_deployed_many, fit_weighted_levels, grid_sq_error, grid_sq_errors,
    levels_sq_error, quantize_levels,
)


def _weighted_rows(seed, rows=40, n=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=g, dtype=torch.float64)
    w[:, :3] *= 6  # outliers make clipping worthwhile
    weight = torch.rand(rows, n, generator=g, dtype=torch.float64).pow(3)
    return w, weight


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fit_uniform_grids_deployed_vs_dense_ratio_grid(bits):
    w, weight = _weighted_rows(bits)
    grids, cost = fit_uniform_grids_deployed(w, weight, bits, iters=12, min_ratio=0.2, grid=20)
    torch.testing.assert_close(cost, grid_sq_error(w, weight, grids))  # the cost is of those grids
    lo, hi = w.min(1).values, w.max(1).values
    dense = torch.stack([grid_sq_error(w, weight, grids_from_range(r * lo, r * hi, bits, 16))
                         for r in torch.linspace(0.2, 1.0, 2001).tolist()])  # (2001, rows)
    assert (cost <= dense[-1] + 1e-12).all()  # never worse than min/max (RTN's range)
    # grid + golden section lands within 2 % of the dense optimum on every row, and on average
    # within 0.5 %
    assert (cost <= dense.min(0).values * 1.02 + 1e-12).all()
    assert cost.sum() <= dense.min(0).values.sum() * 1.005


def test_grid_sq_error_vs_quantize_dequantize_with_zero_scale_and_ratio_batch():
    w, weight = _weighted_rows(7, rows=6, n=16)
    w[2] = 0.0  # an all-zero row: scale 0, every level 0
    grids = minmax_grids(w, 3)
    assert grids.scale[2] == 0
    ref = ((grids.dequantize(grids.quantize(w)) - w).pow(2) * weight).sum(1)
    assert torch.equal(grid_sq_error(w, weight, grids), ref)
    lo, hi = w.min(1).values, w.max(1).values
    ratios = torch.tensor([0.3, 0.7, 1.0], dtype=torch.float64)[:, None]
    stacked = grid_sq_error(w, weight, grids_from_range(ratios * lo, ratios * hi, 3))  # (3, rows)
    for i, r in enumerate(ratios[:, 0].tolist()):
        assert torch.equal(stacked[i], grid_sq_error(w, weight, grids_from_range(r * lo, r * hi, 3)))


@pytest.mark.parametrize("chunk", [2**18, 64 * 5])  # all ratios in one call | five per call
def test_search_range_batched_ratios_vs_one_at_a_time(monkeypatch, chunk):
    import bayesq.codebook as codebook

    monkeypatch.setattr(codebook, "_BATCH_ELEMENTS", chunk)
    w, weight = _weighted_rows(8, rows=30, n=64)
    w[:, 10:20] = 0.0  # flat costs over ratios on some rows exercise the tie rule (earlier ratio kept)
    w[5] = 0.0
    lo, hi = w.min(1).values, w.max(1).values
    cost = lambda g: grid_sq_error(w, weight, g)  # noqa: E731
    one = search_range(lo, hi, 3, cost, iters=12, min_ratio=0.2, grid=20)
    many = search_range(lo, hi, 3, cost, iters=12, min_ratio=0.2, grid=20, elements=w.shape[1])
    assert torch.equal(one[0].scale, many[0].scale) and torch.equal(one[0].zero, many[0].zero)
    assert torch.equal(one[1], many[1])



@pytest.mark.parametrize("chunk", [2**18, 64 * 5])  # whole | a few rows per call
def test_grid_sq_errors_vs_grid_sq_error_each(monkeypatch, chunk):
    import bayesq.codebook as codebook

    monkeypatch.setattr(codebook, "_BATCH_ELEMENTS", chunk)
    w, a = _weighted_rows(11, rows=30)
    b = torch.rand_like(a)
    lo, hi = w.min(1).values, w.max(1).values
    ratios = torch.tensor([0.3, 0.7, 1.0], dtype=torch.float64)[:, None]
    shared = grids_from_range(ratios * lo, ratios * hi, 3)  # (3, rows): every weight scores every grid
    got = grid_sq_errors(w, [a, b], shared)  # (2, 3, rows)
    assert torch.equal(got[0], grid_sq_error(w, a, shared)) and torch.equal(got[1], grid_sq_error(w, b, shared))
    pair = grids_from_range(ratios[:2] * lo, ratios[:2] * hi, 3)  # (2, rows): weight i scores grids i
    got = grid_sq_errors(w, [a, b], pair, paired=True)
    assert torch.equal(got[0], grid_sq_error(w, a, pair.take(0)))
    assert torch.equal(got[1], grid_sq_error(w, b, pair.take(1)))


@pytest.mark.parametrize("bits", [2, 3])
def test_fit_uniform_grids_deployed_many_vs_one_call_each(bits):
    """Searched together (the ratio grid scored once, the golden sections as one), each metric's
    grids and costs are exactly those it gets alone."""
    w, a = _weighted_rows(20 + bits)
    metrics = [a, a.flip(1), torch.ones_like(a)]
    w[:, 10:20] = 0.0  # flat stretches exercise the tie rule
    grids, cost = fit_uniform_grids_deployed_many(w, metrics, bits, iters=12, min_ratio=0.2, grid=20)
    for i, m in enumerate(metrics):
        one, c = fit_uniform_grids_deployed(w, m, bits, iters=12, min_ratio=0.2, grid=20)
        assert torch.equal(grids.scale[i], one.scale) and torch.equal(grids.zero[i], one.zero)
        assert torch.equal(cost[i], c)
    assert not torch.equal(grids.scale[0], grids.scale[2])  # the metrics do pick other ranges

def _dp_levels_cost(x: np.ndarray, wt: np.ndarray, k: int) -> float:
    """Optimal weighted k-means cost on a line: the best contiguous partition of sorted x (DP)."""
    order = np.argsort(x)
    x, wt = x[order], wt[order]
    n = len(x)

    def cell(i, j):  # cost of x[i:j] at its weighted mean
        ww, xx = wt[i:j], x[i:j]
        s = ww.sum()
        return 0.0 if s == 0 else float((ww * (xx - (ww * xx).sum() / s) ** 2).sum())

    best = np.full((k + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    for c in range(1, k + 1):
        for j in range(1, n + 1):
            best[c, j] = min(best[c - 1, i] + cell(i, j) for i in range(j))
    return float(best[1:, n].min())


def test_fit_weighted_levels_vs_dp_optimum_on_clustered_rows():
    g = torch.Generator().manual_seed(3)
    centres = torch.tensor([-2.0, -0.5, 0.7, 3.0], dtype=torch.float64)
    w = (centres[torch.randint(0, 4, (6, 24), generator=g)] + 0.05 * torch.randn(6, 24, generator=g, dtype=torch.float64))
    weight = torch.rand(6, 24, generator=g, dtype=torch.float64) + 0.1
    levels, cost = fit_weighted_levels(w, weight, torch.ones_like(w), 2, lut_bits=64)
    torch.testing.assert_close(cost, levels_sq_error(w, weight, levels))
    for r in range(w.shape[0]):
        assert cost[r].item() == pytest.approx(_dp_levels_cost(w[r].numpy(), weight[r].numpy(), 4), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("bits", [2, 3])
def test_fit_weighted_levels_never_worse_than_rtn_levels(bits):
    w, weight = _weighted_rows(10 + bits, rows=20, n=48)
    mask = torch.ones_like(w)
    mask[:, -5:] = 0  # padding carries no weight
    levels, cost = fit_weighted_levels(w, weight * mask, mask, bits)
    lo = torch.where(mask > 0, w, math.inf).min(1).values
    hi = torch.where(mask > 0, w, -math.inf).max(1).values
    rtn = lo[:, None] + (hi - lo)[:, None] * torch.linspace(0, 1, 2**bits, dtype=torch.float64)
    rtn16 = rtn.to(torch.float16).double()
    assert (cost <= levels_sq_error(w, weight * mask, rtn16) + 1e-12).all()
    assert (levels[:, 1:] >= levels[:, :-1]).all()
    assert quantize_levels(w, levels).max() < 2**bits


@pytest.mark.parametrize("grid", [0, 20])
def test_search_range_min_ratio_one_is_minmax_scored_once(grid):
    torch.manual_seed(0)
    w = torch.randn(6, 64, dtype=torch.float64)
    calls = []

    def cost(g):
        calls.append(g)
        return (g.dequantize(g.quantize(w)) - w).pow(2).sum(1)

    grids, c = search_range(w.min(1).values, w.max(1).values, 3, cost, iters=12, min_ratio=1.0, grid=grid)
    want = minmax_grids(w, 3)
    assert len(calls) == 1 and torch.equal(grids.scale, want.scale) and torch.equal(grids.zero, want.zero)
    assert torch.equal(c, cost(want))
