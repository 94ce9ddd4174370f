"""Non-uniform codebooks: one sorted look-up table of levels per allocation unit.

:func:`levels_cost` is the posterior-expected distortion of arbitrary levels, from per-cell
Gaussian integrals (the same quantity :func:`bayesq.grid_cost.grid_cost` has in closed form for a
uniform grid); :func:`fit_lloyd_levels` is the posterior-weighted Lloyd-Max; :func:`mulaw_levels`
a fixed mu-law control; :func:`compile_to_uniform` refits a uniform grid to a given code
assignment. :class:`LevelTables` and :class:`MulawTables` are the codebooks that store them.
Checked by ``tests/test_levels.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Mapping

import torch

from bayesq.books import CodeBook, Field, Need, Slot, register_book, stored_float
from bayesq.grid_cost import CHUNK_ELEMENTS, normal_pdf, optimal_uniform_range, upper_tail, x_normal_pdf
from bayesq.grids import UniformGrids
from bayesq.storage import lut_unit_cost_bits, mulaw_unit_cost_bits

_FP16_MAX = 65504.0


@register_book
@dataclass(frozen=True)
class LevelTables(CodeBook):
    """Non-uniform codebooks: sorted look-up tables, each shared by some groups.

    Attributes:
        bits: bit-width of every code (``K = 2**bits`` levels per table).
        levels: (R, K) float64 ascending per row, as stored (fp16-rounded).
        row: (G,) int64 table of each group (a Lloyd LUT serves every group of its allocation
            unit; a mu-law table is one per group: :class:`MulawTables`).

    Stored (kind ``lut``): one table of ``K`` entries (``lut_bits``) per allocation unit.
    """

    kind: ClassVar[str] = "lut"
    bits: int
    levels: torch.Tensor
    row: torch.Tensor

    def take(self, rows: torch.Tensor) -> "LevelTables":
        return replace(self, row=self.row[rows])

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """(G, n) int64 codes: nearest level of each group's table (:func:`quantize_levels`)."""
        return quantize_levels(w, self.levels[self.row])

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """(G, n) float64 ``levels[row[g], code]``."""
        return dequantize_levels(codes, self.levels[self.row])

    @classmethod
    def unit_cost_bits(cls, n_weights: int, n_groups: int, bits: int, n_choices: int, quant,
                       rows: int = 1) -> int:
        return lut_unit_cost_bits(n_weights, bits, n_choices, quant.lut_bits)

    def export_fields(self, sel: torch.Tensor, blocks, quant) -> list[Field]:
        rows = self.row  # (n_sel,) table of each selected group; a unit's groups share one
        first = rows[:: blocks.unit_groups]
        if bool((rows != first.repeat_interleave(blocks.unit_groups)[: rows.numel()]).any()):
            raise ValueError(f"layer '{blocks.name}': a {self.bits}-bit LUT is not shared by its unit's groups")
        return [Field("lut", sel[:: blocks.unit_groups], self.levels[first], bits=quant.lut_bits)]

    @classmethod
    def export_slots(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping) -> list[Slot]:
        return [Slot("lut", sel[:: blocks.unit_groups], 2**bits)]

    @classmethod
    def from_export(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping,
                    fields: Mapping[str, torch.Tensor], need: Need) -> "LevelTables":
        unit = blocks.group_unit()[sel]
        units = torch.unique(unit)
        return cls(bits, fields["lut"], torch.searchsorted(units, unit))

    def group_levels(self) -> torch.Tensor:
        return self.levels[self.row]

    def trainable(self) -> dict[str, torch.Tensor]:
        return {"levels": self.levels}

    def decode_trained(self, params: Mapping[str, torch.Tensor], codes: torch.Tensor) -> torch.Tensor:
        return torch.gather(params["levels"][self.row], 1, codes)  # rows: the groups at these bits

    def from_trained(self, params: Mapping[str, torch.Tensor], codes: torch.Tensor, scale_bits: int,
                     lut_bits: int) -> tuple["LevelTables", torch.Tensor]:
        """Tables stay ascending: each code follows its level to the level's new place."""
        levels = stored_float(params["levels"], lut_bits)
        srt, perm = levels.sort(dim=1, stable=True)
        inv = torch.argsort(perm, dim=1)  # (R, K) old column -> new column
        return replace(self, levels=srt), torch.gather(inv[self.row], 1, codes)


