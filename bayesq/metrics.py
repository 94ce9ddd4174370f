"""Evaluation metrics: one function per concept, pure torch, no I/O.

Class predictions and labels are 1-D integer sequences of equal length ``N >= 1`` (torch
tensors, NumPy arrays or lists; converted with ``torch.as_tensor``). Scores are Python floats
in [0, 1] (GLUE aggregates keep the scale of their inputs).

GLUE conventions (Wang et al., 2018; the GLUE leaderboard):

* SST-2, QNLI, MNLI-m, MNLI-mm: accuracy. QQP: accuracy and F1 of the positive class
  (``is_duplicate = 1``).
* The GLUE score is the unweighted mean over *tasks*; a task with several metrics contributes
  the mean of those metrics. MNLI is one task whose two metrics are the matched and the
  mismatched accuracy, so ``mnli-m`` and ``mnli-mm`` are averaged into one ``mnli`` score
  before the macro average.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

#: GLUE tasks with an evaluation protocol here (canonical names).
GLUE_TASKS = ("mnli-m", "mnli-mm", "qnli", "qqp", "sst2")

#: Official GLUE metrics of each task, in leaderboard order.
GLUE_TASK_METRICS: dict[str, tuple[str, ...]] = {
    "mnli-m": ("accuracy",),
    "mnli-mm": ("accuracy",),
    "qnli": ("accuracy",),
    "qqp": ("f1", "accuracy"),
    "sst2": ("accuracy",),
}

_ALIASES = {
    "sst-2": "sst2", "mnli": "mnli-m", "mnli_m": "mnli-m", "mnli-matched": "mnli-m",
    "mnli_matched": "mnli-m", "mnli_mm": "mnli-mm", "mnli-mismatched": "mnli-mm",
    "mnli_mismatched": "mnli-mm",
}

#: Tasks that the GLUE score merges into one (MNLI's matched and mismatched dev/test sets).
_SCORE_GROUPS = {"mnli-m": "mnli", "mnli-mm": "mnli"}


def glue_task(name: str) -> str:
    """Canonical GLUE task name (case-insensitive; ``SST-2`` -> ``sst2``, ``mnli`` -> ``mnli-m``).

    Raises:
        ValueError: unknown task, listing the choices.
    """
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; choices: {', '.join(GLUE_TASKS)}")
    return key


def _class_ids(pred: Any, labels: Any) -> tuple[Tensor, Tensor]:
    """``pred``, ``labels`` as int64 (N,) tensors on the CPU; checks shapes and ``N >= 1``."""
    p = torch.as_tensor(pred).detach().cpu()
    y = torch.as_tensor(labels).detach().cpu()
    for what, t in (("pred", p), ("labels", y)):
        if t.dim() != 1:
            raise ValueError(f"{what} must be 1-D class ids (N,), got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{what} must hold integer class ids, got dtype {t.dtype}")
    if p.shape != y.shape:
        raise ValueError(f"pred has {p.shape[0]} entries but labels has {y.shape[0]}")
    if p.shape[0] == 0:
        raise ValueError("pred and labels are empty: need at least one example")
    return p.to(torch.int64), y.to(torch.int64)


def accuracy(pred: Any, labels: Any) -> float:
    """Fraction of correct predictions, ``acc = (1/N) sum_i [pred_i == labels_i]``.

    Args:
        pred: integer class ids (N,).
        labels: integer class ids (N,).

    Returns:
        accuracy in [0, 1].
    """
    p, y = _class_ids(pred, labels)
    return float((p == y).sum()) / p.shape[0]


def f1_binary(pred: Any, labels: Any, positive: int = 1) -> float:
    """F1 score of the class ``positive``: ``F1 = 2 TP / (2 TP + FP + FN)``.

    ``TP = #{pred = pos, label = pos}``, ``FP = #{pred = pos, label != pos}``,
    ``FN = #{pred != pos, label = pos}`` (the harmonic mean of precision and recall). Any other
    class id counts as negative. When ``TP + FP + FN = 0`` (no positive predicted or present)
    the score is 0.0, as ``sklearn.metrics.f1_score(zero_division=0)``.

    Args:
        pred: integer class ids (N,).
        labels: integer class ids (N,).
        positive: the class id whose F1 is returned.

    Returns:
        F1 in [0, 1].
    """
    p, y = _class_ids(pred, labels)
    pp, yp = p == positive, y == positive
    tp = int((pp & yp).sum())
    fp = int((pp & ~yp).sum())
    fn = int((~pp & yp).sum())
    denom = 2 * tp + fp + fn
    return 2 * tp / denom if denom else 0.0


def glue_metrics(task: str, pred: Any, labels: Any) -> dict[str, float]:
    """The official GLUE metrics of ``task`` (see ``GLUE_TASK_METRICS``).

    Args:
        task: one of ``GLUE_TASKS`` (aliases as in ``glue_task``).
        pred: integer class ids (N,) in the task's label ids (HF GLUE convention).
        labels: integer class ids (N,).

    Returns:
        ``{"accuracy": a}``, and for QQP ``{"f1": f, "accuracy": a}`` (F1 of ``is_duplicate=1``).
    """
    name = glue_task(task)
    out = {}
    for metric in GLUE_TASK_METRICS[name]:
        out[metric] = f1_binary(pred, labels, positive=1) if metric == "f1" else accuracy(pred, labels)
    return out


def glue_score(per_task: Mapping[str, Mapping[str, float] | float]) -> float:
    """GLUE-style macro average: ``score = (1/T) sum_t mean(metrics of task t)``.

    A task given as a dict of metrics contributes their unweighted mean (QQP: (F1 + acc) / 2);
    a task given as a number contributes that number. ``mnli-m`` and ``mnli-mm`` form one task
    ``mnli`` whose metrics are the two accuracies, as on the GLUE leaderboard. Task names other
    than ``GLUE_TASKS`` are accepted as their own tasks (e.g. ``cola``), so the function also
    computes the full nine-task score. Scale follows the inputs ([0, 1] or percent).

    Args:
        per_task: task name -> ``{metric: value}`` (as from ``glue_metrics``) or a value.

    Returns:
        the macro average over the (grouped) tasks.

    Raises:
        ValueError: empty ``per_task`` or a task with no metrics.
    """
    if not per_task:
        raise ValueError("glue_score: no tasks given")
    groups: dict[str, list[float]] = {}
    for task, metrics in per_task.items():
        key = str(task).strip().lower()
        key = _ALIASES.get(key, key)
        if isinstance(metrics, Mapping):
            if not metrics:
                raise ValueError(f"glue_score: task {task!r} has no metrics")
            value = sum(float(v) for v in metrics.values()) / len(metrics)
        else:
            value = float(metrics)
        groups.setdefault(_SCORE_GROUPS.get(key, key), []).append(value)
    task_scores = [sum(v) / len(v) for v in groups.values()]
    return sum(task_scores) / len(task_scores)


# ---- probabilistic predictions: top-k, calibration, tails, uncertainty ---------------------------

def _probs(probs: Any, labels: Any | None = None) -> tuple[Tensor, Tensor | None]:
    """``probs`` as float64 (N, C) rows on the simplex (checked), ``labels`` as int64 (N,)."""
    p = torch.as_tensor(probs).detach().cpu().to(torch.float64)
    if p.dim() != 2 or p.shape[0] == 0 or p.shape[1] < 2:
        raise ValueError(f"probs must be (N, C) class probabilities with N >= 1, C >= 2; got {tuple(p.shape)}")
    if not torch.isfinite(p).all() or (p < 0).any() or not torch.allclose(p.sum(1), torch.ones(p.shape[0],
                                                                                       dtype=p.dtype), atol=1e-4):
        raise ValueError("probs rows must be finite, non-negative and sum to 1 (pass softmax(logits))")
    if labels is None:
        return p, None
    y = torch.as_tensor(labels).detach().cpu()
    if y.dim() != 1 or y.shape[0] != p.shape[0] or y.is_floating_point():
        raise ValueError(f"labels must be {p.shape[0]} integer class ids (N,), got {y.dtype} {tuple(y.shape)}")
    y = y.to(torch.int64)
    if (y < 0).any() or (y >= p.shape[1]).any():
        raise ValueError(f"labels must lie in [0, {p.shape[1] - 1}]")
    return p, y


def topk_accuracy(probs: Any, labels: Any, k: int = 1) -> float:
    """Share of examples whose label is among the ``k`` most probable classes (ties: lowest index).

    Args:
        probs: (N, C) class probabilities (``softmax(logits)``).
        labels: (N,) integer class ids.
    """
    p, y = _probs(probs, labels)
    if not 1 <= k <= p.shape[1]:
        raise ValueError(f"k={k} must be in [1, {p.shape[1]}]")
    top = torch.topk(p, k, dim=1).indices  # (N, k)
    return float((top == y[:, None]).any(1).double().mean())


def task_averages(per_task: Mapping[str, tuple[int, int]]) -> dict[str, float]:
    """Macro and micro accuracy over tasks given as ``{task: (correct, n)}``.

    ``macro = (1/T) sum_t correct_t / n_t``;  ``micro = sum_t correct_t / sum_t n_t``.
    """
    if not per_task or any(n <= 0 or not 0 <= c <= n for c, n in per_task.values()):
        raise ValueError("task_averages: need >= 1 task, each (correct, n) with 0 <= correct <= n, n >= 1")
    macro = sum(c / n for c, n in per_task.values()) / len(per_task)
    micro = sum(c for c, _ in per_task.values()) / sum(n for _, n in per_task.values())
    return {"macro": macro, "micro": micro}


def reliability_bins(confidence: Tensor, correct: Tensor, edges: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-bin (count, accuracy, mean confidence) for bin ``edges`` (B+1,), ascending, 0 .. 1.

    Bin b holds ``edges[b] < conf <= edges[b+1]`` (the first bin also holds conf = 0).
    Empty bins have accuracy and confidence 0. Shapes: (B,) int64, (B,) float64, (B,) float64.
    """
    idx = torch.bucketize(confidence, edges[1:-1], right=False)  # (N,) in [0, B-1]
    n_bins = edges.numel() - 1
    count = torch.bincount(idx, minlength=n_bins)
    acc = torch.bincount(idx, weights=correct.double(), minlength=n_bins) / count.clamp_min(1)
    conf = torch.bincount(idx, weights=confidence.double(), minlength=n_bins) / count.clamp_min(1)
    return count, acc, conf


