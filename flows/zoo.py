"""Zoo flow: recompress every model of a zoo file at each of its budgets, on Prefect's thread
pool or on a Dask cluster; served on a schedule by ``bayesq zoo serve --cron``.

    python -m flows zoo --zoo zoo.yaml --params params.yaml --out results-zoo [--dask [ADDRESS]]

A zoo file lists the models::

    models:
      - name: lite0-fmnist            # an entry of bayesq.harness.models.zoo (or one `loader` registers)
        loader: zoo                   # zoo | package.module:function (called once, registers the entry)
        dataset: data/raw/fashion-mnist   # the raw data the entry reads (default: its file under --raw)
        checkpoint: models/lite0-fmnist/model.safetensors   # default: <models>/<name>/model.safetensors
        budgets: [3.0, 3.5]
      - model: ./my-bert                # your own model (no loader): a Hugging Face folder,
        data: ./sst2.parquet            # torchvision:<arch> + checkpoint, or package.module:function;
        text_column: sentence           # data and column keys as `bayesq quantize --model ... --data ...`
        label_column: label             # (flows/byo.py: name, checkpoint, num_classes, tokenizer, split,
        budgets: [3.0]                  # text_column, image_column, label_column, max_length, image_size,
        methods: [bayesq, gptq]         # calibration, selection, test, budgets, methods, exclude)

Per model the flow submits a task graph to the task runner (Prefect's thread pool, or Dask
workers): the posterior, then one loss-table task per layer (the layers fan out across workers;
one task for the whole table when it reads calibration data), then one quantise-export-evaluate
task per budget (method ``bayesq-distill``: distilled up to ``distill.max_budget``). They call
the cached tasks of ``flows/prepare.py`` and ``flows/quantize.py``, so an unchanged model is all
cache hits, a new model or budget runs only its own tasks, and a model that fails is reported
while the others go on. One MLflow parent run per invocation, one child per model and budget,
tagged with the lineage (``flows/lineage.py``).
An entry with ``model:`` and ``data:`` (a user's model and data, :mod:`flows.byo`) runs one cached
task per method and budget (:func:`byo_task`: prepare, quantise, export with its skeleton, load back,
compare with FP on the test draw), its report next to its export.
Writes ``<out>/zoo_results.json`` (``records``: one per model and budget; ``failures``; for your
models ``paired``: BayesQ minus each other method, :func:`flows.byo.paired_rows`), for your models
``<out>/zoo.md`` (their table with the paired rows, :func:`flows.sources.sources_table`) and the
exports in ``<out>/exports/``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from bayesq.blocks import quantizable_layers
from bayesq.expected_loss import LossTable
from bayesq.harness.models.zoo import get_entry
from flows.byo import ByoModel, byo_from_mapping, paired_rows, submit_rows, track_child
from flows.common import code_version, digest, parser, read_params, write_json
from flows.finetune import load_model, raw_path
from flows.lineage import artifact_tags, export_lineage
from flows.prepare import checked_exclude, layer_table_task, posterior_task, prep_code, table_task
from flows.quantize import Row, Source, quantize_eval_task
from flows.sources import sources_table
from flows.tracking import (
    child_run_name, flow_run_namer, log_row_artifacts, mlflow_child, mlflow_parent, row_params, say,
)


@dataclass(frozen=True)
class ZooModel:
    """One model of a zoo file (paths relative to the working directory)."""

    name: str
    loader: str = "zoo"
    dataset: str = ""
    checkpoint: str = ""
    budgets: tuple[float, ...] = (3.0,)


def _bad(path, i: int, key: str, value, why: str) -> ValueError:
    return ValueError(f"{path}: models[{i}].{key} = {value!r}: {why}")


def read_zoo(path: Path) -> tuple[ZooModel | ByoModel, ...]:
    """Validated models of a zoo file (unknown keys, missing names, bad budgets or loaders and
    duplicate names raise ``ValueError`` naming the entry and the key). An entry with ``model:``
    is a user's model and data (:func:`flows.byo.byo_from_mapping`, no ``loader``)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if set(raw) - {"models"}:
        raise ValueError(f"{path}: unknown top-level key(s) {sorted(set(raw) - {'models'})}; expected 'models'")
    items = raw.get("models") or []
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: 'models' must be a non-empty list of models")
    out, seen = [], set()
    for i, item in enumerate(items):
        if isinstance(item, dict) and "model" in item:
            byo = byo_from_mapping(item, f"{path}: models[{i}]")
            if byo.name in seen:
                raise _bad(path, i, "name", byo.name, "listed twice (give each model its own 'name')")
            seen.add(byo.name)
            out.append(byo)
            continue
        if not isinstance(item, dict) or "name" not in item:
            raise ValueError(f"{path}: models[{i}] must be a mapping with at least a 'name' (an embedded model) "
                             "or 'model' and 'data' (your own)")
        unknown = set(item) - {f.name for f in fields(ZooModel)}
        if unknown:
            raise _bad(path, i, sorted(unknown)[0], item[sorted(unknown)[0]],
                       f"unknown key; valid keys: {sorted(f.name for f in fields(ZooModel))}")
        budgets = item.get("budgets", [3.0])
        if not isinstance(budgets, list) or not budgets or not all(isinstance(b, (int, float)) and b > 0
                                                                    for b in budgets):
            raise _bad(path, i, "budgets", budgets, "must be a non-empty list of positive bits per weight")
        loader = str(item.get("loader", "zoo"))
        if loader != "zoo" and ":" not in loader:
            raise _bad(path, i, "loader", loader, "use 'zoo' or 'package.module:function'")
        if item["name"] in seen:
            raise _bad(path, i, "name", item["name"], "listed twice")
        seen.add(item["name"])
        out.append(ZooModel(str(item["name"]), loader, str(item.get("dataset", "")), str(item.get("checkpoint", "")),
                            tuple(float(b) for b in budgets)))
    return tuple(out)


