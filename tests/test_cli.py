"""The ``bayesq`` command line: help on every command, one model quantised and exported without
DVC, its lineage printed back, clear errors."""

import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from bayesq.harness.models.zoo import register, unregister
from flows.cli import _serve, app
from tests.test_flows import TinyEntry, _params

runner = CliRunner()
COMMANDS = ["run", "quantize", "eval", "report", "lineage", "ui"]


@pytest.mark.parametrize("command", COMMANDS)
def test_cli_help_on_every_command(command):
    res = runner.invoke(app, [command, "--help"])
    assert res.exit_code == 0 and "Usage" in res.output


def test_cli_help_lists_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and all(c in res.output for c in COMMANDS)


@pytest.fixture
def tiny_models(tmp_path):
    from safetensors.torch import save_model

    register(TinyEntry(), replace=True)
    folder = tmp_path / "models" / "tiny-cnn"
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    save_model(TinyEntry().build(), str(folder / "model.safetensors"))
    (tmp_path / "tiny.bin").write_bytes(b"synthetic")  # the (synthetic) dataset file lineage hashes
    yield tmp_path
    unregister("tiny-cnn")


def test_cli_quantize_writes_export_and_lineage_reads_it(tiny_models, one_thread):
    from bayesq.export import load

    params, out = _params(tiny_models), tiny_models / "tiny.safetensors"
    res = runner.invoke(app, ["quantize", "tiny-cnn", "--budget", "4.0", "--out", str(out), "--params", str(params),
                              "--models", str(tiny_models / "models"), "--raw", str(tiny_models)])
    assert res.exit_code == 0, res.output
    assert "bits/weight accounted" in res.output and "over all weight matrices (0 kept in floating point)" in res.output
    assert out.is_file()
    assert "bias correction:" in res.output and "layers' mean outputs restored" in res.output
    model = load(out)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    res = runner.invoke(app, ["lineage", str(out), "--check"])
    assert res.exit_code == 0, res.output
    for key in ("model", "tiny-cnn", "bayesq", "budget", "4.0", "seed", "17", "checkpoint_sha256", "git_commit",
                "calibration_indices", "64 training inputs", "params.quant.bits", "[2, 3, 4, 8]", "code_version",
                "dataset_digest", "posterior", "fitted in this run"):
        assert key in res.output, key
    assert "checkpoint" in res.output and ": ok" in res.output
    avg = {k: line.split()[-1] for line in res.output.splitlines() for k in ("quantised weights", "all weight matrices")
           if k in line}
    assert float(avg["quantised weights"]) <= 4.0
    assert avg["all weight matrices"] == avg["quantised weights"]  # every matrix of the tiny CNN is quantised
    ckpt = tiny_models / "models" / "tiny-cnn" / "model.safetensors"
    ckpt.write_bytes(ckpt.read_bytes() + b" ")  # the checkpoint changed after the export
    res = runner.invoke(app, ["lineage", str(out), "--check"])
    assert res.exit_code == 1 and "MISMATCH" in res.output


def test_cli_quantize_distils_only_when_asked(tiny_models, one_thread):
    from bayesq.export import read_export

    params, out = _params(tiny_models), tiny_models / "tiny3.safetensors"
    common = ["--budget", "3.0", "--out", str(out), "--params", str(params), "--models", str(tiny_models / "models"),
              "--raw", str(tiny_models)]
    res = runner.invoke(app, ["quantize", "tiny-cnn", *common])
    assert res.exit_code == 0, res.output
    assert read_export(out).user["method"] == "bayesq"  # the default: the pipeline's bayesq row
    res = runner.invoke(app, ["quantize", "tiny-cnn", *common, "--distill"])
    assert res.exit_code == 0, res.output
    assert read_export(out).user["method"] == "bayesq-distill"


