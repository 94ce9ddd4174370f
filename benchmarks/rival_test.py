"""BayesQ's pipeline row against rivals at their strongest, on every test example, paired: one
model, seed and budget of what ``reports/paired.json`` holds, without the pipeline.

For each fine-tuned embedded model (``make run`` first, or at least its fine-tune stage) and the
pipeline's calibration and held-out selection draws (seed ``--seed``), each method of
``--methods`` runs with params.yaml's settings exactly as its pipeline row does
(:func:`flows.configs.method_config`: BayesQ's default row, the baselines with their variant
selection and bias correction; the rows on GPTQ's grids also try the BayesQ row's allocation as a
variant when ``bayesq`` runs before them, as in the pipeline), except that ``--iters`` sets the steps of the learned rivals
(``baselines.adaround_iters``, ``brecq_iters``, ``lsq_iters``, ``pact_iters``, ``dorefa_iters``) for rows too slow at their papers'
counts. Each is scored on every test example: ``KL(p_FP || p_Q)`` and correctness. Prints each
method's mean KL, accuracy, seconds and true bits, then ``first - X`` with paired 95 % bootstrap
intervals (:func:`bayesq.comparison.paired_difference`, the pipeline's) for every other X.

A method may carry params.yaml overrides, ``METHOD:section.key=value[,section.key=value]``
(YAML values, as an ablation row's), e.g. ``bayesq:posterior.curvature_share=0.25``: the same
method with those settings, as its own row.

    python benchmarks/rival_test.py [--models lite0-fmnist] [--methods bayesq gptq brecq] [--budget 3.0]
                                    [--iters N] [--seed 17]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lite0-fmnist"])
    ap.add_argument("--methods", nargs="+", default=["bayesq", "gptq", "brecq"])
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=None, help="steps of the learned rivals (default: params.yaml's)")
    ap.add_argument("--seed", type=int, default=17)
    a = ap.parse_args()

    from flows.settings import apply_defaults

    apply_defaults()
    from one_time_cost import load_inputs, test_batches

    from bayesq.comparison import correct_per_example, paired_difference
    from bayesq.evaluation import kl_per_input, predict, reference_log_probs
    from bayesq.methods import Inputs, quantize_with
    from flows.configs import method_config
    from flows.params import GRID_METHODS, Method, ablation_params

    for name in a.models:
        params, model, calibration, selection = load_inputs(name, a.seed, ROOT / "params.yaml")
        if a.iters is not None:
            params = replace(params, baselines=replace(params.baselines, adaround_iters=a.iters, brecq_iters=a.iters,
                                                       lsq_iters=a.iters, pact_iters=a.iters, dorefa_iters=a.iters))
        test, labels = test_batches(name, params)
        labels = torch.as_tensor(labels)
        reference = reference_log_probs(model, test)
        kl, correct, kept = {}, {}, None
        for spec in a.methods:
            method, over = parse_spec(spec)
            cfg = method_config(method, ablation_params(params, over, spec) if over else params, a.budget, a.seed)[0]
            given = kept if Method(method) in GRID_METHODS and params.baselines.select else None
            start = time.perf_counter()
            out = quantize_with(model, cfg, a.budget, Inputs(calibration=calibration, selection=selection,
                                                             allocation=given))
            seconds = time.perf_counter() - start
            if spec == "bayesq":
                kept = out.result.allocation.unit_bits
            with torch.no_grad():
                kl[spec] = kl_per_input(reference, out.result.model, test)
                correct[spec] = correct_per_example(predict(out.result.model, test), labels).double()
            variant = out.details.get("variant") or out.details.get("encoding") or ""
            print(f"{name} {spec}: KL {kl[spec].mean():.5f}, accuracy {100 * correct[spec].mean():.2f} % "
                  f"({len(kl[spec])} test examples), {out.result.average_bits:.3f} bits, {seconds:.0f} s "
                  f"{variant}", flush=True)
        first = a.methods[0]
        for method in a.methods[1:]:
            for what, values, scale in (("KL", kl, 1.0), ("accuracy (pts)", correct, 100.0)):
                d = paired_difference(scale * values[first], scale * values[method])
                star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
                print(f"{name} {first} - {method}: {what} {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}",
                      flush=True)


def parse_spec(spec: str) -> tuple[str, dict]:
    """``METHOD[:section.key=value,...]`` -> (method, {dotted key: YAML value})."""
    import yaml

    method, _, rest = spec.partition(":")
    over = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"{spec!r}: write overrides as section.key=value")
        over[key.strip()] = yaml.safe_load(value)
    return method, over


if __name__ == "__main__":
    main()