def resolve_entry(m: ZooModel):
    """The zoo entry of ``m`` (running its loader first when it has one)."""

    if m.loader != "zoo":
        module, _, attr = m.loader.partition(":")
        getattr(importlib.import_module(module), attr)()
    return get_entry(m.name)


def _inputs(m: ZooModel, models: str, raw: str) -> tuple[Path, Path]:
    """The checkpoint and dataset of ``m`` (clear errors when missing)."""

    entry = resolve_entry(m)
    ckpt = Path(m.checkpoint) if m.checkpoint else Path(models) / m.name / "model.safetensors"
    if not ckpt.is_file():
        raise FileNotFoundError(f"no checkpoint for '{m.name}' at {ckpt}: set its 'checkpoint' in the zoo file")
    src = Path(m.dataset) if m.dataset else raw_path(entry, Path(raw))
    if not src.exists():
        raise FileNotFoundError(f"no dataset for '{m.name}' at {src}: set its 'dataset' in the zoo file")
    return ckpt, src


def pin_threads(threads: int | None) -> None:
    """Set torch's intra-op threads in this process (None: leave them). The split of float
    reductions (a convolution's weight gradient during distillation) follows the thread count, so
    byte-identical exports from two runs need the same count; exports record it (``torch_threads``)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


# Tasks submitted to the task runner. Each first pins the thread count and runs the model's loader
# (a Dask worker is a fresh process that has not registered it), then calls the cached task of
# flows/prepare.py or flows/quantize.py, so their cache keys are the pipeline's.

@task(cache_policy=NO_CACHE, task_run_name="zoo posterior {m.name}")
def posterior(m: ZooModel, ckpt: str, mdig: str, src: str, sdig: str, params, out: str, threads: int | None) -> dict:

    pin_threads(threads)
    resolve_entry(m)
    return posterior_task(m.name, ckpt, mdig, src, sdig, params.data, params.calibration, params.posterior,
                          params.seeds[0], str(Path(out) / "posterior"), prep_code(), exclude=params.excluded(m.name))


@task(cache_policy=NO_CACHE, task_run_name="zoo table {m.name} {layer}")
def layer_table(m: ZooModel, ckpt: str, mdig: str, post: dict, layer: str, params, threads: int | None):

    pin_threads(threads)
    resolve_entry(m)
    return layer_table_task(m.name, ckpt, mdig, post["path"], post["sha256"], layer, params.quant, prep_code())


@task(cache_policy=NO_CACHE, task_run_name="zoo table {m.name}")
def whole_table(m: ZooModel, ckpt: str, mdig: str, src: str, sdig: str, post: dict, params, out: str,
                threads: int | None):

    pin_threads(threads)
    resolve_entry(m)
    return table_task(m.name, ckpt, mdig, post["path"], post["sha256"], src, sdig, params.data, params.calibration,
                      params.quant, params.seeds[0], str(Path(out) / "tables"), prep_code())["table"]


@task(cache_policy=NO_CACHE, task_run_name="zoo merge tables")
def merge_tables(parts: list):
    """The per-layer tables (network order) as one LossTable."""

    return LossTable(tuple(parts))


@task(cache_policy=NO_CACHE, task_run_name="zoo bayesq-distill {m.name} b{budget}")
def quantize_budget(m: ZooModel, ckpt: str, mdig: str, src: str, sdig: str, post: dict, table, params, out: str,
                    code: str, lineage: dict, threads: int | None, budget: float) -> dict:
    """BayesQ (distilled up to ``distill.max_budget``) at one budget: export, load back, evaluate."""

    pin_threads(threads)
    resolve_entry(m)
    key = f"{post['sha256']}:{params.quant}:{params.calibration}"
    row = Row(Source(m.name, ckpt, mdig, src, sdig), "bayesq-distill", budget, params.seeds[0], code, params.data,
              params.quant, params.allocation, str(Path(out) / "exports"), calibration=params.calibration,
              distill=params.distill, robustness=params.robustness, table_key=key, posterior_file=post["path"],
              exclude=params.excluded(m.name))
    r = quantize_eval_task(row, table, lineage=lineage)
    return {**{k: r[k] for k in ("model", "budget", "seed", "accuracy", "avg_bits", "total_bits",
                                 "quantize_seconds", "export", "layer_bits")},
            "posterior_seconds": post["seconds"], "posterior_sha256": post["sha256"], "model_digest": mdig}


def submit_byo(m: ByoModel, params, out: str, code: str, lineage: dict, threads: int | None = None) -> list:
    """Submit one task per method and budget of a user's model; raises at once when its model or
    data is missing or does not fit (checked before anything runs)."""

    return submit_rows(m, params, out, code, lineage, params.seeds[:1], threads)


def submit_model(m: ZooModel, params, raw: str, models: str, out: str, code: str, lineage: dict,
                 threads: int | None = None) -> list:
    """Submit one model's task graph: posterior -> one table task per layer (or one for the whole
    model when the table reads calibration data) -> merge -> one quantise task per budget.
    Returns the budgets' futures; raises at once when the model's inputs are missing or one of
    its ``exclude`` patterns (params.yaml) matches no layer."""

    ckpt, src = _inputs(m, models, raw)
    mdig, sdig = digest(ckpt), digest(src)
    args = (m, str(ckpt), mdig)
    exclude = params.excluded(m.name)  # params.yaml's exclude of an embedded model
    model = load_model(resolve_entry(m), ckpt) if exclude or not params.quant.needs_data else None
    if exclude:
        checked_exclude(m.name, model, exclude)
    post = posterior.submit(*args, str(src), sdig, params, out, threads)
    if params.quant.needs_data:
        table = whole_table.submit(*args, str(src), sdig, post, params, out, threads)
    else:
        layers = quantizable_layers(model, exclude)
        table = merge_tables.submit([layer_table.submit(*args, post, layer, params, threads) for layer in layers])
    return [quantize_budget.submit(*args, str(src), sdig, post, table, params, out, code, lineage, threads,
                                   budget=budget) for budget in m.budgets]


def task_runner(dask: str | None, workers: int = 2, threads: int | None = None):
    """Prefect's thread pool with ``workers`` threads (``dask`` None; 1: one task at a time), a Dask
    LocalCluster of ``workers`` processes (``dask`` = "local"; each starts with ``threads`` or
    cpu_count // workers intra-op threads), or the Dask scheduler at ``dask`` (e.g. tcp://10.0.0.5:8786)."""
    if workers < 1:
        raise ValueError(f"workers = {workers}: need at least 1")
    if threads is not None and threads < 1:
        raise ValueError(f"threads = {threads}: need at least 1 (or leave it unset)")
    if dask is None:
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=workers)
    import dask as dask_lib
    from prefect_dask import DaskTaskRunner

    if dask == "local":
        threads = threads or max(1, (os.cpu_count() or 1) // workers)  # set before the workers start
        dask_lib.config.set({f"distributed.nanny.pre-spawn-environ.{k}": threads
                             for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
        # Dask's default MALLOC_TRIM_THRESHOLD_=65536 turns off glibc's adaptive mmap threshold, so
        # every large torch buffer is mmapped and page-faulted afresh: a layer table took 2.4x as long.
        dask_lib.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None})
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True})
    return DaskTaskRunner(address=dask)


