"""GPTQ (Frantar et al. 2022): error-feedback rounding under the layer-input Hessian.

For each Linear/Conv2d layer (Conv2d on unfolded patches; grouped Conv2d per group) GPTQ
minimises the calibration layer-output error ``tr(D H D^T)``, ``H = (1/N) sum a a^T``
(:mod:`bayesq.baselines.activations`), column by column with the OBS update of the not yet
quantised columns. The solver is BayesQ's own :func:`bayesq.error_feedback.error_feedback_groups`
(shared, as docs/method.md section 2 allows), with GPTQ's choices:

* dampening ``H + damp * mean(diag H) * I`` (``damp = 0.01``); dead inputs (``H_jj = 0``)
  get ``H_jj = 1`` first, as in the reference implementation;
* act-order: columns by decreasing ``H_jj``;
* lazy block updates of 128 columns;
* min/max grids per output channel or per group of ``group_size`` consecutive weights, fitted
  on the original weights before the sweep (GPTQ's ``static_groups``, which keeps the grids
  fixed under act-order).

Fractional budgets (``3.5`` bits is no single bit-width once scales are counted) are met by
GPTQ's mixed rule here: the greedy knapsack over units of about ``group_size * unit_groups``
weights with loss ``sum_{o,j} H_jj (Q_b(w_oj) - w_oj)^2`` (the diagonal of GPTQ's objective)
under BayesQ's exact storage accounting. :func:`gptq_select` instead picks, on the calibration
inputs, the best of that rule, uniform bit-widths with the smallest group size that fits, and
an externally supplied allocation (:mod:`bayesq.baselines.select`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from bayesq.assignment import allocate
from bayesq.baselines.activations import InputStats
from bayesq.baselines.select import (
    GROUP_SIZES, BaselineChoice, baseline_blocks, cheapest_bits, check_feasible, choice_outcome, given_allocation,
    group_sizes_setting, mixed_min_bits, mixed_outcome, select_variants, stats_of, uniform_variants,
)
from bayesq.blocks import LayerBlocks, checked_layers, layer_blocks
from bayesq.canonical import on_canonical
from bayesq.config import Granularity, QuantConfig, Rounding
from bayesq.context import KnownOutputs
from bayesq.error_feedback import LazyMetrics, damped_metric, damped_metrics
from bayesq.expected_loss import LossTable, rtn_table
from bayesq.forward import Batch
from bayesq.memory import LazyMap
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import Allocation, QuantizationResult, QuantizedWeight, baseline_result
from bayesq.rounding import encode
from bayesq.settings import setting, validate, within
from bayesq.storage import budget_bits

DAMP = 0.01

#: (rows W (out, d_in), column metric, scale, zero, maxq (out, d_in), *, groups=(out, d_in) group index,
#: name=layer) -> (out, d_in) int64 codes; a solver that needs no groups takes them as ``**_``
Solver = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerRounding:
    """How a layer's rows are rounded on their fixed grids, for methods that share GPTQ's grids,
    budgets and variants and differ in the rounding (AdaRound) or learn the grids (LSQ):
    ``metric(stats, out)`` maps a layer's input statistics and output features to the column
    metric handed to ``solver`` and ``grid_fit``; ``grid_fit``: each group's grid learned from
    its min/max one before the rounding (:func:`bayesq.rounding.encode`); ``refine(layers,
    encodings)``: the encodings of every layer, rounded layer by layer, re-rounded jointly on the
    same grids (BRECQ's block reconstruction, :mod:`bayesq.baselines.brecq`); ``refit``: each
    group's scale refitted to the codes in ``metric`` (Bit-Split, :mod:`bayesq.baselines.bitsplit`);
    ``method`` names it in errors."""

    method: str
    metric: Callable[[InputStats, int], torch.Tensor]
    solver: Solver
    grid_fit: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    refine: Callable[[dict[str, nn.Module], dict[str, QuantizedWeight]], dict[str, QuantizedWeight]] | None = None
    refit: bool = False


def damped_hessian(H: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """GPTQ's dampening of (groups, d, d) or (d, d) float64 ``H``.

    Dead inputs (``H_jj = 0``) get ``H_jj = 1``; then ``H + damp * mean(diag H) * I`` per group
    (``I`` alone when the whole diagonal is 0).
    """
    return damped_metric(H, damp)


def _granularity(granularity: Granularity | str) -> Granularity:
    """``granularity`` as the enum; ``ValueError`` for per-tensor grids."""
    granularity = Granularity(granularity)
    if granularity == Granularity.TENSOR:
        raise ValueError("GPTQ quantises with per-channel or per-group grids; choose 'channel' or 'group'")
    return granularity


def gptq_table(layers: dict[str, nn.Module], stats: dict[str, InputStats], blocks: list[LayerBlocks],
               cfg: QuantConfig, progress: bool = False) -> LossTable:
    """Min/max grids of every candidate with GPTQ's mixed-rule loss ``sum H_jj (Q_b(w) - w)^2``."""
    weights = {n: m.weight for n, m in layers.items()}
    omega = LazyMap(layers, lambda n: stats[n].row_diag(layers[n].weight.shape[0]))  # (out, d_in), per layer
    return rtn_table(weights, blocks, cfg, element_weight=omega, progress=progress)


def gptq_codes(layers: dict[str, nn.Module], stats: dict[str, InputStats], table: LossTable, allocation: Allocation,
               act_order: bool, damp: float, rounding: LayerRounding | None = None, scale_bits: int = 16,
               progress: bool = False) -> dict[str, QuantizedWeight]:
    """GPTQ's error-feedback encodings of ``layers`` on the grids of ``allocation``'s bit-widths
    (``rounding``: another method's rounding of the same grids, or its grids learned and stored at
    ``scale_bits``, then its joint ``refine`` when it has one; ``progress``: a bar over the layers)."""
    if rounding is None:  # made per layer as encode reads it: one damped copy and factor held at a time
        metric, solver, grid_fit, refit = damped_metrics({n: stats[n].H for n in layers}, damp), None, None, False
    else:
        metric = LazyMetrics(layers, lambda n: rounding.metric(stats[n], layers[n].weight.shape[0]))
        solver, grid_fit, refit = rounding.solver, rounding.grid_fit, rounding.refit
    codes = encode(table, allocation, {n: m.weight for n, m in layers.items()},
                   rounding=Rounding.ERROR_FEEDBACK, column_metric=metric, act_order=act_order, solver=solver,
                   grid_fit=grid_fit, refit=refit, scale_bits=scale_bits, progress=progress)
    return codes if rounding is None or rounding.refine is None else rounding.refine(layers, codes)


def gptq_solve(model: nn.Module, layers: dict[str, nn.Module], stats: dict[str, InputStats], table: LossTable,
               allocation: Allocation, act_order: bool, damp: float, exclude: Sequence[str],
               rounding: LayerRounding | None = None, scale_bits: int = 16,
               progress: bool = False) -> QuantizationResult:
    """:func:`gptq_codes` as a baseline's result (the quantised copy of ``model``)."""
    qweights = gptq_codes(layers, stats, table, allocation, act_order, damp, rounding, scale_bits, progress)
    return baseline_result(model, layers, qweights, allocation, table, exclude)


@on_canonical
def gptq_quantize(
    model: nn.Module, stats: dict[str, InputStats], granularity: Granularity, budget: float,
    cfg: QuantConfig = QuantConfig(), *, act_order: bool = True, damp: float = DAMP, exclude: Sequence[str] = (),
    rounding: LayerRounding | None = None, progress: bool = False,
) -> QuantizationResult:
    """GPTQ at ``budget`` average bits (all metadata counted) with channel or group grids.

    Args:
        model: Linear/Conv2d layers are quantised; others stay in floating point.
        stats: :func:`bayesq.baselines.activations.input_stats` of the model's layers.
        granularity: ``channel`` (one grid per output row) or ``group`` (``cfg.group_size``).
        budget: average bits per quantised weight.
        exclude: module names or glob patterns kept in floating point (the result's
            ``unquantized``; they need no statistics).
        rounding: another method's rounding on the same grids (AdaRound), else error feedback.
        progress: a bar over the layers as they are encoded.

    Raises:
        ValueError: per-tensor granularity (GPTQ uses channel or group grids), missing stats,
            an infeasible budget, non-finite weights.
    """
    granularity = _granularity(granularity)
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model", exclude)
    table = gptq_table(layers, stats, baseline_blocks(layers, granularity, cfg), cfg, progress)
    return gptq_solve(model, layers, stats, table, allocate(table, budget), act_order, damp, exclude, rounding,
                      cfg.scale_bits, progress)


@on_canonical
def gptq_allocation_quantize(
    model: nn.Module, stats: dict[str, InputStats], unit_bits: Mapping[str, Sequence[int]], budget: float,
    cfg: QuantConfig = QuantConfig(), *, act_order: bool = True, damp: float = DAMP, exclude: Sequence[str] = (),
    rounding: LayerRounding | None = None, progress: bool = False,
) -> QuantizationResult:
    """GPTQ's error-feedback solver on a supplied allocation (e.g. BayesQ's ``Allocation.unit_bits``).

    Units are BayesQ's blocks for ``cfg`` (``layer_blocks(layers, cfg.group_size,
    cfg.unit_groups, cfg.unit)``) with min/max grids per group; the exact cost (codes, scales,
    zero-points, headers over ``cfg.bits``) must fit ``budget``.

    Args:
        unit_bits: layer name -> bit-width of each unit, every width in ``cfg.bits``.
        exclude, rounding, progress: as :func:`gptq_quantize`.

    Raises:
        ValueError: missing stats, a layer's unit count or a width not matching ``cfg``, a cost
            above the budget, non-finite weights.
    """
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model", exclude)
    table = gptq_table(layers, stats, layer_blocks(layers, cfg.group_size, cfg.unit_groups, cfg.unit.value, cfg.row_blocked), cfg,
                       progress)
    return gptq_solve(model, layers, stats, table, given_allocation(table, unit_bits, budget), act_order, damp,
                      exclude, rounding, cfg.scale_bits, progress)


@on_canonical
def gptq_candidates(
    model: nn.Module, stats: dict[str, InputStats], budget: float, cfg: QuantConfig = QuantConfig(), *,
    granularity: Granularity = Granularity.GROUP, group_sizes: Sequence[int] = GROUP_SIZES,
    allocation: Mapping[str, Sequence[int]] | None = None, act_order: bool = True, damp: float = DAMP,
    exclude: Sequence[str] = (), rounding: LayerRounding | None = None, progress: bool = False,
) -> dict[str, Callable[[], QuantizationResult]]:
    """Budget-feasible GPTQ variants (module docstring of :mod:`bayesq.baselines.select`), unbuilt.

    ``allocation`` (:func:`gptq_allocation_quantize`) unless ``allocation`` is None, ``mixed``
    (:func:`gptq_quantize` at ``granularity``) when its cheapest allocation fits and
    ``uniform-<b>-g<G>`` / ``uniform-<b>-channel`` for each width of ``cfg.bits`` with a fitting
    layout from ``group_sizes``, in that order. ``exclude``, ``rounding``, ``progress``: as :func:`gptq_quantize`.

    Raises:
        ValueError: missing stats, or no variant fits the budget (naming the minimum feasible one).
    """
    granularity = _granularity(granularity)
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model", exclude)
    n = sum(m.weight.numel() for m in layers.values())
    opts = dict(act_order=act_order, damp=damp, exclude=exclude, rounding=rounding, progress=progress)
    out: dict[str, Callable[[], QuantizationResult]] = {}
    if allocation is not None:  # first: usually the best, so the selection drops the others early
        out["allocation"] = partial(gptq_allocation_quantize, model, stats, allocation, budget, cfg, **opts)
    if mixed_min_bits(layers, granularity, cfg) <= budget_bits(budget, n):
        out["mixed"] = partial(gptq_quantize, model, stats, granularity, budget, cfg, **opts)
    for v in uniform_variants(layers, budget, cfg, group_sizes):
        out[v.name] = partial(gptq_quantize, model, stats, v.granularity, budget, v.config(cfg), **opts)
    check_feasible(out, rounding.method if rounding else "GPTQ", budget, cheapest_bits(layers, granularity, cfg, group_sizes))
    return out


@on_canonical
def gptq_select(
    model: nn.Module, stats: dict[str, InputStats], batches: Iterable[Batch], budget: float,
    cfg: QuantConfig = QuantConfig(), *, granularity: Granularity = Granularity.GROUP,
    group_sizes: Sequence[int] = GROUP_SIZES, allocation: Mapping[str, Sequence[int]] | None = None,
    act_order: bool = True, damp: float = DAMP, bias_correction: bool = False,
    selection: Iterable[Batch] | None = None, known: KnownOutputs | None = None,
    exclude: Sequence[str] = (), rounding: LayerRounding | None = None,
    progress: bool = False,
) -> BaselineChoice:
    """The GPTQ variant of :func:`gptq_candidates` with the least mean calibration
    ``KL(p_FP || p_Q)`` on ``batches`` (the inputs ``stats`` come from); ``bias_correction``:
    each variant also in its bias-corrected form, and the kept one's output offset refitted on
    ``batches`` and ``selection`` (:func:`bayesq.baselines.select.select_best`).
    ``selection``: inputs held out of ``batches`` to score the variants on instead (the
    bias correction is still fitted on ``batches``). ``known``: the FP model's outputs the caller
    has (its log-probabilities on the scored inputs, its logits on ``batches``: the offset's fit;
    :class:`bayesq.context.KnownOutputs`). ``rounding``: as
    :func:`gptq_quantize`. ``progress``: a bar over the variants, the layers each encodes and the
    scoring passes (:func:`select_best`).

    Raises:
        ValueError: as :func:`gptq_candidates`; an empty ``batches``.
    """
    cands = gptq_candidates(model, stats, budget, cfg, granularity=granularity, group_sizes=group_sizes,
                            allocation=allocation, act_order=act_order, damp=damp, exclude=exclude, rounding=rounding,
                            progress=progress)
    return select_variants(cands, model, stats, batches, bias_correction, selection, known, progress)


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ (:func:`gptq_quantize`); with ``select`` the variant of :func:`gptq_select` with the
    least KL on the selection inputs (``group_sizes`` its uniform layouts; ``bias_correction``:
    each variant also bias-corrected), else the ``mixed`` rule at ``granularity``; ``progress``:
    bars over the statistics pass, the variants, their layers and the scoring passes."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    act_order: bool = True
    damp: float = setting(DAMP, within("(0, 1)", "GPTQ uses 0.01"))  # dampening, a fraction of mean(diag H)
    bias_correction: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "GPTQConfig")


