"""flows.tracking: run names, flattened configurations, artifacts and the DVC cache path."""

import json
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from bayesq.config import Curvature, Rounding
from flows.configs import method_settings
from flows.methods import Method
from flows.params import load_params
from flows.tracking import artifact_root, child_run_name, dvc_cache_path, flatten, parent_run_name, row_params


def test_run_names_say_stage_profile_commit_time_and_row():
    when = datetime(2026, 11, 26, 10, 31, tzinfo=timezone.utc)
    assert parent_run_name("quantize", "quick", "f95379d0123", when) == "quantize-quick-f95379d-20261126-1031"
    assert child_run_name("lite0-fmnist", "bayesq", 3, 17) == "lite0-fmnist/bayesq/b3.0/s17"


def test_flatten_dotted_keys_enums_by_value_sequences_as_json():
    params = load_params({})
    flat = flatten({"quant": params.quant, "posterior": params.posterior})
    assert flat["quant.bits"] == "[" + ", ".join(str(b) for b in params.quant.bits) + "]"
    assert flat["posterior.curvature"] == params.posterior.curvature.value
    assert all(isinstance(v, str) for v in flat.values())
    assert len(flat) == len(flatten(params.quant)) + len(flatten(params.posterior))


def test_row_params_are_each_methods_effective_configuration():
    params = load_params({})
    ef = row_params(params, Method.BAYESQ_EF, *method_settings(params, Method.BAYESQ_EF))
    assert ef["posterior.curvature"] == Curvature.KFAC.value and ef["quant.rounding"] == Rounding.ERROR_FEEDBACK.value
    plain = row_params(params, Method.BAYESQ, *method_settings(params, Method.BAYESQ))
    assert plain["posterior.curvature"] == params.posterior.curvature.value
    paper = row_params(params, Method.BAYESQ_PAPER, *method_settings(params, Method.BAYESQ_PAPER))
    assert (paper["posterior.prior"], paper["quant.objective"]) == ("fixed", "draws")
    gptq = row_params(params, Method.GPTQ)
    assert gptq["gptq.group_sizes"] == "[32, 64, 128, 256]" and gptq["gptq.damp"] == "0.01"
    assert not any(k.startswith(("posterior.", "gptq.quant.")) for k in gptq)
    assert row_params(params, Method.BAYESQ_BRECQ)["brecq.iters"] == "20000"  # the brecq row's schedule
    assert any(k.startswith("distill.") for k in row_params(params, Method.BAYESQ_DISTILL))
    assert not any(k.startswith(("calibration.", "distill.")) for k in row_params(params, Method.RTN_GROUP))


def test_artifact_root_sits_beside_a_sqlite_store(tmp_path):
    assert artifact_root(f"sqlite:///{tmp_path / 'mlflow.db'}") == tmp_path.resolve() / "mlartifacts"


def test_dvc_cache_path_vs_dvc_add(tmp_path):
    """The content-addressed path an export reference names is where `dvc add` puts the file."""
    import hashlib

    dvc = Path(sys.executable).parent / "dvc"
    f = tmp_path / "x.bin"
    f.write_bytes(b"bayesq export bytes")
    subprocess.run([str(dvc), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    subprocess.run([str(dvc), "add", "-q", "x.bin"], cwd=tmp_path, check=True)
    md5 = hashlib.md5(f.read_bytes()).hexdigest()
    assert (tmp_path / dvc_cache_path(md5)).read_bytes() == b"bayesq export bytes"


def test_mlflow_child_logs_params_metrics_artifacts_and_spans_its_cost(tmp_path, monkeypatch):
    import mlflow

    import flows.tracking as tracking

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    small, big = tmp_path / "small.safetensors", tmp_path / "big.safetensors"
    small.write_bytes(b"s" * 10)
    big.write_bytes(b"b" * 100)
    monkeypatch.setattr(tracking, "EXPORT_ARTIFACT_MAX_BYTES", 50)
    tracking.use_experiment("t")
    params = {f"p{i}": i for i in range(150)}  # more than one REST batch
    with mlflow.start_run(run_name="parent") as parent:
        ids = [tracking.mlflow_child(parent.info.run_id, name, params, {"accuracy": 0.5}, {},
                                     seconds=42.0, artifacts=lambda c, rid, f=f: tracking.log_row_artifacts(
                                         c, rid, {"layer_bits": {"a": 3.0}, "export": {"path": str(f),
                                                                                       "sha256": "00"}}))
               for name, f in (("small", small), ("big", big))]
    client = mlflow.tracking.MlflowClient()
    for run_id in ids:
        run = client.get_run(run_id)
        assert len(run.data.params) == 150 and run.data.metrics == {"accuracy": 0.5}
        assert run.info.end_time - run.info.start_time == 42_000
        assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path / "mlartifacts")
    small_files = {a.path for a in client.list_artifacts(ids[0])} | {a.path for a in client.list_artifacts(ids[0], "export")}
    assert {"layer_bits.json", "export/small.safetensors"} <= small_files
    assert {a.path for a in client.list_artifacts(ids[1])} == {"layer_bits.json", "export_ref.json"}
    ref = json.loads(Path(client.download_artifacts(ids[1], "export_ref.json", str(tmp_path))).read_text())
    assert ref["bytes"] == 100 and re.fullmatch(r"\.dvc/cache/files/md5/[0-9a-f]{2}/[0-9a-f]{30}", ref["dvc_cache"])


def test_log_reports_without_run_file_or_unknown_run_logs_nothing(tmp_path, monkeypatch, capsys):
    from flows.tracking import log_reports

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert log_reports(tmp_path / "mlflow_run.json", []) is None
    (tmp_path / "mlflow_run.json").write_text('{"run_id": "0123456789abcdef"}')
    assert log_reports(tmp_path / "mlflow_run.json", []) is None
    assert "not in this tracking store" in capsys.readouterr().out


def test_flow_run_namer_outside_a_run_names_stage_and_commit():
    from flows.lineage import git_commit
    from flows.tracking import flow_run_namer

    assert flow_run_namer("quantize")() == f"quantize-{git_commit()[:7]}"


def test_use_experiment_stores_the_runs_view_the_printed_link_opens(tmp_path, monkeypatch):
    import mlflow

    from flows.cli import mlflow_runs_url
    from flows.tracking import VIEW_KEY, use_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    exp_id = use_experiment("bayesq")
    exp = mlflow.tracking.MlflowClient().get_experiment(exp_id)
    view = json.loads(exp.tags[f"mlflow.sharedViewState.{VIEW_KEY}"])
    assert {"metrics.`accuracy`", "metrics.`avg_bits`", "params.`method`"} <= set(view["selectedColumns"])
    assert exp.artifact_location == (tmp_path / "mlartifacts" / "bayesq").resolve().as_uri()
    assert mlflow_runs_url("http://h:1", uri) == (f"http://h:1/#/experiments/{exp_id}/runs?"
                                                 f"viewStateShareKey={VIEW_KEY}&workflowType=machine_learning")
