"""DVC stage `report`: main table, accuracy-bit frontiers and DVC metrics from the results.

    python -m flows report --results results/results.json --models models --out reports

Writes ``main_table.md`` (with every row's KL to the FP model and agreement, and the paired
comparisons of the BayesQ rows with GPTQ and RTN per-group on the same test examples),
``paired.json`` (those comparisons), ``exports.md`` (file sizes next to the accounted bits),
``posterior.md`` (the fitted prior precisions and prior-dominated share per model, from
``posteriors.json`` next to the results), ``frontier_<model>.png`` and ``metrics.json``; with
``--summary docs/results.md`` also the one-page summary the README links to (:func:`results_summary`).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from bayesq.comparison import RESAMPLES, SEED, paired_differences
from flows.common import read_json, write_json
from flows.labels import METHOD_LABEL, layer_kind
from flows.robustness_report import robustness_report
from flows.timings import timings_markdown
from flows.tracking import log_reports

FIDELITY_KEYS = ("kl_mean", "kl_se", "agreement")  # absent from records written before per-example evaluation


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


def _time_ratio(methods: dict, a: str, b: str) -> float | None:
    """Mean over budgets of the one-time cost of method ``a`` over that of ``b``."""
    ratios = [methods[a][x]["seconds"] / methods[b][x]["seconds"] for x in methods.get(a, {})
              if x in methods.get(b, {}) and methods[b][x]["seconds"] > 0]
    return statistics.fmean(ratios) if ratios else None


_RULE = {"variant": "least KL on the selection inputs",
         "encoding": "the anchor (min/max grids when scored on the calibration inputs, the searched grids on "
                     "held-out inputs) unless the other candidate's KL on the selection inputs is lower by a "
                     "resolved margin, its 95 % paired-bootstrap interval against the anchor shown with the inputs it "
                     "was scored on (a quarter of them when it was resolved worse there and not scored "
                     "further)"}


def variant_lines(records: list[dict], model: str) -> list[str]:
    """Which variant each selecting baseline kept (``variant``: the least KL on the selection
    inputs), and which grids each BayesQ row kept (``encoding``, when it had candidates: the
    anchor unless the other candidate's KL was lower by a resolved margin), at each budget (seed)."""
    kept: dict = defaultdict(list)
    rule: dict = {}
    for r in records:
        kind = "variant" if r.get("variant") else "encoding" if r.get("encoding_kl") else None
        if r["model"] != model or kind is None:
            continue
        anchor = next(iter(set(r.get("encoding_kl", {})) - set(r.get("encoding_margin", {}))), "")
        seen = r.get("encoding_inputs", {})
        margins = ", ".join(f"{k} − {anchor} [{lo:+.5f}, {hi:+.5f}]"
                            + (f" on {seen[k]} inputs" if k in seen else "")
                            for k, (lo, hi) in r.get("encoding_margin", {}).items()) if kind == "encoding" else ""
        rule[r["method"]] = _RULE[kind]
        kept[r["method"]].append(f"{r['budget']:.1f} bits: {r[kind]}" + (f" ({margins})" if margins else "")
                                 + (f" (seed {r['seed']})" if len({x['seed'] for x in records}) > 1 else ""))
    return [f"{METHOD_LABEL.get(m, m)} kept ({rule[m]}): " + "; ".join(v) + "." for m, v in kept.items()]


def accuracy_se(accuracy: float, n: int) -> float:
    """Binomial standard error ``sqrt(a (1 - a) / n)`` of an accuracy on ``n`` test examples."""
    return (accuracy * (1 - accuracy) / n) ** 0.5


def main_table(summary: dict, fp: dict[str, dict], budgets: list[float], records: list[dict] = ()) -> str:
    lines = ["# Main table: top-1 accuracy (%) at matched true average bits", "",
             "Each cell: accuracy ± its standard error over test examples (binomial, sqrt(a (1 − a) / N); "
             "several seeds: mean over seeds ± SD over seeds), then the true average bits per quantised "
             "weight (payload, scales, zero-points, stored AWQ scales and bit-width headers all counted). "
             "The SE covers test-set sampling only; differences between two rows are resolved far more "
             "sharply by the paired comparisons below (same examples). GPTQ and AWQ are their best "
             "variant (own mixed rule, uniform widths at the smallest fitting group size, GPTQ on "
             "BayesQ's allocation, each also with bias correction) by the least KL to FP on the selection "
             "inputs: a second draw of training inputs, disjoint from the calibration inputs the variants are "
             "fitted on (`calibration.selection`, `selection_images` / `selection_sentences`), on which "
             "BayesQ's grid selection also scores. "
             "Time: the method's one-time cost in wall seconds (BayesQ: posterior + loss table + "
             "allocation and encoding; GPTQ / AWQ: input statistics + solve; HAWQ: Hessian traces + "
             "knapsack), mean over budgets, measured in the same run on the same machine; each MLflow child "
             "run logs it as `preprocess_seconds` and the test-set evaluation, not counted here, as "
             "`eval_seconds`.", ""]
    for model, methods in summary.items():
        seeds = max(v["n_seeds"] for m in methods.values() for v in m.values())
        trained = " (only the new head trained, on the frozen pretrained backbone)" \
            if fp[model].get("trained") == "head" else ""
        lines += [f"## {model}", "", f"Seeds: {seeds}. FP accuracy{trained}: {100 * fp[model]['fp_accuracy']:.2f}% "
                  f"on {fp[model]['n_test']} test examples.", ""]
        lines.append("| method | " + " | ".join(f"{b:.1f} bits" for b in budgets) + " | time (s) |")
        lines.append("|---|" + "---|" * (len(budgets) + 1))
        fp_se = accuracy_se(fp[model]["fp_accuracy"], fp[model]["n_test"])
        lines.append("| FP (32-bit) | " + " | ".join(f"{100 * fp[model]['fp_accuracy']:.2f} ± {100 * fp_se:.2f}"
                                                     for _ in budgets) + " | – |")
        for method, label in METHOD_LABEL.items():
            if method not in methods:
                continue
            cells = []
            for b in budgets:
                v = methods[method].get(b)
                if v is None:
                    cells.append("–")
                    continue
                spread = v["accuracy_sd"] if v["n_seeds"] > 1 else accuracy_se(v["accuracy"], fp[model]["n_test"])
                cells.append(f"{100 * v['accuracy']:.2f} ± {100 * spread:.2f} ({v['avg_bits']:.3f} b)")
            secs = statistics.fmean(v["seconds"] for v in methods[method].values())
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {secs:.1f} |")
        notes = []
        for a in ("bayesq", "bayesq-ef"):
            ratio = _time_ratio(methods, a, "gptq")
            if ratio is not None:
                notes.append(f"{METHOD_LABEL[a]} / GPTQ time: {ratio:.2f}×")
        if notes:
            lines += ["", "; ".join(notes) + "."]
        variants = variant_lines(list(records), model)
        if variants:
            lines += [""] + [f"* {v}" for v in variants]
        lines.append("")
    return "\n".join(lines)


def frontier_plot(model: str, methods: dict, fp_acc: float, path: Path, n_test: int) -> None:
    """Accuracy against true average bits, one line per method; error bars: 95 % intervals of
    test-set sampling (1.96 binomial SE; several seeds: 1.96 SD over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for method, label in METHOD_LABEL.items():
        if method not in methods:
            continue
        pts = sorted((v["avg_bits"], 100 * v["accuracy"], 196 * (v["accuracy_sd"] if v["n_seeds"] > 1 else
                                                                 accuracy_se(v["accuracy"], n_test)))
                     for v in methods[method].values())
        xs, ys, sds = zip(*pts)
        ax.errorbar(xs, ys, yerr=sds, marker="s" if method.startswith("bayesq") else "o", capsize=3, label=label)
    ax.axhline(100 * fp_acc, color="gray", ls="--", lw=1, label="FP")
    ax.set_xlabel("true average bits per weight")
    ax.set_ylabel("top-1 accuracy (%), 95 % bars")
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
             "layouts, bit sets, format version, content hash). *All matrices*: bits per weight over every "
             "floating parameter with two or more dimensions, the quantised ones as in the file and the "
             "others (embeddings, layers kept in floating point) at their storage width. Δlogit: "
             "largest |logit difference| "
             "between the loaded and the in-memory model on 64 test inputs.", ""]
    by_model: dict = defaultdict(list)
    for r in records:
        if r.get("export"):
            by_model[r["model"]].append(r)
    for model, rs in by_model.items():
        seed = min(r["seed"] for r in rs)
        rs = sorted((r for r in rs if r["seed"] == seed), key=lambda r: (r["budget"], r["method"]))
        lines += [f"## {model} (seed {seed}, {rs[0]['n_weights']:,} quantised weights)", "",
                  "| method | budget | accounted bits/w | payload bits/w | all matrices bits/w | "
                  "payload − accounted (bits) | file MB | FP tensors MB | header KB | max Δlogit |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            e = r["export"]
            lines.append(f"| {METHOD_LABEL.get(r['method'], r['method'])} | {r['budget']} | {r['avg_bits']:.4f} | "
                         f"{e['payload_avg_bits']:.4f} | {_bits(e.get('all_avg_bits'))} | "
                         f"{e['payload_bits'] - e['accounted_bits']} | "
                         f"{e['file_bytes'] / 1e6:.3f} | {e['fp_bytes'] / 1e6:.3f} | {e['header_bytes'] / 1e3:.1f} | "
                         f"{e['max_logit_diff']:.1e} |")
        lines.append("")
    return "\n".join(lines)


PAIRED_METHODS = ("bayesq", "bayesq-ef", "bayesq-distill", "bayesq-paper", "bayesq-brecq")
PAIRED_BASELINES = ("gptq", "optq", "anneal", "adaround", "brecq", "lsq", "lsq-plus", "pact", "dorefa", "bit-split", "ocs",
                    "awq", "smoothquant", "hawq", "zeroq", "aciq", "lloyd-block", "clip-block",
                    "rtn-group", "rtn-channel", "rtn-tensor")  # every one run
PAIRED_VARIANTS = (("bayesq-brecq", "bayesq"),)  # a BayesQ row against BayesQ's default: does it earn the default?
PAIRED_METRICS = (("accuracy", "correct", 100.0), ("kl", "kl", 1.0))  # (metric, example array, scale)


def _bits(value: float | None) -> str:
    """``value`` to four decimals, ``-`` for a record written before it was measured."""
    return "-" if value is None else f"{value:.4f}"


def example_file(record: dict, results_dir: Path) -> Path | None:
    """A record's per-example file: as written, else under ``<results_dir>/examples/`` (a moved
    results folder); None when the record names none or the file is gone."""
    if not record.get("examples_file"):
        return None
    path = Path(record["examples_file"])
    for p in (path, Path(results_dir) / "examples" / path.name):
        if p.exists():
            return p
    return None


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _pooled(rows: dict, seeds: list[int], key: str):
    """(N,) float64 per-example ``key`` averaged over ``seeds`` (one seed: that seed's values)."""
    import torch

    return torch.stack([rows[s][key].double() for s in seeds]).mean(0)


def paired_comparisons(records: list[dict], results_dir: Path, resamples: int | None = None,
                       seed: int | None = None) -> tuple[list[dict], list[str]]:
    """Every BayesQ row against every baseline row (:data:`PAIRED_BASELINES`), and the pairs of
    :data:`PAIRED_VARIANTS`, at the same model and budget, on the same test examples (:func:`bayesq.comparison.paired_differences`).

    ``diff`` = method − baseline: accuracy in points (from ``correct``), KL to FP in nats (from
    ``kl``), with the paired-bootstrap 95 % interval; one bootstrap (the same resampled example
    indices) per model and budget. Over several seeds the per-example values are averaged over
    the seeds both rows have before resampling examples. Returns the rows (``model``, ``budget``,
    ``method``, ``baseline``, ``metric``, ``diff``, ``ci_low``, ``ci_high``, ``n``, ``seeds``) and
    notes on what was left out.
    """
    import torch


    examples: dict = defaultdict(dict)  # (model, budget, method) -> {seed: arrays}
    missing = []
    for r in records:
        if r["method"] not in PAIRED_METHODS + PAIRED_BASELINES:  # (PAIRED_VARIANTS pairs rows of these)
            continue
        path = example_file(r, results_dir)
        if path is None:
            missing.append(f"{r['model']}/{r['method']}/b{r['budget']}/s{r['seed']}")
        else:
            examples[(r["model"], r["budget"], r["method"])][r["seed"]] = _load(path)
    out = []
    for model, budget in sorted({k[:2] for k in examples}):
        pairs = []
        for method, base in [*((m, bl) for m in PAIRED_METHODS for bl in PAIRED_BASELINES), *PAIRED_VARIANTS]:
            a, b = examples.get((model, budget, method)), examples.get((model, budget, base))
            seeds = sorted(set(a or ()) & set(b or ()))
            if seeds and a[seeds[0]]["correct"].shape == b[seeds[0]]["correct"].shape:
                pairs.append((method, base, seeds))
        if not pairs:
            continue
        cols = [(m, bl, s, metric, key, scale) for m, bl, s in pairs for metric, key, scale in PAIRED_METRICS]
        x = torch.stack([scale * _pooled(examples[(model, budget, m)], s, key) for m, _, s, _, key, scale in cols], 1)
        y = torch.stack([scale * _pooled(examples[(model, budget, bl)], s, key) for _, bl, s, _, key, scale in cols], 1)
        res = paired_differences(x, y, RESAMPLES if resamples is None else resamples, SEED if seed is None else seed)
        for (m, bl, s, metric, _, _), d in zip(cols, res):
            out.append({"model": model, "budget": budget, "method": m, "baseline": bl, "metric": metric,
                        **d.as_dict(), "n": d.n, "seeds": s})
    shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
    notes = [f"{len(missing)} row(s) have no per-example file (records written before per-example evaluation, "
             f"or the file is gone) and are left out: {shown}."] if missing else []
    return out, notes


def ci_text(row: dict, fmt: str) -> str:
    """``diff [low, high]`` in ``fmt``, with * when the interval excludes 0."""
    resolved = "*" if row["ci_low"] > 0 or row["ci_high"] < 0 else ""
    return f"{row['diff']:{fmt}} [{row['ci_low']:{fmt}}, {row['ci_high']:{fmt}}]{resolved}"


def paired_table(rows: list[dict], notes: list[str]) -> str:
    """Markdown: the paired comparisons, one line per (model, budget, method, baseline)."""

    lines = ["## Paired comparisons on the same test examples", "",
             "Δ = method − baseline, both scored on the same test examples. Accuracy in points "
             "(positive: the method is more accurate); KL(p_FP ‖ p_Q) in nats, mean over test examples "
             "(negative: the method is closer to the FP model). Brackets: 95 % percentile interval of a "
             f"paired bootstrap over test examples ({RESAMPLES:,} resamples of the example indices, "
             f"generator seed {SEED}, the same indices for both methods); * marks an interval that "
             "excludes 0. It covers test-set sampling only, not the calibration set, fine-tuning or any "
             "other seed. The fine-tune is pinned (`finetune.seed`, `finetune.threads`; lite0-fmnist trains "
             "only a head on its frozen pretrained backbone), so a rerun on a fresh clone reproduces these "
             "numbers, on another CPU too: MiniLM's fine-tune byte for byte, lite0's to ~5e-9 relative, and "
             "`bash benchmarks/other_cpu.sh` re-runs the 3.0-bit rows and checks them against these "
             "intervals. Another fine-tune (another `finetune.seed`) is another model: how far the "
             "differences move with it, beyond these intervals, is measured in docs/method.md §18d, §22b."]
    seeds = sorted({tuple(r["seeds"]) for r in rows})
    if any(len(s) > 1 for s in seeds):
        lines[-1] += (" Several seeds: each example's values are averaged over the seeds both rows have, "
                      "then examples are resampled (seeds: " + "; ".join(", ".join(map(str, s)) for s in seeds) + ").")
    elif seeds:
        lines[-1] += " One seed: " + ", ".join(str(s[0]) for s in seeds) + "."
    lines.append("")
    if not rows:
        lines += ["No paired comparison: no BayesQ row and baseline row with per-example files "
                  "at the same model and budget.", ""]
    else:
        cell = {(r["model"], r["budget"], r["method"], r["baseline"], r["metric"]): r for r in rows}
        lines += ["| model | bits | method | baseline | Δ accuracy (points) [95 % CI] | Δ KL to FP (nats) [95 % CI] "
                  "| examples |", "|---|---|---|---|---|---|---|"]
        for key in dict.fromkeys(k[:4] for k in cell):
            acc, kl = cell.get((*key, "accuracy")), cell.get((*key, "kl"))
            model, budget, method, base = key
            lines.append(f"| {model} | {budget:.1f} | {METHOD_LABEL.get(method, method)} | "
                         f"{METHOD_LABEL.get(base, base)} | {ci_text(acc, '+.2f') if acc else '–'} | "
                         f"{ci_text(kl, '+.3g') if kl else '–'} | {(acc or kl)['n']:,} |")
        lines.append("")
    return "\n".join(lines + notes + ([""] if notes else []))


def fidelity_table(summary: dict, budgets: list[float]) -> str:
    """Markdown: mean KL to the FP model ± its SE and top-1 agreement with FP, every row."""
    lines = ["## Fidelity to the FP model: KL and top-1 agreement", "",
             "Each cell: mean over test examples of KL(p_FP ‖ p_Q) in nats ± its standard error "
             "(sd / √N over examples), then the share (%) of test examples whose top-1 class agrees with "
             "the FP model's. Several seeds: means over seeds of both (the SE is that of one seed's mean)."]
    missing = 0
    for model, methods in summary.items():
        lines += ["", f"### {model}", "", "| method | " + " | ".join(f"{b:.1f} bits" for b in budgets) + " |",
                  "|---|" + "---|" * len(budgets)]
        for method, label in METHOD_LABEL.items():
            if method not in methods:
                continue
            cells = []
            for b in budgets:
                v = methods[method].get(b)
                if v is not None and "kl_mean" not in v:
                    missing += 1
                cells.append("–" if v is None or "kl_mean" not in v else
                             f"{v['kl_mean']:.3g} ± {v['kl_se']:.2g} ({100 * v['agreement']:.2f}%)")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if missing:
        lines += ["", f"{missing} cell(s) show – : their records were written before per-example evaluation "
                  "(no `kl_mean` / `agreement`); re-run the quantize stage to fill them."]
    return "\n".join(lines + [""])


def posterior_table(posteriors: list[dict]) -> str:
    """Markdown: per model and posterior, the fitted prior precisions lambda_l (min / median /
    max over layers) and the prior-dominated share (weights whose posterior variance is within
    10 % of the prior's), pooled and per layer kind; the per-layer values follow."""
    lines = ["## Posterior: fitted prior and prior-dominated share", "",
             "lambda_l: each layer's prior precision (posterior.prior: fitted = maximised Laplace marginal "
             "likelihood, MacKay's fixed point). Prior-dominated: share of weights whose posterior variance "
             "is within 10 % of the prior variance 1/lambda_l (the data curvature adds less than lambda_l/9).", "",
             "| model | row | curvature | prior | seed | calibration inputs | lambda_l min / median / max | "
             "prior-dominated (all weights) |", "|---|---|---|---|---|---|---|---|"]
    detail = ["", "### Per layer", "", "| model | row | layer | lambda_l | prior-dominated |", "|---|---|---|---|---|"]
    if not posteriors:
        return "\n".join(lines + ["", "No posterior summary (`posteriors.json`) next to the results.", ""])
    for p in posteriors:
        lam = sorted(p["prior_precision"].values())
        mid = lam[len(lam) // 2] if lam else float("nan")
        lines.append(f"| {p['model']} | {p['method']} | {p.get('curvature', '?')} | {p.get('prior', '?')} | {p['seed']} | "
                     f"{p.get('n_examples', '?')} | {lam[0]:.3g} / {mid:.3g} / {lam[-1]:.3g} | "
                     f"{100 * p['prior_dominated_share']:.1f} % |")
        for layer, v in p["prior_precision"].items():
            detail.append(f"| {p['model']} | {p['method']} | {layer} | {v:.3g} | "
                          f"{100 * p['prior_dominated'][layer]:.1f} % |")
    return "\n".join(lines + detail + [""])


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
        ratio = _time_ratio(methods, "bayesq", "gptq")
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
        ref = _load(ref_path)
        data = {k: _load(files[k]) for k in rows}
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
