"""Closed-form posterior-expected distortion of a uniform grid under a Gaussian posterior.

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
cancels).  The derivation is in ``docs/method.md``; ``tests/test_grid_cost.py`` checks it
against numerical integration.  The boundary sums cost O(K) per weight; where the posterior is
much wider than the step (``d <= SMOOTH_MAX_STEP``, e.g. prior-dominated weights at 8 bits) they
are midpoint sums of smooth functions and :func:`grid_cost_fast` takes them by the Euler-Maclaurin
formula, O(1) per weight, with an omitted O(d^6) term below float64 rounding.
"""

from __future__ import annotations

import math

import torch
from scipy.optimize import minimize_scalar

_SQRT2 = math.sqrt(2.0)


_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


CHUNK_ELEMENTS = 1 << 22  # weights x boundaries per evaluation chunk (32 MiB of float64)


def upper_tail(x: torch.Tensor) -> torch.Tensor:
    """Q(x) = P(Z > x) for Z ~ N(0, 1), accurate in the upper tail."""
    return 0.5 * torch.erfc(x / _SQRT2)


def normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def x_normal_pdf(x: torch.Tensor) -> torch.Tensor:
    """x * phi(x), with its limit 0 at +-inf."""
    return torch.where(torch.isfinite(x), x * normal_pdf(x), torch.zeros_like(x))


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
    tail = upper_tail(torch.where(upper, a, -a))
    e_n = torch.where(upper, tail, -tail).sum(-1)
    e_n2 = (torch.where(upper, 2 * rel - 1, 1 - 2 * rel) * tail).sum(-1)
    s_phi = normal_pdf(a).sum(-1)
    return 1.0 + c_star * c_star + 2 * d * (c_star * e_n - s_phi) + d * d * e_n2


