"""Sharing artifacts through a DVC remote (a local folder here; S3 / SSH in docs/operations.md): a stage's
export is pushed, deleted with the cache, pulled back byte for byte, and the md5 the lineage tags
record (``dvc.<stage>.out.<path>``) names the object in the remote."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from bayesq.export import read_export, save_export
from bayesq.tensorfile import file_sha256
from flows.lineage import dvc_lock_tags

DVC = str(Path(sys.executable).parent / "dvc")


def _dvc(repo: Path, *args: str) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    res = subprocess.run([DVC, *args], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"dvc {' '.join(args)}:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _export(path: Path) -> None:
    from bayesq.config import BayesQConfig, DistillConfig
    from bayesq.quantize import quantize_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    cal = [torch.randn(16, 16, generator=torch.Generator().manual_seed(1)) for _ in range(2)]
    cfg = BayesQConfig(budget=4.0, distill=DistillConfig(max_budget=0.0))
    res = quantize_model(model, cal, cfg, progress=False)
    save_export(path, res.model, res.weights, cfg.quant, res.allocation.total_bits, metadata={"model": "mlp"})


def test_dvc_push_pull_local_remote_round_trip(tmp_path):
    repo, remote = tmp_path / "repo", tmp_path / "remote"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(repo, "init", "-q")
    _dvc(repo, "remote", "add", "-d", "team", str(remote))
    _export(repo / "staged.safetensors")
    (repo / "dvc.yaml").write_text(
        "stages:\n  quantize:\n    cmd: mkdir -p results && cp staged.safetensors results/mlp.safetensors\n"
        "    deps: [staged.safetensors]\n    outs: [results]\n")
    _dvc(repo, "repro", "-q")
    export = repo / "results" / "mlp.safetensors"
    digest = file_sha256(export)
    _dvc(repo, "push", "-q")
    md5 = dvc_lock_tags(repo / "dvc.lock")["dvc.quantize.out.results"]
    assert md5.endswith(".dir")
    assert list(remote.rglob(md5.removesuffix(".dir")[2:] + ".dir"))  # the tagged md5 is in the remote

    shutil.rmtree(repo / "results")  # a teammate's fresh clone: no outputs, no cache
    shutil.rmtree(repo / ".dvc" / "cache")
    assert "not in cache" in _dvc(repo, "status")
    _dvc(repo, "pull", "-q")
    assert file_sha256(export) == digest
    assert read_export(export).user == {"model": "mlp"}  # verifies the content hash too
    assert "up to date" in _dvc(repo, "status")
