"""Applying an allocation: integer codes, per-group scales/zero-points and the quantised model.

The quantised model is rebuilt from codes, scales and zero-points alone
(``w_hat = scale * (code - zero)``), never from the float weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from bayesq.allocation import greedy_allocate, total
from bayesq.blocks import LayerBlocks, check_finite, layer_blocks, quantizable_layers
from bayesq.codebook import UniformGrids, dequantize, quantize
from bayesq.config import BayesQConfig
from bayesq.curvature.fisher import fisher_diagonal
from bayesq.expected_loss import LossTable, posterior_table
from bayesq.forward import Batch
from bayesq.posterior import DiagonalPosterior, fit_diagonal_posterior
from bayesq.storage import average_bits, budget_bits


@dataclass(frozen=True)
class Allocation:
    """Chosen bit-width of every unit and the exact storage it implies.

    Attributes:
        unit_bits: layer name -> (U,) bit-width per unit.
        total_bits: exact bits of payload, scales, zero-points and headers.
        n_weights: number of quantised weights.
        budget_bits: the budget the allocator was given.
    """

    unit_bits: dict[str, tuple[int, ...]]
    total_bits: int
    n_weights: int
    budget_bits: int

    @property
    def average_bits(self) -> float:
        return average_bits(self.total_bits, self.n_weights)


@dataclass(frozen=True)
class QuantizedWeight:
    """Deployable encoding of one weight: codes (G, group) int64, scale/zero (G,), bits (G,)."""

    blocks: LayerBlocks
    group_bits: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """Weight of ``blocks.shape`` (float64) from codes, scales and zero-points only."""
        w = self.scale[:, None] * (self.codes.double() - self.zero[:, None])
        return self.blocks.from_groups(w)


@dataclass(frozen=True)
class QuantizationResult:
    """What :func:`quantize_model` returns."""

    model: nn.Module
    weights: dict[str, QuantizedWeight]
    allocation: Allocation
    table: LossTable
    posterior: DiagonalPosterior | None = None

    @property
    def average_bits(self) -> float:
        return self.allocation.average_bits


def allocate(table: LossTable, avg_bits: float) -> Allocation:
    """Greedy allocation of ``table`` under ``avg_bits`` bits per quantised weight."""
    losses, costs = table.flat()
    budget = budget_bits(avg_bits, table.n_weights)
    try:
        choice = greedy_allocate(losses, costs, budget)
    except ValueError:
        need = sum(c[0] for c in costs) / table.n_weights
        raise ValueError(
            f"budget of {avg_bits} bits/weight is infeasible: the cheapest encoding of these "
            f"layers needs {need:.4f} bits/weight (lowest bit-width plus scales, zero-points and "
            "headers); raise the budget or use a larger group size"
        ) from None
    unit_bits, k = {}, 0
    for t in table.layers:
        n = t.blocks.n_units
        unit_bits[t.blocks.name] = tuple(t.bits[j] for j in choice[k:k + n])
        k += n
    return Allocation(unit_bits, int(total(costs, choice)), table.n_weights, budget)


def encode(table: LossTable, allocation: Allocation, weights: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """Quantise each layer's weights with the grids of its units' chosen bit-widths."""
    out = {}
    for t in table.layers:
        lb = t.blocks
        w, _ = lb.to_groups(weights[lb.name].detach().double().reshape(-1))
        unit_bits = torch.tensor(allocation.unit_bits[lb.name], dtype=torch.int64)
        group_bits = unit_bits[lb.group_unit()]  # (G,)
        codes = torch.zeros_like(w, dtype=torch.int64)
        scale = torch.zeros(lb.n_groups, dtype=torch.float64)
        zero = torch.zeros(lb.n_groups, dtype=torch.float64)
        for b, g in zip(t.bits, t.grids):
            sel = group_bits == b
            if sel.any():
                sub = UniformGrids(b, g.scale[sel], g.zero[sel])
                codes[sel] = quantize(w[sel], sub)
                scale[sel], zero[sel] = sub.scale, sub.zero
        out[lb.name] = QuantizedWeight(lb, group_bits, codes, scale, zero)
    return out


def quantized_copy(model: nn.Module, weights: dict[str, QuantizedWeight]) -> nn.Module:
    """Deep copy of ``model`` whose quantised layers hold the dequantised weights."""
    qmodel = copy.deepcopy(model)
    modules = dict(qmodel.named_modules())
    with torch.no_grad():
        for name, qw in weights.items():
            mod = modules[name]
            mod.weight.copy_(qw.dequantize().to(mod.weight.dtype))
    return qmodel.eval()


def fit_posterior(
    model: nn.Module, calibration: Iterable[Batch], config: BayesQConfig, progress: bool = True
) -> DiagonalPosterior:
    """Label-free diagonal Fisher Laplace posterior of the model's Linear/Conv2d weights."""
    layers = quantizable_layers(model)
    check_finite(layers)
    fisher, n = fisher_diagonal(
        model, calibration, layers, label_samples=config.posterior.label_samples,
        seed=config.seed, progress=progress,
    )
    weights = {name: m.weight for name, m in layers.items()}
    return fit_diagonal_posterior(fisher, n, weights, config.posterior)


def quantize_model(
    model: nn.Module, calibration: Iterable[Batch], config: BayesQConfig = BayesQConfig(),
    *, posterior: DiagonalPosterior | None = None, progress: bool = True,
) -> QuantizationResult:
    """BayesQ: posterior -> expected-loss tables -> greedy allocation -> quantised model.

    Args:
        model: any module built of Linear/Conv2d layers (others stay in floating point);
            it must return (B, C) logits or an object with ``.logits``.
        calibration: iterable of unlabelled input batches (tensors or dicts of tensors).
        config: budget (average bits per quantised weight, all metadata included), posterior
            and grid settings.
        posterior: a posterior fitted earlier (skips the Fisher pass).

    Returns:
        :class:`QuantizationResult` with the quantised copy of the model, the codes/scales of
        every layer, the allocation and its true average bits.
    """
    layers = quantizable_layers(model)
    check_finite(layers)
    blocks = layer_blocks(layers, config.quant.group_size, config.quant.unit_groups)
    if posterior is None:
        posterior = fit_posterior(model, calibration, config, progress)
    table = posterior_table(posterior, blocks, config.quant, progress)
    allocation = allocate(table, config.budget)
    weights = encode(table, allocation, {n: m.weight for n, m in layers.items()})
    return QuantizationResult(quantized_copy(model, weights), weights, allocation, table, posterior)
