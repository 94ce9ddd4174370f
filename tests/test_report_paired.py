"""flows.report's paired comparisons and fidelity columns on a hand-made results folder."""

import zlib

import pytest
import torch

from bayesq.comparison import fidelity_summary, paired_difference
from bayesq.tensorfile import save_tensors
from flows.common import read_json, write_json
from flows.methods import METHOD_LABEL

N = 60


def _arrays(seed: int, p_correct: float) -> dict:
    g = torch.Generator().manual_seed(seed)
    kl = 0.05 * torch.rand(N, generator=g, dtype=torch.float64)
    return {"correct": (torch.rand(N, generator=g) < p_correct).to(torch.uint8), "kl": kl.float(),
            "agree": (torch.rand(N, generator=g) < 0.9).to(torch.uint8)}


def _record(results, method: str, budget: float, seed: int, p_correct: float, with_examples: bool = True) -> dict:
    r = {"model": "m", "method": method, "budget": budget, "seed": seed, "avg_bits": budget - 0.1,
         "quantize_seconds": 1.0}
    arrays = _arrays(zlib.crc32(f"{method}/{budget}/{seed}".encode()), p_correct)
    r["accuracy"] = float(arrays["correct"].double().mean())
    if with_examples:
        path = results / "examples" / f"m_{method}_b{budget}_s{seed}.safetensors"
        save_tensors(path, arrays)
        s = fidelity_summary(arrays["kl"].double(), arrays["agree"].bool())
        r.update(s.as_dict(), examples_file=str(path))
    return r, arrays


def _folder(tmp_path, seeds=(17,), with_examples=True):
    results, models = tmp_path / "results", tmp_path / "models"
    write_json(models / "m" / "fp.json", {"fp_accuracy": 0.9, "n_test": N})
    fp = {"model": "m", "method": "fp", "budget": 32.0, "seed": 17, "accuracy": 0.9, "avg_bits": 32.0}
    records, arrays = [fp], {}
    for seed in seeds:
        for budget in (3.0, 4.0):
            for method, p in (("bayesq", 0.8), ("bayesq-ef", 0.75), ("gptq", 0.6), ("rtn-group", 0.4), ("awq", 0.5)):
                r, a = _record(results, method, budget, seed, p, with_examples)
                records.append(r)
                arrays[(method, budget, seed)] = a
    write_json(results / "results.json", records)
    return results, models, arrays


def test_report_paired_json_schema_and_vs_library(tmp_path):
    from flows.report import report

    results, models, arrays = _folder(tmp_path)
    report(results / "results.json", models, tmp_path / "reports")
    paired = read_json(tmp_path / "reports" / "paired.json")
    assert len(paired) == 2 * 2 * 3 * 2  # budgets x methods x baselines (gptq, awq, rtn-group: every one run) x metrics
    for row in paired:
        assert set(row) == {"model", "budget", "method", "baseline", "metric", "diff", "ci_low", "ci_high",
                            "n", "seeds"}
        assert row["method"] in ("bayesq", "bayesq-ef") and row["baseline"] in ("gptq", "awq", "rtn-group")
        assert row["metric"] in ("kl", "accuracy") and row["n"] == N and row["seeds"] == [17]
        assert row["ci_low"] <= row["diff"] <= row["ci_high"]
        key = "correct" if row["metric"] == "accuracy" else "kl"
        a = arrays[(row["method"], row["budget"], 17)][key].double()
        b = arrays[(row["baseline"], row["budget"], 17)][key].double()
        ref = paired_difference(a, b, scale=100.0 if row["metric"] == "accuracy" else 1.0)
        assert (row["diff"], row["ci_low"], row["ci_high"]) == pytest.approx(
            (ref.diff, ref.ci_low, ref.ci_high), rel=1e-12, abs=1e-12)
    md = (tmp_path / "reports" / "main_table.md").read_text()
    assert "## Paired comparisons on the same test examples" in md and "One seed: 17" in md
    assert "## Fidelity to the FP model" in md
    fid = next(line for line in md.splitlines() if line.startswith("| BayesQ |") and "%)" in line)
    s = fidelity_summary(arrays[("bayesq", 3.0, 17)]["kl"].double(), arrays[("bayesq", 3.0, 17)]["agree"].bool())
    assert f"{s.kl_mean:.3g} ± {s.kl_se:.2g} ({100 * s.agreement:.2f}%)" in fid
    metrics = read_json(tmp_path / "reports" / "metrics.json")
    assert {"kl_mean", "agreement"} <= set(metrics["m"]["bayesq@3.0"])


def test_report_pools_seeds_by_averaging_examples(tmp_path):
    from flows.report.paired import paired_comparisons

    results, _, arrays = _folder(tmp_path, seeds=(17, 29))
    rows, notes = paired_comparisons(read_json(results / "results.json"), results, resamples=500)
    row = next(r for r in rows
               if (r["method"], r["baseline"], r["budget"], r["metric"]) == ("bayesq", "gptq", 4.0, "accuracy"))
    assert row["seeds"] == [17, 29] and not notes

    def mean(method):
        return (arrays[(method, 4.0, 17)]["correct"].double() + arrays[(method, 4.0, 29)]["correct"].double()) / 2

    ref = paired_difference(mean("bayesq"), mean("gptq"), resamples=500, scale=100.0)
    assert (row["diff"], row["ci_low"], row["ci_high"]) == pytest.approx((ref.diff, ref.ci_low, ref.ci_high), rel=1e-12)


def test_report_renders_records_without_per_example_keys(tmp_path):
    from flows.report import report

    results, models, _ = _folder(tmp_path, with_examples=False)
    report(results / "results.json", models, tmp_path / "reports")
    assert read_json(tmp_path / "reports" / "paired.json") == []
    md = (tmp_path / "reports" / "main_table.md").read_text()
    assert "No paired comparison" in md and "have no per-example file" in md
    assert "written before per-example evaluation" in md and "## m" in md


