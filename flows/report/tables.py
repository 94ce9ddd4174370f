"""The report's markdown tables: main table (accuracy, bits, time per method and budget), the
selected variants, fidelity to the FP model, export sizes and the fitted posteriors."""

from __future__ import annotations

import statistics
from collections import defaultdict

from flows.methods import METHOD_LABEL
from flows.report.paired import bits_text

FIDELITY_KEYS = ("kl_mean", "kl_se", "agreement")  # absent from records written before per-example evaluation


def time_ratio(methods: dict, a: str, b: str) -> float | None:
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
            ratio = time_ratio(methods, a, "gptq")
            if ratio is not None:
                notes.append(f"{METHOD_LABEL[a]} / GPTQ time: {ratio:.2f}×")
        if notes:
            lines += ["", "; ".join(notes) + "."]
        variants = variant_lines(list(records), model)
        if variants:
            lines += [""] + [f"* {v}" for v in variants]
        lines.append("")
    return "\n".join(lines)


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
                         f"{e['payload_avg_bits']:.4f} | {bits_text(e.get('all_avg_bits'))} | "
                         f"{e['payload_bits'] - e['accounted_bits']} | "
                         f"{e['file_bytes'] / 1e6:.3f} | {e['fp_bytes'] / 1e6:.3f} | {e['header_bytes'] / 1e3:.1f} | "
                         f"{e['max_logit_diff']:.1e} |")
        lines.append("")
    return "\n".join(lines)


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
