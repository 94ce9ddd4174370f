"""Every allocator by name (:data:`ALLOCATORS`), and the ones that are not the greedy knapsack.

:func:`random_allocate` (ablation control), :func:`lagrangian_allocate` (per-block argmin of
``L + lam C``) and :func:`dp_allocate` (the exact oracle) solve the problem of
:mod:`bayesq.allocation`: one candidate ``j_b >= floors[b]`` per block minimising
``sum_b losses[b][j_b]`` subject to ``sum_b costs[b][j_b] <= budget``. Derivations: docs/method.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from bayesq.allocation import (
    Table, _as_table, _hulls, _penalty, _prepare, _Problem, _segments, greedy_allocate, hw_greedy_allocate,
)


def random_allocate(costs: Table, budget: float, *, seed: int, floors: Sequence[int] | None = None) -> list[int]:
    """Ablation control: upgrade a uniformly random block to its next candidate until nothing fits.

    Blocks start at their floors; a block whose next candidate does not fit (or that has none)
    is retired, which equals drawing uniformly among the blocks whose next upgrade still fits.
    Deterministic for a given ``seed``.  Returns one candidate index per block within budget.
    """
    cost, size = _as_table(costs, "costs")
    zeros = np.zeros_like(cost) if (size == cost.shape[1]).all() else [[0.0] * int(k) for k in size]
    p = _prepare(zeros, costs, budget, floors)
    rng = np.random.default_rng(seed)
    choice, spent = p.floor.tolist(), p.need
    live = [b for b in range(cost.shape[0]) if choice[b] + 1 < size[b]]
    table = p.cost.tolist()
    while live:
        k = int(rng.integers(len(live)))
        b = live[k]
        extra = table[b][choice[b] + 1] - table[b][choice[b]]
        if spent + extra > budget:
            live[k] = live[-1]
            live.pop()
            continue
        spent += extra
        choice[b] += 1
        if choice[b] + 1 >= size[b]:
            live[k] = live[-1]
            live.pop()
    return choice


def _lagrangian_choice(p: _Problem, lam: float) -> np.ndarray:
    """(n,) argmin_j L_b(j) + lam * C_b(j) over j >= floor (first index on ties)."""
    score = p.loss + lam * p.cost  # (n, K); padding is +inf
    score[np.arange(p.loss.shape[1])[None, :] < p.floor[:, None]] = np.inf
    return np.argmin(score, axis=1)


def _fits(p: _Problem, choice: np.ndarray, budget: float) -> bool:
    """Whether the (n,) ``choice`` costs at most ``budget`` bits."""
    return float(sum(p.cost[np.arange(choice.size), choice].tolist())) <= budget


def lagrangian_lambda(losses: Table, costs: Table, budget: float, *, floors: Sequence[int] | None = None) -> float:
    """Cheapest multiplier lam >= 0 whose per-block argmin of ``L + lam * C`` fits the budget.

    The argmin is constant between consecutive hull slopes (the breakpoints d_1 < ... < d_m), so
    bisection runs over 0 and one point inside each interval: d_1 / 2, (d_k + d_k+1) / 2 and
    2 d_m + 1 (where every block sits at its floor).  A midpoint, not the breakpoint itself,
    because at a breakpoint the two candidates tie and rounding may pick either.
    """
    p = _prepare(losses, costs, budget, floors)
    if _fits(p, _lagrangian_choice(p, 0.0), budget):
        return 0.0
    d = np.unique(_segments(p, *_hulls(p.loss, p.cost, p.floor)).dens)  # ascending breakpoints
    lams = np.concatenate([d[:1] / 2, (d[:-1] + d[1:]) / 2, 2 * d[-1:] + 1]) if d.size else np.ones(1)
    lo, hi = -1, lams.size - 1  # invariant: lams[hi] fits, lams[lo] (or 0) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(p, _lagrangian_choice(p, float(lams[mid])), budget) else (mid, hi)
    return float(lams[hi])


def lagrangian_allocate(
    losses: Table, costs: Table, budget: float, *, lam: float | None = None, floors: Sequence[int] | None = None,
    penalty: float = 0.0,
) -> list[int]:
    """Per-block ``argmin_j L_b(j) + lam * C_b(j)`` (budget regularisation).

    ``lam=None`` uses ``max(penalty, lagrangian_lambda(...))`` (the cheapest lam that fits, or
    the budget regularisation if larger).  By Everett's theorem the result is optimal among
    allocations costing no more than it does.

    Raises:
        ValueError: lam < 0, the solution for a given lam exceeds the budget (raise lam or pass
            None), infeasible budget or malformed tables.
    """
    if lam is None:
        lam = max(_penalty(penalty), lagrangian_lambda(losses, costs, budget, floors=floors))
    if not 0 <= lam < np.inf:
        raise ValueError(f"lam must be finite and >= 0 (loss penalty per bit), got {lam}")
    p = _prepare(losses, costs, budget, floors)
    choice = _lagrangian_choice(p, lam)
    if not _fits(p, choice, budget):
        raise ValueError(
            f"lam={lam} gives an allocation over the budget of {budget:.0f} bits; raise lam or pass lam=None"
        )
    return choice.tolist()


def dp_allocate(
    losses: Table, costs: Table, budget: float, *, floors: Sequence[int] | None = None, penalty: float = 0.0
) -> list[int]:
    """Exact optimum of the allocation problem (same contract as :func:`greedy_allocate`).

    With ``penalty`` lambda > 0 the objective is ``L + lambda C`` (still under the budget).

    Dynamic programme over Pareto fronts: after each block, keep for every reachable total
    cost within budget the least total loss, dropping states that cost more and lose no less
    and states that can no longer fit the floors of the blocks still to come.  Each block's
    step is vectorised (front x candidates).  Exact for any tables; the front grows with the
    number of distinct cost sums, so it is an oracle for small and medium instances.

    Raises:
        ValueError: infeasible budget (naming the minimum feasible one) or malformed tables.
    """
    p = _prepare(losses, costs, budget, floors)
    n, k = p.loss.shape
    floor_cost = p.cost[np.arange(n), p.floor]
    rest = np.concatenate([np.cumsum(floor_cost[::-1])[::-1][1:], [0.0]])  # (n,) floors still to come
    front_c, front_l = np.zeros(1), np.zeros(1)
    history = []
    for b in range(n):
        js = np.arange(p.floor[b], p.size[b])
        c = (front_c[:, None] + p.cost[b, js][None, :]).ravel()  # (F * J,) front-major
        loss = (front_l[:, None] + p.loss[b, js][None, :]).ravel()
        ok = np.flatnonzero(c + rest[b] <= budget)
        ok = ok[np.lexsort((loss[ok], c[ok]))]
        lo = loss[ok]
        best_before = np.concatenate([[np.inf], np.minimum.accumulate(lo)[:-1]])
        ok = ok[lo < best_before]  # Pareto: strictly less loss than every cheaper state
        history.append((ok // js.size, js[ok % js.size]))
        front_c, front_l = c[ok], loss[ok]
    i = int(np.argmin(front_l + _penalty(penalty) * front_c))
    choice = [0] * n
    for b in range(n - 1, -1, -1):
        prev, js = history[b]
        choice[b] = int(js[i])
        i = int(prev[i])
    return choice


@dataclass(frozen=True)
class Problem:
    """One allocation problem, what every allocator of :data:`ALLOCATORS` reads.

    Attributes:
        losses, costs: per block, each candidate's expected loss and exact bits (strictly
            ascending costs); lists (ragged allowed) or (n, K) arrays.
        budget: total bits allowed.
        penalty: budget regularisation lambda >= 0 (loss per bit; see :func:`greedy_allocate`).
        density_costs: the greedy's latency-aware density costs (None: storage bits).
        layer, bits: each block's layer index and candidates' bit-widths (the hardware-aware greedy).
        tolerance: the hardware-aware greedy's near-tie window ``eta``.
        seed: the random control's seed.
    """

    losses: Table
    costs: Table
    budget: float
    penalty: float = 0.0
    density_costs: Table | None = None
    layer: Sequence[int] | None = None
    bits: Table | None = None
    tolerance: float = 0.01
    seed: int = 0


def _hw(p: Problem) -> list[int]:
    if p.layer is None or p.bits is None:
        raise ValueError("the hardware-aware greedy needs each block's layer and candidate bit-widths "
                         "(Problem.layer, Problem.bits)")
    return hw_greedy_allocate(p.losses, p.costs, p.budget, layer=p.layer, bits=p.bits, eta=p.tolerance,
                              penalty=p.penalty)


# allocator name (bayesq.config.Allocator values) -> Problem -> one candidate index per block, within budget
ALLOCATORS = {
    "greedy": lambda p: greedy_allocate(p.losses, p.costs, p.budget, density_costs=p.density_costs,
                                        penalty=p.penalty),
    "greedy-hw": _hw,
    "dp": lambda p: dp_allocate(p.losses, p.costs, p.budget, penalty=p.penalty),
    "lagrangian": lambda p: lagrangian_allocate(p.losses, p.costs, p.budget, penalty=p.penalty),
    "random": lambda p: random_allocate(p.costs, p.budget, seed=p.seed),
}
