"""Posterior-predictive distillation (bayesq/distill.py) on a tiny MLP and a tiny conv net."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from nets import TokenModel
from torch import nn

import bayesq.distill as D
from bayesq import BayesQConfig, PosteriorConfig, QuantConfig, quantize_model
from bayesq.config import DistillConfig
from bayesq.distill import (
    SCALE_GRID, _Trainable, apply_distilled, distill, predictive_kl, sample_agreement, split_calibration, teacher_probs,
    tempering_scale,
)
from bayesq.grids import UniformGrids
from bayesq.levels import LevelTables
from bayesq.posterior import Posterior
from bayesq.result import quantized_copy
from flows.params import load_params

OFF = DistillConfig(max_budget=0)
FAST = DistillConfig(lr=1e-3, steps=200)
EVERY_BATCH = PosteriorConfig(curvature_share=1.0)  # the base result's posterior (see base)
HUGE = DistillConfig(lr=1.0, steps=20)  # a learning rate that wrecks the scales: distillation hurts
# the base encoding: searched grids without the error-feedback gains or coordinate descent, which
# leaves the scales room for distillation to improve (the default leaves little on this MLP)
BASE_Q = QuantConfig(feedback_table=False, cd_passes=0, select_grids=False)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def _convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def _cal():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(32, 16, generator=g) for _ in range(4)]


def _kl(model, teacher, batches, tau):
    """tau^2 * KL(teacher || softmax(model / tau)), summed over batches (batch means), float64."""
    total = 0.0
    with torch.no_grad():
        for t, x in zip(teacher, batches):
            logq = F.log_softmax(model(x).double() / tau, dim=-1)
            p = t.double()
            total += tau**2 * float((p * (p.clamp_min(1e-300).log() - logq)).sum(-1).mean())
    return total


@pytest.fixture(scope="module")
def base(one_thread):
    """Undistilled BayesQ result at 3 bits (uniform grids), its Fisher from every calibration batch
    (the toy's four batches: half of them gives a teacher this toy's 200 steps do not fit)."""
    model, cal = _mlp(), _cal()
    res = quantize_model(model, cal, BayesQConfig(budget=3.0, quant=BASE_Q, distill=OFF, posterior=EVERY_BATCH),
                         progress=False, keep_posterior=True)
    return model, cal, res


@pytest.fixture(scope="module")
def distilled(base):
    model, cal, res = base
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = distill(model, res.weights, res.posterior, cal, FAST, seed=0)
    return out, before


@pytest.fixture(scope="module")
def lut(one_thread):
    model, cal = _mlp(), _cal()
    res = quantize_model(model, cal, BayesQConfig(budget=3.0, quant=QuantConfig(codebook="lloyd", rounding="nearest"), distill=OFF),
                         progress=False, keep_posterior=True)
    assert any(isinstance(b, LevelTables) for qw in res.weights.values() for b in qw.books.values())
    return model, cal, res


# ---- _Trainable decodes like QuantizedWeight.dequantize --------------------------------------------

def _assert_trainable_matches(weights):
    for name, qw in weights.items():
        w = _Trainable(qw).weight()
        assert w.dtype == torch.float32 and w.shape == qw.blocks.shape, name
        torch.testing.assert_close(w.double(), qw.dequantize(), rtol=1e-6, atol=1e-7, msg=name)


def test_trainable_weight_matches_dequantize_uniform(base):
    weights = base[2].weights
    assert all(isinstance(b, UniformGrids) for qw in weights.values() for b in qw.books.values())
    assert any(len(qw.books) > 1 for qw in weights.values())  # a layer mixing bit-widths
    _assert_trainable_matches(weights)


def test_trainable_weight_matches_dequantize_lut(lut):
    _assert_trainable_matches(lut[2].weights)


def test_trainable_weight_matches_dequantize_col_scale(base):
    qw = base[2].weights["2"]  # Linear(64, 64)
    g = torch.Generator().manual_seed(3)
    col = (0.5 + torch.rand(2, 64, generator=g, dtype=torch.float64)).half().double()  # 2 row groups of 32
    scaled = dataclasses.replace(qw, col_scale=col)
    assert not torch.allclose(scaled.dequantize(), qw.dequantize())
    _assert_trainable_matches({"2": scaled})


def test_trainable_weight_matches_dequantize_conv(one_thread):
    g = torch.Generator().manual_seed(2)
    cal = [torch.randn(8, 3, 6, 6, generator=g) for _ in range(2)]
    res = quantize_model(_convnet(), cal, BayesQConfig(budget=3.0, distill=OFF), progress=False, keep_posterior=True)
    assert res.weights["0"].blocks.shape == (8, 3, 3, 3)
    _assert_trainable_matches(res.weights)


# ---- what distill keeps fixed and what it stores ------------------------------------------------------

def test_distill_keeps_codes_bits_and_stores_representable_books(base, distilled):
    res, (out, _) = base[2], distilled
    assert set(out.weights) == set(res.weights)
    for name, qw in res.weights.items():
        new = out.weights[name]
        assert torch.equal(new.codes, qw.codes) and torch.equal(new.group_bits, qw.group_bits)
        assert new.blocks == qw.blocks and set(new.books) == set(qw.books)
        for b, book in new.books.items():
            assert isinstance(book, UniformGrids) and book.bits == b
            assert book.scale.shape == qw.books[b].scale.shape
            z = book.zero
            assert torch.equal(z, z.round()) and bool((z >= 0).all()) and bool((z <= 2**b - 1).all())
            s = book.scale
            assert bool((s >= 0).all()) and torch.equal(s, s.half().double())
    assert out.steps == FAST.steps and out.loss_last < out.loss_first


def test_distill_lut_levels_stored_fp16(lut):
    model, cal, res = lut
    out = distill(model, res.weights, res.posterior, cal, DistillConfig(lr=1e-3, steps=20, accept=False), seed=0)
    changed = False
    for name, qw in res.weights.items():
        assert torch.equal(out.weights[name].group_bits, qw.group_bits)
        for b, book in out.weights[name].books.items():
            lv = book.levels
            assert torch.equal(lv, lv.half().double()), (name, b)
            assert torch.equal(book.row, qw.books[b].row)
            changed |= not torch.equal(lv, qw.books[b].levels)
    assert changed


def test_distill_lut_stored_decodes_to_trained_levels(lut, monkeypatch):
    model, cal, res = lut
    trained = {}
    real = _Trainable.stored

    def spy(self, scale_bits, lut_bits):
        trained[id(self.qw)] = {b: p["levels"].detach().double().half().double() for b, p in self.books.items()}
        return real(self, scale_bits, lut_bits)

    monkeypatch.setattr(D._Trainable, "stored", spy)
    out = distill(model, res.weights, res.posterior, cal, dataclasses.replace(FAST, accept=False), seed=0)
    for name, qw in res.weights.items():
        books = {b: LevelTables(b, trained[id(qw)][str(b)], book.row) for b, book in qw.books.items()}
        expect = dataclasses.replace(qw, books=books).dequantize()
        assert torch.equal(out.weights[name].dequantize(), expect), name


def test_distill_leaves_model_unchanged(base, distilled):
    model, before = base[0], distilled[1]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_quantize_model_distillation_keeps_allocation(base):
    res0 = base[2]
    # accept=False: kept even where the held-out KL does not drop, so the scales must move
    res1 = quantize_model(_mlp(), _cal(), BayesQConfig(budget=3.0, quant=BASE_Q, posterior=EVERY_BATCH,
                                                       distill=DistillConfig(max_budget=3.5, accept=False)),
                          progress=False)
    assert res1.allocation.total_bits == res0.allocation.total_bits
    assert res1.allocation.unit_bits == res0.allocation.unit_bits
    differs = False
    for name, qw in res0.weights.items():
        new = res1.weights[name]
        assert torch.equal(new.codes, qw.codes) and torch.equal(new.group_bits, qw.group_bits)
        differs |= any(not torch.equal(new.books[b].scale, qw.books[b].scale) for b in qw.books)
    assert differs
    # the returned model runs the distilled encoding
    for name, qw in res1.weights.items():
        assert torch.equal(res1.model.get_submodule(name).weight, qw.dequantize().float())


def test_quantize_model_above_max_budget_not_distilled(one_thread):
    cal = _cal()
    off = quantize_model(_mlp(), cal, BayesQConfig(budget=4.0, distill=OFF), progress=False)
    on = quantize_model(_mlp(), cal, BayesQConfig(budget=4.0), progress=False)
    assert on.allocation.total_bits == off.allocation.total_bits
    for name, qw in off.weights.items():
        new = on.weights[name]
        assert torch.equal(new.codes, qw.codes)
        for b, book in qw.books.items():
            assert torch.equal(new.books[b].scale, book.scale) and torch.equal(new.books[b].zero, book.zero)
        assert torch.equal(on.model.get_submodule(name).weight, off.model.get_submodule(name).weight)


# ---- the objective ----------------------------------------------------------------------------------

def test_distill_lowers_teacher_kl(base, distilled):
    model, cal, res = base
    out = distilled[0]
    assert out.accepted
    fit, _ = split_calibration(cal, FAST.holdout, seed=0)
    teacher = teacher_probs(model, res.posterior, fit, out.sample_scale, FAST.samples, FAST.temperature, seed=0)
    before = _kl(quantized_copy(model, res.weights), teacher, fit, FAST.temperature)
    after = _kl(apply_distilled(model, out), teacher, fit, FAST.temperature)
    assert after < 0.8 * before, (before, after)


def test_distill_first_loss_is_teacher_kl_on_first_fit_batch(base):
    model, cal, res = base
    cfg = DistillConfig(lr=1e-3, steps=10)
    out = distill(model, res.weights, res.posterior, cal, cfg, seed=0)
    fit, _ = split_calibration(cal, cfg.holdout, seed=0)
    teacher = teacher_probs(model, res.posterior, fit, out.sample_scale, cfg.samples, cfg.temperature, seed=0)
    first = _kl(quantized_copy(model, res.weights), teacher[:1], fit[:1], cfg.temperature)
    assert out.loss_first == pytest.approx(first, rel=2e-3)  # tail = 1 step: untrained loss, batch 0 (fp32)


def test_distill_train_bias_changes_bias_and_apply_uses_it(base):
    model, cal, res = base
    out = distill(model, res.weights, res.posterior, cal,
                  DistillConfig(lr=1e-3, steps=40, train_bias=True, accept=False))
    assert set(out.biases) == set(res.weights)
    moved = [n for n, b in out.biases.items() if not torch.equal(b, model.get_submodule(n).bias.detach())]
    assert moved
    q = apply_distilled(model, out)
    for n, b in out.biases.items():
        assert torch.equal(q.get_submodule(n).bias.detach(), b)
    plain = distill(model, res.weights, res.posterior, cal, DistillConfig(lr=1e-3, steps=2))
    assert plain.biases == {}


# ---- tempering and teacher ------------------------------------------------------------------------

def _posterior_like(post, variance):
    return Posterior(mean=post.mean, variance={n: torch.full_like(v, variance) for n, v in post.variance.items()},
                     n_examples=post.n_examples)


def test_tempering_scale_tiny_variance_is_one(base):
    model, cal, res = base
    assert tempering_scale(model, _posterior_like(res.posterior, 1e-12), cal, 0.95) == 1.0


def test_tempering_scale_huge_variance_full_agreement_is_zero(base):
    model, cal, res = base
    post = _posterior_like(res.posterior, 1e4)
    assert sample_agreement(model, post, cal, SCALE_GRID[-1], 2, 0) < 1.0
    assert tempering_scale(model, post, cal, 1.0) == 0.0


@pytest.mark.parametrize("target", [0.5, 0.9, 0.95, 0.99])
def test_tempering_scale_vs_grid_scan(base, target):
    model, cal, res = base
    agree = [sample_agreement(model, res.posterior, cal, s, 2, 0) for s in SCALE_GRID]
    s = tempering_scale(model, res.posterior, cal, target, samples=2, seed=0)
    passing = [i for i, a in enumerate(agree) if a >= target]
    assert passing, "target unreachable on this net; pick a lower one"
    first = passing[0]
    if passing == list(range(first, len(SCALE_GRID))):  # monotone from the first pass on: bisection is exact
        assert s == SCALE_GRID[first]
        if first > 0:
            assert agree[first - 1] < target  # twice the scale fails
    assert agree[SCALE_GRID.index(s)] >= target


def test_teacher_probs_scale_zero_is_softmax_of_mean_model(base):
    model, cal, res = base
    tau = 2.0
    with torch.no_grad():
        ref = [F.softmax(model(x).float() / tau, dim=-1) for x in cal]
    one = teacher_probs(model, res.posterior, cal, 0.0, samples=1, tau=tau)
    for a, b in zip(one, ref):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    many = teacher_probs(model, res.posterior, cal, 0.0, samples=3, tau=tau)
    for a, b in zip(many, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.double().sum(-1), torch.ones(len(a), dtype=torch.float64), rtol=0, atol=1e-6)


def test_teacher_probs_sampled_rows_sum_to_one_and_differ(base):
    model, cal, res = base
    t = teacher_probs(model, res.posterior, cal, 1e-2, samples=4, tau=2.0, seed=0)
    t0 = teacher_probs(model, res.posterior, cal, 0.0, samples=1, tau=2.0)
    for a, b in zip(t, t0):
        torch.testing.assert_close(a.double().sum(-1), torch.ones(len(a), dtype=torch.float64), rtol=0, atol=1e-6)
        assert not torch.allclose(a, b)
    again = teacher_probs(model, res.posterior, cal, 1e-2, samples=4, tau=2.0, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(t, again))


# ---- the calibration split ----------------------------------------------------------------------------

def _numbered(sizes):
    """Tensor batches whose rows are their global index (float64, (B, 2))."""
    out, start = [], 0
    for k in sizes:
        ids = torch.arange(start, start + k, dtype=torch.float64)
        out.append(torch.stack([ids, -ids], 1))
        start += k
    return out


def _ids(batches):
    return [int(i) for b in batches for i in (b["input_ids"][:, 0, 0] if isinstance(b, dict) else b[:, 0])]


@pytest.mark.parametrize("holdout", [0.1, 0.25, 0.5, 0.9])
def test_split_calibration_disjoint_covers_every_input(holdout):
    sizes = [7, 10, 0, 3, 1, 12]
    n = sum(sizes)
    fit, held = split_calibration(_numbered(sizes), holdout, seed=5)
    f, h = _ids(fit), _ids(held)
    assert not set(f) & set(h)
    assert sorted(f + h) == list(range(n))
    assert len(h) == min(n - 1, max(1, round(holdout * n)))
    for part in (fit, held):
        for b in part:
            assert b.dtype == torch.float64 and b.shape[1] == 2 and len(b) > 0
            torch.testing.assert_close(b[:, 1], -b[:, 0], rtol=0, atol=0)  # whole rows move together
            assert torch.equal(b[:, 0], b[:, 0].sort().values)  # order within a batch kept


def test_split_calibration_deterministic_for_seed():
    cal = _numbered([8, 8, 8, 8])
    a, b = split_calibration(cal, 0.25, seed=3), split_calibration(cal, 0.25, seed=3)
    assert _ids(a[0]) == _ids(b[0]) and _ids(a[1]) == _ids(b[1])
    assert _ids(split_calibration(cal, 0.25, seed=4)[1]) != _ids(a[1])


def test_split_calibration_clamps_to_one_input_each_side():
    fit, held = split_calibration(_numbered([2]), 0.01, seed=0)
    assert len(_ids(fit)) == 1 and len(_ids(held)) == 1
    fit, held = split_calibration(_numbered([2]), 0.99, seed=0)
    assert len(_ids(fit)) == 1 and len(_ids(held)) == 1


def test_split_calibration_dict_batches():
    g = torch.Generator().manual_seed(0)
    cal = []
    for start, (k, t) in zip((0, 5, 11), ((5, 4), (6, 3), (4, 7))):  # padded widths differ per batch
        ids = torch.randn(k, t, 3, generator=g, dtype=torch.float64)
        ids[:, 0, 0] = torch.arange(start, start + k, dtype=torch.float64)
        cal.append({"input_ids": ids, "mask": ids[..., 1].clone()})
    fit, held = split_calibration(cal, 0.25, seed=1)
    assert sorted(_ids(fit) + _ids(held)) == list(range(15)) and len(_ids(held)) == 4
    by_id = {int(r[0, 0]): (r, m) for b in cal for r, m in zip(b["input_ids"], b["mask"])}
    for b in fit + held:
        assert set(b) == {"input_ids", "mask"}
        for r, m in zip(b["input_ids"], b["mask"]):
            r0, m0 = by_id[int(r[0, 0])]
            assert torch.equal(r, r0) and torch.equal(m, m0)


# ---- the held-out acceptance rule ---------------------------------------------------------------------

def _direct_kl(fp_model, q_model, batches):
    """Mean over inputs of sum_y p log(p / q), p / q the softmaxes of the two models (float64, plain loop)."""
    total, n = 0.0, 0
    with torch.no_grad():
        for x in batches:
            zp = fp_model(**x) if isinstance(x, dict) else fp_model(x)
            zq = q_model(**x) if isinstance(x, dict) else q_model(x)
            for rp, rq in zip(zp.double().tolist(), zq.double().tolist()):
                # log p_c = z_c - log sum exp z, by hand (finite where q underflows)
                lse_p = max(rp) + math.log(sum(math.exp(z - max(rp)) for z in rp))
                lse_q = max(rq) + math.log(sum(math.exp(z - max(rq)) for z in rq))
                total += sum(math.exp(a - lse_p) * ((a - lse_p) - (b - lse_q)) for a, b in zip(rp, rq))
                n += 1
    return total / n


def _assert_same_encoding(a, b):
    assert a.keys() == b.keys()
    for name, qa in a.items():
        qb = b[name]
        assert torch.equal(qa.codes, qb.codes) and torch.equal(qa.group_bits, qb.group_bits), name
        for bits, book in qa.books.items():
            assert torch.equal(book.scale, qb.books[bits].scale) and torch.equal(book.zero, qb.books[bits].zero)


@pytest.fixture(scope="module")
def hurt(base):
    model, cal, res = base
    return distill(model, res.weights, res.posterior, cal, dataclasses.replace(HUGE, train_bias=True), seed=0)


def test_distill_worsening_rejected_returns_undistilled(base, hurt):
    model, cal, res = base
    assert not hurt.accepted and hurt.kl_after >= hurt.kl_before, (hurt.kl_before, hurt.kl_after)
    assert all(hurt.weights[n] is qw for n, qw in res.weights.items())
    _assert_same_encoding(hurt.weights, res.weights)
    assert hurt.biases == {}
    q, ref = apply_distilled(model, hurt), quantized_copy(model, res.weights)
    for k, v in ref.state_dict().items():
        assert torch.equal(q.state_dict()[k], v), k  # weights and biases bit for bit
    assert hurt.steps == HUGE.steps


def test_distill_improving_accepted(base, distilled):
    model, cal, res = base
    out = distilled[0]
    assert out.accepted and out.kl_after < out.kl_before, (out.kl_before, out.kl_after)
    assert any(not torch.equal(out.weights[n].books[b].scale, qw.books[b].scale)
               for n, qw in res.weights.items() for b in qw.books)
    _, held = split_calibration(cal, FAST.holdout, seed=0)
    assert _direct_kl(model, apply_distilled(model, out), held) == pytest.approx(out.kl_after, rel=1e-9, abs=1e-15)


def test_distill_accept_false_keeps_worsening(base, hurt):
    model, cal, res = base
    cfg = dataclasses.replace(HUGE, train_bias=True, accept=False)
    out = distill(model, res.weights, res.posterior, cal, cfg, seed=0)
    assert out.accepted
    assert (out.kl_before, out.kl_after) == (hurt.kl_before, hurt.kl_after)  # same split and fit
    assert out.kl_after >= out.kl_before
    assert any(not torch.equal(out.weights[n].books[b].scale, qw.books[b].scale)
               for n, qw in res.weights.items() for b in qw.books)
    assert set(out.biases) == set(res.weights)
    _, held = split_calibration(cal, cfg.holdout, seed=0)
    assert _direct_kl(model, apply_distilled(model, out), held) == pytest.approx(out.kl_after, rel=1e-9, abs=1e-15)


def test_distill_heldout_kl_matches_direct_sum(base, hurt):
    model, cal, res = base
    _, held = split_calibration(cal, HUGE.holdout, seed=0)
    direct = _direct_kl(model, quantized_copy(model, res.weights), held)
    assert direct > 0
    assert hurt.kl_before == pytest.approx(direct, rel=1e-9, abs=1e-15)
    assert predictive_kl(model, res.weights, held) == pytest.approx(direct, rel=1e-9, abs=1e-15)
    assert predictive_kl(model, res.weights, cal) != pytest.approx(direct, rel=1e-6)  # held-out inputs only


def test_distill_dict_batches_heldout_kl(one_thread):
    torch.manual_seed(0)
    model = TokenModel(32, 32, 3)
    g = torch.Generator().manual_seed(1)
    cal = [{"input_ids": torch.randn(6, 4, 32, generator=g), "mask": (torch.rand(6, 4, generator=g) > 0.3).float()}
           for _ in range(3)]
    cfg = BayesQConfig(budget=4.0, quant=QuantConfig(group_size=32), distill=OFF)
    res = quantize_model(model, cal, cfg, progress=False, keep_posterior=True)
    out = distill(model, res.weights, res.posterior, cal, DistillConfig(lr=1e-3, steps=5), seed=2)
    fit, held = split_calibration(cal, 0.25, seed=2)
    assert all(isinstance(b, dict) for b in fit + held) and sum(len(b["mask"]) for b in held) == 4
    direct = _direct_kl(model, quantized_copy(model, res.weights), held)
    assert out.kl_before == pytest.approx(direct, rel=1e-9, abs=1e-15)
    assert out.accepted == (out.kl_after < out.kl_before)


def test_quantize_model_rejected_distillation_keeps_undistilled(base):
    model, cal, res0 = base
    res1 = quantize_model(model, cal, BayesQConfig(budget=3.0, quant=BASE_Q, distill=HUGE), posterior=res0.posterior,
                          progress=False)
    _assert_same_encoding(res1.weights, res0.weights)
    for k, v in res0.model.state_dict().items():
        assert torch.equal(res1.model.state_dict()[k], v), k


# ---- errors -----------------------------------------------------------------------------------------

def test_distill_empty_calibration_raises(base):
    model, _, res = base
    with pytest.raises(ValueError, match="calibration"):
        distill(model, res.weights, res.posterior, [])
    with pytest.raises(ValueError, match="calibration"):
        distill(model, res.weights, res.posterior, [torch.zeros(0, 16)])


def test_distill_refuses_a_model_without_a_head():
    """A base model's features have no softmax teacher: a message, and the model's mode kept."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=16)).train()
    with pytest.raises(ValueError, match="no head.*without distillation"):
        distill(model, {}, None, [{"input_ids": torch.randint(0, 20, (2, 5))}])
    assert model.training


