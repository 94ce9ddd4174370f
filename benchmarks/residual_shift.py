"""What is left of the logit shift after the output offset (``quant.output_offset``), and what
post-hoc corrections of it do.

For one embedded model and calibration seed, BayesQ's pipeline row (params.yaml's settings, the
seed's calibration and held-out selection draws, its output offset included) is quantised once.
Printed:

1. (two classes) the shift of the quantised model's class-1 margin ``m = z_1 - z_0`` against the
   FP model's, by bins of the FP margin, on the test, calibration and selection inputs;
2. (two classes) the FP model's test accuracy when a constant is added to its margin: how much a
   shift alone moves accuracy on this test set, with no other error;
3. recalibrations of the quantised logits fitted by least mean KL to the FP model (as the offset,
   :func:`bayesq.output_offset.mean_kl`) on the calibration inputs, and on calibration plus
   selection inputs: ``z + c`` (the offset again), ``a z + c`` (one temperature) and ``a * z + c``
   (one scale per class; for a Linear output layer both fold into its rows' scales and bias).
   Test KL and accuracy, paired against the default (95 % bootstrap intervals,
   :func:`bayesq.comparison.paired_difference`);
4. ``--passes`` passes of empirical bias correction: each bias-corrected layer's mean output on
   the calibration inputs, measured on the quantised model (so with the errors of the layers
   before it), is moved to the FP model's at once for all layers (one Jacobi step per pass), then
   the output offset is refitted; paired against the default after each pass.

    python benchmarks/residual_shift.py [--model minilm-sentiment] [--seed 17] [--passes 1]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

BINS = (-99, -4, -2, -1, -0.5, 0, 0.5, 1, 2, 4, 99)  # FP margin bins of part 1
SHIFTS = (-0.3, -0.2, -0.1, -0.05, 0.05, 0.1, 0.2, 0.3)  # constant margin shifts of part 2


def interval(d) -> str:
    star = "*" if d.ci_low > 0 or d.ci_high < 0 else ""
    return f"{d.diff:+.5f} [{d.ci_low:+.5f}, {d.ci_high:+.5f}]{star}"


def margin_shift_bins(z_fp: torch.Tensor, z_q: torch.Tensor) -> str:
    """Mean margin shift per FP-margin bin, one line per bin."""
    m = z_fp[:, 1] - z_fp[:, 0]
    d = (z_q[:, 1] - z_q[:, 0]) - m
    lines = [f"    all {len(m)}: {float(d.mean()):+.4f} (SD {float(d.std()):.4f})"]
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        s = (m >= lo) & (m < hi)
        if s.any():
            lines.append(f"    FP margin in [{lo:+g}, {hi:+g}): {int(s.sum()):4d} inputs, shift {float(d[s].mean()):+.4f}")
    return "\n".join(lines)


def fit_recalibration(z_fp: torch.Tensor, z_q: torch.Tensor, mode: str):
    """(a, c) of ``a * z + c`` with least mean KL to ``z_fp`` (``mode``: offset | temperature |
    affine; a: (C,) float64, ones for ``offset``, one value repeated for ``temperature``)."""
    from bayesq.output_offset import mean_kl

    C = z_fp.shape[1]
    log_a = torch.zeros(1 if mode == "temperature" else C, dtype=torch.float64, requires_grad=mode != "offset")
    c = torch.zeros(C, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([c] + ([log_a] if mode != "offset" else []), max_iter=200, tolerance_grad=1e-12,
                            tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = mean_kl(z_fp, log_a.exp() * z_q, c)
        loss.backward()
        return loss

    opt.step(closure)
    return log_a.detach().exp().expand(C), c.detach() - c.detach().mean()


def output_means(model: nn.Module, batches, names) -> dict[str, torch.Tensor]:
    """Layer name -> (out,) float64 mean of its output over the inputs and positions (Conv2d:
    channels on dim 1; Linear: the last dim)."""
    from bayesq.forward import call

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name, conv):
        def post(mod, inputs, out):
            y = out.detach().double()
            y = y.transpose(0, 1).reshape(y.shape[1], -1).T if conv else y.reshape(-1, y.shape[-1])
            sums[name] = sums.get(name, 0) + y.sum(0)
            counts[name] = counts.get(name, 0) + len(y)
        return post

    mods = {n: model.get_submodule(n) for n in names}
    handles = [m.register_forward_hook(hook(n, isinstance(m, nn.Conv2d))) for n, m in mods.items()]
    model.eval()
    try:
        with torch.no_grad():
            for b in batches:
                call(model, b)
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / counts[n] for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm-sentiment")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--budget", type=float, default=3.0)
    ap.add_argument("--passes", type=int, default=1, help="passes of empirical bias correction (part 4)")
    a = ap.parse_args()

    from flows.settings import apply_defaults

    apply_defaults()
    from one_time_cost import load_inputs, test_batches

    from bayesq.comparison import kl_per_example, paired_difference
    from bayesq.evaluation import predict
    from bayesq.methods import Inputs, quantize_with
    from bayesq.output_offset import fit_output_offset
    from flows.configs import method_config

    params, model, calibration, selection = load_inputs(a.model, a.seed, ROOT / "params.yaml")
    test, labels = test_batches(a.model, params)
    labels = torch.as_tensor(labels)
    cfg = method_config("bayesq", params, a.budget, a.seed)[0]
    res = quantize_with(model, cfg, a.budget, Inputs(calibration=calibration, selection=selection)).result
    z = {k: (predict(model, b).double(), predict(res.model, b).double())
         for k, b in (("test", test), ("calibration", calibration), ("selection", selection))}
    z_fp, z_q = z["test"]
    kl0, ok0 = kl_per_example(z_fp, z_q), (z_q.argmax(-1) == labels).double()
    ok_fp = (z_fp.argmax(-1) == labels).double()
    off = res.output_offset
    shift = None if off is None or off.shift is None else [round(float(v), 4) for v in off.shift]
    print(f"{a.model} seed {a.seed}, BayesQ's default: test KL {kl0.mean():.5f}, accuracy {100 * ok0.mean():.2f} % "
          f"(FP {100 * ok_fp.mean():.2f} %); output offset {shift} ({off.skipped if off else 'off'})", flush=True)

    def changes(zz: torch.Tensor) -> str:
        p_fp, p = z_fp.argmax(-1), zz.argmax(-1)
        moved = p != p_fp
        return (f"{int(moved.sum())} predictions differ from FP ({int((moved & (p == 1)).sum())} to class 1), "
                f"{int((moved & (p == labels)).sum())} of them right")

    def versus_default(tag: str, zz: torch.Tensor) -> None:
        kl, ok = kl_per_example(z_fp, zz), (zz.argmax(-1) == labels).double()
        print(f"  {tag}: KL {kl.mean():.5f}, {100 * ok.mean():.2f} %; - default: KL {interval(paired_difference(kl, kl0))}, "
              f"accuracy (pts) {interval(paired_difference(100 * ok, 100 * ok0))}; {changes(zz)}", flush=True)

    print(f"  default: {changes(z_q)}")
    if z_fp.shape[1] == 2:
        print("1. class-1 margin shift, quantised - FP, by FP margin:")
        for k, (zf, zq) in z.items():
            print(f"  {k}:\n{margin_shift_bins(zf, zq)}")
        print("2. FP test accuracy with a constant added to its margin:")
        m = z_fp[:, 1] - z_fp[:, 0]
        for s in SHIFTS:
            p = (m + s > 0).long()
            print(f"  {s:+.2f}: {100 * float((p == labels).double().mean()):.2f} % ({int((p != z_fp.argmax(-1)).sum())} "
                  f"predictions changed)")
    print("3. recalibrations a * z + c fitted by least mean KL, on top of the default:")
    for src in ("calibration", "calibration + selection"):
        zf = torch.cat([z[k][0] for k in src.split(" + ")])
        zq = torch.cat([z[k][1] for k in src.split(" + ")])
        for mode in ("offset", "temperature", "affine"):
            scale, c = fit_recalibration(zf, zq, mode)
            versus_default(f"{mode} on {src} (a {[round(float(v), 3) for v in scale]}, c {[round(float(v), 4) for v in c]})",
                           scale * z_q + c)
    if res.correction is None:
        print("4. skipped: the default has no bias correction")
        return
    print(f"4. empirical bias correction of {len(res.correction.targets)} layers, then the offset refitted:")
    names = list(res.correction.targets)
    fp_means = output_means(model, calibration, names)
    q = copy.deepcopy(res.model)
    state = dict(q.named_parameters()) | dict(q.named_buffers())
    for k in range(1, a.passes + 1):
        q_means = output_means(q, calibration, names)
        gap = sum(float((fp_means[n] - q_means[n]).pow(2).sum()) for n in names)
        with torch.no_grad():
            for n, key in res.correction.targets.items():
                t = state[key]
                t.add_((fp_means[n] - q_means[n]).to(t.dtype), alpha=-1.0 if key.endswith("running_mean") else 1.0)
        fixed = copy.deepcopy(q)
        fit_output_offset(model, fixed, calibration).apply(fixed)
        versus_default(f"pass {k} (summed squared mean-output gap before it {gap:.3g})", predict(fixed, test).double())


if __name__ == "__main__":
    main()
