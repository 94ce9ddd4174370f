"""Test-set evaluation (bayesq/evaluation.py): predict and prediction_summary vs hand computations."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from bayesq.evaluation import bootstrap_se, predict, prediction_summary

# 6 examples, 3 classes: logits = log(p), so softmax gives back p (rows sum to 1)
PROBS = np.array([
    [0.70, 0.20, 0.10],  # label 0: right, conf 0.70
    [0.50, 0.30, 0.20],  # label 1: wrong, conf 0.50
    [0.11, 0.78, 0.11],  # label 1: right, conf 0.78
    [0.28, 0.10, 0.62],  # label 2: right, conf 0.62
    [0.42, 0.33, 0.25],  # label 2: wrong, conf 0.42
    [0.04, 0.06, 0.90],  # label 2: right, conf 0.90
])
LABELS = np.array([0, 1, 1, 2, 2, 2])


def _softmax(logit):
    z = np.asarray(logit, dtype=np.float64)
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _bins(conf, correct, n_bins=15):
    """Loop over equal-width bins (lo, hi]; the first bin also takes conf = 0."""
    count, acc, cf = [0] * n_bins, [0.0] * n_bins, [0.0] * n_bins
    for c, ok in zip(conf, correct):
        b = next(i for i in range(n_bins) if c <= (i + 1) / n_bins)
        count[b] += 1
        acc[b] += ok
        cf[b] += c
    acc = [a / n if n else 0.0 for a, n in zip(acc, count)]
    cf = [c / n if n else 0.0 for c, n in zip(cf, count)]
    return count, acc, cf


def _cvar(loss, alpha):
    """Rockafellar-Uryasev: min over v of v + E[(L - v)+] / (1 - alpha) (attained at a data point)."""
    return min(v + sum(max(x - v, 0.0) for x in loss) / (len(loss) * (1 - alpha)) for v in loss)


def _worst(conf, correct, k):
    m = max(1, math.ceil(k * len(conf) - 1e-9))
    order = sorted(range(len(conf)), key=lambda i: conf[i])
    return sum(correct[i] for i in order[:m]) / m


def _reference(logit, labels):
    p = _softmax(logit)
    n = len(labels)
    pred = p.argmax(1)
    conf = p.max(1)
    correct = [int(pred[i] == labels[i]) for i in range(n)]
    loss = [-math.log(p[i, labels[i]]) for i in range(n)]
    count, acc, cf = _bins(conf, correct)
    gaps = [abs(a - c) for a, c in zip(acc, cf)]
    return {
        "accuracy": sum(correct) / n, "nll": sum(loss) / n,
        "worst5": _worst(conf, correct, 0.05), "worst10": _worst(conf, correct, 0.10),
        "cvar90": _cvar(loss, 0.90), "cvar95": _cvar(loss, 0.95),
        "ece": sum(k / n * g for k, g in zip(count, gaps)),
        "mce": max(g for k, g in zip(count, gaps) if k),
        "bins": {"count": count, "accuracy": acc, "confidence": cf},
    }


def _check(out, ref):
    for key in ("accuracy", "nll", "worst5", "worst10", "cvar90", "cvar95", "ece", "mce"):
        assert out[key] == pytest.approx(ref[key], rel=1e-9, abs=1e-12), key
    assert out["bins"]["count"] == ref["bins"]["count"]
    np.testing.assert_allclose(out["bins"]["accuracy"], ref["bins"]["accuracy"], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(out["bins"]["confidence"], ref["bins"]["confidence"], rtol=1e-12, atol=1e-15)


# ---- predict -------------------------------------------------------------------------------------

class _DictModel(nn.Module):
    """forward(input_ids=..., attention_mask=...) -> object with ``.logits`` (Hugging Face style)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        h = (self.emb(input_ids) * attention_mask[..., None]).sum(1)
        return SimpleNamespace(logits=self.head(h))


