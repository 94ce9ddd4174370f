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
