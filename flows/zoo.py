"""Zoo flow: recompress every model of a zoo file at each of its budgets, on Prefect's thread
pool or on a Dask cluster; served on a schedule by ``bayesq zoo serve --cron``.

    python -m flows.zoo --zoo zoo.yaml --params params.yaml --out results-zoo [--dask [ADDRESS]]

A zoo file lists the models::

    models:
      - name: lite0-fmnist            # an entry of bayesq.models.zoo (or one `loader` registers)
        loader: zoo                   # zoo | package.module:function (called once, registers the entry)
        dataset: data/raw/fashion-mnist   # the raw data the entry reads (default: its file under --raw)
        checkpoint: models/lite0-fmnist/model.safetensors   # default: <models>/<name>/model.safetensors
        budgets: [3.0, 3.5]

Per model one task (submitted to the task runner, so models run in parallel on Dask) that calls
the cached posterior and table tasks of ``flows/prepare.py`` and one cached quantise-export-
evaluate task per budget (``flows.quantize.quantize_eval_task``, method ``bayesq-distill``:
distilled up to ``distill.max_budget``). So an unchanged model is all cache hits, a new model or
budget runs only its own tasks, and a model that fails is reported while the others go on.
Writes ``<out>/zoo_results.json`` (``records``: one per model and budget; ``failures``) and the
exports in ``<out>/exports/``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from pathlib import Path

import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.common import code_version, digest, parser, read_params, write_json



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


def read_zoo(path: Path) -> tuple[ZooModel, ...]:
    """Validated models of a zoo file (unknown keys, missing names, bad budgets or loaders and
    duplicate names raise ``ValueError`` naming the entry and the key)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if set(raw) - {"models"}:
        raise ValueError(f"{path}: unknown top-level key(s) {sorted(set(raw) - {'models'})}; expected 'models'")
    items = raw.get("models") or []
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: 'models' must be a non-empty list of models")
    out, seen = [], set()
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "name" not in item:
            raise ValueError(f"{path}: models[{i}] must be a mapping with at least a 'name'")
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
    from bayesq.models.zoo import get_entry

    if m.loader != "zoo":
        module, _, attr = m.loader.partition(":")
        getattr(importlib.import_module(module), attr)()
    return get_entry(m.name)


@task(cache_policy=NO_CACHE)
def recompress_model(m: ZooModel, params, raw: str, models: str, out: str, code: str) -> list[dict]:
    """Posterior, table and every budget of one model (each a cached task, run here)."""
    from flows.finetune import raw_path
    from flows.prepare import posterior_task, table_task
    from flows.quantize import quantize_eval_task

    entry = resolve_entry(m)
    ckpt = Path(m.checkpoint) if m.checkpoint else Path(models) / m.name / "model.safetensors"
    if not ckpt.is_file():
        raise FileNotFoundError(f"no checkpoint for '{m.name}' at {ckpt}: set its 'checkpoint' in the zoo file")
    src = Path(m.dataset) if m.dataset else raw_path(entry, Path(raw))
    if not src.exists():
        raise FileNotFoundError(f"no dataset for '{m.name}' at {src}: set its 'dataset' in the zoo file")
    mdig, sdig, seed = digest(ckpt), digest(src), params.seeds[0]
    post = posterior_task(m.name, str(ckpt), mdig, str(src), sdig, params.data, params.calibration, params.posterior,
                          seed, str(Path(out) / "posterior"), code)
    tab = table_task(m.name, str(ckpt), mdig, post["path"], digest(Path(post["path"])), str(src), sdig, params.data,
                     params.calibration, params.quant, seed, str(Path(out) / "tables"), code)
    key = f"{digest(Path(post['path']))}:{params.quant}:{params.calibration}"
    records = []
    for budget in m.budgets:
        r = quantize_eval_task(m.name, "bayesq-distill", budget, seed, str(ckpt), mdig, str(src), sdig, params.data,
                               params.quant, params.allocation, tab["table"], key, post["path"], code,
                               calibration=params.calibration, distill=params.distill, robustness=params.robustness,
                               export_dir=str(Path(out) / "exports"))
        records.append({k: r[k] for k in ("model", "budget", "seed", "accuracy", "avg_bits", "total_bits",
                                          "quantize_seconds", "export")})
    return records


def task_runner(dask: str | None, workers: int = 2):
    """Prefect's default thread pool (``dask`` None), a Dask LocalCluster of ``workers`` processes
    (``dask`` = "local"), or the Dask scheduler at ``dask`` (e.g. tcp://10.0.0.5:8786)."""
    if dask is None:
        return None
    from prefect_dask import DaskTaskRunner

    if dask == "local":
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True})
    return DaskTaskRunner(address=dask)


def zoo_flow_body(zoo: Path, params_path: Path, raw: Path, models: Path, out: Path) -> dict:
    """Submit every model, gather records and failures, write ``zoo_results.json``."""
    params = read_params(params_path)
    code = code_version()
    futures = {m.name: recompress_model.submit(m, params, str(raw), str(models), str(out), code)
               for m in read_zoo(zoo)}
    records, failures = [], []
    for name, fut in futures.items():
        try:
            rs = fut.result()
        except Exception as err:  # one failing model is reported; the others go on
            failures.append({"model": name, "error": f"{type(err).__name__}: {err}"})
            print(f"[zoo] {name}: FAILED: {err}", flush=True)
            continue
        for r in rs:
            print(f"[zoo] {name} budget {r['budget']}: acc {r['accuracy']:.4f} at {r['avg_bits']:.4f} bits, "
                  f"{r['export']['file_bytes'] / 1e6:.2f} MB", flush=True)
        records += rs
    result = {"records": records, "failures": failures}
    write_json(Path(out) / "zoo_results.json", result)
    return result


def make_zoo_flow(dask: str | None = None, workers: int = 2):
    """The zoo flow on the chosen task runner (see :func:`task_runner`)."""
    runner = task_runner(dask, workers)
    kwargs = {"task_runner": runner} if runner is not None else {}
    return flow(name="bayesq-zoo", **kwargs)(zoo_flow_body)


def main() -> None:
    p = parser("Recompress every model of a zoo file at its budgets")
    p.add_argument("--zoo", type=Path, required=True)
    p.add_argument("--raw", type=Path, default=Path("data/raw"))
    p.add_argument("--models", type=Path, default=Path("models"))
    p.add_argument("--out", type=Path, default=Path("results-zoo"))
    p.add_argument("--dask", nargs="?", const="local", default=None,
                   help="run on Dask: a local cluster, or the scheduler address given")
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    make_zoo_flow(a.dask, a.workers)(a.zoo, a.params, a.raw, a.models, a.out)


if __name__ == "__main__":
    main()
