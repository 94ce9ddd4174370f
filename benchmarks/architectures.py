"""Weight accounting per architecture family at 3.0 bits: the quantised share of the weight
matrices, the average bits of the quantised weights and of all of them (the floating ones at
their storage width), and what is kept in floating point, with the reason.

Two tables:

* ``tiny``: the test matrix's models (``bayesq.harness.architectures``, cut-down widths) through
  every method of ``tests/test_architectures.py`` (BayesQ, BayesQ with K-FAC + error feedback,
  GPTQ, AWQ, RTN per group), on the harness's seeded example batches;
* ``real``: the published configurations (ResNet-18, MobileNetV3-Small, EfficientNet-B0,
  ConvNeXt-Tiny, ViT-B/16, BERT-base, DistilBERT-base, GPT-2 small, T5-small, a 6-layer
  ``nn.TransformerEncoder``) through RTN per group (data-free, so the accounting of a full-size
  model costs seconds; the share does not depend on the method).

Random weights, so the numbers say what is quantised and what it costs, not how accurate it is.

    python benchmarks/architectures.py [--tables tiny,real] [--budget 3.0]
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace
import time

import torch

from bayesq.baselines.awq import AWQConfig
from bayesq.baselines.gptq import GPTQConfig
from bayesq.baselines.rtn import RTNConfig
from bayesq.config import BayesQConfig, Curvature, DistillConfig, Granularity, PosteriorConfig
from bayesq.harness.architectures import FAMILIES, build, example_batches
from bayesq.methods import Inputs, quantize_with

METHODS = {
    "bayesq": BayesQConfig(distill=DistillConfig(steps=8)),
    "bayesq-ef": BayesQConfig(posterior=replace(PosteriorConfig(), curvature=Curvature.KFAC),
                              distill=DistillConfig(steps=8)),
    "gptq": GPTQConfig(),
    "awq": AWQConfig(),
    "rtn": RTNConfig(Granularity.GROUP),
}


def _reasons(unquantized: dict[str, str]) -> str:
    kinds = Counter(why.split(":")[0].split(" (")[0] for why in unquantized.values())
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items())) or "-"


def row(family: str, size: str, method: str, budget: float) -> str:
    model = build(family, size)
    batches = example_batches(family, size) if method != "rtn" else None
    start = time.perf_counter()
    res = quantize_with(model, METHODS[method], budget, Inputs(calibration=batches)).result
    seconds = time.perf_counter() - start
    n_q = res.allocation.n_weights
    params = dict(res.model.named_parameters())
    n_fp = sum(params[n].numel() for n in res.unquantized)
    share = n_q / (n_q + n_fp)
    return (f"| {family} | {method} | {len(res.weights)} | {n_q + n_fp:,} | {100 * share:.1f} % | "
            f"{res.average_bits:.3f} | {res.average_bits_all:.3f} | {_reasons(res.unquantized)} | {seconds:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", default="tiny,real")
    ap.add_argument("--budget", type=float, default=3.0)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    header = ("| family | method | layers | weight matrices | quantised share | avg bits (quantised) | "
              "avg bits (all) | kept in floating point | s |\n|---|---|---|---|---|---|---|---|---|")
    for table in args.tables.split(","):
        print(f"\n## {table} ({args.budget} bits)\n\n{header}")
        for family in FAMILIES:
            for method in (METHODS if table == "tiny" else ["rtn"]):
                print(row(family, table, method, args.budget), flush=True)


if __name__ == "__main__":
    main()
