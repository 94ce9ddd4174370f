"""Allocation: greedy (vectorised) vs its heap reference, naive and brute-force oracles; variants.

References are independent of the code under test: the original max-heap greedy (kept here
verbatim), a naive O(n^2) greedy with exact rational densities and brute-force hulls,
exhaustive search over all allocations, and the exact DP (itself checked by brute force).
"""

from fractions import Fraction
import heapq
import itertools
import random

import numpy as np
import pytest

import bayesq.allocation as alloc
from bayesq.allocation import greedy_allocate, hw_greedy_allocate, min_feasible_budget, total
from bayesq.allocators import dp_allocate, lagrangian_allocate, lagrangian_lambda, random_allocate
from bayesq.storage import unit_cost_bits


def _brute_force(losses, costs, budget):
    best, arg = float("inf"), None
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        if total(costs, choice) <= budget and total(losses, choice) < best:
            best, arg = total(losses, choice), choice
    return best, arg


def _convex_block(rng, n, step_costs):
    """Losses with diminishing returns: decreasing gains per bit along ascending costs."""
    costs = [10 + sum(step_costs[:j]) for j in range(n)]
    loss, losses = rng.uniform(5, 50), []
    slope = rng.uniform(0.5, 5.0)
    for j in range(n):
        losses.append(loss)
        if j + 1 < n:
            loss -= slope * step_costs[j]
            slope *= rng.uniform(0.2, 0.9)
    return losses, costs


