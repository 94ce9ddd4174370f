"""What the tracking UIs show: MLflow run names, parameters and artifacts; Prefect run names, tags and logs.

One place decides how a run looks to a person browsing MLflow or Prefect:

* **MLflow parent run** (one per flow invocation): named ``<stage>-<profile>-<commit7>-<UTC time>``
  (e.g. ``quantize-default-f95379d-20261126-1031``), tagged with its lineage
  (:func:`flows.lineage.run_tags`) and the Prefect flow run's id and name; the Prefect flow run is
  tagged ``mlflow:<run id>`` back.
* **MLflow child run** (one per row): named ``model/method/b<budget>/s<seed>``; its parameters
  are the row's whole effective configuration, flattened to dotted keys (``quant.bits``,
  ``posterior.prior``, ...; :func:`row_params`); its start and end times span the row's real
  one-time cost plus its evaluation, so the runs table's Duration column means something.
* **Artifacts** go to a folder beside the tracking store (:func:`artifact_root`: ``mlartifacts/<experiment>``
  next to ``mlflow.db``), set when the experiment is created. A row's export (the deploy stage's
  ONNX files too) is logged when it is
  at most :data:`EXPORT_ARTIFACT_MAX_BYTES`; a larger one (MiniLM's are ~50 MB each, ~1.5 GB a run)
  is logged as ``export_ref.json``: its path, sha256 and the content-addressed path DVC keeps it
  under (``.dvc/cache/files/md5/..``), so the bytes are stored once.
* **Runs table**: each experiment stores a shared view (:func:`runs_view`: flat, by run name, the
  model / method / budget parameters and the accuracy, bits, KL and time metrics as columns);
  :func:`runs_table_url` links to it (``bayesq ui`` prints it).
* **Prefect**: flow runs are named by :func:`flow_run_namer` (stage, profile, commit); tasks carry
  ``task_run_name`` templates (model, method, budget, seed). :func:`say` prints a progress line
  and sends it to the current flow or task run's log, which the Prefect UI shows (``flows.settings``
  lets INFO through to the API and keeps the console at WARNING, so nothing is printed twice).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator

from flows import ROOT
from flows.common import mlflow_store_lock, read_json, read_params, write_json
from flows.lineage import _rel, git_commit, run_tags
from flows.methods import BAYESQ_ROWS, CALIBRATED_METHODS, Method

EXPORT_ARTIFACT_MAX_BYTES = 8 * 2**20


def say(message: str) -> None:
    """Print ``message`` and log it at INFO to the active Prefect flow or task run (if any)."""
    print(message, flush=True)
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(message)
    except MissingContextError:
        pass


def artifact_root(tracking_uri: str | None = None) -> Path:
    """The artifact folder of a tracking store: ``mlartifacts/`` beside a SQLite file store
    (``sqlite:///dir/mlflow.db`` -> ``dir/mlartifacts``), else beside the repository."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts"
    return ROOT / "mlartifacts"


# The runs table a person should see first: a shared view stored on the experiment (MLflow UI's
# "viewStateShareKey"), flat (sorted by run name, so children are not folded under their parent
# and one row's runs across invocations sit together, newest first), with these columns.
VIEW_KEY = "bayesq"
_METRICS = ("accuracy", "avg_bits", "kl_mean", "agreement", "preprocess_seconds", "eval_seconds")
VIEW_COLUMNS = {
    "bayesq": (("params", ("model", "method", "budget", "seed", "variant", "encoding")), ("metrics", _METRICS)),
    "bayesq-ablations": (("params", ("model", "group", "row", "budget")), ("metrics", _METRICS)),
    "bayesq-zoo": (("params", ("model", "budget")), ("metrics", ("accuracy", "avg_bits", "quantize_seconds"))),
}


def runs_view(experiment: str) -> str:
    """JSON of the shared runs-table view of ``experiment`` (:data:`VIEW_COLUMNS`)."""
    columns = [f"{kind}.`{key}`" for kind, keys in VIEW_COLUMNS.get(experiment, ()) for key in keys]
    return json.dumps({"selectedColumns": columns, "orderByKey": "tags.`mlflow.runName`", "orderByAsc": True,
                       "runsHiddenMode": "SHOW_ALL"})


def runs_table_url(base: str, experiment) -> str:
    """The MLflow UI link to ``experiment``'s runs table (an ``mlflow.entities.Experiment``): its
    shared view when it has one, else the plain table (the experiment's own page opens on the GenAI
    traces tab)."""
    if f"mlflow.sharedViewState.{VIEW_KEY}" in experiment.tags:
        return f"{base}/#/experiments/{experiment.experiment_id}/runs?viewStateShareKey={VIEW_KEY}" \
               "&workflowType=machine_learning"
    return f"{base}/#/experiments/{experiment.experiment_id}?workflowType=machine_learning"


def use_experiment(name: str) -> str:
    """Make ``name`` the active MLflow experiment, creating it with its artifacts under
    :func:`artifact_root` ``/<name>``, and (re)store its runs-table view (:func:`runs_view`);
    returns its id."""
    import mlflow


    with mlflow_store_lock():  # creating the store's schema or the experiment races between processes
        found = mlflow.get_experiment_by_name(name)
        if found is None:
            root = artifact_root() / name
            root.mkdir(parents=True, exist_ok=True)
            mlflow.create_experiment(name, artifact_location=root.as_uri())
        exp_id = mlflow.set_experiment(name).experiment_id
        mlflow.tracking.MlflowClient().set_experiment_tag(exp_id, f"mlflow.sharedViewState.{VIEW_KEY}", runs_view(name))
        return exp_id


def parent_run_name(stage: str, profile: str, commit: str, when: datetime | None = None) -> str:
    """``<stage>-<profile>-<commit7>-<YYYYmmdd-HHMM UTC>``."""
    when = when or datetime.now(timezone.utc)
    return f"{stage}-{profile}-{commit[:7]}-{when:%Y%m%d-%H%M}"


def child_run_name(model: str, method: str, budget: float, seed: int) -> str:
    """``model/method/b<budget>/s<seed>``, e.g. ``lite0-fmnist/bayesq/b3.0/s17``."""
    return f"{model}/{method}/b{float(budget)}/s{seed}"


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Dotted ``key -> str`` of a (nested) frozen config dataclass or dict: enums by value,
    sequences and dicts as JSON."""
    items = ({f.name: getattr(obj, f.name) for f in fields(obj)} if is_dataclass(obj) else dict(obj))
    out = {}
    for key, value in items.items():
        name = f"{prefix}{key}"
        if is_dataclass(value):
            out |= flatten(value, f"{name}.")
        elif isinstance(value, Enum):
            out[name] = str(value.value)
        elif isinstance(value, (list, tuple, dict)):
            out[name] = json.dumps(value, default=lambda v: v.value if isinstance(v, Enum) else str(v))
        else:
            out[name] = str(value)
    return out


def row_params(params, method, posterior=None, quant=None) -> dict[str, str]:
    """A row's effective configuration, flattened: the sections it reads, with the method's own
    ``posterior`` / ``quant`` settings where they differ from params.yaml's (``bayesq-ef``,
    ``bayesq-paper``, ablation rows)."""

    method = Method(method)
    sections = {"data": params.data, "quant": quant or params.quant}
    if method in BAYESQ_ROWS:
        sections |= {"posterior": posterior or params.posterior, "allocation": params.allocation,
                     "calibration": params.calibration}
    if method == Method.BAYESQ_DISTILL:
        sections["distill"] = params.distill
    if method in (*CALIBRATED_METHODS, Method.HAWQ, Method.BAYESQ_BRECQ):
        sections["calibration"] = params.calibration
    out = flatten(sections)
    own = Method.BRECQ if method == Method.BAYESQ_BRECQ else method  # bayesq-brecq: the brecq row's schedule
    if own not in BAYESQ_ROWS:  # a baseline's own config (its class's fields; quant is the section above)
        config = params.baselines.config(own)
        out |= {k: v for k, v in flatten(config, f"{own.value}.").items()
                if not k.startswith(f"{own.value}.quant.") and k not in (f"{own.value}.progress", f"{own.value}.seed")}
    return out


def _prefect_flow_run() -> tuple[str, str]:
    """(id, name) of the active Prefect flow run, or ("", "")."""
    from prefect.runtime import flow_run

    return (str(flow_run.id or ""), str(flow_run.name or ""))


def _tag_flow_run(flow_run_id: str, tags: list[str]) -> None:
    """Add ``tags`` to a Prefect flow run (kept: the ones it has)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        client.update_flow_run(flow_run_id, tags=sorted(set(run.tags) | set(tags)))