def test_distill_one_input_raises(base):
    model, _, res = base
    with pytest.raises(ValueError, match=r"1 input.*at least 2.*pass more calibration inputs"):
        distill(model, res.weights, res.posterior, [torch.zeros(1, 16), torch.zeros(0, 16)],
                DistillConfig(steps=1))


@pytest.mark.parametrize("holdout", [0, 1, -0.5, 2.0])
def test_split_calibration_bad_holdout_raises(holdout):
    with pytest.raises(ValueError, match=r"distill\.holdout.*\(0, 1\)"):
        split_calibration(_numbered([4]), holdout)


def test_load_params_distill_holdout_accept():
    cfg = load_params({"distill": {"holdout": 0.5, "accept": False}}).distill
    assert (cfg.holdout, cfg.accept) == (0.5, False)
    assert (DistillConfig().holdout, DistillConfig().accept) == (0.25, True)


def test_distill_unknown_layer_raises(base):
    model, cal, res = base
    weights = dict(res.weights)
    weights["encoder.fc9"] = weights["2"]
    with pytest.raises(ValueError, match=r"encoder\.fc9"):
        distill(model, weights, res.posterior, cal, DistillConfig(steps=1))


@pytest.mark.parametrize("field,value", [("steps", 0), ("agreement", 0), ("temperature", -1), ("samples", 0),
                                         ("lr", 0.0), ("max_budget", -1.0), ("agreement", 1.5),
                                         ("train_bias", 1), ("holdout", 0), ("holdout", 0.0), ("holdout", 1),
                                         ("holdout", 1.5), ("holdout", -0.25), ("holdout", math.nan),
                                         ("holdout", True), ("holdout", "0.25"), ("accept", 1), ("accept", "yes")])
