"""BayesQ's grids and allocation with AdaRound's, DoReFa's or BRECQ's rounding, against BayesQ's default rounding.

BayesQ's default (``params.yaml``'s settings, 3.0 bits, seed 17, on the pipeline's calibration
draw) picks a grid candidate, allocates its bits and rounds by error feedback plus coordinate
descent, then refits the scales and applies the bias correction. Here the kept candidate's table
and allocation are encoded again with AdaRound's rounding in place of error feedback and
coordinate descent (:func:`bayesq.baselines.adaround.adaround_rows` in the layer-output MSE metric,
the paper's schedule, or with ``--rounding dorefa`` :func:`bayesq.baselines.dorefa.dorefa_rows`,
DoReFa's straight-through fine-tune at ``baselines.dorefa_lr``; the same scale refit and bias
correction after it), or (``--rounding brecq``) BayesQ's final encoding (its refitted grids) is rounded again by BRECQ's block
reconstruction (:func:`bayesq.baselines.brecq.brecq_encoding`, the library's ``bayesq-brecq``
step, its schedule at ``--iters`` steps per unit), scored with and without BayesQ's bias
correction (the library's row drops it: ``(no bc)``). Every row then gets BayesQ's output offset
refitted on the calibration and selection inputs when ``quant.output_offset`` is on, as the
library's last step does (:func:`bayesq.quantize.assemble`). All are scored by the per-input
``KL(p_FP || p_Q)`` on the pipeline's 2,000 held-out selection inputs, paired. BayesQ chose its
grid candidate on these inputs, which favours BayesQ's own rounding slightly. ``--on test``
scores every test example instead (KL and correctness, paired), inputs neither encoding saw.

    python benchmarks/bayesq_adaround.py [--models minilm-sentiment lite0-fmnist] [--iters 10000]
                                         [--rounding adaround|dorefa|brecq] [--on selection|test]
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["minilm-sentiment", "lite0-fmnist"])
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--rounding", choices=["adaround", "dorefa", "brecq"], default="adaround")
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--on", choices=["selection", "test"], default="selection", help="the inputs scored")
    a = ap.parse_args()

    from flows.settings import apply_defaults

    apply_defaults()
    from one_time_cost import bayesq_stages, load_inputs, test_batches

    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.adaround import adaround_rows
    from bayesq.baselines.brecq import BRECQConfig, brecq_encoding
    from bayesq.baselines.dorefa import dorefa_rows
    from bayesq.output_offset import fit_output_offset
    from bayesq.canonical import canonical
    from bayesq.comparison import correct_per_example, paired_difference
    from bayesq.config import Rounding
    from bayesq.evaluation import kl_per_input, predict, reference_log_probs
    from bayesq.quantize import encode
    from bayesq.result import quantized_copy

    for name in a.models:
        params, model, calibration, selection = load_inputs(name, a.seed, ROOT / "params.yaml")
        with canonical(model) as m:
            _, enc = bayesq_stages(m, calibration, params, a.budget, a.seed, selection)
            layers = {n: m.get_submodule(n) for n in enc.weights}
            stats = input_stats(m, calibration, layers, abs_mean=False)
            metric = {n: stats[n].output_mse_metric(layers[n].weight.shape[0]) for n in layers}
            start = time.perf_counter()
            if a.rounding in ("adaround", "dorefa"):
                solver = (partial(adaround_rows, iters=a.iters, progress=True) if a.rounding == "adaround" else
                          partial(dorefa_rows, iters=a.iters, lr=params.baselines.dorefa_lr, progress=True))
                new = encode(enc.table, enc.allocation, {n: l.weight for n, l in layers.items()},
                             rounding=Rounding.ERROR_FEEDBACK, column_metric=metric, refit=enc.quant.refit,
                             scale_bits=enc.quant.scale_bits, solver=solver)
            else:
                # the library's step (bayesq-brecq's): every code learned again on BayesQ's grids
                new = brecq_encoding(m, enc, calibration, BRECQConfig(iters=a.iters, seed=a.seed)).weights
            seconds = time.perf_counter() - start
            scored, labels = selection, None
            if a.on == "test":
                scored, labels = test_batches(name, params)
                labels = torch.as_tensor(labels)
            reference = reference_log_probs(m, scored)
            kl, correct = {}, {}
            tag = f"bayesq+{a.rounding}"
            rows = [("bayesq", enc.weights, enc.correction), (tag, new, enc.correction)]
            if enc.correction is not None:  # the new rounding also without BayesQ's bias correction
                rows.append((f"{tag} (no bc)", new, None))
            with torch.no_grad():
                for key, weights, correction in rows:
                    qmodel = quantized_copy(m, weights, correction).eval()
                    if enc.quant.output_offset:  # the library's last step, on every row alike
                        fit_output_offset(m, qmodel, calibration, selection=selection).apply(qmodel)
                    kl[key] = kl_per_input(reference, qmodel, scored)
                    if labels is not None:
                        correct[key] = correct_per_example(predict(qmodel, scored), labels).double()
        for key, v in kl.items():
            acc = f", accuracy {100 * correct[key].mean():.2f} %" if correct else ""
            print(f"{name} {key}: KL {v.mean():.5f}{acc} on {len(v)} {a.on} inputs (candidate {enc.name})",
                  flush=True)
        for key in kl:
            if key == "bayesq":
                continue
            for what, values, scale in (("KL", kl, 1.0), ("accuracy (pts)", correct, 100.0)):
                if not values:
                    continue
                d = paired_difference(scale * values[key], scale * values["bayesq"])
                star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
                print(f"{name} {key} - bayesq: {what} {d.diff:+.6f} [{d.ci_low:+.6f}, {d.ci_high:+.6f}]{star}; "
                      f"the {a.rounding} encoding {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