def bin_errors(confidence: Tensor, correct: Tensor, edges: Tensor) -> tuple[float, float]:
    """(ECE, MCE) of (N,) float64 top-1 ``confidence`` and 0/1 ``correct`` over the bins ``edges``
    (:func:`reliability_bins`; the formulas of :func:`calibration_error`)."""
    count, acc, cf = reliability_bins(confidence, correct, edges)
    gap = (acc - cf).abs()
    return float((count.double() / count.sum() * gap).sum()), float(gap[count > 0].max())


def calibration_error(
    probs: Any, labels: Any, n_bins: int = 15, *, repeats: int = 0, seed: int = 0,
) -> dict[str, float]:
    """Expected and maximum calibration error of the top-1 confidence.

    ``ECE = sum_b (n_b / N) |acc_b - conf_b|``, ``MCE = max_{b: n_b > 0} |acc_b - conf_b|`` over
    ``n_bins`` equal-width bins of the confidence ``max_c p_c``. With ``repeats = R > 0`` the two
    are also averaged over R binnings with random boundaries (``n_bins - 1`` interior edges drawn
    uniformly on (0, 1), seeded), which removes the dependence on where the fixed edges fall:
    ``ece_random`` / ``mce_random`` are the means, ``*_random_sd`` the standard deviations.

    Returns:
        ``{"ece", "mce"}`` (fixed bins) plus the random-boundary statistics when ``repeats > 0``.
    """
    p, y = _probs(probs, labels)
    if n_bins < 1 or repeats < 0:
        raise ValueError(f"n_bins={n_bins} must be >= 1 and repeats={repeats} >= 0")
    conf, pred = p.max(1)
    correct = (pred == y).double()

    def errors(edges: Tensor) -> tuple[float, float]:
        return bin_errors(conf, correct, edges)

    out = dict(zip(("ece", "mce"), errors(torch.linspace(0, 1, n_bins + 1, dtype=torch.float64))))
    if repeats:
        gen = torch.Generator().manual_seed(seed)
        draws = []
        for _ in range(repeats):
            inner = torch.rand(n_bins - 1, generator=gen, dtype=torch.float64).sort().values
            draws.append(errors(torch.cat([torch.zeros(1, dtype=torch.float64), inner,
                                           torch.ones(1, dtype=torch.float64)])))
        d = torch.tensor(draws, dtype=torch.float64)  # (R, 2)
        sd = d.std(0) if repeats > 1 else torch.zeros(2, dtype=torch.float64)
        out.update(ece_random=float(d[:, 0].mean()), mce_random=float(d[:, 1].mean()),
                   ece_random_sd=float(sd[0]), mce_random_sd=float(sd[1]))
    return out


