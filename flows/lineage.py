"""Lineage: what produced an artifact — git commit, DVC stage hashes, params, input digests.

Three places carry it:

* every MLflow parent run: :func:`run_tags` (commit, dirty flag, params.yaml sha256, the
  ``dvc.lock`` hash of each stage and the md5 DVC recorded for each stage output — the key
  ``dvc pull`` fetches that exact artifact by);
* every MLflow child run: :func:`artifact_tags` (sha256 of the export file, its content hash,
  the posterior, checkpoint and dataset digests);
* every export's header (``user`` metadata): :func:`export_lineage` (the params sections that
  shape a quantised model, the posterior file and its digest, the calibration indices, commit),
  printed by ``bayesq lineage FILE``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from bayesq.tensorfile import file_sha256
from flows import ROOT
from flows.common import digest

# params sections that shape a quantised model (stored in every export)
EXPORT_SECTIONS = ("data", "calibration", "posterior", "quant", "allocation", "distill", "baselines")
# tracked files a pipeline run writes: DVC's lock file and the committed reports
PIPELINE_WRITES = ("dvc.lock", "reports")


def git_commit(root: Path = ROOT) -> str:
    """HEAD's commit, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def git_dirty(root: Path = ROOT) -> bool:
    """Whether tracked files differ from HEAD (the commit alone does not describe the code).

    Files the pipeline itself rewrites (:data:`PIPELINE_WRITES`) do not count: ``dvc repro``
    updates ``dvc.lock`` after each stage, before the next stage records its lineage."""
    excludes = [f":(exclude){path}" for path in PIPELINE_WRITES]
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *excludes],
                             cwd=root, capture_output=True, text=True, check=True)
        return bool(out.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def _short(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def dvc_lock_tags(lock: Path = ROOT / "dvc.lock") -> dict[str, str]:
    """``dvc.<stage>``: hash of the stage's lock entry (command, deps, params, outs);
    ``dvc.<stage>.out.<path>``: the md5 DVC stored for that output. Empty without a lock file."""
    if not Path(lock).is_file():
        return {}
    stages = (yaml.safe_load(Path(lock).read_text()) or {}).get("stages", {})
    tags = {}
    for name, entry in sorted(stages.items()):
        tags[f"dvc.{name}"] = _short(entry)
        for out in entry.get("outs", []):
            if "md5" in out:
                tags[f"dvc.{name}.out.{out['path']}"] = out["md5"]
    return tags


def run_tags(params_path: Path | None = None) -> dict[str, str]:
    """Tags of one flow invocation (MLflow parent run)."""

    tags = {"git_commit": git_commit(), "git_dirty": str(git_dirty()).lower(), **dvc_lock_tags()}
    if params_path is not None and Path(params_path).is_file():
        tags["params_sha256"] = digest(Path(params_path))
    return tags


def params_json(params) -> str:
    """The :data:`EXPORT_SECTIONS` of validated ``Params`` as canonical JSON."""
    def plain(section):
        return section.as_mapping() if hasattr(section, "as_mapping") else asdict(section)

    return json.dumps({s: plain(getattr(params, s)) for s in EXPORT_SECTIONS}, sort_keys=True, default=str)


def _rel(path: str | Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def export_lineage(params, commit: str | None = None) -> dict[str, str]:
    """Export metadata every row of one invocation shares: params and commit."""
    commit = commit or git_commit()
    return {"params": params_json(params), "git_commit": commit + ("-dirty" if git_dirty() else "")}


def row_metadata(model: str, method: str, budget: float, seed: int, code: str, shared: dict[str, str],
                 inputs: dict[str, str], **extra: str) -> dict[str, str]:
    """The header metadata of one export: what it is (``model``, ``method``, ``budget``, ``seed``),
    the code version, the invocation's ``shared`` lineage (:func:`export_lineage`), the row's
    ``inputs`` (:func:`input_lineage`) and ``extra`` entries; every value a string. The one
    place the pipeline's rows and ``bayesq quantize`` build it."""
    return {"model": model, "method": method, "budget": str(budget), "seed": str(seed), "code_version": code,
            **shared, **inputs, **extra}


def input_lineage(model_file: str, raw: str, raw_digest: str, posterior_file: str | None,
                  calibration_indices) -> dict[str, str]:
    """Export metadata of one row's inputs: checkpoint and posterior as paths with the sha256 of
    their bytes (``sha256sum`` checks them), the dataset with its :func:`flows.common.digest`, and
    the calibration inputs as indices into the training split (None: a data-free method), and the
    process's torch intra-op threads (float reductions, hence the bytes, follow their number)."""
    import torch


    meta = {"checkpoint": _rel(model_file), "checkpoint_sha256": file_sha256(model_file), "dataset": _rel(raw),
            "dataset_digest": raw_digest, "posterior": "none (this method fits no posterior)",
            "calibration_indices": "none (data-free method)", "torch_threads": str(torch.get_num_threads())}
    if posterior_file:
        meta["posterior"] = _rel(posterior_file)
        meta["posterior_sha256"] = file_sha256(posterior_file)
    if calibration_indices is not None:
        meta["calibration_indices"] = ",".join(map(str, calibration_indices.tolist()))
    return meta


def artifact_tags(export: dict, **digests: str) -> dict[str, str]:
    """MLflow child-run tags: the export file's path and digests, plus the input ``digests``
    (e.g. ``model_sha256``, ``posterior_sha256``)."""
    tags = {"export_path": _rel(export["path"]), "export_sha256": export["sha256"],
            "export_content_sha256": export["content_sha256"]}
    return {**tags, **{k: v for k, v in digests.items() if v}}
