import math
import re
from dataclasses import replace

import pytest
import torch
from test_select import brute_uniform, explicit_kl, variant_name
from torch import nn

from bayesq.baselines.activations import InputStats, input_stats
from bayesq.baselines.gptq import (
    GPTQConfig, damped_hessian, gptq_allocation_quantize, gptq_candidates, gptq_quantize, gptq_select,
)
from bayesq.baselines.rtn import rtn_quantize
from bayesq.blocks import quantizable_layers
from bayesq.config import BayesQConfig, Granularity, QuantConfig
from bayesq.context import KnownOutputs
from bayesq.error_feedback import error_feedback_groups
from bayesq.evaluation import predict
from bayesq.methods import Inputs, quantize_with
from bayesq.output_offset import fit_output_offset
from bayesq.quantize import quantize_model
from bayesq.result import quantized_copy
from bayesq.storage import grid_bits, header_bits

CFG = QuantConfig(group_size=16, unit_groups=2)


def _obq_reference(W, H, scale, zero, maxq, order):
    """Plain OBQ: each row on its own; after rounding column j, the remaining columns F move
    to the least-squares optimum with an explicitly inverted H[F', F'] (F' = F + {j})."""
    W = W.clone()
    codes = torch.zeros_like(W, dtype=torch.int64)
    for o in range(W.shape[0]):
        w = W[o].clone()
        remaining = list(order)
        for j in order:
            c = int(torch.clamp(torch.round(w[j] / scale[o, j] + zero[o, j]), 0, int(maxq[o, j])))
            codes[o, j] = c
            q = scale[o, j] * (c - zero[o, j])
            inv = torch.linalg.inv(H[remaining][:, remaining])
            k = remaining.index(j)
            rest = [i for i in remaining if i != j]
            upd = (w[j] - q) / inv[k, k] * inv[k, [remaining.index(i) for i in rest]]
            w[rest] -= upd
            remaining = rest
    return codes


def _layer_problem(seed, out=6, d=10, groups=1):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, d, generator=g, dtype=torch.float64)
    X = torch.randn(groups, 40, d, generator=g, dtype=torch.float64) @ torch.randn(groups, d, d, generator=g,
                                                                                   dtype=torch.float64)
    H = X.transpose(1, 2) @ X / 40  # (groups, d, d)
    scale = torch.full((out, d), 0.4, dtype=torch.float64)
    zero = torch.full((out, d), 4.0, dtype=torch.float64)
    maxq = torch.full((out, d), 7, dtype=torch.int64)
    return W, H, scale, zero, maxq


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("groups", [1, 3])
def test_gptq_codes_vs_plain_obq_reference(seed, groups):
    W, H, scale, zero, maxq = _layer_problem(seed, groups=groups)
    Hd = damped_hessian(H)
    got = error_feedback_groups(W, Hd, scale, zero, maxq, act_order=True, block_size=3)
    per = W.shape[0] // groups
    for g in range(groups):
        r = slice(g * per, (g + 1) * per)
        order = torch.argsort(Hd[g].diagonal(), descending=True, stable=True).tolist()
        assert torch.equal(got[r], _obq_reference(W[r], Hd[g], scale[r], zero[r], maxq[r], order))