def test_distill_config_invalid_raises(field, value):
    with pytest.raises(ValueError, match=rf"distill\.{field}"):
        DistillConfig(**{field: value})


def test_load_params_distill_unknown_key_raises():
    with pytest.raises(ValueError, match=r"distill.*'stepz'.*'steps'"):
        load_params({"distill": {"stepz": 3}})


# ---- per-token outputs (a language model) --------------------------------------------------------

def _lm_setup():
    from nets import TinyCausalLM, lm_batches

    torch.manual_seed(0)
    model = TinyCausalLM(vocab=29, d=32, hidden=64).eval()
    cal = lm_batches([[5, 9, 3, 7], [8, 2, 6, 4], [9, 9, 1, 5]], vocab=29)
    res = quantize_model(model, cal, BayesQConfig(budget=3.0, quant=BASE_Q, distill=OFF), progress=False, keep_posterior=True)
    return model, cal, res


def test_top_k_teacher_kl_dense_when_every_word_kept_partition_kl_otherwise():
    """TopKTeacher.kl: with k = V the exact per-token KL (mean over real tokens, padding not
    read); with k < V the KL on the partition {each kept word, the rest}, computed by hand."""
    from bayesq.distill import TopKTeacher

    g = torch.Generator().manual_seed(0)
    tau, (b, t, v) = 2.0, (2, 4, 6)
    p = torch.softmax(torch.randn(b, t, v, generator=g), -1)
    z = torch.randn(b, t, v, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]).bool()
    logq = torch.log_softmax(z / tau, -1)
    dense = (p * (p.log() - logq)).sum(-1)
    want = torch.stack([dense[i][mask[i]].mean() for i in range(b)])
    torch.testing.assert_close(TopKTeacher.of(p, mask, k=v).kl(z, tau), want, rtol=1e-5, atol=1e-7)
    k = 2
    teacher = TopKTeacher.of(p, mask, k=k)
    rows = []
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                top = p[i, j].topk(k).indices
                rest = torch.ones(v, dtype=torch.bool)
                rest[top] = False
                pp = torch.cat([p[i, j, top], p[i, j, rest].sum()[None]])
                qq = torch.cat([logq[i, j, top].exp(), logq[i, j, rest].exp().sum()[None]])
                rows.append((i, float((pp * (pp / qq).log()).sum())))
    want = torch.tensor([sum(x for r, x in rows if r == i) / int(mask[i].sum()) for i in range(b)])
    torch.testing.assert_close(teacher.kl(z, tau), want, rtol=1e-5, atol=1e-7)
    assert teacher.probs.shape == (int(mask.sum()), k) and torch.equal(teacher.argmax(-1), p[mask].argmax(-1))


