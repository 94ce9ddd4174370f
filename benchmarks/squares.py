"""The Fisher's squared per-example gradients of one input, summed into the running total two ways.

    python benchmarks/squares.py [--tokens 128] [--repeats 20]

A curvature pass in parts of one input (``bayesq.memory``'s ``pass_inputs`` = 1: BERT-base,
GPT-2, ResNet-50 at the sizes of ``benchmarks/scale.py``) adds each input's squared weight
gradient ``(g^T a)^2`` (d_out x d_in) into the layer's sum. Timed side by side on the Linear
shapes of BERT-base and GPT-2 small (float32, ``--tokens`` positions per input):

* ``formed``: :func:`bayesq.curvature.patches.squared_grad_sum` returns the square (formed,
  summed over the part's one example), then it is added into the total;
* ``into``: ``squared_grad_sum(..., out=total)`` adds ``grad * grad`` straight into the total
  (``addcmul``: no square or batch-sum temporaries).

Prints milliseconds per input for each shape, their ratio and the per-layer-set totals, and the
largest relative difference of the two totals (float32 rounding only).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from bayesq.curvature.patches import add_widened, squared_grad_sum

SHAPES = {  # (d_out, d_in): count per block, of the model's Linear layers
    "BERT-base": {(768, 768): 4, (3072, 768): 1, (768, 3072): 1},
    "GPT-2 small": {(2304, 768): 1, (768, 768): 1, (3072, 768): 1, (768, 3072): 1},
    "GPT-2 head": {(50257, 768): 1},  # the vocabulary projection, once per model
}


def per_input_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, {args.tokens} positions per input, float32")
    for model, shapes in SHAPES.items():
        sums = {"formed": 0.0, "into": 0.0}
        for (d_out, d_in), count in shapes.items():
            mod = nn.Linear(d_in, d_out)
            a, g = torch.randn(1, args.tokens, d_in), torch.randn(1, args.tokens, d_out)
            formed, into = torch.zeros(d_out, d_in), torch.zeros(d_out, d_in)
            t_formed = per_input_ms(lambda: add_widened(formed, squared_grad_sum(mod, a, g)), args.repeats)
            t_into = per_input_ms(lambda: squared_grad_sum(mod, a, g, out=into), args.repeats)
            diff = ((formed - into).abs().max() / formed.abs().max()).item()
            sums["formed"] += count * t_formed
            sums["into"] += count * t_into
            print(f"  {model:11s} {d_out:5d} x {d_in:<5d} formed {t_formed:6.2f} ms  into {t_into:6.2f} ms  "
                  f"ratio {t_into / t_formed:4.2f}  max rel diff {diff:.1e}")
        print(f"{model}: its Linear layers per input (one block's for a transformer): formed {sums['formed']:.1f} ms, "
              f"into {sums['into']:.1f} ms, ratio {sums['into'] / sums['formed']:.2f}")


if __name__ == "__main__":
    main()