def test_cli_quantize_errors_are_clear(tiny_models):
    params = _params(tiny_models)
    common = ["--params", str(params), "--raw", str(tiny_models), "--out", str(tiny_models / "x.safetensors")]
    res = runner.invoke(app, ["quantize", "tiny-cnn", "--models", str(tiny_models / "none"), *common])
    assert res.exit_code == 1 and "no fine-tuned model" in res.output and "bayesq run" in res.output
    res = runner.invoke(app, ["quantize", "no-such-model", *common])
    assert res.exit_code == 1 and "no-such-model" in res.output
    res = runner.invoke(app, ["quantize", "tiny-cnn", "--budget", "1.0", "--models", str(tiny_models / "models"),
                              *common])
    assert res.exit_code == 1 and "infeasible" in res.output
    assert not (tiny_models / "x.safetensors").exists()


def test_cli_quantize_too_little_memory_is_clear(tiny_models, monkeypatch):
    """The memory estimate's error is the command's message (no traceback), nothing written."""
    from bayesq import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1024)
    params = _params(tiny_models)
    res = runner.invoke(app, ["quantize", "tiny-cnn", "--params", str(params), "--raw", str(tiny_models),
                              "--models", str(tiny_models / "models"), "--out", str(tiny_models / "x.safetensors")])
    assert res.exit_code == 1 and "BayesQ needs about" in res.output and "check_memory=False" in res.output
    assert "Traceback" not in res.output and not (tiny_models / "x.safetensors").exists()


def test_cli_lineage_and_report_errors_are_clear(tmp_path):
    res = runner.invoke(app, ["lineage", str(tmp_path / "absent.safetensors")])
    assert res.exit_code == 1 and "no export at" in res.output
    res = runner.invoke(app, ["report", "--results", str(tmp_path / "results.json")])
    assert res.exit_code == 1 and "bayesq run" in res.output
    res = runner.invoke(app, ["run", "--profile", "huge"])
    assert res.exit_code == 1 and "quick or full" in res.output


