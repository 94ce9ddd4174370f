"""ACIQ (Banner et al. 2019): analytic clipping of each output channel's range.

Weights of a channel are modelled as Laplace(mu, b) (``mu`` the channel mean, ``b`` the mean
absolute deviation from it, the maximum-likelihood scale). Clipping to ``mu +- alpha`` and
quantising uniformly with ``2**M`` levels costs, per weight,

    E(alpha) = 2 b^2 exp(-alpha / b)  +  alpha^2 / (3 * 4^M)        (clipping + rounding noise)

whose minimiser is ``alpha* = c_M * b``; ``c_M`` is found numerically (scipy) and matches the
paper's table (2.83, 3.89, 5.03 for M = 2, 3, 4). The grid covers
``[max(min w, mu - alpha*), min(max w, mu + alpha*)]`` with an fp16 scale and an integer
zero-point per channel. Fractional budgets: the greedy knapsack over units of about
``group_size * unit_groups`` weights with the plain squared rounding error (data-free, as RTN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import nn

from bayesq.assignment import allocate
from bayesq.baselines.rtn import rtn_blocks
from bayesq.blocks import checked_layers, layer_blocks
from bayesq.canonical import on_canonical
from bayesq.config import Granularity, QuantConfig
from bayesq.expected_loss import rtn_table
from bayesq.grids import UniformGrids, grids_from_range
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import QuantizationResult, baseline_result
from bayesq.rounding import encode


def laplace_clip_mse(alpha: float, bits: int) -> float:
    """``E(alpha)`` above for a unit-scale Laplace (b = 1)."""
    return 2.0 * math.exp(-alpha) + alpha**2 / (3.0 * 4.0**bits)


@lru_cache(maxsize=None)
def laplace_clip_ratio(bits: int) -> float:
    """``c_M = alpha* / b`` minimising :func:`laplace_clip_mse` (bounded scalar search)."""
    from scipy.optimize import minimize_scalar

    if bits < 1:
        raise ValueError(f"bits={bits} must be >= 1")
    res = minimize_scalar(laplace_clip_mse, bounds=(0.0, 64.0), args=(bits,), method="bounded",
                          options={"xatol": 1e-10})
    return float(res.x)


def aciq_grids(w: torch.Tensor, bits: int, mask: torch.Tensor, scale_bits: int = 16) -> UniformGrids:
    """Clipped per-row grids of (G, n) float64 ``w`` (``mask`` 1 on real weights, 0 on padding)."""
    n = mask.sum(1).clamp_min(1)
    mu = (w * mask).sum(1) / n  # (G,)
    b = ((w - mu[:, None]).abs() * mask).sum(1) / n  # (G,) Laplace scale (MLE about the mean)
    alpha = laplace_clip_ratio(bits) * b
    lo = torch.maximum(w.min(1).values, mu - alpha)
    hi = torch.minimum(w.max(1).values, mu + alpha)
    return grids_from_range(lo, hi, bits, scale_bits)


@on_canonical
def aciq_quantize(
    model: nn.Module, budget: float, cfg: QuantConfig = QuantConfig(),
    *, granularity: Granularity = Granularity.CHANNEL, exclude: Sequence[str] = (), progress: bool = False,
) -> QuantizationResult:
    """ACIQ at ``budget`` average bits (all metadata counted), one clipped grid per channel;
    ``exclude``: module names or glob patterns kept in floating point (the result's ``unquantized``);
    ``progress``: bars over the layers' grids, then their encodings."""
    layers = checked_layers(model, exclude=exclude)
    blocks = rtn_blocks(layer_blocks(layers, cfg.group_size, cfg.unit_groups), Granularity(granularity), cfg)
    weights = {n: m.weight for n, m in layers.items()}
    table = rtn_table(weights, blocks, cfg,
                      grids=lambda w, b, mask: aciq_grids(w, b, mask, cfg.scale_bits), progress=progress)
    allocation = allocate(table, budget)
    qweights = encode(table, allocation, weights, progress=progress)
    return baseline_result(model, layers, qweights, allocation, table, exclude)


@dataclass(frozen=True)
class ACIQConfig:
    """Analytical clipping (:func:`aciq_quantize`) at ``granularity`` (``progress``: its bars)."""

    granularity: Granularity = Granularity.CHANNEL
    quant: QuantConfig = field(default_factory=QuantConfig)
    progress: bool = True


@register(ACIQConfig)
def aciq_method(model: nn.Module, config: ACIQConfig, budget: float, inputs: Inputs) -> Outcome:
    """:func:`aciq_quantize` (data-free: reads nothing of ``inputs`` but ``exclude``)."""
    return Outcome(aciq_quantize(model, budget, config.quant, granularity=config.granularity,
                                 exclude=tuple(inputs.exclude), progress=config.progress))
