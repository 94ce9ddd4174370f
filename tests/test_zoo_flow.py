"""Zoo flow: zoo-file validation, per-model fan-out with cache hits, a failing model reported
without stopping the others, and the same results on a 2-worker Dask cluster as serially."""

from pathlib import Path

import pytest
import torch
import yaml

from bayesq.export import read_export
from flows.zoo import ZooModel, make_zoo_flow, read_zoo, task_runner
from tests.test_flows import TinyEntry, TinyEntryB, _params, register_tiny

LOADER = "tests.test_flows:register_tiny"


def _zoo(tmp_path: Path, models: list[dict]) -> Path:
    path = tmp_path / "zoo.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return path


def test_read_zoo_defaults_and_values(tmp_path):
    zoo = _zoo(tmp_path, [{"name": "a"}, {"name": "b", "loader": "pkg.mod:fn", "budgets": [3, 3.5],
                                          "dataset": "d", "checkpoint": "c.safetensors"}])
    assert read_zoo(zoo) == (ZooModel("a"), ZooModel("b", "pkg.mod:fn", "d", "c.safetensors", (3.0, 3.5)))


@pytest.mark.parametrize("models, message", [
    ([{"name": "a", "budget": [3.0]}], r"models\[0\].budget = \[3.0\]: unknown key"),
    ([{"name": "a", "budgets": [0]}], r"models\[0\].budgets = \[0\]: must be a non-empty list"),
    ([{"name": "a", "loader": "module_without_function"}], r"models\[0\].loader .* 'package.module:function'"),
    ([{"name": "a"}, {"name": "a"}], r"models\[1\].name = 'a': listed twice"),
    ([{"budgets": [3.0]}], r"models\[0\] must be a mapping with at least a 'name'"),
    ([], "non-empty list"),
])
def test_read_zoo_errors_name_entry_and_key(tmp_path, models, message):
    with pytest.raises(ValueError, match=message):
        read_zoo(_zoo(tmp_path, models))


@pytest.fixture
def zoo_setup(tmp_path):
    from safetensors.torch import save_model

    register_tiny()
    for entry in (TinyEntry(), TinyEntryB()):
        folder = tmp_path / "models" / entry.name
        folder.mkdir(parents=True)
        save_model(entry.build(), str(folder / "model.safetensors"))
    (tmp_path / "tiny.bin").write_bytes(b"synthetic")
    yield tmp_path
    from bayesq.harness.models.zoo import unregister

    unregister("tiny-cnn")
    unregister("tiny-cnn-b")


def _run(tmp, zoo, out, dask=None, threads=None):
    return make_zoo_flow(dask, threads=threads)(zoo, _params(tmp), tmp, tmp / "models", tmp / out, threads)


def _key(records):
    return sorted((r["model"], r["budget"], r["accuracy"], r["avg_bits"], r["export"]["payload_bits"])
                  for r in records)


def test_zoo_flow_caches_adds_and_isolates_failures(zoo_setup, prefect_harness, one_thread):
    tmp = zoo_setup
    one = _zoo(tmp, [{"name": "tiny-cnn", "loader": LOADER, "budgets": [4.0]},
                     {"name": "tiny-cnn-b", "loader": LOADER, "checkpoint": str(tmp / "missing.safetensors")}])
    first = _run(tmp, one, "zoo")
    assert [r["model"] for r in first["records"]] == ["tiny-cnn"]
    assert first["failures"][0]["model"] == "tiny-cnn-b" and "missing.safetensors" in first["failures"][0]["error"]
    assert Path(first["records"][0]["export"]["path"]).is_file()
    two = _zoo(tmp, [{"name": "tiny-cnn", "loader": LOADER, "budgets": [4.0]},
                     {"name": "tiny-cnn-b", "loader": LOADER, "budgets": [4.0, 6.0]}])
    second = _run(tmp, two, "zoo")
    assert not second["failures"] and len(second["records"]) == 3
    old = next(r for r in second["records"] if r["model"] == "tiny-cnn")
    assert old == first["records"][0]  # a cache hit: the same record, wall times included
    again = _run(tmp, two, "zoo")
    assert again == second


