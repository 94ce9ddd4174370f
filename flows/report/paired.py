"""Paired comparisons: each BayesQ row against every baseline (and variant) on the same test
examples, with 95 % paired-bootstrap intervals of the accuracy and KL differences."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from bayesq.comparison import RESAMPLES, SEED, paired_differences
from flows.labels import ci_text
from flows.methods import BASELINES, BAYESQ_ROWS, METHOD_LABEL

PAIRED_METHODS = tuple(m.value for m in BAYESQ_ROWS)  # every BayesQ row ...


PAIRED_BASELINES = tuple(m.value for m in BASELINES)  # ... against every baseline, in the registry's order


PAIRED_VARIANTS = (("bayesq-brecq", "bayesq"),)  # a BayesQ row against BayesQ's default: does it earn the default?


PAIRED_METRICS = (("accuracy", "correct", 100.0), ("kl", "kl", 1.0))  # (metric, example array, scale)


def bits_text(value: float | None) -> str:
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


def load_examples(path: Path) -> dict:
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
            examples[(r["model"], r["budget"], r["method"])][r["seed"]] = load_examples(path)
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
