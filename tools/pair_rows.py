"""Paired differences of two rows saved by ``benchmarks/rival_test.py``, whatever code made them.

``rival_test.py`` reuses a row only while the library, the flows and params.yaml are unchanged.
A row that took hours (a learned rival at its full steps) can still be paired with a row of a
later BayesQ: both hold the per-example KL and correctness on the same test examples in the same
order (the test split does not depend on the code). This prints ``A - B`` for KL and accuracy with
the pipeline's paired 95 % bootstrap intervals (:func:`bayesq.comparison.paired_difference`).

With ``--model`` (the rows' embedded model, two classes), the FP model's test predictions are
computed too, and for each row the predictions that differ from the FP model's, by direction, and
how many of them are right: a row keeps only each example's correctness, which for two classes
gives its prediction (the label if correct, the other class if not).

    python tools/pair_rows.py .cache/rival_test/minilm-sentiment-bayesq-<key>.safetensors \\
                                   .cache/rival_test/minilm-sentiment-dorefa-<key>.safetensors \
                                   [--model minilm-sentiment]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, help="row file of the first method")
    ap.add_argument("b", type=Path, help="row file of the second method (the same model's test set)")
    ap.add_argument("--model", default=None, help="embedded two-class model of the rows: also compare each row's "
                                                   "predictions with the FP model's")
    args = ap.parse_args()

    from rival_test import load_row

    from bayesq.comparison import paired_difference

    rows = {}
    for path in (args.a, args.b):
        row = load_row(path)
        if row is None:
            raise SystemExit(f"{path}: no readable rival_test row there")
        rows[path] = row
    a, b = rows[args.a], rows[args.b]
    if len(a.kl) != len(b.kl):
        raise SystemExit(f"the rows hold {len(a.kl)} and {len(b.kl)} test examples: not the same test set")
    for path, row in rows.items():
        print(f"{path.name}: KL {row.kl.mean():.5f}, accuracy {100 * row.correct.mean():.2f} %, "
              f"{row.bits:.3f} bits, {row.seconds:.0f} s {row.variant}")
    if args.model:
        flips(args.model, rows)
    for what, scale, x, y in (("KL", 1.0, a.kl, b.kl), ("accuracy (pts)", 100.0, a.correct, b.correct)):
        d = paired_difference(scale * x, scale * y)
        star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
        print(f"A - B: {what} {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}")


def flips(name: str, rows: dict) -> None:
    """Print each row's test predictions that differ from the FP model's, by direction."""
    import torch
    from one_time_cost import load_inputs, test_batches

    from bayesq.evaluation import predict
    from flows.settings import apply_defaults

    apply_defaults()
    params, model, _, _ = load_inputs(name, 0, ROOT / "params.yaml")
    test, labels = test_batches(name, params)
    labels = torch.as_tensor(labels)
    z = predict(model, test)
    if z.shape[1] != 2:
        raise SystemExit(f"{name} has {z.shape[1]} classes: a row's predictions follow from its correctness only for 2")
    if len(z) != len(next(iter(rows.values())).correct):
        raise SystemExit(f"{name} has {len(z)} test examples, the rows another number: not this model's rows")
    fp = z.argmax(-1)
    print(f"FP model: accuracy {100 * (fp == labels).double().mean():.2f} %")
    for path, row in rows.items():
        pred = torch.where(row.correct.bool(), labels, 1 - labels)
        moved = pred != fp
        parts = []
        for a, b in ((0, 1), (1, 0)):
            sel = moved & (fp == a)
            parts.append(f"{a}->{b}: {int(sel.sum())} ({int((sel & (labels == b)).sum())} now right)")
        print(f"{path.name}: {int(moved.sum())} predictions differ from FP ({', '.join(parts)}), "
              f"agreement {100 * (~moved).double().mean():.2f} %")


if __name__ == "__main__":
    main()
