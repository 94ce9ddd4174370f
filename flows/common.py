"""Shared I/O helpers of the flows: params, digests, code version, the MLflow store lock, JSON
(how runs look in MLflow and Prefect: :mod:`flows.tracking`)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from prefect.cache_policies import INPUTS, TASK_SOURCE

from flows import ROOT
from flows.locks import locked as with_locks
from flows.params import read_params  # noqa: F401 - the flows' way in (defined where the params are)


def locked(policy):
    """``policy`` with serialisable isolation: the run computing a cache key holds a lock file on
    it (:mod:`flows.locks`; stale when its process died), so a concurrent run sharing the result
    store waits and then reads the result instead of computing it again or reading half of it."""

    return with_locks(policy, Path(os.environ.get("PREFECT_LOCAL_STORAGE_PATH", ROOT / ".prefect" / "results")) / "locks")


CACHE = locked(INPUTS + TASK_SOURCE)  # plus an explicit `code` input: TASK_SOURCE sees only the wrapper


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


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as sorted, indented JSON, atomically (temporary file + rename), so a concurrent
    reader or writer never sees half a file."""
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".partial")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    return p


@contextmanager
def mlflow_store_lock() -> Iterator[None]:
    """Inter-process lock on a SQLite MLflow store (``<db>.lock``; no-op for other stores): two
    processes opening a new store at once both run its schema migration, and both may create the
    same experiment."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith("sqlite:///"):
        yield
        return
    from filelock import FileLock

    with FileLock(uri.removeprefix("sqlite:///") + ".lock", timeout=600):
        yield
