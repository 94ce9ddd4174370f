"""Which calibration and selection sizes should `bayesq quantize --model ... --data ...` default to?

For one user model and data set (any source and data `bayesq quantize` takes), every method is
run at every calibration size (and selection size) through the same row as the CLI
(:func:`flows.byo.run_row`), with one test draw shared by all of them (:func:`bayesq.harness.data.files.draw_examples`
takes the test examples first, so they depend on the seed and ``--test`` only). Printed per row:
wall time of the quantisation, KL(FP || Q) with its 95 % interval (a model without a head: the
relative error of its final hidden states instead, "KL" below reads "feature error" then),
accuracy Q - FP (with labels), the paired difference of each row's per-example KL to the same method at the
largest calibration size (negative: the smaller set is closer to FP), and, with BayesQ and GPTQ
both run, BayesQ - GPTQ at every size (the floor of the CLI's draw sizes is the smallest
calibration size where it is still resolved below 0).

    python benchmarks/byo_sizes.py --model ./minilm-sst --data reviews.parquet --text-column sentence \\
        --label-column label [--calibration 128 256 512 1024] [--selection 256] [--methods bayesq gptq] \\
        [--budget 3.0] [--test 512] [--seed 17] [--out /tmp/byo-sizes]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bayesq.comparison import paired_difference
from bayesq.harness.data.files import DataSource
from flows.byo import ByoModel, load_examples, prepare, run_row
from flows.common import read_params
from flows.settings import apply_defaults

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--text-column", nargs="*", default=[])
    p.add_argument("--image-column", default="")
    p.add_argument("--label-column", default="")
    p.add_argument("--checkpoint", default="")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--calibration", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--selection", type=int, nargs="+", default=[256])
    p.add_argument("--methods", nargs="+", default=["bayesq", "gptq"])
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--test", type=int, default=512)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="byo-sizes-")))
    a = p.parse_args()
    apply_defaults()
    params = read_params(ROOT / "params.yaml")
    data = DataSource(a.data, text_columns=tuple(a.text_column), image_column=a.image_column,
                      label_column=a.label_column, image_size=a.image_size)
    rows = []
    for sel in a.selection:
        for cal in a.calibration:
            spec = ByoModel("bench", a.model, data, a.checkpoint, calibration=cal, selection=sel, test=a.test)
            prep = prepare(spec, a.seed, say=lambda _: None)
            for method in a.methods:
                r = run_row(prep, method, a.budget, params, a.seed, a.out / f"{method}_c{cal}_s{sel}.safetensors",
                            {}, "bench", say=lambda _: None)
                rows.append((method, cal, sel, r))
                f = r["fidelity"]
                key = "kl" if "kl" in f else "feature_error"
                acc = f"  acc Q-FP {f['accuracy_diff']:+.2f} pts" if "accuracy_diff" in f else ""
                print(f"{method:8s} cal {cal:5d} sel {sel:4d}  {r['quantize_seconds']:6.1f} s  "
                      f"{key} {f[key]:.5f} [{f[key + '_ci_low']:.5f}, {f[key + '_ci_high']:.5f}]{acc}", flush=True)
    print("\npaired KL difference to the same method and selection size at the largest calibration size:")
    for method, cal, sel, r in rows:
        top = max(c for m, c, s, _ in rows if m == method and s == sel)
        ref = next(x for m, c, s, x in rows if (m, c, s) == (method, top, sel))
        d = paired_difference(load_examples(Path(r["examples_file"])).primary,
                              load_examples(Path(ref["examples_file"])).primary)
        print(f"{method:8s} cal {cal:5d} sel {sel:4d} - cal {top}: {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]")
    kl = {(m, c, s): load_examples(Path(r["examples_file"])).primary for m, c, s, r in rows}
    if any(m == "bayesq" for m, _, _ in kl) and any(m == "gptq" for m, _, _ in kl):
        print("\npaired KL difference BayesQ - GPTQ at each size (* resolved):")
        for (m, cal, sel), v in kl.items():
            if m == "bayesq" and ("gptq", cal, sel) in kl:
                d = paired_difference(v, kl[("gptq", cal, sel)])
                star = "*" if d.ci_high < 0 or d.ci_low > 0 else ""
                print(f"cal {cal:5d} sel {sel:4d}: {d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}", flush=True)


if __name__ == "__main__":
    main()