def test_damped_hessian_vs_gptq_rule():
    H = torch.tensor([[[2.0, 0.5, 0.0], [0.5, 4.0, 0.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)
    got = damped_hessian(H, 0.01)
    mean = (2.0 + 4.0 + 1.0) / 3  # the dead input's diagonal is set to 1 first
    want = H.clone()
    want[0, 2, 2] = 1.0
    want[0] += 0.01 * mean * torch.eye(3, dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="dampening"):
        damped_hessian(H, 0.0)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4)).double()


def _identity_stats(model):
    return {n: InputStats(torch.eye(m.in_features, dtype=torch.float64)[None],
                          torch.ones(1, m.in_features, dtype=torch.float64), 1)
            for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("granularity", ["channel", "group"])
@pytest.mark.parametrize("budget", [3.5, 4.5])
def test_gptq_identity_hessian_equals_rtn(granularity, budget):
    model = _model()
    gq = gptq_quantize(model, _identity_stats(model), granularity, budget, CFG)
    rq = rtn_quantize(model, Granularity(granularity), budget, CFG)
    assert gq.allocation.unit_bits == rq.allocation.unit_bits
    for n in gq.weights:
        assert torch.equal(gq.weights[n].codes, rq.weights[n].codes)


@pytest.mark.parametrize("seed", range(6))
def test_gptq_layer_error_not_above_rtn(seed):
    """Same grids and bit-widths: GPTQ's output error tr(D H D^T) is at most RTN's."""
    torch.manual_seed(seed)
    lin = nn.Linear(24, 8).double()
    g = torch.Generator().manual_seed(100 + seed)
    mix = torch.randn(24, 24, generator=g, dtype=torch.float64)
    batches = [torch.randn(32, 24, generator=g, dtype=torch.float64) @ mix for _ in range(2)]
    stats = input_stats(lin, batches, {"": lin})
    ones = {"": InputStats(stats[""].H, stats[""].abs_mean, 1)}
    H = stats[""].H[0]
    res = gptq_quantize(lin, ones, "group", 4.0, CFG)
    rtn = rtn_quantize(lin, Granularity.GROUP, 4.0, CFG)
    W = lin.weight.detach()
    err = {k: float(torch.trace((q.weights[""].dequantize() - W) @ H @ (q.weights[""].dequantize() - W).T))
           for k, q in (("gptq", res), ("rtn", rtn))}
    # RTN's allocation may differ (its loss is unweighted): compare at GPTQ's allocation too
    nearest = res.weights[""]
    groups, _ = nearest.blocks.to_groups(W.reshape(-1))
    codes = torch.zeros_like(nearest.indices())
    for b, book in nearest.books.items():
        codes[nearest.group_bits == b] = book.quantize(groups[nearest.group_bits == b])
    Dn = replace(nearest, codes=codes).dequantize() - W
    assert err["gptq"] <= float(torch.trace(Dn @ H @ Dn.T)) + 1e-12
    assert err["gptq"] < err["rtn"]


def test_gptq_conv_model_within_budget_and_rebuilt_from_codes():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 5)).double()
    batches = [torch.randn(4, 3, 6, 6, dtype=torch.float64) for _ in range(2)]
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    res = gptq_quantize(model, input_stats(model, batches, layers), "group", 4.0, CFG)
    assert res.average_bits <= 4.0
    for n, q in res.weights.items():
        assert torch.equal(res.model.get_submodule(n).weight, q.dequantize())


def test_gptq_bad_input_raises():
    model = _model()
    with pytest.raises(ValueError, match="per-channel or per-group"):
        gptq_quantize(model, _identity_stats(model), "tensor", 4.0, CFG)
    with pytest.raises(ValueError, match="no input statistics"):
        gptq_quantize(model, {}, "group", 4.0, CFG)
    with pytest.raises(ValueError, match="infeasible"):
        gptq_quantize(model, _identity_stats(model), "group", 1.0, CFG)


# ---- the selection among budget-feasible variants ------------------------------------------------

GROUP_SIZES = (8, 16, 32, 64)


def _calibrated(seed=0):
    model = _model(seed)
    g = torch.Generator().manual_seed(50 + seed)
    batches = [torch.randn(16, 16, generator=g, dtype=torch.float64) for _ in range(2)]
    return model, batches, input_stats(model, batches, quantizable_layers(model))


def stored_bits(res, n_choices):
    """Bits recomputed from the stored encoding alone: codes, an fp16 scale and a b-bit zero-point
    per group, a unit header naming one of ``n_choices`` widths, AWQ's fp16 column scales."""
    total = 0
    for qw in res.weights.values():
        sizes = qw.blocks.group_sizes()
        total += int((sizes * qw.group_bits).sum() + (16 + qw.group_bits).sum())
        total += qw.blocks.n_units * header_bits(n_choices)
        total += 0 if qw.col_scale is None else 16 * qw.col_scale.numel()
    return total


