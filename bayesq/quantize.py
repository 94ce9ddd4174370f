"""BayesQ end to end: posterior -> loss table -> allocation -> integer codes -> quantised model.

The quantised model is rebuilt from the stored encoding alone (codes plus per-group scales /
zero-points, or look-up tables), never from the float weights.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.allocation import ALLOCATORS, Problem
from bayesq.baselines.activations import InputStats, StatsSums, input_stats
from bayesq.bias_correction import BiasCorrection
from bayesq.blocks import (
    LayerBlocks, check_finite, check_model_finite, layer_blocks, quantizable_layers,
    unquantized_weights,
)
from bayesq.canonical import on_canonical
from bayesq.comparison import sequential_choice
from bayesq.config import (
    AllocationConfig, Allocator, BayesQConfig, CostTerms, Curvature, DistillConfig, Objective, PosteriorConfig, Proxy,
    QuantConfig, Rounding, Whitening,
)
from bayesq.distill import DistillResult, apply_distilled, distill
from bayesq.error_feedback import (
    LazyMetrics, coordinate_descent, damped_metrics, error_feedback_groups, feedback_gain, shared_factors,
)
from bayesq.evaluation import kl_per_input, log_probs, reference_log_probs
from bayesq.expected_loss import Book, LayerTable, LossTable, apply_mc_proxy, posterior_tables
from bayesq.forward import Batch, batch_size, first_inputs, kept_state, model_batches, pass_logits
from bayesq.memory import check as check_memory_fits, estimate as estimate_memory, release_freed
from bayesq.methods import Inputs, Outcome, read, register
from bayesq.output_offset import OutputOffset, fit_output_offset
from bayesq.posterior import ROWS_IN_PASS, Posterior, fit_posterior as _fit_posterior, input_moments
from bayesq.refit import refit_rows, refit_scales, row_equations
from bayesq.result import (
    Allocation, QuantizationResult, QuantizedWeight, load_quantized, quantized_copy,
)
from bayesq.storage import budget_bits


# ---- allocation ---------------------------------------------------------------------------------

def _floor_bits(name: str, floors: Mapping[str, int]) -> int:
    """Largest floor among the glob patterns ``name`` matches (0 if none)."""
    return max((b for pat, b in floors.items() if fnmatch.fnmatchcase(name, pat)), default=0)


def _candidates(table: LossTable, cfg: AllocationConfig):
    """Per-unit candidate arrays (n, nb): bits, loss, cost, validity (floors) and layer ids (NumPy, on
    the CPU: the allocators' bookkeeping; the table itself stays on the weights' device)."""
    loss, cost = (x.cpu().numpy().astype(np.float64) for x in table.arrays())
    bits = np.concatenate([np.tile(np.array(t.bits), (t.blocks.n_units, 1)) for t in table.layers])
    layer = np.concatenate([np.full(t.blocks.n_units, i) for i, t in enumerate(table.layers)])
    floor = np.concatenate([np.full(t.blocks.n_units, _floor_bits(t.blocks.name, cfg.floors)) for t in table.layers])
    valid = bits >= floor[:, None]
    empty = np.flatnonzero(~valid.any(1))
    if empty.size:
        t = table.layers[layer[empty[0]]]
        raise ValueError(f"allocation.floors asks layer '{t.blocks.name}' for at least {floor[empty[0]]} bits "
                         f"but the candidates are {list(t.bits)}; lower the floor or add a wider bit-width")
    return bits, loss, cost, valid, layer


def _latency_costs(cost: np.ndarray, bits: np.ndarray, n_weights: np.ndarray, penalty: float) -> np.ndarray:
    """Kernel-time model: storage bits plus ``penalty * n * b`` for bit-widths that do not divide 32."""
    return cost + penalty * n_weights[:, None] * bits * (32 % bits != 0)


def _ragged(order: np.ndarray, *tables: np.ndarray) -> list[list[list[float]]]:
    """Rows of each table restricted to ``order[b]`` (a list of column indices per row)."""
    return [[row[o].tolist() for row, o in zip(t, order)] for t in tables]


def _usable(cost: np.ndarray, valid: np.ndarray) -> list[np.ndarray]:
    """Per row: valid candidates sorted by cost, keeping the first of any equal-cost run."""
    out = []
    for c, v in zip(cost, valid):
        idx = np.flatnonzero(v)
        idx = idx[np.argsort(c[idx], kind="stable")]
        keep = np.concatenate([[True], np.diff(c[idx]) > 0])
        out.append(idx[keep])
    return out


def min_bits(table: LossTable, cfg: AllocationConfig = AllocationConfig()) -> float:
    """Storage bits of the cheapest allocation (every unit at its cheapest candidate at its floor)."""
    _, _, cost, valid, _ = _candidates(table, cfg)
    return float(np.where(valid, cost, np.inf).min(1).sum())


def allocate(table: LossTable, avg_bits: float, cfg: AllocationConfig = AllocationConfig(), seed: int = 0) -> Allocation:
    """Bit-width of every unit under ``avg_bits`` bits per quantised weight (all metadata counted).

    Candidates below a unit's floor (``cfg.floors``) are dropped; a unit whose candidate costs
    are not strictly ascending (a tiny unit where a LUT costs more than an 8-bit grid) keeps
    its candidates sorted by cost. ``cfg.penalty`` lambda is applied as
    ``lambda * (L_floor - L_min) / N`` loss per bit: ``L_floor`` the loss with every unit at its
    cheapest candidate, ``L_min`` with every unit at its least-loss one, N the number of
    weights; i.e. the allocation minimises ``(L - L_min) / (L_floor - L_min) + lambda * avg_bits``.

    Raises:
        ValueError: an infeasible budget (naming the minimum feasible one in bits per weight),
            or floors no candidate satisfies.
    """
    bits, loss, cost, valid, layer = _candidates(table, cfg)
    budget = budget_bits(avg_bits, table.n_weights)
    regular = bool(valid.all()) and bool((np.diff(cost, axis=1) > 0).all())
    order = None if regular else _usable(cost, valid)
    need = float(cost[:, 0].sum()) if regular else float(sum(c[o[0]] for c, o in zip(cost, order)))
    if need > budget:
        raise ValueError(
            f"budget of {avg_bits} bits/weight is infeasible: the cheapest encoding of these layers "
            f"needs {need / table.n_weights:.4f} bits/weight (lowest bit-width plus scales, zero-points, "
            "tables and headers, at the floors); raise the budget, lower the floors or use a larger group size"
        )
    widest = float(cost[:, -1].sum()) if regular else float(sum(c[o[-1]] for c, o in zip(cost, order)))
    binding = widest > budget
    if not binding and widest > need:  # one width per unit (a uniform variant) has nothing to trade
        warnings.warn(f"budget of {avg_bits} bits/weight does not bind: every unit at its widest candidate needs "
                      f"{widest / table.n_weights:.4f} bits/weight, so nothing is traded; lower the budget to compress",
                      stacklevel=2)
    l_floor = float(loss[:, 0].sum()) if regular else float(sum(r[o[0]] for r, o in zip(loss, order)))
    l_min = float(np.where(valid, loss, np.inf).min(1).sum())
    penalty = cfg.penalty * max(l_floor - l_min, 0.0) / table.n_weights
    n_unit = np.concatenate([[n for n, _ in t.blocks.unit_sizes()] for t in table.layers]).astype(np.float64)
    tables = (loss, cost, bits, _latency_costs(cost, bits, n_unit, cfg.unaligned_penalty))
    L, C, B, T = tables if regular else _ragged(order, *tables)
    problem = Problem(L, C, budget, penalty, density_costs=T if cfg.latency else None, layer=layer.tolist(),
                      bits=B if not regular else B.tolist(), tolerance=cfg.hw_tolerance, seed=seed)
    try:
        pick = ALLOCATORS[Allocator(cfg.allocator).value](problem)
    except ValueError as err:
        if cfg.latency and "density_costs" in str(err):
            raise ValueError(f"allocation.unaligned_penalty = {cfg.unaligned_penalty}: the predicted kernel "
                             "time must grow with the bit-width; lower it (below 1/3 for bits 3 and 4)") from None
        raise
    col = np.asarray(pick) if regular else np.array([o[j] for o, j in zip(order, pick)])
    rows = np.arange(col.size)
    chosen = bits[rows, col]
    unit_bits, k = {}, 0
    for t in table.layers:
        n = t.blocks.n_units
        unit_bits[t.blocks.name] = tuple(int(b) for b in chosen[k:k + n])
        k += n
    total = int(sum(cost[rows, col].tolist()))
    return Allocation(unit_bits, total, table.n_weights, budget, float(loss[rows, col].sum()), binding)


def loss_reduction_curve(
    table: LossTable, avg_bits: float, cfg: AllocationConfig = AllocationConfig(),
    fractions: tuple[float, ...] = (0.2, 0.4, 0.6),
) -> dict[float, float]:
    """Diminishing returns: share of the expected-loss reduction (cheapest allocation -> the one
    at ``avg_bits``) reached after spending each fraction of the bits between the two."""
    n = table.n_weights
    full = allocate(table, avg_bits, cfg)
    floor_bits = min_bits(table, cfg)
    cheapest = allocate(table, (floor_bits + 0.5) / n, cfg)
    drop = cheapest.expected_loss - full.expected_loss
    out = {}
    for f in fractions:
        part = allocate(table, (floor_bits + f * (full.total_bits - floor_bits) + 0.5) / n, cfg)
        out[f] = (cheapest.expected_loss - part.expected_loss) / drop if drop > 0 else 1.0
    return out


# ---- encoding -----------------------------------------------------------------------------------

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
CD_DTYPE = torch.float32  # coordinate descent's D H: half float64's time, the same cost to 2e-6 (benchmarks/cd_dtype.py)


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
    ``W``: the (out, d_in) weight in its own dtype, widened to float64 where read. When every row holds whole groups, the rows' normal equations are built in :func:`row_chunks`
    (``refit.refit_rows``: the same scales, float64 working copies the size of a chunk)."""
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
    return _reads_stats(q, bool(posterior.kfac))


