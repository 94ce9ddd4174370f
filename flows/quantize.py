"""DVC stage `quantize`: posterior, loss tables, BayesQ and the baselines at every budget, evaluation.

    python -m flows.quantize --params params.yaml --raw data/raw --models models --out results

Per (model, seed): a cached posterior task (calibration inputs drawn from the training split
with the seed, labels never used) and a cached loss-table task (also written as Parquet), a
second pair with the K-FAC posterior for ``bayesq-ef``, and the HAWQ Hessian traces; per
(method, budget): a cached quantise-and-evaluate task (GPTQ and AWQ collect their layer-input
statistics inside it, on the same calibration inputs). Every record carries
``preprocess_seconds``: the method's whole one-time cost at that budget (BayesQ: posterior +
table + allocation and encoding; GPTQ / AWQ: input statistics + solve; HAWQ: traces + knapsack).  One MLflow parent run per invocation,
one child run per (model, method, seed, budget), logged from the flow body so cache hits are
logged too.  Writes ``<out>/results.json``, ``<out>/posterior/`` and ``<out>/tables/``.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from bayesq.config import Curvature, FisherScale, Granularity, Method, Rounding, replace
from flows.common import (
    CACHE, code_version, digest, mlflow_child, mlflow_parent, parser, read_params, write_json,
)
from flows.finetune import load_model, raw_path
from flows.robustness import fp_eval_task, mean_corruption_error, tracked_metrics

_RTN = {Method.RTN_TENSOR: Granularity.TENSOR, Method.RTN_CHANNEL: Granularity.CHANNEL,
        Method.RTN_GROUP: Granularity.GROUP}


def calibration_batches(entry, splits, data, calibration, seed: int):
    """Unlabelled calibration batches drawn from the training inputs with ``seed``."""
    from bayesq.data.calibration import sample_calibration_indices
    from bayesq.models.zoo import _take

    n_cal = calibration.images if entry.task == "image" else calibration.sentences
    idx = sample_calibration_indices(len(splits.train_labels), min(n_cal, len(splits.train_labels)), seed)
    inputs = _take(splits.train_inputs, idx)
    return idx, entry.batches(inputs, calibration.batch_size, data)


@task(cache_policy=CACHE, persist_result=True)
def posterior_task(name: str, model_file: str, model_digest: str, raw: str, raw_digest: str,
                   data, calibration, posterior, seed: int, out: str, code: str, tag: str = "") -> dict:
    """Fit the posterior on the seed's calibration set; save it as safetensors.

    The file holds the variances, the error-feedback metrics of structured posteriors and the
    calibration indices (which inputs were used).
    """
    import torch
    from safetensors.torch import save_file

    from bayesq.config import BayesQConfig
    from bayesq.models.zoo import get_entry
    from bayesq.quantize import fit_posterior

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    splits = entry.load_splits(data, Path(raw))
    idx, batches = calibration_batches(entry, splits, data, calibration, seed)
    if calibration.fisher_scale == FisherScale.TRAIN:
        posterior = replace(posterior, n_data=len(splits.train_labels))
    start = time.perf_counter()
    post = fit_posterior(model, batches, BayesQConfig(posterior=posterior, seed=seed))
    seconds = time.perf_counter() - start
    path = Path(out) / f"{name}_s{seed}{'_' + tag if tag else ''}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {f"variance/{k}": v.float().contiguous() for k, v in post.variance.items()}
    for k, f in (post.kfac or {}).items():  # damped K-FAC factors (float64: they get inverted)
        tensors[f"kfac_A/{k}"], tensors[f"kfac_G/{k}"] = f.A.contiguous(), f.G.contiguous()
    tensors["calibration_indices"] = idx.to(torch.int64)
    save_file(tensors, str(path), metadata={"n_examples": str(post.n_examples), "seed": str(seed),
                                            "n_data": str(post.n_data), "curvature": posterior.curvature.value})
    return {"path": str(path), "seconds": seconds, "n_examples": post.n_examples}


def load_posterior(model, path: Path):
    """The :class:`bayesq.posterior.Posterior` saved by ``posterior_task`` (means from ``model``)."""
    from safetensors import safe_open

    from bayesq.blocks import quantizable_layers
    from bayesq.curvature.kfac import KFACFactors
    from bayesq.posterior import Posterior

    layers = quantizable_layers(model)
    with safe_open(str(path), "pt") as f:
        var = {n: f.get_tensor(f"variance/{n}").double() for n in layers}
        keys = set(f.keys())
        meta = f.metadata()
        n = int(meta["n_examples"])
        kfac = {k: KFACFactors(f.get_tensor(f"kfac_A/{k}"), f.get_tensor(f"kfac_G/{k}"), n)
                for k in layers if f"kfac_A/{k}" in keys}
    mean = {k: m.weight.detach().double() for k, m in layers.items()}
    return Posterior(mean, var, n, kfac or None, int(meta.get("n_data", 0)))


@task(cache_policy=CACHE, persist_result=True)
def table_task(name: str, model_file: str, model_digest: str, posterior_file: str,
               posterior_digest: str, raw: str, raw_digest: str, data, calibration, quant,
               seed: int, out: str, code: str, tag: str = ""):
    """BayesQ expected-loss table (LossTable, persisted by Prefect) plus its Parquet copy
    ``<out>/<posterior file stem>[_<tag>].parquet`` (with every entry's standard error)."""
    import pandas as pd

    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.models.zoo import get_entry
    from bayesq.quantize import build_table

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    post = load_posterior(model, Path(posterior_file))
    blocks = layer_blocks(quantizable_layers(model), quant.group_size, quant.unit_groups, quant.unit.value)
    batches = None
    if quant.needs_data:
        _, batches = calibration_batches(entry, entry.load_splits(data, Path(raw)), data, calibration, seed)
    start = time.perf_counter()
    table = build_table(post, blocks, quant, seed=seed, model=model, calibration=batches, progress=False)
    seconds = time.perf_counter() - start
    path = Path(out) / f"{Path(posterior_file).stem}{'_' + tag if tag else ''}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame.from_records(table.records()).to_parquet(path, index=False)
    return {"table": table, "seconds": seconds, "path": str(path)}


def config_tag(*configs) -> str:
    """Short hash naming an artifact by the settings that shape it."""
    import hashlib

    return hashlib.sha256("|".join(map(str, configs)).encode()).hexdigest()[:10]


@task(cache_policy=CACHE, persist_result=True)
def hawq_traces_task(name: str, model_file: str, model_digest: str, raw: str, raw_digest: str,
                     data, calibration, probes: int, seed: int, code: str) -> dict:
    """HAWQ's per-layer Hutchinson Hessian traces on the seed's calibration set (timed)."""
    from bayesq.baselines.hawq import hessian_traces
    from bayesq.models.zoo import get_entry

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    _, batches = calibration_batches(entry, entry.load_splits(data, Path(raw)), data, calibration, seed)
    start = time.perf_counter()
    traces = hessian_traces(model, batches, probes=probes, seed=seed)
    return {"traces": traces, "seconds": time.perf_counter() - start}


def _baseline(method: Method, model, entry, splits, data, calibration, quant, baselines, budget: float,
              seed: int, traces: dict | None):
    """Quantise with a baseline; returns its QuantizationResult."""
    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.aciq import aciq_quantize
    from bayesq.baselines.awq import awq_quantize
    from bayesq.baselines.gptq import gptq_quantize
    from bayesq.baselines.hawq import hawq_quantize
    from bayesq.baselines.rtn import rtn_quantize
    from bayesq.blocks import quantizable_layers

    if method in _RTN:
        return rtn_quantize(model, _RTN[method], budget, quant)
    if method == Method.ACIQ:
        return aciq_quantize(model, budget, quant)
    if method == Method.HAWQ:
        return hawq_quantize(model, traces, budget, quant)
    _, batches = calibration_batches(entry, splits, data, calibration, seed)
    stats = input_stats(model, batches, quantizable_layers(model))
    if method == Method.GPTQ:
        return gptq_quantize(model, stats, Granularity.GROUP, budget, quant,
                             act_order=baselines.gptq_act_order, damp=baselines.gptq_damp)
    return awq_quantize(model, stats, budget, quant, grid=baselines.awq_grid)


def _bayesq(model, table, budget: float, allocation_cfg, quant, posterior_file: str | None, seed: int):
    """BayesQ's allocation and encoding from a cached table: (weights, allocation)."""
    from bayesq.quantize import allocate, encode

    allocation = allocate(table, budget, allocation_cfg, seed)
    weights = {t.blocks.name: model.get_submodule(t.blocks.name).weight for t in table.layers}
    post = load_posterior(model, Path(posterior_file)) if posterior_file else None
    return encode(table, allocation, weights, posterior=post, rounding=quant.rounding), allocation, post


@task(cache_policy=(INPUTS - "table") + TASK_SOURCE, persist_result=True)
def quantize_eval_task(name: str, method: str, budget: float, seed: int, model_file: str,
                       model_digest: str, raw: str, raw_digest: str, data, quant, allocation_cfg,
                       table, table_key: str, posterior_file: str | None, code: str,
                       calibration=None, baselines=None, traces: dict | None = None,
                       distill=None, robustness=None, ood: bool = False) -> dict:
    """Quantise with one method at one budget and evaluate on the test split (and under shift).

    ``table`` / ``posterior_file`` (BayesQ rows), ``calibration`` (GPTQ, AWQ: their input
    statistics; distillation: its inputs), ``baselines`` (their settings), ``traces`` (HAWQ) and
    ``distill`` (``bayesq-distill``) are read only by the methods that need them;
    ``quantize_seconds`` times everything done here but evaluation. ``robustness`` sets the
    calibration metrics; ``ood`` adds the corrupted / other-domain evaluation.
    """
    from bayesq.config import RobustnessConfig
    from bayesq.models.zoo import get_entry
    from bayesq.quantize import quantized_copy
    from flows.robustness import evaluate_model

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    splits = entry.load_splits(data, Path(raw))
    start = time.perf_counter()
    extra = {}
    if Method(method) in (Method.BAYESQ, Method.BAYESQ_EF, Method.BAYESQ_DISTILL):
        qweights, allocation, post = _bayesq(model, table, budget, allocation_cfg, quant, posterior_file, seed)
        qmodel = quantized_copy(model, qweights)
        if Method(method) == Method.BAYESQ_DISTILL and distill.applies(budget):
            from bayesq.distill import apply_distilled, distill as run_distill

            _, batches = calibration_batches(entry, splits, data, calibration, seed)
            res = run_distill(model, qweights, post, batches, distill, scale_bits=quant.scale_bits,
                              lut_bits=quant.lut_bits, seed=seed)
            qmodel = apply_distilled(model, res)
            extra = {"distill_seconds": res.seconds, "distill_sample_scale": res.sample_scale,
                     "distill_teacher_agreement": res.teacher_agreement,
                     "distill_loss_first": res.loss_first, "distill_loss_last": res.loss_last}
    else:
        res = _baseline(Method(method), model, entry, splits, data, calibration, quant, baselines, budget,
                        seed, traces)
        qmodel, allocation = res.model, res.allocation
    seconds = time.perf_counter() - start
    ev = evaluate_model(entry, qmodel, splits, data, Path(raw), robustness or RobustnessConfig(), ood, seed)
    layer_bits = {}
    for layer, bits in allocation.unit_bits.items():
        layer_bits[layer] = sum(bits) / len(bits)
    return {
        "model": name, "method": method, "budget": budget, "seed": seed,
        "accuracy": ev["calibration"]["accuracy"], **ev,
        "avg_bits": allocation.average_bits, "total_bits": allocation.total_bits,
        "budget_bits": allocation.budget_bits, "n_weights": allocation.n_weights,
        "quantize_seconds": seconds, "layer_bits": layer_bits, **extra,
    }


def _kfac_prep(params, name, model_file, mdig, src, sdig, seed, out, code):
    """Posterior and table of the ``bayesq-ef`` row: K-FAC posterior, error-feedback rounding."""
    posterior = replace(params.posterior, curvature=Curvature.KFAC)
    quant = replace(params.quant, rounding=Rounding.ERROR_FEEDBACK)
    post = posterior_task(name, str(model_file), mdig, str(src), sdig, params.data, params.calibration,
                          posterior, seed, str(Path(out) / "posterior"), code, tag="kfac")
    tab = table_task(name, str(model_file), mdig, post["path"], digest(Path(post["path"])), str(src), sdig,
                     params.data, params.calibration, quant, seed, str(Path(out) / "tables"), code, tag="ef")
    return post, tab, f"{digest(Path(post['path']))}:{quant}:{params.calibration}", quant


@flow(name="bayesq-quantize")
def quantize_flow(params_path: Path, raw: Path, models: Path, out: Path) -> list[dict]:
    from bayesq.models.zoo import get_entry

    params = read_params(params_path)
    code = code_version()
    records = []
    with mlflow_parent("bayesq", f"quantize-{params.profile}", {"profile": params.profile}) as parent:
        for name in params.models:
            entry = get_entry(name)
            model_file = Path(models) / name / "model.safetensors"
            mdig, src = digest(model_file), raw_path(entry, raw)
            sdig = digest(src)
            rob = params.robustness
            fp = fp_eval_task(name, str(model_file), mdig, str(src), sdig, params.data, rob, params.seeds[0], code)
            records.append(fp)
            print(f"[quantize] {name} FP: acc {fp['accuracy']:.4f}, ECE {fp['calibration']['ece']:.4f}", flush=True)
            for seed in params.seeds:
                post = posterior_task(name, str(model_file), mdig, str(src), sdig, params.data,
                                      params.calibration, params.posterior, seed,
                                      str(Path(out) / "posterior"), code)
                tab = table_task(name, str(model_file), mdig, post["path"], digest(Path(post["path"])),
                                 str(src), sdig, params.data, params.calibration, params.quant, seed,
                                 str(Path(out) / "tables"), code)
                print(f"[quantize] {name} seed {seed}: posterior {post['seconds']:.1f}s, "
                      f"table {tab['seconds']:.1f}s", flush=True)
                key = f"{digest(Path(post['path']))}:{params.quant}:{params.calibration}"
                prep = {Method.BAYESQ: (post, tab, key, params.quant),
                        Method.BAYESQ_DISTILL: (post, tab, key, params.quant)}
                if Method.BAYESQ_EF in params.methods:
                    prep[Method.BAYESQ_EF] = _kfac_prep(params, name, model_file, mdig, src, sdig, seed, out, code)
                hawq = None
                if Method.HAWQ in params.methods:
                    hawq = hawq_traces_task(name, str(model_file), mdig, str(src), sdig, params.data,
                                            params.calibration, params.baselines.hawq_probes, seed, code)
                for budget in params.budgets:
                    for method in params.methods:
                        # baselines read no BayesQ posterior or table (and are not keyed on them)
                        p_post, p_tab, p_key, p_quant = prep.get(method, (None, None, "", params.quant))
                        r = quantize_eval_task(name, method.value, budget, seed, str(model_file), mdig,
                                               str(src), sdig, params.data, p_quant, params.allocation,
                                               p_tab and p_tab["table"], p_key, p_post and p_post["path"], code,
                                               calibration=params.calibration, baselines=params.baselines,
                                               traces=hawq["traces"] if method == Method.HAWQ else None,
                                               distill=params.distill, robustness=rob,
                                               ood=method in rob.methods and budget in rob.budgets)
                        r = {**r, "preprocess_seconds": r["quantize_seconds"]}
                        corruption = mean_corruption_error(r["ood"], fp["ood"])
                        if corruption:
                            r = {**r, "corruption": corruption}
                        if method in prep:
                            r = {**r, "posterior_seconds": p_post["seconds"], "table_seconds": p_tab["seconds"],
                                 "preprocess_seconds": p_post["seconds"] + p_tab["seconds"] + r["quantize_seconds"]}
                        elif method == Method.HAWQ:
                            r = {**r, "traces_seconds": hawq["seconds"],
                                 "preprocess_seconds": hawq["seconds"] + r["quantize_seconds"]}
                        print(f"[quantize] {name} {method.value:12s} budget {budget}: "
                              f"acc {r['accuracy']:.4f} at {r['avg_bits']:.4f} bits", flush=True)
                        metrics = {k: r[k] for k in ("accuracy", "avg_bits", "total_bits", "quantize_seconds",
                                                     "posterior_seconds", "table_seconds", "traces_seconds",
                                                     "preprocess_seconds", "distill_seconds",
                                                     "distill_sample_scale") if k in r}
                        metrics.update(tracked_metrics(r))
                        mlflow_child(parent.info.run_id, f"{name}/{method.value}/s{seed}/b{budget}",
                                     {"model": name, "method": method.value, "seed": seed, "budget": budget,
                                      "group_size": params.quant.group_size, "bits": str(params.quant.bits),
                                      "damping": params.posterior.damping},
                                     metrics, {"profile": params.profile, "code_version": code})
                        records.append(r)
    write_json(Path(out) / "results.json", records)
    return records


def main() -> None:
    p = parser("Quantise the fine-tuned models with BayesQ and the baselines")
    p.add_argument("--raw", type=Path, required=True)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    quantize_flow(a.params, a.raw, a.models, a.out)


if __name__ == "__main__":
    main()
