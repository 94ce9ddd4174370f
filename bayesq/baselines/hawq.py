"""HAWQ-style mixed precision (Dong et al. 2019/2020): Hessian-trace sensitivity, knapsack.

One bit-width per layer. Sensitivity of layer l at b bits (HAWQ-v2):

    Omega_l(b) = (Tr(H_l) / n_l) * ||Q_b(W_l) - W_l||^2,

``Tr(H_l)`` the trace of the loss Hessian block of the layer's weights, estimated with
Hutchinson's Rademacher probes (:func:`bayesq.curvature.hutchinson.hutchinson_diagonal`,
pseudo-labels, no dataset labels) and clamped at 0 (a finite-probe estimate can be negative),
``Q_b`` min/max grids per group of ``group_size`` weights. Bit-widths come from the greedy
knapsack on ``Omega`` under the same budget and the same exact storage accounting as BayesQ
(HAWQ-v3 solves this with an ILP; the greedy on the convex hull is within one layer of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch import nn

from bayesq.assignment import allocate
from bayesq.blocks import LayerBlocks, checked_layers, quantizable_layers
from bayesq.canonical import on_canonical
from bayesq.config import QuantConfig
from bayesq.curvature.hutchinson import hutchinson_diagonal
from bayesq.expected_loss import rtn_table
from bayesq.forward import Batch
from bayesq.memory import LazyMap
from bayesq.methods import Inputs, Outcome, read, register
from bayesq.result import QuantizationResult, baseline_result
from bayesq.rounding import encode
from bayesq.settings import integer, setting, validate


@on_canonical
def hessian_traces(
    model: nn.Module, calibration: Iterable[Batch], *, probes: int = 16, seed: int = 0, progress: bool = False,
    exclude: Sequence[str] = (),
) -> dict[str, float]:
    """Per-layer Hutchinson estimate of ``Tr(H_l)`` (mean over inputs), float, clamped at 0, of
    the layers ``exclude`` (module names or glob patterns) does not match."""
    layers = quantizable_layers(model, tuple(exclude))
    curv, n = hutchinson_diagonal(model, calibration, layers, probes=probes, curvature="hessian",
                                  seed=seed, progress=progress)
    return {k: max(float(v.sum()) / n, 0.0) for k, v in curv.items()}


@on_canonical
def hawq_quantize(
    model: nn.Module, traces: dict[str, float], budget: float, cfg: QuantConfig = QuantConfig(),
    *, exclude: Sequence[str] = (),
) -> QuantizationResult:
    """HAWQ-style per-layer bit-widths at ``budget`` average bits (all metadata counted);
    ``exclude``: module names or glob patterns kept in floating point (the result's ``unquantized``).

    Raises:
        ValueError: missing traces, an infeasible budget, non-finite weights.
    """
    layers = checked_layers(model, traces, "Hessian trace", "run hessian_traces on the same model", exclude)
    blocks = []
    for n, m in layers.items():
        shape = tuple(m.weight.shape)
        whole = math.ceil(math.prod(shape) / cfg.group_size)  # every group in one unit
        blocks.append(LayerBlocks(n, shape, cfg.group_size, whole))
    weights = {n: m.weight for n, m in layers.items()}
    omega = LazyMap(layers, lambda n: torch.full(layers[n].weight.shape, traces[n] / layers[n].weight.numel(),
                                                 dtype=torch.float64))
    table = rtn_table(weights, blocks, cfg, element_weight=omega)
    allocation = allocate(table, budget)
    qweights = encode(table, allocation, weights)
    return baseline_result(model, layers, qweights, allocation, table, exclude)


@dataclass(frozen=True)
class HAWQConfig:
    """HAWQ-style allocation from Hessian traces (:func:`hawq_quantize`); ``probes``
    Hutchinson probes per batch and ``seed`` when the traces are computed
    (:func:`hessian_traces`; ``progress``: a bar over its batches)."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    probes: int = setting(16, integer(1))  # Rademacher probes per calibration batch for the traces
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "HAWQConfig")


@register(HAWQConfig)
def hawq_method(model: nn.Module, config: HAWQConfig, budget: float, inputs: Inputs) -> Outcome:
    """:func:`hawq_quantize` on ``inputs.traces``, else on :func:`hessian_traces` of the
    calibration batches."""
    exclude = tuple(inputs.exclude)
    traces = inputs.traces
    if traces is None:
        traces = hessian_traces(model, inputs.need_calibration("HAWQ"), probes=config.probes, seed=config.seed,
                                exclude=exclude, progress=config.progress)
    return Outcome(hawq_quantize(model, dict(traces), budget, config.quant, exclude=exclude), {},
                   read(inputs, "traces"))
