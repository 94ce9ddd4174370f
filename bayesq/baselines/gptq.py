"""GPTQ (Frantar et al. 2022): error-feedback rounding under the layer-input Hessian.

For each Linear/Conv2d layer (Conv2d on unfolded patches; grouped Conv2d per group) GPTQ
minimises the calibration layer-output error ``tr(D H D^T)``, ``H = (1/N) sum a a^T``
(:mod:`bayesq.baselines.activations`), column by column with the OBS update of the not yet
quantised columns. The solver is BayesQ's own :func:`bayesq.error_feedback.error_feedback_groups`
(shared, as DESIGN.md section 2 allows), with GPTQ's choices:

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
under BayesQ's exact storage accounting.
"""

from __future__ import annotations

import torch
from torch import nn

from bayesq.baselines.activations import InputStats
from bayesq.baselines.rtn import rtn_blocks
from bayesq.blocks import checked_layers, layer_blocks
from bayesq.config import Granularity, QuantConfig, Rounding
from bayesq.expected_loss import rtn_table
from bayesq.quantize import QuantizationResult, allocate, encode, quantized_copy

DAMP = 0.01


def damped_hessian(H: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """GPTQ's dampening of (groups, d, d) or (d, d) float64 ``H``.

    Dead inputs (``H_jj = 0``) get ``H_jj = 1``; then ``H + damp * mean(diag H) * I`` per group
    (``I`` alone when the whole diagonal is 0).
    """
    if damp <= 0:
        raise ValueError(f"damp={damp}: GPTQ's dampening must be > 0 (default 0.01)")
    H = H.double().clone()
    diag = H.diagonal(dim1=-2, dim2=-1)  # view: (..., d)
    diag[diag <= 0] = 1.0
    diag += damp * diag.mean(-1, keepdim=True)
    return H


def gptq_quantize(
    model: nn.Module, stats: dict[str, InputStats], granularity: Granularity, budget: float,
    cfg: QuantConfig = QuantConfig(), *, act_order: bool = True, damp: float = DAMP,
) -> QuantizationResult:
    """GPTQ at ``budget`` average bits (all metadata counted) with channel or group grids.

    Args:
        model: Linear/Conv2d layers are quantised; others stay in floating point.
        stats: :func:`bayesq.baselines.activations.input_stats` of the model's layers.
        granularity: ``channel`` (one grid per output row) or ``group`` (``cfg.group_size``).
        budget: average bits per quantised weight.

    Raises:
        ValueError: per-tensor granularity (GPTQ uses channel or group grids), missing stats,
            an infeasible budget, non-finite weights.
    """
    granularity = Granularity(granularity)
    if granularity == Granularity.TENSOR:
        raise ValueError("GPTQ quantises with per-channel or per-group grids; choose 'channel' or 'group'")
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model")
    blocks = rtn_blocks(layer_blocks(layers, cfg.group_size, cfg.unit_groups), granularity, cfg)
    weights = {n: m.weight for n, m in layers.items()}
    omega = {n: stats[n].row_diag(m.weight.shape[0]) for n, m in layers.items()}  # (out, d_in)
    table = rtn_table(weights, blocks, cfg, element_weight=omega)
    allocation = allocate(table, budget)
    metric = {n: damped_hessian(stats[n].H, damp) for n in layers}
    qweights = encode(table, allocation, weights, rounding=Rounding.ERROR_FEEDBACK,
                      column_metric=metric, act_order=act_order)
    return QuantizationResult(quantized_copy(model, qweights), qweights, allocation, table)
