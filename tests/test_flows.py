"""End-to-end: finetune -> quantize -> report flows on a tiny registered model and tiny data."""

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from bayesq.harness.corruptions import CORRUPTIONS
from bayesq.harness.models.config import DataConfig, FinetuneConfig
from bayesq.harness.models.zoo import Splits, ZooEntry, register, unregister


class TinyEntry(ZooEntry):
    """A small CNN on synthetic 8x8 images whose label is the brightened quadrant."""

    name = "tiny-cnn"
    task = "image"
    default_raw = Path("tiny.bin")

    def build(self, pretrained: bool = True) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 4),
        )

    side = 8  # image side

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 4, (400,), generator=g)
        x = torch.randint(0, 120, (400, self.side, self.side), generator=g, dtype=torch.uint8)
        h = self.side // 2
        for i, q in enumerate(y.tolist()):
            r, c = divmod(q, 2)
            x[i, h * r:h * r + h, h * c:h * c + h] += 120
        return Splits(x[:300], y[:300], x[300:], y[300:])

    def batches(self, inputs, batch_size: int, data: DataConfig):
        x = inputs.float().unsqueeze(1) / 255.0 - 0.5
        return [x[i:i + batch_size] for i in range(0, len(x), batch_size)]

    def learning_rate(self, cfg: FinetuneConfig) -> float:
        return cfg.lr_image


ROBUST = ("bayesq", "bayesq-distill", "bayesq-ef", "gptq", "awq", "rtn-group")  # robustness.methods default
ALL_METHODS = ("bayesq", "bayesq-distill", "bayesq-ef", "bayesq-paper", "bayesq-brecq", "rtn-tensor", "rtn-channel", "rtn-group", "gptq", "awq", "hawq", "zeroq", "aciq",
               "adaround", "brecq", "lsq", "lsq-plus", "pact", "dorefa", "bit-split", "optq", "clip-block", "lloyd-block", "smoothquant",
               "anneal", "ocs")


@pytest.fixture
def tiny_entry():
    register(TinyEntry(), replace=True)
    yield
    unregister("tiny-cnn")


