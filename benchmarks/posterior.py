"""Posterior fitting time per curvature, relative to one forward+backward pass over the calibration set.

    python benchmarks/posterior.py [--models lite0-fmnist minilm-sentiment] [--calibration 128]

Needs the fine-tuned models of the pipeline (``make run`` writes ``models/``) and ``data/raw``.
Every figure is measured in the same run on the same calibration batches: first one plain
forward+backward pass (cross-entropy at the model's argmax labels, the cost unit), then each
curvature estimator of ``bayesq.quantize.fit_posterior``.  Prints seconds and the ratio.
Then, on the first calibration batch, the diagonal Fisher's squared per-example gradients summed
over the batch two ways: all N gradients as one tensor, then squared and summed
(``per_example_grad``), against ``squared_grad_sum`` (one example at a time for large layers).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bayesq.config import BayesQConfig, Curvature, PosteriorConfig
from bayesq.forward import logits
from bayesq.quantize import fit_posterior
from bayesq.settings import replace
from flows.settings import apply_defaults

apply_defaults()  # the pipeline's environment, before Prefect / Hugging Face are imported

from flows.common import read_params  # noqa: E402
from flows.finetune import load_model, raw_path  # noqa: E402
from flows.prepare import calibration_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def forward_backward(model, batches) -> float:
    start = time.perf_counter()
    for b in batches:
        out = logits(model, b)
        F.cross_entropy(out, out.argmax(-1)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def squares_both_ways(model, batch) -> tuple[float, float, float]:
    """Seconds of ``sum_n grad_n^2`` over every quantisable layer on one batch, batched (N
    gradients materialised) and by :func:`squared_grad_sum`; and their largest relative difference."""
    from bayesq.blocks import quantizable_layers
    from bayesq.curvature.patches import per_example_grad, squared_grad_sum

    layers, acts, outs = quantizable_layers(model), {}, {}

    def capture(name: str):
        def hook(mod, inputs, output) -> None:  # returns None: the output is left as it is
            acts[name] = inputs[0].detach()
            output.register_hook(lambda g: outs.__setitem__(name, g))
        return hook

    hooks = [m.register_forward_hook(capture(n)) for n, m in layers.items()]
    out = logits(model, batch)
    F.cross_entropy(out, out.argmax(-1), reduction="sum").backward()
    model.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    start = time.perf_counter()
    batched = {n: per_example_grad(m, acts[n], outs[n]).pow_(2).sum(0) for n, m in layers.items() if n in outs}
    mid = time.perf_counter()
    looped = {n: squared_grad_sum(m, acts[n], outs[n]) for n, m in layers.items() if n in outs}
    end = time.perf_counter()
    diff = max(float((batched[n] - looped[n]).abs().max() / batched[n].abs().max().clamp_min(1e-30)) for n in looped)
    return mid - start, end - mid, diff


def main() -> None:
    from bayesq.harness.models.zoo import get_entry

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["lite0-fmnist", "minilm-sentiment"])
    p.add_argument("--calibration", type=int, default=128, help="calibration inputs per model")
    p.add_argument("--probes", type=int, default=16)
    a = p.parse_args()
    params = read_params(ROOT / "params.yaml")
    cal = replace(params.calibration, images=a.calibration, sentences=a.calibration)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; "
          f"{a.calibration} calibration inputs, batch {cal.batch_size}")
    for name in a.models:
        entry = get_entry(name)
        model = load_model(entry, ROOT / "models" / name / "model.safetensors")
        splits = entry.load_splits(params.data, raw_path(entry, ROOT / "data" / "raw"))
        _, batches = calibration_batches(entry, splits, params.data, cal, 17)
        batches = list(batches)
        forward_backward(model, batches[:1])  # warm-up
        unit = forward_backward(model, batches)
        print(f"\n{name}: one forward+backward over the calibration set: {unit:.2f} s")
        print(f"  {'curvature':22s} {'seconds':>8s} {'x fwd+bwd':>10s}")
        for curv in Curvature:
            cfg = BayesQConfig(posterior=PosteriorConfig(curvature=curv, probes=a.probes), seed=17)
            start = time.perf_counter()
            fit_posterior(model, batches, cfg, progress=False)
            sec = time.perf_counter() - start
            extra = f" (M={a.probes})" if curv.value.startswith("hutchinson") else ""
            print(f"  {curv.value + extra:22s} {sec:8.2f} {sec / unit:10.1f}", flush=True)
        batched, looped, diff = squares_both_ways(model, batches[0])
        print(f"  squared per-example gradients, one batch: materialised {batched:.2f} s, squared_grad_sum "
              f"{looped:.2f} s ({batched / looped:.1f}x); largest relative difference {diff:.1e}")


if __name__ == "__main__":
    main()