def test_predict_concatenates_batches_in_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, 4, generator=g, dtype=torch.float64) for n in (3, 5, 1, 2)]
    model.train()  # predict must switch dropout off, and give the model back in training mode
    out = predict(model, batches)
    assert model.training
    with torch.no_grad():
        ref = model.eval()(torch.cat(batches)).float()
    assert out.dtype == torch.float32 and out.shape == (11, 3)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    rev = predict(model, batches[::-1])
    assert not torch.allclose(rev, out)  # order matters, so the check above is about order
    assert not out.requires_grad


def test_predict_dict_batches_with_logits_attribute():
    torch.manual_seed(0)
    model = _DictModel()
    g = torch.Generator().manual_seed(2)
    batches = []
    for n in (2, 4, 3):
        ids = torch.randint(0, 11, (n, 5), generator=g)
        mask = (torch.rand(n, 5, generator=g) > 0.3).long()
        batches.append({"input_ids": ids, "attention_mask": mask})
    out = predict(model, batches)
    with torch.no_grad():
        ref = torch.cat([model(**b).logits for b in batches])
    assert out.shape == (9, 3)
    assert torch.equal(out, ref)


def test_predict_empty_raises():
    with pytest.raises(ValueError, match="no batches"):
        predict(nn.Linear(2, 2), [])


# ---- prediction_summary ----------------------------------------------------------------------------

def test_prediction_summary_hand_example():
    logit = torch.tensor(np.log(PROBS))
    out = prediction_summary(logit, torch.tensor(LABELS))
    # by hand: right on rows 0, 2, 3, 5; least confident is row 4 (0.42, wrong)
    assert out["accuracy"] == pytest.approx(4 / 6, abs=1e-15)
    nll = -(math.log(0.7) + math.log(0.3) + math.log(0.78) + math.log(0.62) + math.log(0.25) + math.log(0.9)) / 6
    assert out["nll"] == pytest.approx(nll, rel=1e-12)
    assert out["worst5"] == 0.0 and out["worst10"] == 0.0  # ceil(0.05 * 6) = ceil(0.6) = 1 example: row 4
    assert out["cvar90"] == pytest.approx(-math.log(0.25), rel=1e-12)  # tail of 0.6 examples: the largest loss
    # bins of width 1/15: 0.42 -> 6, 0.5 -> 7, 0.62 -> 9, 0.7 -> 10, 0.78 -> 11, 0.9 -> 13
    count = [0] * 15
    for b in (6, 7, 9, 10, 11, 13):
        count[b] = 1
    assert out["bins"]["count"] == count
    ece = (0.3 + 0.5 + 0.22 + 0.38 + 0.42 + 0.1) / 6  # one example per bin: |correct - conf|
    assert out["ece"] == pytest.approx(ece, rel=1e-12)
    assert out["mce"] == pytest.approx(0.5, rel=1e-12)
    assert "top5" not in out and "f1" not in out
    _check(out, _reference(logit.numpy(), LABELS))


@pytest.mark.parametrize("n,c", [(40, 4), (37, 7), (50, 2)])
def test_prediction_summary_vs_loops(n, c):
    g = torch.Generator().manual_seed(n * 10 + c)
    logit = 2.0 * torch.randn(n, c, generator=g, dtype=torch.float64)
    labels = torch.randint(0, c, (n,), generator=g)
    out = prediction_summary(logit, labels)
    _check(out, _reference(logit.numpy(), labels.numpy()))
    assert sum(out["bins"]["count"]) == n and len(out["bins"]["count"]) == 15
    assert ("top5" in out) == (c > 5)
    assert ("f1" in out) == (c == 2)


def test_prediction_summary_top5_vs_loop():
    n, c = 60, 8
    g = torch.Generator().manual_seed(5)
    logit = torch.randn(n, c, generator=g, dtype=torch.float64)
    labels = torch.randint(0, c, (n,), generator=g)
    p = _softmax(logit.numpy())
    hits = sum(int(sum(p[i, j] > p[i, labels[i]] for j in range(c)) < 5) for i in range(n))
    out = prediction_summary(logit, labels)
    assert out["top5"] == pytest.approx(hits / n, abs=1e-15)
    assert out["accuracy"] < out["top5"] < 1.0
    assert "top5" not in prediction_summary(logit[:, :5], labels.clamp(max=4))


