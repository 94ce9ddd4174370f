"""Rounding against rounding on the same grids and bits: KL to the FP model, paired, on held-out inputs.

For each fine-tuned embedded model (``make run`` first, or at least its fine-tune stage) and the
pipeline's calibration draw (seed ``--seed``): each method of ``--methods`` without its variant
selection (``select=False``: its own mixed rule at ``--budget``; GPTQ, AdaRound and LSQ then share
the min/max grids and the allocation, and differ only in how they round or fit the grids), then the per-input
``KL(p_FP || p_Q)`` on the pipeline's selection draw (held out of the calibration inputs, read
by no method here). Prints each method's mean KL, seconds and true bits, and each method minus
the first with its paired 95 % bootstrap interval (``*``: it excludes 0).

    python benchmarks/rival_kl.py [--models lite0-fmnist minilm-sentiment] [--methods gptq adaround brecq lsq lsq-plus rtn]
                                  [--budget 3.0] [--iters N] [--seed 17]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def configs(iters: int | None) -> dict:
    """Each method without its selection; ``iters``: the learned methods' steps (None: their defaults)."""
    from bayesq.baselines.adaround import AdaRoundConfig
    from bayesq.baselines.brecq import BRECQConfig
    from bayesq.baselines.gptq import GPTQConfig
    from bayesq.baselines.lsq import LSQConfig
    from bayesq.baselines.rtn import RTNConfig
    from bayesq.config import Granularity

    steps = {} if iters is None else {"iters": iters}
    return {"gptq": GPTQConfig(select=False), "adaround": AdaRoundConfig(select=False, **steps),
            "lsq": LSQConfig(select=False, **steps), "lsq-plus": LSQConfig(select=False, offset=True, **steps),
            "brecq": BRECQConfig(select=False, **steps), "rtn": RTNConfig(Granularity.GROUP)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lite0-fmnist", "minilm-sentiment"])
    ap.add_argument("--methods", nargs="+", default=["gptq", "adaround"])
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=None, help="steps of every learned method (default: each one's own)")
    ap.add_argument("--seed", type=int, default=17)
    a = ap.parse_args()

    from one_time_cost import load_inputs

    from bayesq.baselines.activations import input_stats
    from bayesq.canonical import canonical
    from bayesq.comparison import paired_difference
    from bayesq.evaluation import kl_per_input, reference_log_probs
    from bayesq.methods import Inputs, quantize_with

    cfgs = configs(a.iters)
    for name in a.models:
        _, model, calibration, selection = load_inputs(name, a.seed, ROOT / "params.yaml")
        with canonical(model) as m:
            stats = input_stats(m, calibration)
        reference = reference_log_probs(model, selection)
        kl = {}
        for method in a.methods:
            start = time.perf_counter()
            res = quantize_with(model, cfgs[method], a.budget, Inputs(calibration=calibration, stats=stats)).result
            seconds = time.perf_counter() - start
            with torch.no_grad():
                kl[method] = kl_per_input(reference, res.model, selection)
            print(f"{name} {method}: KL {kl[method].mean():.5f} ({len(kl[method])} held-out inputs), "
                  f"{res.average_bits:.3f} bits, {seconds:.0f} s", flush=True)
        first = a.methods[0]
        for method in a.methods[1:]:
            d = paired_difference(kl[method], kl[first])
            star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
            print(f"{name} {method} - {first}: KL {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}", flush=True)


if __name__ == "__main__":
    main()
