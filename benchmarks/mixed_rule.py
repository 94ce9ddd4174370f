"""Where do the baselines' accuracies come from: their rounding or their mixed-precision rule?

For one embedded model and budget, evaluates on the test split:

* RTN per-group with its own allocation (plain squared error) and with GPTQ's (H-weighted);
* GPTQ with its own allocation and with RTN's (same grids, error-feedback rounding);
* AWQ with its own allocation (scales searched and stored).

    python benchmarks/mixed_rule.py [--model lite0-fmnist] [--budget 3.0] [--seed 17]

Needs the fine-tuned model under models/ and the raw data under data/raw (``make run``).
"""

from __future__ import annotations

import time

import torch
from embedded import case


def main() -> None:
    c = case(__doc__.splitlines()[0])
    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.awq import awq_quantize
    from bayesq.baselines.gptq import damped_hessian
    from bayesq.baselines.rtn import rtn_blocks
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.config import Granularity, Rounding
    from bayesq.expected_loss import rtn_table
    from bayesq.quantize import allocate, encode, quantized_copy

    q, model = c.params.quant, c.model
    layers = quantizable_layers(model)
    stats = input_stats(model, c.calibration, layers)
    blocks = rtn_blocks(layer_blocks(layers, q.group_size, q.unit_groups), Granularity.GROUP, q)
    weights = {n: m.weight for n, m in layers.items()}
    omega = {n: stats[n].row_diag(m.weight.shape[0]) for n, m in layers.items()}
    tables = {"plain": rtn_table(weights, blocks, q), "H-weighted": rtn_table(weights, blocks, q, element_weight=omega)}
    metric = {n: damped_hessian(stats[n].H, c.params.baselines.gptq_damp) for n in layers}

    print(f"{c.model_name} at {c.budget} bits, seed {c.seed}; test accuracy (%)")
    allocs = {name: allocate(table, c.budget) for name, table in tables.items()}
    for alloc_name, table in tables.items():
        alloc = allocs[alloc_name]
        for rounding in (Rounding.NEAREST, Rounding.ERROR_FEEDBACK):
            start = time.perf_counter()
            qw = encode(table, alloc, weights, rounding=rounding,
                        column_metric=metric if rounding == Rounding.ERROR_FEEDBACK else None, act_order=True)
            acc = c.accuracy(quantized_copy(model, qw))
            name = "GPTQ rounding" if rounding == Rounding.ERROR_FEEDBACK else "nearest (RTN)"
            print(f"  {name:14s} with the {alloc_name:10s} allocation: {acc:6.2f}  "
                  f"({alloc.average_bits:.4f} b, {time.perf_counter() - start:.1f} s)")
    res = awq_quantize(model, stats, c.budget, q, grid=c.params.baselines.awq_grid)
    scaled = sum(w.col_scale is not None for w in res.weights.values())
    print(f"  AWQ (own rule, {scaled}/{len(res.weights)} layers scaled): "
          f"{c.accuracy(res.model):6.2f}  ({res.average_bits:.4f} b)")
    for name, alloc in allocs.items():
        b = torch.tensor([x for unit in alloc.unit_bits.values() for x in unit])
        print(f"  {name:10s} allocation: units at " + ", ".join(f"{k} b: {int((b == k).sum())}" for k in q.bits))


if __name__ == "__main__":
    main()