@register(GPTQConfig)
def gptq_method(model: nn.Module, config: GPTQConfig, budget: float, inputs: Inputs) -> Outcome:
    """GPTQ from ``inputs.stats`` (else computed from the calibration batches); with
    ``config.select``, ``inputs.allocation`` is one more variant and the variants are scored on
    ``inputs.selection`` (else the calibration batches) against ``inputs.known``'s log-probabilities when given."""
    return grid_method_outcome(model, config, budget, inputs, "GPTQ", act_order=config.act_order, damp=config.damp)


def grid_method_outcome(model: nn.Module, config, budget: float, inputs: Inputs, method: str, **opts) -> Outcome:
    """The handler of a method on GPTQ's grids and variants (GPTQ, AdaRound): ``config``'s
    ``select``, ``granularity``, ``quant``, ``group_sizes``, ``bias_correction`` and ``progress`` as
    in :class:`GPTQConfig`; ``opts`` go to :func:`gptq_quantize` / :func:`gptq_select`."""
    batches, stats, known = stats_of(model, inputs, method, config.progress)
    opts.update(exclude=tuple(inputs.exclude), progress=config.progress)
    if not config.select:
        return mixed_outcome(gptq_quantize(model, stats, config.granularity, budget, config.quant, **opts), inputs)
    choice = gptq_select(model, stats, batches, budget, config.quant, granularity=config.granularity,
                         group_sizes=config.group_sizes, allocation=inputs.allocation,
                         bias_correction=config.bias_correction, selection=inputs.selection,
                         known=known, **opts)
    return choice_outcome(choice, inputs)
