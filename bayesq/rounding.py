"""Rounding an allocated layer to its codes: nearest, error feedback, coordinate descent, refit.

Shared by BayesQ and every baseline that encodes from a loss table: :func:`encode` rounds each
layer of an allocation on the grids (or level tables) its table fitted, in the metric the
posterior gives (:func:`ef_column_metric`), then optionally refits the scales to the codes; the
statistics it reads (:func:`bias_correction`, :func:`feedback_gains`) are computed here too.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.baselines.activations import InputStats, input_stats
from bayesq.bias_correction import BiasCorrection
from bayesq.blocks import LayerBlocks
from bayesq.config import CostTerms, Objective, QuantConfig, Rounding
from bayesq.error_feedback import (
    LazyMetrics, coordinate_descent, damped_metrics, error_feedback_groups, feedback_gain, shared_factors,
)
from bayesq.expected_loss import Book, LayerTable, LossTable
from bayesq.forward import Batch
from bayesq.memory import release_freed
from bayesq.posterior import Posterior
from bayesq.refit import refit_rows, refit_scales, row_equations
from bayesq.result import Allocation, QuantizedWeight


def group_grid(lb: LayerBlocks, group_bits: torch.Tensor, books: Mapping[int, Book]):
    """(n_groups,) scale, zero (float64) and maxq (int64) of the groups' uniform grids."""
    scale = torch.zeros(lb.n_groups, dtype=torch.float64, device=group_bits.device)
    zero = torch.zeros(lb.n_groups, dtype=torch.float64, device=group_bits.device)
    for b, book in books.items():
        affine = book.affine_fields()
        if affine is None:
            raise ValueError("error-feedback rounding needs uniform grids for every candidate")
        sel = group_bits == b
        scale[sel], zero[sel] = affine
    maxq = (2**group_bits - 1).to(torch.int64)  # a stored scale 0 (an all-zero group) gets its zero-point code
    return scale, zero, maxq


ENCODE_ROW_ELEMENTS = 1 << 21  # weights per error-feedback call on a layer with one column metric


# coordinate descent's D H: half float64's time, the same cost to 2e-6 (docs/findings.md; benchmarks/cd_dtype.py
# at 2423b3a)
CD_DTYPE = torch.float32


