"""The report's figures: each model's accuracy-bits frontier."""

from __future__ import annotations

from pathlib import Path

from flows.methods import METHOD_LABEL
from flows.report.tables import accuracy_se


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