def test_teacher_probs_language_model_top_k_of_the_draws_average(one_thread):
    """Per-token teacher: the top-k of the average of softmax(f(x; w_m) / tau) over the draws of
    :func:`D._sample_generator`, real tokens only; at scale 0 the mean model's softmax."""
    from bayesq.distill import TopKTeacher

    model, cal, res = _lm_setup()
    tau = 2.0
    (t0,) = teacher_probs(model, res.posterior, cal[:1], 0.0, samples=1, tau=tau)
    mask = cal[0]["attention_mask"].bool()
    with torch.no_grad():
        dense = F.softmax(model(**cal[0])["logits"].float() / tau, -1)
    assert isinstance(t0, TopKTeacher) and torch.equal(t0.mask, mask)
    want = dense[mask].topk(min(D.TEACHER_TOP_K, dense.shape[-1]), -1)
    assert torch.equal(t0.probs, want.values) and torch.equal(t0.index.long(), want.indices)
    (t2,) = teacher_probs(model, res.posterior, cal[:1], 0.5, samples=2, tau=tau, seed=3)
    avg = 0.0
    with torch.no_grad():
        for m in range(2):
            w = D._sampled_weights(res.posterior, 0.5, D._sample_generator(3, m))
            avg = avg + F.softmax(D._logits_with(model, w, cal[0]).float() / tau, -1) / 2
    torch.testing.assert_close(t2.probs, avg[mask].topk(t2.probs.shape[1], -1).values, rtol=0, atol=0)


