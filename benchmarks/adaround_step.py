"""AdaRound's step: the hand-derived gradient against autograd and against its ``D H`` floor.

AdaRound runs 10,000 Adam steps per layer, each one gradient of its relaxed layer objective
(:func:`bayesq.baselines.adaround.adaround_loss`). The solver's gradient,
:meth:`bayesq.baselines.adaround.Relaxation.grad`, is derived by hand; this times it side by side,
on random float32 layers of the given shapes with a min/max grid per row, against

* autograd on ``adaround_loss`` (the reference the tests check the gradient against), and
* the one ``D H`` product a step cannot avoid (the floor),

both with the regulariser on (annealing) and off (warm-up), and checks the two gradients agree.
Prints milliseconds per step and the hand gradient's time over the floor. Shapes are
``out x d_in``; the defaults are MiniLM's (attention projections, FFN in and out) and BERT-base's
FFN out.

    python benchmarks/adaround_step.py [--shapes 384x384 1536x384 384x1536 768x3072] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from bayesq.baselines.adaround import Relaxation, adaround_loss  # noqa: E402


def per_call(fn, repeats: int) -> float:
    """Milliseconds per call of ``fn`` (one warm-up call first)."""
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats * 1e3


def layer(out: int, d: int, bits: int = 3, seed: int = 0):
    """Float32 weights, a sample second-moment metric and a per-row min/max grid, shaped (1, out, d)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(1, out, d, generator=g) * 0.05
    X = torch.randn(2 * d, d, generator=g)
    H = (X.T @ X / (2 * d))[None]
    lo, hi = W.amin(-1, keepdim=True), W.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).expand_as(W).contiguous()
    zero = torch.round(-lo / scale[..., :1]).expand_as(W).contiguous()
    maxq = torch.full_like(W, 2**bits - 1)
    low = torch.floor(W / scale) + zero
    v = torch.randn(W.shape, generator=g)
    return W, H, scale, zero, maxq, low, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["384x384", "1536x384", "384x1536", "768x3072"])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per step")
    print(f"{'shape':>10} {'beta':>5} {'autograd':>9} {'hand':>7} {'D H':>7} {'hand / D H':>10} {'max rel diff':>12}")
    for shape in a.shapes:
        out, d = (int(x) for x in shape.split("x"))
        W, H, scale, zero, maxq, low, v = layer(out, d)
        relaxed = Relaxation(W, H, scale, zero, maxq, low)
        D = torch.randn_like(W)
        for b in (None, 10.0):
            def autograd():
                vg = v[0].clone().requires_grad_()
                adaround_loss(vg, W[0], H[0], scale[0], zero[0], maxq[0], low[0], 0.01, b).backward()
                return vg.grad

            auto = per_call(autograd, a.repeats)
            hand = per_call(lambda: relaxed.grad(v, 0.01, b), a.repeats)
            floor = per_call(lambda: D @ H, a.repeats)
            ref, got = autograd(), relaxed.grad(v, 0.01, b)[0]
            diff = float((got - ref).abs().max() / ref.abs().max())
            print(f"{shape:>10} {'off' if b is None else b:>5} {auto:9.2f} {hand:7.2f} {floor:7.2f} "
                  f"{hand / floor:10.2f} {diff:12.1e}")


if __name__ == "__main__":
    main()