@contextmanager
def mlflow_parent(experiment: str, stage: str, profile: str, tags: dict[str, str],
                  params_path: Path | None = None) -> Iterator[Any]:
    """One parent MLflow run per flow invocation (tracking URI from MLFLOW_TRACKING_URI), named
    by :func:`parent_run_name`, tagged with its lineage (:func:`flows.lineage.run_tags`) and the
    Prefect flow run; the flow run is tagged ``mlflow:<run id>``."""
    import mlflow


    use_experiment(experiment)
    lineage = run_tags(params_path)
    flow_id, flow_name = _prefect_flow_run()
    prefect = {"prefect_flow_run_id": flow_id, "prefect_flow_run_name": flow_name} if flow_id else {}
    name = parent_run_name(stage, profile, lineage["git_commit"])
    with mlflow.start_run(run_name=name, tags={**lineage, **prefect, "profile": profile, **tags}) as run:
        if flow_id:
            _tag_flow_run(flow_id, [f"mlflow:{run.info.run_id}", f"profile:{profile}"])
        say(f"[{stage}] MLflow run {name} ({run.info.run_id})")
        yield run


def _log_params(client, run_id: str, params: dict[str, Any]) -> None:
    from mlflow.entities import Param

    items = [Param(k, str(v)) for k, v in sorted(params.items())]
    for i in range(0, len(items), 100):  # the REST API's batch limit
        client.log_batch(run_id, params=items[i:i + 100])


