"""Table loss vs deployed error of two codebooks on a fitted posterior (the Lloyd ablation row).

    python benchmarks/codebook_error.py [--model lite0-fmnist] [--budget 3.0] \
        [--posterior results-ablations/posterior/<model>_s17_<tag>.safetensors] \
        [--codebooks uniform lloyd] [--tables results-ablations/tables]

Needs ``models/`` and a posterior written by the pipeline (``make ablations``; default: the core
row's, named by the main settings of ``params.yaml``).  For each codebook it
builds the expected-loss table, allocates ``--budget`` bits and encodes the posterior means,
then prints per layer the mean bit-width, the plug-in whitened error of the deployed weights
``sum (Q(mu) - mu)^2 / sigma^2`` and the relative RMSE ``||Q(mu) - mu|| / ||mu||``, and the
totals next to the table's expected loss.  ``--tables`` (no model needed) prints instead, for every
Parquet table in the folder, the median unit loss per bit-width: flat columns mean upgrades buy
nothing.  About 4 minutes on 2 CPU cores for lite0-fmnist (two table builds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_medians(folder: Path) -> None:
    import pandas as pd

    for f in sorted(Path(folder).glob("*.parquet")):
        t = pd.read_parquet(f)
        med = t.groupby("bits")["loss"].median()
        print(f"{f.name:60s} " + "  ".join(f"{int(b)}b {v:10.2f}" for b, v in med.items()))


def core_posterior(model: str) -> Path:
    """The core ablation row's posterior: named by the main settings of params.yaml, seed 17."""
    from flows.common import read_params
    from flows.prepare import config_tag

    params = read_params(ROOT / "params.yaml")
    tag = config_tag(params.calibration, params.posterior)
    path = ROOT / "results-ablations" / "posterior" / f"{model}_s{params.seeds[0]}_{tag}.safetensors"
    if not path.exists():
        raise SystemExit(f"{path} not found: run `make ablations` or pass --posterior")
    return path


def deployed_error(model_name: str, budget: float, posterior: Path, codebooks: list[str]) -> None:
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.config import QuantConfig
    from bayesq.expected_loss import posterior_table
    from bayesq.harness.models.zoo import get_entry
    from bayesq.quantize import allocate, encode
    from flows.finetune import load_model
    from flows.prepare import load_posterior

    model = load_model(get_entry(model_name), ROOT / "models" / model_name / "model.safetensors")
    post = load_posterior(model, posterior)
    layers = quantizable_layers(model)
    q0 = QuantConfig()
    blocks = layer_blocks(layers, q0.group_size, q0.unit_groups)
    weights = {n: m.weight for n, m in layers.items()}
    runs = {}
    for cb in codebooks:
        table = posterior_table(post, blocks, QuantConfig(codebook=cb, rounding="nearest"), progress=True)
        alloc = allocate(table, budget)
        runs[cb] = (alloc, encode(table, alloc, weights))
        print(f"{cb}: table expected loss {alloc.expected_loss:.6g} at {budget} bits", flush=True)
    head = " ".join(f"{'bits ' + c:>12s} {'white ' + c:>14s} {'rmse ' + c:>12s}" for c in codebooks)
    print(f"{'layer':40s} {'weights':>8s} {head}")
    totals = {c: [0.0, 0.0] for c in codebooks}
    for lb in blocks:
        mu, var = post.mean[lb.name], post.variance[lb.name]
        cells = []
        for c in codebooks:
            alloc, qw = runs[c]
            d = qw[lb.name].dequantize() - mu
            white, sse = float((d * d / var).sum()), float((d * d).sum())
            totals[c][0] += white
            totals[c][1] += sse
            bits = alloc.unit_bits[lb.name]
            rmse = (sse / float((mu * mu).sum())) ** 0.5
            cells.append(f"{sum(bits) / len(bits):12.2f} {white:14.4g} {rmse:12.3f}")
        print(f"{lb.name[:40]:40s} {mu.numel():8d} " + " ".join(cells))
    for c in codebooks:
        print(f"total {c}: plug-in whitened error {totals[c][0]:.6g}, squared weight error {totals[c][1]:.6g}")


def main() -> None:
    from flows.settings import apply_defaults

    apply_defaults()  # the pipeline's environment, before Prefect / Hugging Face are imported
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lite0-fmnist")
    p.add_argument("--budget", type=float, default=3.0)
    p.add_argument("--posterior", type=Path)
    p.add_argument("--codebooks", nargs="+", default=["uniform", "lloyd"])
    p.add_argument("--tables", type=Path, help="print median unit loss per bit-width of these tables and stop")
    a = p.parse_args()
    if a.tables:
        table_medians(a.tables)
        return
    deployed_error(a.model, a.budget, a.posterior or core_posterior(a.model), a.codebooks)


if __name__ == "__main__":
    main()
