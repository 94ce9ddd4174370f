"""Where do the baselines' accuracies come from: their rounding or their mixed-precision rule?

For one embedded model and budget, evaluates on the test split:

* RTN per-group with its own allocation (plain squared error) and with GPTQ's (H-weighted);
* GPTQ with its own allocation and with RTN's (same grids, error-feedback rounding);
* AWQ with its own allocation (scales searched and stored).

    python benchmarks/mixed_rule.py [--model lite0-fmnist] [--budget 3.0] [--seed 17]

Needs the fine-tuned model under models/ and the raw data under data/raw (``make run``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lite0-fmnist")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = p.parse_args()

    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.awq import awq_quantize
    from bayesq.baselines.gptq import damped_hessian
    from bayesq.baselines.rtn import rtn_blocks
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.config import Granularity, Rounding
    from bayesq.expected_loss import rtn_table
    from bayesq.models.zoo import evaluate, get_entry
    from bayesq.quantize import allocate, encode, quantized_copy
    from flows.common import read_params
    from flows.finetune import load_model, raw_path
    from flows.quantize import calibration_batches

    params = read_params(a.params)
    q = params.quant
    entry = get_entry(a.model)
    model = load_model(entry, Path("models") / a.model / "model.safetensors")
    splits = entry.load_splits(params.data, raw_path(entry, Path("data/raw")))
    _, batches = calibration_batches(entry, splits, params.data, params.calibration, a.seed)
    test = entry.batches(splits.test_inputs, 64, params.data)
    layers = quantizable_layers(model)
    stats = input_stats(model, batches, layers)
    blocks = rtn_blocks(layer_blocks(layers, q.group_size, q.unit_groups), Granularity.GROUP, q)
    weights = {n: m.weight for n, m in layers.items()}
    omega = {n: stats[n].row_diag(m.weight.shape[0]) for n, m in layers.items()}
    tables = {"plain": rtn_table(weights, blocks, q), "H-weighted": rtn_table(weights, blocks, q, element_weight=omega)}
    metric = {n: damped_hessian(stats[n].H, params.baselines.gptq_damp) for n in layers}

    print(f"{a.model} at {a.budget} bits, seed {a.seed}; test accuracy (%)")
    for alloc_name, table in tables.items():
        alloc = allocate(table, a.budget)
        for rounding in (Rounding.NEAREST, Rounding.ERROR_FEEDBACK):
            start = time.perf_counter()
            qw = encode(table, alloc, weights, rounding=rounding,
                        column_metric=metric if rounding == Rounding.ERROR_FEEDBACK else None, act_order=True)
            acc = evaluate(quantized_copy(model, qw), test, splits.test_labels)
            name = "GPTQ rounding" if rounding == Rounding.ERROR_FEEDBACK else "nearest (RTN)"
            print(f"  {name:14s} with the {alloc_name:10s} allocation: {100 * acc:6.2f}  "
                  f"({alloc.average_bits:.4f} b, {time.perf_counter() - start:.1f} s)")
    res = awq_quantize(model, stats, a.budget, q, grid=params.baselines.awq_grid)
    scaled = sum(w.col_scale is not None for w in res.weights.values())
    print(f"  AWQ (own rule, {scaled}/{len(res.weights)} layers scaled): "
          f"{100 * evaluate(res.model, test, splits.test_labels):6.2f}  ({res.average_bits:.4f} b)")
    bits = torch.tensor([b for t in allocate(tables['plain'], a.budget).unit_bits.values() for b in t])
    bits_h = torch.tensor([b for t in allocate(tables['H-weighted'], a.budget).unit_bits.values() for b in t])
    for name, b in (("plain", bits), ("H-weighted", bits_h)):
        print(f"  {name:10s} allocation: units at " + ", ".join(f"{k} b: {int((b == k).sum())}" for k in q.bits))


if __name__ == "__main__":
    main()