@register_book
@dataclass(frozen=True)
class MulawTables(LevelTables):
    """:class:`LevelTables` holding the fixed mu-law table times one scale per group
    (:func:`mulaw_levels`; ``row`` is ``arange(G)``).

    Stored (kind ``mulaw``): one scale (``scale_bits``) per group; ``quant.mulaw_mu`` in the layout.
    """

    kind: ClassVar[str] = "mulaw"

    @classmethod
    def unit_cost_bits(cls, n_weights: int, n_groups: int, bits: int, n_choices: int, quant,
                       rows: int = 1) -> int:
        return mulaw_unit_cost_bits(n_weights, n_groups, bits, n_choices, quant.scale_bits)

    def export_fields(self, sel: torch.Tensor, blocks, quant) -> list[Field]:
        absmax = _mulaw_scale(self, quant.mulaw_mu, quant.scale_bits, blocks.name)
        return [Field("scale", sel, absmax, bits=quant.scale_bits)]

    def layout_entries(self, quant) -> dict:
        return {"mu": quant.mulaw_mu}

    @classmethod
    def export_slots(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping) -> list[Slot]:
        return [Slot("scale", sel)]

    @classmethod
    def from_export(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping,
                    fields: Mapping[str, torch.Tensor], need: Need) -> "MulawTables":
        levels = mulaw_levels(fields["scale"][:, 0], bits, layout["mu"], layout["scale_bits"])
        return cls(bits, levels, torch.arange(sel.numel()))


def _mulaw_scale(book: LevelTables, mu: float, scale_bits: int, name: str) -> torch.Tensor:
    """The stored per-group scale A of mu-law tables (checked to rebuild the tables exactly)."""
    bits = book.bits
    levels = book.levels[book.row]  # (n, K)
    unit = mulaw_levels(torch.ones(1, dtype=torch.float64), bits, mu, scale_bits)[0]
    absmax = levels[:, -1] / unit[-1]
    if not torch.equal(mulaw_levels(absmax, bits, mu, scale_bits), levels):
        raise ValueError(f"layer '{name}': its {bits}-bit tables are not mu-law tables of one stored scale "
                         "(edited after quantisation?); export them with quant.codebook: lloyd")
    return absmax