def _params(tmp_path: Path) -> Path:
    params = {
        "models": ["tiny-cnn"], "seeds": [17], "budgets": [3.0, 4.0],
        "finetune": {"epochs": 3, "batch_size": 32, "lr_image": 0.003},
        "calibration": {"images": 64, "batch_size": 16},
        "quant": {"group_size": 32, "unit_groups": 4, "range_iters": 6},  # units of 128: a Lloyd table fits 3.0 bits
        "posterior": {"probes": 2},
        "distill": {"steps": 30, "max_budget": 3.5},  # the bayesq-distill row distils at 3.0 (as params.yaml)
        "baselines": {"adaround": {"iters": 30}, "brecq": {"iters": 10}, "lsq": {"iters": 30},
                      "lsq-plus": {"iters": 30}, "pact": {"iters": 30}, "dorefa": {"iters": 30},
                      "bit-split": {"epochs": 3}, "anneal": {"steps": 10}},  # the learned rivals' code paths, not their steps
        "robustness": {"corruption_examples": 50, "severities": [1, 5], "random_bin_repeats": 3},
    }
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_pipeline_flows_end_to_end(tmp_path, prefect_harness, tiny_entry):
    import mlflow
    import pandas as pd

    from flows.common import read_json
    from flows.finetune import finetune_flow
    from flows.quantize import quantize_flow
    from flows.report import report

    params, raw = _params(tmp_path), tmp_path / "raw"
    raw.mkdir()
    (raw / "tiny.bin").write_bytes(b"synthetic")
    models, results, reports = tmp_path / "models", tmp_path / "results", tmp_path / "reports"

    cfg = yaml.safe_load(params.read_text())
    cfg["methods"] = list(ALL_METHODS)
    params.write_text(yaml.safe_dump(cfg))
    fp = finetune_flow(params, raw, models)
    assert fp[0]["fp_accuracy"] > 0.5  # it learned something
    assert (models / "tiny-cnn" / "model.safetensors").exists()

    everything = quantize_flow(params, raw, models, results)
    records = [r for r in everything if r["method"] != "fp"]
    assert len(records) == 2 * len(ALL_METHODS) and len(everything) == len(records) + 1
    for r in records:
        assert r["avg_bits"] <= r["budget"]
        assert 0.0 <= r["accuracy"] <= 1.0
        assert r["preprocess_seconds"] >= r["quantize_seconds"] > 0
    assert (results / "posterior" / "tiny-cnn_s17_kfac.safetensors").exists()
    # one statistics pass per (model, seed), read by the rows that need it and counted in their one-time cost
    assert (results / "stats" / "tiny-cnn_s17.safetensors").exists()
    assert {r["method"] for r in records if r["stats_read"]} == {"bayesq", "bayesq-distill", "bayesq-brecq", "bayesq-ef",
                                                                 "gptq", "awq",
                                                                 "adaround", "brecq", "lsq", "lsq-plus", "pact", "dorefa",
                                                                 "bit-split", "ocs",
                                                                 "optq", "smoothquant", "anneal"}
    for r in records:
        assert ("stats_seconds" in r) == r["stats_read"]
        assert r["preprocess_seconds"] >= r["quantize_seconds"] + r.get("stats_seconds", 0.0)
    for r in records:  # evaluated from the export on disk, which holds exactly the accounted bits
        ex = r["export"]
        assert Path(ex["path"]).stat().st_size == ex["file_bytes"]
        assert r["total_bits"] <= ex["payload_bits"] < r["total_bits"] + 8 * 3 * 4  # byte rounding only
        assert ex["max_logit_diff"] == 0.0
        assert r["avg_bits_all"] == ex["all_avg_bits"] == ex["payload_avg_bits"]  # the tiny CNN: every matrix quantised
    _check_examples(records, results, next(r for r in everything if r["method"] == "fp"))
    assert read_json(results / "results.json") == everything
    # calibration summary on every row; shifted data on the robustness rows at 3.0 bits
    fp = next(r for r in everything if r["method"] == "fp")
    assert set(fp["ood"]["corruptions"]) == set(CORRUPTIONS) and fp["calibration"]["ece"] >= 0
    for r in records:
        assert {"ece", "mce", "worst10", "cvar95", "bins"} <= set(r["calibration"])
        assert sum(r["calibration"]["bins"]["count"]) == 100  # the tiny test split
        robust = r["method"] in ROBUST and r["budget"] == 3.0
        assert (r["ood"] is not None) == robust
        if robust:
            assert r["corruption"]["mce"] > 0
    distilled = {r["budget"]: r for r in records if r["method"] == "bayesq-distill"}
    assert "distill_seconds" in distilled[3.0] and "distill_seconds" not in distilled[4.0]
    plain = {r["budget"]: r for r in records if r["method"] == "bayesq"}
    assert distilled[4.0]["accuracy"] == plain[4.0]["accuracy"]  # above distill.max_budget: the same model
    assert distilled[3.0]["avg_bits"] == plain[3.0]["avg_bits"]  # same codes, same bits
    for b in (3.0, 4.0):  # distillation starts from the bayesq row's saved encoding, counted in its one-time cost
        assert Path(plain[b]["encoding_file"]).exists() and "encoding_file" not in distilled[b]
        assert distilled[b]["encoding_seconds"] > 0 and distilled[b]["layer_bits"] == plain[b]["layer_bits"]
        assert distilled[b]["encoding"] == plain[b]["encoding"]
        assert distilled[b]["preprocess_seconds"] >= distilled[b]["quantize_seconds"] + distilled[b]["encoding_seconds"]
    table = pd.read_parquet(results / "tables" / "tiny-cnn_s17.parquet")
    assert list(table.columns) == ["layer", "unit", "bits", "loss", "cost_bits", "se"]
    assert sorted(table.bits.unique()) == [2, 3, 4, 8]

    runs = mlflow.search_runs(experiment_names=["bayesq"], output_format="list")
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == len(records) and len(runs) == len(records) + 1
    assert {r.data.params["method"] for r in children} == set(ALL_METHODS)
    assert all("accuracy" in r.data.metrics and "avg_bits" in r.data.metrics for r in children)
    bayesq_runs = [r for r in children if r.data.params["method"] == "bayesq"]
    assert all({"posterior_seconds", "table_seconds"} <= set(r.data.metrics) for r in bayesq_runs)

    _check_lineage(records, runs, results, params, models)
    _check_tracking(records, runs, results)

    again = quantize_flow(params, raw, models, results)  # every task a cache hit
    assert again == everything  # identical wall times prove nothing was recomputed
    _check_prefect_runs(read_json(results / "mlflow_run.json")["run_id"], cached=True)

    report(results / "results.json", models, reports)
    logged = mlflow.tracking.MlflowClient().list_artifacts(read_json(results / "mlflow_run.json")["run_id"], "reports")
    assert {"reports/main_table.md", "reports/paired.json", "reports/frontier_tiny-cnn.png"} <= {a.path for a in logged}
    table_md = (reports / "main_table.md").read_text()
    assert "## tiny-cnn" in table_md and "RTN per-group" in table_md and "HAWQ" in table_md
    assert "BayesQ / GPTQ time:" in table_md
    bq = next(r for r in records if r["method"] == "bayesq" and r["budget"] == 3.0)  # accuracy ± binomial SE
    se = 100 * (bq["accuracy"] * (1 - bq["accuracy"]) / read_json(models / "tiny-cnn" / "fp.json")["n_test"]) ** 0.5
    assert f"| BayesQ | {100 * bq['accuracy']:.2f} ± {se:.2f} (" in table_md
    assert (reports / "frontier_tiny-cnn.png").stat().st_size > 0
    cal_md = (reports / "calibration_robustness.md").read_text()
    assert "## Calibration and tails at 3.0 bits" in cal_md and "One seed" in cal_md
    ece, ece_se = bq["calibration"]["ece"], bq["calibration"]["se"]["ece"]  # value ± bootstrap SE
    assert f"| BayesQ | {100 * bq['accuracy']:.2f} ± " in cal_md and f"{100 * ece:.2f} ± {100 * ece_se:.2f}" in cal_md
    assert "mCE" in cal_md and "## Distillation" in cal_md and "BayesQ + distillation" in cal_md
    assert (reports / "reliability_tiny-cnn.png").stat().st_size > 0
    assert (reports / "layer_bits_tiny-cnn.png").stat().st_size > 0
    exports_md = (reports / "exports.md").read_text()
    assert "## tiny-cnn" in exports_md and exports_md.count("| BayesQ |") == 2  # both budgets
    assert "all matrices bits/w" in exports_md and f"| {bq['avg_bits_all']:.4f} |" in exports_md
    metrics = read_json(reports / "metrics.json")
    assert set(metrics["tiny-cnn"]) >= {"fp_accuracy", "bayesq@3.0", "rtn-tensor@4.0"}
    assert "kl_mean" in metrics["tiny-cnn"]["bayesq@3.0"]
    # 5 BayesQ rows vs all 21 baselines, and BayesQ + BRECQ vs BayesQ; both metrics, both budgets
    paired = read_json(reports / "paired.json")
    bayesq_rows = {"bayesq", "bayesq-distill", "bayesq-ef", "bayesq-paper", "bayesq-brecq"}
    assert {p["baseline"] for p in paired} == set(ALL_METHODS) - bayesq_rows | {"bayesq"}
    assert {p["method"] for p in paired if p["baseline"] == "bayesq"} == {"bayesq-brecq"}
    assert len(paired) == (5 * 21 + 1) * 2 * 2 and "## Paired comparisons on the same test examples" in table_md
    assert all(p["n"] == 100 and p["ci_low"] <= p["diff"] <= p["ci_high"] for p in paired)
    # the fitted prior per layer and the prior-dominated share, as the posterior files hold them
    from bayesq.harness.models.zoo import get_entry
    from flows.finetune import load_model
    from flows.prepare import load_posterior

    posteriors = read_json(results / "posteriors.json")
    assert {(p["method"], p["curvature"]) for p in posteriors} == {("bayesq", "fisher"), ("bayesq-ef", "kfac"),
                                                                          ("bayesq-paper", "fisher")}
    post = load_posterior(load_model(get_entry("tiny-cnn"), models / "tiny-cnn" / "model.safetensors"),
                          results / "posterior" / "tiny-cnn_s17.safetensors")
    diag = next(p for p in posteriors if p["method"] == "bayesq")
    assert diag["prior_precision"] == pytest.approx(post.prior_precision, rel=1e-12)
    assert diag["prior_dominated_share"] == pytest.approx(post.prior_dominated_share())
    post_md = (reports / "posterior.md").read_text()
    assert "prior-dominated" in post_md and all(f"| {layer} |" in post_md for layer in post.prior_precision)


