"""Uniform grids whose clipping range minimises posterior-expected whitened distortion.

A grid with ``K = 2**bits`` levels ``c_k = lo + k * step`` (k = 0..K-1) quantises a scalar by
nearest-level rounding (values beyond the range go to the end levels).  For one weight with
diagonal posterior ``w ~ N(mu, sigma^2)`` its expected whitened distortion is the sum of the
Gaussian cell integrals

    E[(Q(w) - w)^2] / sigma^2 = sum_k int_{cell k} (c_k - w)^2 N(w; mu, sigma^2) dw / sigma^2,

which has the closed form below in terms of the boundaries ``a_j = (t_j - mu) / sigma``
(``t_j = lo + (j - 1/2) step``, j = 1..K-1), the whitened step ``d = step / sigma`` and the
whitened offset ``c* = (c_{k*} - mu) / sigma`` of the level ``k*`` nearest to ``mu``.  Writing the
quantised value as ``c* + d N'(u)`` with ``N'`` the signed number of boundaries crossed,

    cost = 1 + c*^2 + 2 d (c* E[N'] - sum_j phi(a_j)) + d^2 E[N'^2],
    E[N']   = sum_{j>k*} Q(a_j) - sum_{j<=k*} Q(-a_j),
    E[N'^2] = sum_{j>k*} (2(j-k*)-1) Q(a_j) + sum_{j<=k*} (2(k*-j)+1) Q(-a_j),

with ``Q`` the upper normal tail (every tail is evaluated where it is small, so nothing
cancels).  The derivation is in ``docs/method.md``; ``tests/test_codebook.py`` checks it
against numerical integration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy.optimize import minimize_scalar

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_CHUNK_ELEMENTS = 1 << 22  # weights x boundaries per evaluation chunk (32 MiB of float64)


def _upper_tail(x: torch.Tensor) -> torch.Tensor:
    """Q(x) = P(Z > x) for Z ~ N(0, 1), accurate in the upper tail."""
    return 0.5 * torch.erfc(x / _SQRT2)


def _pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _x_pdf(x: torch.Tensor) -> torch.Tensor:
    """x * phi(x), with its limit 0 at +-inf."""
    return torch.where(torch.isfinite(x), x * _pdf(x), torch.zeros_like(x))


def grid_cost(
    mu: torch.Tensor, sigma: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, levels: int
) -> torch.Tensor:
    """Expected whitened squared error of each weight under a uniform grid.

    Args:
        mu, sigma: (G, n) float64 posterior means and standard deviations (sigma > 0).
        lo, step: (G,) float64 first level and spacing of each row's grid (step >= 0).
        levels: number of levels K (the same for every row).

    Returns:
        (G, n) float64: ``E_{w ~ N(mu, sigma^2)}[(Q(w) - w)^2] / sigma^2`` (closed form above).
    """
    lo, step = lo[:, None], step[:, None]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    k_star = torch.where(step > 0, torch.round((mu - lo) / safe), torch.zeros_like(mu))
    k_star = k_star.clamp(0, levels - 1)  # (G, n) nearest level
    c_star = (lo + k_star * step - mu) / sigma
    d = step / sigma
    if levels == 1:
        return 1.0 + c_star * c_star
    j = torch.arange(1, levels, dtype=mu.dtype, device=mu.device)  # (K-1,) boundary index
    a = (lo[..., None] + (j - 0.5) * step[..., None] - mu[..., None]) / sigma[..., None]
    rel = j - k_star[..., None]  # (G, n, K-1): > 0 above mu, <= 0 below
    upper = rel > 0
    tail = _upper_tail(torch.where(upper, a, -a))
    e_n = torch.where(upper, tail, -tail).sum(-1)
    e_n2 = (torch.where(upper, 2 * rel - 1, 1 - 2 * rel) * tail).sum(-1)
    s_phi = _pdf(a).sum(-1)
    return 1.0 + c_star * c_star + 2 * d * (c_star * e_n - s_phi) + d * d * e_n2


def grid_cost_chunked(
    mu: torch.Tensor, sigma: torch.Tensor, lo: torch.Tensor, step: torch.Tensor,
    levels: int, mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row sums of :func:`grid_cost` (masked), computed in memory-bounded chunks. Returns (G,)."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, mu.shape[1] * max(1, levels - 1)))
    out = torch.empty(mu.shape[0], dtype=mu.dtype, device=mu.device)
    for s in range(0, mu.shape[0], rows):
        e = slice(s, s + rows)
        cost = grid_cost(mu[e], sigma[e], lo[e], step[e], levels)
        if mask is not None:
            cost = cost * mask[e]
        out[e] = cost.sum(-1)
    return out


def uniform_gaussian_mse(bits: int, alpha: float) -> float:
    """Exact MSE of the 2**bits-level mid-rise uniform quantiser on [-alpha, alpha] for N(0, 1).

    Levels ``-alpha + (k + 1/2) * 2 alpha / K``; inputs beyond the range go to the end levels
    (the clipping tails are part of the first and last cells).
    """
    if bits < 1 or alpha <= 0:
        raise ValueError(f"need bits >= 1 and alpha > 0, got bits={bits}, alpha={alpha}")
    k = 2**bits
    step = 2.0 * alpha / k
    one = torch.ones(1, 1, dtype=torch.float64)
    lo = torch.tensor([-alpha + step / 2], dtype=torch.float64)
    return float(grid_cost(0 * one, one, lo, torch.tensor([step], dtype=torch.float64), k))


def optimal_uniform_range(bits: int) -> tuple[float, float]:
    """(alpha*, mse*) minimising :func:`uniform_gaussian_mse` over alpha (bounded Brent)."""
    res = minimize_scalar(
        lambda a: uniform_gaussian_mse(bits, a), bounds=(1e-3, 12.0), method="bounded",
        options={"xatol": 1e-10},
    )
    return float(res.x), float(res.fun)


@dataclass(frozen=True)
class UniformGrids:
    """One asymmetric uniform grid per group: ``level_k = scale * (k - zero)``, k = 0..2**bits-1.

    Attributes:
        bits: bit-width of every code.
        scale: (G,) float64, already rounded to the stored scale precision.
        zero: (G,) float64 integer-valued zero-points in [0, 2**bits - 1].
    """

    bits: int
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def levels(self) -> int:
        return 2**self.bits

    @property
    def lo(self) -> torch.Tensor:
        return -self.scale * self.zero


def grids_from_range(
    lo: torch.Tensor, hi: torch.Tensor, bits: int, scale_bits: int = 16
) -> UniformGrids:
    """Asymmetric integer-zero-point grids covering [lo, hi] per group (GPTQ-style).

    ``scale = (hi - lo) / (K - 1)`` rounded to fp16 (or fp32), ``zero = round(-lo / scale)``
    clamped to [0, K-1]; a zero-width range gives scale 0 (every level is 0) only when the
    group is all zeros, else a scale that represents the constant exactly up to rounding.
    """
    k = 2**bits
    scale = (hi - lo) / (k - 1)
    flat = scale <= 0
    scale = torch.where(flat, torch.maximum(lo.abs(), hi.abs()), scale)
    dtype = torch.float16 if scale_bits == 16 else torch.float32
    scale = scale.to(dtype).to(torch.float64)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.where(scale > 0, torch.round(-lo / safe), torch.zeros_like(lo)).clamp(0, k - 1)
    return UniformGrids(bits=bits, scale=scale, zero=zero)


def minmax_grids(w: torch.Tensor, bits: int, scale_bits: int = 16, ratio: torch.Tensor | float = 1.0) -> UniformGrids:
    """Grids over ``ratio * [min, max]`` of each row of ``w`` (G, n) — RTN when ratio = 1."""
    return grids_from_range(ratio * w.min(1).values, ratio * w.max(1).values, bits, scale_bits)


def fit_uniform_grids(
    mu: torch.Tensor, sigma: torch.Tensor, mask: torch.Tensor, bits: int, *,
    iters: int = 20, min_ratio: float = 0.2, scale_bits: int = 16,
) -> tuple[UniformGrids, torch.Tensor]:
    """Per-group clipping range minimising the posterior-expected whitened distortion.

    The range is ``rho * [min, max]`` of the group's means, with ``rho`` found by a vectorised
    golden-section search on [min_ratio, 1]; ``rho = 1`` (plain min/max) is always a candidate,
    so the result is never worse than the RTN range under this objective.

    Args:
        mu, sigma: (G, n) float64 posterior means / standard deviations of each group.
        mask: (G, n) float64, 1 for real weights, 0 for padding (padding must repeat a real
            value of its group so that min/max are unaffected).
        bits: bit-width.

    Returns:
        (grids, cost): the chosen grids and their (G,) float64 summed expected whitened cost.
    """
    levels = 2**bits
    wmin, wmax = mu.min(1).values, mu.max(1).values

    def cost_at(rho: torch.Tensor) -> tuple[torch.Tensor, UniformGrids]:
        g = grids_from_range(rho * wmin, rho * wmax, bits, scale_bits)
        return grid_cost_chunked(mu, sigma, g.lo, g.scale, levels, mask), g

    one = torch.ones_like(wmin)
    best_cost, best = cost_at(one)
    best_rho = one.clone()
    a = torch.full_like(wmin, min_ratio)
    b = one.clone()
    c = b - _GOLDEN * (b - a)
    d = a + _GOLDEN * (b - a)
    fc, _ = cost_at(c)
    fd, _ = cost_at(d)
    for rho, f in ((c, fc), (d, fd)):
        better = f < best_cost
        best_cost, best_rho = torch.where(better, f, best_cost), torch.where(better, rho, best_rho)
    for _ in range(max(0, iters - 2)):
        left = fc < fd  # minimum in [a, d]
        b = torch.where(left, d, b)
        a = torch.where(left, a, c)
        new = torch.where(left, b - _GOLDEN * (b - a), a + _GOLDEN * (b - a))
        fnew, _ = cost_at(new)
        c, fc, d, fd = (  # left: (new, c) become (c, d); right: (d, new) become (c, d)
            torch.where(left, new, d), torch.where(left, fnew, fd),
            torch.where(left, c, new), torch.where(left, fc, fnew),
        )
        better = fnew < best_cost
        best_cost, best_rho = torch.where(better, fnew, best_cost), torch.where(better, new, best_rho)
    grids = grids_from_range(best_rho * wmin, best_rho * wmax, bits, scale_bits)
    return grids, best_cost


def quantize(w: torch.Tensor, grids: UniformGrids) -> torch.Tensor:
    """Integer codes (G, n) int64 of ``w`` (G, n) by nearest-level rounding, clamped to range."""
    s = grids.scale[:, None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.where(s > 0, torch.round(w / safe) + grids.zero[:, None], grids.zero[:, None])
    return codes.clamp(0, grids.levels - 1).to(torch.int64)


def dequantize(codes: torch.Tensor, grids: UniformGrids) -> torch.Tensor:
    """Weights (G, n) float64 from codes: ``scale * (code - zero)``."""
    return grids.scale[:, None] * (codes.to(torch.float64) - grids.zero[:, None])


def lloyd_max_gaussian(bits: int, *, iters: int = 2000, tol: float = 1e-13) -> tuple[torch.Tensor, float]:
    """Levels and MSE of the Lloyd-Max (MSE-optimal scalar) quantiser for N(0, 1).

    Lloyd iterations with closed-form Gaussian cell centroids
    ``c_k = (phi(t_k) - phi(t_{k+1})) / (Phi(t_{k+1}) - Phi(t_k))`` and midpoint thresholds,
    started from the optimal uniform grid; the MSE is the exact cell integral (section 3 of
    ``docs/method.md``).  Returns ((2**bits,) float64 ascending levels, mse).
    """
    if bits < 1:
        raise ValueError(f"need bits >= 1, got {bits}")
    k = 2**bits
    alpha, _ = optimal_uniform_range(bits)
    levels = -alpha + (torch.arange(k, dtype=torch.float64) + 0.5) * (2 * alpha / k)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(iters):
        t = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
        mass = _upper_tail(t[:-1]) - _upper_tail(t[1:])
        new = (_pdf(t[:-1]) - _pdf(t[1:])) / mass
        done = (new - levels).abs().max() < tol
        levels = new
        if done:
            break
    t = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
    a, b, c = t[:-1], t[1:], levels
    mass = _upper_tail(a) - _upper_tail(b)
    # int_a^b (u - c)^2 phi = (1 + c^2) P + 2c (phi(b) - phi(a)) + a phi(a) - b phi(b)
    mse = ((1 + c * c) * mass + 2 * c * (_pdf(b) - _pdf(a)) + _x_pdf(a) - _x_pdf(b)).sum()
    return levels, float(mse)
