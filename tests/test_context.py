"""The run's FP outputs (bayesq/context.py): computed at most once, given ones read instead, checked."""

import pytest
import torch
from torch import nn

import bayesq.context as ctx
from bayesq.context import FPOutputs, KnownOutputs
from bayesq.evaluation import reference_log_probs

F64 = torch.float64


def _model_and_batches(n: int = 4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double().eval()
    g = torch.Generator().manual_seed(1)
    return model, [torch.randn(5, 6, generator=g, dtype=F64) for _ in range(n)]


def _counting(monkeypatch) -> list:
    calls, real = [], ctx.reference_log_probs
    monkeypatch.setattr(ctx, "reference_log_probs", lambda m, b, desc=None: calls.append(len(b)) or real(m, b, desc))
    return calls


def test_fp_outputs_log_probs_computed_once_vs_reference_log_probs(monkeypatch):
    model, batches = _model_and_batches()
    calls = _counting(monkeypatch)
    fp = FPOutputs(model, batches)
    assert fp.known_log_probs() is None  # nothing computed until read
    first = fp.log_probs()
    assert fp.log_probs() is first and fp.known_log_probs() is first and calls == [4]
    for got, want in zip(first, reference_log_probs(model, batches)):
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(fp.log_probs(slice(1, 3)), first[1:3]))  # a look: sliced
    assert calls == [4]


def test_fp_outputs_looks_computed_once_each_before_the_whole(monkeypatch):
    """Look by look (a selection's two looks), each part is computed once and only that part."""
    model, batches = _model_and_batches()
    calls = _counting(monkeypatch)
    fp = FPOutputs(model, batches)
    look = fp.log_probs(slice(0, 1))
    assert fp.log_probs(slice(0, 1)) is look and calls == [1]
    fp.log_probs(slice(1, 4))
    assert calls == [1, 3] and fp.known_log_probs() is None


def test_fp_outputs_given_pieces_are_read_not_computed(monkeypatch):
    model, batches = _model_and_batches()
    calls = _counting(monkeypatch)
    given = [torch.zeros(5, 3, dtype=F64) for _ in batches]
    logits = [torch.ones(5, 3) for _ in batches]
    fp = FPOutputs(model, batches, batches, known=KnownOutputs(given, logits))
    assert fp.log_probs() is given and fp.logits is logits
    assert all(a is b for a, b in zip(fp.log_probs(slice(2, 4)), given[2:4], strict=True))
    fp.offer_logits([torch.full((5, 3), 2.0) for _ in batches])
    fp.offer_log_probs([torch.ones(5, 3, dtype=F64) for _ in batches])
    assert fp.logits is logits and fp.log_probs() is given  # a pass's outputs never replace given ones
    assert calls == []


def test_fp_outputs_offered_pieces_fill_what_is_missing():
    model, batches = _model_and_batches()
    fp = FPOutputs(model, batches, batches)
    made = [torch.ones(5, 3, dtype=F64) for _ in batches]
    fp.offer_log_probs(made)
    fp.offer_logits(None)
    assert fp.known_log_probs() is made and fp.logits is None
    fp.offer_logits(made)
    assert fp.logits is made


def test_fp_outputs_refuses_log_probs_of_other_batches():
    model, batches = _model_and_batches()
    with pytest.raises(ValueError, match="reference has 3 batches of log-probabilities for 4 input batches"):
        FPOutputs(model, batches, known=KnownOutputs(reference_log_probs(model, batches[:3])))
