"""Bring your own model and data (flows/byo.py) end to end, as a user runs it: the CLI from a
Hugging Face folder and a Parquet file to an export, a report and an MLflow run; `bayesq eval` on
the export alone; every kind of model loaded back from its export without a skeleton; the zoo
flow and the pipeline's sources stage on user models; every bad input a clear error that writes
nothing."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from bayesq.comparison import kl_per_example
from bayesq.export import load, read_export
from bayesq.harness.data.files import DataSource
from flows.byo import ByoModel, byo_from_mapping, load_examples, prepare, report_paths, run_row
from flows.cli import app
from flows.common import read_params
from flows.params import load_params

runner = CliRunner()
SMALL = ["--calibration", "24", "--selection", "24", "--test", "40"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def _quantize(*args: str):
    return runner.invoke(app, ["quantize", *SMALL, *args])  # a later flag overrides SMALL's


def test_cli_quantize_hf_folder_and_parquet_to_export_report_and_mlflow(byo_models, byo_data, tmp_path,
                                                                        mlflow_store, one_thread):
    import mlflow

    out = tmp_path / "my-bert-3b.safetensors"
    res = _quantize("--model", str(byo_models["bert"]), "--data", str(byo_data["parquet"]), "--text-column", "sentence",
                    "--label-column", "label", "--budget", "3.0", "--out", str(out))
    assert res.exit_code == 0, res.output
    js, md = report_paths(out)
    record = json.loads(js.read_text())
    f = record["fidelity"]
    assert {"kl", "kl_ci_low", "kl_ci_high", "agreement", "accuracy_fp", "accuracy_q", "accuracy_diff"} <= set(f)
    assert f["n"] == 40 and "perplexity_ratio" not in f
    assert f["kl_ci_low"] <= f["kl"] <= f["kl_ci_high"]
    assert "KL(FP || Q)" in res.output and "accuracy Q - FP" in md.read_text()
    assert record["avg_bits"] <= 3.0 and record["export"]["max_logit_diff"] == 0.0
    assert record["draws"]["calibration"]["n"] == 24 and record["draws"]["test"]["n"] == 40
    # the report's KL is the loaded export's mean KL to FP on the test draw, recomputed here
    spec = ByoModel("x", str(byo_models["bert"]), DataSource(str(byo_data["parquet"]), text_columns=("sentence",),
                                                              label_column="label"), calibration=24, selection=24, test=40)
    prep = prepare(spec, read_params(ROOT / "params.yaml").seeds[0], say=lambda _: None)
    loaded = load(out)
    with torch.no_grad():
        kl = torch.cat([kl_per_example(prep.fp(**b).logits, loaded(**b).logits) for b in prep.test])
    assert f["kl"] == pytest.approx(float(kl.mean()), rel=1e-9)
    # lineage: the model folder, the data digest and the three draws
    meta = read_export(out).user
    assert meta["model_source"] == str(byo_models["bert"]) and meta["dataset_digest"] == record["dataset_digest"]
    assert len(meta["calibration_indices"].split(",")) == 24
    res = runner.invoke(app, ["lineage", str(out), "--check"])
    assert res.exit_code == 0 and "model_source" in res.output and res.output.count(": ok") == 2
    # the MLflow run: metrics with their intervals, the export and the report as artifacts
    runs = mlflow.search_runs(experiment_names=["bayesq-byo"], filter_string="tags.mlflow.parentRunId != ''")
    assert len(runs) == 1 and runs["metrics.kl"][0] == pytest.approx(f["kl"])
    assert runs["metrics.accuracy_diff_ci_high"][0] == pytest.approx(f["accuracy_diff_ci_high"])
    arts = {a.path for a in mlflow.tracking.MlflowClient().list_artifacts(runs["run_id"][0], "report")}
    assert arts == {"report/my-bert-3b.report.json", "report/my-bert-3b.report.md"}
    # a consumer: `bayesq eval` from the export alone gives the same numbers on its own test draw
    res = runner.invoke(app, ["eval", str(out), "--data", str(byo_data["parquet"]), "--out", str(tmp_path / "e.json")])
    assert res.exit_code == 0, res.output
    again = json.loads((tmp_path / "e.json").read_text())
    assert again["examples"] == "export test draw"
    assert again["fidelity"]["kl"] == pytest.approx(f["kl"], rel=1e-12)
    assert again["fidelity"]["accuracy_diff"] == f["accuracy_diff"]
    # on other data (CSV of the same rows: another digest): a seeded draw of --test examples
    res = runner.invoke(app, ["eval", str(out), "--data", str(byo_data["csv"]), "--test", "30",
                              "--out", str(tmp_path / "e2.json")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "e2.json").read_text())["fidelity"]["n"] == 30


@pytest.mark.parametrize("name, args, metric", [
    ("gpt2", ["--data", "jsonl", "--text-column", "sentence"], "perplexity_ratio"),
    ("vit", ["--data", "images", "--label-column", "label", "--test", "24"], "accuracy_diff"),
    ("mnv3", ["--data", "images", "--label-column", "label", "--image-size", "32", "--test", "24"], "accuracy_diff"),
    ("bert-base", ["--data", "disk", "--text-column", "sentence", "--text-column", "second"], "feature_error"),
    ("callable", ["--data", "csv", "--text-column", "sentence", "--label-column", "label"], "accuracy_diff"),
])
def test_every_model_kind_exports_and_loads_without_skeleton(byo_models, byo_data, tmp_path, name, args, metric,
                                                             one_thread):
    model = {"mnv3": ["--model", "torchvision:mobilenet_v3_small", "--checkpoint", str(byo_models["mnv3"])],
             "callable": ["--model", "tests.byo_fixtures:tiny_text_model", "--tokenizer", str(byo_models["bert"])]}
    argv = model.get(name, ["--model", str(byo_models.get(name, ""))])
    argv += [str(byo_data[a]) if a in byo_data else a for a in args]
    out = tmp_path / f"{name}.safetensors"
    res = _quantize(*argv, "--out", str(out), "--no-track", "--method", "gptq" if name == "vit" else "bayesq")
    assert res.exit_code == 0, res.output
    record = json.loads(report_paths(out)[0].read_text())
    assert metric in record["fidelity"] and record["export"]["max_logit_diff"] == 0.0
    contents = read_export(out)
    assert contents.skeleton["kind"] == ("torchvision" if name == "mnv3" else "callable" if name == "callable"
                                         else "huggingface")
    loaded = load(out)  # no skeleton, no producer code
    assert sum(p.numel() for p in loaded.parameters()) > 0 and not loaded.training


def test_cli_default_draw_sizes_shrink_to_a_300_row_file_and_given_ones_do_not(byo_models, tmp_path, one_thread):
    """No size flags on 300 rows: the defaults (512 + 256 + 512) shrink together to 120 + 60 + 120
    and the run says so; a size given that does not fit is refused, nothing written."""
    import datasets

    from tests.byo_fixtures import sentences

    rows = tmp_path / "reviews.parquet"
    datasets.Dataset.from_dict({"sentence": sentences(300), "label": [i % 2 for i in range(300)]}).to_parquet(str(rows))
    out = tmp_path / "m.safetensors"
    args = ["quantize", "--model", str(byo_models["bert"]), "--data", str(rows), "--text-column", "sentence",
            "--label-column", "label", "--budget", "3.0", "--no-track"]
    res = runner.invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "the data has 300 examples, fewer than the default draws need (512 + 256 + 512)" in said
    assert "120 calibration, 60 selection, 120 test" in said
    record = json.loads(report_paths(out)[0].read_text())
    assert [record["draws"][k]["n"] for k in ("calibration", "selection", "test")] == [120, 60, 120]
    report = " ".join(report_paths(out)[1].read_text().split())
    assert "the data has 300 examples" in report and "a small test draw: 120 examples" in report
    assert "about 2.1 times as wide as with the default 512" in report  # sqrt(512 / 120)
    never = tmp_path / "never.safetensors"
    res = runner.invoke(app, [*args, "--calibration", "320", "--out", str(never)])
    assert res.exit_code == 1 and "sizes given need calibration 320 = 320" in " ".join(res.output.split())
    assert not never.exists()
    # the floor: 20 rows run (8 + 4 + 8), 19 are refused with the fewest that run named
    for n, ok in ((20, True), (19, False)):
        few = tmp_path / f"few{n}.parquet"
        datasets.Dataset.from_dict({"sentence": sentences(n), "label": [i % 2 for i in range(n)]}).to_parquet(str(few))
        res = runner.invoke(app, [*args[:4], str(few), *args[5:], "--out", str(tmp_path / f"few{n}.safetensors")])
        assert (res.exit_code == 0) == ok, res.output
        if not ok:
            assert "below the 8 that measurement supports" in " ".join(res.output.split())
            assert "bring at least 20 examples" in " ".join(res.output.split())


def test_bad_inputs_are_named_and_write_nothing(byo_models, byo_data, tmp_path, one_thread):
    out = tmp_path / "never.safetensors"
    bert = ["--model", str(byo_models["bert"])]
    cases = [
        (bert + ["--data", str(byo_data["parquet"]), "--text-column", "sentense"],
         "text column 'sentense' is not in .*did you mean 'sentence'"),
        (bert + ["--data", str(byo_data["parquet"]), "--text-column", "sentence", "--label-column", "labels"],
         "label column 'labels' is not in"),
        (["--model", str(tmp_path), "--data", str(byo_data["parquet"]), "--text-column", "sentence"],
         "is not a model directory"),
        (["--model", str(byo_models["vit"]), "--data", str(byo_data["parquet"]), "--text-column", "sentence"],
         "given to an image model"),
        (["--model", str(byo_models["vit"]), "--data", str(byo_data["images"]), "--label-column", "label",
          "--test", "70"], "the data has 72 examples but calibration"),
        (["--model", "torchvision:resnet18", "--checkpoint", str(byo_models["mnv3"]), "--num-classes", "3",
          "--data", str(byo_data["images"]), "--test", "24"], "does not match torchvision:resnet18"),
        (["--model", str(byo_models["gpt2"]), "--data", str(byo_data["jsonl"]), "--text-column", "sentence",
          "--label-column", "label"], "causal language model: it has no class labels"),
        (["--model", str(byo_models["bert-base"]), "--data", str(byo_data["parquet"]), "--text-column", "sentence",
          "--label-column", "label"], "base model without a head .*AutoModel.*drop the label column"),
        (bert + ["--data", str(byo_data["disk"]), "--split", "validation", "--text-column", "sentence"],
         "has no split 'validation'"),
        (bert + ["--data", str(byo_data["parquet"]), "--text-column", "sentence", "--method", "gptx"],
         "--method gptx: choose one of"),
        (bert + ["--data", str(byo_data["parquet"]), "--text-column", "sentence", "--budget", "0.5"],
         "budget"),
    ]
    for argv, message in cases:
        res = _quantize(*argv, "--out", str(out), "--no-track")
        assert res.exit_code == 1, (argv, res.output)
        assert re.search(message, " ".join(res.output.split())), (message, res.output)
        assert not out.exists() and not report_paths(out)[0].exists()
    # labels outside the head's classes: a 2-class model on the 3-class image folder
    import datasets

    three = tmp_path / "three.parquet"
    datasets.Dataset.from_dict({"sentence": ["good"] * 120, "label": [0, 1, 2] * 40}).to_parquet(str(three))
    res = _quantize(*bert, "--data", str(three), "--text-column", "sentence", "--label-column", "label",
                    "--out", str(out), "--no-track")
    assert res.exit_code == 1 and "labels outside the head's classes" in " ".join(res.output.split())
    assert not out.exists()


def test_base_model_without_head_bayesq_vs_gptq_on_feature_measures(byo_models, byo_data, tmp_path, one_thread):
    """A base BERT (no head) from a config: each run reports feature error, cosine and neighbour
    agreement with intervals (no KL), and BayesQ minus GPTQ on the same test examples is the
    paired difference of those per-example values, as the sources / zoo table shows it."""
    from flows.byo import paired_rows
    from flows.sources import sources_table

    records = []
    for method in ("bayesq", "gptq"):
        out = tmp_path / f"base-{method}.safetensors"
        res = _quantize("--model", str(byo_models["bert-base"]), "--data", str(byo_data["parquet"]),
                        "--text-column", "sentence", "--test", "40", "--method", method, "--out", str(out), "--no-track")
        assert res.exit_code == 0, res.output
        assert "feature error" in res.output and "neighbour agreement" in res.output and "KL(FP" not in res.output
        records.append(json.loads(report_paths(out)[0].read_text()))
    f = records[0]["fidelity"]
    assert "kl" not in f and f["n"] == 40
    for key in ("feature_error", "cosine", "neighbour"):
        assert f[f"{key}_ci_low"] <= f[key] <= f[f"{key}_ci_high"]
    (row,) = paired_rows(records)
    assert row["baseline"] == "gptq" and "kl" not in row
    a, b = (load_examples(Path(r["examples_file"])) for r in records)
    assert row["feature_error"]["diff"] == pytest.approx(100 * float((a.feature_error - b.feature_error).mean()),
                                                         rel=1e-9, abs=1e-12)
    assert row["neighbour"]["diff"] == pytest.approx(100 * float((a.neighbour - b.neighbour).mean()), abs=1e-9)
    table = sources_table(records, [])
    assert "Models without a head" in table and "| bert-base | 3.0 | " in table and "KL(FP ‖ Q)" not in table


def test_cli_target_onnxruntime_writes_an_onnx_file_checked_in_onnx_runtime(byo_models, byo_data, tmp_path,
                                                                           one_thread):
    """--target onnxruntime: one .onnx file whose quantised layers are MatMulNBits, the report
    checks ONNX Runtime's output against BayesQ's model and FP; wrong targets, suffixes and
    methods are refused and write nothing. (The fixture's 32-weight rows are padded to a block of
    128, so its cheapest encoding is above 10 bits per weight: the budget is 11.)"""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bert.onnx"
    argv = ["--model", str(byo_models["bert"]), "--data", str(byo_data["parquet"]), "--text-column", "sentence",
            "--label-column", "label", "--budget", "11", "--no-track"]
    res = _quantize(*argv, "--target", "onnxruntime", "--out", str(out))
    assert res.exit_code == 0, res.output
    record = json.loads(report_paths(out)[0].read_text())
    assert record["target"] == "onnxruntime" and record["export"]["max_logit_diff"] < 1e-4
    assert len(record["export"]["matmulnbits"]) == 14 and not record["export"]["kept"]  # 2 x 6 + pooler + head
    assert record["avg_bits"] <= 11 and "kl" in record["fidelity"]
    assert "MatMulNBits" in report_paths(out)[1].read_text()
    import onnxruntime as ort

    assert "MatMulNBits" in _ops(out) and "Gemm" not in _ops(out) and ort.InferenceSession(str(out)).get_inputs()
    assert record["export"]["accuracy_level"] == 4  # the default: int8 activations (the round trip checked at 1)
    level1 = tmp_path / "bert-l1.onnx"  # float32 compute: the file says so
    res = _quantize(*argv, "--target", "onnxruntime", "--accuracy-level", "1", "--out", str(level1))
    assert res.exit_code == 0, res.output
    r1 = json.loads(report_paths(level1)[0].read_text())
    assert r1["export"]["accuracy_level"] == 1 and "the file's level 1" in report_paths(level1)[1].read_text()
    # `bayesq eval` runs the file in ONNX Runtime on the export's own test draw: the same scores
    res = runner.invoke(app, ["eval", str(out), "--data", str(byo_data["parquet"]), "--out", str(tmp_path / "e.json")])
    assert res.exit_code == 0, res.output
    again = json.loads((tmp_path / "e.json").read_text())
    assert again["examples"] == "export test draw" and again["fidelity"]["kl"] == pytest.approx(
        record["fidelity"]["kl"], rel=1e-9, abs=1e-15)
    (tmp_path / "corrupt.onnx").write_bytes(b"not a model")
    res = runner.invoke(app, ["eval", str(tmp_path / "corrupt.onnx"), "--data", str(byo_data["parquet"])])
    assert res.exit_code == 1 and "not a readable ONNX file" in " ".join(res.output.split())
    never = tmp_path / "never.onnx"
    for extra, message in ((["--target", "tensorrt", "--out", str(never)], "target 'tensorrt' does not exist"),
                           (["--target", "onnxruntime", "--out", str(tmp_path / "never.safetensors")],
                            "writes a .onnx file: pass --out never.onnx"),
                           (["--target", "onnxruntime", "--method", "ocs", "--out", str(never)],
                            "--target onnxruntime quantises with --method bayesq, gptq, optq, awq, rtn-group")):
        res = _quantize(*argv, *extra)
        assert res.exit_code == 1 and message in " ".join(res.output.split()), res.output
    assert not never.exists() and not (tmp_path / "never.safetensors").exists()
    # GPTQ in the same format: its variants are the target's layouts, every layer MatMulNBits
    gptq = tmp_path / "bert-gptq.onnx"
    res = _quantize(*argv, "--target", "onnxruntime", "--method", "gptq", "--out", str(gptq))
    assert res.exit_code == 0, res.output
    rg = json.loads(report_paths(gptq)[0].read_text())
    assert len(rg["export"]["matmulnbits"]) == 14 and not rg["export"]["kept"] and rg["avg_bits"] <= 11
    assert rg["export"]["file_avg_bits"] <= rg["avg_bits"] + 1e-9
    # a CNN: its convolutions are left out of the allocation and listed with the target's reason
    cnn = tmp_path / "mnv3.onnx"
    res = _quantize("--model", "torchvision:mobilenet_v3_small", "--checkpoint", str(byo_models["mnv3"]),
                    "--data", str(byo_data["images"]), "--label-column", "label", "--image-size", "32", "--test", "24",
                    "--budget", "11", "--target", "onnxruntime", "--out", str(cnn), "--no-track")
    assert res.exit_code == 0, res.output
    record = json.loads(report_paths(cnn)[0].read_text())
    assert set(record["export"]["matmulnbits"]) == {"classifier.0", "classifier.3"}
    convs = {k: v for k, v in record["unquantized"].items() if k.startswith("features.")}
    assert convs and all("a convolution: ONNX Runtime has no weight-only low-bit Conv kernel" in v for v in convs.values())


def _ops(path: Path) -> list[str]:
    import onnx

    return [n.op_type for n in onnx.load(str(path)).graph.node]


def test_byo_entries_from_zoo_and_params_mappings(tmp_path):
    m = byo_from_mapping({"model": "./my-bert/", "data": "d.parquet", "text_column": "s", "budgets": [3, 4],
                          "methods": ["gptq"]}, "zoo: models[0]")
    assert (m.name, m.data.text_columns, m.budgets, m.methods) == ("my-bert", ("s",), (3.0, 4.0), ("gptq",))
    assert (m.calibration, m.selection, m.test) == (None, None, None)  # left out: the defaults, fitted to the data
    sized = byo_from_mapping({"model": "m", "data": "d", "calibration": 64, "test": 32}, "zoo: models[1]")
    assert (sized.calibration, sized.selection, sized.test) == (64, None, 32)
    with pytest.raises(ValueError, match=r"models\[0\]: unknown key 'text_colum' \(did you mean 'text_column'"):
        byo_from_mapping({"model": "m", "data": "d", "text_colum": "s"}, "zoo: models[0]")
    with pytest.raises(ValueError, match="'data' is required"):
        byo_from_mapping({"model": "m"}, "zoo: models[0]")
    with pytest.raises(ValueError, match="methods = \\['bq'\\]: choose from"):
        byo_from_mapping({"model": "m", "data": "d", "methods": ["bq"]}, "x")
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    p = load_params({**raw, "sources": [{"name": "mine", "model": "m", "data": "d", "text_column": "s"}]})
    assert p.sources[0].methods == ("bayesq", "gptq") and p.sources[0].budgets == p.budgets
    with pytest.raises(ValueError, match=r"sources\[0\].name = 'lite0-fmnist': already the name"):
        load_params({**raw, "sources": [{"name": "lite0-fmnist", "model": "m", "data": "d"}]})
    with pytest.raises(ValueError, match="sources = 'x': need a list"):
        load_params({**raw, "sources": "x"})


def test_zoo_flow_hf_and_torchvision_models_then_lineage_check(byo_models, byo_data, tmp_path, prefect_harness,
                                                               mlflow_store, one_thread):
    from flows.zoo import make_zoo_flow

    zoo = tmp_path / "zoo.yaml"
    zoo.write_text(yaml.safe_dump({"models": [
        {"name": "my-bert", "model": str(byo_models["bert"]), "data": str(byo_data["parquet"]),
         "text_column": "sentence", "label_column": "label", "calibration": 24, "selection": 24, "test": 40,
         "methods": ["bayesq", "rtn-group"]},
        {"name": "my-mnv3", "model": "torchvision:mobilenet_v3_small", "checkpoint": str(byo_models["mnv3"]),
         "data": str(byo_data["images"]), "label_column": "label", "image_size": 32, "calibration": 16,
         "selection": 16, "test": 24},
        {"name": "broken", "model": str(tmp_path), "data": str(byo_data["parquet"]), "text_column": "sentence"}]}))
    res = make_zoo_flow(None, workers=1)(zoo, ROOT / "params.yaml", tmp_path, tmp_path, tmp_path / "zoo-out")
    assert [f["model"] for f in res["failures"]] == ["broken"]
    assert "| my-bert | 3.0 | 17 | rtn-group |" in (tmp_path / "zoo-out" / "zoo.md").read_text()  # the paired row
    assert sorted((r["model"], r["method"]) for r in res["records"]) == [
        ("my-bert", "bayesq"), ("my-bert", "rtn-group"), ("my-mnv3", "bayesq")]
    for r in res["records"]:
        path = Path(r["export"]["path"])
        assert path.parent == tmp_path / "zoo-out" / "exports" and report_paths(path)[1].is_file()
        assert Path(r["examples_file"]).parent == tmp_path / "zoo-out" / "examples"
        assert sorted(p.name for p in path.parent.glob("*.safetensors") if "_".join(p.name.split("_")[:1]) == r["model"]
                      and p.name.split("_")[1] == r["method"]) == [path.name]  # exports only
        out = runner.invoke(app, ["lineage", str(path), "--check"])
        assert out.exit_code == 0 and "MISMATCH" not in out.output
        assert "dataset " in out.output and out.output.count(": ok") == 2  # the data, and the folder or checkpoint
        loaded = load(path)
        assert loaded is not None
    again = make_zoo_flow(None, workers=1)(zoo, ROOT / "params.yaml", tmp_path, tmp_path, tmp_path / "zoo-out")
    assert sorted(r["export"]["sha256"] for r in again["records"]) == sorted(
        r["export"]["sha256"] for r in res["records"])  # cached: the same rows


def test_sources_stage_runs_declared_models(byo_models, byo_data, tmp_path, prefect_harness, mlflow_store,
                                            one_thread):
    from flows.sources import sources_flow

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["sources"] = [{"name": "my-gpt2", "model": str(byo_models["gpt2"]), "data": str(byo_data["jsonl"]),
                       "text_column": "sentence", "calibration": 16, "selection": 16, "test": 24,
                       "methods": ["bayesq", "rtn-tensor"]}]
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    res = sources_flow(params, tmp_path / "results-sources")
    assert not res["failures"]
    assert sorted((r["model"], r["method"]) for r in res["records"]) == [("my-gpt2", "bayesq"), ("my-gpt2", "rtn-tensor")]
    table = (tmp_path / "results-sources" / "sources.md").read_text()
    assert "| my-gpt2 | bayesq | 3.0 |" in table and "perplexity" in table
    # BayesQ minus RTN on the same test examples: the mean of the per-example KL differences
    (paired,) = json.loads((tmp_path / "results-sources" / "sources.json").read_text())["paired"]
    kl = {r["method"]: load_examples(Path(r["examples_file"])).kl for r in res["records"]}
    assert paired["baseline"] == "rtn-tensor" and paired["n"] == 24
    assert paired["kl"]["diff"] == pytest.approx(float((kl["bayesq"] - kl["rtn-tensor"]).mean()), rel=1e-12)
    assert paired["kl"]["ci_low"] <= paired["kl"]["diff"] <= paired["kl"]["ci_high"]
    assert "| my-gpt2 | 3.0 | 17 | rtn-tensor |" in table
    raw["sources"] = []
    params.write_text(yaml.safe_dump(raw))
    empty = sources_flow(params, tmp_path / "none")
    assert empty == {"records": [], "failures": [], "paired": []}
    assert "No user models are declared" in (tmp_path / "none" / "sources.md").read_text()


def test_run_sources_with_none_declared_starts_no_flow(tmp_path, monkeypatch):
    import flows.sources as sources

    def no_flow(*_a, **_k):
        raise AssertionError("the Prefect flow started with no sources declared")

    monkeypatch.setattr(sources, "sources_flow", no_flow)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["sources"] = []
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(raw))
    assert sources.run_sources(params, tmp_path / "none") == {"records": [], "failures": [], "paired": []}
    assert "No user models are declared" in (tmp_path / "none" / "sources.md").read_text()
    raw["sources"] = [{"name": "m", "model": "torchvision:resnet18", "data": "x.jsonl"}]
    params.write_text(yaml.safe_dump(raw))
    with pytest.raises(AssertionError, match="flow started"):  # declared: the flow runs them
        sources.run_sources(params, tmp_path / "some")


def test_run_row_leaves_no_export_when_the_check_fails(byo_models, byo_data, tmp_path, monkeypatch, one_thread):
    import flows.byo as byo

    spec = ByoModel("x", str(byo_models["bert"]), DataSource(str(byo_data["parquet"]), text_columns=("sentence",)),
                    calibration=16, selection=0, test=16)
    prep = prepare(spec, 0, say=lambda _: None)

    def broken(*a, **k):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(byo, "score_examples", broken)
    out = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError, match="evaluation failed"):
        run_row(prep, "rtn-group", 4.0, read_params(ROOT / "params.yaml"), 0, out, {}, "code", say=lambda _: None)
    assert not out.exists()


def test_eval_needs_the_fp_model_and_takes_another_path(byo_models, byo_data, tmp_path, one_thread):
    import shutil

    moved = tmp_path / "producer-bert"
    shutil.copytree(byo_models["bert"], moved)
    out = tmp_path / "q.safetensors"
    res = _quantize("--model", str(moved), "--data", str(byo_data["parquet"]), "--text-column", "sentence",
                    "--method", "rtn-group", "--out", str(out), "--no-track")
    assert res.exit_code == 0, res.output
    shutil.rmtree(moved)  # the consumer has the export, not the producer's folder
    res = runner.invoke(app, ["eval", str(out), "--data", str(byo_data["parquet"])])
    assert res.exit_code == 1 and "KL to the FP model needs the FP model" in " ".join(res.output.split())
    res = runner.invoke(app, ["eval", str(out), "--data", str(byo_data["parquet"]), "--reference",
                              str(byo_models["bert"]), "--out", str(tmp_path / "e.json")])
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "e.json").read_text())
    assert record["examples"] == "export test draw" and record["fidelity"]["n"] == 40
    assert record["fidelity"]["kl"] == pytest.approx(json.loads(report_paths(out)[0].read_text())["fidelity"]["kl"])