def _check_examples(records, results, fp):
    """The FP test logits and every row's per-example file: KL / agreement / correctness against them."""
    from safetensors.torch import load_file

    logits = load_file(fp["logits_file"])
    assert Path(fp["logits_file"]).parent == results / "examples" and logits["logits"].shape == (100, 4)
    for r in records:
        ex = load_file(r["examples_file"])
        assert Path(r["examples_file"]).name == f"tiny-cnn_{r['method']}_b{r['budget']}_s17.safetensors"
        assert ex["correct"].dtype == torch.uint8 and ex["kl"].dtype == torch.float32
        assert float(ex["correct"].double().mean()) == pytest.approx(r["accuracy"], abs=1e-12)
        assert r["kl_mean"] == pytest.approx(float(ex["kl"].double().mean()), rel=1e-6) and r["kl_se"] > 0
        assert 0 < r["agreement"] <= 1


def _check_lineage(records, runs, results, params_path, models):
    """Exports name their params, posterior (and its sha256), calibration indices and commit; MLflow
    runs carry the commit, params hash and the export / input digests."""
    import json

    from safetensors import safe_open

    from bayesq.export import read_export
    from bayesq.tensorfile import file_sha256
    from flows.common import read_params
    from flows.lineage import git_commit, params_json

    by = {(r["method"], r["budget"]): r for r in records}
    user = read_export(by[("bayesq", 3.0)]["export"]["path"]).user
    post = results / "posterior" / "tiny-cnn_s17.safetensors"
    assert Path(user["posterior"]).resolve() == post.resolve() and user["posterior_sha256"] == file_sha256(post)
    with safe_open(str(post), "pt") as f:
        assert user["calibration_indices"] == ",".join(map(str, f.get_tensor("calibration_indices").tolist()))
    assert user["params"] == params_json(read_params(params_path))
    assert json.loads(user["params"])["quant"]["group_size"] == 32
    assert user["git_commit"].removesuffix("-dirty") == git_commit()
    assert user["checkpoint_sha256"] == file_sha256(models / "tiny-cnn" / "model.safetensors")
    gptq = read_export(by[("gptq", 3.0)]["export"]["path"]).user
    assert gptq["calibration_indices"] == user["calibration_indices"] and gptq["posterior"].startswith("none")
    assert read_export(by[("rtn-group", 3.0)]["export"]["path"]).user["calibration_indices"].startswith("none")
    ef = read_export(by[("bayesq-ef", 3.0)]["export"]["path"]).user
    assert ef["posterior"].endswith("tiny-cnn_s17_kfac.safetensors")
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert parent.data.tags["git_commit"] == git_commit() and parent.data.tags["params_sha256"]
    assert parent.data.tags["git_dirty"] in ("true", "false")
    for run in runs:
        if "mlflow.parentRunId" in run.data.tags:
            r = by[(run.data.params["method"], float(run.data.params["budget"]))]
            assert run.data.tags["export_sha256"] == file_sha256(r["export"]["path"]) == r["export"]["sha256"]


def _check_tracking(records, runs, results):
    """MLflow: the parent named by stage, profile, commit and time; children ``model/method/bB/sS``
    with the effective configuration as parameters, a duration equal to their one-time cost plus
    evaluation, and their files; the loss tables on the parent; the Prefect flow run linked both ways."""
    import re

    import mlflow

    from flows.common import read_json
    from flows.lineage import git_commit
    from flows.tracking import child_run_name

    client = mlflow.tracking.MlflowClient()
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    assert re.fullmatch(rf"quantize-quick-{git_commit()[:7]}-\d{{8}}-\d{{4}}", parent.info.run_name)
    assert read_json(results / "mlflow_run.json")["run_id"] == parent.info.run_id
    by = {(r["method"], r["budget"]): r for r in records}
    children = {r.info.run_name: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert set(children) == {child_run_name("tiny-cnn", m, b, 17) for m, b in by}
    for (method, budget), r in by.items():
        run = children[child_run_name("tiny-cnn", method, budget, 17)]
        assert run.data.params["quant.group_size"] == "32" and "data.split_seed" in run.data.params
        assert ("posterior.curvature" in run.data.params) == method.startswith("bayesq")
        assert run.data.metrics["eval_seconds"] == pytest.approx(r["eval_seconds"])
        spent = 1000 * (r["preprocess_seconds"] + r["eval_seconds"])
        assert run.info.end_time - run.info.start_time == pytest.approx(spent, abs=2)
        files = {a.path for a in client.list_artifacts(run.info.run_id)}
        files |= {a.path for a in client.list_artifacts(run.info.run_id, "export")}
        assert {"layer_bits.json", f"export/{Path(r['export']['path']).name}"} <= files
    assert children[child_run_name("tiny-cnn", "bayesq-ef", 3.0, 17)].data.params["posterior.curvature"] == "kfac"
    assert children[child_run_name("tiny-cnn", "gptq", 3.0, 17)].data.params["variant"] == by[("gptq", 3.0)]["variant"]
    assert "tables/tiny-cnn_s17.parquet" in {a.path for a in client.list_artifacts(parent.info.run_id, "tables")}
    _check_prefect_runs(parent.info.run_id, cached=False)


def _check_prefect_runs(mlflow_run_id: str, cached: bool):
    """The Prefect flow run of that MLflow parent: named by stage, profile and commit, tagged with
    the MLflow run id; its task runs named by method, model, budget and seed; our progress lines
    (and, on a rerun, the cache hits) in its logs."""
    import mlflow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import TaskRunSort
    from prefect.logging.handlers import APILogHandler

    from flows.lineage import git_commit

    flow_id = mlflow.tracking.MlflowClient().get_run(mlflow_run_id).data.tags["prefect_flow_run_id"]
    APILogHandler().flush()  # send the queued log lines
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_id)
        assert flow_run.name == f"quantize-quick-{git_commit()[:7]}"
        assert f"mlflow:{mlflow_run_id}" in flow_run.tags
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_id]}), limit=200,
                                      sort=TaskRunSort.EXPECTED_START_TIME_ASC)
        assert {"bayesq tiny-cnn b3.0 s17", "gptq tiny-cnn b4.0 s17", "posterior tiny-cnn s17 "} <= {t.name for t in tasks}
        logs, where = [], LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_id]))
        while page := client.read_logs(where, limit=200, offset=len(logs)):  # the server's page size
            logs += [log.message for log in page]
    assert any(m.startswith("[quantize] tiny-cnn bayesq ") for m in logs)
    assert any(m.startswith("[task] posterior tiny-cnn s17") and m.endswith("cache hit" if cached else "computed")
               for m in logs)


