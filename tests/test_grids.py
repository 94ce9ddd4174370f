"""Uniform grids: range search, fits, rounding and the scored squared errors (bayesq/grids.py)."""

import math

import numpy as np
import pytest
import torch

from bayesq.grid_cost import grid_cost
from bayesq.grids import (
    dequantize, fit_uniform_grids, fit_uniform_grids_deployed, fit_uniform_grids_deployed_many, grid_sq_error,
    grid_sq_errors, grids_from_range, minmax_grids, quantize, search_range,
)
from oracles import weighted_rows


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




@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fit_uniform_grids_deployed_vs_dense_ratio_grid(bits):
    w, weight = weighted_rows(bits)
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
    w, weight = weighted_rows(7, rows=6, n=16)
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
    import bayesq.grids as codebook

    monkeypatch.setattr(codebook, "_BATCH_ELEMENTS", chunk)
    w, weight = weighted_rows(8, rows=30, n=64)
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
    import bayesq.grids as codebook

    monkeypatch.setattr(codebook, "_BATCH_ELEMENTS", chunk)
    w, a = weighted_rows(11, rows=30)
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
    w, a = weighted_rows(20 + bits)
    metrics = [a, a.flip(1), torch.ones_like(a)]
    w[:, 10:20] = 0.0  # flat stretches exercise the tie rule
    grids, cost = fit_uniform_grids_deployed_many(w, metrics, bits, iters=12, min_ratio=0.2, grid=20)
    for i, m in enumerate(metrics):
        one, c = fit_uniform_grids_deployed(w, m, bits, iters=12, min_ratio=0.2, grid=20)
        assert torch.equal(grids.scale[i], one.scale) and torch.equal(grids.zero[i], one.zero)
        assert torch.equal(cost[i], c)
    assert not torch.equal(grids.scale[0], grids.scale[2])  # the metrics do pick other ranges


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
