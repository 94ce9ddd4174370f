"""Does an embedded model's fine-tune depend on which CPU kernels run it? One machine, four dispatches.

Runs the first ``--steps`` steps of ``ModelEntry.finetune``'s loop (same optimiser, learning
rate, seed and batches; one torch thread) in a fresh process per setting: the default dispatch,
then each library that picks kernels by instruction set switched to another code path

* ``ATEN_CPU_CAPABILITY=default``: ATen's vectorised element-wise and reduction kernels,
* ``ONEDNN_MAX_CPU_ISA=AVX``: oneDNN's convolutions and matmuls,
* ``MKL_CBWR=COMPATIBLE``: MKL's BLAS,

and prints, per setting, the relative L2 change of all weights against the default, the
largest change, how many weights moved by more than 1e-6, and the training loss at the last step. ``--variant`` changes the recipe in every setting alike, to see
whether a change removes the amplification: ``eps`` (Adam's epsilon 1e-6 instead of 1e-8),
``bn-frozen`` (BatchNorm layers in eval mode), ``sgd`` (SGD, lr 0.01, momentum 0.9, weight decay
1e-4), ``float64`` (weights and inputs in float64; the inputs are still resized in float32);
``frozen`` runs the library's whole fine-tune with the backbone frozen (``finetune.frozen_backbone``:
only the head trains, ``finetune.head_epochs`` epochs on the backbone's features; ``--steps`` is
ignored). A change at float-rounding level (~1e-7) means the fine-tune
is the same model on another CPU; percent-level means the kernels' rounding is amplified and
another CPU fine-tunes another model (docs/method.md, section 22b).

    python benchmarks/finetune_isa.py [--model lite0-fmnist] [--steps 20] [--variant adam|eps|bn-frozen|sgd|float64|frozen]
                                      [--params params.yaml] [--raw data/raw]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"default dispatch": {}, "ATEN_CPU_CAPABILITY=default": {"ATEN_CPU_CAPABILITY": "default"},
            "ONEDNN_MAX_CPU_ISA=AVX": {"ONEDNN_MAX_CPU_ISA": "AVX"}, "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"}}


VARIANTS = ("adam", "eps", "bn-frozen", "sgd", "float64", "frozen")


def steps(model_name: str, n_steps: int, params: Path, raw: Path, out: Path, variant: str = "adam") -> None:
    """The first ``n_steps`` of the fine-tune; saves the flattened weights (float32) to ``out``."""
    import torch
    import torch.nn.functional as F
    import yaml

    sys.path.insert(0, str(ROOT))
    from bayesq.config import replace
    from bayesq.harness.data.sentiment import seeded_permutation
    from bayesq.forward import logits
    from bayesq.harness.models.zoo import _take, get_entry
    from flows.params import load_params

    p = load_params(yaml.safe_load(params.read_text()))
    entry, cfg = get_entry(model_name), p.finetune
    splits = entry.load_splits(p.data, raw / entry.default_raw.name)
    torch.set_num_threads(1)
    if variant == "frozen":  # the pipeline's own code path, whole
        model = entry.finetune(entry.build(pretrained=True), splits, p.data,
                               replace(cfg, frozen_backbone=(model_name,), threads=1))
        torch.save({"weights": torch.cat([q.detach().flatten().float() for q in model.parameters()]),
                    "loss": float("nan")}, out)
        return
    torch.manual_seed(cfg.seed)
    model = entry.build(pretrained=True).train()
    if variant == "float64":
        model = model.double()
    if variant == "bn-frozen":
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.eval()
    if variant == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=entry.learning_rate(cfg), weight_decay=cfg.weight_decay,
                                eps=1e-6 if variant == "eps" else 1e-8)
    order = seeded_permutation(len(splits.train_labels), cfg.seed * 1000003)  # epoch 0, as finetune
    loss = torch.tensor(float("nan"))
    for s in range(n_steps):
        idx = order[s * cfg.batch_size:(s + 1) * cfg.batch_size]
        (batch,) = entry.batches(_take(splits.train_inputs, idx), len(idx), p.data)
        if variant == "float64" and isinstance(batch, torch.Tensor):
            batch = batch.double()
        loss = F.cross_entropy(logits(model, batch), splits.train_labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.save({"weights": torch.cat([q.detach().flatten().float() for q in model.parameters()]),
                "loss": float(loss.detach())}, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lite0-fmnist")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variant", choices=VARIANTS, default="adam")
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    ap.add_argument("--raw", type=Path, default=ROOT / "data" / "raw")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # internal: run the steps, save here
    a = ap.parse_args()
    if a.child:
        steps(a.model, a.steps, a.params, a.raw, a.child, a.variant)
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for label, env in SETTINGS.items():
            out = Path(tmp) / f"{len(runs)}.pt"
            subprocess.run([sys.executable, __file__, "--model", a.model, "--steps", str(a.steps), "--variant", a.variant,
                            "--params",
                            str(a.params), "--raw", str(a.raw), "--child", str(out)],
                           env={**os.environ, **env}, check=True)
            runs[label] = torch.load(out)
    base = runs["default dispatch"]["weights"]
    what = "the whole fine-tune" if a.variant == "frozen" else f"{a.steps} fine-tune steps"
    print(f"{a.model}, {what} ({a.variant}), one thread: relative L2 change of all weights vs the default dispatch")
    for label, r in runs.items():
        diff = r["weights"] - base
        rel = float(diff.norm() / base.norm())
        print(f"  {label:30s} {rel:.2e}   max |change| {float(diff.abs().max()):.1e}, "
              f"{int((diff.abs() > 1e-6).sum())} of {diff.numel()} weights moved > 1e-6"
              + (f"; loss at the last step {r['loss']:.4f}" if r["loss"] == r["loss"] else ""))


if __name__ == "__main__":
    main()
