"""Do the learned rivals converge before their step counts? A layer objective against the step count.

On the pipeline's fine-tuned embedded models and calibration inputs (``make run`` first, or at
least its fine-tune stage: ``models/<name>/model.safetensors``), for a few layers of each model:
min/max grids per group of 64 at ``--bits`` (GPTQ's static grids, the ones the learned rivals
start from in this project), then the hard-rounded layer-output error ``tr(D H D^T)`` of

* nearest rounding, GPTQ's error feedback (its damped metric), and
* ``--method`` after each step count of ``--iters`` (each a separate run of the full schedule with
  that many steps, as the method would run): ``adaround`` (its codes on the min/max grids),
  ``lsq``, ``lsq-plus`` or ``pact`` (nearest codes on the learned grids, ``--lr`` the step on
  ``s / s^0``, ``--zero-lr`` LSQ+'s on the zero-points), ``dorefa`` (its straight-through codes
  on the min/max grids, ``--lr`` the step on the latent weights in code units), ``bitsplit``
  (``--iters`` its epochs: symmetric grids from its weight-space start, plane-wise codes, the
  scales refitted to them as the method stores them),

each relative to nearest rounding on the min/max grids, with the seconds the method took. The
last lines say, per model, the smallest step count whose mean ratio over the layers is within
``--tol`` (1 %) of the largest count's: the count a scaled-down default may use.

    python benchmarks/learned_iters.py [--method adaround|lsq|lsq-plus|pact|dorefa|bitsplit] [--models lite0-fmnist minilm-sentiment]
                                       [--layers 4] [--iters 250 500 1000 2000 4000 10000] [--bits 3]
                                       [--tol 0.01] [--lr 0.2] [--zero-lr 0.02]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def layer_grid(W: torch.Tensor, bits: int, group: int = 64):
    """Per-group min/max grid (scale, zero, maxq) of ``bits`` bits over groups of ``group``
    columns, and the (out, d_in) group index of each weight."""
    from bayesq.blocks import LayerBlocks
    from bayesq.grids import minmax_grids
    from bayesq.rounding import group_grid

    lb = LayerBlocks("w", tuple(W.shape), group, 1)
    groups, _ = lb.to_groups(W.reshape(-1))
    book = minmax_grids(groups, bits)
    scale, zero, maxq = group_grid(lb, torch.full((lb.n_groups,), bits), {bits: book})
    return scale, zero, maxq, lb.element_groups(slice(0, W.shape[0]), W.device)


def fitted(method: str, W, metric, scale, zero, maxq, idx, iters: int, lr: float, zero_lr: float, name: str):
    """(scale, zero, codes) per element after ``method`` at ``iters`` steps."""
    from bayesq.baselines.adaround import adaround_rows
    from bayesq.baselines.bitsplit import bitsplit_rows, symmetric_grid
    from bayesq.baselines.dorefa import dorefa_rows
    from bayesq.baselines.lsq import StepGradient, lsq_grid, nearest_rows
    from bayesq.refit import refit_scales

    if method == "bitsplit":
        s, z = symmetric_grid(W, metric, scale, zero, maxq, idx)
        codes = bitsplit_rows(W, metric, s[idx], z[idx], maxq[idx], groups=idx, epochs=iters, progress=True, name=name)
        s = refit_scales(W, codes.double() - z[idx], idx, s, metric)[0]
        return s[idx], z[idx], codes
    if method in ("adaround", "dorefa"):
        s, z, m = scale[idx], zero[idx], maxq[idx]
        if method == "dorefa":
            return s, z, dorefa_rows(W, metric, s, z, m, iters=iters, lr=lr, progress=True, name=name)
        return s, z, adaround_rows(W, metric, s, z, m, iters=iters, progress=True, name=name)
    gradient = StepGradient.PACT if method == "pact" else StepGradient.LSQ
    s, z = lsq_grid(W, metric, scale, zero, maxq, idx, offset=method == "lsq-plus", iters=iters, lr=lr,
                    zero_lr=zero_lr, gradient=gradient, progress=True, name=name)
    return s[idx], z[idx], nearest_rows(W, metric, s[idx], z[idx], maxq[idx])


def error(W, H, scale, zero, codes) -> float:
    D = scale * (codes.double() - zero) - W
    return float((D * (D @ H)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", choices=["adaround", "lsq", "lsq-plus", "pact", "dorefa", "bitsplit"], default="adaround")
    ap.add_argument("--models", nargs="+", default=["lite0-fmnist", "minilm-sentiment"])
    ap.add_argument("--layers", type=int, default=4, help="layers per model, spread over its depth")
    ap.add_argument("--iters", type=int, nargs="+", default=[250, 500, 1000, 2000, 4000, 10000])
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--tol", type=float, default=0.01)
    ap.add_argument("--lr", type=float, default=0.2, help="LSQ, PACT: Adam's step on s / s^0; DoReFa: on the latent weights (code units)")
    ap.add_argument("--zero-lr", type=float, default=0.02, help="LSQ+: Adam's step on the zero-points")
    ap.add_argument("--seed", type=int, default=17)
    a = ap.parse_args()

    from one_time_cost import load_inputs

    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.lsq import nearest_rows
    from bayesq.blocks import quantizable_layers
    from bayesq.canonical import canonical
    from bayesq.error_feedback import damped_metric, error_feedback_groups

    for name in a.models:
        _, model, batches, _ = load_inputs(name, a.seed, ROOT / "params.yaml")
        with canonical(model) as m:
            layers = quantizable_layers(m, ())
            names = [k for k in layers if getattr(layers[k], "groups", 1) == 1]
            picked = names[:: max(1, len(names) // a.layers)][: a.layers]
            stats = input_stats(m, batches, {k: layers[k] for k in picked}, abs_mean=False)
            ratios = {it: [] for it in a.iters}
            for k in picked:
                W = layers[k].weight.detach().double().reshape(layers[k].weight.shape[0], -1)
                H = stats[k].H[0].double()
                g_scale, g_zero, g_maxq, idx = layer_grid(W, a.bits)
                scale, zero, maxq = g_scale[idx], g_zero[idx], g_maxq[idx]
                nearest = error(W, H, scale, zero, nearest_rows(W, H, scale, zero, maxq))
                ef = error(W, H, scale, zero, error_feedback_groups(W, damped_metric(stats[k].H, 0.01), scale, zero,
                                                                    maxq, act_order=True))
                line = f"{name} {k} {tuple(W.shape)}: GPTQ {ef / nearest:.3f}"
                for it in a.iters:
                    t0 = time.perf_counter()
                    s, z, codes = fitted(a.method, W, stats[k].output_mse_metric(W.shape[0]), g_scale, g_zero, g_maxq,
                                         idx, it, a.lr, a.zero_lr, f"{k} ({it} steps)")
                    ratios[it].append(error(W, H, s, z, codes) / nearest)
                    line += f"  {it}: {ratios[it][-1]:.3f} ({time.perf_counter() - t0:.0f} s)"
                print(line, flush=True)
        final = sum(ratios[a.iters[-1]]) / len(picked)
        enough = next(it for it in a.iters if sum(ratios[it]) / len(picked) <= final * (1 + a.tol))
        print(f"{name} {a.method}: mean error vs nearest rounding " +
              ", ".join(f"{it}: {sum(r) / len(r):.3f}" for it, r in ratios.items()) +
              f"; within {a.tol:.0%} of {a.iters[-1]} steps from {enough} steps", flush=True)


if __name__ == "__main__":
    main()
