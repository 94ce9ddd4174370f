"""Per-unit expected-loss tables over candidate bit-widths: closed form, with Monte Carlo proxies.

For each allocation unit u and bit-width b the table holds

    L_u(b) = 0.5 * sum_{i in u} omega_i E_{w_i ~ N(mu_i, sigma_i^2)}[(Q_b(w_i) - w_i)^2],

the posterior-expected increase of the task loss when ``omega_i = 1 / sigma_i^2`` (posterior
whitening, the method), plain squared error for ``omega = 1`` (identity) and the diagonal of the
layer-output error for ``omega_oi = A_ii`` (data-only "PCA" metric, A the layer inputs' second
moment). ``Q_b`` is the unit's codebook at b bits, fitted to minimise that same quantity:

* ``uniform``: per-group grids, clipping range searched (``codebook.fit_uniform_grids``);
* ``uniform-fixed``: per-group grids over ``mean +- alpha*(b) (1 - 1/K) std`` of the group's
  weights (the N(0, 1)-optimal range, no search), clamped to [min, max];
* ``lloyd``: one posterior-weighted Lloyd-Max LUT per allocation unit (``fit_lloyd_levels``);
* ``lloyd-uniform``: that LUT's assignment compiled to a uniform grid per group
  (``compile_to_uniform``), for backends without LUTs;
* ``mulaw``: the fixed mu-law table scaled by each group's absmax;
* ``vq``: one weighted k-means codebook of ``K = 2**(b * vq_dim)`` vectors per layer (tensor
  units; ``bayesq/vq.py``), entry ``0.5 (D(C, a) + sum omega sigma^2)`` for the assignment made
  on the means (what is stored); candidates with K > 4096 use searched uniform grids.

Candidates with more than 16 levels (8 bits) always use min/max uniform grids (the optimal
clipping of a 256-level grid lies beyond a group's extremes). C_u(b) is the candidate's exact
storage (``storage.py``). Closed-form entries have standard error 0; the Monte Carlo proxies
(:func:`apply_mc_proxy`) replace the entries of the most sensitive layers by a rescaled
estimate and store its standard error. ``docs/method.md`` sections 3-5 and 10.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from bayesq.blocks import LayerBlocks
from bayesq.books import FITS, CodeBook, book_class, register_fit
from bayesq.config import Codebook, CostTerms, Objective, QuantConfig, Whitening
from bayesq.grid_cost import grid_cost_chunked, optimal_uniform_range
from bayesq.grids import (
    UniformGrids, fit_uniform_grids, fit_uniform_grids_deployed, fit_uniform_grids_deployed_many, grid_sq_error,
    grids_from_range, minmax_grids,
)
from bayesq.levels import (
    LevelTables, MulawTables, compile_to_uniform, fit_lloyd_levels, fit_weighted_levels, levels_cost_chunked,
    levels_sq_error, mulaw_levels,
)
from bayesq.memory import release_freed
from bayesq.posterior import Posterior
from bayesq.vq import MAX_CODEBOOK, VQBook, fit_vq, vq_assign

SEARCH_MAX_LEVELS = 16
Book = CodeBook  # any registered codebook kind (bayesq.books)


@dataclass(frozen=True)
class LayerTable:
    """Candidates of one layer.

    Attributes:
        blocks: group / unit layout.
        bits: candidate bit-widths (ascending).
        unit_loss: (U, nb) float64 expected loss of each unit at each candidate.
        unit_cost: (U, nb) int64 exact storage bits.
        books: one codebook per candidate, covering every group of the layer.
        unit_se: (U, nb) float64 standard error of ``unit_loss`` (0 for closed-form entries).
    """

    blocks: LayerBlocks
    bits: tuple[int, ...]
    unit_loss: torch.Tensor
    unit_cost: torch.Tensor
    books: tuple[Book, ...]
    unit_se: torch.Tensor

    @property
    def grids(self) -> tuple[Book, ...]:  # the name the RTN tables and older callers use
        return self.books


@dataclass(frozen=True)
class LossTable:
    """All layers' candidates, in network order."""

    layers: tuple[LayerTable, ...]

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(losses (n_units, nb) float64, costs (n_units, nb) int64) over all layers' units."""
        return (torch.cat([t.unit_loss for t in self.layers]), torch.cat([t.unit_cost for t in self.layers]))

    def flat(self) -> tuple[list[list[float]], list[list[int]]]:
        """(losses, costs) as nested lists, one row per unit over all layers."""
        losses, costs = self.arrays()
        return losses.tolist(), costs.tolist()

    @property
    def n_weights(self) -> int:
        return sum(t.blocks.numel for t in self.layers)

    def layer(self, name: str) -> LayerTable:
        for t in self.layers:
            if t.blocks.name == name:
                return t
        raise KeyError(name)

    def records(self) -> list[dict]:
        """One row per (layer, unit, bits) for a Parquet table, with the entry's standard error."""
        rows = []
        for t in self.layers:
            for u, (loss, cost, se) in enumerate(zip(t.unit_loss.tolist(), t.unit_cost.tolist(), t.unit_se.tolist())):
                for b, l_, c, e in zip(t.bits, loss, cost, se):
                    rows.append({"layer": t.blocks.name, "unit": u, "bits": b, "loss": l_, "cost_bits": c, "se": e})
        return rows