def _mixed_min_bits(model, cfg, extra=0):
    """Every unit at the lowest width with cfg's groups and units, headers included (brute force)."""
    total = extra
    for m in quantizable_layers(model).values():
        n = m.weight.numel()
        groups = math.ceil(n / cfg.group_size)
        total += grid_bits(n, groups, min(cfg.bits)) + math.ceil(groups / cfg.unit_groups) * header_bits(len(cfg.bits))
    return total


def check_candidates(model, cands, budget, cfg, group_sizes, extra=0):
    """Every candidate meets the budget by the stored bits; uniform ones are the brute-force
    smallest feasible group size per width, with exactly its cost; mixed iff it fits."""
    n = sum(m.weight.numel() for m in quantizable_layers(model).values())
    want = brute_uniform(model, budget, cfg.bits, group_sizes, extra=extra)
    uniform = {k for k in cands if k.startswith("uniform-")}
    assert uniform == {variant_name(b, g) for b, (g, _) in want.items()}
    assert ("mixed" in cands) == (_mixed_min_bits(model, cfg, extra) <= budget * n)
    for name, build in cands.items():
        res = build()
        single = name.startswith("uniform-")
        assert stored_bits(res, 1 if single else len(cfg.bits)) == res.allocation.total_bits
        assert res.average_bits <= budget
        if single:
            b = int(name.split("-")[1])
            g, total = want[b]
            assert res.allocation.total_bits == total
            for qw in res.weights.values():
                assert bool((qw.group_bits == b).all())
                assert qw.blocks.group_size == (qw.blocks.row if g is None else g)


@pytest.mark.parametrize("budget", [3.0, 3.5, 4.0, 4.5])
def test_gptq_candidates_meet_budget_and_uniform_smallest_group(budget):
    model, _, stats = _calibrated()
    cands = gptq_candidates(model, stats, budget, CFG, group_sizes=GROUP_SIZES)
    check_candidates(model, cands, budget, CFG, GROUP_SIZES)
    if "mixed" in cands:  # today's rule, unchanged
        direct = gptq_quantize(model, stats, "group", budget, CFG)
        assert cands["mixed"]().allocation == direct.allocation


def test_gptq_select_returns_least_calibration_kl():
    model, batches, stats = _calibrated(1)
    cands = gptq_candidates(model, stats, 4.0, CFG, group_sizes=GROUP_SIZES)
    assert len(cands) >= 3
    choice = gptq_select(model, stats, batches, 4.0, CFG, group_sizes=GROUP_SIZES)
    want = {k: explicit_kl(model, build().model, batches) for k, build in cands.items()}
    assert choice.kl == pytest.approx(want, rel=1e-9)
    assert choice.variant == min(want, key=want.get)
    winner = cands[choice.variant]()
    for n, q in choice.result.weights.items():
        assert torch.equal(q.codes, winner.weights[n].codes)


def test_gptq_select_scores_on_selection_inputs_vs_explicit_kl():
    model, batches, stats = _calibrated(1)
    _, held, _ = _calibrated(2)
    cands = gptq_candidates(model, stats, 4.0, CFG, group_sizes=GROUP_SIZES)
    choice = gptq_select(model, stats, batches, 4.0, CFG, group_sizes=GROUP_SIZES, selection=held)
    want = {k: explicit_kl(model, build().model, held) for k, build in cands.items()}
    assert choice.kl == pytest.approx(want, rel=1e-9)
    assert choice.variant == min(want, key=want.get)


def test_gptq_select_bias_correction_offers_each_variant_corrected():
    model, batches, stats = _calibrated(1)
    plain = gptq_select(model, stats, batches, 4.0, CFG, group_sizes=GROUP_SIZES)
    both = gptq_select(model, stats, iter(batches), 4.0, CFG, group_sizes=GROUP_SIZES, bias_correction=True)
    assert set(both.kl) == set(plain.kl) | {f"{k}+bc" for k in plain.kl}
    for k, v in plain.kl.items():  # the uncorrected forms score as without the option
        assert both.kl[k] == pytest.approx(v, rel=1e-12)
    assert both.variant == min(both.kl, key=both.kl.get)
    assert both.kl[both.variant] <= plain.kl[plain.variant]
    assert plain.result.output_offset is None  # offered with the correction only