def test_read_params_misspelled_key_is_clear(tmp_path):
    from flows.common import read_params

    path = tmp_path / "params.yaml"
    path.write_text("calibraton:\n  images: 10\n")
    with pytest.raises(ValueError, match="unknown key 'calibraton' \\(did you mean 'calibration'\\?\\)"):
        read_params(path)


def test_params_yaml_ablation_rows_validate_in_every_profile():
    from flows.ablate import ablation_rows
    from flows.params import load_params

    raw = yaml.safe_load((Path(__file__).parents[1] / "params.yaml").read_text())
    rows = {}
    for profile in raw["profiles"]:
        rows[profile] = [(g, label) for g, label, _, _ in ablation_rows(load_params({**raw, "profile": profile}))]
        assert rows[profile][0][0] == "core"  # the reference row comes first
    assert set(rows["quick"]) < set(rows["full"])  # full adds the exploratory rows to the default ones
    for group in ("objective", "cost terms", "prior", "distillation acceptance"):
        assert any(g == group for g, _ in rows["quick"]), group


def test_ablation_row_method_must_be_one_a_row_can_run(tmp_path):
    from flows.ablate import ablation_rows
    from flows.common import read_params

    params = yaml.safe_load(_params(tmp_path).read_text())
    params["ablations"] = {"rows": {"g": {"r": {"method": "gptq"}}}}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    with pytest.raises(ValueError, match=r"ablations.rows.g.r: method 'gptq' is not one an ablation row can run"):
        ablation_rows(read_params(path))


def test_finetune_flow_unknown_frozen_backbone_names_field(tmp_path):
    from flows.finetune import finetune_flow

    cfg = yaml.safe_load(_params(tmp_path).read_text())
    cfg["finetune"]["frozen_backbone"] = ["lite0-fmnst"]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="finetune.frozen_backbone: unknown model 'lite0-fmnst'.*lite0-fmnist"):
        finetune_flow.fn(path, tmp_path, tmp_path / "models")
    assert not (tmp_path / "models").exists()


def test_get_entry_unknown_model_is_clear():
    from bayesq.harness.models.zoo import get_entry

    with pytest.raises(ValueError, match="unknown model 'lite0-fmnst'.*did you mean 'lite0-fmnist'"):
        get_entry("lite0-fmnst")


def test_ablation_flow_rows_failures_and_report(tmp_path, prefect_harness, tiny_entry):
    from flows.ablate import ablate_flow
    from flows.common import read_json
    from flows.finetune import finetune_flow
    from flows.report.ablations import ablation_report

    params = yaml.safe_load(_params(tmp_path).read_text())
    params["ablations"] = {"budgets": [3.0, 4.0], "rows": {
        "core": {"BayesQ": {}},
        "codebook": {"Lloyd LUT": {"quant.codebook": "lloyd", "quant.rounding": "nearest", "quant.unit_groups": 8},
                     "K-FAC + error feedback": {"posterior.curvature": "kfac", "quant.rounding": "error-feedback"}},
        "distillation": {"always kept": {"method": "bayesq-distill", "distill.accept": False}},
        "broken": {"floor above every candidate": {"allocation.floors": {"*": 16}}},
    }}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))  # row order matters: the first is the core
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "tiny.bin").write_bytes(b"synthetic")
    models, out = tmp_path / "models", tmp_path / "abl"
    finetune_flow(path, raw, models)
    records = ablate_flow(path, raw, models, out)
    ok = [r for r in records if "error" not in r]
    assert len(ok) == 8 and all(r["avg_bits"] <= r["budget"] for r in ok)
    kept = {r["budget"]: r for r in ok if r["row"] == "always kept"}  # distilled at 3.0 (max_budget 3.5) only
    assert kept[3.0]["method"] == "bayesq-distill" and kept[3.0]["distill_accepted"] is True
    assert "distill_seconds" not in kept[4.0]
    paths = {r["export"]["path"] for r in ok}  # one file per row and budget, under the output folder
    assert len(paths) == 8 and all(Path(x).is_relative_to(out / "exports") and Path(x).is_file() for x in paths)
    failed = [r for r in records if "error" in r]
    assert len(failed) == 1 and "at least 16 bits" in failed[0]["error"]
    data = read_json(out / "ablations.json")
    curve = data["diminishing"]["tiny-cnn"]["3.0"]
    assert 0 <= curve["0.2"] <= curve["0.4"] <= curve["0.6"] <= 1
    ablation_report(out / "ablations.json", models, tmp_path / "reports" / "ablations.md")
    md = (tmp_path / "reports" / "ablations.md").read_text()
    for text in ("| **codebook** |", "Lloyd LUT", "failed¹", "at least 16 bits", "Diminishing returns",
                 "Per-layer bit allocation", "`quant.codebook=lloyd`", "Δ KL tiny-cnn @3.0"):
        assert text in md, text
    # every row scored example by example against the FP logits, one folder per row
    files = {r["examples_file"] for r in ok}
    assert len(files) == 8 and all(Path(f).is_relative_to(out / "examples") for f in files)
    assert all(r["kl_mean"] >= 0 and r["kl_se"] >= 0 for r in ok)
    from safetensors.torch import load_file

    from bayesq.comparison import paired_difference
    from flows.report.ablations import ablation_deltas

    at3 = {r["row"]: r for r in ok if r["budget"] == 3.0}
    deltas = ablation_deltas(ok, ("core", "BayesQ"), 3.0)
    for row, group in (("Lloyd LUT", "codebook"), ("always kept", "distillation")):
        mine, core = (load_file(at3[k]["examples_file"]) for k in (row, "BayesQ"))
        assert float(mine["kl"].double().mean()) == pytest.approx(at3[row]["kl_mean"], rel=1e-6)
        for metric, key, scale in (("kl", "kl", 1.0), ("accuracy", "correct", 100.0)):
            want = paired_difference(scale * mine[key].double(), scale * core[key].double())
            assert deltas[("tiny-cnn", group, row)][metric] == pytest.approx(want.as_dict(), rel=1e-9, abs=1e-12)


