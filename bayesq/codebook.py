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
against numerical integration.  The boundary sums cost O(K) per weight; where the posterior is
much wider than the step (``d <= SMOOTH_MAX_STEP``, e.g. prior-dominated weights at 8 bits) they
are midpoint sums of smooth functions and :func:`grid_cost_fast` takes them by the Euler-Maclaurin
formula, O(1) per weight, with an omitted O(d^6) term below float64 rounding.

Non-uniform codebooks (one sorted LUT of levels per row): :func:`levels_cost` is the same
expected cost for arbitrary levels, from per-cell integrals; :func:`fit_lloyd_levels` is the
posterior-weighted Lloyd-Max; :func:`mulaw_levels` a fixed mu-law control; and
:func:`compile_to_uniform` refits a uniform grid to a given code assignment.  Checked by
``tests/test_codebook_lut.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, ClassVar, Mapping, Sequence

import torch
from scipy.optimize import minimize_scalar

from bayesq.books import CodeBook, Field, Need, Slot, register_book, stored_float
from bayesq.storage import lut_unit_cost_bits, mulaw_unit_cost_bits, unit_cost_bits
from bayesq.targets import ONNXRUNTIME, matmulnbits_unit_cost_bits

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_BATCH_ELEMENTS = 2**18  # weights scored per call when search_range scores several ratios at once
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
    (``tests/test_codebook.py`` compares with :func:`grid_cost`).
    """
    lo, step = lo[:, None], step[:, None]
    safe = torch.where(step > 0, step, torch.ones_like(step))
    k_star = torch.where(step > 0, torch.round((mu - lo) / safe), torch.zeros_like(mu)).clamp(0, levels - 1)
    c = (lo + k_star * step - mu) / sigma
    d = step / sigma
    d2 = d * d
    e2, e4 = d2 / 24, 7 * d2 * d2 / 5760  # the Euler-Maclaurin coefficients
    top, bottom = c + (levels - 1 - k_star) * d, c - k_star * d  # (hi - mu) / sigma, (lo - mu) / sigma
    p_c, p_top, p_bottom = _pdf(c), _pdf(top), _pdf(bottom)
    q_top, q_bottom = _upper_tail(top), _upper_tail(bottom)
    s_up_b, t_up_b = _smooth_terms(top, q_top, p_top, c, e2, e4)
    s_low_b, t_low_b = _smooth_terms(-bottom, _upper_tail(-bottom), p_bottom, -c, e2, e4)
    s_up_a, t_up_a = _start_terms(c, _upper_tail(c), p_c, e2, e4)
    s_low_a, t_low_a = _start_terms(-c, _upper_tail(-c), p_c, e2, e4)
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
    rows = max(1, _CHUNK_ELEMENTS // max(1, mu.shape[1] * max(1, levels - 1)))
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


@register_book
@dataclass(frozen=True)
class UniformGrids(CodeBook):
    """One asymmetric uniform grid per group: ``level_k = scale * (k - zero)``, k = 0..2**bits-1.

    Attributes:
        bits: bit-width of every code.
        scale: (G,) float64, already rounded to the stored scale precision.
        zero: (G,) float64 integer-valued zero-points in [0, 2**bits - 1].

    Stored (kind ``grid``): one scale (``scale_bits``) and one ``bits``-bit zero-point per group.
    """

    kind: ClassVar[str] = "grid"
    bits: int
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def levels(self) -> int:
        return 2**self.bits

    @property
    def lo(self) -> torch.Tensor:
        return -self.scale * self.zero

    def take(self, rows: torch.Tensor) -> "UniformGrids":
        """The grids of the selected groups (index or boolean mask)."""
        return UniformGrids(self.bits, self.scale[rows], self.zero[rows])

    def quantize(self, w: torch.Tensor) -> torch.Tensor:
        """(G, n) int64 codes of (G, n) ``w`` by nearest-level rounding (:func:`quantize`)."""
        return quantize(w, self)

    def dequantize(self, codes: torch.Tensor) -> torch.Tensor:
        """(G, n) float64 ``scale * (code - zero)``."""
        return dequantize(codes, self)

    @classmethod
    def unit_cost_bits(cls, n_weights: int, n_groups: int, bits: int, n_choices: int, quant,
                       rows: int = 1) -> int:
        """What the target's file stores for one unit (:mod:`bayesq.targets`): BayesQ's format
        (:func:`bayesq.storage.unit_cost_bits`), or ONNX Runtime's for one row or ``rows`` rows."""
        if getattr(quant, "target", "bayesq") == ONNXRUNTIME.name:
            return matmulnbits_unit_cost_bits(n_groups, bits, quant.group_size, n_choices, quant.scale_bits, rows)
        return unit_cost_bits(n_weights, n_groups, bits, n_choices, quant.scale_bits)

    def export_fields(self, sel: torch.Tensor, blocks, quant) -> list[Field]:
        widths = torch.full((sel.numel(),), self.bits, dtype=torch.int64)
        return [Field("scale", sel, self.scale, bits=quant.scale_bits),
                Field("zero", sel, self.zero.to(torch.int64), widths=widths)]

    @classmethod
    def export_slots(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping) -> list[Slot]:
        return [Slot("scale", sel), Slot("zero", sel, widths=torch.full((sel.numel(),), bits, dtype=torch.int64))]

    @classmethod
    def from_export(cls, bits: int, sel: torch.Tensor, blocks, layout: Mapping,
                    fields: Mapping[str, torch.Tensor], need: Need) -> "UniformGrids":
        return cls(bits, fields["scale"][:, 0], fields["zero"][:, 0].double())

    def affine_fields(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.scale, self.zero

    def with_affine(self, scale: torch.Tensor, zero: torch.Tensor) -> "UniformGrids":
        return UniformGrids(self.bits, scale, zero)

    def group_levels(self) -> torch.Tensor:
        codes = torch.arange(2**self.bits, dtype=torch.float64, device=self.scale.device)
        return self.scale[:, None] * (codes[None, :] - self.zero[:, None])

    def trainable(self) -> dict[str, torch.Tensor]:
        return {"scale": self.scale, "zero": self.zero}

    def decode_trained(self, params: Mapping[str, torch.Tensor], codes: torch.Tensor) -> torch.Tensor:
        """``scale * (code - zero)`` with the zero-point rounded straight-through."""
        z = params["zero"]
        z = z + (torch.round(z).clamp(0, 2**self.bits - 1) - z).detach()  # straight-through rounding
        return params["scale"][:, None] * (codes.float() - z[:, None])

    def from_trained(self, params: Mapping[str, torch.Tensor], codes: torch.Tensor, scale_bits: int,
                     lut_bits: int) -> tuple["UniformGrids", torch.Tensor]:
        scale = stored_float(params["scale"], scale_bits).clamp(min=0)
        zero = torch.round(params["zero"]).clamp(0, 2**self.bits - 1)
        return UniformGrids(self.bits, scale, zero), codes


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


def search_range(
    wmin: torch.Tensor, wmax: torch.Tensor, bits: int, cost: Callable[[UniformGrids], torch.Tensor], *,
    iters: int = 20, min_ratio: float = 0.2, scale_bits: int = 16, grid: int = 0, elements: int = 0,
) -> tuple[UniformGrids, torch.Tensor]:
    """Per-row clipping ratio ``rho`` in [min_ratio, 1] of the range ``rho * [min, max]``.

    ``cost(grids) -> (G,)`` scores the grids of every row. ``rho = 1`` (plain min/max) is always
    a candidate, so the result is never worse than RTN's range under ``cost``. With ``grid > 0``
    the ratios ``linspace(min_ratio, 1, grid)`` are scored first and the golden-section search
    (``iters - 2`` steps) runs inside one grid step of the best of them; with ``grid = 0`` it
    runs on the whole of [min_ratio, 1]. ``elements > 0`` (weights per row) says that ``cost``
    also scores grids with a leading ratio dimension ((R, G) scales -> (R, G) costs, as
    :func:`grid_sq_error`): the grid's ratios are then scored together, with the same result.

    Args:
        wmin, wmax: (G,) float64 smallest / largest real weight of each row.

    Returns:
        (grids, cost): the chosen grids and their (G,) float64 cost.
    """
    def paired(g: UniformGrids) -> torch.Tensor:  # (1, G) grids: this search's points
        return cost(g.take(0))[None]

    grids, costs = search_ranges(wmin, wmax, bits, lambda g: cost(g)[None], paired, iters=iters, min_ratio=min_ratio,
                                 scale_bits=scale_bits, grid=grid, elements=elements)
    return grids.take(0), costs[0]


def search_ranges(
    wmin: torch.Tensor, wmax: torch.Tensor, bits: int, scan: Callable[[UniformGrids], torch.Tensor],
    paired: Callable[[UniformGrids], torch.Tensor], *, iters: int = 20, min_ratio: float = 0.2,
    scale_bits: int = 16, grid: int = 0, elements: int = 0,
) -> tuple[UniformGrids, torch.Tensor]:
    """:func:`search_range` of the same rows under ``k`` costs at once, each search with the
    result it has alone. ``scan(grids)`` scores grids that every search scores (``rho = 1``, the
    ratio grid; scales (..., G)) under all k costs: (k, ..., G), e.g. :func:`grid_sq_errors` (the
    rounding errors computed once, weighted once per cost). ``paired(grids)`` scores (k, G)
    grids, row i of them under cost i: (k, G); the golden sections, where the searches go their
    own ways, run as one on (k, G) ratios. Other arguments as :func:`search_range`.

    Returns:
        (grids with (k, G) scales and zero-points, (k, G) float64 costs).
    """
    def grids_at(rho: torch.Tensor) -> UniformGrids:
        return grids_from_range(rho * wmin, rho * wmax, bits, scale_bits)

    one = torch.ones_like(wmin)
    f1 = scan(grids_at(one))  # (k, G)
    best = _Best(torch.ones_like(f1), f1)
    if min_ratio >= 1:  # min/max is the only range: nothing to search
        return grids_at(best.rho), best.cost
    lo, hi = torch.full_like(best.rho, min_ratio), best.rho.clone()
    if grid > 1:
        ratios = torch.linspace(min_ratio, 1.0, grid, dtype=wmin.dtype, device=wmin.device)[:-1]
        if elements > 0:  # every ratio at once, in chunks of at most _BATCH_ELEMENTS weights
            per = max(1, _BATCH_ELEMENTS // max(1, wmin.numel() * elements))
            for part in ratios.split(per):
                rho = part[:, None].expand(-1, wmin.shape[0])
                f = scan(grids_at(rho))  # (k, R, G)
                for i in range(len(part)):  # in order: ties keep the earlier ratio, as one at a time
                    best.consider(rho[i], f[:, i])
        else:
            for r in ratios.tolist():
                rho = torch.full_like(wmin, r)
                best.consider(rho, scan(grids_at(rho)))
        step = (1.0 - min_ratio) / (grid - 1)
        lo, hi = (best.rho - step).clamp_min(min_ratio), (best.rho + step).clamp_max(1.0)
    _golden(best, lambda rho: paired(grids_at(rho)), lo, hi, iters)
    return grids_at(best.rho), best.cost


class _Best:
    """The least cost per row seen so far and its ratio (ties keep the earlier)."""

    def __init__(self, rho: torch.Tensor, cost: torch.Tensor) -> None:
        self.rho, self.cost = rho, cost

    def consider(self, rho: torch.Tensor, f: torch.Tensor) -> None:
        better = f < self.cost
        self.cost, self.rho = torch.where(better, f, self.cost), torch.where(better, rho, self.rho)


def _golden(best: _Best, cost_at: Callable[[torch.Tensor], torch.Tensor], a: torch.Tensor, b: torch.Tensor,
            iters: int) -> None:
    """Golden-section search per row on [a, b] (``iters - 2`` steps after the first two points),
    every point scored offered to ``best``."""
    c = b - _GOLDEN * (b - a)
    d = a + _GOLDEN * (b - a)
    fc, fd = cost_at(c), cost_at(d)
    best.consider(c, fc)
    best.consider(d, fd)
    for _ in range(max(0, iters - 2)):
        left = fc < fd  # minimum in [a, d]
        b = torch.where(left, d, b)
        a = torch.where(left, a, c)
        new = torch.where(left, b - _GOLDEN * (b - a), a + _GOLDEN * (b - a))
        fnew = cost_at(new)
        c, fc, d, fd = (  # left: (new, c) become (c, d); right: (d, new) become (c, d)
            torch.where(left, new, d), torch.where(left, fnew, fd),
            torch.where(left, c, new), torch.where(left, fc, fnew),
        )
        best.consider(new, fnew)


def fit_uniform_grids(
    mu: torch.Tensor, sigma: torch.Tensor, mask: torch.Tensor, bits: int, *,
    iters: int = 20, min_ratio: float = 0.2, scale_bits: int = 16,
) -> tuple[UniformGrids, torch.Tensor]:
    """Per-group clipping range minimising the posterior-expected whitened distortion of draws.

    The ``draws`` objective (kept as an ablation): the range is ``rho * [min, max]`` of the
    group's means, ``rho`` from :func:`search_range` (golden section on [min_ratio, 1]) on
    :func:`grid_cost_chunked`.

    Args:
        mu, sigma: (G, n) float64 posterior means / standard deviations of each group.
        mask: (G, n) float64, 1 for real weights, 0 for padding (padding must repeat a real
            value of its group so that min/max are unaffected).
        bits: bit-width.

    Returns:
        (grids, cost): the chosen grids and their (G,) float64 summed expected whitened cost.
    """
    levels = 2**bits
    return search_range(
        mu.min(1).values, mu.max(1).values, bits,
        lambda g: grid_cost_chunked(mu, sigma, g.lo, g.scale, levels, mask),
        iters=iters, min_ratio=min_ratio, scale_bits=scale_bits,
    )


# ---- The deployed objective: weighted squared error of the stored weights ---------------------

def grid_sq_error(w: torch.Tensor, weight: torch.Tensor, grids: UniformGrids) -> torch.Tensor:
    """(..., G) float64 ``sum_i weight_i (Q(w_i) - w_i)^2`` of (G, n) ``w`` under its rows' grids.

    The grids' ``scale`` / ``zero`` may carry leading dimensions (..., G): several candidate
    grids per row scored at once (:func:`search_range`'s ratio grid). The same values as
    ``dequantize(quantize(w))`` (the codes stay integers in float64; a zero scale decodes to 0),
    without the integer round trip. Rows are scored in chunks of about ``_BATCH_ELEMENTS``
    temporaries (cache-sized: about 2x faster than whole large layers; each row's sum is the same).
    """
    return grid_sq_errors(w, (weight,), grids)[0]


def grid_sq_errors(w: torch.Tensor, weights: Sequence[torch.Tensor], grids: UniformGrids, *,
                   paired: bool = False) -> torch.Tensor:
    """(k, ..., G) :func:`grid_sq_error` under each of the k ``weights`` ((G, n) each): the squared
    rounding errors are computed once and weighted once per weight (the same values as one call
    each). ``paired``: the grids' scales are (k, G), and weight i scores row i of them: (k, G)."""
    lead = math.prod(grids.scale.shape[:-1])
    rows = max(1, _BATCH_ELEMENTS // max(1, lead * w.shape[-1]))
    if rows >= w.shape[0]:
        return _sq_errors(w, weights, grids.scale, grids.zero, grids.levels, paired)
    out = torch.empty(len(weights), *grids.scale.shape[paired:], dtype=torch.float64, device=w.device)
    for i in range(0, w.shape[0], rows):
        part = slice(i, i + rows)
        out[..., part] = _sq_errors(w[part], [x[part] for x in weights], grids.scale[..., part],
                                    grids.zero[..., part], grids.levels, paired)
    return out


def _sq_errors(w: torch.Tensor, weights: Sequence[torch.Tensor], scale: torch.Tensor, zero: torch.Tensor,
               levels: int, paired: bool) -> torch.Tensor:
    """:func:`grid_sq_errors` of rows ``w`` under (..., G) ``scale`` / ``zero``, in one temporary
    (one more per weight but the last, unless ``paired``)."""
    s, z = scale[..., None], zero[..., None]
    q = torch.div(w, rounding_divisor(s))  # one temporary, then in place: the cost of the range search
    q.round_().add_(z).clamp_(0, levels - 1)
    err = q.sub_(z).mul_(s).sub_(w).square_()
    if paired:  # (k, G, n): row i under weight i
        for e, x in zip(err, weights):
            e.mul_(x)
        return err.sum(-1)
    last = len(weights) - 1
    return torch.stack([(err.mul_(x) if i == last else err * x).sum(-1) for i, x in enumerate(weights)])


def levels_sq_error(w: torch.Tensor, weight: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """(R,) float64 ``sum_i weight_i (Q(w_i) - w_i)^2`` under each row's sorted ``levels`` (R, K)."""
    return ((dequantize_levels(quantize_levels(w, levels), levels) - w).pow(2) * weight).sum(1)


def fit_uniform_grids_deployed(
    w: torch.Tensor, weight: torch.Tensor, bits: int, *, iters: int = 12, min_ratio: float = 0.2,
    scale_bits: int = 16, grid: int = 20,
) -> tuple[UniformGrids, torch.Tensor]:
    """Per-group range minimising the weighted squared error of the deployed weights.

    ``J(rho) = sum_i weight_i (Q_rho(w_i) - w_i)^2`` with ``Q_rho`` the grid over
    ``rho * [min, max]`` of the group's weights (:func:`search_range`: a ``grid`` of ratios, then
    golden section). ``weight`` is the metric (data curvature, + prior precision) times the
    padding mask.

    Args:
        w: (G, n) float64 trained weights (padding repeats a real weight of its group).
        weight: (G, n) float64 >= 0.

    Returns:
        (grids, (G,) float64 cost ``J``).
    """
    grids, cost = fit_uniform_grids_deployed_many(w, (weight,), bits, iters=iters, min_ratio=min_ratio,
                                                  scale_bits=scale_bits, grid=grid)
    return grids.take(0), cost[0]


def fit_uniform_grids_deployed_many(
    w: torch.Tensor, weights: Sequence[torch.Tensor], bits: int, *, iters: int = 12, min_ratio: float = 0.2,
    scale_bits: int = 16, grid: int = 20,
) -> tuple[UniformGrids, torch.Tensor]:
    """:func:`fit_uniform_grids_deployed` of the same weights under each of the k ``weights``
    (metrics) at once (:func:`search_ranges`: the ratio grid's rounding errors computed once for
    all, the golden sections run as one): the results of one call each, in less time.

    Returns:
        (grids with (k, G) scales and zero-points, (k, G) float64 costs).
    """
    return search_ranges(w.min(1).values, w.max(1).values, bits, lambda g: grid_sq_errors(w, weights, g),
                         lambda g: grid_sq_errors(w, weights, g, paired=True), iters=iters,
                         min_ratio=min_ratio, scale_bits=scale_bits, grid=grid, elements=w.shape[1])


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


def rounding_divisor(scale: torch.Tensor) -> torch.Tensor:
    """What a weight is divided by before rounding to an affine grid: the scale, and infinity
    where the scale is 0. The one rounding rule of every affine grid in the library
    (:func:`quantize`, :func:`grid_sq_error`, error-feedback rounding):
    ``code = clamp(round(w / divisor) + zero, 0, maxq)``, so a zero-scale group (all its weights
    equal, e.g. pruned to 0) gets its zero-point code and decodes to 0."""
    return torch.where(scale > 0, scale, torch.full_like(scale, math.inf))


def quantize(w: torch.Tensor, grids: UniformGrids) -> torch.Tensor:
    """Integer codes (G, n) int64 of ``w`` (G, n) by nearest-level rounding, clamped to range
    (:func:`rounding_divisor`)."""
    codes = torch.round(w / rounding_divisor(grids.scale[:, None])) + grids.zero[:, None]
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


# ---- Non-uniform codebooks: one sorted look-up table (LUT) of K levels per row ---------------

_FP16_MAX = 65504.0


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
    tail, pdf = _upper_tail(z.abs()), _pdf(z)
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
    return max(1, _CHUNK_ELEMENTS // max(1, n * (k + 1)))


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
