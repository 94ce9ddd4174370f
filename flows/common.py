"""Shared I/O helpers of the flows: params, digests, code version, MLflow runs, JSON."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml
from prefect.cache_policies import INPUTS, TASK_SOURCE

from bayesq.config import Params, load_params
from flows import ROOT

CACHE = INPUTS + TASK_SOURCE  # plus an explicit `code` input: TASK_SOURCE sees only the wrapper


def read_params(path: Path) -> Params:
    """Validated params with the selected profile applied."""
    with open(path) as f:
        return load_params(yaml.safe_load(f) or {})


def digest(path: Path) -> str:
    """sha256 of a file, or of every file under a directory (sorted), as hex."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() else [Path(path)]
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def code_version(*paths: str, exclude: tuple[str, ...] = ()) -> str:
    """Hash of the sources a task runs (files or folders relative to the repository root,
    default ``bayesq`` and ``flows``), leaving out ``exclude`` (files or folders).

    Part of every cache key, because Prefect's TASK_SOURCE sees only the task wrapper.
    """
    h = hashlib.sha256()
    files = []
    for rel in paths or ("bayesq", "flows"):
        p = ROOT / rel
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    skip = [ROOT / e for e in exclude]
    for p in files:
        if any(p == e or e in p.parents for e in skip):
            continue
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    return p


@contextmanager
def mlflow_parent(experiment: str, run_name: str, tags: dict[str, str]) -> Iterator[Any]:
    """One parent MLflow run per flow invocation (tracking URI from MLFLOW_TRACKING_URI)."""
    import mlflow

    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name, tags={"git_commit": git_commit(), **tags}) as run:
        yield run


def mlflow_child(parent_id: str, name: str, params: dict, metrics: dict, tags: dict[str, str]) -> None:
    """A child run under ``parent_id`` (explicit: Prefect tasks run in other threads)."""
    import mlflow

    client = mlflow.tracking.MlflowClient()
    parent = client.get_run(parent_id)
    run = client.create_run(
        parent.info.experiment_id, run_name=name,
        tags={"mlflow.parentRunId": parent_id, "git_commit": git_commit(), **tags},
    )
    for k, v in params.items():
        client.log_param(run.info.run_id, k, v)
    for k, v in metrics.items():
        client.log_metric(run.info.run_id, k, float(v))
    client.set_terminated(run.info.run_id)