@pytest.mark.parametrize("seed", range(30))
def test_greedy_allocate_vs_brute_force_equal_steps(seed):
    # Diminishing returns and equal step costs: greedy is optimal for every budget.
    rng = random.Random(seed)
    blocks = [_convex_block(rng, 4, [8, 8, 8]) for _ in range(5)]
    losses, costs = [b[0] for b in blocks], [b[1] for b in blocks]
    budget = rng.randint(int(min_feasible_budget(costs)), int(sum(c[-1] for c in costs)))
    choice = greedy_allocate(losses, costs, budget)
    assert total(costs, choice) <= budget
    assert total(losses, choice) == pytest.approx(_brute_force(losses, costs, budget)[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_allocate_optimal_at_greedy_prefix_budgets(seed):
    # Diminishing returns, unequal step costs: whenever the budget equals the cost of a prefix
    # of the gain-per-bit order, the greedy allocation is optimal for it (Everett).
    rng = random.Random(100 + seed)
    blocks = [_convex_block(rng, 4, [rng.choice([4, 8, 16]) for _ in range(3)]) for _ in range(5)]
    losses, costs = [b[0] for b in blocks], [b[1] for b in blocks]
    steps = sorted(
        ((losses[b][j] - losses[b][j + 1]) / (costs[b][j + 1] - costs[b][j]), costs[b][j + 1] - costs[b][j])
        for b in range(5) for j in range(3)
    )[::-1]
    budget = min_feasible_budget(costs)
    for _, extra in steps[: rng.randint(1, len(steps))]:
        budget += extra
    choice = greedy_allocate(losses, costs, budget)
    assert total(costs, choice) == budget
    assert total(losses, choice) == pytest.approx(_brute_force(losses, costs, budget)[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_greedy_allocate_within_budget_on_arbitrary_tables(seed):
    rng = random.Random(200 + seed)
    losses, costs = [], []
    for _ in range(6):
        c = sorted(rng.sample(range(1, 60), 4))
        losses.append([rng.uniform(0, 10) for _ in c])  # not even monotone
        costs.append(c)
    budget = rng.uniform(min_feasible_budget(costs), sum(c[-1] for c in costs))
    choice = greedy_allocate(losses, costs, budget)
    assert total(costs, choice) <= budget
    # never worse than staying at the cheapest candidates
    assert total(losses, choice) <= total(losses, [0] * 6) + 1e-12


def test_greedy_allocate_infeasible_names_minimum_budget():
    with pytest.raises(ValueError, match="needs 30 bits"):
        greedy_allocate([[1.0, 0.5], [2.0, 1.0]], [[10, 20], [20, 40]], 29)


def test_greedy_allocate_rejects_unsorted_costs():
    with pytest.raises(ValueError, match="ascending"):
        greedy_allocate([[1.0, 0.5]], [[20, 10]], 100)


def test_greedy_allocate_full_budget_takes_best():
    losses, costs = [[3.0, 2.0, 1.0], [5.0, 1.0, 0.5]], [[1, 2, 3], [1, 2, 3]]
    assert greedy_allocate(losses, costs, 6) == [2, 2]
    assert greedy_allocate(losses, costs, 3) == [0, 1]


@pytest.mark.parametrize("seed", range(30))
def test_dp_allocate_vs_brute_force(seed):
    rng = random.Random(300 + seed)
    losses, costs = [], []
    for _ in range(5):
        c = sorted(rng.sample(range(1, 40), 4))
        losses.append([rng.uniform(0, 10) for _ in c])
        costs.append(c)
    budget = rng.uniform(min_feasible_budget(costs), sum(c[-1] for c in costs))
    choice = dp_allocate(losses, costs, budget)
    assert total(costs, choice) <= budget
    assert total(losses, choice) == pytest.approx(_brute_force(losses, costs, budget)[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_greedy_allocate_never_beats_dp(seed):
    rng = random.Random(400 + seed)
    blocks = [_convex_block(rng, 4, [rng.choice([4, 8, 16]) for _ in range(3)]) for _ in range(8)]
    losses, costs = [b[0] for b in blocks], [b[1] for b in blocks]
    budget = rng.randint(int(min_feasible_budget(costs)), int(sum(c[-1] for c in costs)))
    assert total(losses, dp_allocate(losses, costs, budget)) <= total(losses, greedy_allocate(losses, costs, budget)) + 1e-12


def test_dp_allocate_infeasible_names_minimum_budget():
    with pytest.raises(ValueError, match="needs 30 bits"):
        dp_allocate([[1.0, 0.5], [2.0, 1.0]], [[10, 20], [20, 40]], 29)


# ---------------------------------------------------------------- references


def _heap_hull(loss, cost):
    hull = [0]
    for j in range(1, len(loss)):
        if loss[j] >= loss[hull[-1]]:
            continue
        while len(hull) >= 2:
            i, k = hull[-2], hull[-1]
            if (loss[k] - loss[i]) * (cost[j] - cost[i]) <= (loss[j] - loss[i]) * (cost[k] - cost[i]):
                break
            hull.pop()
        hull.append(j)
    return hull


def _heap_reference(losses, costs, budget):
    """The original pure-Python max-heap greedy (bayesq/allocation.py before vectorisation)."""
    hulls = [_heap_hull(lb, cb) for lb, cb in zip(losses, costs)]
    pos = [0] * len(losses)
    spent = float(sum(c[0] for c in costs))
    heap = []

    def push(b):
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
            continue
        spent += extra
        pos[b] += 1
        push(b)
    return [hulls[b][pos[b]] for b in range(len(losses))]


def _naive_greedy(losses, costs, budget, dcosts=None, floors=None):
    """Greedy by definition, exact rationals: from each block's current point the next hull
    point is the nearest j of steepest descent (L_i - L_j) / (T_j - T_i); take the best
    (density, gain, -block) each round; a misfit retires its block.  Integer tables only."""
    dcosts = costs if dcosts is None else dcosts
    n = len(losses)
    cur = list(floors) if floors is not None else [0] * n
    spent, live = sum(costs[b][cur[b]] for b in range(n)), set(range(n))

    def step(b):
        i, best = cur[b], None
        for j in range(i + 1, len(losses[b])):
            if losses[b][j] < losses[b][i]:
                d = Fraction(losses[b][i] - losses[b][j], dcosts[b][j] - dcosts[b][i])
                if best is None or d > best[0]:
                    best = (d, j)
        return best

    while True:
        cands = [(s[0], losses[b][cur[b]] - losses[b][s[1]], -b, s[1]) for b in live if (s := step(b))]
        if not cands:
            return cur
        d, g, nb, j = max(cands)
        b = -nb
        extra = costs[b][j] - costs[b][cur[b]]
        if spent + extra > budget:
            live.discard(b)
            continue
        spent += extra
        cur[b] = j


def _instance(rng, n, k, kind):
    """(losses, costs) as numpy arrays: 'ties' small integers, 'convex' realistic curves with
    bayesq.storage costs, 'mixed' costs of 1 and 10000 bits, 'float' non-integer costs."""
    if kind == "ties":
        return rng.integers(0, 6, (n, k)).astype(float), np.cumsum(rng.integers(1, 4, (n, k)), 1).astype(float)
    if kind == "convex":
        bits = np.array([2, 3, 4, 8][:k])
        cost = np.array([unit_cost_bits(1024, 16, b, 4) for b in bits], float)
        loss = rng.lognormal(0, 1, (n, 1)) * np.exp(-bits[None, :] * rng.uniform(0.4, 1.2, (n, 1)))
        return loss, np.tile(cost, (n, 1))
    if kind == "mixed":
        steps = np.where(rng.random((n, k)) < 0.5, 1.0, 10000.0)
        return np.sort(rng.random((n, k)))[:, ::-1].copy(), np.cumsum(steps, 1)
    return rng.random((n, k)), np.cumsum(rng.random((n, k)) + 0.01, 1)


def _budget(rng, costs, integral=True):
    lo, hi = float(sum(costs[:, 0].tolist())), float(costs[:, -1].sum())
    return float(rng.integers(int(np.ceil(lo)), int(hi) + 2)) if integral else float(rng.uniform(lo, hi + 1))


def _brute(losses, costs, budget, floors=None):
    floors = floors or [0] * len(costs)
    best, arg = float("inf"), None
    for choice in itertools.product(*[range(f, len(c)) for f, c in zip(floors, costs)]):
        if total(costs, choice) <= budget and total(losses, choice) < best:
            best, arg = total(losses, choice), list(choice)
    return best, arg


# ---------------------------------------------------------------- greedy: identity and speed


@pytest.mark.parametrize("kind", ["ties", "convex", "mixed", "float"])
@pytest.mark.parametrize("seed", range(40))
def test_greedy_allocate_vs_heap_reference_identical(kind, seed):
    rng = np.random.default_rng(seed)
    loss, cost = _instance(rng, int(rng.integers(1, 30)), int(rng.integers(1, 5)), kind)
    budget = _budget(rng, cost, integral=kind != "float")
    costs = cost.tolist() if kind == "float" else [[int(c) for c in row] for row in cost.tolist()]
    expect = _heap_reference(loss.tolist(), costs, budget)
    assert greedy_allocate(loss.tolist(), costs, budget) == expect
    assert greedy_allocate(loss, cost, budget) == expect  # numpy input


@pytest.mark.parametrize("seed", range(10))
def test_greedy_allocate_vs_heap_reference_ragged(seed):
    rng = random.Random(seed)
    losses, costs = [], []
    for _ in range(12):
        k = rng.randint(1, 5)
        costs.append(sorted(rng.sample(range(1, 30), k)))
        losses.append([float(rng.randint(0, 6)) for _ in range(k)])
    budget = rng.uniform(min_feasible_budget(costs), sum(c[-1] for c in costs) + 1)
    assert greedy_allocate(losses, costs, budget) == _heap_reference(losses, costs, budget)


@pytest.mark.parametrize("kind", ["ties", "convex", "mixed"])
@pytest.mark.parametrize("max_events", [0, 64])
def test_greedy_allocate_vs_heap_reference_large_band_path(kind, max_events, monkeypatch):
    # Large enough for the sampled band split; max_events=0 forces the sorted-scan fallback.
    rng = np.random.default_rng({"ties": 1, "convex": 2, "mixed": 3}[kind])
    loss, cost = _instance(rng, 6000, 4, kind)
    splits = []
    band = alloc._band
    monkeypatch.setattr(alloc, "_band", lambda *a: splits.append(band(*a)) or splits[-1])
    monkeypatch.setattr(alloc, "_MAX_EVENTS", max_events)
    for budget in (_budget(rng, cost), _budget(rng, cost)):
        expect = _heap_reference(loss.tolist(), [[int(c) for c in r] for r in cost.tolist()], budget)
        assert greedy_allocate(loss, cost, budget) == expect
    assert any(s is not None and s[0].size > 0 for s in splits)  # the band path was exercised


def test_greedy_allocate_million_units_uses_the_budget():
    # its speed (goal: 1 s) is measured by benchmarks/allocation.py, not asserted here
    rng = np.random.default_rng(0)
    loss, cost = _instance(rng, 10**6, 4, "convex")
    budget = 3.5 * 1024 * 10**6
    choice = greedy_allocate(loss, cost, budget)
    assert total(cost, choice) <= budget
    assert budget - total(cost, choice) < cost[0, -1]  # the budget is used up to one upgrade


# ---------------------------------------------------------------- greedy: floors, latency density


@pytest.mark.parametrize("seed", range(20))
def test_greedy_allocate_floors_and_density_costs_vs_naive(seed):
    rng = random.Random(500 + seed)
    n, k = 6, 4
    costs = [sorted(rng.sample(range(1, 40), k)) for _ in range(n)]
    dcosts = [sorted(rng.sample(range(1, 40), k)) for _ in range(n)]
    losses = [[rng.randint(0, 30) for _ in range(k)] for _ in range(n)]
    floors = [rng.randint(0, 2) for _ in range(n)]
    budget = rng.randint(int(min_feasible_budget(costs, floors=floors)), sum(c[-1] for c in costs))
    assert greedy_allocate(losses, costs, budget, floors=floors) == _naive_greedy(losses, costs, budget, floors=floors)
    got = greedy_allocate(losses, costs, budget, floors=floors, density_costs=dcosts)
    assert got == _naive_greedy(losses, costs, budget, dcosts, floors)
    assert all(j >= f for j, f in zip(got, floors)) and total(costs, got) <= budget


def test_greedy_allocate_density_costs_change_the_order():
    # Equal storage steps, block 1 cheaper in latency: it wins the single upgrade despite less gain.
    losses, costs = [[10.0, 4.0], [10.0, 6.0]], [[2, 3], [2, 3]]
    assert greedy_allocate(losses, costs, 5) == [1, 0]
    assert greedy_allocate(losses, costs, 5, density_costs=[[0, 10], [0, 1]]) == [0, 1]


def test_greedy_allocate_floors_infeasible_names_minimum_budget():
    with pytest.raises(ValueError, match="needs 50 bits.*lower the floors"):
        greedy_allocate([[1.0, 0.5], [2.0, 1.0]], [[10, 20], [20, 40]], 45, floors=[0, 1])
    assert min_feasible_budget([[10, 20], [20, 40]], floors=[0, 1]) == 50


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"floors": [0, 2]}, r"floors\[1\]=2 is out of range"),
        ({"floors": [0]}, "one integer candidate index per block"),
        ({"density_costs": [[1, 2]]}, "same shape as costs"),
        ({"density_costs": [[1, 2], [3, 3]]}, "density_costs must be strictly ascending"),
    ],
)
def test_greedy_allocate_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        greedy_allocate([[1.0, 0.5], [2.0, 1.0]], [[10, 20], [20, 40]], 100, **kwargs)


def test_greedy_allocate_rejects_non_finite_and_bad_shapes():
    with pytest.raises(ValueError, match="block 1: losses must be finite"):
        greedy_allocate([[1.0, 0.5], [float("nan"), 1.0]], [[10, 20], [20, 40]], 100)
    with pytest.raises(ValueError, match="must be 2-D"):
        greedy_allocate(np.ones(3), np.ones(3), 100)
    with pytest.raises(ValueError, match="losses has 2 blocks but costs has 1"):
        greedy_allocate([[1.0], [2.0]], [[1]], 100)


def test_total_numpy_matches_lists():
    rng = np.random.default_rng(0)
    table, choice = rng.random((50, 4)), rng.integers(0, 4, 50).tolist()
    assert total(table, choice) == total(table.tolist(), choice)


# ---------------------------------------------------------------- hardware-aware tie-breaking


def _layered(seed, n_layers=6, per=8, noise=0.01):
    """Layers of near-identical blocks (relative noise 1%), equal 1040-bit steps for bits 2..5."""
    rng = np.random.default_rng(seed)
    bits = [2, 3, 4, 5]
    layer = np.repeat(np.arange(n_layers), per)
    scale = rng.lognormal(0, 1, n_layers)[layer] * (1 + noise * rng.standard_normal(layer.size))
    loss = scale[:, None] * np.exp(-np.array(bits)[None, :] * rng.uniform(0.5, 1.0, n_layers)[layer][:, None])
    cost = np.tile(1040.0 * np.array(bits), (layer.size, 1))
    return loss, cost, _budget(rng, cost), layer.tolist(), [bits] * layer.size


def _distinct(choice, layer, bits):
    per = {}
    for b, j in enumerate(choice):
        per.setdefault(layer[b], set()).add(bits[b][j])
    return {k: len(v) for k, v in per.items()}


@pytest.mark.parametrize("seed", range(10))
def test_hw_greedy_allocate_eta_zero_equals_greedy(seed):
    rng = np.random.default_rng(seed)
    loss, cost = _instance(rng, 40, 4, "ties" if seed % 2 else "convex")
    budget = _budget(rng, cost)
    layer, bits = (np.arange(40) // 5).tolist(), [[2, 3, 4, 8]] * 40
    expect = greedy_allocate(loss, cost, budget)
    assert hw_greedy_allocate(loss, cost, budget, layer=layer, bits=bits, eta=0.0) == expect


def test_hw_greedy_allocate_fewer_kernels_than_greedy():
    # Per seed and eta: sum over layers of distinct bit-widths never above greedy's, within
    # budget; strictly fewer on a good share of the instances.
    fewer = 0
    for seed in range(60):
        loss, cost, budget, layer, bits = _layered(seed)
        dg = _distinct(greedy_allocate(loss, cost, budget), layer, bits)
        for eta in (0.03, 0.1):
            choice = hw_greedy_allocate(loss, cost, budget, layer=layer, bits=bits, eta=eta)
            assert total(cost, choice) <= budget
            dh = _distinct(choice, layer, bits)
            assert sum(dh.values()) <= sum(dg.values())
            fewer += sum(dh.values()) < sum(dg.values())
    assert fewer >= 5


def test_hw_greedy_allocate_at_most_one_mixed_layer_on_interleaved_layers():
    # Two layers of 6 blocks whose densities interleave within 0.1%: greedy upgrades blocks of
    # both in turn and, cut mid-way, leaves both layers mixed (4 kernels); hw finishes one layer
    # first, so at most one layer is mixed.  Per layer it is NOT monotone: for 9-11 upgrades
    # greedy has finished layer 0 while hw finished layer 1 (same total).
    rng = np.random.default_rng(0)
    layer, bits = [0] * 6 + [1] * 6, [[3, 4]] * 12
    scale = 1 + 0.001 * rng.standard_normal(12)
    loss = np.stack([scale * 8.0, scale * 4.0], axis=1)  # (12, 2)
    cost = np.tile([3.0, 4.0], (12, 1))
    greedy_kernels = []
    for extra in range(13):
        dg = _distinct(greedy_allocate(loss, cost, 36 + extra), layer, bits)
        dh = _distinct(hw_greedy_allocate(loss, cost, 36 + extra, layer=layer, bits=bits, eta=0.01), layer, bits)
        assert sum(dh.values()) <= min(sum(dg.values()), 3)
        greedy_kernels.append(sum(dg.values()))
    assert max(greedy_kernels) == 4


@pytest.mark.parametrize("seed", range(15))
def test_hw_greedy_allocate_loss_bound_vs_dp(seed):
    # Equal steps on convex curves: nothing is skipped before the budget is used up, so
    # L_hw <= L*(c) + eta * (L_floor - L*(c)) at the spent bits c (L* from the DP oracle).
    loss, cost, budget, layer, bits = _layered(100 + seed, n_layers=4, per=5, noise=0.05)
    floor_loss = total(loss, [0] * len(layer))
    for eta in (0.05, 0.2, 0.5):
        choice = hw_greedy_allocate(loss, cost, budget, layer=layer, bits=bits, eta=eta)
        spent = total(cost, choice)
        best = total(loss, dp_allocate(loss, cost, spent))
        assert total(loss, choice) <= best + eta * (floor_loss - best) + 1e-12


def test_hw_greedy_allocate_rejects_bad_input():
    loss, cost = [[1.0, 0.5], [2.0, 1.0]], [[10, 20], [20, 40]]
    with pytest.raises(ValueError, match=r"eta must be in \[0, 1\)"):
        hw_greedy_allocate(loss, cost, 100, layer=[0, 0], bits=[[2, 4], [2, 4]], eta=1.5)
    with pytest.raises(ValueError, match="one id per block"):
        hw_greedy_allocate(loss, cost, 100, layer=[0], bits=[[2, 4], [2, 4]])


# ---------------------------------------------------------------- random control


@pytest.mark.parametrize("seed", range(10))
def test_random_allocate_within_budget_maximal_and_deterministic(seed):
    rng = np.random.default_rng(seed)
    _, cost = _instance(rng, 30, 4, "mixed")
    budget, floors = _budget(rng, cost), rng.integers(0, 2, 30).tolist()
    budget = max(budget, min_feasible_budget(cost, floors=floors))
    choice = random_allocate(cost, budget, seed=seed, floors=floors)
    assert choice == random_allocate(cost, budget, seed=seed, floors=floors)
    spent = total(cost, choice)
    assert spent <= budget and all(j >= f for j, f in zip(choice, floors))
    # maximal: no block's next candidate still fits
    assert all(j + 1 == 4 or spent + cost[b, j + 1] - cost[b, j] > budget for b, j in enumerate(choice))


def test_random_allocate_seeds_differ():
    cost = np.tile([1.0, 2.0, 3.0], (50, 1))
    draws = {tuple(random_allocate(cost, 100, seed=s)) for s in range(5)}
    assert len(draws) == 5


# ---------------------------------------------------------------- Lagrangian


def _lagrangian_solutions(loss, cost):
    """Every per-block argmin of L + lam C, lam at midpoints between all pairwise slopes."""
    slopes = {0.0}
    for lb, cb in zip(loss.tolist(), cost.tolist()):
        for i, j in itertools.combinations(range(len(lb)), 2):
            slopes.add(max(0.0, (lb[i] - lb[j]) / (cb[j] - cb[i])))
    s = sorted(slopes)
    lams = [x / 2 for x in s[:1]] + [(a + b) / 2 for a, b in zip(s, s[1:])] + [2 * s[-1] + 1]
    return [np.argmin(loss + lam * cost, axis=1) for lam in lams]


@pytest.mark.parametrize("seed", range(25))
def test_lagrangian_allocate_optimal_at_own_cost_vs_dp(seed):
    # Everett: the argmin of L + lam C is optimal among allocations costing at most its cost
    # (any tables).  lam=None: it fits the budget and is the costliest Lagrangian solution that
    # does (brute force over all slopes), i.e. the cheapest lam.
    rng = np.random.default_rng(700 + seed)
    loss, cost = _instance(rng, 8, 4, "convex" if seed % 2 else "ties")
    budget = _budget(rng, cost)
    choice = lagrangian_allocate(loss, cost, budget)
    own = total(cost, choice)
    assert own <= budget
    assert total(loss, choice) == pytest.approx(total(loss, dp_allocate(loss, cost, own)), rel=1e-12, abs=1e-12)
    assert total(loss, choice) >= total(loss, dp_allocate(loss, cost, budget)) - 1e-12
    fitting = [total(cost, c) for c in _lagrangian_solutions(loss, cost) if total(cost, c) <= budget]
    assert own == max(fitting)
    lam = lagrangian_lambda(loss, cost, budget)
    assert choice == np.argmin(loss + lam * cost, axis=1).tolist()


def test_lagrangian_allocate_explicit_lam_vs_brute_argmin():
    loss, cost = [[5.0, 2.0, 1.5], [9.0, 3.0, 2.0]], [[1, 2, 3], [1, 2, 3]]
    # block 0: 5+1, 2+2, 1.5+3 -> 1 ; block 1: 9+1, 3+2, 2+3 -> 1 (first on ties)
    assert lagrangian_allocate(loss, cost, 100, lam=1.0) == [1, 1]
    assert lagrangian_allocate(loss, cost, 100, lam=0.0) == [2, 2]
    with pytest.raises(ValueError, match="over the budget.*raise lam"):
        lagrangian_allocate(loss, cost, 3, lam=0.0)
    with pytest.raises(ValueError, match="lam must be finite and >= 0"):
        lagrangian_allocate(loss, cost, 100, lam=-1.0)


# ---------------------------------------------------------------- DP oracle


@pytest.mark.parametrize("seed", range(15))
def test_dp_allocate_floors_vs_brute_force(seed):
    rng = random.Random(900 + seed)
    costs = [sorted(rng.sample(range(1, 40), 4)) for _ in range(5)]
    losses = [[rng.uniform(0, 10) for _ in range(4)] for _ in range(5)]
    floors = [rng.randint(0, 3) for _ in range(5)]
    budget = rng.uniform(min_feasible_budget(costs, floors=floors), sum(c[-1] for c in costs))
    choice = dp_allocate(losses, costs, budget, floors=floors)
    assert total(costs, choice) <= budget and all(j >= f for j, f in zip(choice, floors))
    assert total(losses, choice) == pytest.approx(_brute(losses, costs, budget, floors)[0], rel=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_allocate_vs_dp_few_hundred_blocks(seed):
    # Realistic concave curves, 300 blocks x 4 bit-widths: greedy never better, gap < 0.1 %.
    rng = np.random.default_rng(seed)
    loss, cost = _instance(rng, 300, 4, "convex")
    budget = float(rng.uniform(2.5, 5.0) * 1024 * 300)
    best = total(loss, dp_allocate(loss, cost, budget))
    got = total(loss, greedy_allocate(loss, cost, budget))
    assert best <= got <= best * (1 + 1e-3)


@pytest.mark.parametrize(
    ("losses", "costs", "budget", "expect"),
    [
        # u0 has collinear hull steps (density 1, gains 2 then 4): its second step must not be
        # ordered before its first although its own key (gain 4) beats u1's (gain 3).
        ([[6.0, 4.0, 0.0], [3.0, 0.0], [2.7, 0.0]], [[0, 2, 6], [0, 3], [0, 3]], 8, [1, 1, 1]),
        # u0's hull densities rise by rounding (0.09999999999999999 then 0.1): same rule.
        ([[0.3, 0.1, 0.0], [0.1, 0.0], [0.05, 0.0]], [[0, 2, 3], [0, 1], [0, 1]], 3, [1, 1, 0]),
    ],
)
def test_greedy_allocate_prefix_key_matches_heap(losses, costs, budget, expect):
    assert _heap_reference(losses, costs, budget) == expect
    assert greedy_allocate(losses, costs, budget) == expect


# ---- budget regularisation (penalty lambda) ------------------------------------------------------

def _brute_penalised(losses, costs, budget, lam):
    best = float("inf")
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        if total(costs, choice) <= budget:
            best = min(best, total(losses, choice) + lam * total(costs, choice))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_dp_allocate_penalty_vs_brute_force(seed):
    rng = random.Random(900 + seed)
    losses, costs = [], []
    for _ in range(5):
        c = sorted(rng.sample(range(1, 40), 4))
        losses.append(sorted((rng.uniform(0, 10) for _ in c), reverse=True))
        costs.append(c)
    budget = rng.uniform(min_feasible_budget(costs), sum(c[-1] for c in costs))
    lam = rng.choice([0.0, 0.05, 0.2, 1.0])
    choice = dp_allocate(losses, costs, budget, penalty=lam)
    assert total(costs, choice) <= budget
    got = total(losses, choice) + lam * total(costs, choice)
    assert got == pytest.approx(_brute_penalised(losses, costs, budget, lam), rel=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_greedy_allocate_penalty_with_slack_budget_is_exact_optimum(seed):
    # With a budget that does not bind, stopping at density < lambda is the per-block argmin of
    # L + lambda C on convex (diminishing-returns) blocks: the DP's optimum, and Lagrangian's.
    rng = random.Random(950 + seed)
    blocks = [_convex_block(rng, 4, [rng.randint(1, 9) for _ in range(3)]) for _ in range(6)]
    losses, costs = [b[0] for b in blocks], [b[1] for b in blocks]
    budget = sum(c[-1] for c in costs)
    lam = rng.uniform(0.05, 2.0)
    g = greedy_allocate(losses, costs, budget, penalty=lam)
    exact = _brute_penalised(losses, costs, budget, lam)
    assert total(losses, g) + lam * total(costs, g) == pytest.approx(exact, rel=1e-12)
    lg = lagrangian_allocate(losses, costs, budget, penalty=lam)
    assert total(losses, lg) + lam * total(costs, lg) == pytest.approx(exact, rel=1e-12)
    hw = hw_greedy_allocate(losses, costs, budget, layer=[0] * 6, bits=[[2, 3, 4, 8]] * 6, eta=0.0, penalty=lam)
    assert hw == g


@pytest.mark.parametrize("seed", range(10))
def test_greedy_allocate_penalty_monotone_and_zero_is_plain_greedy(seed):
    rng = random.Random(980 + seed)
    blocks = [_convex_block(rng, 4, [rng.randint(1, 9) for _ in range(3)]) for _ in range(40)]
    losses, costs = [b[0] for b in blocks], [b[1] for b in blocks]
    budget = (min_feasible_budget(costs) + sum(c[-1] for c in costs)) / 2
    assert greedy_allocate(losses, costs, budget, penalty=0.0) == greedy_allocate(losses, costs, budget)
    spent = [total(costs, greedy_allocate(losses, costs, budget, penalty=lam)) for lam in (0, 0.1, 0.5, 2, 100)]
    assert spent == sorted(spent, reverse=True) and spent[-1] == min_feasible_budget(costs)
    hw = [hw_greedy_allocate(losses, costs, budget, layer=list(range(40)), bits=[[2, 3, 4, 8]] * 40, eta=0.05,
                             penalty=lam) for lam in (0.5, 100)]
    assert total(costs, hw[1]) == min_feasible_budget(costs) <= total(costs, hw[0]) <= budget


def test_allocators_reject_negative_penalty():
    for fn in (lambda **k: greedy_allocate([[1, 0]], [[1, 2]], 2, **k),
               lambda **k: dp_allocate([[1, 0]], [[1, 2]], 2, **k),
               lambda **k: hw_greedy_allocate([[1, 0]], [[1, 2]], 2, layer=[0], bits=[[2, 3]], **k)):
        with pytest.raises(ValueError, match="penalty must be a finite number >= 0"):
            fn(penalty=-1.0)


def test_allocators_one_signature_vs_direct_calls():
    """Every allocator of the config is called as ALLOCATORS[name](Problem) and gives what the
    function gives when called directly."""
    from bayesq.allocators import ALLOCATORS, Problem
    from bayesq.config import Allocator

    assert set(ALLOCATORS) == {a.value for a in Allocator}
    rng = np.random.default_rng(5)
    loss = np.sort(rng.random((12, 4)), axis=1)[:, ::-1].copy()
    cost = np.cumsum(rng.integers(5, 20, (12, 4)), axis=1).astype(float)
    bits = [[2, 3, 4, 8]] * 12
    layer = [i // 4 for i in range(12)]
    budget = float(cost[:, 1].sum())
    p = Problem(loss, cost, budget, layer=layer, bits=bits, tolerance=0.05, seed=3)
    direct = {
        "greedy": greedy_allocate(loss, cost, budget),
        "greedy-hw": hw_greedy_allocate(loss, cost, budget, layer=layer, bits=bits, eta=0.05),
        "dp": dp_allocate(loss, cost, budget),
        "lagrangian": lagrangian_allocate(loss, cost, budget),
        "random": random_allocate(cost, budget, seed=3),
    }
    for name, pick in direct.items():
        assert ALLOCATORS[name](p) == pick, name
        assert sum(cost[i, j] for i, j in enumerate(pick)) <= budget
    with pytest.raises(ValueError, match="needs each block's layer"):
        ALLOCATORS["greedy-hw"](Problem(loss, cost, budget))
