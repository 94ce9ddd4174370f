"""BayesQ + error feedback: which column metric and column order, on BayesQ's own allocation.

BayesQ's K-FAC posterior, loss table, grids and allocation stay fixed; only the error-feedback
rounding changes: the posterior's input factor A in natural column order, A with act-order,
and the calibration data's own Hessian H (GPTQ's 1 % damping) with act-order.

    python benchmarks/ef_metric.py [--model lite0-fmnist] [--budget 3.0] [--seed 17]

Needs ``make run`` first (the fine-tuned model and the K-FAC posterior file of the
``bayesq-ef`` row under results/posterior/).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lite0-fmnist")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = p.parse_args()

    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.gptq import damped_hessian
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.config import Rounding, replace
    from bayesq.models.zoo import evaluate, get_entry
    from bayesq.quantize import allocate, build_table, encode, quantized_copy
    from flows.common import read_params
    from flows.finetune import load_model, raw_path
    from flows.quantize import calibration_batches, load_posterior

    params = read_params(a.params)
    q = replace(params.quant, rounding=Rounding.ERROR_FEEDBACK)
    entry = get_entry(a.model)
    model = load_model(entry, Path("models") / a.model / "model.safetensors")
    splits = entry.load_splits(params.data, raw_path(entry, Path("data/raw")))
    _, batches = calibration_batches(entry, splits, params.data, params.calibration, a.seed)
    test = entry.batches(splits.test_inputs, 64, params.data)
    post = load_posterior(model, Path("results/posterior") / f"{a.model}_s{a.seed}_kfac.safetensors")
    layers = quantizable_layers(model)
    table = build_table(post, layer_blocks(layers, q.group_size, q.unit_groups, q.unit.value), q, progress=False)
    alloc = allocate(table, a.budget, params.allocation, a.seed)
    stats = input_stats(model, batches, layers)
    data_h = {n: damped_hessian(stats[n].H, params.baselines.gptq_damp) for n in layers}
    weights = {n: m.weight for n, m in layers.items()}
    print(f"{a.model} at {a.budget} bits ({alloc.average_bits:.4f} b), seed {a.seed}: test accuracy (%)")
    for label, kw in (("posterior A, natural order", dict(posterior=post)),
                      ("posterior A, act-order", dict(posterior=post, act_order=True)),
                      ("data H (GPTQ damping), act-order", dict(column_metric=data_h, act_order=True))):
        start = time.perf_counter()
        qw = encode(table, alloc, weights, rounding=Rounding.ERROR_FEEDBACK, **kw)
        acc = evaluate(quantized_copy(model, qw), test, splits.test_labels)
        print(f"  {label:34s} {100 * acc:6.2f}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