def worst_k_accuracy(probs: Any, labels: Any, k: float = 0.10) -> float:
    """Accuracy on the ``ceil(k N)`` least confident examples (top-1 confidence, stable order)."""
    p, y = _probs(probs, labels)
    if not 0 < k <= 1:
        raise ValueError(f"k={k} must be a fraction in (0, 1]")
    conf, pred = p.max(1)
    return least_confident_accuracy(conf, (pred == y).double(), k)


def least_confident_accuracy(confidence: Tensor, correct: Tensor, k: float) -> float:
    """Mean of (N,) 0/1 ``correct`` over the ``ceil(k N)`` smallest ``confidence`` (stable order):
    :func:`worst_k_accuracy` from per-example values."""
    m = max(1, math.ceil(k * confidence.shape[0] - 1e-9))
    low = torch.argsort(confidence, stable=True)[:m]
    return float(correct[low].mean())


def cvar(losses: Any, alpha: float = 0.95) -> float:
    """Conditional value at risk of per-example losses (the mean of the worst ``1 - alpha`` tail).

    Rockafellar-Uryasev for the empirical distribution of N losses:
    ``CVaR_alpha = min_v v + E[(L - v)_+] / (1 - alpha)``, attained at the alpha-quantile
    ``v = VaR_alpha``; equal to the mean of the ``(1 - alpha) N`` largest losses when that is an
    integer (a fractional last atom is weighted in otherwise).

    Args:
        losses: (N,) float losses, e.g. the negative log-likelihood of the label.
    """
    loss = torch.as_tensor(losses).detach().cpu().to(torch.float64).reshape(-1)
    if loss.numel() == 0 or not torch.isfinite(loss).all():
        raise ValueError("cvar: need at least one finite loss")
    if not 0 <= alpha < 1:
        raise ValueError(f"alpha={alpha} must be in [0, 1)")
    srt = loss.sort(descending=True).values
    tail = (1 - alpha) * loss.numel()  # mass of the tail in examples
    whole = int(math.floor(tail + 1e-9))
    total = srt[:whole].sum()
    if whole < loss.numel() and tail - whole > 1e-9:
        total = total + (tail - whole) * srt[whole]
    return float(total / tail)


