"""bayesq.metrics against hand-computed examples and scikit-learn."""

from __future__ import annotations

import numpy as np
import math

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
    from sklearn import metrics as sklearn_metrics  # an independent reference (dev dependency)
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


# ---- probabilistic predictions ---------------------------------------------------------------------

from bayesq.metrics import (  # noqa: E402
    calibration_error, codebook_usage, cvar, entropy_and_mi, nll, snr_db, task_averages, topk_accuracy,
    whitened_clipping_rate, worst_k_accuracy,
)

_P = torch.tensor([[0.9, 0.05, 0.05], [0.9, 0.05, 0.05], [0.62, 0.3, 0.08], [0.41, 0.35, 0.24]], dtype=torch.float64)
_Y = torch.tensor([0, 1, 0, 2])


def test_topk_accuracy_vs_hand_count():
    assert topk_accuracy(_P, _Y, 1) == 0.5
    assert topk_accuracy(_P, _Y, 2) == 0.75  # label 1 of row 2 is second; label 2 of row 4 is third
    assert topk_accuracy(_P, _Y, 3) == 1.0
    with pytest.raises(ValueError, match="k=4"):
        topk_accuracy(_P, _Y, 4)


def test_task_averages_macro_micro_vs_hand():
    out = task_averages({"a": (3, 4), "b": (1, 1)})
    assert out["macro"] == pytest.approx(0.875) and out["micro"] == pytest.approx(0.8)


def test_calibration_error_vs_hand_computed_bins():
    # confidences 0.9, 0.9 (one right) -> bin 13; 0.62 (right) -> bin 9; 0.41 (wrong) -> bin 6
    out = calibration_error(_P, _Y, 15)
    assert out["ece"] == pytest.approx((2 * 0.4 + 0.38 + 0.41) / 4, abs=1e-12)
    assert out["mce"] == pytest.approx(0.41, abs=1e-12)


def test_calibration_error_random_boundaries_vs_loop_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 4, generator=gen, dtype=torch.float64) * 2
    probs, labels = logits.softmax(1), torch.randint(0, 4, (300,), generator=gen)
    out = calibration_error(probs, labels, 15, repeats=5, seed=11)
    conf, pred = probs.max(1)
    g = torch.Generator().manual_seed(11)
    eces, mces = [], []
    for _ in range(5):
        inner = sorted(torch.rand(14, generator=g, dtype=torch.float64).tolist())
        edges = [0.0] + inner + [1.0]
        gaps, weights = [], []
        for lo, hi in zip(edges[:-1], edges[1:]):
            members = [i for i in range(300) if (lo < conf[i] <= hi) or (lo == 0.0 and conf[i] == 0.0)]
            if members:
                acc = sum(int(pred[i] == labels[i]) for i in members) / len(members)
                gaps.append(abs(acc - sum(float(conf[i]) for i in members) / len(members)))
                weights.append(len(members) / 300)
        eces.append(sum(w * x for w, x in zip(weights, gaps)))
        mces.append(max(gaps))
    assert out["ece_random"] == pytest.approx(sum(eces) / 5, abs=1e-12)
    assert out["mce_random"] == pytest.approx(sum(mces) / 5, abs=1e-12)
    assert out["ece_random_sd"] == pytest.approx(float(torch.tensor(eces, dtype=torch.float64).std()), abs=1e-12)


def test_worst_k_accuracy_vs_hand():
    # least confident first: row 4 (0.41, wrong), row 3 (0.62, right), rows 1-2 (0.9)
    assert worst_k_accuracy(_P, _Y, 0.25) == 0.0
    assert worst_k_accuracy(_P, _Y, 0.5) == 0.5
    assert worst_k_accuracy(_P, _Y, 1.0) == 0.5


@pytest.mark.parametrize("alpha, want", [(0.5, 3.5), (0.75, 4.0), (0.6, (4 + 0.6 * 3) / 1.6), (0.0, 2.5)])
def test_cvar_vs_hand_and_rockafellar_uryasev_minimum(alpha, want):
    losses = torch.tensor([2.0, 4.0, 1.0, 3.0], dtype=torch.float64)
    assert cvar(losses, alpha) == pytest.approx(want, abs=1e-12)
    ru = min(float(v + (losses - v).clamp_min(0).mean() / (1 - alpha)) for v in losses)
    assert cvar(losses, alpha) == pytest.approx(ru, abs=1e-12)


def test_nll_vs_hand():
    assert torch.allclose(nll(_P, _Y), -torch.log(torch.tensor([0.9, 0.05, 0.62, 0.24], dtype=torch.float64)))


def test_entropy_and_mi_vs_hand():
    disagree = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)  # (S=2, N=1, C=2)
    h, mi = entropy_and_mi(disagree)
    assert float(h) == pytest.approx(math.log(2)) and float(mi) == pytest.approx(math.log(2))
    agree = torch.tensor([[[0.3, 0.7]], [[0.3, 0.7]]], dtype=torch.float64)
    h, mi = entropy_and_mi(agree)
    assert float(h) == pytest.approx(-(0.3 * math.log(0.3) + 0.7 * math.log(0.7))) and float(mi) == pytest.approx(0.0)


def test_codebook_usage_vs_hand():
    out = codebook_usage(torch.tensor([0, 0, 1, 3]), 4)
    assert out["utilization"] == 0.75 and out["entropy_bits"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        codebook_usage(torch.tensor([4]), 4)


def test_snr_db_vs_hand():
    out = snr_db(torch.tensor([1.0, -2.0]), torch.tensor([1.0, -1.0]))
    assert out["snr_db"] == pytest.approx(10 * math.log10(5)) and out["psnr_db"] == pytest.approx(10 * math.log10(8))
    assert snr_db(torch.ones(3), torch.ones(3))["snr_db"] == math.inf


def test_whitened_clipping_rate_vs_monte_carlo():
    gen = torch.Generator().manual_seed(0)
    mu = torch.tensor([0.0, 0.5, -1.0], dtype=torch.float64)
    sd = torch.tensor([1.0, 0.2, 2.0], dtype=torch.float64)
    lo, hi = -1.0, 1.0
    draws = mu + sd * torch.randn(200_000, 3, generator=gen, dtype=torch.float64)
    outside = ((draws < lo) | (draws > hi)).double()
    mc, se = float(outside.mean()), float(outside.mean(1).std() / math.sqrt(200_000))
    assert abs(whitened_clipping_rate(mu, sd, lo, hi) - mc) < 4 * se


def test_probabilistic_metrics_bad_input_is_clear():
    with pytest.raises(ValueError, match="sum to 1"):
        calibration_error(torch.ones(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="labels must lie"):
        topk_accuracy(_P, torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="alpha"):
        cvar(torch.ones(3), 1.0)
