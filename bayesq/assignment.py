"""Bit assignment: a loss table and an average-bit budget -> one candidate width per unit.

:func:`allocate` turns a :class:`bayesq.expected_loss.LossTable` into the knapsack problem of
:mod:`bayesq.allocation` (floors, latency-aware costs, budget regularisation), solves it with the
allocator ``AllocationConfig.allocator`` names (:data:`bayesq.allocators.ALLOCATORS`) and returns
the :class:`bayesq.result.Allocation`. Every method that allocates bits from a table calls it.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Mapping

import numpy as np

from bayesq.allocators import ALLOCATORS, Problem
from bayesq.config import AllocationConfig, Allocator
from bayesq.expected_loss import LossTable
from bayesq.result import Allocation
from bayesq.storage import budget_bits


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
