"""Encodings on the same allocations: which grids, rounding, polish and refit lose least.

One posterior; allocations from BayesQ's table with the error-feedback gains on the searched or
the min/max grids (``--allocate-on``: each encoding on its own grids' table, or every encoding on
one), and GPTQ's encoding on each allocation used, so each difference to GPTQ comes from the
encoding alone. Each row also prints its KL on the calibration inputs (what a selection may use).
Encodings: the grids (``searched`` clipping or ``minmax``), then error-feedback rounding, optionally
coordinate-descent sweeps (``+cd``: two, ``+cdN``: N), the scale refit (``+refit``) and the
relative dampening of the rounding metric (``+dampX``, e.g. ``+damp0.001``; default 0.01, GPTQ's;
the tables and allocations keep the default). ``minmax`` grids
without refit are GPTQ's encoding (the script checks this against
:func:`bayesq.baselines.gptq.gptq_allocation_quantize`).

    python benchmarks/encoding_variants.py [--model lite0-fmnist] [--budget 3.0] [--seed 17] [--only minmax,searched+refit]
        [--allocate-on own|searched|minmax]

Needs the fine-tuned model and data of ``make run`` (``models/``, ``data/raw``).
"""

from __future__ import annotations

import argparse
import sys
import time

from embedded import case

VARIANTS = ("searched", "searched+refit", "minmax", "minmax+refit", "minmax+cd", "searched+cd+refit")


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--only", default=",".join(VARIANTS), help="comma-separated encodings (default: all)")
    extra.add_argument("--allocate-on", default="own", choices=("own", "searched", "minmax"),
                       help="the grids whose table the allocation is made on (own: each encoding's grids)")
    args, sys.argv[1:] = extra.parse_known_args(sys.argv[1:])
    only = args.only.split(",")
    known = {"refit", "cd"} | {f"cd{n}" for n in range(1, 100)}
    bad = [v for v in only if v.split("+")[0] not in ("searched", "minmax")
           or {x for x in v.split("+")[1:] if not x.startswith("damp")} - known]
    if bad:
        raise SystemExit(f"--only: unknown encodings {bad}; e.g. {','.join(VARIANTS)} (cdN: N sweeps)")
    c = case(__doc__.splitlines()[0])
    from bayesq import BayesQConfig
    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.gptq import gptq_allocation_quantize
    from bayesq.baselines.select import mean_kl, reference_log_probs
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.comparison import correct_per_example, kl_per_example, paired_difference
    from bayesq.config import replace
    from bayesq.evaluation import predict
    from bayesq.quantize import allocate, build_table, ef_column_metric, encode, fit_posterior, quantized_copy

    p = c.params
    q = replace(p.quant, feedback_table=True)
    cfg = BayesQConfig(budget=c.budget, posterior=p.posterior, quant=q, allocation=p.allocation, seed=c.seed)
    layers = quantizable_layers(c.model)
    blocks = layer_blocks(layers, q.group_size, q.unit_groups, q.unit.value)
    start = time.perf_counter()
    post = fit_posterior(c.model, c.calibration, cfg, progress=False)
    metric = ef_column_metric(post, q, c.model, c.calibration)
    tables = {name: build_table(post, blocks, replace(q, min_range_ratio=ratio), model=c.model,
                                calibration=c.calibration, progress=False, column_metric=metric)
              for name, ratio in (("searched", q.min_range_ratio), ("minmax", 1.0))}
    allocations = {g: allocate(tables[g], c.budget, p.allocation, c.seed) for g in tables}
    print(f"{c.model_name} at {c.budget} bits, seed {c.seed}, allocated on {args.allocate_on} grids: posterior + tables "
          f"{time.perf_counter() - start:.0f} s")
    fp = predict(c.model, c.test)
    reference = reference_log_probs(c.model, c.calibration)
    weights = {n: m.weight for n, m in layers.items()}
    scores = {}

    def score(name: str, model) -> None:
        logits = predict(model, c.test)
        kl, correct = kl_per_example(fp, logits), 100 * correct_per_example(logits, c.labels).double()
        scores[name] = (kl, correct)
        print(f"  {name:24s} acc {correct.mean():6.2f}  KL {kl.mean():.5f} ± {kl.std() / len(kl) ** 0.5:.5f}  "
              f"calibration KL {mean_kl(reference, model, c.calibration):.5f}", flush=True)

    def allocation_of(grids: str) -> str:
        return grids if args.allocate_on == "own" else args.allocate_on

    for name in only:
        grids, *steps = name.split("+")
        damp = next((float(x[4:]) for x in steps if x.startswith("damp")), None)
        used = metric if damp is None else ef_column_metric(post, q, c.model, c.calibration, damp=damp)
        qw = encode(tables[grids], allocations[allocation_of(grids)], weights, posterior=post, rounding=q.rounding,
                    column_metric=used, act_order=q.act_order, refit="refit" in steps, scale_bits=q.scale_bits,
                    cd_passes=next((int(x[2:] or 2) for x in steps if x.startswith("cd")), 0))
        score(name, quantized_copy(c.model, qw))
    stats = input_stats(c.model, c.calibration, layers)
    for grids in sorted({allocation_of(name.split("+")[0]) for name in only}):
        unit_bits = {k: list(v) for k, v in allocations[grids].unit_bits.items()}
        score(f"gptq on {grids} allocation", gptq_allocation_quantize(
            c.model, stats, unit_bits, c.budget, q, act_order=p.baselines.gptq_act_order,
            damp=p.baselines.gptq_damp).model)
    print("paired differences to gptq on the same allocation, 95 % bootstrap intervals:")
    for name in only:
        gptq = scores[f"gptq on {allocation_of(name.split('+')[0])} allocation"]
        kl = paired_difference(scores[name][0], gptq[0])
        acc = paired_difference(scores[name][1], gptq[1])
        print(f"  {name:24s} KL {kl.diff:+.5f} [{kl.ci_low:+.5f}, {kl.ci_high:+.5f}]  "
              f"accuracy {acc.diff:+.2f} [{acc.ci_low:+.2f}, {acc.ci_high:+.2f}] points")


if __name__ == "__main__":
    main()