def test_gptq_select_bias_correction_refits_the_kept_output_bias():
    """With the correction, the kept variant's model is its corrected copy with the output offset
    of :func:`bayesq.output_offset.fit_output_offset` on the calibration batches added to the
    last layer's bias, and nothing else changed."""
    model, batches, stats = _calibrated(1)
    both = gptq_select(model, stats, batches, 4.0, CFG, group_sizes=GROUP_SIZES, bias_correction=True)
    res = both.result
    plain = quantized_copy(model, res.weights, res.correction)
    offset = fit_output_offset(model, plain, batches)
    assert res.output_offset.layer == offset.layer is not None
    torch.testing.assert_close(res.output_offset.shift, offset.shift, rtol=0, atol=0)
    a, b = res.model.state_dict(), plain.state_dict()
    for key in a:
        if key == f"{offset.layer}.bias":
            torch.testing.assert_close(a[key] - b[key], offset.shift.to(a[key].dtype), rtol=0, atol=1e-12)
        else:
            assert torch.equal(a[key], b[key]), key


def test_gptq_select_infeasible_budget_names_minimum():
    model, batches, stats = _calibrated()
    with pytest.raises(ValueError, match="infeasible for GPTQ") as err:
        gptq_select(model, stats, batches, 1.5, CFG, group_sizes=GROUP_SIZES)
    need = float(re.search(r"needs (\d+\.\d+) bits", str(err.value)).group(1))
    ws = [m.weight for m in quantizable_layers(model).values()]
    cheapest = min(sum(grid_bits(w.numel(), w.shape[0] if g is None else math.ceil(w.numel() / g), 2) for w in ws)
                   for g in [*GROUP_SIZES, None])
    assert need == pytest.approx(min(cheapest, _mixed_min_bits(model, CFG)) / 240, abs=1e-4)
    assert gptq_candidates(model, stats, math.ceil(need * 1e4) / 1e4, CFG, group_sizes=GROUP_SIZES)


@pytest.mark.parametrize("unit", ["block", "channel"])
def test_gptq_allocation_candidate_reproduces_unit_bits(unit):
    model, batches, stats = _calibrated(2)
    cfg = replace(CFG, unit=unit)
    bq = quantize_model(model, batches, BayesQConfig(budget=4.0, quant=cfg), progress=False)
    unit_bits = bq.allocation.unit_bits
    assert len({b for bits in unit_bits.values() for b in bits}) > 1  # a genuinely mixed allocation
    res = gptq_allocation_quantize(model, stats, unit_bits, 4.0, cfg)
    assert res.allocation.unit_bits == unit_bits
    assert res.allocation.total_bits == bq.allocation.total_bits == stored_bits(res, len(cfg.bits))
    for n, q in res.weights.items():
        assert torch.equal(q.group_bits, torch.tensor(unit_bits[n])[q.blocks.group_unit()])
        assert torch.equal(res.model.get_submodule(n).weight, q.dequantize())
        # error feedback: output error at most nearest rounding's on the same grids
        W, H = model.get_submodule(n).weight.detach(), stats[n].H[0]
        groups, _ = q.blocks.to_groups(W.reshape(-1))
        codes = torch.zeros_like(q.indices())
        for b, book in q.books.items():
            codes[q.group_bits == b] = book.quantize(groups[q.group_bits == b])
        D, Dn = q.dequantize() - W, replace(q, codes=codes).dequantize() - W
        assert float(torch.trace(D @ H @ D.T)) <= float(torch.trace(Dn @ H @ Dn.T)) + 1e-12
    choice = gptq_select(model, stats, batches, 4.0, cfg, group_sizes=GROUP_SIZES, allocation=unit_bits)
    assert "allocation" in choice.kl and choice.avg_bits["allocation"] == res.average_bits


