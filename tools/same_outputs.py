"""Do the library's public calls give the same tensors as at an earlier commit? A refactor's check.

Runs one small set of calls on a seeded CNN, at ``rev`` (a git worktree of it, its own ``bayesq``
first on the path) and in this checkout, and compares every tensor they return: each quantised
model's state and output offset, for BayesQ (held-out selection, calibration only, with
distillation), GPTQ (with and without held-out inputs), AWQ, LSQ and BayesQ + BRECQ. Prints each
call and whether its tensors are equal element for element; exits 1 if any differs. The calls
use only the API that both commits have (``quantize_model``, ``quantize_with`` and the configs).
A minute or two on 2 cores; the pipeline's rows are checked by ``tools/pair_runs.py``.

    python tools/same_outputs.py 2423b3a
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def calls() -> dict:
    """Call name -> a function returning its QuantizationResult (imports from the ``bayesq`` first on the path)."""
    import torch
    from torch import nn

    from bayesq import BayesQConfig, quantize_model
    from bayesq.baselines.awq import AWQConfig
    from bayesq.baselines.brecq import BayesQBRECQConfig, BRECQConfig
    from bayesq.baselines.gptq import GPTQConfig
    from bayesq.baselines.lsq import LSQConfig
    from bayesq.config import DistillConfig, QuantConfig
    from bayesq.methods import Inputs, quantize_with

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 5)).double().eval()
    g = torch.Generator().manual_seed(1)
    cal = [torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(4)]
    sel = [torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    q, off = QuantConfig(group_size=16, unit_groups=2), DistillConfig(max_budget=0)
    with_sel, cal_only = Inputs(calibration=cal, selection=sel), Inputs(calibration=cal)
    return {
        "bayesq, held-out selection": lambda: quantize_model(model, cal, BayesQConfig(budget=4.0, quant=q, distill=off),
                                                             progress=False, selection=sel),
        "bayesq, calibration only": lambda: quantize_model(model, cal, BayesQConfig(budget=4.0, quant=q, distill=off),
                                                           progress=False),
        "bayesq, distilled": lambda: quantize_model(
            model, cal, BayesQConfig(budget=4.0, quant=q, distill=DistillConfig(max_budget=4.5, steps=5, samples=2)),
            progress=False, selection=sel),
        "gptq, held-out selection": lambda: quantize_with(
            model, GPTQConfig(q, group_sizes=(16, 32), bias_correction=True, progress=False), 4.0, with_sel).result,
        "gptq, calibration only": lambda: quantize_with(
            model, GPTQConfig(q, group_sizes=(16, 32), bias_correction=True, progress=False), 4.0, cal_only).result,
        "awq": lambda: quantize_with(model, AWQConfig(q, group_sizes=(16,), grid=4, bias_correction=True,
                                                      progress=False), 4.0, with_sel).result,
        "lsq": lambda: quantize_with(model, LSQConfig(q, group_sizes=(16,), iters=20, bias_correction=True,
                                                      progress=False), 4.0, with_sel).result,
        "bayesq + brecq": lambda: quantize_with(
            model, BayesQBRECQConfig(BayesQConfig(quant=q, distill=off, progress=False),
                                     BRECQConfig(q, iters=10, bias_correction=True, progress=False)),
            4.0, with_sel).result,
    }


def run(out: Path) -> None:
    """Every call's tensors (model state, output offset) into ``out`` (torch.save)."""
    import torch

    saved = {}
    for name, call in calls().items():
        res = call()
        saved[name] = {k: v.clone() for k, v in res.model.state_dict().items()}
        if res.output_offset is not None and res.output_offset.shift is not None:
            saved[name]["output offset"] = res.output_offset.shift.clone()
    torch.save(saved, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the earlier commit")
    ap.add_argument("--run", type=Path, help=argparse.SUPPRESS)  # internal: run the calls, save to this file
    a = ap.parse_args()
    if a.run:
        run(a.run)
        return
    import os

    import torch

    python = str(Path(sys.executable).absolute())  # the same interpreter, wherever it was called from
    with tempfile.TemporaryDirectory() as tmp:
        tree, then, now = Path(tmp) / "tree", Path(tmp) / "then.pt", Path(tmp) / "now.pt"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), a.rev], cwd=ROOT, check=True)
        try:
            for where, out in ((tree, then), (ROOT, now)):
                print(f"running the calls at {a.rev if where == tree else 'this checkout'} ...", flush=True)
                subprocess.run([python, str(Path(__file__).resolve()), a.rev, "--run", str(out)], cwd=where,
                               check=True, env={**os.environ, "PYTHONPATH": str(where)})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        x, y = torch.load(then), torch.load(now)
    failed = False
    for name in x:
        same = name in y and x[name].keys() == y[name].keys() and all(torch.equal(x[name][k], y[name][k])
                                                                       for k in x[name])
        failed |= not same
        print(f"{name}: {'the same tensors' if same else 'DIFFERENT'} ({len(x[name])} tensors)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
