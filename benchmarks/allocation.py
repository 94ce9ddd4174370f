"""Bit-allocation solvers: greedy speed at 10^6 units and objective gaps to the exact DP.

    python benchmarks/allocation.py [--units 1000000] [--dp-units 400] [--seeds 8]

Synthetic but realistic tables, all measured in this one run: units of 1024 weights in 16
groups, bit-widths {2, 3, 4, 8}, exact costs ``bayesq.storage.unit_cost_bits(1024, 16, b, 4)``,
losses ``s_u * 4^(-r_u * b)`` (decreasing, roughly exponential in bits) with log-normal scales
shared by a layer of 16 units, per-unit rates and 10 % multiplicative noise (so a few curves are
not convex), made monotone.  Prints:

(a) greedy wall time on 10^6 units x 4 bit-widths at 3.5 bits/weight (first call and median of
    5), goal <= 1 s;
(b) relative objective gap of greedy to the DP optimum, (L - L_dp) / L_dp in %, mean and max
    over seeds x budgets {3.0, 3.5, 4.0} bits/weight, goal <= 0.1 %;
(c) the same gap for hw tie-breaking (eta = 0.01 and 0.05, layers of 16 units), the Lagrangian solution
    (cheapest fitting multiplier) and the random ablation control, plus kernels per layer.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from bayesq.allocation import greedy_allocate, hw_greedy_allocate, total
from bayesq.allocators import dp_allocate, lagrangian_allocate, random_allocate
from bayesq.storage import unit_cost_bits

BITS = (2, 3, 4, 8)
LAYER = 16  # units per layer
BUDGETS = (3.0, 3.5, 4.0)  # bits per weight


def tables(n_units: int, seed: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(losses (n, 4), costs (n, 4), layer id per unit) as described in the module docstring."""
    rng = np.random.default_rng(seed)
    layer = np.arange(n_units) // LAYER
    scale = rng.lognormal(0.0, 1.5, layer[-1] + 1)[layer] * rng.lognormal(0.0, 0.3, n_units)
    rate = rng.uniform(0.7, 1.1, n_units)
    loss = scale[:, None] * 4.0 ** (-rate[:, None] * np.array(BITS)[None, :])  # (n, 4)
    loss = np.minimum.accumulate(loss * rng.lognormal(0.0, 0.1, loss.shape), axis=1)
    cost = np.tile(np.array([unit_cost_bits(1024, 16, b, len(BITS)) for b in BITS], float), (n_units, 1))
    return loss, cost, layer.tolist()


def kernels(choice: list[int], layer: list[int]) -> int:
    """Sum over layers of the number of distinct bit-widths used."""
    return len({(layer[u], BITS[j]) for u, j in enumerate(choice)})


def speed(n_units: int) -> tuple[float, float]:
    loss, cost, _ = tables(n_units, seed=0)
    budget = 3.5 * 1024 * n_units
    times = []
    for _ in range(6):
        start = time.perf_counter()
        choice = greedy_allocate(loss, cost, budget)
        times.append(time.perf_counter() - start)
    assert total(cost, choice) <= budget
    return times[0], statistics.median(times[1:])


def gaps(n_units: int, seeds: int) -> dict[str, list[float]]:
    names = ("greedy", "hw 0.01", "hw 0.05", "lagrangian", "random")
    extra = ("dp_s", "kern greedy", "kern hw 0.01", "kern hw 0.05")
    out: dict[str, list[float]] = {k: [] for k in names + extra}
    for seed in range(seeds):
        loss, cost, layer = tables(n_units, seed=100 + seed)
        for avg in BUDGETS:
            budget = avg * 1024 * n_units
            start = time.perf_counter()
            best = total(loss, dp_allocate(loss, cost, budget))
            out["dp_s"].append(time.perf_counter() - start)
            g = greedy_allocate(loss, cost, budget)
            bits = [BITS] * n_units
            hw = {e: hw_greedy_allocate(loss, cost, budget, layer=layer, bits=bits, eta=e) for e in (0.01, 0.05)}
            choices = {
                "greedy": g,
                "hw 0.01": hw[0.01],
                "hw 0.05": hw[0.05],
                "lagrangian": lagrangian_allocate(loss, cost, budget),
                "random": random_allocate(cost, budget, seed=seed),
            }
            for name, c in choices.items():
                assert total(cost, c) <= budget, name
                out[name].append(100.0 * (total(loss, c) - best) / best)
            for name in ("greedy", "hw 0.01", "hw 0.05"):
                out[f"kern {name}"].append(kernels(choices[name], layer))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=1_000_000)
    ap.add_argument("--dp-units", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} "
          f"python={platform.python_version()} numpy={np.__version__}")

    first, median = speed(args.units)
    ok_a = median <= 1.0
    print(f"(a) greedy, {args.units} units x {len(BITS)} bit-widths: first call {first:.3f} s, "
          f"median of 5 {median:.3f} s -> goal <= 1 s {'MET' if ok_a else 'NOT MET'}")

    res = gaps(args.dp_units, args.seeds)
    n = len(res["greedy"])
    print(f"(b)+(c) gap to the DP optimum, {args.dp_units} units, {args.seeds} seeds x budgets "
          f"{BUDGETS} bits/weight = {n} instances (DP {statistics.mean(res['dp_s']):.3f} s each on average)")
    for name in ("greedy", "hw 0.01", "hw 0.05", "lagrangian", "random"):
        print(f"    {name:<11s} mean {statistics.mean(res[name]):9.5f} %   max {max(res[name]):9.5f} %")
    ok_b = max(res["greedy"]) <= 0.1
    print(f"    greedy goal max gap <= 0.1 %: {'MET' if ok_b else 'NOT MET'}")
    kern = ", ".join(f"{k} {statistics.mean(res['kern ' + k]):.2f}" for k in ("greedy", "hw 0.01", "hw 0.05"))
    print(f"    kernels per instance (sum over {args.dp_units // LAYER} layers of distinct bit-widths), mean: {kern}")


if __name__ == "__main__":
    main()
