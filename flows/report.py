"""DVC stage `report`: main table, accuracy-bit frontiers and DVC metrics from the results.

    python -m flows.report --results results/results.json --models models --out reports

Writes ``main_table.md``, ``exports.md`` (file sizes next to the accounted bits),
``frontier_<model>.png`` and ``metrics.json``.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from flows.common import read_json, write_json

METHOD_LABEL = {"bayesq": "BayesQ", "bayesq-distill": "BayesQ + distillation", "bayesq-ef": "BayesQ + EF (K-FAC)",
                "gptq": "GPTQ (g64, act-order)",
                "awq": "AWQ (g64)", "hawq": "HAWQ-style (per layer)", "aciq": "ACIQ (per channel)",
                "rtn-tensor": "RTN per-tensor", "rtn-channel": "RTN per-channel", "rtn-group": "RTN per-group (g64)"}


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
            "seconds": statistics.fmean(r.get("preprocess_seconds", r["quantize_seconds"]) for r in rs),
            "n_seeds": len(rs),
            **{k: statistics.fmean(r["calibration"][k] for r in rs) for k in ("ece", "worst10", "cvar95")
               if all(r.get("calibration") for r in rs)},
        }
    return out


def _time_ratio(methods: dict, a: str, b: str) -> float | None:
    """Mean over budgets of the one-time cost of method ``a`` over that of ``b``."""
    ratios = [methods[a][x]["seconds"] / methods[b][x]["seconds"] for x in methods.get(a, {})
              if x in methods.get(b, {}) and methods[b][x]["seconds"] > 0]
    return statistics.fmean(ratios) if ratios else None


def main_table(summary: dict, fp: dict[str, dict], budgets: list[float]) -> str:
    lines = ["# Main table: top-1 accuracy (%) at matched true average bits", "",
             "Each cell: accuracy, then the true average bits per quantised weight (payload, "
             "scales, zero-points, stored AWQ scales and bit-width headers all counted). Mean over "
             "seeds (± SD when more than one). Single-bit-width baselines meet fractional budgets "
             "with their own mixed rule (greedy knapsack over their own error proxy, README). "
             "Time: the method's one-time cost in wall seconds (BayesQ: posterior + loss table + "
             "allocation and encoding; GPTQ / AWQ: input statistics + solve; HAWQ: Hessian traces + "
             "knapsack), mean over budgets, measured in the same run on the same machine.", ""]
    for model, methods in summary.items():
        seeds = max(v["n_seeds"] for m in methods.values() for v in m.values())
        lines += [f"## {model}", "", f"Seeds: {seeds}. FP accuracy: {100 * fp[model]['fp_accuracy']:.2f}% "
                  f"on {fp[model]['n_test']} test examples.", ""]
        lines.append("| method | " + " | ".join(f"{b:.1f} bits" for b in budgets) + " | time (s) |")
        lines.append("|---|" + "---|" * (len(budgets) + 1))
        lines.append("| FP (32-bit) | " + " | ".join(f"{100 * fp[model]['fp_accuracy']:.2f}" for _ in budgets) + " | – |")
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
            secs = statistics.fmean(v["seconds"] for v in methods[method].values())
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {secs:.1f} |")
        notes = []
        for a in ("bayesq", "bayesq-ef"):
            ratio = _time_ratio(methods, a, "gptq")
            if ratio is not None:
                notes.append(f"{METHOD_LABEL[a]} / GPTQ time: {ratio:.2f}×")
            low = budgets[0]
            if low in methods.get(a, {}) and low in methods.get("gptq", {}):
                gap = 100 * (methods[a][low]["accuracy"] - methods["gptq"][low]["accuracy"])
                notes.append(f"{METHOD_LABEL[a]} − GPTQ at {low:.1f} bits: {gap:+.2f} points")
        if notes:
            lines += ["", "; ".join(notes) + "."]
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
        ax.errorbar(xs, ys, yerr=sds, marker="s" if method.startswith("bayesq") else "o", capsize=3, label=label)
    ax.axhline(100 * fp_acc, color="gray", ls="--", lw=1, label="FP")
    ax.set_xlabel("true average bits per weight")
    ax.set_ylabel("top-1 accuracy (%)")
    ax.set_title(model)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def export_table(records: list[dict]) -> str:
    """Markdown: every exported file's size next to the bits the allocation accounted."""
    lines = ["# Exported files: bytes on disk vs accounted bits", "",
             "Every row of the main table was evaluated from this file, loaded back with "
             "`bayesq.export.load` (not from an in-memory copy). *Accounted*: the allocation's exact "
             "storage (codes, scales, zero-points, LUTs, AWQ scales, bit-width headers) per quantised "
             "weight. *Payload*: 8 × the bytes of those tensors in the file; it exceeds the accounted "
             "bits only by the byte rounding of each packed stream (< 8 bits per stream, three streams "
             "per layer). The fixed overhead the average does not count: the tensors left in floating "
             "point (biases, norms, embeddings; stored as they are) and the safetensors header (JSON "
             "layouts, bit sets, format version, content hash). Δlogit: largest |logit difference| "
             "between the loaded and the in-memory model on 64 test inputs.", ""]
    by_model: dict = defaultdict(list)
    for r in records:
        if r.get("export"):
            by_model[r["model"]].append(r)
    for model, rs in by_model.items():
        seed = min(r["seed"] for r in rs)
        rs = sorted((r for r in rs if r["seed"] == seed), key=lambda r: (r["budget"], r["method"]))
        lines += [f"## {model} (seed {seed}, {rs[0]['n_weights']:,} quantised weights)", "",
                  "| method | budget | accounted bits/w | payload bits/w | payload − accounted (bits) | "
                  "file MB | FP tensors MB | header KB | max Δlogit |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            e = r["export"]
            lines.append(f"| {METHOD_LABEL.get(r['method'], r['method'])} | {r['budget']} | {r['avg_bits']:.4f} | "
                         f"{e['payload_avg_bits']:.4f} | {e['payload_bits'] - e['accounted_bits']} | "
                         f"{e['file_bytes'] / 1e6:.3f} | {e['fp_bytes'] / 1e6:.3f} | {e['header_bytes'] / 1e3:.1f} | "
                         f"{e['max_logit_diff']:.1e} |")
        lines.append("")
    return "\n".join(lines)


def report(results: Path, models: Path, out: Path) -> None:
    from flows.robustness_report import robustness_report

    everything = read_json(results)
    records = [r for r in everything if r["method"] != "fp"]  # FP rows: the robustness reference
    summary = summarise(records)
    budgets = sorted({r["budget"] for r in records})
    fp = {m: read_json(Path(models) / m / "fp.json") for m in summary}
    out.mkdir(parents=True, exist_ok=True)
    (out / "main_table.md").write_text(main_table(summary, fp, budgets))
    (out / "exports.md").write_text(export_table(records))
    for model, methods in summary.items():
        frontier_plot(model, methods, fp[model]["fp_accuracy"], out / f"frontier_{model}.png")
    robustness_report(everything, out)
    metrics = {
        model: {"fp_accuracy": fp[model]["fp_accuracy"],
                **{f"{method}@{b}": {k: v[k] for k in ("accuracy", "avg_bits", "seconds", "ece", "worst10", "cvar95")
                                     if k in v}
                   for method, per in methods.items() for b, v in per.items()}}
        for model, methods in summary.items()
    }
    write_json(out / "metrics.json", metrics)


LAYER_KINDS = (  # (substring of the module name, kind) -- first match wins
    ("attention.self.query", "attention q/k/v"), ("attention.self.key", "attention q/k/v"),
    ("attention.self.value", "attention q/k/v"), ("attention.output", "attention out"),
    ("intermediate", "FFN in"), ("output.dense", "FFN out"), ("pooler", "pooler"),
    ("classifier", "classifier"), ("_conv_stem", "stem conv"), ("_expand_conv", "expand 1x1"),
    ("_depthwise_conv", "depthwise 3x3/5x5"), ("_project_conv", "project 1x1"),
    ("_conv_head", "head 1x1"), ("_fc", "classifier"), ("downsample", "downsample 1x1"),
    ("conv1", "3x3 conv"), ("conv2", "3x3 conv"), ("fc", "classifier"),
)


def layer_kind(name: str) -> str:
    """Coarse layer family of a module name (for the per-layer bit summary)."""
    for key, kind in LAYER_KINDS:
        if key in name:
            return kind
    return name.rsplit(".", 1)[-1]


def _se(fp: dict) -> float:
    """Binomial standard error (points) of an accuracy near the FP accuracy."""
    a = fp["fp_accuracy"]
    return 100 * (a * (1 - a) / fp["n_test"]) ** 0.5


def _overhead(r: dict) -> float:
    return r.get("posterior_seconds", 0.0) + r.get("table_seconds", 0.0) + r["quantize_seconds"]


def ablation_table(records: list[dict], fp: dict[str, dict], extras: dict | None = None) -> str:
    """The paper's ablation layout: categories of variants, accuracy per model and budget, the
    change against the core row at the lowest budget, one-time cost relative to the core row."""
    models = list(dict.fromkeys(r["model"] for r in records))
    failed = {(r["model"], r["group"], r["row"]): r["error"] for r in records if "error" in r}
    records = [r for r in records if "error" not in r]
    budgets = sorted({r["budget"] for r in records})
    cell = {(r["model"], r["group"], r["row"], r["budget"]): r for r in records}
    rows = list(dict.fromkeys((r["group"], r["row"]) for r in records))
    rows += [k[1:] for k in failed if k[1:] not in rows]
    base, low = rows[0], budgets[0]
    heads = [f"{m} @{b:.1f}" for m in models for b in budgets] + [f"Δ {m} @{low:.1f}" for m in models]
    lines = [
        "# Ablations: BayesQ with one component switched per row", "",
        "Top-1 accuracy (%) on the test split, with the true average bits per quantised weight in "
        "brackets (payload, scales, zero-points, look-up tables, codebooks and headers all counted). "
        f"Δ: accuracy change against the core row (\"{base[1]}\") at {low:.1f} bits. Overhead: one-time "
        "cost (posterior + loss table + allocation and encoding, wall seconds) relative to the core row; "
        "no GPTQ baseline exists yet, so the core row is the reference (the paper uses a GPTQ pass). "
        "One seed; one standard error of an accuracy is about "
        + ", ".join(f"{_se(fp[m]):.2f} points on {m} ({fp[m]['n_test']} test examples)" for m in models)
        + ", so differences below about twice that are not resolved. "
        + "FP accuracy: " + ", ".join(f"{m} {100 * fp[m]['fp_accuracy']:.2f}%" for m in models) + ".", "",
        "| category | variant | " + " | ".join(heads) + " | overhead | settings |",
        "|---|---|" + "---|" * len(heads) + "---|---|",
    ]
    group_seen = None
    for group, label in rows:
        if group != group_seen:
            lines.append(f"| **{group}** | |" + " |" * len(heads) + " | |")
            group_seen = group
        cells, over, ratios = [], "", []
        for m in models:
            for b in budgets:
                r = cell.get((m, group, label, b))
                if r is None:
                    cells.append("failed¹" if (m, group, label) in failed else "–")
                    continue
                over = ", ".join(f"`{k}={v}`" for k, v in r["overrides"].items())
                cells.append(f"{100 * r['accuracy']:.2f} ({r['avg_bits']:.2f})")
                ref = cell.get((m, *base, b))
                if ref and _overhead(ref) > 0:
                    ratios.append(_overhead(r) / _overhead(ref))
        for m in models:
            r, ref = cell.get((m, group, label, low)), cell.get((m, *base, low))
            cells.append("–" if r is None or ref is None else f"{100 * (r['accuracy'] - ref['accuracy']):+.2f}")
        ovh = f"{sum(ratios) / len(ratios):.2f}×" if ratios else "–"
        lines.append(f"| | {label} | " + " | ".join(cells) + f" | {ovh} | {over or 'defaults'} |")
    lines.append("")
    if failed:
        lines += ["¹ Rows that raised (the run went on without them):", ""]
        lines += [f"* {m}, {g} / {r}: `{err}`" for (m, g, r), err in failed.items()] + [""]
    if extras:
        lines += _diminishing(extras, models, budgets) + _layer_bits(records, base, models, budgets)
    return "\n".join(lines)


def _diminishing(extras: dict, models: list[str], budgets: list[float]) -> list[str]:
    """Share of the expected-loss reduction bought by the first part of the upgrade budget."""
    fracs = sorted({float(f) for m in models for b in budgets for f in extras.get(m, {}).get(str(b), {})})
    if not fracs:
        return []
    lines = ["## Diminishing returns (core row)", "",
             "Share (%) of the total expected-loss reduction that the greedy allocator achieves after "
             "spending the given share of the bits above the cheapest allocation (concave = the first "
             "bits buy most of the gain).", "",
             "| bits spent | " + " | ".join(f"{m} @{b:.1f}" for m in models for b in budgets) + " |",
             "|---|" + "---|" * (len(models) * len(budgets))]
    for f in fracs:
        vals = [extras.get(m, {}).get(str(b), {}).get(str(f)) for m in models for b in budgets]
        lines.append(f"| first {100 * f:.0f}% | " + " | ".join("–" if v is None else f"{100 * v:.1f}" for v in vals) + " |")
    return lines + [""]


def _layer_bits(records: list[dict], base: tuple, models: list[str], budgets: list[float]) -> list[str]:
    """Mean bits per layer family in the core row's allocation at each budget."""
    lines = ["## Per-layer bit allocation (core row)", "",
             "Mean bit-width of the allocation units in each layer family (scales and headers not included).", ""]
    for m in models:
        kinds: dict = defaultdict(lambda: defaultdict(list))
        for r in records:
            if r["model"] == m and (r["group"], r["row"]) == base:
                for name, bits in r["layer_bits"].items():
                    kinds[layer_kind(name)][r["budget"]].append(bits)
        if not kinds:
            continue
        lines += [f"**{m}**", "", "| layer family | layers | " + " | ".join(f"@{b:.1f}" for b in budgets) + " |",
                  "|---|---|" + "---|" * len(budgets)]
        for kind, per in kinds.items():
            n = len(next(iter(per.values())))
            lines.append(f"| {kind} | {n} | " + " | ".join(
                f"{statistics.fmean(per[b]):.2f}" if per.get(b) else "–" for b in budgets) + " |")
        lines.append("")
    return lines


def ablation_report(results: Path, models: Path, out: Path) -> None:
    data = read_json(results)
    records, extras = data["records"], data["diminishing"]
    fp = {m: read_json(Path(models) / m / "fp.json") for m in {r["model"] for r in records}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(ablation_table(records, fp, extras))


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