def test_task_runner_local_dask_workers_threads_and_allocator(monkeypatch):
    """Local Dask workers start with the requested intra-op threads and without Dask's
    MALLOC_TRIM_THRESHOLD_ (it made a ResNet layer table 2.4x slower)."""
    import copy
    import os

    import dask
    from distributed import Client, LocalCluster

    monkeypatch.setattr(dask.config, "config", copy.deepcopy(dask.config.config))  # restored afterwards
    for var in ("OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_"):  # the OS value would win over the config
        monkeypatch.delenv(var, raising=False)
    task_runner("local", workers=2, threads=3)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        env = client.submit(lambda: {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")},
                            pure=False).result()
    assert env == {"OMP_NUM_THREADS": "3", "MALLOC_TRIM_THRESHOLD_": None}
    with pytest.raises(ValueError, match="threads = 0"):
        task_runner(None, workers=1, threads=0)


def test_zoo_flow_dask_two_workers_matches_serial_byte_for_byte(zoo_setup, prefect_harness, monkeypatch):
    """The serial run, then the same zoo recomputed (cache refreshed) on a 2-worker Dask cluster
    into the same folder, both with one torch thread per task: the same records and byte-identical
    export files, which record that thread count."""
    from prefect.settings import PREFECT_TASKS_REFRESH_CACHE, temporary_settings

    tmp = zoo_setup
    zoo = _zoo(tmp, [{"name": "tiny-cnn", "loader": LOADER, "budgets": [4.0]},
                     {"name": "tiny-cnn-b", "loader": LOADER, "budgets": [3.0, 4.0]}])
    serial = _run(tmp, zoo, "zoo", threads=1)
    files = {r["export"]["path"]: (Path(r["export"]["path"]).read_bytes(), Path(r["export"]["path"]).stat().st_mtime_ns)
             for r in serial["records"]}
    monkeypatch.setenv("PREFECT_TASKS_REFRESH_CACHE", "true")  # the Dask workers' processes
    with temporary_settings({PREFECT_TASKS_REFRESH_CACHE: True}):
        dask = _run(tmp, zoo, "zoo", dask="local", threads=1)
    assert not serial["failures"] and not dask["failures"] and len(dask["records"]) == 3
    assert _key(dask["records"]) == _key(serial["records"])
    for r in dask["records"]:
        data, written = files[r["export"]["path"]]
        path = Path(r["export"]["path"])
        assert path.stat().st_mtime_ns != written  # recomputed and rewritten by a worker
        assert path.read_bytes() == data
        assert read_export(path).user["torch_threads"] == "1"
        assert r["export"]["sha256"] == next(s for s in serial["records"] if s["export"]["path"] == str(path))[
            "export"]["sha256"]


def test_zoo_flow_killed_and_restarted_redoes_no_finished_task(zoo_setup, prefect_harness):
    """Kill the flow process while one model's posterior task stalls (holding its cache-key lock);
    the restart reuses the finished model's tasks (its export is not rewritten), takes over the
    dead run's lock and completes the other model."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tmp = zoo_setup
    zoo = _zoo(tmp, [{"name": "tiny-cnn", "loader": LOADER, "budgets": [4.0]},
                     {"name": "tiny-cnn-b", "loader": "tests.test_flows:register_tiny_stalling", "budgets": [4.0]}])
    cmd = [sys.executable, "-m", "flows.zoo", "--zoo", str(zoo), "--params", str(_params(tmp)), "--raw", str(tmp),
           "--models", str(tmp / "models"), "--out", str(tmp / "zoo")]
    marker, export = tmp / "stalled", tmp / "zoo" / "exports" / "tiny-cnn_bayesq-distill_b4.0_s17.safetensors"
    root = Path(__file__).resolve().parent.parent
    log = tmp / "first_run.log"
    # the flow prints "[zoo] tiny-cnn budget ..." once tiny-cnn's task futures resolved, i.e. after its
    # results were persisted: the signal that the first model is finished while the second stalls
    finished = lambda: marker.exists() and "[zoo] tiny-cnn budget" in log.read_text()  # noqa: E731
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "BAYESQ_TEST_STALL": str(marker)},
                                stdout=out, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not finished() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)  # polling, with a deadline
        assert finished() and export.exists(), "the first run did not reach the stalled model"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (tmp / "zoo" / "zoo_results.json").exists()  # killed before the end
    locks = Path(os.environ["PREFECT_LOCAL_STORAGE_PATH"]) / "locks"
    assert list(locks.glob("*.lock")), "the killed run left no lock behind"
    written = export.stat().st_mtime_ns
    done = subprocess.run(cmd, cwd=root, env={k: v for k, v in os.environ.items() if k != "BAYESQ_TEST_STALL"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert export.stat().st_mtime_ns == written  # the finished model was a cache hit
    import json

    result = json.loads((tmp / "zoo" / "zoo_results.json").read_text())
    assert not result["failures"] and {r["model"] for r in result["records"]} == {"tiny-cnn", "tiny-cnn-b"}


def test_zoo_flow_two_concurrent_runs_share_cache_and_mlflow_store(zoo_setup, prefect_harness):
    """Two zoo flow processes started together against one result cache, one output folder and one
    MLflow store: both finish, both parent runs keep all their child runs, every task's result is
    computed once (the cache-key lock makes the other process wait and read it: the two runs log
    the same wall times), and the exports and results file are whole."""
    import json
    import os
    import subprocess
    import sys

    import mlflow

    from bayesq.export import read_export
    from bayesq.tensorfile import file_sha256

    tmp = zoo_setup
    zoo = _zoo(tmp, [{"name": "tiny-cnn", "loader": LOADER, "budgets": [3.0, 4.0]},
                     {"name": "tiny-cnn-b", "loader": LOADER, "budgets": [4.0]}])
    cmd = [sys.executable, "-m", "flows.zoo", "--zoo", str(zoo), "--params", str(_params(tmp)), "--raw", str(tmp),
           "--models", str(tmp / "models"), "--out", str(tmp / "zoo")]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)

    client = mlflow.tracking.MlflowClient()
    exp = client.get_experiment_by_name("bayesq-zoo")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags and r.data.tags.get("zoo") == str(zoo)]
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    logged = []
    for parent in parents:
        children = sorted((r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id),
                          key=lambda r: r.info.run_name)
        assert [c.info.run_name for c in children] == ["tiny-cnn-b/bayesq-distill/b4.0/s17",
                                                       "tiny-cnn/bayesq-distill/b3.0/s17",
                                                       "tiny-cnn/bayesq-distill/b4.0/s17"]
        assert all("layer_bits.json" in {a.path for a in client.list_artifacts(c.info.run_id)} for c in children)
        logged.append([(c.data.metrics["quantize_seconds"], c.data.tags["export_sha256"]) for c in children])
    assert logged[0] == logged[1]  # one computation per task, read by the other run
    result = json.loads((tmp / "zoo" / "zoo_results.json").read_text())
    assert not result["failures"] and len(result["records"]) == 3
    for r in result["records"]:
        read_export(r["export"]["path"])  # verifies the content hash
        assert file_sha256(r["export"]["path"]) == r["export"]["sha256"]
    assert not list((tmp / "zoo").rglob("*.partial"))


def test_layer_table_tasks_vs_whole_table(zoo_setup, one_thread):
    """The per-layer tables the zoo fans out, merged, equal the one-task table exactly."""
    from bayesq.blocks import quantizable_layers
    from bayesq.harness.models.zoo import get_entry
    from bayesq.settings import replace
    from flows.common import digest, read_params
    from flows.finetune import load_model
    from flows.prepare import layer_table_task, posterior_task, table_task

    tmp = zoo_setup
    p = read_params(_params(tmp))
    ckpt, src = tmp / "models" / "tiny-cnn" / "model.safetensors", tmp / "tiny.bin"
    mdig, sdig = digest(ckpt), digest(src)
    post = posterior_task.fn("tiny-cnn", str(ckpt), mdig, str(src), sdig, p.data, p.calibration, p.posterior, 17,
                             str(tmp / "post"), "c")
    quant = replace(p.quant, feedback_table=False)  # a table that reads no calibration data
    whole = table_task.fn("tiny-cnn", str(ckpt), mdig, post["path"], post["sha256"], str(src), sdig, p.data,
                          p.calibration, quant, 17, str(tmp / "tables"), "c")["table"]
    layers = list(quantizable_layers(load_model(get_entry("tiny-cnn"), ckpt)))
    parts = [layer_table_task.fn("tiny-cnn", str(ckpt), mdig, post["path"], post["sha256"], name, quant, "c")
             for name in layers]
    assert [t.blocks.name for t in parts] == [t.blocks.name for t in whole.layers] == layers
    for a, b in zip(parts, whole.layers):
        assert a.bits == b.bits
        assert torch.equal(a.unit_loss, b.unit_loss) and torch.equal(a.unit_cost, b.unit_cost)
    with pytest.raises(ValueError, match="whole model's table"):
        layer_table_task.fn("tiny-cnn", str(ckpt), mdig, post["path"], post["sha256"], layers[0],
                            replace(p.quant, whitening="pca"), "c")