def levels_sq_error(w: torch.Tensor, weight: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """(R,) float64 ``sum_i weight_i (Q(w_i) - w_i)^2`` under each row's sorted ``levels`` (R, K)."""
    return ((dequantize_levels(quantize_levels(w, levels), levels) - w).pow(2) * weight).sum(1)


def fit_weighted_levels(
    w: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor, bits: int, *, iters: int = 30,
    lut_bits: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted k-means (Lloyd) levels of the deployed weights, one LUT of ``2**bits`` per row.

    Minimises ``J(c) = sum_i weight_i (c_{k(i)} - w_i)^2`` with ``k(i)`` the nearest level: each
    iteration assigns every weight to its nearest level and moves every level to its cell's
    weighted mean ``sum weight w / sum weight`` (cells with no weight keep their level), so J
    never increases. Start: the min/max uniform levels of the row's real weights (RTN's levels
    as a LUT); levels stay inside [min, max]. Levels are rounded to the LUT format and a row
    whose rounded result is worse than its rounded start keeps the start.

    Args:
        w: (R, n) float64 weights; weight: (R, n) float64 >= 0 (metric x mask); mask: (R, n)
            1 for real weights, 0 for padding.

    Returns:
        (levels (R, K) float64 ascending as stored, (R,) float64 ``J`` of those levels).
    """
    if w.shape != weight.shape or w.shape != mask.shape or w.ndim != 2 or bits < 1:
        raise ValueError(f"need (R, n) w, weight and mask of one shape and bits >= 1; got "
                         f"{tuple(w.shape)}, {tuple(weight.shape)}, {tuple(mask.shape)}, bits={bits}")
    k = 2**bits
    big = torch.finfo(w.dtype).max
    lo = torch.where(mask > 0, w, big).min(1).values
    hi = torch.where(mask > 0, w, -big).max(1).values
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)  # rows without real weights: any
    start = lo[:, None] + (hi - lo)[:, None] * torch.linspace(0, 1, k, dtype=w.dtype, device=w.device)
    levels = start
    for _ in range(iters):
        codes = quantize_levels(w, levels)  # (R, n)
        m0 = torch.zeros_like(levels).scatter_add_(1, codes, weight)  # (R, K) cell weight
        m1 = torch.zeros_like(levels).scatter_add_(1, codes, weight * w)
        new = torch.where(m0 > 0, m1 / m0.clamp_min(1e-300), levels).sort(1).values
        if torch.equal(new, levels):
            break
        levels = new
    levels, start = _round_stored(levels, lut_bits, "LUT levels"), _round_stored(start, lut_bits, "LUT levels")
    cost, cost0 = levels_sq_error(w, weight, levels), levels_sq_error(w, weight, start)
    keep = cost0 < cost
    return torch.where(keep[:, None], start, levels), torch.where(keep, cost0, cost)


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
        mass = upper_tail(t[:-1]) - upper_tail(t[1:])
        new = (normal_pdf(t[:-1]) - normal_pdf(t[1:])) / mass
        done = (new - levels).abs().max() < tol
        levels = new
        if done:
            break
    t = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
    a, b, c = t[:-1], t[1:], levels
    mass = upper_tail(a) - upper_tail(b)
    # int_a^b (u - c)^2 phi = (1 + c^2) P + 2c (phi(b) - phi(a)) + a phi(a) - b phi(b)
    mse = ((1 + c * c) * mass + 2 * c * (normal_pdf(b) - normal_pdf(a)) + x_normal_pdf(a) - x_normal_pdf(b)).sum()
    return levels, float(mse)


def _round_stored(x: torch.Tensor, bits: int, what: str) -> torch.Tensor:
    """Round float64 values to the stored float format (16: fp16, 32: fp32, 64: kept)."""
    if bits not in (16, 32, 64):
        raise ValueError(f"{what} must be stored in 16, 32 or 64 bits, got {bits}")
    if bits == 16 and bool((x.abs() > _FP16_MAX).any()):
        raise ValueError(f"{what}: values beyond the fp16 range (65504); store them with 32 bits")
    return x.clone() if bits == 64 else x.to(torch.float16 if bits == 16 else torch.float32).double()


def _check(mu: torch.Tensor, sigma: torch.Tensor, omega: torch.Tensor | None, levels: torch.Tensor | None) -> None:
    if mu.ndim != 2 or sigma.shape != mu.shape:
        raise ValueError(f"mu and sigma must both be (R, n), got {tuple(mu.shape)} and {tuple(sigma.shape)}")
    if not bool((sigma > 0).all()):
        raise ValueError("sigma must be > 0 everywhere (clip the posterior variance from below)")
    if omega is not None and (omega.shape != mu.shape or bool((omega < 0).any())):
        raise ValueError(f"omega must be a non-negative (R, n) tensor like mu {tuple(mu.shape)}")
    if levels is not None:
        _check_levels(mu, levels)


def _check_levels(w: torch.Tensor, levels: torch.Tensor) -> None:
    if levels.ndim != 2 or levels.shape[0] != w.shape[0] or levels.shape[1] < 1:
        raise ValueError(f"levels must be (R, K) with R = {w.shape[0]} rows, got {tuple(levels.shape)}")
    if bool((levels[:, 1:] < levels[:, :-1]).any()):
        raise ValueError("levels must be sorted ascending in every row; pass levels.sort(1).values")


def _bounds(levels: torch.Tensor) -> torch.Tensor:
    """(R, K+1) cell boundaries: -inf, midpoints of consecutive levels, +inf."""
    inf = levels.new_full((levels.shape[0], 1), math.inf)
    return torch.cat([-inf, (levels[:, 1:] + levels[:, :-1]) / 2, inf], 1)


def _cells(mu: torch.Tensor, sigma: torch.Tensor, levels: torch.Tensor):
    """Whitened cells (a, b], levels c, mass P(a < u <= b) and phi(a), phi(b); each (R, n, K).

    The mass uses only small tails ``t = Q(|z|)``: ``t_a - t_b`` above the mean, ``t_b - t_a``
    below it, ``1 - t_a - t_b`` across it (no cancellation near 1).
    """
    z = (_bounds(levels)[:, None, :] - mu[..., None]) / sigma[..., None]  # (R, n, K+1)
    c = (levels[:, None, :] - mu[..., None]) / sigma[..., None]  # (R, n, K)
    tail, pdf = upper_tail(z.abs()), normal_pdf(z)
    a, b, ta, tb = z[..., :-1], z[..., 1:], tail[..., :-1], tail[..., 1:]
    mass = torch.where(a >= 0, ta - tb, torch.where(b <= 0, tb - ta, 1.0 - ta - tb))
    return a, b, c, mass, pdf[..., :-1], pdf[..., 1:]


def _cell_sq(*cells: torch.Tensor) -> torch.Tensor:
    """int_a^b (c - u)^2 phi(u) du = (1 + c^2) P + 2 c (phi(b) - phi(a)) + a phi(a) - b phi(b).

    ``cells`` = (a, b, c, P, phi(a), phi(b)) as returned by :func:`_cells`.
    """
    a, b, c, mass, pa, pb = cells
    xa = torch.where(torch.isfinite(a), a * pa, torch.zeros_like(a))
    xb = torch.where(torch.isfinite(b), b * pb, torch.zeros_like(b))
    return (1 + c * c) * mass + 2 * c * (pb - pa) + xa - xb


def _chunk_rows(n: int, k: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, n * (k + 1)))


def levels_cost(
    mu: torch.Tensor, sigma: torch.Tensor, levels: torch.Tensor, omega: torch.Tensor | None = None
) -> torch.Tensor:
    """Posterior-expected cost of each weight under arbitrary sorted levels (nearest-level rounding).

    Args:
        mu, sigma: (R, n) float64 posterior means / standard deviations (sigma > 0).
        levels: (R, K) float64, ascending per row (ties allowed); cells are bounded by the
            midpoints and the two end cells take the clipping tails.
        omega: optional (R, n) float64 metric weight; default ``1 / sigma^2``.

    Returns:
        (R, n) float64 ``omega * E_{w ~ N(mu, sigma^2)}[(Q(w) - w)^2]``; by default the whitened
        ``sum_k int_{a_k}^{b_k} (c_k - u)^2 phi(u) du``, ``u = (w - mu) / sigma`` (:func:`_cell_sq`).
    """
    _check(mu, sigma, omega, levels)
    cost = _cell_sq(*_cells(mu, sigma, levels)).sum(-1)
    return cost if omega is None else omega * sigma * sigma * cost


def levels_cost_chunked(
    mu: torch.Tensor, sigma: torch.Tensor, levels: torch.Tensor, mask: torch.Tensor | None = None,
    omega: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked row sums (R,) of :func:`levels_cost`, in memory-bounded chunks of rows."""
    rows = _chunk_rows(mu.shape[1], levels.shape[1])
    out = torch.empty(mu.shape[0], dtype=mu.dtype, device=mu.device)
    for s in range(0, mu.shape[0], rows):
        e = slice(s, s + rows)
        cost = levels_cost(mu[e], sigma[e], levels[e], None if omega is None else omega[e])
        out[e] = (cost if mask is None else cost * mask[e]).sum(-1)
    return out


def lloyd_levels_step(
    mu: torch.Tensor, sigma: torch.Tensor, levels: torch.Tensor, mask: torch.Tensor,
    omega: torch.Tensor | None = None, limits: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One posterior-weighted Lloyd-Max iteration per row.

    Row objective ``J(c) = sum_i mask_i omega_i E_i[(Q_c(w) - w)^2]``, w_i ~ N(mu_i, sigma_i^2),
    omega default ``1/sigma^2``. For the cells R_k of ``c`` (midpoint thresholds) the minimiser is

        c_k' = sum_i omega_i E_i[w 1{w in R_k}] / sum_i omega_i P_i(R_k),
        E_i[w 1{w in R_k}] = mu_i P_i(R_k) + sigma_i (phi(a_ik) - phi(b_ik)),

    clamped into R_k (a no-op in exact arithmetic); cells without mass keep their level. Hence
    ``J(c') <= J(c)`` (centroids are optimal for fixed cells, midpoints for fixed levels).
    With ``limits`` = ((R,) lo, (R,) hi) the centroid is also clamped into [lo, hi]: J_k is a
    convex quadratic in c_k, so the clamp is the constrained minimiser and J still cannot
    increase (for input levels inside the limits).

    Returns:
        (new levels (R, K) float64 ascending, J(levels) (R,) float64 of the *input* levels).
    """
    _check(mu, sigma, omega, levels)
    new, obj = torch.empty_like(levels), torch.empty(mu.shape[0], dtype=mu.dtype, device=mu.device)
    rows = _chunk_rows(mu.shape[1], levels.shape[1])
    for s in range(0, mu.shape[0], rows):
        e = slice(s, s + rows)
        m, sd, lv = mu[e], sigma[e], levels[e]
        wt = mask[e] * (1.0 / (sd * sd) if omega is None else omega[e])  # (r, n)
        a, b, c, mass, pa, pb = _cells(m, sd, lv)
        obj[e] = ((wt * sd * sd)[..., None] * _cell_sq(a, b, c, mass, pa, pb)).sum((1, 2))
        m0 = (wt[..., None] * mass).sum(1)  # (r, K) weighted cell mass
        m1 = (wt[..., None] * (m[..., None] * mass + sd[..., None] * (pa - pb))).sum(1)
        cand = torch.where(m0 > 0, m1 / torch.where(m0 > 0, m0, torch.ones_like(m0)), lv)
        t = _bounds(lv)  # (r, K+1)
        new[e] = torch.minimum(torch.maximum(cand, t[:, :-1]), t[:, 1:])
        if limits is not None:
            new[e] = torch.minimum(torch.maximum(new[e], limits[0][e, None]), limits[1][e, None])
    return new, obj


def _gaussian_uniform_init(mu: torch.Tensor, sigma: torch.Tensor, wt: torch.Tensor, bits: int) -> torch.Tensor:
    """Optimal uniform N(0,1) grid moved and scaled to each row's weighted mixture mean and std."""
    sw = wt.sum(1, keepdim=True).clamp_min(1e-300)
    mean = (wt * mu).sum(1, keepdim=True) / sw  # (R, 1)
    std = ((wt * ((mu - mean) ** 2 + sigma * sigma)).sum(1, keepdim=True) / sw).sqrt()
    k, (alpha, _) = 2**bits, optimal_uniform_range(bits)
    return mean + std * (-alpha + (torch.arange(k, dtype=mu.dtype, device=mu.device) + 0.5) * (2 * alpha / k))


def _kmeanspp_init(mu: torch.Tensor, wt: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """k-means++ on the means per row (D^2 sampling weighted by ``wt``); (R, K) sorted."""
    gen = torch.Generator(device=mu.device).manual_seed(seed)
    fallback = torch.where(wt.sum(1, keepdim=True) > 0, wt, torch.ones_like(wt))
    centers = [mu.gather(1, torch.multinomial(fallback, 1, generator=gen))]  # (R, 1) each
    d2 = (mu - centers[0]) ** 2
    for _ in range(1, k):
        p = wt * d2
        p = torch.where(p.sum(1, keepdim=True) > 0, p, fallback)
        centers.append(mu.gather(1, torch.multinomial(p, 1, generator=gen)))
        d2 = torch.minimum(d2, (mu - centers[-1]) ** 2)
    return torch.cat(centers, 1).sort(1).values


def fit_lloyd_levels(
    mu: torch.Tensor, sigma: torch.Tensor, mask: torch.Tensor, bits: int, *,
    omega: torch.Tensor | None = None, iters: int = 15, rtol: float = 1e-4, lut_bits: int = 16,
    init: str = "uniform", seed: int = 0, within_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior-weighted Lloyd-Max levels, one LUT of K = 2**bits entries per row.

    Iterates :func:`lloyd_levels_step` at most ``iters`` times; a row stops once its objective
    falls by less than ``rtol`` (relative). ``init="uniform"``: the optimal uniform grid of the
    moment-matched Gaussian (start of :func:`lloyd_max_gaussian`); ``"kmeans++"``: seeded
    k-means++ on the means. Levels are rounded to the LUT format (``lut_bits`` 16 / 32 / 64 =
    fp16 / fp32 / unrounded); a row whose rounded result is worse than its rounded start keeps
    the start. ``within_range``: every level stays inside the row's [min, max] of real means
    (projected Lloyd, see :func:`lloyd_levels_step`): a level beyond them serves only posterior
    draws of weights whose variance is wide, never a stored weight.

    Args:
        mu, sigma, mask: (R, n) float64; mask 1 for real weights, 0 for padding.
        omega: optional (R, n) metric weights (default ``1/sigma^2``: whitened cost).

    Returns:
        (levels (R, K) float64 ascending as stored, cost (R,) = masked row sums of
        :func:`levels_cost` for those levels).
    """
    _check(mu, sigma, omega, None)
    if mask.shape != mu.shape or bits < 1 or iters < 0 or rtol < 0:
        raise ValueError(f"need a (R, n) mask like mu, bits >= 1, iters >= 0, rtol >= 0; got "
                         f"{tuple(mask.shape)}, {bits}, {iters}, {rtol}")
    wt = mask * (1.0 / (sigma * sigma) if omega is None else omega)
    if init not in ("uniform", "kmeans++"):
        raise ValueError(f"init must be 'uniform' or 'kmeans++', got {init!r}")
    start = _gaussian_uniform_init(mu, sigma, wt, bits) if init == "uniform" else _kmeanspp_init(mu, wt, 2**bits, seed)
    limits = None
    if within_range:
        big = torch.finfo(mu.dtype).max
        limits = (torch.where(mask > 0, mu, big).min(1).values, torch.where(mask > 0, mu, -big).max(1).values)
        limits = (torch.minimum(limits[0], limits[1]), torch.maximum(limits[0], limits[1]))  # empty rows: any
        start = torch.minimum(torch.maximum(start, limits[0][:, None]), limits[1][:, None])
    levels, prev = start, None
    active = torch.ones(mu.shape[0], dtype=torch.bool, device=mu.device)
    for _ in range(iters):
        new, obj = lloyd_levels_step(mu, sigma, levels, mask, omega, limits)
        if prev is not None:
            active &= (prev - obj) > rtol * prev.abs()
        if not bool(active.any()):
            break
        levels, prev = torch.where(active[:, None], new, levels), obj
    levels, start = _round_stored(levels, lut_bits, "LUT levels"), _round_stored(start, lut_bits, "LUT levels")
    cost, cost0 = (levels_cost_chunked(mu, sigma, x, mask, omega) for x in (levels, start))
    keep = cost0 < cost
    return torch.where(keep[:, None], start, levels), torch.where(keep, cost0, cost)


def quantize_levels(w: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Codes (R, n) int64 of ``w`` (R, n): nearest of each row's sorted ``levels`` (R, K).

    Cell k is ``(t_k, t_{k+1}]`` with midpoint thresholds t (a tie goes to the lower level).
    """
    _check_levels(w, levels)
    t = ((levels[:, 1:] + levels[:, :-1]) / 2).contiguous()  # (R, K-1) thresholds
    return torch.searchsorted(t, w.contiguous()).to(torch.int64)


def dequantize_levels(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Weights (R, n) float64: ``levels[r, codes[r, i]]``."""
    return levels.gather(1, codes)


def mulaw_levels(absmax: torch.Tensor, bits: int, mu: float = 4.0, scale_bits: int = 16) -> torch.Tensor:
    """Fixed symmetric mu-law codebook per row: one stored scale, no zero-point.

    ``level_k = A sign(u_k) ((1 + mu)^|u_k| - 1) / mu`` at mid-rise ``u_k = -1 + (k + 1/2) 2 / K``,
    ``A`` = ``absmax`` (R,) rounded to the scale format; ``mu = 0`` is the uniform limit
    ``A u_k``. The table depends only on (bits, mu). Default ``mu = 4``: ``docs/method.md``.
    Returns (R, 2**bits) float64 ascending levels.
    """
    if absmax.ndim != 1 or bool((absmax < 0).any()):
        raise ValueError(f"absmax must be a non-negative (R,) tensor, got shape {tuple(absmax.shape)}")
    if bits < 1 or not mu >= 0:
        raise ValueError(f"need bits >= 1 and mu >= 0 (mu = 0 is uniform), got bits={bits}, mu={mu}")
    k = 2**bits
    u = -1 + (torch.arange(k, dtype=torch.float64, device=absmax.device) + 0.5) * (2.0 / k)  # (K,)
    table = u if mu == 0 else torch.sign(u) * torch.expm1(u.abs() * math.log1p(mu)) / mu
    return _round_stored(absmax, scale_bits, "mu-law scale")[:, None] * table


def weighted_line_fit(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row weighted least squares ``y ~ slope x + intercept`` over (R, n) tensors.

    ``slope = cov_w(x, y) / var_w(x)``, ``intercept = mean_w(y) - slope mean_w(x)``; a row with
    constant x gets slope 0, a row of zero weight (0, 0). Returns two (R,) float64 tensors.
    """
    sw = weight.sum(1)
    xm, ym = ((weight * v).sum(1) / sw.clamp_min(1e-300) for v in (x, y))  # (R,) weighted means
    sxx = (weight * (x - xm[:, None]) ** 2).sum(1)
    sxy = (weight * (x - xm[:, None]) * (y - ym[:, None])).sum(1)
    slope = torch.where(sxx > 0, sxy / sxx.clamp_min(1e-300), torch.zeros_like(sxx))
    return slope, ym - slope * xm


def compile_to_uniform(
    codes: torch.Tensor, w: torch.Tensor, bits: int, *, omega: torch.Tensor | None = None,
    mask: torch.Tensor | None = None, scale_bits: int = 16,
) -> UniformGrids:
    """Per-row uniform grid ``scale * (code - zero)`` fitted to a given code assignment.

    Minimises ``E(s, z) = sum_i m_i omega_i (s (code_i - z) - w_i)^2`` (omega default 1) over
    integer z in [0, 2**bits - 1] and stored scales s >= 0: for each z the refit
    ``s_z = max(0, sum m omega (code - z) w / sum m omega (code - z)^2)`` is rounded to the
    nearest stored value (optimal: E is a quadratic in s) and the z of least E wins. The
    candidates include the rounded zero of :func:`weighted_line_fit`, so the result is never
    worse than any integer-zero, stored-scale grid (min/max included) on this assignment.

    Args:
        codes: (R, n) int64 in [0, 2**bits - 1]; w: (R, n) float64 target weights.

    Returns:
        :class:`UniformGrids` with (R,) scale and zero.
    """
    k = 2**bits
    if codes.shape != w.shape or codes.ndim != 2:
        raise ValueError(f"codes and w must both be (R, n), got {tuple(codes.shape)} and {tuple(w.shape)}")
    if bool((codes < 0).any()) or bool((codes >= k).any()):
        raise ValueError(f"codes must lie in [0, {k - 1}] for bits={bits}")
    wt = (torch.ones_like(w) if omega is None else omega) * (1.0 if mask is None else mask)
    if wt.shape != w.shape or bool((wt < 0).any()):
        raise ValueError("omega and mask must be non-negative (R, n) tensors like w")
    hist = torch.zeros(w.shape[0], k, dtype=w.dtype, device=w.device)  # (R, K) per-code sums
    h = hist.scatter_add(1, codes, wt)
    g = hist.scatter_add(1, codes, wt * w)  # (R, K): sum of m omega w per code
    kz = torch.arange(k, dtype=w.dtype, device=w.device)
    diff = kz[:, None] - kz[None, :]  # (K code, K zero): code - z, exact integers
    num, den = g @ diff, h @ (diff * diff)  # (R, K): sum m omega (c - z) w, sum m omega (c - z)^2
    s = _round_stored(torch.where(den > 0, num / den.clamp_min(1e-300), 0.0).clamp_min(0), scale_bits, "scale")
    sww = (wt * w * w).sum(1)  # (R,)
    err = sww[:, None] - 2 * s * num + s * s * den  # (R, K) weighted squared error
    best = err.argmin(1, keepdim=True)  # (R, 1)
    return UniformGrids(bits=bits, scale=s.gather(1, best)[:, 0], zero=kz[best[:, 0]])
