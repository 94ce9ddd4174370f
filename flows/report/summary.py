"""The one-page results summary the README links to (``docs/results.md``)."""

from __future__ import annotations

from flows.labels import ci_text
from flows.methods import METHOD_LABEL
from flows.report.paired import PAIRED_BASELINES
from flows.report.tables import time_ratio


def strongest_rival(methods: dict, budget: float) -> str | None:
    """The baseline of :data:`PAIRED_BASELINES` with the least mean KL at ``budget`` in one model's
    ``methods`` (method -> budget -> summary with ``kl_mean``); None when none has one."""
    kls = {m: methods[m][budget]["kl_mean"] for m in PAIRED_BASELINES
           if budget in methods.get(m, {}) and methods[m][budget].get("kl_mean") is not None}
    return min(kls, key=kls.get) if kls else None


def results_summary(summary: dict, fp: dict[str, dict], paired: list[dict], timings: list[dict] | None,
                    records: list[dict], run_name: str | None = None) -> str:
    """Markdown for ``docs/results.md``: per model and budget, BayesQ's KL to the FP model next to
    GPTQ's and the paired differences to GPTQ and RTN per group (from ``paired``, the rows of
    :func:`paired_comparisons`), accuracy of every method, the one-time cost ratio and the quantize
    stage's wall time (``timings``); ``run_name``: the quantize stage's MLflow parent run
    (``quantize-<profile>-<commit7>-<time>``). Every number comes from the run's files."""
    cell = {(r["model"], r["budget"], r["method"], r["baseline"], r["metric"]): r for r in paired}
    seeds = sorted({r["seed"] for r in records})
    lines = ["# Results", "",
             "Written by the report stage (`python -m flows report`, run by `make run`) from `results/results.json`: "
             "do not edit by hand. Full tables in [`reports/`](../reports/main_table.md); what each method and "
             "number means in [`method.md`](method.md).", "",
             f"Models: {', '.join(summary)}; seeds: {', '.join(map(str, seeds))}; "
             f"{len(records)} rows" + (f"; MLflow run `{run_name}` (profile and commit in its name)." if run_name
                                       else "."), "",
             "## BayesQ against the strongest GPTQ and RTN per group, paired on the same test examples", "",
             "KL(p_FP ‖ p_Q) in nats (mean over test examples; negative Δ: BayesQ is closer to the FP model) and "
             "top-1 accuracy in points; brackets: 95 % paired-bootstrap interval over test examples, * when it "
             "excludes 0.", "",
             "| model | bits | BayesQ KL | GPTQ KL | BayesQ − GPTQ: KL | BayesQ − GPTQ: accuracy "
             "| BayesQ − RTN per group: KL |", "|---|---|---|---|---|---|---|"]
    for model, methods in summary.items():
        for budget in sorted(methods.get("bayesq", {})):
            kl = {m: methods.get(m, {}).get(budget, {}).get("kl_mean") for m in ("bayesq", "gptq")}
            diffs = [cell.get((model, budget, "bayesq", base, metric)) for base, metric in
                     (("gptq", "kl"), ("gptq", "accuracy"), ("rtn-group", "kl"))]
            fmts = ("+.3g", "+.2f", "+.3g")
            lines.append(f"| {model} | {budget:.1f} | " + " | ".join("–" if v is None else f"{v:.3g}" for v in kl.values())
                         + " | " + " | ".join("–" if d is None else ci_text(d, f) for d, f in zip(diffs, fmts)) + " |")
    lines += ["", "## BayesQ against the strongest rival by KL", "",
              "The baseline row with the least mean KL to the FP model at each model and budget, among every one "
              "this run has (`reports/paired.json` holds BayesQ against each of them).", "",
              "| model | bits | strongest rival | its KL | BayesQ − it: KL | BayesQ − it: accuracy |",
              "|---|---|---|---|---|---|"]
    for model, methods in summary.items():
        for budget in sorted(methods.get("bayesq", {})):
            rival = strongest_rival(methods, budget)
            if rival is None:
                continue
            diffs = [cell.get((model, budget, "bayesq", rival, metric)) for metric in ("kl", "accuracy")]
            lines.append(f"| {model} | {budget:.1f} | {METHOD_LABEL.get(rival, rival)} | "
                         f"{methods[rival][budget]['kl_mean']:.3g} | "
                         + " | ".join("–" if d is None else ci_text(d, f) for d, f in zip(diffs, ("+.3g", "+.2f"))) + " |")
    lines += ["", "## Accuracy (%) and true average bits", ""]
    for model, methods in summary.items():
        budgets = sorted({b for per in methods.values() for b in per})
        lines += [f"### {model}", "", f"FP: {100 * fp[model]['fp_accuracy']:.2f} % on {fp[model]['n_test']:,} test "
                  "examples.", "", "| method | " + " | ".join(f"{b:.1f} bits" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        for method, label in METHOD_LABEL.items():
            if method in methods:
                lines.append(f"| {label} | " + " | ".join(
                    "–" if b not in methods[method] else
                    f"{100 * methods[method][b]['accuracy']:.2f} ({methods[method][b]['avg_bits']:.3f} b)"
                    for b in budgets) + " |")
        ratio = time_ratio(methods, "bayesq", "gptq")
        if ratio is not None:
            lines += ["", f"One-time cost, BayesQ / GPTQ (wall seconds in this run, mean over budgets): {ratio:.2f}×."]
        lines.append("")
    if timings:
        computed = [t for t in timings if not t["cached"]]
        slowest = sorted(timings, key=lambda t: -t["seconds"])[:5]
        lines += ["## Time", "",
                  f"Quantize stage: {len(timings)} task calls, {sum(t['seconds'] for t in timings) / 60:.1f} min "
                  f"({len(computed)} computed, {len(timings) - len(computed)} cache hits). Slowest: "
                  + "; ".join(f"{t['task']} {t['seconds']:.0f} s" for t in slowest)
                  + ". Every task: [`reports/timings.md`](../reports/timings.md).", ""]
    return "\n".join(lines)
