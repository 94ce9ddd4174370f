"""Per-block quantisers fitted to the weights alone: uniform with optimal clipping, and Lloyd.

Two rows of the paper's main table design each block's quantiser from that block's weights,
with no data and no posterior (BayesQ's quantiser design with the identity metric):

* ``uniform`` (*per-block uniform + clipping*): one affine grid per group of ``group_size``
  weights over ``rho * [min, max]``, the clipping ratio ``rho`` in ``[min_range_ratio, 1]``
  minimising the group's squared rounding error

      J(rho) = sum_i (Q_rho(w_i) - w_i)^2

  (:func:`bayesq.grids.fit_uniform_grids_deployed`: ``range_grid`` ratios scored, then a
  golden-section search; ``rho = 1`` is RTN's range, so no group is worse than RTN's).
  Stored as RTN per group: codes, an fp16 scale and an integer zero-point per group.
* ``lloyd`` (*per-block non-uniform Lloyd*): one look-up table of ``2**b`` fp16 levels per
  allocation unit (``unit_groups * group_size`` weights), Lloyd's k-means on the unit's
  weights started from their min/max uniform levels (:func:`bayesq.levels.fit_weighted_levels`
  with equal weights; a unit whose result is worse than its start keeps the start). Stored as
  codes plus one table per unit.

Codes are the nearest levels. Fractional budgets are met by the data-free mixed rule of RTN
and ACIQ: the greedy knapsack over the units with their squared rounding error, under the same
exact storage accounting as every method. Candidates above 16 levels (8 bits) are min/max
grids, as BayesQ's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.assignment import allocate
from bayesq.blocks import checked_layers, layer_blocks
from bayesq.canonical import on_canonical
from bayesq.config import Codebook, Objective, QuantConfig, Rounding
from bayesq.expected_loss import LossTable, layer_table
from bayesq.memory import release_freed
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import QuantizationResult, baseline_result
from bayesq.rounding import encode

#: The codebooks a per-block baseline fits (names as ``quant.codebook``).
BLOCK_CODEBOOKS = (Codebook.UNIFORM, Codebook.LLOYD)


def weight_table(layers: dict[str, nn.Module], cfg: QuantConfig, codebook: Codebook,
                 progress: bool = False) -> LossTable:
    """Loss table of ``codebook`` fitted to each layer's weights under the identity metric.

    Entries are ``L_u(b) = 0.5 sum_{i in u} (Q_b(w_i) - w_i)^2`` for the fitted codebook ``Q_b``
    of each unit (:func:`bayesq.expected_loss.layer_table` with ``omega = 1`` and the deployed
    objective).

    Args:
        layers: layer name -> Linear / Conv2d module (weights read as float64, one layer at a time).
        cfg: group size, unit size, candidate bit-widths, range search and storage formats.
        codebook: ``uniform`` or ``lloyd``.
    """
    codebook = Codebook(codebook)
    if codebook not in BLOCK_CODEBOOKS:
        raise ValueError(f"codebook must be one of {[c.value for c in BLOCK_CODEBOOKS]}, got '{codebook.value}'")
    fit_cfg = replace(cfg, objective=Objective.DEPLOYED, codebook=codebook, rounding=Rounding.NEAREST)
    tables = []
    blocks = layer_blocks(layers, cfg.group_size, cfg.unit_groups)
    for lb in tqdm(blocks, desc=f"{codebook.value} block quantisers", disable=not progress, leave=False):
        w = layers[lb.name].weight.detach().double()
        tables.append(layer_table(lb, w, None, fit_cfg, omega=torch.ones_like(w)))
        release_freed()
    return LossTable(tuple(tables))


@on_canonical
def blockwise_quantize(
    model: nn.Module, budget: float, cfg: QuantConfig = QuantConfig(), *,
    codebook: Codebook = Codebook.UNIFORM, exclude: Sequence[str] = (), progress: bool = False,
) -> QuantizationResult:
    """Per-block ``codebook`` quantisers fitted to the weights alone, at ``budget`` average bits
    (all metadata counted); ``exclude``: module names or glob patterns kept in floating point
    (the result's ``unquantized``); ``progress``: bars over the layers' fits, then their encodings.

    Raises:
        ValueError: an unknown codebook, non-finite weights, an infeasible budget.
    """
    layers = checked_layers(model, exclude=exclude)
    table = weight_table(layers, cfg, codebook, progress)
    allocation = allocate(table, budget)
    qweights = encode(table, allocation, {n: m.weight for n, m in layers.items()}, progress=progress)
    return baseline_result(model, layers, qweights, allocation, table, exclude)


@dataclass(frozen=True)
class BlockwiseConfig:
    """Per-block quantisers fitted to the weights (:func:`blockwise_quantize`): ``codebook``
    ``uniform`` (per-group range with MSE-optimal clipping) or ``lloyd`` (a k-means table per
    allocation unit); ``progress``: its bars."""

    codebook: Codebook = Codebook.UNIFORM
    quant: QuantConfig = field(default_factory=QuantConfig)
    progress: bool = True

    def __post_init__(self) -> None:
        try:
            book = Codebook(self.codebook)
        except ValueError:
            book = None
        if book not in BLOCK_CODEBOOKS:
            raise ValueError(f"BlockwiseConfig.codebook must be one of {[c.value for c in BLOCK_CODEBOOKS]}, "
                             f"got {self.codebook!r}")
        object.__setattr__(self, "codebook", book)


@register(BlockwiseConfig)
def blockwise_method(model: nn.Module, config: BlockwiseConfig, budget: float, inputs: Inputs) -> Outcome:
    """:func:`blockwise_quantize` (data-free: reads nothing of ``inputs`` but ``exclude``)."""
    return Outcome(blockwise_quantize(model, budget, config.quant, codebook=config.codebook,
                                      exclude=tuple(inputs.exclude), progress=config.progress))
