"""Lineage helpers: dvc.lock stage hashes, git state, export input metadata."""

import hashlib
import subprocess
from pathlib import Path

import torch
import yaml

from flows.lineage import dvc_lock_tags, git_commit, git_dirty, input_lineage, run_tags

LOCK = {"schema": "2.0", "stages": {
    "finetune": {"cmd": "python -m flows.finetune", "outs": [{"path": "models", "md5": "abc.dir", "size": 3}]},
    "quantize": {"cmd": "python -m flows.quantize", "deps": [{"path": "models", "md5": "abc.dir"}],
                 "outs": [{"path": "results", "md5": "def.dir"}]}}}


def test_dvc_lock_tags_stage_hashes_and_out_md5(tmp_path):
    lock = tmp_path / "dvc.lock"
    lock.write_text(yaml.safe_dump(LOCK))
    tags = dvc_lock_tags(lock)
    assert tags["dvc.finetune.out.models"] == "abc.dir" and tags["dvc.quantize.out.results"] == "def.dir"
    assert len(tags["dvc.finetune"]) == 16 and tags["dvc.finetune"] != tags["dvc.quantize"]
    changed = {**LOCK, "stages": {**LOCK["stages"], "quantize": {**LOCK["stages"]["quantize"], "cmd": "other"}}}
    lock.write_text(yaml.safe_dump(changed))
    again = dvc_lock_tags(lock)
    assert again["dvc.quantize"] != tags["dvc.quantize"] and again["dvc.finetune"] == tags["dvc.finetune"]
    assert dvc_lock_tags(tmp_path / "missing.lock") == {}


def test_run_tags_params_digest_and_git_state(tmp_path, monkeypatch):
    import flows.lineage as lineage
    from flows.common import digest

    p = tmp_path / "params.yaml"
    p.write_text("seeds: [1]\n")
    for dirty in (True, False):
        monkeypatch.setattr(lineage, "git_commit", lambda root=None: "c0ffee")
        monkeypatch.setattr(lineage, "git_dirty", lambda root=None, d=dirty: d)
        tags = run_tags(p)
        assert tags["params_sha256"] == digest(p) and tags["git_commit"] == "c0ffee"
        assert tags["git_dirty"] == str(dirty).lower()
    assert "params_sha256" not in run_tags(tmp_path / "missing.yaml")


def test_git_commit_and_dirty_in_a_repository(tmp_path):
    assert git_commit(tmp_path) == "unknown" and git_dirty(tmp_path) is False  # not a checkout
    run = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    (tmp_path / "dvc.lock").write_text("schema: '2.0'")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "main_table.md").write_text("| a |")
    run("add", "f.txt", "dvc.lock", "reports/main_table.md")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_commit(tmp_path) == head and git_dirty(tmp_path) is False
    (tmp_path / "untracked.txt").write_text("x")
    assert git_dirty(tmp_path) is False  # untracked files are not the code that ran
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages: {}")
    (tmp_path / "reports" / "main_table.md").write_text("| b |")
    assert git_dirty(tmp_path) is False  # what `dvc repro` itself rewrites mid-run is not the code
    (tmp_path / "f.txt").write_text("b")
    assert git_dirty(tmp_path) is True


def test_input_lineage_hashes_files_and_marks_data_free(tmp_path, one_thread):
    ckpt, post = tmp_path / "m.safetensors", tmp_path / "p.safetensors"
    ckpt.write_bytes(b"weights")
    post.write_bytes(b"posterior")
    meta = input_lineage(str(ckpt), str(tmp_path), "d1g", str(post), torch.tensor([5, 2, 9]))
    assert meta["checkpoint_sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert meta["posterior_sha256"] == hashlib.sha256(b"posterior").hexdigest()
    assert meta["calibration_indices"] == "5,2,9" and meta["dataset_digest"] == "d1g"
    assert meta["torch_threads"] == "1"
    free = input_lineage(str(ckpt), str(tmp_path), "d1g", None, None)
    assert free["posterior"].startswith("none") and free["calibration_indices"].startswith("none")
    assert "posterior_sha256" not in free