def nll(probs: Any, labels: Any) -> Tensor:
    """Per-example negative log-likelihood ``-log p_{y_i}`` (N,) float64 (clamped at 1e-300)."""
    p, y = _probs(probs, labels)
    return -p.gather(1, y[:, None]).squeeze(1).clamp_min(1e-300).log()


def entropy_and_mi(sample_probs: Any) -> tuple[Tensor, Tensor]:
    """Predictive entropy and mutual information from S posterior samples (nats).

    ``H[p_bar] = -sum_c p_bar_c log p_bar_c`` with ``p_bar = mean_s p_s``;
    ``MI = H[p_bar] - mean_s H[p_s]`` (the epistemic part, >= 0 by concavity).

    Args:
        sample_probs: (S, N, C) class probabilities of S posterior samples.

    Returns:
        (entropy, mi), each (N,) float64.
    """
    p = torch.as_tensor(sample_probs).detach().cpu().to(torch.float64)
    if p.dim() != 3 or min(p.shape) < 1:
        raise ValueError(f"sample_probs must be (S, N, C), got {tuple(p.shape)}")
    for s in p:
        _probs(s)

    def ent(x: Tensor) -> Tensor:
        return -(x * x.clamp_min(1e-300).log()).sum(-1)

    h = ent(p.mean(0))
    return h, (h - ent(p).mean(0)).clamp_min(0.0)


