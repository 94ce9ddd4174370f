"""Non-uniform codebooks: exact expected cost of sorted levels, posterior-weighted Lloyd-Max,
mu-law control and compile-to-uniform (bayesq/levels.py)."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

import bayesq.levels as cb
from bayesq.grid_cost import grid_cost, optimal_uniform_range
from bayesq.grids import dequantize, fit_uniform_grids, minmax_grids, quantize
from bayesq.levels import (
    compile_to_uniform, dequantize_levels, fit_lloyd_levels, fit_weighted_levels, levels_cost, levels_cost_chunked,
    levels_sq_error, lloyd_levels_step, lloyd_max_gaussian, mulaw_levels, quantize_levels, weighted_line_fit,
)
from oracles import numeric_grid_cost, weighted_rows

F64 = torch.float64


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def _quad_cost(mu: float, sigma: float, levels: np.ndarray) -> float:
    """E[(Q(w) - w)^2] (unwhitened) by adaptive quadrature, cell by cell."""
    bounds = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    total = 0.0
    for c, a, b in zip(levels, bounds[:-1], bounds[1:]):
        f = lambda w, c=c: (c - w) ** 2 * stats.norm.pdf(w, mu, sigma)
        pts = [mu] if a < mu < b else None
        if np.isfinite(a) and np.isfinite(b):
            total += integrate.quad(f, a, b, epsabs=1e-15, epsrel=1e-12, limit=200, points=pts)[0]
        else:
            total += integrate.quad(f, a, b, epsabs=1e-15, epsrel=1e-12, limit=200)[0]
    return total


def _rows(seed: int, r: int, n: int, spread: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(r, n, dtype=F64, generator=g) * 0.05
    sigma = torch.exp(spread * torch.randn(r, n, dtype=F64, generator=g)) * 0.01
    return mu, sigma, g


# ---------------------------------------------------------------- levels_cost


def test_levels_cost_vs_grid_cost_uniform_levels():
    mu, sigma, _ = _rows(0, 3, 40)
    mu[0, :3] = torch.tensor([0.5, -0.7, 0.015])  # clipped beyond both ends, at a boundary
    sigma[1, :2] = torch.tensor([1e-6, 3.0])
    lo, step = _t([-0.1, -0.2, -0.05]), _t([0.03, 0.05, 0.01])
    levels = lo[:, None] + step[:, None] * torch.arange(8, dtype=F64)  # (3, 8)
    got, want = levels_cost(mu, sigma, levels), grid_cost(mu, sigma, lo, step, 8)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_levels_cost_vs_numerical_integration():
    levels = _t([[-0.9, -0.2, 0.05, 0.1, 1.3], [-3.0, -2.9, 0.0, 0.4, 2.0]])
    mu = _t([[0.0, -0.55, 0.075, 2.5, -4.0, 0.3], [-2.95, 0.2, 5.0, -1.0, 0.01, 1.2]])
    sigma = _t([[0.3, 0.01, 0.002, 0.5, 1.0, 20.0], [0.02, 0.1, 2.0, 0.7, 1e-3, 0.05]])
    omega = torch.rand(2, 6, dtype=F64, generator=torch.Generator().manual_seed(3)) + 0.5
    whitened, weighted = levels_cost(mu, sigma, levels), levels_cost(mu, sigma, levels, omega)
    for r in range(2):
        for i in range(6):
            plain = _quad_cost(mu[r, i].item(), sigma[r, i].item(), levels[r].numpy())
            assert whitened[r, i].item() == pytest.approx(plain / sigma[r, i].item() ** 2, rel=1e-7, abs=1e-12)
            assert weighted[r, i].item() == pytest.approx(omega[r, i].item() * plain, rel=1e-7, abs=1e-14)


def test_levels_cost_small_sigma_tail_is_exact():
    # sigma << spacing, mu far outside or inside: cost -> 1 + ((Q(mu) - mu) / sigma)^2, no NaN/inf
    levels = _t([[-0.2, -0.05, 0.01, 0.3]] * 3)
    mu, sigma = _t([[0.013], [5.0], [-0.19]]), _t([[1e-5], [1e-4], [1e-3]])
    want = [1 + ((0.01 - 0.013) / 1e-5) ** 2, 1 + ((0.3 - 5.0) / 1e-4) ** 2, 1 + ((-0.2 + 0.19) / 1e-3) ** 2]
    got = levels_cost(mu, sigma, levels)
    assert torch.isfinite(got).all()
    assert got[:, 0].tolist() == pytest.approx(want, rel=1e-12)


def test_levels_cost_duplicate_levels_equal_deduplicated():
    mu, sigma, _ = _rows(1, 2, 30)
    dup = _t([[-0.05, 0.0, 0.0, 0.04], [-0.1, -0.1, 0.02, 0.02]])
    ded = _t([[-0.05, 0.0, 0.04], [-0.1, 0.02, 0.02]])
    ded2 = _t([[-0.1, 0.02]])
    assert torch.allclose(levels_cost(mu[:1], sigma[:1], dup[:1]), levels_cost(mu[:1], sigma[:1], ded[:1]), rtol=1e-12)
    assert torch.allclose(levels_cost(mu[1:], sigma[1:], dup[1:]), levels_cost(mu[1:], sigma[1:], ded2), rtol=1e-12)


def test_levels_cost_chunked_vs_masked_row_sums(monkeypatch):
    mu, sigma, g = _rows(2, 7, 33)
    levels = torch.sort(torch.randn(7, 4, dtype=F64, generator=g) * 0.05, 1).values
    mask = (torch.rand(7, 33, dtype=F64, generator=g) > 0.3).to(F64)
    omega = torch.rand(7, 33, dtype=F64, generator=g)
    monkeypatch.setattr(cb, "CHUNK_ELEMENTS", 100)  # force many chunks
    for om in (None, omega):
        want = (levels_cost(mu, sigma, levels, om) * mask).sum(1)
        assert torch.allclose(levels_cost_chunked(mu, sigma, levels, mask, om), want, rtol=1e-13)


def test_levels_cost_rejects_bad_input():
    mu, sigma = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    with pytest.raises(ValueError, match="sorted ascending"):
        levels_cost(mu, sigma, _t([[0.0, -1.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="sigma must be > 0"):
        levels_cost(mu, 0 * sigma, _t([[0.0, 1.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match=r"levels must be \(R, K\)"):
        levels_cost(mu, sigma, _t([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="omega"):
        levels_cost(mu, sigma, _t([[0.0, 1.0], [0.0, 1.0]]), -sigma)


# ---------------------------------------------------------------- posterior-weighted Lloyd-Max


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_fit_lloyd_levels_single_weight_vs_lloyd_max_gaussian(bits):
    want, mse = lloyd_max_gaussian(bits)
    one = torch.ones(2, 1, dtype=F64)
    mu, sigma = _t([[0.0], [0.3]]), _t([[1.0], [0.02]])  # N(0,1) and an affine copy
    levels, cost = fit_lloyd_levels(mu, sigma, one, bits, iters=3000, rtol=0.0, lut_bits=64)
    assert torch.allclose(levels[0], want, atol=1e-7)
    assert torch.allclose(levels[1], 0.3 + 0.02 * want, atol=1e-9)
    assert cost.tolist() == pytest.approx([mse, mse], rel=1e-9)  # whitened cost = N(0,1) MSE


def test_lloyd_levels_step_objective_non_increasing():
    mu, sigma, g = _rows(4, 6, 64)
    mu[0, 0] = 0.6  # an outlier
    mask = torch.ones_like(mu)
    mask[5, 50:] = 0
    for omega in (None, torch.rand(6, 64, dtype=F64, generator=g)):
        levels = torch.sort(torch.randn(6, 8, dtype=F64, generator=g) * 0.05, 1).values
        objs = []
        for _ in range(30):
            new, obj = lloyd_levels_step(mu, sigma, levels, mask, omega)
            assert torch.allclose(obj, levels_cost_chunked(mu, sigma, levels, mask, omega), rtol=1e-12)
            assert (new[:, 1:] >= new[:, :-1]).all()
            objs.append(obj)
            levels = new
        objs = torch.stack(objs)  # (iters, R)
        assert (objs[1:] <= objs[:-1] * (1 + 1e-12)).all()
        assert (objs[-1] < objs[0]).all()


def _mixture_density(x, mu, sigma, wt):
    return float(np.sum(wt * stats.norm.pdf(x, mu, sigma)))


def test_fit_lloyd_levels_fixed_point_vs_numerical_integration():
    # At convergence every level is the omega-weighted mixture centroid of its cell, and the
    # returned cost is the mixture's expected squared error, both by quadrature.
    mu_np = np.array([-0.3, -0.05, 0.0, 0.12, 0.5])
    sd_np = np.array([0.1, 0.02, 0.3, 0.05, 0.2])
    om_np = np.array([1.0, 3.0, 0.5, 2.0, 1.5])
    mu, sigma, omega = (torch.from_numpy(v[None]) for v in (mu_np, sd_np, om_np))
    levels, cost = fit_lloyd_levels(mu, sigma, torch.ones_like(mu), 2, omega=omega, iters=5000,
                                    rtol=0.0, lut_bits=64)
    lv = levels[0].numpy()
    bounds = np.concatenate([[-np.inf], (lv[1:] + lv[:-1]) / 2, [np.inf]])
    total = 0.0
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        # the objective weights E_i by omega_i: density sum_i omega_i N(w; mu_i, sd_i^2)
        m0 = integrate.quad(lambda x: _mixture_density(x, mu_np, sd_np, om_np), a, b, epsabs=1e-13, limit=200)[0]
        m1 = integrate.quad(lambda x: x * _mixture_density(x, mu_np, sd_np, om_np), a, b, epsabs=1e-13, limit=200)[0]
        assert lv[k] == pytest.approx(m1 / m0, abs=1e-8)
        f = lambda x, c=lv[k]: (c - x) ** 2 * _mixture_density(x, mu_np, sd_np, om_np)
        total += integrate.quad(f, a, b, epsabs=1e-14, limit=200)[0]
    assert cost.item() == pytest.approx(total, rel=1e-8)


@pytest.mark.parametrize("init", ["uniform", "kmeans++"])
def test_fit_lloyd_levels_beats_fitted_uniform_grid(init):
    mu, sigma, _ = _rows(5, 8, 64, spread=0.7)
    mask = torch.ones_like(mu)
    for bits in (2, 3):
        levels, cost = fit_lloyd_levels(mu, sigma, mask, bits, init=init, seed=1)
        assert torch.equal(levels, levels.half().double())  # stored as an fp16 LUT
        assert torch.allclose(cost, levels_cost_chunked(mu, sigma, levels, mask), rtol=1e-12)
        _, uniform = fit_uniform_grids(mu, sigma, mask, bits)
        assert (cost < uniform).all()


def test_fit_lloyd_levels_kmeanspp_is_seeded():
    mu, sigma, _ = _rows(6, 4, 64)
    mask = torch.ones_like(mu)
    a = fit_lloyd_levels(mu, sigma, mask, 2, init="kmeans++", seed=3)[0]
    b = fit_lloyd_levels(mu, sigma, mask, 2, init="kmeans++", seed=3)[0]
    assert torch.equal(a, b)


def test_lloyd_levels_step_empty_cell_keeps_level():
    mu, sigma = _t([[0.0, 0.05, 0.1]]), _t([[1e-3, 1e-3, 1e-3]])
    levels = _t([[-100.0, 0.01, 0.08, 100.0]])  # the end cells hold no mass at all
    new, _ = lloyd_levels_step(mu, sigma, levels, torch.ones_like(mu))
    assert new[0, 0].item() == -100.0 and new[0, 3].item() == 100.0
    assert new[0, 1].item() == pytest.approx(0.0, abs=1e-7)  # 5-sigma leak of the weight at 0.05
    assert new[0, 2].item() == pytest.approx(0.075, abs=1e-7)


def test_fit_lloyd_levels_rejects_bad_input():
    mu, sigma = torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=F64)
    mask = torch.ones_like(mu)
    with pytest.raises(ValueError, match="init must be"):
        fit_lloyd_levels(mu, sigma, mask, 2, init="random")
    with pytest.raises(ValueError, match="16, 32 or 64"):
        fit_lloyd_levels(mu, sigma, mask, 2, lut_bits=8)
    with pytest.raises(ValueError, match="mask"):
        fit_lloyd_levels(mu, sigma, mask[:, :2], 2)
    with pytest.raises(ValueError, match="fp16 range"):
        fit_lloyd_levels(mu + 1e5, sigma, mask, 2)


# ---------------------------------------------------------------- quantize / dequantize levels


def test_quantize_levels_vs_brute_force_nearest():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4, 200, dtype=F64, generator=g)
    levels = torch.sort(torch.randn(4, 8, dtype=F64, generator=g), 1).values
    codes = quantize_levels(w, levels)
    brute = (w[..., None] - levels[:, None, :]).abs().argmin(-1)  # (4, 200)
    assert torch.equal(codes, brute)
    assert torch.equal(quantize_levels(dequantize_levels(codes, levels), levels), codes)
    tie = quantize_levels(_t([[0.5]]), _t([[0.0, 1.0]]))
    assert tie.item() == 0  # a tie goes to the lower level


# ---------------------------------------------------------------- mu-law


def test_mulaw_levels_invert_with_the_mulaw_compressor():
    absmax = _t([0.37, 2.0, 0.0])
    for mu in (1.0, 4.0, 255.0):
        levels = mulaw_levels(absmax, 3, mu)
        a = absmax.half().double()
        assert (levels[:, 1:] >= levels[:, :-1]).all() and (levels.abs() <= a[:, None]).all()
        x = levels[:2] / a[:2, None]
        # compressor F(x) = sign(x) ln(1 + mu |x|) / ln(1 + mu) maps the levels to the mid-rise points
        u = np.sign(x.numpy()) * np.log1p(mu * np.abs(x.numpy())) / np.log1p(mu)
        assert u == pytest.approx(np.tile(-1 + (np.arange(8) + 0.5) / 4, (2, 1)), abs=1e-12)
        assert (levels[2] == 0).all()


def test_mulaw_levels_hand_values_and_uniform_limit():
    lv = mulaw_levels(_t([1.0]), 1, mu=3.0)  # u = -1/2, 1/2: (4^0.5 - 1)/3 = 1/3
    assert lv[0].tolist() == pytest.approx([-1 / 3, 1 / 3], abs=1e-15)
    assert mulaw_levels(_t([2.0]), 2, mu=0.0)[0].tolist() == pytest.approx([-1.5, -0.5, 0.5, 1.5])
    with pytest.raises(ValueError, match="mu >= 0"):
        mulaw_levels(_t([1.0]), 2, mu=-1.0)
    with pytest.raises(ValueError, match="absmax"):
        mulaw_levels(_t([[1.0]]), 2)


# ---------------------------------------------------------------- compile to uniform


def test_weighted_line_fit_vs_numpy_polyfit():
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 8, (5, 40), generator=g).to(F64)
    w = 0.03 * (codes - 3.2) + 0.01 * torch.randn(5, 40, dtype=F64, generator=g)
    omega = torch.rand(5, 40, dtype=F64, generator=g) + 0.1
    slope, intercept = weighted_line_fit(codes, w, omega)
    for r in range(5):
        # numpy weights multiply the residual, so sqrt(omega) gives the omega-weighted squares
        p = np.polyfit(codes[r].numpy(), w[r].numpy(), 1, w=np.sqrt(omega[r].numpy()))
        assert [slope[r].item(), intercept[r].item()] == pytest.approx(list(p), rel=1e-10, abs=1e-13)


def _assignment_error(codes, w, wt, scale, zero):
    return (wt * (scale[:, None] * (codes.to(F64) - zero[:, None]) - w) ** 2).sum(1)


def test_compile_to_uniform_recovers_an_exact_uniform_grid():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(6, 64, dtype=F64, generator=g) * 0.05
    grids = minmax_grids(w, 3)
    codes = quantize(w, grids)
    out = compile_to_uniform(codes, dequantize(codes, grids), 3)
    assert torch.equal(out.scale, grids.scale) and torch.equal(out.zero, grids.zero)


def test_compile_to_uniform_vs_brute_force_over_stored_grids():
    g = torch.Generator().manual_seed(10)
    w = torch.randn(3, 12, dtype=F64, generator=g) * 0.1
    levels = torch.sort(torch.randn(3, 8, dtype=F64, generator=g) * 0.1, 1).values
    codes = quantize_levels(w, levels)
    omega = torch.rand(3, 12, dtype=F64, generator=g) + 0.2
    out = compile_to_uniform(codes, w, 3, omega=omega)
    got = _assignment_error(codes, w, omega, out.scale, out.zero)
    # every fp16 scale >= 0 and every zero-point in [0, 7]
    scales = torch.arange(0, 0x7C00, dtype=torch.int16).view(torch.float16).to(F64)  # (31744,)
    c = codes.to(F64)
    for r in range(3):
        res = scales[:, None, None] * (c[r] - torch.arange(8, dtype=F64)[:, None]) - w[r]  # (S, 8, n)
        best = (omega[r] * res**2).sum(-1).min()
        assert got[r].item() <= best.item() * (1 + 1e-12)
        assert got[r].item() >= best.item() * (1 - 1e-12)
    mm = minmax_grids(w, 3)
    assert (got <= _assignment_error(codes, w, omega, mm.scale, mm.zero) * (1 + 1e-12)).all()
    # and never worse than the rounded zero of the unrounded regression, refit
    slope, intercept = weighted_line_fit(c, w, omega)
    z = torch.round(-intercept / slope).clamp(0, 7)
    s = ((omega * (c - z[:, None]) * w).sum(1) / (omega * (c - z[:, None]) ** 2).sum(1)).half().double()
    assert (got <= _assignment_error(codes, w, omega, s, z) * (1 + 1e-12)).all()


def test_compile_to_uniform_mask_and_degenerate_rows():
    w = _t([[0.1, 0.1, 0.1, 9.0], [0.0, 0.0, 0.0, 0.0]])
    codes = torch.tensor([[3, 3, 3, 0], [2, 2, 2, 2]])
    mask = _t([[1, 1, 1, 0], [1, 1, 1, 1]])
    out = compile_to_uniform(codes, w, 2, mask=mask)
    assert dequantize(codes, out)[0, :3].tolist() == pytest.approx([0.1] * 3, rel=1e-3)  # fp16 scale
    assert dequantize(codes, out)[1].abs().max().item() == 0.0
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 3\]"):
        compile_to_uniform(codes + 2, w, 2)
    with pytest.raises(ValueError, match="non-negative"):
        compile_to_uniform(codes, w, 2, omega=-torch.ones_like(w))


def test_fit_lloyd_levels_within_range_is_projected_and_monotone():
    # Wide posteriors pull unconstrained levels far beyond the stored weights; within_range keeps
    # every level in the row's [min, max] of real means, and the projected step stays monotone.
    mu, sigma, g = _rows(11, 5, 64)
    sigma[:, :32] *= 50  # half the weights barely constrained
    mask = torch.ones_like(mu)
    mask[4, 40:] = 0
    free, _ = cb.fit_lloyd_levels(mu, sigma, mask, 3, lut_bits=64)
    lo = torch.where(mask > 0, mu, torch.inf).min(1).values
    hi = torch.where(mask > 0, mu, -torch.inf).max(1).values
    assert ((free < lo[:, None]) | (free > hi[:, None])).any()  # the unconstrained fit leaves the range
    boxed, cost = cb.fit_lloyd_levels(mu, sigma, mask, 3, lut_bits=64, within_range=True)
    assert ((boxed >= lo[:, None] - 1e-15) & (boxed <= hi[:, None] + 1e-15)).all()
    assert torch.allclose(cost, levels_cost_chunked(mu, sigma, boxed, mask), rtol=1e-12)
    levels = torch.minimum(torch.maximum(torch.sort(torch.randn(5, 8, dtype=F64, generator=g) * 0.05, 1).values,
                                         lo[:, None]), hi[:, None])
    prev = None
    for _ in range(20):
        levels, obj = lloyd_levels_step(mu, sigma, levels, mask, None, (lo, hi))
        assert ((levels >= lo[:, None]) & (levels <= hi[:, None])).all()
        if prev is not None:
            assert (obj <= prev * (1 + 1e-12)).all()
        prev = obj
    # rows whose unconstrained optimum lies inside the range are unaffected
    tight, _ = cb.fit_lloyd_levels(mu[:, 32:], sigma[:, 32:] / 50, mask[:, 32:], 2, lut_bits=64)
    tight_box, _ = cb.fit_lloyd_levels(mu[:, 32:], sigma[:, 32:] / 50, mask[:, 32:], 2, lut_bits=64,
                                       within_range=True)
    m2, k2 = mu[:, 32:], mask[:, 32:]
    lo2 = torch.where(k2 > 0, m2, torch.inf).min(1).values
    hi2 = torch.where(k2 > 0, m2, -torch.inf).max(1).values
    inside = ((tight >= lo2[:, None]) & (tight <= hi2[:, None])).all(1)
    assert inside.any() and torch.allclose(tight[inside], tight_box[inside])


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
    assert mse == pytest.approx(numeric_grid_cost(0.0, 1.0, levels.numpy()), rel=1e-9)
    assert mse < optimal_uniform_range(bits)[1]  # non-uniform beats the best uniform grid


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
    w, weight = weighted_rows(10 + bits, rows=20, n=48)
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


# Max (1960): Lloyd-Max quantiser of N(0, 1): positive levels and MSE.
LLOYD_MAX_TABLE = {
    1: ([0.7979], 0.3634),
    2: ([0.4528, 1.510], 0.1175),
    3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
    4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497),
}


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