def test_report_skips_rows_whose_example_file_is_gone(tmp_path):
    from flows.report.paired import paired_comparisons

    results, _, _ = _folder(tmp_path)
    (results / "examples" / "m_gptq_b3.0_s17.safetensors").unlink()
    rows, notes = paired_comparisons(read_json(results / "results.json"), results, resamples=100)
    assert not any(r["baseline"] == "gptq" and r["budget"] == 3.0 for r in rows)
    assert any(r["baseline"] == "rtn-group" and r["budget"] == 3.0 for r in rows)
    assert "m/gptq/b3.0/s17" in notes[0]


def test_example_file_found_in_moved_results_folder(tmp_path):
    from flows.report.paired import example_file

    results, _, _ = _folder(tmp_path)
    r = next(r for r in read_json(results / "results.json") if r["method"] == "bayesq")
    moved = tmp_path / "elsewhere"
    results.rename(moved)
    assert example_file(r, moved) == moved / "examples" / "m_bayesq_b3.0_s17.safetensors"
    assert example_file({k: v for k, v in r.items() if k != "examples_file"}, moved) is None


def test_variant_lines_name_baseline_variants_and_bayesq_grids():
    from flows.report.tables import variant_lines

    records = [
        {"model": "m", "method": "gptq", "budget": 3.0, "seed": 1, "variant": "allocation+bc"},
        {"model": "m", "method": "bayesq", "budget": 3.0, "seed": 1, "encoding": "minmax",
         "encoding_kl": {"searched": 0.2, "minmax": 0.1}, "encoding_margin": {"searched": [0.05, 0.15]},
         "encoding_inputs": {"minmax": 2000, "searched": 2000}},
        {"model": "m", "method": "bayesq", "budget": 3.5, "seed": 1, "encoding": "searched",  # first look only
         "encoding_kl": {"searched": 0.1, "searched-plain": 0.2}, "encoding_margin": {"searched-plain": [0.02, 0.2]},
         "encoding_inputs": {"searched": 500, "searched-plain": 500}},
        {"model": "m", "method": "bayesq", "budget": 4.0, "seed": 1, "encoding": "searched",  # held out
         "encoding_kl": {"searched": 0.1, "searched-plain": 0.1}, "encoding_margin": {"searched-plain": [-0.01, 0.01]}},
        {"model": "m", "method": "bayesq-paper", "budget": 3.0, "seed": 1, "encoding": "searched",
         "encoding_kl": {}},  # one candidate: nothing was chosen
        {"model": "other", "method": "gptq", "budget": 3.0, "seed": 1, "variant": "mixed"},
    ]
    lines = variant_lines(records, "m")
    assert len(lines) == 2
    assert lines[0].startswith("GPTQ") and lines[0].endswith("3.0 bits: allocation+bc.")
    assert "least KL on the selection inputs" in lines[0]
    assert "3.0 bits: minmax (searched − minmax [+0.05000, +0.15000] on 2000 inputs)" in lines[1]
    assert "3.5 bits: searched (searched-plain − searched [+0.02000, +0.20000] on 500 inputs)" in lines[1]
    assert "4.0 bits: searched (searched-plain − searched [-0.01000, +0.01000])." in lines[1]
    assert "unless the other candidate's KL on the selection inputs is lower by a resolved margin" in lines[1]


def test_results_summary_numbers_vs_paired_json_and_records(tmp_path):
    from flows.report import report

    results, models, _ = _folder(tmp_path)
    write_json(results / "timings.json", [{"task": "posterior m s17", "seconds": 90.0, "cached": False},
                                          {"task": "bayesq m b3.0 s17", "seconds": 30.0, "cached": True}])
    write_json(results / "mlflow_run.json", {"run_id": "x", "run_name": "quantize-quick-abc1234-20261127-0100",
                                             "experiment_id": "1"})
    report(results / "results.json", models, tmp_path / "reports", tmp_path / "docs" / "results.md")
    text = (tmp_path / "docs" / "results.md").read_text()
    paired = read_json(tmp_path / "reports" / "paired.json")
    records = {(r["method"], r["budget"]): r for r in read_json(results / "results.json") if r["method"] != "fp"}
    for budget in (3.0, 4.0):
        kl = next(r for r in paired if r["budget"] == budget and r["method"] == "bayesq" and r["baseline"] == "gptq"
                  and r["metric"] == "kl")
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| m | {budget:.1f} |"))
        assert f"{records[('bayesq', budget)]['kl_mean']:.3g}" in line
        assert f"{kl['diff']:+.3g} [{kl['ci_low']:+.3g}, {kl['ci_high']:+.3g}]" in line
        assert f"{100 * records[('gptq', budget)]['accuracy']:.2f} ({records[('gptq', budget)]['avg_bits']:.3f} b)" in text
        rivals = {m: r["kl_mean"] for (m, b), r in records.items() if b == budget and m in ("gptq", "awq", "rtn-group")}
        best = min(rivals, key=rivals.get)
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| m | {budget:.1f} | {METHOD_LABEL[best]} |"))
        diff = next(r for r in paired if r["budget"] == budget and r["method"] == "bayesq" and r["baseline"] == best
                    and r["metric"] == "kl")
        assert f"| {rivals[best]:.3g} | {diff['diff']:+.3g} [{diff['ci_low']:+.3g}, {diff['ci_high']:+.3g}]" in line
    assert "quantize-quick-abc1234-20261127-0100" in text
    assert "2 task calls, 2.0 min (1 computed, 1 cache hits)" in text and "posterior m s17 90 s" in text