def test_prediction_summary_f1_binary():
    g = torch.Generator().manual_seed(6)
    logit = torch.randn(45, 2, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 2, (45,), generator=g)
    pred = logit.argmax(1)
    tp = int(((pred == 1) & (labels == 1)).sum())
    fp = int(((pred == 1) & (labels == 0)).sum())
    fn = int(((pred == 0) & (labels == 1)).sum())
    out = prediction_summary(logit, labels)
    assert out["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn), abs=1e-15)
    from sklearn import metrics as sklearn_metrics  # an independent reference (dev dependency)
    assert out["f1"] == pytest.approx(sklearn_metrics.f1_score(labels.numpy(), pred.numpy()), abs=1e-12)


def test_bootstrap_se_vs_analytic_standard_errors():
    g = torch.Generator().manual_seed(8)
    n = 2000
    logit = 1.5 * torch.randn(n, 4, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (n,), generator=g)
    p = torch.softmax(logit, -1)
    loss = -p[torch.arange(n), labels].log()
    acc = float((p.argmax(1) == labels).double().mean())

    def fn(p_, y):
        return {"accuracy": float((p_.argmax(1) == y).double().mean()),
                "nll": float(-p_[torch.arange(len(y)), y].log().mean())}

    se = bootstrap_se(p, labels, fn, resamples=2000, seed=1)
    # the bootstrap SE of a mean is sd / sqrt(n) (n denominator) up to Monte Carlo error (~1.6 % here)
    assert se["accuracy"] == pytest.approx(math.sqrt(acc * (1 - acc) / n), rel=0.06)
    assert se["nll"] == pytest.approx(float(loss.std(unbiased=False)) / math.sqrt(n), rel=0.06)
    assert bootstrap_se(p, labels, fn, resamples=50, seed=1) == bootstrap_se(p, labels, fn, resamples=50, seed=1)
    with pytest.raises(ValueError, match="at least 2 resamples"):
        bootstrap_se(p, labels, fn, resamples=1)


def test_prediction_summary_se_every_test_sampling_metric():
    g = torch.Generator().manual_seed(9)
    logit = 2.0 * torch.randn(300, 8, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 8, (300,), generator=g)
    out = prediction_summary(logit, labels, resamples=300)
    assert set(out["se"]) == {"accuracy", "top5", "nll", "worst5", "worst10", "cvar90", "cvar95", "ece", "mce"}
    acc = out["accuracy"]
    assert out["se"]["accuracy"] == pytest.approx(math.sqrt(acc * (1 - acc) / 300), rel=0.15)
    assert all(v >= 0 for v in out["se"].values()) and out["se"]["nll"] > 0 and out["se"]["ece"] > 0


@pytest.mark.parametrize("classes", [2, 8])
def test_prediction_summary_se_from_example_values_vs_resampling_probabilities(classes):
    # the SEs come from per-example values; the same resamples of the (N, C) probabilities
    # through every metric function give the same numbers
    from bayesq.evaluation import _scalars

    g = torch.Generator().manual_seed(4)
    logit = (2.0 * torch.randn(400, classes, generator=g, dtype=torch.float64)).round(decimals=1)  # ties in confidence
    labels = torch.randint(0, classes, (400,), generator=g)
    got = prediction_summary(logit, labels, n_bins=10, resamples=40, seed=3)["se"]
    p = torch.softmax(logit, -1)
    want = bootstrap_se(p, labels, lambda p_, y: _scalars(p_, y, 10, 0, 3), resamples=40, seed=3)
    assert got == want


def test_prediction_summary_random_bins_seeded():
    g = torch.Generator().manual_seed(7)
    logit = torch.randn(30, 3, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (30,), generator=g)
    a = prediction_summary(logit, labels, repeats=4, seed=3)
    b = prediction_summary(logit, labels, repeats=4, seed=3)
    c = prediction_summary(logit, labels, repeats=4, seed=4)
    for key in ("ece_random", "mce_random", "ece_random_sd", "mce_random_sd"):
        assert a[key] == b[key]
    assert a["ece_random"] != c["ece_random"]
    assert a["ece"] == c["ece"]  # fixed bins do not depend on the seed
    assert 0 <= a["ece_random"] <= a["mce_random"] <= 1


def test_prediction_summary_float32_logits_computed_in_float64():
    logit = torch.tensor(np.log(PROBS))
    a = prediction_summary(logit, torch.tensor(LABELS))
    b = prediction_summary(logit.float(), torch.tensor(LABELS))
    assert b["nll"] == pytest.approx(a["nll"], rel=1e-6)


def test_prediction_summary_length_mismatch_raises():
    logit = torch.zeros(5, 3)
    with pytest.raises(ValueError, match="5 logits but 4 labels"):
        prediction_summary(logit, torch.zeros(4, dtype=torch.int64))


def test_kl_per_input_mismatched_reference_names_the_fix():
    from bayesq.evaluation import kl_per_input, reference_log_probs

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    batches = [torch.randn(5, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)]
    ref = reference_log_probs(model, batches)
    assert torch.equal(kl_per_input(ref, model, batches), torch.zeros(7, dtype=torch.float64))
    with pytest.raises(ValueError, match="1 batches of log-probabilities for 2 input batches"):
        kl_per_input(ref[:1], model, batches)
    with pytest.raises(ValueError, match=r"batch 0 has shape \(2, 3\) but the model gives \(5, 3\)"):
        kl_per_input(ref[::-1], model, batches)


def test_one_evaluation_loop_and_one_rule_for_no_batches():
    """predict, the zoo's accuracy and GLUE's predictions run the same loop and all refuse an
    empty input; the loop itself returns nothing for it."""
    from bayesq.evaluation import each_batch
    from bayesq.harness.models.glue import predictions
    from bayesq.harness.models.zoo import evaluate

    model = nn.Linear(4, 3)
    assert each_batch(model, [], lambda m, b: m(b)) == []
    for call in (lambda: predict(model, []), lambda: predictions(model, []),
                 lambda: evaluate(model, [], torch.zeros(0, dtype=torch.int64))):
        with pytest.raises(ValueError, match="no batches to evaluate"):
            call()
    x = torch.randn(6, 4)
    assert torch.equal(predictions(model, [x[:2], x[2:]]), predict(model, [x]).argmax(-1))


def _lm_pair():
    """A tiny causal LM, a perturbed copy of it (the 'quantised' model), float64."""
    import copy

    from nets import TinyCausalLM

    torch.manual_seed(0)
    fp = TinyCausalLM().double().eval()
    q = copy.deepcopy(fp)
    with torch.no_grad():
        for p in q.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return fp, q


def _hand_token_mean_kl(fp, q, batches) -> list[float]:
    """Per sequence, run alone on its real tokens: mean over tokens of sum_v p (log p - log q)."""
    out = []
    for b in batches:
        for i, n in enumerate(b["attention_mask"].sum(1).tolist()):
            ids = b["input_ids"][i:i + 1, :n]
            with torch.no_grad():
                lp = torch.log_softmax(fp(input_ids=ids)["logits"][0], -1)
                lq = torch.log_softmax(q(input_ids=ids)["logits"][0], -1)
            out.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
    return out


def test_kl_per_input_language_model_token_mean_and_padding_ignored():
    """(B, T, V) logits: each input's KL is the mean over its real tokens of the per-token KL;
    the reference is recomputed per batch (FPReference, sliceable); more padding appended changes
    nothing, and the FP model against itself scores 0."""
    from bayesq.evaluation import FPReference, kl_per_input, mean_kl, reference_log_probs
    from nets import lm_batches, with_padding

    fp, q = _lm_pair()
    batches = lm_batches([[3, 5, 2], [4, 1, 4]])
    ref = reference_log_probs(fp, batches)
    assert isinstance(ref, FPReference) and len(ref) == len(batches)
    got = kl_per_input(ref, q, batches)
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(_hand_token_mean_kl(fp, q, batches),
                                                                        rel=1e-10, abs=1e-15)
    padded = with_padding(batches, 3)
    torch.testing.assert_close(kl_per_input(reference_log_probs(fp, padded), q, padded), got, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(kl_per_input(ref[1:], q, batches[1:]), got[len(batches[0]["input_ids"]):],
                               rtol=0, atol=0)
    stored = [ref[i] for i in range(len(ref))]  # (B, T, V) log-probabilities given explicitly
    torch.testing.assert_close(kl_per_input(stored, q, batches), got, rtol=1e-12, atol=1e-15)
    assert mean_kl(ref, fp, batches) == 0.0
    with pytest.raises(ValueError, match=r"reference batch 0 has shape \(3, 4, 23\) but the model gives \(3, 5, 23\)"):
        kl_per_input(stored[::-1], q, batches)


def test_kl_per_input_fp_reference_in_parts_vs_whole_batches(monkeypatch):
    """Against an FPReference a batch is scored in parts of KL_PART_POSITIONS token positions:
    both models see parts of the batch (ceil(3 inputs / 1) or / 2), and the per-input KL is that
    of each input run alone."""
    import bayesq.evaluation as E
    from nets import lm_batches, with_padding

    fp, q = _lm_pair()
    batches = with_padding(lm_batches([[3, 5, 2], [4, 1, 4]]), 2)  # 3 inputs per batch, 7 positions
    want = torch.tensor(_hand_token_mean_kl(fp, q, batches), dtype=torch.float64)
    for per_part, sizes in [(7, [1, 1, 1]), (14, [2, 1]), (10**6, [3])]:
        monkeypatch.setattr(E, "KL_PART_POSITIONS", per_part)
        seen = []
        hooks = [m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["input_ids"].shape[0]),
                                             with_kwargs=True) for m in (fp, q)]
        got = E.kl_per_input(E.reference_log_probs(fp, batches), q, batches)
        for h in hooks:
            h.remove()
        assert seen[-2 * len(sizes) * len(batches):] == [n for n in sizes for _ in (q, fp)] * len(batches)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-15)


