"""The annealing search with each unit's outputs reused against full passes, side by side.

For each embedded fine-tuned model, the pipeline's ``anneal`` row settings (params.yaml, 3.0
bits, the seed's calibration draw, its first ``search_inputs`` inputs): GPTQ's encodings at every
width once, then :func:`bayesq.baselines.anneal.anneal_search` with ``reuse=True`` (a proposal
runs from the first unit it changes) and ``reuse=False`` (every pass in full), one after the other
in this process. Prints each one's seconds, their ratio, and whether the traces (every energy,
accept / reject decision and the best assignment) are identical, which they must be.

    python benchmarks/anneal_reuse.py [--models lite0-fmnist minilm-sentiment] [--steps 200]
                                      [--budget 3.0] [--seed 17]

Needs ``models/`` and ``data/raw`` (``make run``, or at least its fine-tune stage).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["lite0-fmnist", "minilm-sentiment"])
    ap.add_argument("--steps", type=int, default=None, help="moves of each search (default: params.yaml's)")
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=17)
    a = ap.parse_args()

    from flows.settings import apply_defaults
    apply_defaults()
    from one_time_cost import load_inputs

    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.anneal import anneal_search, layer_encodings
    from bayesq.blocks import quantizable_layers
    from bayesq.canonical import canonical
    from bayesq.forward import first_inputs
    from flows.configs import method_config

    for name in a.models:
        params, model, calibration, _ = load_inputs(name, a.seed, ROOT / "params.yaml")
        cfg = method_config("anneal", params, a.budget, a.seed)[0]
        steps = cfg.steps if a.steps is None else a.steps
        with canonical(model) as m:
            layers = quantizable_layers(m)
            table, enc = layer_encodings(layers, input_stats(m, calibration, layers), cfg.quant)
            search = first_inputs(calibration, cfg.search_inputs)
            traces, seconds = {}, {}
            for reuse in (True, False):
                start = time.perf_counter()
                traces[reuse] = anneal_search(m, table, enc, search, a.budget, steps=steps, t_start=cfg.t_start,
                                              t_end=cfg.t_end, seed=cfg.seed, progress=True, reuse=reuse)
                seconds[reuse] = time.perf_counter() - start
        t = traces[True]
        print(f"{name}: {steps} moves on {cfg.search_inputs} inputs, {t.accepted} accepted, KL {t.start_kl:.5f} -> "
              f"{t.best_kl:.5f}; reused {seconds[True]:.1f} s, full passes {seconds[False]:.1f} s, ratio "
              f"{seconds[True] / seconds[False]:.2f}; traces identical: {traces[True] == traces[False]}", flush=True)


if __name__ == "__main__":
    main()
