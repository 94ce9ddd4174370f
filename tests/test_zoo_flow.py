"""Zoo flow: zoo-file validation, per-model fan-out with cache hits, a failing model reported
without stopping the others, and the same results on a 2-worker Dask cluster as serially."""

from pathlib import Path

import pytest
import yaml

from flows.zoo import ZooModel, make_zoo_flow, read_zoo
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
    from bayesq.models.zoo import unregister

    unregister("tiny-cnn")
    unregister("tiny-cnn-b")


def _run(tmp, zoo, out, dask=None):
    return make_zoo_flow(dask)(zoo, _params(tmp), tmp, tmp / "models", tmp / out)


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


def test_zoo_flow_dask_two_workers_matches_serial(zoo_setup, prefect_harness):
    tmp = zoo_setup
    zoo = _zoo(tmp, [{"name": "tiny-cnn", "loader": LOADER, "budgets": [4.0]},
                     {"name": "tiny-cnn-b", "loader": LOADER, "budgets": [4.0]}])
    serial = _run(tmp, zoo, "serial")
    dask = _run(tmp, zoo, "dask", dask="local")
    assert not serial["failures"] and not dask["failures"]
    assert _key(dask["records"]) == _key(serial["records"])
    from bayesq.export import read_export

    for s in serial["records"]:  # the same tensors and layouts (content hash), the same size
        d = next(r for r in dask["records"] if r["model"] == s["model"])
        a, b = read_export(s["export"]["path"]), read_export(d["export"]["path"])
        assert a.metadata["content_sha256"] == b.metadata["content_sha256"]
        assert d["export"]["file_bytes"] == s["export"]["file_bytes"]


def test_zoo_flow_killed_and_restarted_redoes_no_finished_task(zoo_setup):
    """Kill the flow process while one model stalls; the restart reuses the finished model's
    tasks (its export is not rewritten) and completes the other."""
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
    proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "BAYESQ_TEST_STALL": str(marker)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (marker.exists() and export.exists()) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert marker.exists() and export.exists(), "the first run did not reach the stalled model"
        time.sleep(2)  # let the finished task's result be persisted
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (tmp / "zoo" / "zoo_results.json").exists()  # killed before the end
    written = export.stat().st_mtime_ns
    done = subprocess.run(cmd, cwd=root, env={k: v for k, v in os.environ.items() if k != "BAYESQ_TEST_STALL"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert export.stat().st_mtime_ns == written  # the finished model was a cache hit
    import json

    result = json.loads((tmp / "zoo" / "zoo_results.json").read_text())
    assert not result["failures"] and {r["model"] for r in result["records"]} == {"tiny-cnn", "tiny-cnn-b"}
