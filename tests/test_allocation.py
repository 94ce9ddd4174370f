import itertools
import random

import pytest

from bayesq.allocation import dp_allocate, greedy_allocate, min_feasible_budget, total


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
