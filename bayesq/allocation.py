"""Bit allocation under a global storage budget: greedy max-heap knapsack.

Problem: choose one candidate j_b per block b to minimise ``sum_b losses[b][j_b]`` subject to
``sum_b costs[b][j_b] <= budget`` (costs in bits, candidates in ascending cost).

Greedy: start every block at its cheapest candidate and repeatedly take the upgrade with the
largest loss reduction per extra bit, ``gamma = (L_b(i) - L_b(j)) / (C_b(j) - C_b(i))``.
Upgrades follow each block's lower convex hull of (cost, loss), so a block whose curve is not
convex still gets the steps a Lagrangian solution would take; an upgrade that no longer fits
retires its block.  Ties prefer the larger absolute gain, then the lower block index.  With
diminishing returns every allocation the greedy passes through is optimal for its own cost
(Everett), and with equal step costs it is optimal for every budget.
"""

from __future__ import annotations

import heapq
from typing import Sequence


def _check(losses: Sequence[Sequence[float]], costs: Sequence[Sequence[float]]) -> None:
    if len(losses) != len(costs):
        raise ValueError(f"losses has {len(losses)} blocks but costs has {len(costs)}")
    for b, (lb, cb) in enumerate(zip(losses, costs)):
        if len(lb) != len(cb) or not lb:
            raise ValueError(f"block {b}: need the same non-zero number of losses and costs")
        if any(c2 <= c1 for c1, c2 in zip(cb, cb[1:])):
            raise ValueError(f"block {b}: candidate costs must be strictly ascending, got {list(cb)}")


def min_feasible_budget(costs: Sequence[Sequence[float]]) -> float:
    """Bits of the cheapest allocation (every block at its first candidate)."""
    return float(sum(c[0] for c in costs))


def _require_feasible(costs: Sequence[Sequence[float]], budget: float) -> float:
    """Bits of the cheapest allocation; ``ValueError`` naming it when it exceeds ``budget``."""
    need = min_feasible_budget(costs)
    if need > budget:
        raise ValueError(
            f"budget of {budget:.0f} bits is infeasible: the cheapest allocation (every block at "
            f"its lowest bit-width) needs {need:.0f} bits; raise the budget to at least that"
        )
    return need


def _hull(loss: Sequence[float], cost: Sequence[float]) -> list[int]:
    """Indices of the lower convex hull of (cost, loss) from candidate 0, loss decreasing."""
    hull = [0]
    for j in range(1, len(loss)):
        if loss[j] >= loss[hull[-1]]:
            continue  # dominated: costs more, loses no less
        while len(hull) >= 2:
            i, k = hull[-2], hull[-1]
            # keep k only if the slope i->k is steeper (more negative) than i->j
            if (loss[k] - loss[i]) * (cost[j] - cost[i]) <= (loss[j] - loss[i]) * (cost[k] - cost[i]):
                break
            hull.pop()
        hull.append(j)
    return hull


def greedy_allocate(
    losses: Sequence[Sequence[float]], costs: Sequence[Sequence[float]], budget: float
) -> list[int]:
    """Candidate index per block chosen by the greedy gain-per-bit knapsack.

    Args:
        losses: ``losses[b][j]`` expected loss of block b at its j-th candidate.
        costs: ``costs[b][j]`` exact bits of block b at its j-th candidate (strictly ascending).
        budget: total bits allowed.

    Returns:
        list of chosen candidate indices, one per block; total cost <= budget.

    Raises:
        ValueError: if even the cheapest allocation exceeds ``budget`` (the message names the
            minimum feasible budget), or the tables are malformed.
    """
    _check(losses, costs)
    need = _require_feasible(costs, budget)
    hulls = [_hull(lb, cb) for lb, cb in zip(losses, costs)]
    pos = [0] * len(losses)  # position on each hull
    spent = need
    heap: list[tuple[float, float, int]] = []

    def push(b: int) -> None:
        h = hulls[b]
        if pos[b] + 1 < len(h):
            i, j = h[pos[b]], h[pos[b] + 1]
            gain = losses[b][i] - losses[b][j]
            heapq.heappush(heap, (-gain / (costs[b][j] - costs[b][i]), -gain, b))

    for b in range(len(losses)):
        push(b)
    while heap:
        _, _, b = heapq.heappop(heap)
        i, j = hulls[b][pos[b]], hulls[b][pos[b] + 1]
        extra = costs[b][j] - costs[b][i]
        if spent + extra > budget:
            continue  # retire this block; smaller upgrades elsewhere may still fit
        spent += extra
        pos[b] += 1
        push(b)
    return [hulls[b][pos[b]] for b in range(len(losses))]


def total(table: Sequence[Sequence[float]], choice: Sequence[int]) -> float:
    """Sum of ``table[b][choice[b]]`` (total loss or total bits of an allocation)."""
    return float(sum(row[j] for row, j in zip(table, choice)))


def dp_allocate(
    losses: Sequence[Sequence[float]], costs: Sequence[Sequence[float]], budget: float
) -> list[int]:
    """Exact optimum of the allocation problem (same contract as :func:`greedy_allocate`).

    Dynamic programme over Pareto fronts: after each block, keep for every reachable total
    cost within budget the least total loss, dropping states that cost more and lose no less.
    Exact for any tables; the front can grow with the number of distinct cost sums, so it is
    an oracle for small and medium instances.

    Raises:
        ValueError: infeasible budget (naming the minimum feasible one) or malformed tables.
    """
    _check(losses, costs)
    _require_feasible(costs, budget)
    # front: list of (cost, loss, back-pointer index into history[b-1], choice)
    front: list[tuple[float, float, int, int]] = [(0.0, 0.0, -1, -1)]
    history: list[list[tuple[float, float, int, int]]] = []
    rest = [0.0] * (len(costs) + 1)  # cheapest cost of the blocks still to come
    for b in range(len(costs) - 1, -1, -1):
        rest[b] = rest[b + 1] + costs[b][0]
    for b, (lb, cb) in enumerate(zip(losses, costs)):
        cand = [
            (c0 + c, l0 + loss, i, j)
            for i, (c0, l0, _, _) in enumerate(front)
            for j, (loss, c) in enumerate(zip(lb, cb))
            if c0 + c + rest[b + 1] <= budget
        ]
        cand.sort(key=lambda s: (s[0], s[1]))
        pruned: list[tuple[float, float, int, int]] = []
        for s in cand:
            if not pruned or s[1] < pruned[-1][1]:
                pruned.append(s)
        history.append(pruned)
        front = pruned
    k = min(range(len(front)), key=lambda i: front[i][1])
    choice = []
    for b in range(len(costs) - 1, -1, -1):
        _, _, k_prev, j = history[b][k]
        choice.append(j)
        k = k_prev
    return choice[::-1]
