"""bayesq.metrics against hand-computed examples (and sklearn where it is installed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bayesq.metrics import GLUE_TASKS, accuracy, f1_binary, glue_metrics, glue_score, glue_task


def test_accuracy_hand_computed():
    pred = torch.tensor([0, 1, 1, 2, 0])
    labels = torch.tensor([0, 1, 2, 2, 1])
    assert accuracy(pred, labels) == pytest.approx(3 / 5)  # positions 0, 1, 3 correct
    assert accuracy(np.array([1, 1]), [1, 1]) == 1.0  # numpy / list inputs
    assert accuracy(torch.tensor([0], dtype=torch.int32), torch.tensor([1])) == 0.0


def test_f1_binary_hand_computed():
    pred = torch.tensor([1, 1, 0, 1, 0, 0, 1])
    labels = torch.tensor([1, 0, 0, 1, 1, 0, 1])
    # positive 1: TP = 3 (0, 3, 6), FP = 1 (1), FN = 1 (4) -> 2*3 / (6 + 1 + 1) = 0.75
    assert f1_binary(pred, labels) == pytest.approx(0.75)
    # positive 0: TP = 2 (2, 5), FP = 1 (4), FN = 1 (1) -> 4 / 6
    assert f1_binary(pred, labels, positive=0) == pytest.approx(2 / 3)
    # multi-class ids: everything but `positive` is negative
    assert f1_binary([2, 1, 2], [2, 2, 0], positive=2) == pytest.approx(2 / (2 + 1 + 1))
    # no positive predicted or present: 0.0 (sklearn zero_division=0)
    assert f1_binary([0, 0], [0, 0]) == 0.0


def test_f1_binary_matches_sklearn():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    gen = torch.Generator().manual_seed(0)
    for trial in range(5):
        pred = torch.randint(0, 2, (200,), generator=gen)
        labels = torch.randint(0, 2, (200,), generator=gen)
        for pos in (0, 1):
            ref = sklearn_metrics.f1_score(labels.numpy(), pred.numpy(), pos_label=pos, zero_division=0)
            assert f1_binary(pred, labels, positive=pos) == pytest.approx(ref, abs=1e-12)
        assert accuracy(pred, labels) == pytest.approx(sklearn_metrics.accuracy_score(labels, pred))


@pytest.mark.parametrize(
    "pred, labels, match",
    [
        (torch.tensor([0, 1]), torch.tensor([0]), "2 entries but labels has 1"),
        (torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64), "empty"),
        (torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), "integer class ids"),
        (torch.zeros(2, 3, dtype=torch.int64), torch.tensor([0, 1]), r"1-D class ids"),
    ],
)
def test_metric_input_errors(pred, labels, match):
    with pytest.raises(ValueError, match=match):
        accuracy(pred, labels)
    with pytest.raises(ValueError, match=match):
        f1_binary(pred, labels)


def test_glue_metrics_per_task():
    pred = torch.tensor([1, 1, 0, 1, 0, 0, 1])
    labels = torch.tensor([1, 0, 0, 1, 1, 0, 1])
    assert glue_metrics("qqp", pred, labels) == pytest.approx({"f1": 0.75, "accuracy": 5 / 7})
    for task in ("sst2", "qnli", "mnli-m", "mnli-mm", "SST-2", "mnli"):
        assert glue_metrics(task, pred, labels) == pytest.approx({"accuracy": 5 / 7})
    with pytest.raises(ValueError, match="unknown GLUE task 'cola'; choices: mnli-m, mnli-mm, qnli, qqp, sst2"):
        glue_metrics("cola", pred, labels)
    assert [glue_task(t) for t in GLUE_TASKS] == list(GLUE_TASKS)


def test_glue_score_matches_leaderboard():
    # BERT-large on the GLUE leaderboard: score 80.5; MNLI counts once (mean of m and mm),
    # two-metric tasks contribute the mean of their metrics.
    row = {
        "cola": 60.5, "sst2": {"accuracy": 94.9}, "mrpc": {"f1": 89.3, "accuracy": 85.4},
        "stsb": {"pearson": 87.6, "spearman": 86.5}, "qqp": {"f1": 72.1, "accuracy": 89.3},
        "mnli-m": {"accuracy": 86.7}, "mnli-mm": {"accuracy": 85.9}, "qnli": {"accuracy": 92.7},
        "rte": 70.1, "wnli": 65.1,
    }
    expected = (60.5 + 94.9 + (89.3 + 85.4) / 2 + (87.6 + 86.5) / 2 + (72.1 + 89.3) / 2
                + (86.7 + 85.9) / 2 + 92.7 + 70.1 + 65.1) / 9
    assert glue_score(row) == pytest.approx(expected)
    assert round(glue_score(row), 1) == 80.5


def test_glue_score_five_tasks_hand_computed():
    per_task = {
        "sst2": {"accuracy": 0.9}, "qnli": {"accuracy": 0.8}, "qqp": {"f1": 0.6, "accuracy": 0.8},
        "mnli-m": {"accuracy": 0.7}, "mnli-mm": {"accuracy": 0.5},
    }
    # tasks: sst2 0.9, qnli 0.8, qqp 0.7, mnli (0.7 + 0.5) / 2 = 0.6 -> mean 0.75
    assert glue_score(per_task) == pytest.approx(0.75)
    assert glue_score({"sst2": 0.5}) == 0.5
    with pytest.raises(ValueError, match="no tasks"):
        glue_score({})
    with pytest.raises(ValueError, match="'qqp' has no metrics"):
        glue_score({"qqp": {}})
