"""Uniform grids (one fp16 scale and zero-point per group) whose clipping range minimises the
posterior-expected whitened distortion of :func:`bayesq.grid_cost.grid_cost`.

:class:`UniformGrids` is the codebook; :func:`search_range` / :func:`search_ranges` find each
group's clipping ratio (golden section on the closed-form cost), :func:`fit_uniform_grids` and
its ``_deployed`` variants fit the grids a table scores; :func:`quantize` / :func:`dequantize`
round to and from the codes. The non-uniform codebooks are in :mod:`bayesq.levels`. Checked by
``tests/test_grids.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, Sequence

import torch

from bayesq.books import CodeBook, Field, Need, Slot, register_book, stored_float
from bayesq.grid_cost import grid_cost_chunked
from bayesq.storage import unit_cost_bits
from bayesq.targets import ONNXRUNTIME, matmulnbits_unit_cost_bits

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_BATCH_ELEMENTS = 2**18  # weights scored per call when search_range scores several ratios at once


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
