"""Why does the held-out check reject distillation? Its step size, on the pipeline's BayesQ row.

On each fine-tuned embedded model (``make run`` first, or at least its fine-tune stage) and the
pipeline's calibration and held-out selection draws (seed ``--seed``), BayesQ's row at
``--budget`` is quantised once (params.yaml's settings, distillation off, the posterior kept);
then its scales, zero-points and tables are distilled (:func:`bayesq.distill.distill`, params.yaml's
``distill`` section) at each learning rate of ``--lr``: AdamW moves each stored parameter by about
``lr`` in its own units, so a scale of 1e-3 moves 10 % per step at 1e-4. ``--agreement 1.0`` tempers the teacher until its draws agree with the FP model on every
probe input (a teacher next to the FP model, the held-out check's reference). Printed per rate: the tempering scale, the fit loss first / last, the held-out KL of the
calibration split before / after and whether the check accepts, and the KL of the distilled model
(accepted or not) on every test example with BayesQ − distilled and its paired 95 % interval.

    python benchmarks/distill_step.py [--models lite0-fmnist minilm-sentiment] [--lr 1e-4 1e-5 1e-6]
                                      [--agreement A] [--steps N] [--budget 3.0] [--seed 17]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
import sys

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lite0-fmnist", "minilm-sentiment"])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-4, 1e-5, 1e-6])
    ap.add_argument("--agreement", type=float, default=None,
                    help="the teacher's tempering target (default params.yaml's; 1.0: draws that agree with the FP "
                         "model on every probe input, a teacher next to the FP model)")
    ap.add_argument("--steps", type=int, default=None, help="AdamW steps (default params.yaml's)")
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=17)
    a = ap.parse_args()

    from flows.settings import apply_defaults

    apply_defaults()
    from one_time_cost import load_inputs, test_batches

    from bayesq.comparison import paired_difference
    from bayesq.evaluation import kl_per_input, reference_log_probs
    from bayesq.quantize import assemble, quantize_model
    from bayesq.selection import Encoding
    from flows.configs import method_config

    for name in a.models:
        params, model, calibration, selection = load_inputs(name, a.seed, ROOT / "params.yaml")
        test, _ = test_batches(name, params)
        reference = reference_log_probs(model, test)
        cfg = method_config("bayesq", params, a.budget, a.seed)[0]
        res = quantize_model(model, calibration, cfg, selection=selection, keep_posterior=True, progress=False)
        with torch.no_grad():
            base = kl_per_input(reference, res.model, test)
        print(f"{name} BayesQ: test KL {base.mean():.5f} ({res.encoding})", flush=True)
        enc = Encoding(res.encoding, cfg.quant, res.table, res.allocation, res.weights, res.selection_kl,
                       res.correction)
        for lr in a.lr:  # accept False: keep what the fit made, it is scored below
            dcfg = replace(params.distill, lr=lr, accept=False, max_budget=a.budget)
            if a.agreement is not None:
                dcfg = replace(dcfg, agreement=a.agreement)
            if a.steps is not None:
                dcfg = replace(dcfg, steps=a.steps)
            # the output offset (params.yaml's quant.output_offset) refitted after distillation on the same
            # calibration and selection inputs as the BayesQ row's
            fitted, _, d, _ = assemble(model, enc, res.posterior, calibration, dcfg, a.budget, a.seed, progress=True,
                                       selection=selection)
            with torch.no_grad():
                kl = kl_per_input(reference, fitted, test)
            p = paired_difference(base, kl)
            print(f"{name} lr {lr:g}: s {d.sample_scale:g}, loss {d.loss_first:.4g} -> {d.loss_last:.4g}, held-out "
                  f"KL {d.kl_before:.5f} -> {d.kl_after:.5f} ({'accepted' if d.kl_after < d.kl_before else 'rejected'}), "
                  f"test KL {kl.mean():.5f}, BayesQ - distilled {p.diff:+.5f} [{p.ci_low:+.5f}, {p.ci_high:+.5f}], "
                  f"{d.seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
