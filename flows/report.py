"""DVC stage `report`: main table, accuracy-bit frontiers and DVC metrics from the results.

    python -m flows.report --results results/results.json --models models --out reports

Writes ``main_table.md``, ``frontier_<model>.png`` and ``metrics.json``.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from flows.common import read_json, write_json

METHOD_LABEL = {"bayesq": "BayesQ", "rtn-tensor": "RTN per-tensor", "rtn-channel": "RTN per-channel",
                "rtn-group": "RTN per-group (g64)"}


def summarise(records: list[dict]) -> dict:
    """{model: {method: {budget: {accuracy, accuracy_sd, avg_bits, n_seeds}}}} averaged over seeds."""
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
            "n_seeds": len(rs),
        }
    return out


def main_table(summary: dict, fp: dict[str, dict], budgets: list[float]) -> str:
    lines = ["# Main table: top-1 accuracy (%) at matched true average bits", "",
             "Each cell: accuracy, then the true average bits per quantised weight (payload, "
             "scales, zero-points and bit-width headers all counted). Mean over seeds "
             "(± SD when more than one).", ""]
    for model, methods in summary.items():
        seeds = max(v["n_seeds"] for m in methods.values() for v in m.values())
        lines += [f"## {model}", "", f"Seeds: {seeds}. FP accuracy: {100 * fp[model]['fp_accuracy']:.2f}% "
                  f"on {fp[model]['n_test']} test examples.", ""]
        lines.append("| method | " + " | ".join(f"{b:.1f} bits" for b in budgets) + " |")
        lines.append("|---|" + "---|" * len(budgets))
        lines.append("| FP (32-bit) | " + " | ".join(f"{100 * fp[model]['fp_accuracy']:.2f}" for _ in budgets) + " |")
        for method, label in METHOD_LABEL.items():
            if method not in methods:
                continue
            cells = []
            for b in budgets:
                v = methods[method].get(b)
                if v is None:
                    cells.append("–")
                    continue
                sd = f" ± {100 * v['accuracy_sd']:.2f}" if v["n_seeds"] > 1 else ""
                cells.append(f"{100 * v['accuracy']:.2f}{sd} ({v['avg_bits']:.3f} b)")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def frontier_plot(model: str, methods: dict, fp_acc: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for method, label in METHOD_LABEL.items():
        if method not in methods:
            continue
        pts = sorted((v["avg_bits"], 100 * v["accuracy"], 100 * v["accuracy_sd"]) for v in methods[method].values())
        xs, ys, sds = zip(*pts)
        ax.errorbar(xs, ys, yerr=sds, marker="s" if method == "bayesq" else "o", capsize=3, label=label)
    ax.axhline(100 * fp_acc, color="gray", ls="--", lw=1, label="FP")
    ax.set_xlabel("true average bits per weight")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(model)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(results: Path, models: Path, out: Path) -> None:
    records = read_json(results)
    summary = summarise(records)
    budgets = sorted({r["budget"] for r in records})
    fp = {m: read_json(Path(models) / m / "fp.json") for m in summary}
    out.mkdir(parents=True, exist_ok=True)
    (out / "main_table.md").write_text(main_table(summary, fp, budgets))
    for model, methods in summary.items():
        frontier_plot(model, methods, fp[model]["fp_accuracy"], out / f"frontier_{model}.png")
    metrics = {
        model: {"fp_accuracy": fp[model]["fp_accuracy"],
                **{f"{method}@{b}": {"accuracy": v["accuracy"], "avg_bits": v["avg_bits"]}
                   for method, per in methods.items() for b, v in per.items()}}
        for model, methods in summary.items()
    }
    write_json(out / "metrics.json", metrics)


def ablation_table(records: list[dict], fp: dict[str, dict]) -> str:
    """The paper's ablation layout: one row per variant, accuracy per model and budget."""
    models = list(dict.fromkeys(r["model"] for r in records))
    budgets = sorted({r["budget"] for r in records})
    cell = {(r["model"], r["group"], r["row"], r["budget"]): r for r in records}
    rows = list(dict.fromkeys((r["group"], r["row"]) for r in records))
    base = rows[0]
    lines = [
        "# Ablations: BayesQ with one component switched per row", "",
        "Top-1 accuracy (%) at matched true average bits (payload, scales, zero-points, look-up "
        "tables and headers counted); in brackets the difference to the first row "
        f"(\"{base[1]}\"). One seed; the accuracy's standard error is about "
        + ", ".join(f"{100 * ((fp[m]['fp_accuracy'] * (1 - fp[m]['fp_accuracy'])) / fp[m]['n_test']) ** 0.5:.2f}"
                    f" points on {m}" for m in models)
        + ". Every row's true average bits are in `results-ablations/ablations.json`.", "",
    ]
    head = " | ".join(f"{m} {b:.1f}" for m in models for b in budgets)
    lines += [f"| group | variant | {head} | overrides |", "|---|---|" + "---|" * (len(models) * len(budgets)) + "---|"]
    lines.append("| FP | full precision | " + " | ".join(
        f"{100 * fp[m]['fp_accuracy']:.2f}" for m in models for _ in budgets) + " | |")
    for group, label in rows:
        cells, over = [], ""
        for m in models:
            for b in budgets:
                r = cell.get((m, group, label, b))
                ref = cell.get((m, *base, b))
                if r is None:
                    cells.append("–")
                    continue
                over = ", ".join(f"`{k}={v}`" for k, v in r["overrides"].items())
                delta = f" ({100 * (r['accuracy'] - ref['accuracy']):+.2f})" if ref and (group, label) != base else ""
                cells.append(f"{100 * r['accuracy']:.2f}{delta}")
        lines.append(f"| {group} | {label} | " + " | ".join(cells) + f" | {over} |")
    lines.append("")
    return "\n".join(lines)


def ablation_report(results: Path, models: Path, out: Path) -> None:
    records = read_json(results)
    fp = {m: read_json(Path(models) / m / "fp.json") for m in {r["model"] for r in records}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(ablation_table(records, fp))


def main() -> None:
    p = argparse.ArgumentParser(description="Write the reports from the quantisation results")
    p.add_argument("--results", type=Path, help="results.json of the quantize stage")
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ablations", type=Path, help="ablations.json: write <out>/ablations.md only")
    a = p.parse_args()
    if a.ablations:
        ablation_report(a.ablations, a.models, a.out / "ablations.md")
    elif a.results:
        report(a.results, a.models, a.out)
    else:
        p.error("pass --results (main table) or --ablations (ablation table)")


if __name__ == "__main__":
    main()
