"""Seed statistics and table layout of flows/robustness_report.py against hand-computed values."""

import math

from flows.robustness_report import calibration_table, seed_stats


def test_seed_stats_vs_t_table():
    # three seeds 1, 2, 3: mean 2, SD 1, t_{0.975, 2} = 4.3027 (printed t tables) -> half-width 4.3027 / sqrt(3)
    mean, sd, half = seed_stats([1.0, 2.0, 3.0])
    assert mean == 2.0 and sd == 1.0
    assert math.isclose(half, 4.302653 / math.sqrt(3), rel_tol=1e-6)


def test_seed_stats_one_seed_has_no_interval():
    mean, sd, half = seed_stats([0.5])
    assert mean == 0.5 and math.isnan(sd) and math.isnan(half)


def _record(method, seed, acc, budget=3.0):
    cal = {k: 0.1 for k in ("ece", "ece_random", "mce", "nll", "worst5", "worst10", "cvar90", "cvar95")}
    return {"model": "m", "method": method, "seed": seed, "budget": budget, "calibration": {**cal, "accuracy": acc}}


def test_calibration_table_mean_sd_interval_over_seeds():
    records = [_record("fp", 17, 0.9, 32.0)] + [_record("bayesq", s, a) for s, a in ((17, 0.80), (29, 0.82), (43, 0.84))]
    lines = calibration_table(records, 3.0)
    row = next(line for line in lines if line.startswith("| BayesQ |"))
    half = 4.302653 * 2.0 / math.sqrt(3)  # accuracy in points: SD 2.00
    assert f"82.00 ± 2.00 [{82 - half:.2f}, {82 + half:.2f}]" in row
    assert next(line for line in lines if line.startswith("| FP (32-bit) |")).split(" | ")[1] == "90.00"