class TinyEntryB(TinyEntry):
    """A second tiny zoo model (same data, another name and initialisation)."""

    name = "tiny-cnn-b"

    def build(self, pretrained: bool = True) -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))


def register_tiny() -> None:
    """Zoo-file loader of the tiny models (Dask workers run it in their own processes)."""
    register(TinyEntry(), replace=True)
    register(TinyEntryB(), replace=True)


class StallingEntryB(TinyEntryB):
    """``tiny-cnn-b`` whose data loading, if ``BAYESQ_TEST_STALL`` names a file, creates it and
    stalls: a cached task (the posterior) still running, holding its cache-key lock, when the
    test kills the flow."""

    def load_splits(self, data: DataConfig, raw: Path) -> Splits:
        import os
        import time

        marker = os.environ.get("BAYESQ_TEST_STALL")
        if marker:
            Path(marker).touch()
            time.sleep(600)
        return super().load_splits(data, raw)


def register_tiny_stalling() -> None:
    """Like :func:`register_tiny`, with the stalling ``tiny-cnn-b``."""
    register(TinyEntry(), replace=True)
    register(StallingEntryB(), replace=True)


def _called_sources(fn) -> set[Path]:
    """Source files of every Python function called while ``fn()`` runs (sys.setprofile; the
    bodies of modules imported on the way define functions, they are not counted)."""
    import sys

    files: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name != "<module>":
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {Path(f).resolve() for f in files}


def _inside(files: set[Path], excluded: tuple[str, ...]) -> list[str]:
    from flows.common import ROOT

    roots = [(ROOT / e).resolve() for e in excluded]
    return sorted(str(f) for f in files if any(f == r or r in f.parents for r in roots))


