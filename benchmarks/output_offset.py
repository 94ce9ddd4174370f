"""What the output offset (``quant.output_offset``, ``bayesq/output_offset.py``) corrects, per
calibration seed: the shift of the logits that BayesQ's quantised model makes, the predictions it
changes, and the test KL and accuracy with and without the offset (the default's: half of the
fit, ``bayesq.output_offset.SHRINK``), paired.

For each embedded model and seed, BayesQ's pipeline row (params.yaml's settings, the seed's
calibration and held-out selection draws) is quantised once with the offset off; the offset is
then fitted on the calibration and held-out selection inputs together and added to a copy, which
is exactly what the default does last (:func:`bayesq.quantize.assemble`). Printed per seed:

* the mean logit shift ``mean_n (z^Q_n - z^FP_n)`` on the test inputs (its norm; for two classes
  the shift of the second class's margin, over all inputs and over those within 1 of the FP
  decision boundary);
* the test predictions that differ from the FP model's, by (FP class -> quantised class);
* test KL and accuracy without and with the offset, ``with - without`` paired (95 % bootstrap
  intervals, :func:`bayesq.comparison.paired_difference`), and ``without - FP`` in accuracy;
* the same for the least-squares offset, ``mean_n (z^FP_n - z^Q_n)`` on the same inputs
  (the bias correction's rule applied to the logits), against the KL fit;
* the KL fit on the calibration inputs alone (the default until 2026-12-02), against the fit on
  both input sets (the default's);
* the offset fitted in full (the default until 2026-12-07), against the default's half of it.

    python benchmarks/output_offset.py [--models lite0-fmnist minilm-sentiment] [--seeds 17 18 19]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lite0-fmnist", "minilm-sentiment"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[17, 18, 19])
    ap.add_argument("--budget", type=float, default=3.0)
    a = ap.parse_args()

    from flows.settings import apply_defaults

    apply_defaults()
    from one_time_cost import load_inputs, test_batches

    from bayesq.comparison import kl_per_example, paired_difference
    from bayesq.evaluation import predict
    from bayesq.methods import Inputs, quantize_with
    from bayesq.output_offset import fit_output_offset
    from flows.configs import method_config

    def interval(d) -> str:
        star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
        return f"{d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}"

    for name in a.models:
        for seed in a.seeds:
            params, model, calibration, selection = load_inputs(name, seed, ROOT / "params.yaml")
            test, labels = test_batches(name, params)
            labels = torch.as_tensor(labels)
            cfg = method_config("bayesq", params, a.budget, seed)[0]
            cfg = replace(cfg, quant=replace(cfg.quant, output_offset=False))
            start = time.perf_counter()
            res = quantize_with(model, cfg, a.budget, Inputs(calibration=calibration, selection=selection)).result
            quantise_s = time.perf_counter() - start
            start = time.perf_counter()
            offset = fit_output_offset(model, res.model, calibration, selection=selection)
            fit_s = time.perf_counter() - start
            fixed = copy.deepcopy(res.model)
            offset.apply(fixed)
            z_fp, z_q, z_off = (predict(m, test).double() for m in (model, res.model, fixed))
            shift = (z_q - z_fp).mean(0)
            line = f"{name} seed {seed}: mean logit shift norm {float(shift.norm()):.4f}"
            if z_fp.shape[1] == 2:
                m_fp, m_q = z_fp[:, 1] - z_fp[:, 0], z_q[:, 1] - z_q[:, 0]
                near = m_fp.abs() < 1
                line += (f"; class-1 margin shift {float((m_q - m_fp).mean()):+.4f}, "
                         f"{float((m_q - m_fp)[near].mean()):+.4f} within 1 of the boundary ({int(near.sum())} inputs)")
            print(line, flush=True)
            p_fp = z_fp.argmax(-1)
            for tag, z in (("without", z_q), ("with", z_off)):
                p = z.argmax(-1)
                moves = Counter(zip(p_fp[p != p_fp].tolist(), p[p != p_fp].tolist()))
                top = ", ".join(f"{i}->{j}: {k}" for (i, j), k in moves.most_common(6))
                print(f"  {tag} offset: {int((p != p_fp).sum())} test predictions differ from FP ({top})", flush=True)
            kl = {k: kl_per_example(z_fp, z) for k, z in (("without", z_q), ("with", z_off))}
            ok = {k: (z.argmax(-1) == labels).double() for k, z in (("fp", z_fp), ("without", z_q), ("with", z_off))}
            print(f"  FP accuracy {100 * ok['fp'].mean():.2f} %; without: KL {kl['without'].mean():.5f}, "
                  f"{100 * ok['without'].mean():.2f} %; with: KL {kl['with'].mean():.5f}, {100 * ok['with'].mean():.2f} %; "
                  f"offset {offset.layer} {[round(float(v), 4) for v in offset.shift]} "
                  f"(calibration + selection KL {offset.kl_before:.5f} -> {offset.kl_after:.5f}); "
                  f"quantise {quantise_s:.0f} s, offset fit {fit_s:.1f} s", flush=True)
            z_cal = [predict(m, list(calibration) + list(selection)).double() for m in (model, res.model)]
            z_mean = z_q + (z_cal[0] - z_cal[1]).mean(0)
            kl_mean, ok_mean = kl_per_example(z_fp, z_mean), (z_mean.argmax(-1) == labels).double()
            print(f"  least-squares offset: KL {kl_mean.mean():.5f}, {100 * ok_mean.mean():.2f} %; KL fit - least squares: "
                  f"KL {interval(paired_difference(kl['with'], kl_mean))}", flush=True)
            cal = fit_output_offset(model, res.model, calibration)
            z_cal_only = z_q + cal.shift.to(z_q) if cal.shift is not None else z_q
            kl_cal, ok_cal = kl_per_example(z_fp, z_cal_only), (z_cal_only.argmax(-1) == labels).double()
            print(f"  offset on calibration alone: KL {kl_cal.mean():.5f}, {100 * ok_cal.mean():.2f} %; "
                  f"calibration + selection (default) - calibration alone: KL "
                  f"{interval(paired_difference(kl['with'], kl_cal))}, accuracy (pts) "
                  f"{interval(paired_difference(100 * ok['with'], 100 * ok_cal))}", flush=True)
            full = fit_output_offset(model, res.model, calibration, selection=selection, shrink=1.0)
            z_full = z_q + full.shift.to(z_q)
            kl_full, ok_full = kl_per_example(z_fp, z_full), (z_full.argmax(-1) == labels).double()
            print(f"  offset fitted in full (the default before 2026-12-07): KL {kl_full.mean():.5f}, "
                  f"{100 * ok_full.mean():.2f} %; halved (default) - full: KL "
                  f"{interval(paired_difference(kl['with'], kl_full))}, accuracy (pts) "
                  f"{interval(paired_difference(100 * ok['with'], 100 * ok_full))}", flush=True)
            print(f"  with - without: KL {interval(paired_difference(kl['with'], kl['without']))}, "
                  f"accuracy (pts) {interval(paired_difference(100 * ok['with'], 100 * ok['without']))}; "
                  f"without - FP: accuracy (pts) {interval(paired_difference(100 * ok['without'], 100 * ok['fp']))}",
                  flush=True)


if __name__ == "__main__":
    main()