def mlflow_child(parent_id: str, name: str, params: dict, metrics: dict, tags: dict[str, str],
                 seconds: float = 0.0, artifacts: Callable[[Any, str], None] | None = None) -> str:
    """A finished child run under ``parent_id`` (explicit: Prefect tasks run in other threads);
    it spans the last ``seconds`` (the row's real cost, not the time to log it);
    ``artifacts(client, run_id)`` logs its files. Returns its run id."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.tracking.MlflowClient()
    parent = client.get_run(parent_id)
    end = int(time.time() * 1000)
    run = client.create_run(
        parent.info.experiment_id, run_name=name, start_time=end - int(1000 * seconds),
        tags={"mlflow.parentRunId": parent_id, "git_commit": parent.data.tags.get("git_commit", ""), **tags},
    )
    run_id = run.info.run_id
    _log_params(client, run_id, params)
    client.log_batch(run_id, metrics=[Metric(k, float(v), end, 0) for k, v in sorted(metrics.items())])
    if artifacts is not None:
        artifacts(client, run_id)
    client.set_terminated(run_id, end_time=end)
    return run_id


def dvc_cache_path(md5: str) -> str:
    """Where DVC 3 keeps a file of this md5 (relative to the repository): ``.dvc/cache/files/md5/ab/cdef…``."""
    return f".dvc/cache/files/md5/{md5[:2]}/{md5[2:]}"


def log_row_artifacts(client, run_id: str, record: dict) -> None:
    """A row's files on its MLflow run: ``layer_bits.json`` (layer -> average bits), and the export
    (:func:`log_export`)."""
    client.log_dict(run_id, record.get("layer_bits", {}), "layer_bits.json")
    log_export(client, run_id, Path(record["export"]["path"]), record["export"]["sha256"])


def log_export(client, run_id: str, path: Path, sha256: str | None = None) -> None:
    """The export file at ``path`` on run ``run_id``: itself (under ``export/``) when at most
    :data:`EXPORT_ARTIFACT_MAX_BYTES`, else ``export_ref.json`` (path, bytes, sha256, md5 and
    :func:`dvc_cache_path`: DVC stores the bytes once)."""
    import hashlib

    if path.stat().st_size <= EXPORT_ARTIFACT_MAX_BYTES:
        client.log_artifact(run_id, str(path), "export")
        return
    data = path.read_bytes()
    md5 = hashlib.md5(data).hexdigest()
    client.log_dict(run_id, {"path": _rel(path), "bytes": len(data), "sha256": sha256 or hashlib.sha256(data).hexdigest(),
                             "md5": md5, "dvc_cache": dvc_cache_path(md5),
                             "why": f"over {EXPORT_ARTIFACT_MAX_BYTES} bytes: DVC stores the bytes once, "
                                    "`dvc pull` restores them"}, "export_ref.json")


def log_files(run_id: str, files: list[Path], folder: str) -> None:
    """Log existing ``files`` on run ``run_id`` under ``folder`` (missing ones are skipped)."""
    import mlflow

    client = mlflow.tracking.MlflowClient()
    for f in files:
        if Path(f).is_file():
            client.log_artifact(run_id, str(f), folder)


def flow_run_namer(stage: str) -> Callable[[], str]:
    """A Prefect ``flow_run_name`` callable: ``<stage>-<profile>-<commit7>`` from the flow's
    ``params_path`` parameter (``<stage>-<commit7>`` without one)."""

    def name() -> str:
        from prefect.runtime import flow_run


        path = (flow_run.parameters or {}).get("params_path")
        profile = f"-{read_params(Path(path)).profile}" if path and Path(path).is_file() else ""
        return f"{stage}{profile}-{git_commit()[:7]}"

    return name


def write_run_file(out: Path, run) -> None:
    """``<out>/mlflow_run.json``: the parent run that wrote ``out`` (the report stage logs its
    files there, :func:`log_reports`)."""

    write_json(Path(out) / "mlflow_run.json", {"run_id": run.info.run_id, "run_name": run.info.run_name,
                                               "experiment_id": run.info.experiment_id})


def log_reports(run_file: Path, files: list[Path], folder: str = "reports") -> str | None:
    """Log the report ``files`` on the parent MLflow run that produced the results, named by
    ``run_file`` (``mlflow_run.json``, written by the quantize / ablate flow next to its results).
    Returns that run's id, or None (said why) when the file or the run is not in this store."""
    import mlflow
    from mlflow.exceptions import MlflowException


    if not Path(run_file).is_file():
        say(f"[report] no {run_file}: reports not logged to MLflow")
        return None
    run_id = read_json(run_file)["run_id"]
    try:
        mlflow.tracking.MlflowClient().get_run(run_id)
    except MlflowException:
        say(f"[report] MLflow run {run_id} ({run_file}) is not in this tracking store: reports not logged")
        return None
    log_files(run_id, files, folder)
    say(f"[report] logged {len(files)} report files on MLflow run {run_id}")
    return run_id
