"""Which BayesQ configuration is the default: candidates against the strongest GPTQ and RTN per group.

Every candidate quantises the same fine-tuned model on the same calibration inputs at one
budget; each is scored on every test example by KL(p_FP || p_Q) and correctness, and compared
with GPTQ (its best calibration-selected variant, BayesQ's allocation among the candidates) and
RTN per group by the paired bootstrap of ``bayesq.comparison`` (95 % intervals). GPTQ's variants
are offered with BayesQ's bias correction too (``baselines.bias_correction``), as in the pipeline.

    python benchmarks/candidates.py [--model lite0-fmnist] [--budget 3.0] [--seed 17] [--only default,paper]

The first candidate run (the first of ``--only``) supplies GPTQ's allocation variant.

Needs the fine-tuned model and data of ``make run`` (``models/``, ``data/raw``). Candidates:

* ``default``: the library default (diagonal Fisher posterior with a fitted prior, deployed
  objective with the error-feedback gains, error-feedback rounding in the layers' input second
  moments, act-order, two coordinate-descent sweeps; searched grids with the scale refit or
  min/max grids, whichever has the lower calibration KL; the bias correction);
* ``plain-table``: the default table without the error-feedback gains (``feedback_table: false``);
* ``no-cd``: the default without coordinate descent (``cd_passes: 0``);
* ``searched``: searched grids only (``select_grids: false``);
* ``no-refit``: the default without the scale refit;
* ``nearest``: the default with nearest rounding;
* ``no-bc``: the default without the bias correction;
* ``kfac``: a K-FAC posterior (error feedback in its input factor);
* ``paper``: the paper-literal configuration (fixed prior, draws objective, nearest rounding, no
  bias correction).
"""

from __future__ import annotations

import argparse
import sys
import time

from embedded import case


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    args, sys.argv[1:] = extra.parse_known_args(sys.argv[1:])
    c = case(__doc__.splitlines()[0])
    from bayesq import BayesQConfig, quantize_model
    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.gptq import gptq_select
    from bayesq.baselines.rtn import rtn_quantize
    from bayesq.blocks import quantizable_layers
    from bayesq.comparison import correct_per_example, kl_per_example, paired_difference
    from bayesq.config import DistillConfig, Granularity, replace
    from bayesq.evaluation import predict

    p = c.params
    base = BayesQConfig(budget=c.budget, posterior=p.posterior, quant=p.quant, allocation=p.allocation,
                        distill=DistillConfig(max_budget=0), seed=c.seed)
    candidates = {
        "default": base,
        "plain-table": replace(base, quant=replace(p.quant, feedback_table=False)),
        "no-cd": replace(base, quant=replace(p.quant, cd_passes=0)),
        "searched": replace(base, quant=replace(p.quant, select_grids=False)),
        "no-refit": replace(base, quant=replace(p.quant, refit=False)),
        "nearest": replace(base, quant=replace(p.quant, rounding="nearest")),
        "no-bc": replace(base, quant=replace(p.quant, bias_correction=False)),
        "kfac": replace(base, posterior=replace(p.posterior, curvature="kfac")),
        "paper": replace(base, posterior=replace(p.posterior, prior="fixed"),
                         quant=replace(p.quant, objective="draws", rounding="nearest", bias_correction=False)),
    }
    if args.only:
        unknown = set(args.only.split(",")) - set(candidates)
        if unknown:
            raise SystemExit(f"--only: unknown candidates {sorted(unknown)}; choose from {sorted(candidates)}")
        candidates = {k: candidates[k] for k in args.only.split(",")}
    fp = predict(c.model, c.test)
    scores, allocation = {}, None

    def score(name: str, result, seconds: float, note: str = "") -> None:
        logits = predict(result.model, c.test)
        kl, correct = kl_per_example(fp, logits), correct_per_example(logits, c.labels).double()
        scores[name] = (kl, 100 * correct)
        print(f"{name:10s} {result.average_bits:.4f} bits  acc {100 * correct.mean():6.2f}  "
              f"KL {kl.mean():.5f} ± {kl.std() / len(kl) ** 0.5:.5f}  ({seconds:.0f} s){note}", flush=True)

    print(f"{c.model_name} at {c.budget} bits, seed {c.seed}, {len(c.labels)} test examples")
    selection = c.selection  # as the pipeline: choices scored on the held-out draw
    for name, cfg in candidates.items():
        start = time.perf_counter()
        res = quantize_model(c.model, c.calibration, cfg, progress=False, selection=selection,
                             keep_posterior=True)
        post = res.posterior
        kept = f", kept {res.encoding} grids (selection KL {', '.join(f'{k} {v:.4g}' for k, v in res.selection_kl.items())})"
        score(name, res, time.perf_counter() - start,
              f"  prior-dominated {100 * post.prior_dominated_share():.1f} %" + (kept if res.selection_kl else ""))
        if allocation is None:  # the first candidate's allocation is GPTQ's allocation variant
            allocation = {k: list(v) for k, v in res.allocation.unit_bits.items()}
    start = time.perf_counter()
    stats = input_stats(c.model, c.calibration, quantizable_layers(c.model))
    choice = gptq_select(c.model, stats, c.calibration, c.budget, p.quant, group_sizes=p.baselines.group_sizes,
                         allocation=allocation, act_order=p.baselines.gptq_act_order, damp=p.baselines.gptq_damp,
                         bias_correction=p.baselines.bias_correction, selection=selection)
    score("gptq", choice.result, time.perf_counter() - start,
          f"  variant {choice.variant} (selection KL {', '.join(f'{k} {v:.4g}' for k, v in choice.kl.items())})")
    start = time.perf_counter()
    score("rtn-group", rtn_quantize(c.model, Granularity.GROUP, c.budget, p.quant), time.perf_counter() - start)

    print("paired differences (candidate - baseline), 95 % bootstrap intervals:")
    for name in candidates:
        for baseline in ("gptq", "rtn-group"):
            kl = paired_difference(scores[name][0], scores[baseline][0])
            acc = paired_difference(scores[name][1], scores[baseline][1])
            print(f"  {name:8s} - {baseline:9s}  KL {kl.diff:+.5f} [{kl.ci_low:+.5f}, {kl.ci_high:+.5f}]  "
                  f"accuracy {acc.diff:+.2f} [{acc.ci_low:+.2f}, {acc.ci_high:+.2f}] points")


if __name__ == "__main__":
    main()
