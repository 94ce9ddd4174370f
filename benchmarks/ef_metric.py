"""BayesQ + error feedback: which column metric and column order, on BayesQ's own allocation.

BayesQ's K-FAC posterior, loss table, grids and allocation stay fixed; only the error-feedback
rounding changes: the posterior's input factor A in natural column order, A with act-order,
and the calibration data's own Hessian H (GPTQ's 1 % damping) with act-order.

    python benchmarks/ef_metric.py [--model lite0-fmnist] [--budget 3.0] [--seed 17]

Needs ``make run`` first (the fine-tuned model and the K-FAC posterior file of the
``bayesq-ef`` row under results/posterior/).
"""

from __future__ import annotations

import time
from pathlib import Path

from embedded import case


def main() -> None:
    from flows.settings import apply_defaults

    apply_defaults()  # the pipeline's environment, before Prefect / Hugging Face are imported
    c = case(__doc__.splitlines()[0])
    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.gptq import damped_hessian
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.config import Rounding, replace
    from bayesq.quantize import allocate, build_table, encode, quantized_copy
    from flows.prepare import load_posterior

    params, model = c.params, c.model
    q = replace(params.quant, rounding=Rounding.ERROR_FEEDBACK)
    post = load_posterior(model, Path("results/posterior") / f"{c.model_name}_s{c.seed}_kfac.safetensors")
    layers = quantizable_layers(model)
    table = build_table(post, layer_blocks(layers, q.group_size, q.unit_groups, q.unit.value), q, progress=False)
    alloc = allocate(table, c.budget, params.allocation, c.seed)
    stats = input_stats(model, c.calibration, layers)
    data_h = {n: damped_hessian(stats[n].H, params.baselines.gptq_damp) for n in layers}
    weights = {n: m.weight for n, m in layers.items()}
    print(f"{c.model_name} at {c.budget} bits ({alloc.average_bits:.4f} b), seed {c.seed}: test accuracy (%)")
    for label, kw in (("posterior A, natural order", dict(posterior=post)),
                      ("posterior A, act-order", dict(posterior=post, act_order=True)),
                      ("data H (GPTQ damping), act-order", dict(column_metric=data_h, act_order=True))):
        start = time.perf_counter()
        qw = encode(table, alloc, weights, rounding=Rounding.ERROR_FEEDBACK, **kw)
        acc = c.accuracy(quantized_copy(model, qw))
        print(f"  {label:34s} {acc:6.2f}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