def _unit_sum(blocks: LayerBlocks, group_values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(blocks.n_units, dtype=torch.float64, device=group_values.device)
    return out.index_add_(0, blocks.group_unit(group_values.device), group_values)


def _unit_rows(blocks: LayerBlocks, x: torch.Tensor) -> torch.Tensor:
    """(G, g) group rows -> (U, unit_groups * g) unit rows; a short last unit is padded with
    copies of the last group (callers zero the padding through :func:`_unit_mask`)."""
    pad = blocks.n_units * blocks.unit_groups - x.shape[0]
    if pad:
        x = torch.cat([x, x[-1:].expand(pad, -1)])
    return x.reshape(blocks.n_units, -1)  # (U, unit_groups * g)


def _unit_mask(blocks: LayerBlocks, mask: torch.Tensor) -> torch.Tensor:
    u, k = blocks.n_units, blocks.unit_groups
    pad = u * k - mask.shape[0]
    return torch.cat([mask, mask.new_zeros(pad, mask.shape[1])]).reshape(u, -1) if pad else mask.reshape(u, -1)


def _costs(blocks: LayerBlocks, cfg: QuantConfig, kinds: Sequence[str], device: torch.device) -> torch.Tensor:
    """(U, nb) int64 exact bits of each unit under each candidate's codebook kind
    (:meth:`bayesq.books.CodeBook.unit_cost_bits` of the kind's registered class), on ``device``
    (the unit losses')."""
    nb = len(cfg.bits)
    classes = [book_class(k) for k in kinds]
    span = {"rows": blocks.unit_rows} if blocks.unit_rows > 1 else {}  # a whole layer of a row-blocked target
    rows = [[c.unit_cost_bits(n, g, b, nb, cfg, **span) for b, c in zip(cfg.bits, classes)]
            for n, g in blocks.unit_sizes()]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _fixed_range_grids(mu: torch.Tensor, mask: torch.Tensor, bits: int, scale_bits: int) -> UniformGrids:
    """Per-group grid over ``mean +- alpha*(1 - 1/K) std`` of the real weights, inside [min, max]."""
    k = 2**bits
    alpha, _ = optimal_uniform_range(bits)
    n = mask.sum(1).clamp_min(1)
    mean = (mu * mask).sum(1) / n
    std = (((mu - mean[:, None]) ** 2 * mask).sum(1) / n).sqrt()
    half = alpha * (1 - 1 / k) * std
    lo = torch.maximum(mean - half, mu.min(1).values)
    hi = torch.minimum(mean + half, mu.max(1).values)
    return grids_from_range(lo, hi, bits, scale_bits)


class _LayerFit:
    """Codebook fits of one layer under the ``draws`` objective (an ablation): group rows of mu,
    sigma, mask and the metric weights; every cost is the expected distortion of posterior draws."""

    def __init__(self, blocks: LayerBlocks, mu: torch.Tensor, sigma: torch.Tensor,
                 omega: torch.Tensor | None, cfg: QuantConfig):
        self.blocks, self.cfg = blocks, cfg
        self.mu, self.mask = blocks.to_groups(mu.reshape(-1))  # (G, g) each
        self.sigma, _ = blocks.to_groups(sigma.reshape(-1))
        if omega is None:  # posterior whitening
            self.omega = 1.0 / (self.sigma * self.sigma)
        else:
            self.omega, _ = blocks.to_groups(omega.reshape(-1))
        self.weight = self.mask * self.omega * self.sigma * self.sigma  # multiplies the whitened cost

    def uniform(self, grids: UniformGrids) -> torch.Tensor:
        """(G,) expected cost of per-group uniform grids."""
        return grid_cost_chunked(self.mu, self.sigma, grids.lo, grids.scale, grids.levels, self.weight)

    def levels(self, levels: torch.Tensor) -> torch.Tensor:
        """(G,) expected cost of per-group LUTs (G, K)."""
        return levels_cost_chunked(self.mu, self.sigma, levels, self.mask, self.omega)

    def search(self, b: int) -> tuple[UniformGrids, torch.Tensor]:
        cfg = self.cfg
        return fit_uniform_grids(self.mu, self.sigma, self.weight, b, iters=cfg.range_iters,
                                 min_ratio=cfg.min_range_ratio, scale_bits=cfg.scale_bits)

    def lut(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One LUT per allocation unit: ((U, K) levels, (U,) cost)."""
        lb = self.blocks
        rows = [_unit_rows(lb, x) for x in (self.mu, self.sigma, self.omega)]
        return fit_lloyd_levels(rows[0], rows[1], _unit_mask(lb, self.mask), b, omega=rows[2],
                                lut_bits=self.cfg.lut_bits, within_range=True)

    def vq_constant(self) -> torch.Tensor:
        """(G,) part of a VQ entry that no codebook changes: ``sum omega sigma^2``."""
        return self.weight.sum(1)

    def candidate(self, bits: int) -> tuple[Book, torch.Tensor, str]:
        """(codebook, (U,) unit loss, storage kind) of one candidate bit-width: the fit registered
        for ``cfg.codebook`` (:func:`bayesq.books.register_fit`), or min/max grids above
        ``SEARCH_MAX_LEVELS`` levels."""
        if 2**bits > SEARCH_MAX_LEVELS:
            g = minmax_grids(self.mu, bits, self.cfg.scale_bits)
            return g, self.units(self.uniform(g)), g.kind
        book, loss = FITS[str(getattr(self.cfg.codebook, "value", self.cfg.codebook))](self, bits)
        return book, loss, book.kind

    def _vq(self, b: int) -> tuple[Book, torch.Tensor]:
        """Weighted k-means over the layer's vectors; cost of the stored (mean) assignment."""
        d, (n_groups, g) = self.cfg.vq_dim, self.mu.shape
        if g % d:
            raise ValueError(f"quant.group_size = {g} must be a multiple of quant.vq_dim = {d}")
        om = self.omega * self.mask  # (G, g): padding weighs nothing
        codebook, _, _ = fit_vq(self.mu.reshape(-1, d), om.reshape(-1, d), 2 ** (b * d), lut_bits=self.cfg.lut_bits)
        book = VQBook(b, codebook, om)
        _, vec_cost = vq_assign(self.mu.reshape(-1, d), om.reshape(-1, d), codebook)  # (G g / d,)
        group_cost = vec_cost.reshape(n_groups, -1).sum(1) + self.vq_constant()
        return book, self.units(group_cost)

    def units(self, group_cost: torch.Tensor) -> torch.Tensor:
        """(U,) table entries ``0.5 * sum over each unit's groups`` of (G,) ``group_cost``."""
        return 0.5 * _unit_sum(self.blocks, group_cost)


# ---- the built-in codebooks' fits (quant.codebook) -------------------------------------------------

@register_fit(Codebook.UNIFORM.value, uniform=True)
def _fit_uniform(fit: _LayerFit, b: int) -> tuple[Book, torch.Tensor]:
    """Per-group range searched for the least cost (:meth:`_LayerFit.search`)."""
    g, cost = fit.search(b)
    return g, fit.units(cost)


@register_fit(Codebook.VQ.value)
def _fit_vq(fit: _LayerFit, b: int) -> tuple[Book, torch.Tensor]:
    """VQ while its codebook stays small (``MAX_CODEBOOK`` vectors), else searched uniform grids."""
    return fit._vq(b) if 2 ** (b * fit.cfg.vq_dim) <= MAX_CODEBOOK else _fit_uniform(fit, b)


@register_fit(Codebook.UNIFORM_FIXED.value, uniform=True)
def _fit_uniform_fixed(fit: _LayerFit, b: int) -> tuple[Book, torch.Tensor]:
    """Uniform grids over a fixed range per group (no search)."""
    g = _fixed_range_grids(fit.mu, fit.mask, b, fit.cfg.scale_bits)
    return g, fit.units(fit.uniform(g))


@register_fit(Codebook.MULAW.value)
def _fit_mulaw(fit: _LayerFit, b: int) -> tuple[Book, torch.Tensor]:
    """The fixed mu-law table times each group's largest magnitude."""
    levels = mulaw_levels(fit.mu.abs().max(1).values, b, fit.cfg.mulaw_mu, fit.cfg.scale_bits)  # (G, K)
    return MulawTables(b, levels, torch.arange(levels.shape[0], device=levels.device)), fit.units(fit.levels(levels))


@register_fit(Codebook.LLOYD.value)
def _fit_lloyd(fit: _LayerFit, b: int) -> tuple[Book, torch.Tensor]:
    """Posterior-weighted Lloyd-Max tables, one per allocation unit."""
    levels, cost = fit.lut(b)  # (U, K), (U,)
    return LevelTables(b, levels, fit.blocks.group_unit(levels.device)), 0.5 * cost


@register_fit(Codebook.LLOYD_UNIFORM.value, uniform=True)
def _fit_lloyd_uniform(fit: _LayerFit, b: int) -> tuple[Book, torch.Tensor]:
    """Lloyd-Max assignments compiled to a uniform grid per group (:func:`compile_to_uniform`)."""
    levels, _ = fit.lut(b)
    codes = LevelTables(b, levels, fit.blocks.group_unit(levels.device)).quantize(fit.mu)  # (G, g) the LUT's assignment
    g = compile_to_uniform(codes, fit.mu, b, omega=fit.omega, mask=fit.mask, scale_bits=fit.cfg.scale_bits)
    return g, fit.units(fit.uniform(g))


class _DeployedFit(_LayerFit):
    """Codebook fits under the ``deployed`` objective: every cost is the metric-weighted squared
    error of the stored weights, ``sum_i omega_i (Q(mu_i) - mu_i)^2``; the posterior's variances
    do not enter (they add the same constant to every candidate).

    ``entry_omega`` (error-feedback gains applied, :func:`feedback_weights`): the codebooks are
    fitted under ``omega`` and the table entries of grids are their cost under ``entry_omega``.
    """

    def __init__(self, blocks: LayerBlocks, mu: torch.Tensor, omega: torch.Tensor, cfg: QuantConfig,
                 entry_omega: torch.Tensor | None = None, like: "_DeployedFit | None" = None):
        self.blocks, self.cfg = blocks, cfg
        # (G, g) each; ``like``: a fit of the same layer and means, whose rows are reused (no copy)
        self.mu, self.mask = (like.mu, like.mask) if like is not None else blocks.to_groups(mu.reshape(-1))
        self.omega, _ = blocks.to_groups(omega.reshape(-1))
        self.weight = self._masked(self.omega)
        self.entry_weight = None if entry_omega is None else self._masked(blocks.to_groups(entry_omega.reshape(-1))[0])
        self.joint: _JointSearch | None = None  # set by _JointSearch: the searches it shares ...
        self.joint_index = 0  # ... and this fit's place among them

    def _masked(self, x: torch.Tensor) -> torch.Tensor:
        """``mask * x`` of (G, g) ``x``: ``x`` itself when nothing is padded (the same values)."""
        return self.mask * x if self.blocks.padded else x

    def candidate(self, bits: int) -> tuple[Book, torch.Tensor, str]:
        book, loss, kind = super().candidate(bits)
        if self.entry_weight is not None:
            if book.affine_fields() is None:
                raise ValueError(f"error-feedback table entries need uniform grids, got a '{kind}' codebook")
            loss = self.units(grid_sq_error(self.mu, self.entry_weight, book))
        return book, loss, kind

    def uniform(self, grids: UniformGrids) -> torch.Tensor:
        return grid_sq_error(self.mu, self.weight, grids)

    def levels(self, levels: torch.Tensor) -> torch.Tensor:
        return levels_sq_error(self.mu, self.weight, levels)

    def search(self, b: int) -> tuple[UniformGrids, torch.Tensor]:
        if self.joint is not None:
            return self.joint.search(self, b)
        cfg = self.cfg
        return fit_uniform_grids_deployed(self.mu, self.weight, b, iters=cfg.range_iters,
                                          min_ratio=cfg.min_range_ratio, scale_bits=cfg.scale_bits,
                                          grid=cfg.range_grid)

    def lut(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        lb = self.blocks
        mu, weight = _unit_rows(lb, self.mu), _unit_rows(lb, self.omega) * _unit_mask(lb, self.mask)
        return fit_weighted_levels(mu, weight, _unit_mask(lb, self.mask), b, lut_bits=self.cfg.lut_bits)

    def vq_constant(self) -> torch.Tensor:
        return torch.zeros(self.mu.shape[0], dtype=self.mu.dtype, device=self.mu.device)


class _JointSearch:
    """The range searches of several deployed-objective fits of one layer (the same means and
    search settings, other metrics, e.g. the error-feedback table with and without the gains in
    its search): the first fit to search a bit-width runs every fit's search at once
    (:func:`bayesq.grids.fit_uniform_grids_deployed_many`: the ratio grid's rounding errors
    computed once) and each fit takes its own result, the one it gets alone. It holds the fits'
    means and metrics, not the fits (no reference cycle: a layer's fits are freed with it)."""

    def __init__(self, fits: Sequence[_DeployedFit]) -> None:
        self.mu, self.weights = fits[0].mu, [f.weight for f in fits]
        self.done: dict[int, list] = {}  # bits -> [grids, costs, results not yet taken]
        for i, f in enumerate(fits):
            f.joint, f.joint_index = self, i

    @staticmethod
    def key(fit: _LayerFit) -> tuple | None:
        """Fits with equal keys share their searches (None: a fit that does not search this way)."""
        if type(fit) is not _DeployedFit:
            return None
        c = fit.cfg
        return (id(fit.mu), str(getattr(c.codebook, "value", c.codebook)), c.range_iters, c.min_range_ratio,
                c.scale_bits, c.range_grid)

    def search(self, fit: _DeployedFit, b: int) -> tuple[UniformGrids, torch.Tensor]:
        if b not in self.done:
            c = fit.cfg
            grids, costs = fit_uniform_grids_deployed_many(self.mu, self.weights, b, iters=c.range_iters,
                                                           min_ratio=c.min_range_ratio, scale_bits=c.scale_bits,
                                                           grid=c.range_grid)
            self.done[b] = [grids, costs, len(self.weights)]
        entry = self.done[b]
        grids, costs = entry[0], entry[1]
        entry[2] -= 1
        if entry[2] == 0:
            del self.done[b]
        return grids.take(fit.joint_index), costs[fit.joint_index]


def share_searches(fits: Sequence[_LayerFit]) -> None:
    """Join the fits of one layer whose range searches can share their scoring (:class:`_JointSearch`)."""
    groups: dict[tuple, list[_DeployedFit]] = {}
    for f in fits:
        k = _JointSearch.key(f)
        if k is not None:
            groups.setdefault(k, []).append(f)
    for same in groups.values():
        if len(same) > 1:
            _JointSearch(same)


def layer_table(blocks: LayerBlocks, mu: torch.Tensor, sigma: torch.Tensor | None, cfg: QuantConfig,
                omega: torch.Tensor | None = None, entry_omega: torch.Tensor | None = None) -> LayerTable:
    """Closed-form table of one layer.

    ``quant.objective = deployed``: ``L_u(b) = 0.5 sum_{i in u} omega_i (Q_b(mu_i) - mu_i)^2``
    (``omega`` required: the metric, e.g. the data curvature); ``draws``: the expected distortion
    of posterior draws (``sigma`` required; ``omega`` None = whitening ``1 / sigma^2``).
    ``entry_omega`` (deployed only): the codebooks are fitted under ``omega`` and the entries are
    ``0.5 sum_{i in u} entry_omega_i (Q_b(mu_i) - mu_i)^2`` (the error-feedback table).

    Args:
        mu, sigma, omega, entry_omega: float64 shaped like the weight (posterior means, standard
            deviations, metric weights, entry weights).
    """
    return fit_table(layer_fit(blocks, mu, sigma, cfg, omega, entry_omega))


def layer_fit(blocks: LayerBlocks, mu: torch.Tensor, sigma: torch.Tensor | None, cfg: QuantConfig,
              omega: torch.Tensor | None = None, entry_omega: torch.Tensor | None = None,
              like: _LayerFit | None = None) -> _LayerFit:
    """The codebook fits of one layer that :func:`layer_table` tabulates (arguments as there;
    ``like``: a deployed fit of the same layer and means, whose grouped rows are reused)."""
    if Objective(cfg.objective) == Objective.DEPLOYED:
        if omega is None:
            raise ValueError("the deployed objective needs the metric weights omega (e.g. the data curvature)")
        return _DeployedFit(blocks, mu, omega, cfg, entry_omega, like if isinstance(like, _DeployedFit) else None)
    if entry_omega is not None:
        raise ValueError("entry_omega (the error-feedback table) needs the deployed objective")
    return _LayerFit(blocks, mu, sigma, omega, cfg)


def fit_table(fit: _LayerFit) -> LayerTable:
    """The closed-form table of :func:`layer_table` from the layer's fits."""
    blocks, cfg = fit.blocks, fit.cfg
    books, losses, kinds = [], [], []
    for b in cfg.bits:
        book, loss, kind = fit.candidate(b)
        books.append(book)
        losses.append(loss)
        kinds.append(kind)
    loss = torch.stack(losses, 1)  # (U, nb)
    costs = _costs(blocks, cfg, kinds, loss.device)
    return LayerTable(blocks, cfg.bits, loss, costs, tuple(books), torch.zeros_like(loss))


def metric_weights(posterior: Posterior, name: str, whitening: Whitening,
                   input_diag: dict[str, torch.Tensor] | None = None,
                   objective: Objective = Objective.DRAWS, cost_terms: CostTerms = CostTerms.DATA,
                   ) -> torch.Tensor | None:
    """omega of one layer for the chosen whitening.

    ``posterior`` whitening: under the ``deployed`` objective the data curvature ``h``
    (``cost_terms = data``) or the posterior precision ``h + lambda_l`` (``data-prior``); under
    ``draws`` None (``1 / sigma^2``). ``identity``: 1; ``pca``: the input moments ``A_ii``.
    """
    if whitening == Whitening.POSTERIOR:
        if Objective(objective) == Objective.DRAWS:
            return None
        h = posterior.data_precision(name).double()  # as the float64 means (no copy when float64)
        if CostTerms(cost_terms) == CostTerms.DATA_PRIOR:
            h = h + (posterior.prior_precision or {}).get(name, 0.0)
        return h
    mu = posterior.mean[name]
    if whitening == Whitening.IDENTITY:
        return torch.ones_like(mu)
    if input_diag is None or name not in input_diag:
        raise ValueError("quant.whitening = 'pca' needs the layers' input moments: pass calibration data")
    a = input_diag[name].to(mu.dtype)  # (d_in,)
    return a.expand(mu.shape[0], -1).reshape(mu.shape).clone()  # omega_oi = A_ii


def feedback_weights(omega: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """``omega_oj * r_j``: the metric weights of a layer rounded with error feedback.

    Args:
        omega: float64 weight-shaped metric weights (out, ...), flattened per row to (out, d_in).
        gain: (groups, d_in) or (d_in,) error-feedback gains ``r_j``
            (:func:`bayesq.error_feedback.feedback_gain`); convolution group g owns rows
            ``g * out / groups ... (g + 1) * out / groups - 1``.
    """
    mat = omega.reshape(omega.shape[0], -1)  # (out, d_in)
    gain = gain.to(omega.dtype)
    gain = gain if gain.dim() == 2 else gain.unsqueeze(0)
    if mat.shape[0] % gain.shape[0] or gain.shape[1] != mat.shape[1]:
        raise ValueError(f"gain of shape {tuple(gain.shape)} does not fit a weight of {tuple(mat.shape)} (out, d_in)")
    per_group = mat.reshape(gain.shape[0], -1, mat.shape[1])  # (groups, out / groups, d_in)
    return (per_group * gain[:, None, :]).reshape(omega.shape)


def posterior_table(
    posterior: Posterior, blocks: list[LayerBlocks], cfg: QuantConfig, progress: bool = True,
    input_diag: dict[str, torch.Tensor] | None = None, gains: dict[str, torch.Tensor] | None = None,
) -> LossTable:
    """BayesQ closed-form table: codebooks fitted to, and entries of, ``cfg.objective``.

    ``gains``: layer -> error-feedback gains ``r_j`` multiplying the metric's columns
    (:func:`feedback_weights`; the deployed objective of a layer rounded with error feedback).
    They weigh the table entries, and with ``cfg.feedback_search`` (the default) the grids' range
    search too; without it the ranges are searched under the metric without them (the gains
    price small independent rounding errors, and a clipped weight's error is neither:
    docs/method.md section 18d).
    """
    return posterior_tables(posterior, blocks, [cfg], progress, input_diag, gains)[0]


def posterior_tables(
    posterior: Posterior, blocks: list[LayerBlocks], cfgs: Sequence[QuantConfig], progress: bool = True,
    input_diag: dict[str, torch.Tensor] | None = None, gains: dict[str, torch.Tensor] | None = None,
) -> list[LossTable]:
    """:func:`posterior_table` of each of ``cfgs`` (the same tables), built layer by layer
    together: configurations that search the same ranges under different metrics (the
    error-feedback table with and without ``feedback_search``) score their ratio grids once
    (:func:`share_searches`)."""
    tables: list[list[LayerTable]] = [[] for _ in cfgs]
    for lb in tqdm(blocks, desc="loss table" + (f" ({len(cfgs)} candidates)" if len(cfgs) > 1 else ""),
                   disable=not progress, leave=False):
        fits: list[_LayerFit] = []
        metrics: dict[tuple, tuple] = {}  # (metric weights, with the gains): one of each per layer
        for cfg in cfgs:
            key = (Whitening(cfg.whitening), Objective(cfg.objective), CostTerms(cfg.cost_terms))
            if key not in metrics:
                omega = metric_weights(posterior, lb.name, key[0], input_diag, key[1], key[2])
                gained = feedback_weights(omega, gains[lb.name]) if gains is not None and omega is not None else None
                metrics[key] = omega, gained
            omega, entry = metrics[key]
            if entry is not None and cfg.feedback_search:
                omega, entry = entry, None
            sigma = None if Objective(cfg.objective) == Objective.DEPLOYED else posterior.std(lb.name)  # draws only
            fits.append(layer_fit(lb, posterior.mean[lb.name], sigma, cfg, omega, entry,
                                  like=fits[0] if fits else None))
        share_searches(fits)
        for out, fit in zip(tables, fits):
            out.append(fit_table(fit))
        del fits, metrics
        release_freed()
    return [LossTable(tuple(t)) for t in tables]


def rtn_table(
    weights: Mapping[str, torch.Tensor], blocks: list[LayerBlocks], cfg: QuantConfig,
    element_weight: Mapping[str, torch.Tensor] | None = None, grids: Callable | None = None,
    progress: bool = False,
) -> LossTable:
    """Min/max grids and their squared rounding error per unit (the baselines' own mixed rule).

    ``L_u(b) = sum_{i in u} omega_i (Q_b(w_i) - w_i)^2`` with ``omega = 1`` (RTN, data-free) or
    ``element_weight[name]`` (any tensor with the weight's number of elements, e.g. GPTQ / AWQ's
    input second moments ``diag(H)`` per column: the diagonal part of the layer-output error;
    read once per layer, so a :class:`bayesq.memory.LazyMap` holds one layer's at a time).
    ``grids(w, bits, mask) -> UniformGrids`` replaces the min/max grids (ACIQ's clipped ranges);
    ``w`` and ``mask`` are (G, group_size) float64. ``progress``: a bar over the layers.
    """
    tables = []
    for lb in tqdm(blocks, desc="grids and rounding errors", disable=not progress, leave=False):
        omega = None if element_weight is None else element_weight[lb.name]
        tables.append(_rtn_layer(lb, weights[lb.name], omega, cfg, grids))
        release_freed()
    return LossTable(tuple(tables))


def _rtn_layer(lb: LayerBlocks, weight: torch.Tensor, omega: torch.Tensor | None, cfg: QuantConfig,
               grids: Callable | None) -> LayerTable:
    """:func:`rtn_table`'s table of one layer; the errors scored in row chunks (no full-size
    temporaries of a large layer)."""
    w, real = lb.to_groups(weight.detach().double().reshape(-1))
    mask = real
    if omega is not None:
        omega, _ = lb.to_groups(omega.double().reshape(-1))
        mask = real * omega if lb.padded else omega
    books, losses = [], []
    for b in cfg.bits:
        g = grids(w, b, real) if grids is not None else minmax_grids(w, b, cfg.scale_bits)
        books.append(g)
        losses.append(_unit_sum(lb, grid_sq_error(w, mask, g)))
    loss = torch.stack(losses, 1)
    return LayerTable(lb, cfg.bits, loss, _costs(lb, cfg, [b.kind for b in books], loss.device), tuple(books),
                      torch.zeros_like(loss))