def test_row_cache_keys_leave_out_only_sources_the_row_never_runs(tmp_path, tiny_entry):
    """Each method's row (and the preparation tasks) run with a profiler: no function called may
    live in a source that its cache key leaves out, or a change there would not re-run it."""
    from safetensors.torch import save_model

    from bayesq.harness.models.zoo import get_entry
    from flows.common import digest, read_params
    from flows.methods import METHOD_SOURCES, Method
    from flows.prepare import PREP_EXCLUDE, prepare
    from flows.quantize import Row, Source, quantize_eval_task, row_code, row_excluded

    path = _params(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(methods=list(ALL_METHODS), budgets=[3.0])
    path.write_text(yaml.safe_dump(cfg))
    params, raw = read_params(path), tmp_path / "raw"
    raw.mkdir()
    (raw / "tiny.bin").write_bytes(b"synthetic")
    model_file = tmp_path / "model.safetensors"
    save_model(get_entry("tiny-cnn").build(), str(model_file))
    mdig, src = digest(model_file), raw / "tiny.bin"
    direct = lambda label, task, *a, **k: task.fn(*a, **k)  # noqa: E731 (no Prefect: profile our code only)
    out: dict = {}
    called = _called_sources(lambda: out.update(prep=prepare(params, "tiny-cnn", model_file, mdig, src, digest(src),
                                                             17, tmp_path, call=direct)))
    assert not _inside(called, PREP_EXCLUDE)
    _, _, prep, hawq, stats = out["prep"]
    codes = set()
    for method in params.methods:
        p_post, p_tab, p_key, p_quant = prep.get(method, (None, None, "", params.quant))
        spec = Row(Source("tiny-cnn", str(model_file), mdig, str(src), digest(src)), method.value, 3.0, 17,
                   row_code(method), params.data, p_quant, params.allocation, str(tmp_path / "exports"),
                   calibration=params.calibration, baselines=params.baselines, distill=params.distill,
                   robustness=params.robustness, table_key=p_key, posterior_file=p_post and p_post["path"],
                   traces=hawq["traces"] if method == Method.HAWQ else None, stats_file=stats["path"],
                   stats_sha256=stats["sha256"])
        row = lambda: quantize_eval_task.fn(spec, p_tab and p_tab["table"])  # noqa: E731
        called = _called_sources(row)
        assert not _inside(called, row_excluded(method)), method
        if method in METHOD_SOURCES:  # the method's own source is in its key and really runs
            assert _inside(called, METHOD_SOURCES[method]), method
        codes.add(row_code(method))
    assert len(codes) == len(set(METHOD_SOURCES.values())) + 1  # one key per own set of sources, one shared


def test_exclusion_reaches_posterior_statistics_traces_and_every_row(tmp_path, tiny_entry):
    """A model with ``exclude`` in params.yaml: its posterior, statistics and HAWQ traces leave the
    layer out, every method's row keeps it in floating point (the BayesQ row through its posterior,
    the baselines given the patterns), and the patterns key the tasks' caches."""
    import dataclasses

    from prefect.cache_policies import INPUTS
    from prefect.utilities.callables import get_call_parameters
    from safetensors.torch import save_model

    from bayesq.harness.models.zoo import get_entry
    from flows.common import digest, read_params
    from flows.finetune import load_model
    from flows.methods import Method
    from flows.prepare import load_posterior, load_stats, posterior_task, prepare
    from flows.quantize import Row, Source, quantize_eval_task, row_code

    path = _params(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(methods=["bayesq", "hawq", "rtn-group"], budgets=[4.0], exclude={"tiny-cnn": ["7"]})
    cfg["quant"]["select_grids"] = False  # one table: seconds
    path.write_text(yaml.safe_dump(cfg))
    params, raw = read_params(path), tmp_path / "raw"
    assert params.excluded("tiny-cnn") == ("7",)  # the last Linear
    raw.mkdir()
    (raw / "tiny.bin").write_bytes(b"synthetic")
    model_file, src = tmp_path / "model.safetensors", raw / "tiny.bin"
    save_model(get_entry("tiny-cnn").build(), str(model_file))
    mdig, sdig = digest(model_file), digest(src)
    direct = lambda label, task, *a, **k: task.fn(*a, **k)  # noqa: E731
    post, tab, prep, hawq, stats = prepare(params, "tiny-cnn", model_file, mdig, src, sdig, 17, tmp_path, call=direct)
    kept = {"0", "2", "5"}
    model = load_model(get_entry("tiny-cnn"), model_file)
    assert set(load_posterior(model, Path(post["path"])).mean) == kept
    assert set(load_stats(Path(stats["path"]))) == kept and set(hawq["traces"]) == kept
    assert {t.blocks.name for t in tab["table"].layers} == kept
    rows = []
    for method in params.methods:  # as quantize_flow builds them
        p_post, p_tab, p_key, p_quant = prep.get(method, (None, None, "", params.quant))
        row = Row(Source("tiny-cnn", str(model_file), mdig, str(src), sdig), method.value, 4.0, 17, row_code(method),
                  params.data, p_quant, params.allocation, str(tmp_path / "exports"), calibration=params.calibration,
                  baselines=params.baselines, table_key=p_key, posterior_file=p_post and p_post["path"],
                  traces=hawq["traces"] if method == Method.HAWQ else None, stats_file=stats["path"],
                  stats_sha256=stats["sha256"], exclude=params.excluded("tiny-cnn"))
        r = quantize_eval_task.fn(row, p_tab and p_tab["table"], p_tab and p_tab.get("tables"))
        assert set(r["layer_bits"]) == kept and r["exclude"] == ["7"], method
        assert r["avg_bits_all"] > r["avg_bits"]  # the FP layer counts in the all-matrices average only
        rows.append(row)
    # the patterns key the row and the posterior (and so the table, by the posterior's digest)
    key = lambda task, **kw: INPUTS.compute_key(None, get_call_parameters(task.fn, (), kw), {})  # noqa: E731
    assert key(quantize_eval_task, row=rows[0]) != key(quantize_eval_task, row=dataclasses.replace(rows[0], exclude=()))
    args = dict(name="tiny-cnn", model_file=str(model_file), model_digest=mdig, raw=str(src), raw_digest=sdig,
                data=params.data, calibration=params.calibration, posterior=params.posterior, seed=17, out="o",
                code="c")
    assert key(posterior_task, **args, exclude=("7",)) != key(posterior_task, **args)


def _tiny_task_inputs(tmp_path):
    """(params, entry, model_file, src, task args up to ``data``) of the tiny CNN for a prepare task."""
    from safetensors.torch import save_model

    from bayesq.harness.models.zoo import get_entry
    from flows.common import digest, read_params

    params, raw = read_params(_params(tmp_path)), tmp_path / "raw"
    raw.mkdir()
    (raw / "tiny.bin").write_bytes(b"synthetic")
    entry = get_entry("tiny-cnn")
    model_file = tmp_path / "model.safetensors"
    save_model(entry.build(), str(model_file))
    src = raw / "tiny.bin"
    args = ("tiny-cnn", str(model_file), digest(model_file), str(src), digest(src), params.data)
    return params, entry, model_file, src, args


def test_stats_task_round_trip_vs_input_stats(tmp_path, tiny_entry):
    from bayesq.baselines.activations import input_stats
    from bayesq.blocks import quantizable_layers
    from flows.finetune import load_model
    from flows.prepare import calibration_batches, load_stats, stats_task

    params, entry, model_file, src, args = _tiny_task_inputs(tmp_path)
    rec = stats_task.fn(*args, params.calibration, 17, str(tmp_path / "stats"), "code")
    model = load_model(entry, model_file)
    _, batches = calibration_batches(entry, entry.load_splits(params.data, src), params.data, params.calibration, 17)
    want = input_stats(model, batches, quantizable_layers(model))
    got = load_stats(Path(rec["path"]))
    assert set(got) == set(want) and rec["seconds"] > 0
    for k, w in want.items():
        g = got[k]
        assert g.n == w.n and g.H.dtype == w.H.dtype == torch.float32  # the model's dtype (sum_dtype)
        assert torch.equal(g.H, w.H) and torch.equal(g.abs_mean, w.abs_mean) and torch.equal(g.mean, w.mean)
        assert torch.equal(g.abs_max, w.abs_max)


def test_reference_task_round_trip_vs_reference_log_probs(tmp_path, tiny_entry):
    from bayesq.evaluation import predict, reference_log_probs
    from bayesq.settings import replace
    from flows.finetune import load_model
    from flows.prepare import calibration_batches, load_reference, reference_task, selection_batches, shared_cost

    params, entry, model_file, src, args = _tiny_task_inputs(tmp_path)
    rec = reference_task.fn(*args, params.calibration, 17, str(tmp_path / "ref"), "code")
    batches = selection_batches(entry, entry.load_splits(params.data, src), params.data, params.calibration, 17)
    want = reference_log_probs(load_model(entry, model_file), batches)
    got = load_reference(Path(rec["path"]))
    assert len(got) == len(want) > 1 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].dtype == torch.float64 and rec["seconds"] > 0
    # the calibration part: the FP logits of each calibration batch, as predict gives them
    cal = list(calibration_batches(entry, entry.load_splits(params.data, src), params.data, params.calibration, 17)[1])
    logits = load_reference(Path(rec["path"]), "calibration")
    assert len(logits) == len(cal) > 1 and len(cal) != len(got)
    assert all(torch.equal(z, predict(load_model(entry, model_file), [b])) for z, b in zip(logits, cal))
    with pytest.raises(ValueError, match="'selection' and 'calibration'"):
        load_reference(Path(rec["path"]), "test")
    # scored on the calibration inputs: nothing to share
    assert reference_task.fn(*args, replace(params.calibration, selection="calibration"), 17,
                             str(tmp_path / "ref2"), "code") == {}
    # the shared pass counts in every row that read it
    stats = {"seconds": 2.0}
    assert shared_cost({"stats_read": True, "reference_read": True}, stats, rec) == {
        "stats_seconds": 2.0, "reference_seconds": rec["seconds"]}
    assert shared_cost({"stats_read": False, "reference_read": False}, stats, rec) == {}


def test_reprior_task_vs_posterior_task_fit_with_that_prior(tmp_path, tiny_entry):
    from safetensors import safe_open

    from bayesq.settings import replace
    from flows.configs import method_settings
    from flows.methods import Method
    from flows.prepare import posterior_task, reprior_task

    params, entry, model_file, src, args = _tiny_task_inputs(tmp_path)
    base = posterior_task.fn(*args, params.calibration, params.posterior, 17, str(tmp_path / "post"), "c")
    fixed = replace(params.posterior, prior=method_settings(params, Method.BAYESQ_PAPER)[0].prior)
    want = posterior_task.fn(*args, params.calibration, fixed, 17, str(tmp_path / "want"), "c", tag="paper")
    got = reprior_task.fn(*args[:3], base["path"], base["sha256"], fixed, 17, str(tmp_path / "got"), "c", "paper")
    assert got["prior"] == "fixed" and got["prior_precision"] == want["prior_precision"]
    with safe_open(got["path"], "pt") as g, safe_open(want["path"], "pt") as w:
        assert set(g.keys()) == set(w.keys())
        for k in w.keys():  # the base's curvature is saved in float32: variances agree to its rounding
            assert torch.allclose(g.get_tensor(k).double(), w.get_tensor(k).double(), rtol=1e-6, atol=0), k
    with pytest.raises(ValueError, match="posterior_task"):  # a K-FAC base has no diagonal to refit
        kfac = posterior_task.fn(*args, params.calibration, replace(params.posterior, curvature="kfac"), 17,
                                 str(tmp_path / "kfac"), "c", tag="kfac")
        reprior_task.fn(*args[:3], kfac["path"], kfac["sha256"], fixed, 17, str(tmp_path / "k"), "c", "paper")


def test_table_task_candidate_tables_vs_building_each(tmp_path, tiny_entry):
    from bayesq.blocks import layer_blocks, quantizable_layers
    from bayesq.tables import build_table, grid_candidates
    from flows.finetune import load_model
    from flows.prepare import calibration_batches, load_posterior, posterior_task, table_task

    params, entry, model_file, src, args = _tiny_task_inputs(tmp_path)
    post = posterior_task.fn(*args, params.calibration, params.posterior, 17, str(tmp_path / "post"), "c")
    q = params.quant
    rec = table_task.fn(*args[:3], post["path"], post["sha256"], *args[3:], params.calibration, q, 17,
                        str(tmp_path / "tables"), "c")
    model = load_model(entry, model_file)
    blocks = layer_blocks(quantizable_layers(model), q.group_size, q.unit_groups, q.unit.value)
    _, batches = calibration_batches(entry, entry.load_splits(params.data, src), params.data, params.calibration, 17)
    posterior = load_posterior(model, Path(post["path"]))
    cands = grid_candidates(q, held_out=True)
    assert q.selects_grids and set(rec["tables"]) == set(cands) - {"searched"}
    for name, t in {"searched": rec["table"], **rec["tables"]}.items():  # each as encode_best would build it
        want = build_table(posterior, blocks, cands[name], seed=17, model=model, calibration=batches, progress=False)
        assert all(torch.equal(a.unit_loss, b.unit_loss) for a, b in zip(t.layers, want.layers)), name


def test_table_task_reading_stats_file_vs_own_statistics_pass(tmp_path, tiny_entry):
    from flows.prepare import posterior_task, stats_task, table_task

    params, entry, model_file, src, args = _tiny_task_inputs(tmp_path)
    post = posterior_task.fn(*args, params.calibration, params.posterior, 17, str(tmp_path / "post"), "c")
    stats = stats_task.fn(*args, params.calibration, 17, str(tmp_path / "stats"), "c")
    q = params.quant
    assert q.feeds_back_table
    head = (*args[:3], post["path"], post["sha256"], *args[3:], params.calibration, q, 17)
    own = table_task.fn(*head, str(tmp_path / "t1"), "c")
    read = table_task.fn(*head, str(tmp_path / "t2"), "c", stats_file=stats["path"], stats_sha256=stats["sha256"])
    for a, b in zip(own["table"].layers, read["table"].layers):
        assert torch.equal(a.unit_loss, b.unit_loss)
    Path(stats["path"]).write_bytes(b"corrupt")  # the file is what it reads: a broken one fails
    with pytest.raises(Exception):
        table_task.fn(*head, str(tmp_path / "t3"), "c", stats_file=stats["path"], stats_sha256="x")


def _token_entry():
    """MiniLMSentiment whose "sentence" ``"i:xxx"`` of n characters is n tokens: input_ids [i, ..., i],
    right-padded with 0 (no tokenizer)."""
    from bayesq.harness.models.zoo import MiniLMSentiment

    class Tokens(MiniLMSentiment):
        def batches(self, inputs, batch_size, data):
            out = []
            for k in range(0, len(inputs), batch_size):
                part = inputs[k:k + batch_size]
                width = max(len(s) for s in part)
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in part])
                ids = torch.tensor([int(s.split(":")[0]) for s in part])[:, None] * mask
                out.append({"input_ids": ids, "attention_mask": mask})
            return out

    return Tokens()