def _smooth_terms(x: torch.Tensor, q: torch.Tensor, p: torch.Tensor, x0: torch.Tensor, e2: torch.Tensor,
                  e4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Euler-Maclaurin brackets ``F(x)`` of ``g = Q`` and ``g = (x - x0) Q`` at ``x`` (``q = Q(x)``,
    ``p = phi(x)``): ``F = G - e2 g' + e4 g'''`` with ``G`` an antiderivative, ``e2 = d^2/24``,
    ``e4 = 7 d^4/5760``; the midpoint sum ``d sum_{m=1}^{n} g(a + (m - 1/2) d)`` is ``F(a + n d) - F(a)``
    up to ``-31 d^6/967680 (g^(5)(b) - g^(5)(a))``."""
    x2 = x * x
    f_q = x * q - p + e2 * p + e4 * (1 - x2) * p
    f_t = (0.5 * ((x2 - 1) * q - x * p) - x0 * (x * q - p) - e2 * (q - (x - x0) * p)
           + e4 * p * (4 * x - x0 - x2 * x + x0 * x2))
    return f_q, f_t


def _start_terms(x0: torch.Tensor, q: torch.Tensor, p: torch.Tensor, e2: torch.Tensor,
                 e4: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_smooth_terms` at ``x = x0`` (fewer operations: ``(x - x0) = 0`` there)."""
    xp = x0 * p
    return x0 * q - p + e2 * p + e4 * (p - x0 * xp), -(0.5 * (x0 * x0 + 1) + e2) * q + (0.5 + 3 * e4) * xp


def _grid_cost_smooth(mu: torch.Tensor, sigma: torch.Tensor, lo: torch.Tensor, step: torch.Tensor,
                      levels: int) -> torch.Tensor:
    """:func:`grid_cost` with its boundary sums in closed form: (G, n) float64, O(1) per weight.

    With ``x = c* + (m - 1/2) d`` for the boundaries above ``mu`` (m = j - k*, ``n_up = K-1-k*`` of
    them) and ``x = -c* + (m - 1/2) d`` below it (m = k* - j + 1, ``n_low = k*``),

        d E[N']          = S(c*, n_up) - S(-c*, n_low),        S(x0, n) = d sum_m Q(x),
        d^2 E[N'^2]      = 2 (T(c*, n_up) + T(-c*, n_low)),    T(x0, n) = d sum_m (x - x0) Q(x),
        d sum_j phi(a_j) = d sum of phi over the boundaries,

    each a midpoint sum taken by the Euler-Maclaurin formula (:func:`_smooth_terms`). The omitted
    term is O(d^6): for ``d <= SMOOTH_MAX_STEP`` it is below float64 rounding of the cost
    (``tests/test_grids.py`` compares with :func:`grid_cost`).
    """
    lo, step = lo[:, None], step[:, None]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    k_star = torch.where(step > 0, torch.round((mu - lo) / safe), torch.zeros_like(mu)).clamp(0, levels - 1)
    c = (lo + k_star * step - mu) / sigma
    d = step / sigma
    d2 = d * d
    e2, e4 = d2 / 24, 7 * d2 * d2 / 5760  # the Euler-Maclaurin coefficients
    top, bottom = c + (levels - 1 - k_star) * d, c - k_star * d  # (hi - mu) / sigma, (lo - mu) / sigma
    p_c, p_top, p_bottom = normal_pdf(c), normal_pdf(top), normal_pdf(bottom)
    q_top, q_bottom = upper_tail(top), upper_tail(bottom)
    s_up_b, t_up_b = _smooth_terms(top, q_top, p_top, c, e2, e4)
    s_low_b, t_low_b = _smooth_terms(-bottom, upper_tail(-bottom), p_bottom, -c, e2, e4)
    s_up_a, t_up_a = _start_terms(c, upper_tail(c), p_c, e2, e4)
    s_low_a, t_low_a = _start_terms(-c, upper_tail(-c), p_c, e2, e4)
    f_phi_top = -q_top + e2 * top * p_top + e4 * (3 * top - top * top * top) * p_top
    f_phi_bottom = -q_bottom + e2 * bottom * p_bottom + e4 * (3 * bottom - bottom * bottom * bottom) * p_bottom
    s_n = (s_up_b - s_up_a) - (s_low_b - s_low_a)
    return 1.0 + c * c + 2 * (c * s_n - (f_phi_top - f_phi_bottom)) + 2 * ((t_up_b - t_up_a) + (t_low_b - t_low_a))


SMOOTH_MAX_STEP = 0.02  # whitened step d up to which the boundary sums are taken in closed form


def grid_cost_fast(mu: torch.Tensor, sigma: torch.Tensor, lo: torch.Tensor, step: torch.Tensor,
                   levels: int) -> torch.Tensor:
    """:func:`grid_cost`, (G, n) float64: weights whose whitened step ``d = step / sigma`` is at
    most :data:`SMOOTH_MAX_STEP` (a posterior much wider than the grid's step) by
    :func:`_grid_cost_smooth` (O(1) work each), the others by the boundary sum (O(K) each)."""
    if levels <= 2:
        return grid_cost(mu, sigma, lo, step, levels)
    out = _grid_cost_smooth(mu, sigma, lo, step, levels)
    wide = step[:, None] > SMOOTH_MAX_STEP * sigma  # (G, n): the boundary sum
    if bool(wide.any()):
        rows = wide.nonzero()[:, 0]
        out[wide] = grid_cost(mu[wide][:, None], sigma[wide][:, None], lo[rows], step[rows], levels)[:, 0]
    return out


def grid_cost_chunked(
    mu: torch.Tensor, sigma: torch.Tensor, lo: torch.Tensor, step: torch.Tensor,
    levels: int, mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row sums of :func:`grid_cost` (masked; by :func:`grid_cost_fast`), computed in
    memory-bounded chunks. Returns (G,)."""
    rows = max(1, CHUNK_ELEMENTS // max(1, mu.shape[1] * max(1, levels - 1)))
    out = torch.empty(mu.shape[0], dtype=mu.dtype, device=mu.device)
    for s in range(0, mu.shape[0], rows):
        e = slice(s, s + rows)
        cost = grid_cost_fast(mu[e], sigma[e], lo[e], step[e], levels)
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