def _reads_stats(q: QuantConfig, kfac: bool) -> bool:
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
        stats = _input_stats(posterior, model, calibration, progress)
    return damped_metrics({name: stats[name].H for name in posterior.mean}, damp)


def _input_stats(posterior: Posterior, model: nn.Module | None, calibration: Iterable[Batch] | None,
                 progress: bool) -> dict[str, InputStats]:
    if model is None or calibration is None:
        raise ValueError("error-feedback rounding with a diagonal posterior and bias correction need the model and "
                         "calibration batches (the layers' input second moments and means)")
    layers = {name: model.get_submodule(name) for name in posterior.mean}
    return input_stats(model, calibration, layers, progress=progress, abs_mean=False)


def _stats_of(stats: Mapping[str, InputStats], posterior: Posterior) -> dict[str, InputStats]:
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
            metric = _layer_metric(name, rounding, column_metric, posterior)
            out[name] = encode_layer(t, allocation.unit_bits[name], weights[name], metric, **opts)
        release_freed()
    return out


def _layer_metric(name: str, rounding: Rounding, column_metric: Mapping[str, torch.Tensor] | None,
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


def grid_candidates(q: QuantConfig, held_out: bool = False) -> dict[str, QuantConfig]:
    """The encodings :func:`encode_best` builds: ``q`` itself (``searched`` clipping, or
    ``minmax`` when ``q.min_range_ratio = 1``) and, when ``q.selects_grids``, one other:

    * with ``held_out`` (candidates scored on inputs they were not fitted on) and
      ``q.feeds_back_table``, the other range search of the error-feedback table:
      ``searched-plain`` (``feedback_search: false``) when ``q`` searches with the gains, else
      ``searched-gained``. Neither search wins on every model, and only held-out inputs tell
      which one wins: scored on the calibration inputs, this candidate was kept where the test KL
      was worse (docs/method.md, section 18d);
    * otherwise ``minmax``: min/max grids (``min_range_ratio = 1``, GPTQ's) without the scale
      refit. With the other search on held-out inputs min/max is not built: in the default
      run it never had the lowest selection KL, and where the rule kept it the other search's
      test KL was the same (docs/method.md, section 18d), while each candidate costs an
      encoding and a pass over the selection inputs.
    """
    out = {"searched" if q.min_range_ratio < 1 else "minmax": q}
    if not q.selects_grids:
        return out
    if held_out and q.feeds_back_table:
        other = "searched-plain" if q.feedback_search else "searched-gained"
        out[other] = replace(q, feedback_search=not q.feedback_search)
    else:
        out["minmax"] = replace(q, min_range_ratio=1.0, refit=False, select_grids=False)
    return out


def candidate_tables(
    posterior: Posterior, blocks: list[LayerBlocks], q: QuantConfig, *, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None,
    column_metric: Mapping[str, torch.Tensor] | None = None, progress: bool = False,
    only: Mapping[str, QuantConfig] | None = None,
) -> dict[str, LossTable]:
    """The loss tables of :func:`grid_candidates` (``held_out=True``: every candidate a selection
    can score) other than ``q``'s own, by candidate name: what :func:`encode_best` builds per call
    when not given them. ``only``: just these candidates (name -> config). Arguments as
    :func:`build_table`."""
    cands = only if only is not None else {k: c for k, c in grid_candidates(q, held_out=True).items() if c is not q}
    return build_tables(posterior, blocks, cands, seed=seed, model=model, calibration=calibration, progress=progress,
                        column_metric=column_metric)


@dataclass(frozen=True)
class Encoding:
    """The allocated and encoded candidate :func:`encode_best` kept.

    Attributes:
        name: its :func:`grid_candidates` name.
        quant: its configuration.
        table, allocation, weights: its loss table, allocation and encoded layers.
        selection_kl: candidate name -> mean ``KL(p_FP || p_Q)`` on the inputs it was scored on
            (``selection``, else the calibration inputs; empty: one candidate).
        correction: the bias correction :func:`quantized_copy` applies (None: ``quant.bias_correction`` off).
        selection_margin: candidate name -> 95 % paired-bootstrap interval (low, high) of its mean
            KL minus the anchor's on those inputs (``minmax`` when built, else ``q``'s own
            grids); a candidate is kept over the anchor only when ``high < 0``
            (:func:`bayesq.comparison.resolved_choice`).
        selection_inputs: candidate name -> the inputs it was scored on: the first look's
            (:func:`selection_looks`) for a candidate resolved worse than the anchor there, and
            for the anchor too when no other was left; else all of them.
        scored_logits: the kept candidate's (B, C) float32 logits on each scored batch, in
            order, when the selection scored it on all of them and its logits have no token axis
            (the output offset's fit reads them instead of running the model again: the same
            logits bit for bit); else None.
    """

    name: str
    quant: QuantConfig
    table: LossTable
    allocation: Allocation
    weights: dict[str, QuantizedWeight]
    selection_kl: Mapping[str, float]
    correction: BiasCorrection | None = None
    selection_margin: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    selection_inputs: Mapping[str, int] = field(default_factory=dict)
    scored_logits: Sequence[torch.Tensor] | None = None


SELECTION_FIRST_LOOK = 0.25  # share of the scored inputs in the selection's first look ...
SELECTION_LOOK_MIN = 256  # ... and at least this many, else one look on every input


def first_look_inputs(n: int, batch: int = 1) -> int:
    """Inputs in the first look of a selection over ``n`` inputs in batches of ``batch`` (the
    last may be shorter): ``max(SELECTION_LOOK_MIN, SELECTION_FIRST_LOOK * n)`` rounded up to
    whole batches, or all ``n`` (one look) when that is more than half. Batches meant for a
    selection should draw these inputs at random from the ``n`` (padding order only inside each
    look), so that the early stop sees a sample of all of them."""
    need = max(SELECTION_LOOK_MIN, SELECTION_FIRST_LOOK * n)
    return n if 2 * need > n else min(n, math.ceil(need / batch) * batch)


def selection_looks(batches: Sequence[Batch]) -> int:
    """Batches in the first look of :func:`bayesq.comparison.sequential_choice` over ``batches``:
    the fewest that hold ``max(SELECTION_LOOK_MIN, SELECTION_FIRST_LOOK * N)`` of the N inputs;
    all of them (one look) when that is more than half (:func:`first_look_inputs`)."""
    sizes = [batch_size(b) for b in batches]
    need = first_look_inputs(sum(sizes))
    return len(sizes) if need == sum(sizes) else int(np.searchsorted(np.cumsum(sizes), need)) + 1


def encode_best(
    model: nn.Module, posterior: Posterior, table: LossTable, q: QuantConfig, budget: float,
    allocation_cfg: AllocationConfig = AllocationConfig(), *, seed: int = 0,
    calibration: Iterable[Batch] | None = None, column_metric: Mapping[str, torch.Tensor] | None = None,
    correction: BiasCorrection | None = None, progress: bool = False,
    stats: Mapping[str, InputStats] | None = None, selection: Iterable[Batch] | None = None,
    reference: Sequence[torch.Tensor] | None = None, tables: Mapping[str, LossTable] | None = None,
) -> Encoding:
    """Allocate and encode ``table`` (built for ``q``); with ``q.selects_grids`` also the other
    candidates of :func:`grid_candidates` (their tables built here), each scored by its
    per-input ``KL(p_FP || p_Q)`` after its bias correction (``q.bias_correction``) on
    ``selection`` (inputs held out of the fit, e.g.
    :func:`bayesq.harness.data.calibration.sample_selection_indices`; they admit the other range search
    as the second candidate), else on ``calibration`` (the second candidate: min/max grids). The
    ``minmax`` grids when built, else ``q``'s own, are kept unless the other candidate's mean KL
    is lower by a resolved margin (95 % paired-bootstrap interval of the difference below zero,
    :func:`bayesq.comparison.resolved_choice`), scored in two looks
    (:func:`bayesq.comparison.sequential_choice`, :func:`selection_looks`): a candidate resolved
    worse than the anchor on the first quarter of the inputs is not scored on the rest.

    ``column_metric``: :func:`ef_column_metric` of ``q``; ``correction``: :func:`bias_correction`
    (each computed here when None and needed, from ``stats``: the layers' input statistics
    :func:`bayesq.baselines.activations.input_stats` on ``calibration``, one pass here when None).
    ``reference``: the FP model's log-probabilities on the scored inputs
    (:func:`bayesq.evaluation.reference_log_probs`), computed here when None (per-token logits:
    an :class:`bayesq.evaluation.FPReference`, the FP model run again on each scored batch). ``tables``: the
    other candidates' tables by name (:func:`candidate_tables`; they do not depend on the
    budget, so a caller encoding several budgets builds them once); those absent are built here.
    """
    cands = encode_candidates(model, posterior, table, q, budget, allocation_cfg, seed=seed, calibration=calibration,
                              column_metric=column_metric, correction=correction, progress=progress, stats=stats,
                              selection=selection, tables=tables)
    return select_encoding(model, cands, reference=reference, progress=progress)


@dataclass(frozen=True)
class Candidates:
    """Every grid candidate of :func:`encode_best` allocated and encoded, not yet scored.

    Attributes:
        built: candidate name (:func:`grid_candidates` order) -> (its configuration, loss table,
            allocation, encoded layers).
        correction: the bias correction each is scored and deployed with (None: off).
        scored: the input batches a selection scores them on (``selection``, else the calibration
            batches); None when there is one candidate and no calibration.
    """

    built: Mapping[str, tuple[QuantConfig, LossTable, Allocation, dict[str, QuantizedWeight]]]
    correction: BiasCorrection | None
    scored: list[Batch] | None


def encode_candidates(
    model: nn.Module, posterior: Posterior, table: LossTable, q: QuantConfig, budget: float,
    allocation_cfg: AllocationConfig = AllocationConfig(), *, seed: int = 0,
    calibration: Iterable[Batch] | None = None, column_metric: Mapping[str, torch.Tensor] | None = None,
    correction: BiasCorrection | None = None, progress: bool = False,
    stats: Mapping[str, InputStats] | None = None, selection: Iterable[Batch] | None = None,
    tables: Mapping[str, LossTable] | None = None, consume_metric: bool = False,
) -> Candidates:
    """The first half of :func:`encode_best` (same arguments): every candidate allocated and
    encoded. Nothing it returns refers to ``posterior`` or ``column_metric``, so a caller can
    release them (model-sized at scale) before :func:`select_encoding` scores the candidates.

    ``consume_metric``: ``column_metric`` (a :class:`LazyMetrics`) is the caller's to give away:
    each layer's input moment is released once every candidate has encoded the layer, so that
    the moments of the layers done are not held while the rest are encoded."""
    layers = {t.blocks.name: model.get_submodule(t.blocks.name) for t in table.layers}
    weights = {n: m.weight for n, m in layers.items()}
    selection = list(selection) if selection is not None else None
    if selection is not None and not selection:
        raise ValueError("selection= is empty: pass held-out input batches to score the grid candidates on, "
                         "or None to score them on the calibration inputs")
    cands = grid_candidates(q, held_out=selection is not None)
    if len(cands) > 1 or needs_input_stats(posterior, q):
        calibration = list(calibration) if calibration is not None else None
    if len(cands) > 1 and not (selection or calibration):
        raise ValueError("quant.select_grids scores each candidate's KL on the calibration inputs, but none were "
                         "given: pass calibration= batches, or set quant.select_grids: false")
    scored = selection if selection is not None else calibration
    need_metric = column_metric is None and Rounding(q.rounding) == Rounding.ERROR_FEEDBACK and not posterior.kfac
    need_correction = correction is None and q.bias_correction
    if need_metric or need_correction:
        stats = (_input_stats(posterior, model, calibration, progress) if stats is None
                 else _stats_of(stats, posterior))
        if need_metric:
            column_metric = ef_column_metric(posterior, q, stats=stats)
        if need_correction:
            correction = bias_correction(model, stats, calibration)
    if column_metric is None:
        column_metric = ef_column_metric(posterior, q)  # the K-FAC posterior's, or None
    blocks = [t.blocks for t in table.layers]
    given = {**(tables or {}), **{k: table for k, cq in cands.items() if cq is q}}
    missing = {k: v for k, v in cands.items() if k not in given}
    if missing:
        given |= candidate_tables(posterior, blocks, q, seed=seed, model=model, calibration=calibration,
                                  column_metric=column_metric, progress=progress, only=missing)
    built = {name: (cq, given[name], allocate(given[name], budget, allocation_cfg, seed), {})
             for name, cq in cands.items()}
    bar = f"encode ({Rounding(q.rounding).value}" + (f", {len(cands)} candidates)" if len(cands) > 1 else ")")
    for lb in tqdm(blocks, desc=bar, disable=not progress, leave=False):
        with shared_factors():  # every candidate's rounding of this layer: one factor, one metric held
            metric = _layer_metric(lb.name, q.rounding, column_metric, posterior)
            same: dict[tuple, list] = {}  # candidates that round alike are encoded in one stacked call
            for cq, t, allocation, qw in built.values():
                key = (cq.rounding, cq.act_order, cq.refit, cq.scale_bits, cq.cd_passes)
                same.setdefault(key, []).append((t.layer(lb.name), allocation.unit_bits[lb.name], qw))
            for (rounding, act_order, refit, scale_bits, cd_passes), group in same.items():
                encoded = encode_layer_candidates(
                    [(t, bits) for t, bits, _ in group], weights[lb.name], metric, rounding=rounding,
                    act_order=act_order, refit=refit, scale_bits=scale_bits, cd_passes=cd_passes, progress=progress)
                for (_, _, qw), enc in zip(group, encoded):
                    qw[lb.name] = enc
            del metric
        if consume_metric and isinstance(column_metric, LazyMetrics):
            column_metric.release(lb.name)
        release_freed()
    return Candidates(built, correction, scored)


def select_encoding(model: nn.Module, cands: Candidates, *, reference: Sequence[torch.Tensor] | None = None,
                    progress: bool = False) -> Encoding:
    """The second half of :func:`encode_best`: the candidate kept by the selection rule described
    there, scored on ``cands.scored`` against ``model`` (``reference``: as in :func:`encode_best`)."""
    built, correction, scored = cands.built, cands.correction, cands.scored
    if len(built) == 1:
        return Encoding(next(iter(built)), *next(iter(built.values())), {}, correction)
    fp = {}  # the FP log-probabilities of each look's batches
    scored_logits: dict[str, list[torch.Tensor]] = {}  # each candidate's, by-products of its scores
    scoring = [None, copy.deepcopy(model)]  # one quantised copy, holding the candidate named first

    def score(name: str, part: slice) -> torch.Tensor:
        key = (part.start, part.stop)
        if key not in fp:
            fp[key] = (reference[part] if reference is not None else
                       reference_log_probs(model, scored[part], "FP on the selection inputs" if progress else None))
        if scoring[0] != name:  # exactly quantized_copy(model, its encoding, correction)
            load_quantized(scoring[1], model, built[name][3], correction)
            scoring[0] = name
        return kl_per_input(fp[key], scoring[1].eval(), scored[part], f"selection KL ({name})" if progress else None,
                            logits=scored_logits.setdefault(name, []))

    anchor = "minmax" if "minmax" in built else next(iter(built))
    if reference is not None and len(reference) != len(scored):
        raise ValueError(f"reference has {len(reference)} batches of log-probabilities for {len(scored)} input "
                         "batches: pass reference_log_probs of the same batches, in the same order")
    kept, margins, kls = sequential_choice(score, list(built), anchor, selection_looks(scored), len(scored))
    cq, t, allocation, qw = built[kept]
    kept_lp = scored_logits.get(kept) or None
    if kept_lp is not None and sum(len(z) for z in kept_lp) != sum(batch_size(b) for b in scored):
        kept_lp = None  # scored on the first look only
    return Encoding(kept, cq, t, allocation, qw, {k: float(v.mean()) for k, v in kls.items()}, correction,
                    {k: (d.ci_low, d.ci_high) for k, d in margins.items()}, {k: len(v) for k, v in kls.items()},
                    kept_lp)


# ---- posterior and table --------------------------------------------------------------------------

@on_canonical
def fit_posterior(
    model: nn.Module, calibration: Iterable[Batch], config: BayesQConfig, progress: bool = True,
    *, exclude: Sequence[str] = (),
) -> Posterior:
    """Label-free posterior of the model's Linear/Conv2d weights (``config.posterior.curvature``)
    but those ``exclude`` matches (names or glob patterns, as :func:`quantize_model`); batches and
    errors as :func:`quantize_model` (the same split of batches in the curvature pass, so the same
    posterior), and ``model`` comes back as it was."""
    layers = quantizable_layers(model, tuple(exclude))
    check_finite(layers)
    check_model_finite(model)
    with kept_state(model):
        model.eval()
        batches = model_batches(model, calibration)
        need = estimate_memory(model, layers, batches) if batches and layers else None
        return _fit_posterior(model, batches, layers, config.posterior, seed=config.seed, progress=progress,
                              max_inputs=need and need.pass_inputs)


def posterior_and_stats(
    model: nn.Module, calibration: Iterable[Batch], layers: dict[str, nn.Module], cfg: PosteriorConfig,
    q: QuantConfig, *, seed: int = 0, progress: bool = True, max_inputs: int | None = None,
    logits: list[torch.Tensor | None] | None = None,
) -> tuple[Posterior, dict[str, InputStats] | None]:
    """The posterior of ``layers`` and, when :func:`needs_input_stats` says the encoding reads
    them, the layers' input statistics (else None): taken in the posterior's own pass when its
    curvature allows (:data:`bayesq.posterior.ROWS_IN_PASS`; the same sums as
    :func:`bayesq.baselines.activations.input_stats`, one pass fewer), else by one more forward
    pass. ``calibration``: re-iterable batches in the model's dtype; ``model`` in eval mode;
    ``max_inputs``: the most inputs the curvature pass holds at once
    (:func:`bayesq.posterior.fit_posterior`); ``logits``: a list that receives the model's logits
    of the curvature pass (:func:`bayesq.posterior.fit_posterior`)."""
    one_pass = Curvature(cfg.curvature) in ROWS_IN_PASS  # diagonal: the posterior has no K-FAC factors
    sums = StatsSums(abs_mean=False) if one_pass and _reads_stats(q, kfac=False) else None
    posterior = _fit_posterior(model, calibration, layers, cfg, seed=seed, progress=progress, on_rows=sums,
                               max_inputs=max_inputs, logits=logits)
    if not needs_input_stats(posterior, q):
        return posterior, None
    if sums is not None:
        return posterior, sums.stats(layers, posterior.n_examples)
    return posterior, _input_stats(posterior, model, calibration, progress)


def build_table(
    posterior: Posterior, blocks: list[LayerBlocks], q: QuantConfig, *, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None, progress: bool = True,
    column_metric: Mapping[str, torch.Tensor] | None = None,
) -> LossTable:
    """Loss table for ``q``: closed form, then the Monte Carlo proxy if chosen.

    ``model`` and ``calibration`` are read only when ``q.needs_data`` (the PCA metric's input
    moments, the error-feedback metric of ``quant.feedback_table``, the logit-KL proxy's
    inputs); ``seed`` seeds the Monte Carlo draws; ``column_metric`` (from
    :func:`ef_column_metric`) saves recomputing the error-feedback metric.
    """
    return build_tables(posterior, blocks, {"": q}, seed=seed, model=model, calibration=calibration,
                        progress=progress, column_metric=column_metric)[""]


def build_tables(
    posterior: Posterior, blocks: list[LayerBlocks], configs: Mapping[str, QuantConfig], *, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None, progress: bool = True,
    column_metric: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, LossTable]:
    """:func:`build_table` of each configuration, by name (arguments as there): the same tables as
    one call each. Configurations that differ only in ``feedback_search`` (the grid candidates of
    :func:`grid_candidates` with held-out inputs) are tabulated layer by layer together
    (:func:`bayesq.expected_loss.posterior_tables`: their range searches score the ratio grid once)."""
    batches = None
    needy = next((q for q in configs.values() if q.needs_data), None)
    if needy is not None:
        if model is None or calibration is None:
            raise ValueError(f"quant.whitening = '{needy.whitening.value}' / quant.proxy = '{needy.proxy.value}' / "
                             f"quant.feedback_table = {needy.feedback_table} read calibration data: pass model= "
                             "and calibration=")
        batches = list(calibration)
    groups: dict[QuantConfig, list[str]] = {}
    for name, q in configs.items():
        groups.setdefault(replace(q, feedback_search=False), []).append(name)
    out = {}
    for names in groups.values():
        qs = [configs[n] for n in names]
        q = qs[0]
        input_diag = None
        if q.whitening == Whitening.PCA:
            layers = {lb.name: model.get_submodule(lb.name) for lb in blocks}
            input_diag, _ = input_moments(model, batches, layers)
        gains = None
        if q.feeds_back_table:
            metric = column_metric if column_metric is not None else ef_column_metric(posterior, q, model, batches)
            gains = feedback_gains(posterior, q, metric)
        for name, cq, table in zip(names, qs, posterior_tables(posterior, blocks, qs, progress, input_diag, gains)):
            out[name] = _proxied(table, posterior, cq, seed, batches, model, progress)
    return {name: out[name] for name in configs}


def _proxied(table: LossTable, posterior: Posterior, q: QuantConfig, seed: int, batches: list[Batch] | None,
             model: nn.Module | None, progress: bool) -> LossTable:
    """``table`` with ``q.proxy``'s Monte Carlo entries when one is chosen."""
    if q.proxy == Proxy.MC_KL:
        few = first_inputs(batches, q.mc_examples)
        return apply_mc_proxy(table, posterior, q, kind="kl", model=model, batches=few,
                              n_kl=sum(batch_size(b) for b in few), seed=seed, progress=progress)
    if q.proxy == Proxy.MC_OUTPUT:
        return apply_mc_proxy(table, posterior, q, kind="output", seed=seed, progress=progress)
    return table


def grid_tables(
    posterior: Posterior, blocks: list[LayerBlocks], q: QuantConfig, *, held_out: bool = True, seed: int = 0,
    model: nn.Module | None = None, calibration: Iterable[Batch] | None = None,
    column_metric: Mapping[str, torch.Tensor] | None = None, progress: bool = False,
) -> dict[str, LossTable]:
    """The loss tables of every candidate of :func:`grid_candidates` ``(q, held_out)``, ``q``'s own
    first, by candidate name, built together (:func:`build_tables`). Arguments as :func:`build_table`."""
    return build_tables(posterior, blocks, grid_candidates(q, held_out=held_out), seed=seed, model=model,
                        calibration=calibration, progress=progress, column_metric=column_metric)


@on_canonical
def quantize_model(
    model: nn.Module, calibration: Iterable[Batch], config: BayesQConfig = BayesQConfig(),
    *, posterior: Posterior | None = None, progress: bool | None = None, selection: Iterable[Batch] | None = None,
    exclude: Sequence[str] = (), check_memory: bool = True, keep_posterior: bool = False,
    reference: Sequence[torch.Tensor] | None = None, calibration_fp: Sequence[torch.Tensor] | None = None,
) -> QuantizationResult:
    """BayesQ: posterior -> expected-loss tables -> allocation -> quantised model.

    Args:
        model: any module built of Linear/Conv2d layers (others stay in floating point);
            it must return (B, C) logits, or per-token (B, T, V) logits (a causal language
            model: read on the real tokens of the batches' ``attention_mask``,
            :mod:`bayesq.forward`), as a tensor, an object with ``.logits``, a dict with
            ``"logits"`` or a tuple whose first element is the logits.
        calibration: iterable of input batches: tensors, dicts of tensors (keyword arguments)
            or ``(inputs, labels)`` tuples (labels are never read); floating inputs are cast to
            the model's dtype.
        config: budget (average bits per quantised weight, all metadata included), posterior,
            codebook, table, allocation and rounding settings, and the distillation applied at
            budgets up to ``config.distill.max_budget`` (0 by default: off; same codes and bits).
        posterior: a posterior fitted earlier (skips the curvature pass).
        progress: a bar over each step; None: ``config.progress``.
        selection: input batches held out of ``calibration`` (e.g. another draw of training
            inputs): the grid candidates are scored on them, which also admits the other range
            search as a candidate (:func:`grid_candidates`); None scores on ``calibration``.
        exclude: module names or glob patterns (``"classifier"``, ``"encoder.layer.0.*"``) kept in
            floating point; they are listed in the result's ``unquantized``.
        check_memory: before any work, estimate the peak memory (:mod:`bayesq.memory`) and stop
            with an error when the model's device has less free. The estimate also sets how
            many inputs the curvature pass holds at once (batches split so that its activations
            stay within ``bayesq.memory.PASS_BYTES`` / ``PART_BYTES``; the same sums up to float rounding).
        keep_posterior: return the posterior in the result (its ``posterior``; to distil or
            quantise at another budget without a second curvature pass). Off by default: it is as
            large as the model in float32, and it is released before the candidates are scored.
        reference: the FP model's log-probabilities on ``selection`` (else on ``calibration``),
            :func:`bayesq.evaluation.reference_log_probs` of those batches, where the caller has
            them; else computed once here and read by both the grid selection and the output
            offset's fit.
        calibration_fp: the FP model's logits on ``calibration``, one (B, C) tensor per batch,
            where the caller has them: the output offset's fit reads them instead of a forward pass.

    Returns:
        :class:`QuantizationResult` with the quantised copy of the model, the codes and
        codebooks of every layer, the allocation and its true average bits. ``model`` itself
        comes back as it was (modes, ``requires_grad``, ``.grad``).

    Raises:
        ValueError: NaN/Inf in a parameter, buffer or calibration input (naming it); an
            infeasible budget.
        TypeError: batches or model outputs of a kind the library cannot read (naming it).
        bayesq.memory.InsufficientMemoryError: the estimated peak exceeds the free memory
            (naming the estimate, its terms and what lowers each); nothing was changed.
    """
    with kept_state(model):
        model.eval()  # every pass reads the model as deployed (frozen BatchNorm, no dropout)
        progress = config.progress if progress is None else progress
        return _quantize_model(model, calibration, config, posterior, progress, selection, tuple(exclude),
                               check_memory, keep_posterior, reference, calibration_fp)


def _quantize_model(model, calibration, config, posterior, progress, selection, exclude,
                    check_memory, keep_posterior, reference, calibration_fp) -> QuantizationResult:
    layers = quantizable_layers(model, exclude)
    check_finite(layers)
    check_model_finite(model)
    q = config.quant
    blocks = layer_blocks(layers, q.group_size, q.unit_groups, q.unit.value, q.row_blocked)
    calibration = model_batches(model, calibration)
    selection = model_batches(model, selection, "selection")
    need = estimate_memory(model, layers, calibration) if calibration and layers else None
    if check_memory and need is not None:
        check_memory_fits(need, next(iter(layers.values())).weight.device)
    outputs: list[torch.Tensor | None] = []  # the FP model's logits of the curvature pass: read below, not recomputed
    if posterior is None:
        posterior, stats = posterior_and_stats(model, calibration, layers, config.posterior, q, seed=config.seed,
                                               progress=progress, max_inputs=need and need.pass_inputs,
                                               logits=outputs)
    else:
        stats = _input_stats(posterior, model, calibration, progress) if needs_input_stats(posterior, q) else None
    metric = ef_column_metric(posterior, q, model, calibration, progress=progress, stats=stats)
    correction = bias_correction(model, stats, calibration) if q.bias_correction else None
    del stats  # read by the two lines above only: its (d_in, d_in) sums need not wait for the end
    tables = grid_tables(posterior, blocks, q, held_out=selection is not None, seed=config.seed, model=model,
                         calibration=calibration, progress=progress, column_metric=metric)
    cands = encode_candidates(model, posterior, next(iter(tables.values())), q, config.budget, config.allocation,
                              seed=config.seed, calibration=calibration, column_metric=metric, correction=correction,
                              progress=progress, selection=selection, tables=tables, consume_metric=True)
    del tables
    # Model-sized and read by nothing from here on: the layers' input moments always, the
    # posterior unless it is returned or distillation's teacher.
    del metric
    if not (keep_posterior or config.distill.applies(config.budget)):
        posterior = None
    release_freed()
    # the FP model's (B, C) logits on the calibration inputs (model dtype), from the curvature pass
    fp = pass_logits(outputs, calibration) if calibration else None
    del outputs
    if reference is None and (len(cands.built) > 1 or (selection and q.output_offset and calibration)):
        # one FP pass over the scored inputs, read by the selection and by the offset's fit (on
        # the calibration inputs, the curvature pass has made it)
        label = f"FP on the {'selection' if selection else 'calibration'} inputs"
        reference = ([log_probs(z) for z in fp] if fp is not None and not selection
                     else reference_log_probs(model, cands.scored, label if progress else None))
    enc = select_encoding(model, cands, reference=reference, progress=progress)
    del cands
    # the offset's fit reads both models' outputs on the scored inputs from the selection's scores
    # (on the held-out inputs when there are some, else on the calibration inputs), the FP model's
    # on the calibration inputs from the curvature pass (float32, as predict gives them)
    if calibration_fp is None:
        calibration_fp = reference if reference is not None and not selection else (
            None if fp is None else [z.float() for z in fp])
    if selection:
        offset_inputs = dict(selection_fp=reference, selection_q=enc.scored_logits, calibration_fp=calibration_fp)
    else:
        offset_inputs = dict(calibration_fp=calibration_fp, calibration_q=enc.scored_logits)
    qmodel, weights, _, offset = assemble(model, enc, posterior, calibration, config.distill, config.budget,
                                          config.seed, progress, selection=selection, **offset_inputs)
    return QuantizationResult(qmodel, weights, enc.allocation, enc.table, posterior if keep_posterior else None,
                              enc.name, enc.selection_kl, correction, unquantized_weights(model, layers, exclude),
                              offset)


@register(BayesQConfig)
def bayesq_method(model: nn.Module, config: BayesQConfig, budget: float, inputs: Inputs) -> Outcome:
    """:func:`quantize_model` at ``budget`` (``config.budget`` is replaced) on the calibration and
    selection batches; ``details``: the grids kept (``encoding``) and each candidate's selection KL."""
    res = quantize_model(model, inputs.need_calibration("BayesQ"), replace(config, budget=budget),
                         selection=inputs.selection, exclude=tuple(inputs.exclude), reference=inputs.reference,
                         calibration_fp=inputs.calibration_fp)
    fitted = res.output_offset is not None and res.output_offset.fitted
    # the selection scores several candidates against the reference; the offset's fit reads it as
    # the FP side of the held-out inputs
    scored = bool(res.selection_kl) or (fitted and inputs.selection is not None)
    return Outcome(res, {"encoding": res.encoding, "encoding_kl": dict(res.selection_kl)},
                   (read(inputs, "reference") if scored else frozenset())
                   | (read(inputs, "calibration_fp") if fitted else frozenset()))


def assemble(
    model: nn.Module, enc: Encoding, posterior: Posterior | None, calibration: Sequence[Batch] | None,
    distill_cfg: DistillConfig | None, budget: float, seed: int = 0, progress: bool = False, *,
    selection: Sequence[Batch] | None = None, selection_fp: Sequence[torch.Tensor] | None = None,
    calibration_fp: Sequence[torch.Tensor] | None = None, selection_q: Sequence[torch.Tensor] | None = None,
    calibration_q: Sequence[torch.Tensor] | None = None,
) -> tuple[nn.Module, dict[str, QuantizedWeight], DistillResult | None, OutputOffset | None]:
    """The last stage: the model running ``enc`` (a copy; its bias correction applied), its
    scales distilled to the posterior teacher first when ``distill_cfg.applies(budget)``
    (:func:`bayesq.distill.distill` on ``calibration``; the correction is then applied only if
    distillation trained no bias, which already fits the mean), then its output layer's bias
    refitted to the FP model's mean prediction on ``calibration`` and the held-out ``selection``
    inputs when ``enc.quant.output_offset`` (:func:`bayesq.output_offset.fit_output_offset`,
    ``selection_fp``: the FP model's log-probabilities on ``selection``, ``calibration_fp`` its
    logits on ``calibration``, ``selection_q`` / ``calibration_q`` the logits or log-probabilities
    of ``enc``'s model on ``selection`` / ``calibration`` (:attr:`Encoding.scored_logits`; not
    read when distillation changes that model), if the caller has them; not without calibration
    batches).

    Returns:
        (quantised model, the encoded layers it runs, the :class:`DistillResult` or None, the
        :class:`OutputOffset` applied or None).
    """
    if distill_cfg is None or not distill_cfg.applies(budget):
        qmodel, weights, res = quantized_copy(model, enc.weights, enc.correction), enc.weights, None
    else:
        selection_q = calibration_q = None  # the scored model's outputs, not the distilled one's
        if posterior is None or calibration is None:
            raise ValueError("distillation needs the posterior (its teacher) and calibration batches")
        res = distill(model, enc.weights, posterior, calibration, distill_cfg, scale_bits=enc.quant.scale_bits,
                      lut_bits=enc.quant.lut_bits, seed=seed, progress=progress)
        qmodel, weights = apply_distilled(model, res), res.weights
        if enc.correction is not None and not res.biases:
            enc.correction.apply(qmodel, model)
    offset = None
    if enc.quant.output_offset and calibration:
        offset = fit_output_offset(model, qmodel, calibration, progress, selection=selection,
                                   selection_fp=selection_fp, selection_q=selection_q, calibration_fp=calibration_fp,
                                   calibration_q=calibration_q)
        offset.apply(qmodel)
    return qmodel, weights, res, offset