def test_selection_batches_first_look_a_random_draw_each_look_by_length():
    """The first look's inputs are the draw's first ones (not the shortest sentences), each look
    regrouped by token length, every input once."""
    from bayesq.harness.data.calibration import sample_selection_indices
    from bayesq.harness.models.zoo import Splits
    from bayesq.selection import selection_looks
    from flows.params import CalibrationConfig
    from flows.prepare import selection_batches

    g = torch.Generator().manual_seed(0)
    train = [f"{i}:" + "x" * int(n) for i, n in enumerate(torch.randint(1, 60, (900,), generator=g))]
    splits = Splits(train, torch.zeros(900, dtype=torch.int64), train[:4], torch.zeros(4, dtype=torch.int64))
    cal = CalibrationConfig(sentences=50, batch_size=32, selection_sentences=600)
    batches = selection_batches(_token_entry(), splits, DataConfig(), cal, 17)
    first = selection_looks(batches)
    assert first == 8  # max(256, 600 / 4) inputs in whole batches of 32
    drawn = sample_selection_indices(900, 50, 17, 600).tolist()
    ids = [[int(i) for i in b["input_ids"][:, 0]] for b in batches]
    assert sorted(i for b in ids[:first] for i in b) == sorted(drawn[:256])
    assert sorted(i for b in ids for i in b) == sorted(drawn)
    for look in (batches[:first], batches[first:]):
        lengths = [n for b in look for n in b["attention_mask"].sum(1).tolist()]
        assert lengths == sorted(lengths)
    assert max(len(train[i]) for i in drawn[:256]) > 55  # the first look holds long sentences too


