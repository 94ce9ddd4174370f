"""Calibration, tail and out-of-domain reports from the quantize stage's records.

Writes ``calibration_robustness.md`` (the paper's calibration / tail table at the lowest budget,
the distillation summary, the OOD tables and the per-layer allocation), ``reliability_<model>.png``
(reliability diagrams with per-bin counts) and ``layer_bits_<model>.png``.  Over several seeds a
cell is ``mean ± SD [95 % t-interval]``; with one seed (the quick profile) the table says so.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from flows.labels import layer_kind
from flows.methods import METHOD_LABEL

LABEL = {"fp": "FP (32-bit)", **METHOD_LABEL}
CAL_COLUMNS = (("accuracy", "accuracy", 100), ("ece", "ECE", 100), ("ece_random", "ECE (random bins)", 100),
               ("mce", "MCE", 100), ("nll", "NLL", 1), ("worst5", "worst-5% acc", 100),
               ("worst10", "worst-10% acc", 100), ("cvar90", "CVaR0.90", 1), ("cvar95", "CVaR0.95", 1))
FAMILIES = {"noise": ("gaussian_noise", "shot_noise", "impulse_noise"), "blur": ("gaussian_blur", "defocus_blur"),
            "weather": ("fog", "brightness"), "digital": ("contrast", "pixelate", "jpeg_compression")}


def seed_stats(values: list[float]) -> tuple[float, float, float]:
    """(mean, SD, half-width of the 95 % t-interval); SD and half-width are NaN for one value."""
    from scipy import stats

    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, float("nan"), float("nan")
    sd = statistics.stdev(values)
    return mean, sd, float(stats.t.ppf(0.975, n - 1)) * sd / n**0.5


def _cell(values: list[float], scale: float, digits: int = 2, se: float | None = None) -> str:
    """One seed: the value (± ``se``, its standard error over test examples, when known); several:
    mean ± SD [95 % t-interval] over seeds."""
    mean, sd, half = seed_stats([scale * v for v in values])
    if len(values) < 2:
        return f"{mean:.{digits}f}" + ("" if se is None else f" ± {scale * se:.{digits}f}")
    return f"{mean:.{digits}f} ± {sd:.{digits}f} [{mean - half:.{digits}f}, {mean + half:.{digits}f}]"


def _rows(records: list[dict], model: str, budget: float | None) -> dict[str, list[dict]]:
    """method -> records of ``model`` at ``budget`` (FP rows at any budget), in label order."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["model"] == model and r.get("calibration") and (r["method"] == "fp" or r["budget"] == budget):
            out[r["method"]].append(r)
    return {m: out[m] for m in LABEL if m in out}


def _seeds_note(records: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in records if r["method"] != "fp"})
    if len(seeds) < 2:
        return (f"One seed ({', '.join(map(str, seeds))}; the quick profile): value ± its bootstrap standard "
                "error over the test examples (100 resamples; test-set sampling only, not the calibration draw "
                "or the fine-tune); the random-bin ECE ± its SD over the 20 sets of bin edges. "
                "`make run PROFILE=full` runs seeds 17, 29, 43 and reports mean ± SD [95 % t-interval] over seeds.")
    return (f"Seeds {', '.join(map(str, seeds))} (calibration set resampled per seed): mean ± SD "
            "[95 % t-interval] over seeds.")