def row_chunks(n_out: int, d_in: int, metric: torch.Tensor, copies: int = 1) -> list[slice]:
    """Output rows in chunks of about ``ENCODE_ROW_ELEMENTS / copies`` weights (``copies``: grids
    whose rows are stacked in one call, :func:`encode_layer_candidates`) when the layer has one
    column metric (Linear, ungrouped Conv2d): rows are independent given it, so error feedback and
    coordinate descent give the same codes chunk by chunk while their float64 working copies stay
    the size of a chunk (a vocabulary projection of 50,257 x 768 weights needs several GiB at
    once); one chunk for grouped convolutions (a metric per group)."""
    if metric.dim() == 3 and metric.shape[0] > 1:
        return [slice(0, n_out)]
    step = max(1, ENCODE_ROW_ELEMENTS // max(1, copies * d_in))
    return [slice(r, min(r + step, n_out)) for r in range(0, n_out, step)]


def _refit_books(lb: LayerBlocks, W: torch.Tensor, codes: torch.Tensor, group_bits: torch.Tensor, books: dict,
                 metric: torch.Tensor, scale_bits: int) -> dict:
    """``books`` with each group's scale refitted to its (out, d_in) codes (``refit.refit_scales``);
    ``W``: the (out, d_in) weight in its own dtype, widened to float64 where read. When every row
    holds whole groups, the rows' normal equations are built in :func:`row_chunks` (``refit.refit_rows``:
    the same scales, float64 working copies the size of a chunk)."""
    scale, zero, _ = group_grid(lb, group_bits, books)
    metric = metric.double()
    refit = None
    if lb.row % lb.group_size == 0:
        eqs = []
        for rows in row_chunks(*W.shape, metric):
            group = lb.element_groups(rows, W.device)  # (r, d_in)
            eqs.append(row_equations(W[rows].double(), codes[rows].double() - zero[group], lb.row // lb.group_size,
                                     metric, constant=False))  # the scales only: no W^T H W
        refit = refit_rows(tuple(torch.cat(x) for x in zip(*eqs)), scale, scale_bits=scale_bits)
    if refit is None:  # groups straddle rows, or some row's equations are singular: the whole layer
        group = lb.element_groups(slice(0, W.shape[0]), W.device)  # (out, d_in)
        refit = refit_scales(W.double(), codes.double() - zero[group], group, scale, metric, scale_bits=scale_bits)
    new = refit[0]
    return {b: book.with_affine(new[group_bits == b], book.affine_fields()[1]) for b, book in books.items()}


def _learned_books(lb: LayerBlocks, W: torch.Tensor, group_bits: torch.Tensor, books: dict, metric: torch.Tensor,
                   grid_fit, scale_bits: int) -> dict:
    """``books`` with each group's scale and zero-point learned by ``grid_fit`` (LSQ,
    :mod:`bayesq.baselines.lsq`) from its current grid, the scales then rounded to their stored
    precision (``scale_bits``). ``W``: the (out, d_in) weight, widened to float64 a row chunk at a
    time (:func:`row_chunks`) when every row holds whole groups, else at once."""
    scale, zero, maxq = group_grid(lb, group_bits, books)
    whole_groups = lb.row_aligned or lb.row % lb.group_size == 0
    for rows in row_chunks(*W.shape, metric) if whole_groups else [slice(0, W.shape[0])]:
        idx = lb.element_groups(rows, W.device)  # (r, d_in) group of every weight
        ids = torch.unique(idx)  # these rows' groups, ascending
        scale[ids], zero[ids] = grid_fit(W[rows].double(), metric, scale[ids], zero[ids], maxq[ids],
                                         torch.searchsorted(ids, idx), name=lb.name)
    scale = scale.to(torch.float16 if scale_bits == 16 else torch.float32).double()
    return {b: book.with_affine(scale[group_bits == b], zero[group_bits == b]) for b, book in books.items()}


def needs_input_stats(posterior: Posterior, q: QuantConfig) -> bool:
    """Whether :func:`encode_best` reads the layers' input statistics: error-feedback rounding
    under a diagonal posterior (its column metric) or ``q.bias_correction`` (the mean inputs)."""
    return reads_input_stats(q, bool(posterior.kfac))


def reads_input_stats(q: QuantConfig, kfac: bool) -> bool:
    """:func:`needs_input_stats` of a posterior with (``kfac``) or without Kronecker factors."""
    return q.bias_correction or (Rounding(q.rounding) == Rounding.ERROR_FEEDBACK and not kfac)


def ef_column_metric(
    posterior: Posterior, q: QuantConfig, model: nn.Module | None = None,
    calibration: Iterable[Batch] | None = None, damp: float = 0.01, progress: bool = False,
    stats: Mapping[str, InputStats] | None = None,
) -> LazyMetrics | None:
    """Column metric of error-feedback rounding, or None (nearest rounding; or ``encode`` uses
    the K-FAC posterior's damped input factor A'). The damped metric of a layer is made when it
    is read (:class:`bayesq.error_feedback.LazyMetrics`): only the undamped moments are held.

    * Diagonal posterior: the layers' input second moments ``H = mean_n sum_t a a^T`` on the
      calibration inputs (``stats``, else :func:`bayesq.baselines.activations.input_stats`) with
      GPTQ's relative dampening (``error_feedback.damped_metric``): the column factor of the data
      curvature ``C ~= G (x) H`` that the diagonal table approximates. Needs ``model`` and
      ``calibration`` unless ``stats`` are given.
    * K-FAC / low-rank posterior under the ``deployed`` objective with ``cost_terms = data``:
      the undamped input factor A with the same dampening (the prior's damping would drown A);
      otherwise None (the posterior's A').
    """
    if Rounding(q.rounding) != Rounding.ERROR_FEEDBACK:
        return None
    if posterior.kfac:
        if (Objective(q.objective) == Objective.DEPLOYED and CostTerms(q.cost_terms) == CostTerms.DATA
                and posterior.input_moment):
            return damped_metrics(posterior.input_moment, damp)
        return None
    if stats is None:
        stats = layer_input_stats(posterior, model, calibration, progress)
    return damped_metrics({name: stats[name].H for name in posterior.mean}, damp)


def layer_input_stats(posterior: Posterior, model: nn.Module | None, calibration: Iterable[Batch] | None,
                      progress: bool) -> dict[str, InputStats]:
    """The input statistics of the posterior's layers, one pass over ``calibration``."""
    if model is None or calibration is None:
        raise ValueError("error-feedback rounding with a diagonal posterior and bias correction need the model and "
                         "calibration batches (the layers' input second moments and means)")
    layers = {name: model.get_submodule(name) for name in posterior.mean}
    return input_stats(model, calibration, layers, progress=progress, abs_mean=False)


def stats_of(stats: Mapping[str, InputStats], posterior: Posterior) -> dict[str, InputStats]:
    """``stats`` of the posterior's layers (ValueError naming those it lacks)."""
    missing = [name for name in posterior.mean if name not in stats]
    if missing:
        raise ValueError(f"the input statistics given lack layers {missing[:3]} of the posterior: compute them "
                         "with bayesq.baselines.activations.input_stats on the same model and layers")
    return {name: stats[name] for name in posterior.mean}


def bias_correction(
    model: nn.Module, stats: Mapping[str, InputStats], calibration: Iterable[Batch],
) -> BiasCorrection:
    """:class:`bayesq.bias_correction.BiasCorrection` of the layers in ``stats`` (their mean inputs)."""
    return BiasCorrection.fit(model, {name: s.mean for name, s in stats.items()}, calibration)


def feedback_gains(
    posterior: Posterior, q: QuantConfig, column_metric: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor] | None:
    """Error-feedback gains ``r_j`` per layer for the table (``quant.feedback_table``), or None.

    The metric is the one :func:`encode` rounds in: ``column_metric`` (from
    :func:`ef_column_metric`), else the posterior's damped K-FAC input factor A'. None unless
    the rounding is error feedback under the deployed objective with ``feedback_table`` set
    (``q.feeds_back_table``).
    """
    if not q.feeds_back_table:
        return None
    if isinstance(column_metric, LazyMetrics):
        return column_metric.gains(q.act_order)  # made once for every table of this metric
    if column_metric is None:
        column_metric = {name: f.A for name, f in (posterior.kfac or {}).items()}
    return {name: feedback_gain(h, act_order=q.act_order) for name, h in column_metric.items()}


def encode(
    table: LossTable, allocation: Allocation, weights: dict[str, torch.Tensor], *,
    posterior: Posterior | None = None, rounding: Rounding = Rounding.NEAREST,
    column_metric: Mapping[str, torch.Tensor] | None = None, act_order: bool = False,
    refit: bool = False, scale_bits: int = 16, cd_passes: int = 0, progress: bool = False, solver=None,
    grid_fit=None,
) -> dict[str, QuantizedWeight]:
    """Quantise each layer with the codebooks of its units' chosen bit-widths.

    ``rounding = error-feedback``: codes from :func:`error_feedback.error_feedback_groups` with
    ``column_metric[name]`` ((groups, d_in, d_in) or (d_in, d_in), SPD, already damped; GPTQ's
    input Hessian) as the column metric, or else the damped K-FAC input factor A of
    ``posterior`` (docs/method.md section 2: the sequential minimiser of ``tr(G D A D^T)`` for a
    fixed grid); ``act_order`` orders columns by decreasing metric diagonal; ``cd_passes``
    sweeps of exact coordinate descent in the same metric then polish the codes
    (:func:`error_feedback.coordinate_descent`); ``refit`` then
    refits the groups' scales to the codes in the same metric (:func:`bayesq.refit.refit_scales`,
    stored at ``scale_bits``). Otherwise codes are the nearest levels. ``progress``: a bar over layers.
    ``solver``: another rounding of the rows on the same grids and metric in place of error
    feedback and coordinate descent (``solver(rows, metric, scale, zero, maxq, groups=, name=layer)``
    -> int64 codes, ``groups`` (r, d_in) the index of each weight's group among the rows'; AdaRound,
    :mod:`bayesq.baselines.adaround`). ``grid_fit``: with error feedback or
    ``solver``, each group's grid learned first (``grid_fit(rows, metric, scale, zero, maxq, groups,
    name=layer)`` -> the (g,) scales and zero-points of the rows' g groups, ``groups`` (r, d_in)
    the index of each weight's group among them; LSQ, :mod:`bayesq.baselines.lsq`), then the
    codes rounded on it.

    Layers are encoded one at a time: ``column_metric[name]`` is read once per layer (a
    :class:`bayesq.error_feedback.LazyMetrics` then holds one layer's metric and factor at a time).
    """
    opts = dict(rounding=rounding, act_order=act_order, refit=refit, scale_bits=scale_bits, cd_passes=cd_passes,
                solver=solver, grid_fit=grid_fit, progress=progress)
    out = {}
    for t in tqdm(table.layers, desc=f"encode ({Rounding(rounding).value})", disable=not progress, leave=False):
        name = t.blocks.name
        with shared_factors():  # the layer's row chunks share its factor
            metric = layer_metric(name, rounding, column_metric, posterior)
            out[name] = encode_layer(t, allocation.unit_bits[name], weights[name], metric, **opts)
        release_freed()
    return out


def layer_metric(name: str, rounding: Rounding, column_metric: Mapping[str, torch.Tensor] | None,
                  posterior: Posterior | None) -> torch.Tensor | None:
    """The column metric ``encode`` rounds layer ``name`` in (None for nearest rounding)."""
    if Rounding(rounding) != Rounding.ERROR_FEEDBACK:
        return None
    if column_metric is not None:
        return column_metric[name]
    f = (posterior.kfac or {}).get(name) if posterior is not None else None
    if f is None:
        raise ValueError(f"error-feedback rounding of '{name}' needs a K-FAC or low-rank posterior")
    return f.A


def encode_layer(
    t: LayerTable, unit_bits: Sequence[int], weight: torch.Tensor, metric: torch.Tensor | None, *,
    rounding: Rounding = Rounding.NEAREST, act_order: bool = False, refit: bool = False, scale_bits: int = 16,
    cd_passes: int = 0, solver=None, grid_fit=None, progress: bool = False,
) -> QuantizedWeight:
    """One layer of :func:`encode`: ``weight`` with the books of ``t`` at ``unit_bits`` (one
    width per unit), rounded in ``metric`` (error feedback) or to the nearest levels."""
    return encode_layer_candidates([(t, unit_bits)], weight, metric, rounding=rounding, act_order=act_order,
                                   refit=refit, scale_bits=scale_bits, cd_passes=cd_passes, solver=solver,
                                   grid_fit=grid_fit, progress=progress)[0]


def encode_layer_candidates(
    parts: Sequence[tuple[LayerTable, Sequence[int]]], weight: torch.Tensor, metric: torch.Tensor | None, *,
    rounding: Rounding = Rounding.NEAREST, act_order: bool = False, refit: bool = False, scale_bits: int = 16,
    cd_passes: int = 0, solver=None, grid_fit=None, progress: bool = False,
) -> list[QuantizedWeight]:
    """:func:`encode_layer` of one layer under several ``(table, unit_bits)`` (grid candidates),
    with the same options. Under error feedback without a ``solver`` the candidates' rows are
    stacked into one call of the rounding and of coordinate descent: rows are independent given
    the metric, so the codes are those of one call per candidate, from fewer, larger operations
    (the column loops are bound by per-operation overhead)."""
    lb = parts[0][0].blocks
    w = weight.detach()  # widened to float64 a row chunk at a time (exactly: the same values)
    prepared = [_layer_books(t, bits, w.device) for t, bits in parts]  # (group_bits, books) per candidate
    if Rounding(rounding) != Rounding.ERROR_FEEDBACK:
        return [_nearest_layer(lb, w, group_bits, books) for group_bits, books in prepared]
    mat = w.reshape(w.shape[0], -1)  # (out, d_in)
    if grid_fit is not None:
        prepared = [(gb, _learned_books(lb, mat, gb, books, metric, grid_fit, scale_bits)) for gb, books in prepared]
    grids = [group_grid(lb, gb, books) for gb, books in prepared]
    if solver is None:
        codes = _feedback_codes(lb, mat, grids, metric, act_order, cd_passes, progress)
    else:
        codes = [_solver_codes(lb, mat, grid, metric, solver, progress) for grid in grids]
    out = []
    for (group_bits, books), codes_w in zip(prepared, codes):
        grouped, _ = lb.to_groups(codes_w.reshape(-1))
        if refit:
            books = _refit_books(lb, mat, codes_w, group_bits, books, metric, scale_bits)
        out.append(QuantizedWeight(lb, group_bits, grouped, books))
    return out


def _layer_books(t: LayerTable, unit_bits: Sequence[int], device: torch.device) -> tuple[torch.Tensor, dict]:
    """(group_bits (G,), bits -> the book of the groups at that width) of ``t`` at ``unit_bits``."""
    unit_bits = torch.tensor(unit_bits, dtype=torch.int64, device=device)
    group_bits = unit_bits[t.blocks.group_unit(device)]  # (G,)
    books = {b: book.take(group_bits == b) for b, book in zip(t.bits, t.books) if bool((group_bits == b).any())}
    return group_bits, books


def _nearest_layer(lb: LayerBlocks, w: torch.Tensor, group_bits: torch.Tensor, books: dict) -> QuantizedWeight:
    groups, _ = lb.to_groups(w.double().reshape(-1))
    parts = {b: book.quantize(groups[group_bits == b]) for b, book in books.items()}
    widths = {p.shape[1] for p in parts.values()}
    if len(widths) != 1:
        raise ValueError(f"layer '{lb.name}' mixes VQ and scalar codes; VQ needs quant.unit: tensor")
    codes = torch.zeros(lb.n_groups, widths.pop(), dtype=torch.int64, device=w.device)
    for b, part in parts.items():
        codes[group_bits == b] = part
    return QuantizedWeight(lb, group_bits, codes, books)


def _codes_buffer(mat: torch.Tensor, grid: tuple) -> torch.Tensor:
    """(out, d_in) codes: one byte per weight when every code fits one, else int64."""
    small = int(grid[2].max()) < 256
    return torch.empty(mat.shape, dtype=torch.uint8 if small else torch.int64, device=mat.device)


def _feedback_codes(lb: LayerBlocks, mat: torch.Tensor, grids: list[tuple], metric: torch.Tensor,
                    act_order: bool, cd_passes: int, progress: bool) -> list[torch.Tensor]:
    """(out, d_in) error-feedback codes (then ``cd_passes`` sweeps of coordinate descent) of
    ``mat`` on each of ``grids``, the grids' rows stacked in each call. Rows split evenly into
    the metric's convolution groups are stacked group by group (each group's rows of every grid
    together), so every row keeps its group's metric."""
    k, groups = len(grids), (metric.shape[0] if metric.dim() == 3 else 1)
    out = [_codes_buffer(mat, grid) for grid in grids]
    chunks = row_chunks(*mat.shape, metric, copies=k)  # a large layer (a vocabulary projection) shows its own bar

    def stack(xs: list[torch.Tensor]) -> torch.Tensor:  # k x (r, d) -> (k r, d), group-major
        if k == 1:  # one grid: the rows as they are (no copy)
            return xs[0]
        r, d = xs[0].shape
        return torch.stack([x.reshape(groups, r // groups, d) for x in xs], 1).reshape(k * r, d)

    for rows in tqdm(chunks, desc=lb.name, disable=not progress or len(chunks) == 1, leave=False):
        idx = lb.element_groups(rows, mat.device)  # (r, d_in): the per-element grid of these rows
        m_rows = mat[rows].double()
        W = stack([m_rows] * k)
        scale, zero, maxq = (stack([g[i][idx] for g in grids]) for i in range(3))
        codes = error_feedback_groups(W, metric, scale, zero, maxq, act_order=act_order)
        if cd_passes:
            codes = coordinate_descent(W, metric, scale, zero, maxq, codes, passes=cd_passes, dtype=CD_DTYPE)
        per = codes.reshape(groups, k, -1, codes.shape[1]).unbind(1)  # k x (groups, r / groups, d)
        for buf, part in zip(out, per):
            buf[rows] = part.reshape(m_rows.shape)
    return out


def _solver_codes(lb: LayerBlocks, mat: torch.Tensor, grid: tuple, metric: torch.Tensor, solver,
                  progress: bool) -> torch.Tensor:
    """(out, d_in) codes of ``mat`` on ``grid`` from another rounding (``solver``), a row chunk at a time."""
    out = _codes_buffer(mat, grid)
    chunks = row_chunks(*mat.shape, metric)
    for rows in tqdm(chunks, desc=lb.name, disable=not progress or len(chunks) == 1, leave=False):
        idx = lb.element_groups(rows, mat.device)
        scale, zero, maxq = (x[idx] for x in grid)
        ids = torch.unique(idx)  # these rows' groups, ascending
        out[rows] = solver(mat[rows].double(), metric, scale, zero, maxq, groups=torch.searchsorted(ids, idx),
                           name=lb.name)
    return out