def codebook_usage(codes: Any, levels: int) -> dict[str, float]:
    """Share of the ``levels`` codes used and the usage entropy ``-sum_k f_k log2 f_k`` (bits)."""
    c = torch.as_tensor(codes).detach().cpu().reshape(-1)
    if c.numel() == 0 or c.is_floating_point() or (c < 0).any() or (c >= levels).any():
        raise ValueError(f"codes must be a non-empty integer tensor with values in [0, {levels - 1}]")
    f = torch.bincount(c.to(torch.int64), minlength=levels).double() / c.numel()
    used = f[f > 0]
    return {"utilization": float((f > 0).double().mean()), "entropy_bits": float(-(used * used.log2()).sum())}


def snr_db(weight: Any, quantized: Any) -> dict[str, float]:
    """``SNR = 10 log10(sum w^2 / sum (w - q)^2)``, ``PSNR = 10 log10(max w^2 / mean (w - q)^2)`` (dB).

    An exact copy gives ``inf``.
    """
    w = torch.as_tensor(weight).detach().cpu().to(torch.float64)
    q = torch.as_tensor(quantized).detach().cpu().to(torch.float64)
    if w.shape != q.shape or w.numel() == 0:
        raise ValueError(f"weight {tuple(w.shape)} and quantized {tuple(q.shape)} must have one non-empty shape")
    err = (w - q).pow(2)
    if float(err.sum()) == 0:
        return {"snr_db": math.inf, "psnr_db": math.inf}
    return {"snr_db": 10 * math.log10(float(w.pow(2).sum() / err.sum())),
            "psnr_db": 10 * math.log10(float(w.pow(2).max() / err.mean()))}


def whitened_clipping_rate(mean: Any, std: Any, lo: Any, hi: Any) -> float:
    """Posterior probability mass outside the grid range, averaged over weights.

    ``rate = (1/n) sum_i [Phi((lo_i - mu_i) / sigma_i) + 1 - Phi((hi_i - mu_i) / sigma_i)]``: the
    share of posterior draws the grid clips, measured in the posterior's whitened coordinates.
    ``lo``, ``hi`` broadcast against ``mean`` (per-group ranges expanded by the caller).
    """
    mu = torch.as_tensor(mean).detach().cpu().to(torch.float64)
    sd = torch.as_tensor(std).detach().cpu().to(torch.float64)
    if mu.shape != sd.shape or mu.numel() == 0 or not (sd > 0).all():
        raise ValueError("mean and std must share one non-empty shape, with std > 0")
    lo = torch.as_tensor(lo, dtype=torch.float64)
    hi = torch.as_tensor(hi, dtype=torch.float64)
    normal = torch.distributions.Normal(torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64))
    mass = normal.cdf((lo - mu) / sd) + normal.cdf((mu - hi) / sd)
    return float(mass.mean())
