"""The ablate stage's report: each ablation row's paired change from its base row, diminishing
returns and the bits per layer kind."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from bayesq.comparison import RESAMPLES, SEED, paired_differences
from flows.common import read_json
from flows.labels import ci_text, layer_kind
from flows.report.paired import PAIRED_METRICS, example_file, load_examples
from flows.tracking import log_reports


def _overhead(r: dict) -> float:
    return (r.get("posterior_seconds", 0.0) + r.get("table_seconds", 0.0) + r.get("stats_seconds", 0.0)
            + r.get("reference_seconds", 0.0) + r["quantize_seconds"])


def ablation_deltas(records: list[dict], base: tuple[str, str], budget: float, resamples: int | None = None,
                    seed: int | None = None) -> dict[tuple[str, str, str], dict[str, dict]]:
    """Paired differences of every row against the ``base`` row at ``budget``, per model, on the
    same test examples (:func:`bayesq.comparison.paired_differences`, one bootstrap per model):
    ``(model, group, row) -> {"accuracy": {diff, ci_low, ci_high} (points), "kl": {...} (nats)}``.
    Rows or bases without a per-example file are left out."""
    import torch


    files = {(r["model"], r["group"], r["row"]): example_file(r, Path("."))
             for r in records if r["budget"] == budget}
    out = {}
    for model in dict.fromkeys(k[0] for k in files):
        ref_path = files.get((model, *base))
        rows = [k for k, f in files.items() if k[0] == model and f is not None and k[1:] != base]
        if ref_path is None or not rows:
            continue
        ref = load_examples(ref_path)
        data = {k: load_examples(files[k]) for k in rows}
        rows = [k for k in rows if data[k]["kl"].shape == ref["kl"].shape]
        if not rows:
            continue
        x = torch.stack([data[k][key].double() * scale for k in rows for _, key, scale in PAIRED_METRICS], 1)
        y = torch.stack([ref[key].double() * scale for _ in rows for _, key, scale in PAIRED_METRICS], 1)
        res = iter(paired_differences(x, y, RESAMPLES if resamples is None else resamples,
                                      SEED if seed is None else seed))
        for k in rows:
            out[k] = {metric: next(res).as_dict() for metric, _, _ in PAIRED_METRICS}
    return out


def ablation_table(records: list[dict], fp: dict[str, dict], extras: dict | None = None) -> str:
    """The paper's ablation layout: categories of variants; per model and budget the accuracy,
    true bits and KL to FP (± SE); the paired change against the core row at the lowest budget
    with its 95 % interval; one-time cost relative to the core row."""
    models = list(dict.fromkeys(r["model"] for r in records))
    failed = {(r["model"], r["group"], r["row"]): r["error"] for r in records if "error" in r}
    records = [r for r in records if "error" not in r]
    budgets = sorted({r["budget"] for r in records})
    cell = {(r["model"], r["group"], r["row"], r["budget"]): r for r in records}
    rows = list(dict.fromkeys((r["group"], r["row"]) for r in records))
    rows += [k[1:] for k in failed if k[1:] not in rows]
    base, low = rows[0], budgets[0]
    deltas = ablation_deltas(records, base, low)
    heads = ([f"{m} @{b:.1f}" for m in models for b in budgets] + [f"Δ KL {m} @{low:.1f}" for m in models]
             + [f"Δ acc {m} @{low:.1f}" for m in models])
    lines = [
        "# Ablations: BayesQ with one component switched per row", "",
        "Each model / budget cell: top-1 accuracy (%) on the test split, the true average bits per "
        "quantised weight in brackets (payload, scales, zero-points, look-up tables, codebooks and headers "
        "all counted), then the mean KL(p_FP ‖ p_Q) over the test examples in nats ± its standard error. "
        f"Δ: the row minus the core row (\"{base[1]}\") at {low:.1f} bits on the same test examples, KL in "
        "nats and accuracy in points, with the 95 % interval of a paired bootstrap over test examples "
        "(* : the interval excludes 0). Intervals cover test-set sampling only (one seed: "
        + ", ".join(sorted({str(r["seed"]) for r in records})) + "; the calibration draw and fine-tune are "
        "fixed). Overhead: one-time cost (posterior + loss table + allocation and encoding, wall seconds) "
        "relative to the core row. FP accuracy: "
        + ", ".join(f"{m} {100 * fp[m]['fp_accuracy']:.2f}% ({fp[m]['n_test']} test examples)" for m in models)
        + ".", "",
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
                kl = f" · {r['kl_mean']:.3g} ± {r['kl_se']:.2g}" if "kl_mean" in r else ""
                cells.append(f"{100 * r['accuracy']:.2f} ({r['avg_bits']:.2f}){kl}")
                ref = cell.get((m, *base, b))
                if ref and _overhead(ref) > 0:
                    ratios.append(_overhead(r) / _overhead(ref))
        for metric, fmt in (("kl", "+.3g"), ("accuracy", "+.2f")):
            for m in models:
                d = deltas.get((m, group, label))
                cells.append("0" if (group, label) == base else "–" if d is None else ci_text(d[metric], fmt))
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
    log_reports(Path(results).parent / "mlflow_run.json", [out])