def test_token_kl_chunks_vs_one_pass(monkeypatch):
    import bayesq.evaluation as E

    g = torch.Generator().manual_seed(0)
    z_p, z_q = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 6, generator=g)
    mask = torch.rand(3, 4, generator=g) > 0.3
    lp, lq = torch.log_softmax(z_p[mask].double() / 2, -1), torch.log_softmax(z_q[mask].double() / 2, -1)
    want = (lp.exp() * (lp - lq)).sum(-1)
    torch.testing.assert_close(E.token_kl(z_p, z_q, mask, 2.0), want, rtol=1e-14, atol=0)
    monkeypatch.setattr(E, "KL_CHUNK", 7)  # one row per chunk
    torch.testing.assert_close(E.token_kl(z_p, z_q, mask, 2.0), want, rtol=1e-14, atol=0)


def test_token_kl_of_features_is_half_the_squared_distance():
    """Features read with a unit-variance Gaussian: KL(N(a, I) || N(b, I)) = ||a - b||^2 / 2 per real token."""
    from bayesq.evaluation import token_kl

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    got = token_kl(a, b, mask, likelihood="gaussian")
    want = [0.5 * float(((a[i, t].double() - b[i, t].double()) ** 2).sum()) for i in range(2) for t in range(3)
            if mask[i, t]]
    assert got.dtype == torch.float64 and got.tolist() == pytest.approx(want, rel=1e-12)
