"""DVC stage `report`: main table, accuracy-bit frontiers and DVC metrics from the results.

    python -m flows report --results results/results.json --models models --out reports

Writes ``main_table.md`` (with every row's KL to the FP model and agreement, and the paired
comparisons of the BayesQ rows with GPTQ and RTN per-group on the same test examples),
``paired.json`` (those comparisons), ``exports.md`` (file sizes next to the accounted bits),
``posterior.md`` (the fitted prior precisions and prior-dominated share per model, from
``posteriors.json`` next to the results), ``frontier_<model>.png`` and ``metrics.json``; with
``--summary docs/results.md`` also the one-page summary the README links to (:func:`flows.report.summary.results_summary`).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from flows.common import read_json, write_json
from flows.report.ablations import ablation_report
from flows.report.figures import frontier_plot
from flows.report.paired import paired_comparisons, paired_table
from flows.report.summary import results_summary
from flows.report.tables import FIDELITY_KEYS, export_table, fidelity_table, main_table, posterior_table
from flows.robustness_report import robustness_report
from flows.timings import timings_markdown
from flows.tracking import log_reports


def summarise(records: list[dict]) -> dict:
    """{model: {method: {budget: {accuracy, accuracy_sd, avg_bits, n_seeds, ...}}}} averaged over
    seeds; ``ece`` / ``worst10`` / ``cvar95`` and ``kl_mean`` / ``kl_se`` / ``agreement`` when every
    seed's record has them."""
    groups: dict = defaultdict(list)
    for r in records:
        groups[(r["model"], r["method"], r["budget"])].append(r)
    out: dict = defaultdict(lambda: defaultdict(dict))
    for (model, method, budget), rs in sorted(groups.items()):
        accs = [r["accuracy"] for r in rs]
        out[model][method][budget] = {
            "accuracy": statistics.fmean(accs),
            "accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "avg_bits": statistics.fmean(r["avg_bits"] for r in rs),
            "seconds": statistics.fmean(r.get("preprocess_seconds", r["quantize_seconds"]) for r in rs),
            "n_seeds": len(rs),
            **{k: statistics.fmean(r["calibration"][k] for r in rs) for k in ("ece", "worst10", "cvar95")
               if all(r.get("calibration") for r in rs)},
            **{k: statistics.fmean(r[k] for r in rs) for k in FIDELITY_KEYS if all(k in r for r in rs)},
        }
    return out


def report(results: Path, models: Path, out: Path, summary_file: Path | None = None,
           sources: Path | None = None) -> None:
    """Every report of ``results`` (the quantize stage's) in ``out``; with ``sources`` (the
    sources stage's ``sources.md``) also ``<out>/sources.md``, the user models' table."""
    everything = read_json(results)
    records = [r for r in everything if r["method"] != "fp"]  # FP rows: the robustness reference
    summary = summarise(records)
    budgets = sorted({r["budget"] for r in records})
    fp = {m: read_json(Path(models) / m / "fp.json") for m in summary}
    out.mkdir(parents=True, exist_ok=True)
    if sources is not None:
        (out / "sources.md").write_text(Path(sources).read_text())
    paired, notes = paired_comparisons(records, Path(results).parent)
    write_json(out / "paired.json", paired)
    (out / "main_table.md").write_text("\n".join((main_table(summary, fp, budgets, records), fidelity_table(summary, budgets),
                                                  paired_table(paired, notes))))
    (out / "exports.md").write_text(export_table(records))
    posteriors = Path(results).parent / "posteriors.json"
    (out / "posterior.md").write_text(posterior_table(read_json(posteriors) if posteriors.exists() else []))
    timings_file = Path(results).parent / "timings.json"
    timings = read_json(timings_file) if timings_file.exists() else None
    (out / "timings.md").write_text(timings_markdown(timings) if timings else
                                    "# Quantize stage: wall time per task\n\nNo `timings.json` next to the results.\n")
    if summary_file is not None:
        Path(summary_file).parent.mkdir(parents=True, exist_ok=True)
        run_file = Path(results).parent / "mlflow_run.json"
        run_name = read_json(run_file).get("run_name") if run_file.exists() else None
        Path(summary_file).write_text(results_summary(summary, fp, paired, timings, records, run_name))
    for model, methods in summary.items():
        frontier_plot(model, methods, fp[model]["fp_accuracy"], out / f"frontier_{model}.png", fp[model]["n_test"])
    robustness_report(everything, out)
    metrics = {
        model: {"fp_accuracy": fp[model]["fp_accuracy"],
                **{f"{method}@{b}": {k: v[k] for k in ("accuracy", "avg_bits", "seconds", "ece", "worst10", "cvar95",
                                                          "kl_mean", "agreement") if k in v}
                   for method, per in methods.items() for b, v in per.items()}}
        for model, methods in summary.items()
    }
    write_json(out / "metrics.json", metrics)
    written = sorted(p for p in out.iterdir() if p.is_file() and p.name != "ablations.md")  # that one: the ablate run's
    log_reports(Path(results).parent / "mlflow_run.json", written)


def main() -> None:
    p = argparse.ArgumentParser(description="Write the reports from the quantisation results")
    p.add_argument("--results", type=Path, help="results.json of the quantize stage")
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ablations", type=Path, help="ablations.json: write <out>/ablations.md only")
    p.add_argument("--summary", type=Path, help="also write the results summary here (docs/results.md)")
    p.add_argument("--sources", type=Path, help="the sources stage's sources.md: copied to <out>/sources.md")
    a = p.parse_args()
    if a.ablations:
        ablation_report(a.ablations, a.models, a.out / "ablations.md")
    elif a.results:
        report(a.results, a.models, a.out, a.summary, a.sources)
    else:
        p.error("pass --results (main table) or --ablations (ablation table)")


if __name__ == "__main__":
    main()