def test_gptq_allocation_candidate_bad_allocation_raises():
    model, _, stats = _calibrated()
    bits = rtn_quantize(model, Granularity.GROUP, 4.0, CFG).allocation.unit_bits
    with pytest.raises(ValueError, match="above the budget"):
        gptq_allocation_quantize(model, stats, bits, 3.5, CFG)
    with pytest.raises(ValueError, match="units"):
        gptq_allocation_quantize(model, stats, {**bits, "0": bits["0"] + (2,)}, 4.0, CFG)


def test_gptq_select_held_out_offset_vs_fit_on_both_input_sets():
    """With held-out selection inputs, the kept variant's offset is the one fitted by forward
    passes on the calibration and selection batches together (the scores' log-probabilities
    reused for the selection part give the same offset)."""
    model, batches, stats = _calibrated(1)
    g = torch.Generator().manual_seed(71)
    held = [torch.randn(16, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    res = gptq_select(model, stats, batches, 4.0, CFG, group_sizes=GROUP_SIZES, bias_correction=True,
                      selection=held).result
    plain = quantized_copy(model, res.weights, res.correction)
    both = fit_output_offset(model, plain, batches + held)
    alone = fit_output_offset(model, plain, batches)
    assert res.output_offset.inputs == 32 + 48 == both.inputs
    torch.testing.assert_close(res.output_offset.shift, both.shift, rtol=0, atol=1e-7)  # float32 logits vs float64
    assert (res.output_offset.shift - alone.shift).abs().max() > 1e-4  # the selection inputs moved it


def test_gptq_method_reads_given_calibration_logits_for_the_offset():
    """Inputs.known.logits (the FP logits per calibration batch, as predict gives them) gives
    the offset of the forward pass bit for bit, and is what the fit reads: other logits move it."""
    model, batches, stats = _calibrated(1)
    g = torch.Generator().manual_seed(71)
    held = [torch.randn(16, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    cfg = GPTQConfig(quant=CFG, group_sizes=GROUP_SIZES, bias_correction=True)
    computed = quantize_with(model, cfg, 4.0, Inputs(calibration=batches, selection=held, stats=stats))
    fp = [predict(model, [b]) for b in batches]
    given = quantize_with(model, cfg, 4.0, Inputs(calibration=batches, selection=held, stats=stats, known=KnownOutputs(logits=fp)))
    assert torch.equal(given.result.output_offset.shift, computed.result.output_offset.shift)
    assert "logits" in given.read and "logits" not in computed.read
    moved = quantize_with(model, cfg, 4.0, Inputs(calibration=batches, selection=held, stats=stats,
                                                   known=KnownOutputs(logits=[z + torch.arange(4.0) for z in fp])))
    assert (moved.result.output_offset.shift - computed.result.output_offset.shift).abs().max() > 1e-3


def test_gptq_method_reads_its_statistics_pass_logits_for_the_offset_vs_forward_pass(monkeypatch):
    """Without statistics or logits given, the FP model's logits on the calibration inputs come from
    the statistics pass: the offset's fit runs the quantised model only, and the offset is the one
    fitted with the FP model's forward pass (given logits as predict gives them), bit for bit."""
    import bayesq.output_offset as oo

    model, batches, _ = _calibrated(1)
    g = torch.Generator().manual_seed(71)
    held = [torch.randn(16, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    cfg = GPTQConfig(quant=CFG, group_sizes=GROUP_SIZES, bias_correction=True)
    fp = [predict(model, [b]) for b in batches]
    given = quantize_with(model, cfg, 4.0, Inputs(calibration=batches, selection=held, known=KnownOutputs(logits=fp)))
    seen, forward = [], oo.predict
    monkeypatch.setattr(oo, "predict", lambda m, b, desc=None: seen.append(m is model) or forward(m, b))
    own = quantize_with(model, cfg, 4.0, Inputs(calibration=batches, selection=held))
    assert seen == [False]  # the quantised model's pass; the FP model's logits were the statistics pass's
    assert torch.equal(own.result.output_offset.shift, given.result.output_offset.shift)
    assert "logits" not in own.read