def test_distill_language_model_runs_on_real_tokens_and_heldout_kl_is_exact(one_thread):
    """distill on (B, T, V) logits: finite losses, the held-out KL is the per-input token-mean KL
    (evaluation.kl_per_input), and more padding appended changes the held-out KL by rounding only."""
    from nets import with_padding

    from bayesq.evaluation import kl_per_input, reference_log_probs

    model, cal, res = _lm_setup()
    out = distill(model, res.weights, res.posterior, cal, DistillConfig(lr=1e-3, steps=10), seed=1)
    assert math.isfinite(out.loss_first) and math.isfinite(out.loss_last) and out.steps == 10
    assert 0 <= out.teacher_agreement <= 1
    _, held = split_calibration(cal, 0.25, seed=1)
    q = quantized_copy(model, res.weights)
    direct = float(kl_per_input(reference_log_probs(model, held), q, held).mean())
    assert direct > 0 and out.kl_before == pytest.approx(direct, rel=1e-9)
    assert predictive_kl(model, res.weights, with_padding(held, 3)) == pytest.approx(direct, rel=1e-5)
    assert out.accepted == (out.kl_after < out.kl_before)


def test_quantize_model_float64_model_distils_in_its_own_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).double().eval()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 16, dtype=torch.float64, generator=g) for _ in range(4)]
    cfg = BayesQConfig(budget=3.0, distill=DistillConfig(max_budget=3.5, steps=5))
    assert cfg.distill.applies(cfg.budget)
    res = quantize_model(model, batches, cfg, progress=False)  # the float32 codes trained against a float64 model
    assert res.model[0].weight.dtype == torch.float64 and torch.isfinite(res.model(batches[0])).all()