def test_calibration_batches_of_sentences_grouped_by_length_images_in_draw_order(tiny_entry):
    from bayesq.harness.models.zoo import Splits, get_entry
    from flows.params import CalibrationConfig
    from flows.prepare import calibration_batches, calibration_indices

    Tokens = type(_token_entry())

    g = torch.Generator().manual_seed(1)
    train = [f"{i}:" + "x" * int(n) for i, n in enumerate(torch.randint(1, 60, (200,), generator=g))]
    splits = Splits(train, torch.zeros(200, dtype=torch.int64), train[:4], torch.zeros(4, dtype=torch.int64))
    cal = CalibrationConfig(sentences=64, batch_size=8)
    idx, batches = calibration_batches(Tokens(), splits, DataConfig(), cal, 17)
    assert torch.equal(idx, calibration_indices(Tokens(), splits, cal, 17))  # the draw, sorted
    seen = [int(i) for b in batches for i in b["input_ids"][:, 0]]
    assert sorted(seen) == sorted(idx.tolist())  # each input once
    lengths = [b["attention_mask"].sum(1).tolist() for b in batches]
    assert all(x == sorted(x) for x in lengths)  # batches of similar length, cut to their longest ...
    assert all(b["attention_mask"].shape[1] == max(x) for b, x in zip(batches, lengths))
    assert sorted(x[-1] for x in lengths) == [x[-1] for x in sorted(lengths)]  # ... slices of the sorted draw
    assert [x[-1] for x in lengths] != sorted(x[-1] for x in lengths)  # in a shuffled batch order
    drawn = Tokens().batches([train[i] for i in idx.tolist()], 8, DataConfig())
    assert sum(b["attention_mask"].numel() for b in batches) < 0.75 * sum(b["attention_mask"].numel() for b in drawn)
    entry = get_entry("tiny-cnn")  # images: the draw's order
    img_splits = entry.load_splits(DataConfig(), Path("unused"))
    idx, batches = calibration_batches(entry, img_splits, DataConfig(), CalibrationConfig(images=32, batch_size=8), 3)
    want = entry.batches(img_splits.train_inputs[idx], 8, DataConfig())
    assert len(batches) == len(want) and all(torch.equal(a, b) for a, b in zip(batches, want))


def test_selection_batches_draw_the_configured_size_and_fit_inputs_ignore_it(tiny_entry):
    from bayesq.harness.models.zoo import get_entry
    from bayesq.settings import replace
    from flows.params import CalibrationConfig
    from flows.prepare import fit_inputs, selection_batches

    entry, data = get_entry("tiny-cnn"), DataConfig()
    splits = entry.load_splits(data, Path("unused"))  # 300 training inputs
    cal = CalibrationConfig(images=64, batch_size=16, selection_images=100, selection_sentences=7)
    assert sum(len(b) for b in selection_batches(entry, splits, data, cal, 17)) == 100
    big = replace(cal, selection_images=1000)  # the pool runs out: all 236 inputs the calibration draw left
    assert sum(len(b) for b in selection_batches(entry, splits, data, big, 17)) == 300 - 64
    assert selection_batches(entry, splits, data, replace(cal, selection="calibration"), 17) is None
    # the fitting tasks' cache inputs: the same for every selection setting, not for the calibration draw
    assert fit_inputs(cal) == fit_inputs(big) == fit_inputs(replace(cal, selection="calibration"))
    assert fit_inputs(cal) != fit_inputs(replace(cal, images=32))
    assert fit_inputs(cal).images == 64 and fit_inputs(cal).batch_size == 16


def test_ablation_row_label_at_the_limit_survives_dvc_lock_and_longer_is_refused():
    from dvc.utils.serialize import dumps_yaml

    from flows.stage_params import MAX_ROW_LABEL, AblationConfig

    def lock_round_trip(label: str) -> bool:  # nested as deep as params.yaml's full profile puts a row in dvc.lock
        lock = {"stages": {"ablate": {"params": {"params.yaml": {"profiles": {"full": {"ablations": {
            "rows": {"group": {label: {}}}}}}}}}}}
        try:
            return yaml.safe_load(dumps_yaml(lock)) == lock
        except yaml.YAMLError:
            return False

    words = ("posterior grid rounding " * 10)
    assert lock_round_trip(words[:MAX_ROW_LABEL].strip().ljust(MAX_ROW_LABEL, "x"))
    assert not lock_round_trip(words[:MAX_ROW_LABEL + 15])  # what DVC did to a 75-character label
    AblationConfig(rows={"group": {"x" * MAX_ROW_LABEL: {}}})
    with pytest.raises(ValueError, match=f"at most {MAX_ROW_LABEL} characters.*shorten the label"):
        AblationConfig(rows={"group": {words[:MAX_ROW_LABEL + 1]: {}}})


def test_load_model_image_entry_channels_last_vs_saved_model(tmp_path):
    from safetensors.torch import save_model

    from bayesq.harness.models.zoo import get_entry
    from flows.finetune import load_model

    entry = get_entry("lite0-fmnist")
    torch.manual_seed(0)
    saved = entry.build(pretrained=False).eval()
    save_model(saved, str(tmp_path / "m.safetensors"))
    model = load_model(entry, tmp_path / "m.safetensors")
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), model.state_dict().values()))
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        assert torch.allclose(model(x), saved(x), rtol=0, atol=1e-4)


def test_predict_in_padding_order_vs_input_order():
    from transformers import BertConfig, BertForSequenceClassification

    from bayesq.evaluation import predict
    from bayesq.harness.models.zoo import MiniLMSentiment
    from flows.robustness import _predict_in_padding_order

    entry = MiniLMSentiment()
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=entry.tokenizer.vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2)).double().eval()
    words = ["good", "bad", "a", "film", "plot", "the", "really", "not"]
    g = torch.Generator().manual_seed(1)
    sentences = [" ".join(words[i] for i in torch.randint(0, 8, (int(n),), generator=g))
                 for n in torch.randint(1, 30, (40,), generator=g)]
    data = DataConfig(text_max_length=64)
    got = _predict_in_padding_order(entry, model, sentences, data, batch_size=8)
    want = predict(model, entry.batches(sentences, 8, data))  # input order: batches padded to a random longest
    assert not torch.equal(entry.padding_order(sentences), torch.arange(40))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