def test_cli_zoo_help():
    for args in (["zoo", "--help"], ["zoo", "run", "--help"], ["zoo", "serve", "--help"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "Usage" in res.output


def test_zoo_deployment_schedule_and_errors(tmp_path):
    from flows.cli import zoo_deployment

    zoo = tmp_path / "zoo.yaml"
    zoo.write_text("models:\n  - name: lite0-fmnist\n    budgets: [3.0]\n")
    dep = zoo_deployment(zoo, "0 3 * * 0", tmp_path / "p.yaml", tmp_path, tmp_path, tmp_path / "out", None)
    assert dep.name == "bayesq-zoo" and dep.schedules[0].schedule.cron == "0 3 * * 0"
    assert dep.parameters["zoo"] == str(zoo.resolve())
    with pytest.raises(ValueError, match="not a cron expression"):
        zoo_deployment(zoo, "every sunday", tmp_path / "p.yaml", tmp_path, tmp_path, tmp_path / "out", None)
    res = runner.invoke(app, ["zoo", "serve", "--zoo", str(tmp_path / "absent.yaml")])
    assert res.exit_code == 1 and "absent.yaml" in res.output


def _sleeper(seconds: float = 60.0) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


@pytest.fixture
def started(monkeypatch):
    """The processes ``_serve`` starts, in order; any still running are killed after the test."""
    procs, real_popen = [], subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: procs.append(real_popen(*a, **k)) or procs[-1])
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serve_one_server_exits_stops_the_others_and_fails(started):
    with pytest.raises(typer.Exit) as err:
        _serve({"long": (_sleeper(), {}), "dies": ([sys.executable, "-c", "raise SystemExit(3)"], {})})
    assert err.value.exit_code == 1
    assert [p.returncode for p in started][1] == 3
    assert started[0].returncode is not None  # the long-running one was stopped, not left behind


def test_serve_ctrl_c_stops_every_server(started, monkeypatch):
    real_sleep, calls = time.sleep, []

    def interrupt_once(seconds):  # the first wait in _serve's loop is "Ctrl-C"; Popen.wait sleeps too
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", interrupt_once)
    _serve({"a": (_sleeper(), {}), "b": (_sleeper(), {"EXTRA": "1"})})  # returns normally: Ctrl-C is a clean stop
    assert len(started) == 2 and all(p.returncode is not None for p in started)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_json(url: str, body: dict | None = None, deadline: float = 0.0):
    """GET (or POST ``body``) ``url`` as JSON, retrying until ``deadline`` while the server starts."""
    import json
    import urllib.request

    while True:
        try:
            data = None if body is None else json.dumps(body).encode()
            req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                return json.loads(resp.read())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@contextmanager
def _ui(tmp_path: Path):
    """``bayesq ui`` on two free ports with the stores under ``tmp_path``: yields (environment of
    those stores, printed MLflow URL, MLflow base URL, Prefect port); Ctrl-C (SIGINT) after."""
    import os
    import re
    import signal

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
           "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    ml_port, pf_port = _free_port(), _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--mlflow-port", str(ml_port),
                             "--prefect-port", str(pf_port)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        printed = "".join(proc.stdout.readline() for _ in range(3))
        assert f"http://127.0.0.1:{pf_port}/runs" in printed
        yield env, re.search(r"MLflow runs\s+(\S+)", printed).group(1), f"http://127.0.0.1:{ml_port}", pf_port
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the command stops both servers
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.ui
def test_cli_ui_on_other_ports_serves_advertised_urls(tmp_path):
    """``bayesq ui`` on two non-default ports: the printed MLflow URL opens the runs table of the
    ``bayesq`` experiment, and the Prefect UI's settings point at its own port's API."""
    import mlflow

    exp_id = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").create_experiment("bayesq")
    with _ui(tmp_path) as (env, ml_url, _, pf_port):
        assert ml_url.endswith(f"/#/experiments/{exp_id}?workflowType=machine_learning")
        deadline = time.monotonic() + 180
        settings = _get_json(f"http://127.0.0.1:{pf_port}/ui-settings", deadline=deadline)
        assert settings["api_url"] == f"http://127.0.0.1:{pf_port}/api" and settings["default_ui"] == "v1"
        assert _get_json(settings["api_url"] + "/flow_runs/filter", {"limit": 5}, deadline) == []
        found = _get_json(ml_url.split("#")[0] + "api/2.0/mlflow/experiments/search?max_results=10",
                          deadline=deadline)
        assert exp_id in [e["experiment_id"] for e in found["experiments"] if e["name"] == "bayesq"]


TINY_PIPELINE = """
import sys
from pathlib import Path

import yaml

from tests.test_flows import _params, register_tiny
from flows.finetune import finetune_flow
from flows.quantize import quantize_flow
from flows.report import report

register_tiny()
tmp = Path(sys.argv[1])
params = _params(tmp)
cfg = yaml.safe_load(params.read_text())
cfg.update(methods=["bayesq", "gptq", "rtn-group"], budgets=[3.0])
params.write_text(yaml.safe_dump(cfg))
(tmp / "raw").mkdir()
(tmp / "raw" / "tiny.bin").write_bytes(b"synthetic")
finetune_flow(params, tmp / "raw", tmp / "models")
quantize_flow(params, tmp / "raw", tmp / "models", tmp / "results")
report(tmp / "results" / "results.json", tmp / "models", tmp / "reports")
"""


def _browse(chromium: str, url: str, shot: Path) -> str:
    """The DOM of ``url`` after its scripts ran (headless Chromium, 20 s of virtual time), and a
    screenshot of it at ``shot``."""
    args = [chromium, "--no-sandbox", "--disable-gpu", "--window-size=2400,1400", "--virtual-time-budget=20000"]
    subprocess.run([*args, f"--screenshot={shot}", url], capture_output=True, timeout=120, check=True)
    return subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.ui
def test_ui_walkthrough_in_headless_chromium(tmp_path):
    """What a person sees after the tiny pipeline ran against ``bayesq ui``'s servers: the MLflow
    runs table the printed link opens lists the child runs with accuracy and bits columns; a child
    run's page lists its artifacts; the Prefect flow run shows its named tasks and our log lines.
    Screenshots: ``$BAYESQ_UI_SHOTS`` (default: the test's temporary folder)."""
    import os
    import shutil

    import mlflow

    chromium = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    if chromium is None:
        pytest.skip("no headless Chromium: apt-get install chromium-headless-shell")
    shots = Path(os.environ.get("BAYESQ_UI_SHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent
    with _ui(tmp_path) as (env, _, ml_base, pf_port):
        api = f"http://127.0.0.1:{pf_port}/api"
        _get_json(api + "/health", deadline=time.monotonic() + 180)
        run = subprocess.run([sys.executable, "-c", TINY_PIPELINE, str(tmp_path)], cwd=root, timeout=900,
                             env={**env, "PREFECT_API_URL": api, "OMP_NUM_THREADS": "1"}, capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        from flows.cli import mlflow_runs_url

        table = _browse(chromium, mlflow_runs_url(ml_base, env["MLFLOW_TRACKING_URI"]), shots / "mlflow_runs.png")
        for name in ("tiny-cnn/bayesq/b3.0/s17", "tiny-cnn/gptq/b3.0/s17", "tiny-cnn/rtn-group/b3.0/s17"):
            assert name in table, name
        assert 'col-id="metrics.`accuracy`"' in table and 'col-id="metrics.`avg_bits`"' in table

        client = mlflow.tracking.MlflowClient(env["MLFLOW_TRACKING_URI"])
        exp = client.get_experiment_by_name("bayesq")
        child = next(r for r in client.search_runs([exp.experiment_id])
                     if r.info.run_name == "tiny-cnn/bayesq/b3.0/s17")
        page = _browse(chromium, f"{ml_base}/#/experiments/{exp.experiment_id}/runs/{child.info.run_id}/artifacts",
                       shots / "mlflow_child_artifacts.png")
        assert "layer_bits.json" in page and ">export<" in page

        flow_id = child.data.tags.get("prefect_flow_run_id") or client.get_run(
            child.data.tags["mlflow.parentRunId"]).data.tags["prefect_flow_run_id"]
        logs = _browse(chromium, f"http://127.0.0.1:{pf_port}/runs/flow-run/{flow_id}", shots / "prefect_logs.png")
        assert "[quantize] tiny-cnn bayesq" in logs and "[task] posterior tiny-cnn s17" in logs
        tasks = _browse(chromium, f"http://127.0.0.1:{pf_port}/runs/flow-run/{flow_id}?tab=Task+Runs",
                        shots / "prefect_tasks.png")
        assert "bayesq tiny-cnn b3.0 s17" in tasks and "posterior tiny-cnn s17" in tasks


@pytest.mark.parametrize("method", ["gptq", "rtn-channel", "bayesq-ef", "bayesq-brecq"])
def test_cli_quantize_a_baseline_or_bayesq_row_through_the_registry(tiny_models, one_thread, method):
    from bayesq.export import load, read_export

    params, out = _params(tiny_models), tiny_models / f"{method}.safetensors"
    res = runner.invoke(app, ["quantize", "tiny-cnn", "--method", method, "--budget", "4.0", "--out", str(out),
                              "--params", str(params), "--models", str(tiny_models / "models"), "--raw",
                              str(tiny_models)])
    assert res.exit_code == 0, res.output
    user = read_export(out).user
    assert user["method"] == method
    assert ("fitted in this run" in user.get("posterior", "")) == method.startswith("bayesq")
    assert ("(kfac;" in user.get("posterior", "")) == (method == "bayesq-ef")
    assert ("variant kept:" in res.output) == (method == "gptq")
    assert load(out)(torch.zeros(2, 1, 8, 8)).shape == (2, 4)
    res = runner.invoke(app, ["quantize", "tiny-cnn", "--method", "nope", "--out", str(out), "--params", str(params)])
    assert res.exit_code == 1 and "--method nope: choose one of bayesq, " in res.output and "gptq" in res.output
    res = runner.invoke(app, ["quantize", "tiny-cnn", "--method", method, "--distill", "--out", str(out)])
    assert res.exit_code == 1 and "--distill applies to --method bayesq" in res.output  # not silently ignored