def _tiny_net_and_batches():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1)
    return model, [torch.randn(16, 16, generator=g) for _ in range(4)]


def test_default_config_does_not_distil(monkeypatch):
    """Off by default: accepted on both embedded models, it costs 2-10 times BayesQ's own one-time
    cost for 1-10 % lower KL (docs/findings.md)."""
    assert not BayesQConfig().distill.applies(BayesQConfig().budget) and DistillConfig().max_budget == 0

    def never(*a, **k):
        raise AssertionError("distil called with the default config")

    monkeypatch.setattr("bayesq.quantize.distill", never)
    model, batches = _tiny_net_and_batches()
    quantize_model(model, batches, BayesQConfig(budget=3.0), progress=False)


def test_distillation_shows_progress_and_stops_cleanly_on_ctrl_c(monkeypatch, capsys):
    model, batches = _tiny_net_and_batches()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = BayesQConfig(budget=3.0, distill=DistillConfig(max_budget=3.5, steps=50))
    calls = {"n": 0}
    step = torch.optim.AdamW.step

    def interrupted(self, *args, **kwargs):  # Ctrl-C at the third optimiser step of the fit
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(model, batches, cfg, progress=True)
    assert "distil scales" in capsys.readouterr().err  # the bar was up when Ctrl-C came
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
