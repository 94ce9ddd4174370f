"""Coordinate descent in float32 against float64, on the very calls BayesQ's default makes.

Runs ``quantize_with(model, BayesQConfig(), budget, ...)`` and, at each call of
:func:`bayesq.error_feedback.coordinate_descent` (one per layer and row chunk, the grid
candidates' rows stacked), polishes the same codes in both dtypes, one after the other in this
process. Prints each dtype's summed seconds, how many codes differ, and the summed cost
``tr(D H D^T)`` of each (float64 arithmetic), so a relative difference of either sign shows how
far the float32 result is from float64's.

    python benchmarks/cd_dtype.py [--models minilm-sentiment,lite0-fmnist] [--sizes bert-base]
                                  [--calls 12] [--budget 3.0] [--seed 17]

``--models``: embedded fine-tuned models (needs ``models/`` and ``data/raw`` from ``make run``);
``--sizes``: ``benchmarks/scale.py``'s models from configs (random weights, 128 inputs).
``--calls N`` stops each model after N calls (0: the whole run).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


class Enough(Exception):
    """Raised by the wrapper after ``--calls`` calls to stop the run."""


def tr_cost(W, H, scale, zero, codes) -> float:
    """``sum_r (Q_r - W_r)^T H_{k(r)} (Q_r - W_r)`` in float64."""
    import torch

    from bayesq.refit import layer_cost

    Q = torch.broadcast_to(scale, W.shape).double() * (codes.double() - torch.broadcast_to(zero, W.shape).double())
    return layer_cost(Q, W.double(), H.double())


def measure(run, calls: int) -> dict:
    """Wrap the encoder's coordinate descent while ``run()`` runs; the library's own result is returned."""
    import torch

    import bayesq.rounding as rounding
    from bayesq.error_feedback import coordinate_descent

    tot = dict(n=0, s64=0.0, s32=0.0, diff=0, codes=0, c64=0.0, c32=0.0)

    def both(W, H, scale, zero, maxq, codes, **kw):
        kw.pop("dtype", None)
        out = {}
        for dt, key in ((torch.float64, "64"), (torch.float32, "32")):
            start = time.perf_counter()
            out[key] = coordinate_descent(W, H, scale, zero, maxq, codes, dtype=dt, **kw)
            tot["s" + key] += time.perf_counter() - start
            tot["c" + key] += tr_cost(W, H, scale, zero, out[key])
        tot["diff"] += int((out["64"] != out["32"]).sum())
        tot["codes"] += out["64"].numel()
        tot["n"] += 1
        if calls and tot["n"] >= calls:
            raise Enough
        return out["32" if rounding.CD_DTYPE == torch.float32 else "64"]

    rounding.coordinate_descent = both
    try:
        run()
    except Enough:
        pass
    finally:
        rounding.coordinate_descent = coordinate_descent
    return tot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm-sentiment,lite0-fmnist")
    ap.add_argument("--sizes", default="")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=17)
    a = ap.parse_args()
    from flows.settings import apply_defaults

    apply_defaults()
    import torch

    from bayesq.config import BayesQConfig
    from bayesq.methods import Inputs, quantize_with

    torch.set_num_threads(2)
    cases = [("model", m) for m in a.models.split(",") if m] + [("size", s) for s in a.sizes.split(",") if s]
    for kind, name in cases:
        if kind == "model":
            from one_time_cost import load_inputs

            _, model, cal, sel = load_inputs(name, a.seed, ROOT / "params.yaml")
        else:
            import scale

            ns = argparse.Namespace(size=name, device="cpu", threads=2, calibration=128, selection=0, tokens=128,
                                    pixels=224)
            model, cal, sel = scale.setup(ns)
        t = measure(lambda: quantize_with(model, BayesQConfig(), a.budget, Inputs(calibration=cal, selection=sel)),
                    a.calls)
        rel = (t["c32"] - t["c64"]) / t["c64"]
        print(f"{name}: {t['n']} calls, float64 {t['s64']:.2f} s, float32 {t['s32']:.2f} s "
              f"(ratio {t['s32'] / t['s64']:.2f}); codes differing {t['diff']} / {t['codes']}; "
              f"cost float64 {t['c64']:.6g}, float32 {t['c32']:.6g} (relative {rel:+.1e})", flush=True)


if __name__ == "__main__":
    main()
