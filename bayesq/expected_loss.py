"""Per-unit expected-loss tables over candidate bit-widths (closed form).

For each allocation unit u and bit-width b the table holds

    L_u(b) = 0.5 * sum_{i in u} E_{w_i ~ N(mu_i, sigma_i^2)}[(Q_b(w_i) - w_i)^2] / sigma_i^2,

the posterior-expected increase of the task loss, with Q_b the unit's per-group grids whose
ranges minimise that same quantity (``codebook.fit_uniform_grids``), and C_u(b) its exact bits
(``storage.unit_cost_bits``).  Grids with more than 16 levels keep the min/max range (the
Gaussian-optimal clipping of a 16+ level grid lies beyond the extremes of a 64-weight group)
and are costed by the same closed form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from bayesq.blocks import LayerBlocks
from bayesq.codebook import (
    UniformGrids, dequantize, fit_uniform_grids, grid_cost_chunked, minmax_grids, quantize,
)
from bayesq.config import QuantConfig
from bayesq.posterior import DiagonalPosterior
from bayesq.storage import unit_cost_bits

SEARCH_MAX_LEVELS = 16


@dataclass(frozen=True)
class LayerTable:
    """Candidates of one layer: ``unit_loss``/``unit_cost`` are (U, nb); one grid set per bit-width."""

    blocks: LayerBlocks
    bits: tuple[int, ...]
    unit_loss: torch.Tensor
    unit_cost: torch.Tensor
    grids: tuple[UniformGrids, ...]


@dataclass(frozen=True)
class LossTable:
    """All layers' candidates, in network order."""

    layers: tuple[LayerTable, ...]

    def flat(self) -> tuple[list[list[float]], list[list[int]]]:
        """(losses, costs) with one row per unit over all layers, as the allocator wants them."""
        losses = [row for t in self.layers for row in t.unit_loss.tolist()]
        costs = [row for t in self.layers for row in t.unit_cost.tolist()]
        return losses, costs

    @property
    def n_weights(self) -> int:
        return sum(t.blocks.numel for t in self.layers)

    def records(self) -> list[dict]:
        """One row per (layer, unit, bits) for a Parquet table."""
        rows = []
        for t in self.layers:
            for u, (loss, cost) in enumerate(zip(t.unit_loss.tolist(), t.unit_cost.tolist())):
                for b, l_, c in zip(t.bits, loss, cost):
                    rows.append({"layer": t.blocks.name, "unit": u, "bits": b, "loss": l_, "cost_bits": c})
        return rows


def _unit_costs(blocks: LayerBlocks, bits: tuple[int, ...], scale_bits: int) -> torch.Tensor:
    return torch.tensor(
        [[unit_cost_bits(n, g, b, len(bits), scale_bits) for b in bits] for n, g in blocks.unit_sizes()],
        dtype=torch.int64,
    )


def _unit_sum(blocks: LayerBlocks, group_values: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(blocks.n_units, dtype=torch.float64)
    return out.index_add_(0, blocks.group_unit(), group_values)


def _layer_table(
    blocks: LayerBlocks, cfg: QuantConfig,
    fit: Callable[[int], tuple[UniformGrids, torch.Tensor]],
) -> LayerTable:
    grids, losses = [], []
    for b in cfg.bits:
        g, group_loss = fit(b)
        grids.append(g)
        losses.append(_unit_sum(blocks, group_loss))
    return LayerTable(
        blocks=blocks, bits=cfg.bits, unit_loss=torch.stack(losses, 1),
        unit_cost=_unit_costs(blocks, cfg.bits, cfg.scale_bits), grids=tuple(grids),
    )


def posterior_table(
    posterior: DiagonalPosterior, blocks: list[LayerBlocks], cfg: QuantConfig, progress: bool = True
) -> LossTable:
    """BayesQ table: posterior-optimal grids and their expected loss for every unit and bit-width."""
    tables = []
    for lb in tqdm(blocks, desc="loss table", disable=not progress, leave=False):
        mu, mask = lb.to_groups(posterior.mean[lb.name].reshape(-1))
        sigma, _ = lb.to_groups(posterior.std(lb.name).reshape(-1))

        def fit(b: int) -> tuple[UniformGrids, torch.Tensor]:
            if 2**b <= SEARCH_MAX_LEVELS:
                g, cost = fit_uniform_grids(
                    mu, sigma, mask, b, iters=cfg.range_iters, min_ratio=cfg.min_range_ratio,
                    scale_bits=cfg.scale_bits,
                )
            else:
                g = minmax_grids(mu, b, cfg.scale_bits)
                cost = grid_cost_chunked(mu, sigma, g.lo, g.scale, g.levels, mask)
            return g, 0.5 * cost

        tables.append(_layer_table(lb, cfg, fit))
    return LossTable(tuple(tables))


def rtn_table(weights: dict[str, torch.Tensor], blocks: list[LayerBlocks], cfg: QuantConfig) -> LossTable:
    """Data-free table: min/max grids and their plain squared rounding error (RTN's own rule)."""
    tables = []
    for lb in blocks:
        w, mask = lb.to_groups(weights[lb.name].detach().double().reshape(-1))

        def fit(b: int) -> tuple[UniformGrids, torch.Tensor]:
            g = minmax_grids(w, b, cfg.scale_bits)
            err = (dequantize(quantize(w, g), g) - w).pow(2) * mask
            return g, err.sum(1)

        tables.append(_layer_table(lb, cfg, fit))
    return LossTable(tuple(tables))