def zoo_flow_body(zoo: Path, params_path: Path, raw: Path, models: Path, out: Path, threads: int | None = None) -> dict:
    """Submit every model's tasks, gather records and failures, log them to MLflow (one parent
    run, one child per model and budget) and write ``zoo_results.json``. ``threads``: torch
    intra-op threads per task (None: the process's own setting; see :func:`pin_threads`)."""

    params = read_params(params_path)
    code, lineage = code_version(), export_lineage(params)
    futures, failures = {}, []
    for m in read_zoo(zoo):
        try:
            futures[m.name] = (submit_byo(m, params, str(out), code, lineage, threads) if isinstance(m, ByoModel)
                               else submit_model(m, params, str(raw), str(models), str(out), code, lineage, threads))
        except Exception as err:  # one failing model is reported; the others go on
            failures.append({"model": m.name, "error": f"{type(err).__name__}: {err}"})
    records = []
    with mlflow_parent("bayesq-zoo", f"zoo-{Path(zoo).stem}", params.profile, {"zoo": str(zoo)},
                       params_path) as parent:
        for name, futs in futures.items():
            try:
                rs = [f.result() for f in futs]
            except Exception as err:
                failures.append({"model": name, "error": f"{type(err).__name__}: {err}"})
                continue
            for r in rs:
                if "fidelity" in r:  # a user's model (flows.byo)
                    track_child(parent.info.run_id, r, params)
                    continue
                say(f"[zoo] {name} budget {r['budget']}: acc {r['accuracy']:.4f} at {r['avg_bits']:.4f} bits, "
                    f"{r['export']['file_bytes'] / 1e6:.2f} MB")
                mlflow_child(parent.info.run_id, child_run_name(name, "bayesq-distill", r["budget"], r["seed"]),
                             {"model": name, "method": "bayesq-distill", "budget": r["budget"], "seed": r["seed"],
                              **row_params(params, "bayesq-distill")},
                             {k: r[k] for k in ("accuracy", "avg_bits", "total_bits", "quantize_seconds")},
                             {"code_version": code, **artifact_tags(r["export"], model_digest=r["model_digest"],
                                                                    posterior_sha256=r["posterior_sha256"])},
                             seconds=r["quantize_seconds"], artifacts=lambda c, rid: log_row_artifacts(c, rid, r))
            records += rs
    for f in failures:
        say(f"[zoo] {f['model']}: FAILED: {f['error']}")
    result = {"records": records, "failures": failures}
    byo = [r for r in records if "fidelity" in r]
    if byo:  # your models: BayesQ minus each other method on the same test examples
        result["paired"] = paired_rows(byo)
        (Path(out) / "zoo.md").write_text(sources_table(byo, [], "Your models (zoo entries with model: and data:)"))
    write_json(Path(out) / "zoo_results.json", result)
    return result


def make_zoo_flow(dask: str | None = None, workers: int = 2, threads: int | None = None):
    """The zoo flow on the chosen task runner (see :func:`task_runner`)."""
    return flow(name="bayesq-zoo", flow_run_name=flow_run_namer("zoo"), task_runner=task_runner(dask, workers, threads))(zoo_flow_body)


def main() -> None:
    p = parser("Recompress every model of a zoo file at its budgets")
    p.add_argument("--zoo", type=Path, required=True)
    p.add_argument("--raw", type=Path, default=Path("data/raw"))
    p.add_argument("--models", type=Path, default=Path("models"))
    p.add_argument("--out", type=Path, default=Path("results-zoo"))
    p.add_argument("--dask", nargs="?", const="local", default=None,
                   help="run on Dask: a local cluster, or the scheduler address given")
    p.add_argument("--workers", type=int, default=2, help="threads (no --dask; 1 = serial) or Dask worker processes")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads per task")
    a = p.parse_args()
    make_zoo_flow(a.dask, a.workers, a.threads)(a.zoo, a.params, a.raw, a.models, a.out, a.threads)


if __name__ == "__main__":
    main()
