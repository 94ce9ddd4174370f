"""Layer-input statistics as the library computes them (each batch in the model's dtype, batches
added in float64) against a float64 reference on the same rows, per embedded model.

    python benchmarks/input_stats.py [--models lite0-fmnist,minilm-sentiment] [--seed 17] [--threads 1]

Prints, per model, the wall seconds of :func:`bayesq.baselines.activations.input_stats` (H, mean
|a|, mean a) and of the reference (H only, every batch widened to float64 and reduced with one
einsum, as before), and the largest and median relative Frobenius error of H over the layers
(docs/method.md, section 18f; the timings: docs/findings.md, "One-time cost against GPTQ's"). Needs ``models/`` and ``data/raw`` from ``make run``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from one_time_cost import load_inputs


def compare(model, calibration) -> tuple[float, float, dict[str, float]]:
    """(library seconds, reference seconds, layer -> relative Frobenius error of H)."""
    from bayesq.baselines.activations import input_stats
    from bayesq.blocks import quantizable_layers
    from bayesq.posterior import forward_inputs

    layers = quantizable_layers(model)
    start = time.perf_counter()
    got = input_stats(model, calibration, layers)
    fast = time.perf_counter() - start
    sums: dict[str, torch.Tensor] = {}

    def add(name: str, rows: torch.Tensor) -> None:
        r = rows.double()
        h = torch.einsum("ngti,ngtj->gij", r, r)
        sums[name] = sums[name] + h if name in sums else h

    start = time.perf_counter()
    n = forward_inputs(model, calibration, layers, add)
    slow = time.perf_counter() - start
    return fast, slow, {k: float((got[k].H - v / n).norm() / (v / n).norm()) for k, v in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lite0-fmnist,minilm-sentiment")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for name in a.models.split(","):
        _, model, calibration, _ = load_inputs(name, a.seed, a.params)
        fast, slow, err = compare(model, calibration)
        worst = max(err, key=err.get)
        print(f"{name}: input_stats {fast:.1f} s, float64 reference {slow:.1f} s (ratio {slow / fast:.2f}); "
              f"relative error of H: max {err[worst]:.2e} ({worst}), median {sorted(err.values())[len(err) // 2]:.2e}")


if __name__ == "__main__":
    main()
