"""Does the calibration KL pick the grid candidate the test set would? Against a held-out draw.

Each candidate of the grid selection (``quantize.grid_candidates``) plus the other range search
of the error-feedback table is fitted on the seed's calibration inputs exactly as
``quantize.encode_best`` fits it (posterior, layer-input statistics, table, allocation,
error-feedback encoding, bias correction), then scored by the mean KL(p_FP || p_Q) on

* the calibration inputs it was fitted on (what ``encode_best`` selects on without ``selection=``),
* the pipeline's selection draw (``calibration.selection: held-out``: ``selection_images`` /
  ``selection_sentences`` training inputs, disjoint from the calibration draw),
* another draw of ``--held-size`` training inputs (``--holdout-seed``, used by nothing else;
  default as many as the calibration set),
* every test example,

and, on each of these sets, which candidate two rules keep there, with each paired 95 % interval
against the rule's anchor: min/max unless another's KL is lower by a resolved margin (the rule
when scored on the calibration inputs, between the searched and the min/max grids), and
``encode_best``'s rule on held-out inputs (the searched grids unless the other range search is
lower by a resolved margin; min/max is not built there), scored in ``encode_best``'s two looks
(``comparison.sequential_choice``: the other search is not scored past the first quarter when it
is resolved worse there).

    python benchmarks/selection_holdout.py [--model lite0-fmnist] [--budget 3.0] [--seed 17] [--holdout-seed 99]
                                           [--held-size N]

Needs the fine-tuned model and data of ``make run`` (``models/``, ``data/raw``).
"""

from __future__ import annotations

import argparse
import sys

from embedded import case


def main() -> None:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--holdout-seed", type=int, default=99, help="seed of the held-out draw of training inputs")
    extra.add_argument("--held-size", type=int, default=0, help="inputs in that draw (0: the calibration size)")
    args, sys.argv[1:] = extra.parse_known_args(sys.argv[1:])
    c = case(__doc__.splitlines()[0])
    from bayesq import BayesQConfig
    from bayesq.baselines.activations import input_stats
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.config import replace
    from bayesq.comparison import resolved_choice, sequential_choice
    from bayesq.forward import batch_size
    from bayesq.evaluation import kl_per_input, reference_log_probs
    from bayesq.quantize import (
        allocate, bias_correction, build_table, ef_column_metric, encode, fit_posterior, grid_candidates,
        quantized_copy, selection_looks,
    )

    p, q = c.params, c.params.quant
    cal, selection = list(c.calibration), c.selection or []
    if args.held_size:
        n = {"images": args.held_size} if c.entry.task == "image" else {"sentences": args.held_size}
        c = replace(c, params=replace(p, calibration=replace(p.calibration, **n)))
    held = list(c.draw(args.holdout_seed))
    layers = quantizable_layers(c.model)
    blocks = layer_blocks(layers, q.group_size, q.unit_groups, q.unit.value)
    post = fit_posterior(c.model, cal, BayesQConfig(posterior=p.posterior, quant=q, seed=c.seed), progress=False)
    stats = input_stats(c.model, cal, layers)
    metric = ef_column_metric(post, q, stats=stats)
    correction = bias_correction(c.model, stats, cal) if q.bias_correction else None
    weights = {n: m.weight for n, m in layers.items()}
    sets = {"calibration": cal, "selection": selection, "held-out": held, "test": c.test}
    sets = {k: b for k, b in sets.items() if b}
    refs = {k: reference_log_probs(c.model, b) for k, b in sets.items()}
    cands, per = dict(grid_candidates(q)), {}
    if q.feeds_back_table:
        cands["searched, other range search"] = replace(q, feedback_search=not q.feedback_search)
    print(f"{c.model_name} at {c.budget} bits, seed {c.seed}, held-out draw seed {args.holdout_seed} "
          f"(batches: {', '.join(f'{k} {len(b)}' for k, b in sets.items())}); mean KL(p_FP || p_Q):")
    for name, cq in cands.items():
        t = build_table(post, blocks, cq, seed=c.seed, model=c.model, calibration=cal, progress=False,
                        column_metric=metric)
        qw = encode(t, allocate(t, c.budget, p.allocation, c.seed), weights, posterior=post, rounding=cq.rounding,
                    column_metric=metric, act_order=cq.act_order, refit=cq.refit, scale_bits=cq.scale_bits,
                    cd_passes=cq.cd_passes)
        qmodel = quantized_copy(c.model, qw, correction)
        per[name] = {k: kl_per_input(refs[k], qmodel, b) for k, b in sets.items()}
        print(f"  {name:30s} " + "  ".join(f"{k} {float(v.mean()):.5f}" for k, v in per[name].items()), flush=True)
    other = "searched, other range search"
    rules = {"min/max unless another is resolved lower (95 % paired interval vs min/max)": (
        "minmax", *(n for n in per if n != "minmax"))}
    if other in per:  # encode_best's rule: scored on held-out inputs, the two searches (anchor: q's own)
        rules["encode_best on held-out inputs: searched unless the other search is resolved lower"] = (
            "searched", other)
    for title, (anchor, *rest) in rules.items():
        print(f"kept on each set by the rule '{title}':")
        for k, b in sets.items():
            if anchor == "minmax":
                kept, margins = resolved_choice({n: per[n][k] for n in (anchor, *rest)}, anchor)
            else:  # encode_best's two looks over the set's batches
                starts = [0]
                for x in b:
                    starts.append(starts[-1] + batch_size(x))
                kept, margins, _ = sequential_choice(
                    lambda n, part, k=k, starts=starts: per[n][k][starts[part.start]:starts[part.stop]],
                    (anchor, *rest), anchor, selection_looks(b), len(b))
            print(f"  {k:12s} {kept:30s} " + "  ".join(f"{n} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]"
                                                      for n, d in margins.items()), flush=True)


if __name__ == "__main__":
    main()