def calibration_table(records: list[dict], budget: float) -> list[str]:
    lines = [f"## Calibration and tails at {budget:.1f} bits", "",
             "Test split. ECE / MCE: 15 equal-width confidence bins (%); ECE (random bins): mean over 20 "
             "sets of random bin edges. NLL: mean negative log-likelihood (nats). worst-k% acc: accuracy "
             "on the k % least confident test examples. CVaR_α: mean NLL of the worst 1 − α share of "
             "examples (Rockafellar–Uryasev). Lower is better except for the accuracies.", ""]
    head = " | ".join(c[1] for c in CAL_COLUMNS)
    for model in dict.fromkeys(r["model"] for r in records):
        rows = _rows(records, model, budget)
        if len(rows) < 2:
            continue
        lines += [f"### {model}", "", f"| method | {head} |", "|---|" + "---|" * len(CAL_COLUMNS)]
        for method, rs in rows.items():
            cal = rs[0]["calibration"]
            spread = {**cal.get("se", {}), **({"ece_random": cal["ece_random_sd"]} if "ece_random_sd" in cal else {})}
            cells = [_cell([r["calibration"][k] for r in rs], s, 2 if s == 100 else 3, spread.get(k))
                     for k, _, s in CAL_COLUMNS]
            lines.append(f"| {LABEL[method]} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def distill_table(records: list[dict]) -> list[str]:
    pairs = defaultdict(dict)
    for r in records:
        if r["method"] in ("bayesq", "bayesq-distill") and r.get("calibration"):
            pairs[(r["model"], r["budget"], r["seed"])][r["method"]] = r
    rows = [(k, v) for k, v in sorted(pairs.items()) if "distill_seconds" in v.get("bayesq-distill", {})
            and "bayesq" in v]
    if not rows:
        return []
    lines = ["## Distillation to the posterior-predictive teacher", "",
             "BayesQ before → after distillation (same codes and bits). s: posterior tempering factor of "
             "the teacher's samples (largest with ≥ 95 % argmax agreement with the mean model); agreement: "
             "teacher argmax = mean model's, on the calibration set; loss: τ²·KL(teacher ‖ student), mean "
             "of the first / last 10 % of steps.", "",
             "| model | bits | seed | accuracy | ECE (%) | NLL | worst-10% acc | CVaR0.95 | s | agreement "
             "| loss first → last | time (s) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, budget, seed), v in rows:
        a, d = v["bayesq"]["calibration"], v["bayesq-distill"]
        c = d["calibration"]
        lines.append(
            f"| {model} | {budget:.1f} | {seed} | {100 * a['accuracy']:.2f} → {100 * c['accuracy']:.2f} | "
            f"{100 * a['ece']:.2f} → {100 * c['ece']:.2f} | {a['nll']:.3f} → {c['nll']:.3f} | "
            f"{100 * a['worst10']:.2f} → {100 * c['worst10']:.2f} | {a['cvar95']:.3f} → {c['cvar95']:.3f} | "
            f"{d['distill_sample_scale']:.2g} | {100 * d['distill_teacher_agreement']:.1f}% | "
            f"{d['distill_loss_first']:.4f} → {d['distill_loss_last']:.4f} | {d['distill_seconds']:.0f} |")
    return lines + [""]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def ood_tables(records: list[dict]) -> list[str]:
    lines: list[str] = []
    for model in dict.fromkeys(r["model"] for r in records):
        ood = defaultdict(list)
        for r in records:
            if r["model"] == model and r.get("ood"):
                ood[r["method"]].append(r)
        if len(ood) < 2:
            continue
        budgets = sorted({r["budget"] for rs in ood.values() for r in rs if r["method"] != "fp"})
        first = next(iter(ood.values()))[0]["ood"]
        if "corruptions" in first:
            names = list(first["corruptions"])
            sev = list(next(iter(first["corruptions"].values())))
            fams = [f for f, cs in FAMILIES.items() if any(c in names for c in cs)]
            lines += [f"### {model}: corruptions at {', '.join(f'{b:.1f}' for b in budgets)} bits", "",
                      f"{len(names)} corruptions × severities {', '.join(sev)} of the first "
                      "`robustness.corruption_examples` test images "
                      "(one fixed corruption seed for every model). Accuracy (%) averaged over severities; mCE: "
                      "mean over corruptions of Σ_s error / Σ_s FP error (FP = 100 %; lower is better). "
                      "ECE: mean over all corrupted sets.", "",
                      "| method | clean | corrupted (mean) | " + " | ".join(fams) + " | ECE clean | ECE corrupted | mCE (%) |",
                      "|---|" + "---|" * (len(fams) + 5)]
            for method in (m for m in LABEL if m in ood):
                for r in ood[method]:
                    c = r["ood"]["corruptions"]
                    acc = {n: _mean([v["accuracy"] for v in c[n].values()]) for n in c}
                    ece = _mean([v["ece"] for n in c for v in c[n].values()])
                    fam = [_mean([acc[n] for n in FAMILIES[f] if n in acc]) for f in fams]
                    mce = r.get("corruption", {}).get("mce") if method != "fp" else 1.0
                    seed = f" (s{r['seed']})" if len(ood[method]) > 1 else ""
                    lines.append(f"| {LABEL[method]}{seed} | {100 * r['ood']['clean']['accuracy']:.2f} | "
                                 f"{100 * _mean(list(acc.values())):.2f} | " + " | ".join(f"{100 * x:.2f}" for x in fam)
                                 + f" | {100 * r['ood']['clean']['ece']:.2f} | {100 * ece:.2f} | "
                                 + ("–" if mce is None else f"{100 * mce:.1f}") + " |")
            lines.append("")
        else:
            domains = list(first["domains"])
            lines += [f"### {model}: other domains at {', '.join(f'{b:.1f}' for b in budgets)} bits", "",
                      "Calibrated and fine-tuned on movie-review sentences; evaluated on the other domains of "
                      "the same archive (sentences with a non-zero mean rating, labelled by its sign). "
                      "Accuracy (%) (drop vs the in-domain test split) and ECE (%).", "",
                      "| method | in-domain | " + " | ".join(domains) + " | mean drop | " +
                      " | ".join(f"ECE {d}" for d in domains) + " |",
                      "|---|---|" + "---|" * (2 * len(domains) + 1)]
            for method in (m for m in LABEL if m in ood):
                for r in ood[method]:
                    ind = r["calibration"]["accuracy"]
                    ds = r["ood"]["domains"]
                    drops = [ind - ds[d]["accuracy"] for d in domains]
                    seed = f" (s{r['seed']})" if len(ood[method]) > 1 else ""
                    lines.append(f"| {LABEL[method]}{seed} | {100 * ind:.2f} | " + " | ".join(
                        f"{100 * ds[d]['accuracy']:.2f} ({100 * (ds[d]['accuracy'] - ind):+.2f})" for d in domains)
                        + f" | {100 * _mean(drops):.2f} | " + " | ".join(f"{100 * ds[d]['ece']:.2f}" for d in domains)
                        + " |")
            lines.append("")
    return (["## Out-of-domain", ""] + lines) if lines else []


def layer_table(records: list[dict], budget: float) -> list[str]:
    """Mean unit bits per layer family for each mixed-precision method at ``budget`` (first seed)."""
    lines = [f"## Per-layer bit allocation at {budget:.1f} bits", "",
             "Mean bit-width of the allocation units in each layer family (first seed); pictures: "
             "`layer_bits_<model>.png` (every layer, in network order).", ""]
    for model in dict.fromkeys(r["model"] for r in records):
        per = {r["method"]: r for r in sorted(records, key=lambda r: r["seed"], reverse=True)
               if r["model"] == model and r["budget"] == budget and r.get("layer_bits") and r["method"] != "fp"}
        methods = [m for m in LABEL if m in per]
        if not methods:
            continue
        fams: dict = defaultdict(lambda: defaultdict(list))
        for m in methods:
            for name, bits in per[m]["layer_bits"].items():
                fams[layer_kind(name)][m].append(bits)
        lines += [f"**{model}**", "", "| layer family | layers | " + " | ".join(LABEL[m] for m in methods) + " |",
                  "|---|---|" + "---|" * len(methods)]
        for kind, v in fams.items():
            n = len(next(iter(v.values())))
            lines.append(f"| {kind} | {n} | " + " | ".join(f"{_mean(v[m]):.2f}" if v.get(m) else "–"
                                                        for m in methods) + " |")
        lines.append("")
    return lines


def reliability_plot(model: str, rows: dict[str, list[dict]], budget: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(rows)
    cols = min(4, n)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(3.1 * cols, 3.2 * ((n + cols - 1) // cols)),
                             squeeze=False)
    for ax, (method, rs) in zip(axes.flat, rows.items()):
        b = rs[0]["calibration"]["bins"]  # first seed
        k = len(b["count"])
        centers = [(i + 0.5) / k for i in range(k)]
        filled = [i for i in range(k) if b["count"][i] > 0]
        ax.bar([centers[i] for i in filled], [b["accuracy"][i] for i in filled], width=1 / k, edgecolor="k",
               lw=0.4, color="tab:blue", label="accuracy")
        ax.bar([centers[i] for i in filled], [b["confidence"][i] - b["accuracy"][i] for i in filled],
               bottom=[b["accuracy"][i] for i in filled], width=1 / k, color="tab:red", alpha=0.3, label="gap")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        for i in filled:
            ax.text(centers[i], 0.02, str(b["count"][i]), rotation=90, fontsize=5, ha="center", va="bottom",
                    color="white")
        ece = 100 * rs[0]["calibration"]["ece"]
        ax.set_title(f"{LABEL[method]}\nECE {ece:.2f}%", fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"{model}: reliability at {budget:.1f} bits (bar labels: examples per bin)", fontsize=9)
    fig.supxlabel("confidence", fontsize=8)
    fig.supylabel("accuracy", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def layer_bits_plot(model: str, records: list[dict], budget: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = {r["method"]: r["layer_bits"] for r in records
           if r["model"] == model and r["budget"] == budget and r.get("layer_bits")}
    methods = [m for m in LABEL if m in per and len(set(per[m].values())) > 1]  # mixed allocations only
    if not methods:
        return
    names = list(per[methods[0]])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.09 * len(names)), 3.4))
    for m in methods:
        ax.step(range(len(names)), [per[m].get(n, float("nan")) for n in names], where="mid", lw=1, label=LABEL[m])
    step = max(1, len(names) // 30)
    ax.set_xticks(range(0, len(names), step))
    ax.set_xticklabels([names[i] for i in range(0, len(names), step)], rotation=90, fontsize=5)
    ax.set_ylabel("mean bits of the layer's units")
    ax.set_title(f"{model}: per-layer bits at {budget:.1f} average bits", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def robustness_report(records: list[dict], out: Path) -> None:
    """Write ``calibration_robustness.md`` and the pictures into ``out``."""
    budgets = sorted({r["budget"] for r in records if r["method"] != "fp"})
    if not budgets or not any(r.get("calibration") for r in records):
        return
    low = budgets[0]
    lines = ["# Calibration, tails and robustness", "", _seeds_note(records), ""]
    lines += calibration_table(records, low) + distill_table(records) + ood_tables(records) + layer_table(records, low)
    lines += ["## Figures", ""]
    for model in dict.fromkeys(r["model"] for r in records):
        rows = _rows(records, model, low)
        if rows:
            reliability_plot(model, rows, low, out / f"reliability_{model}.png")
            lines.append(f"* `reliability_{model}.png`: reliability diagrams at {low:.1f} bits.")
        layer_bits_plot(model, records, low, out / f"layer_bits_{model}.png")
        if (out / f"layer_bits_{model}.png").exists():
            lines.append(f"* `layer_bits_{model}.png`: per-layer bits at {low:.1f} bits.")
    (out / "calibration_robustness.md").write_text("\n".join(lines) + "\n")
