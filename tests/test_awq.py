import pytest
import torch
from torch import nn

from test_gptq import check_candidates
from test_select import explicit_kl

from bayesq.baselines.activations import input_stats
from bayesq.baselines.awq import (
    awq_candidates, awq_quantize, awq_select, output_error, scale_bits_total, search_scale,
)
from bayesq.baselines.rtn import rtn_blocks, rtn_quantize
from bayesq.baselines.select import corrected, stats_correction
from bayesq.blocks import layer_blocks, quantizable_layers
from bayesq.config import Granularity, QuantConfig

CFG = QuantConfig(group_size=16, unit_groups=2)


def _salient(seed=0, d=64, out=64):
    """A Linear layer whose input channel 3 is 30x larger than the others."""
    torch.manual_seed(seed)
    lin = nn.Linear(d, out).double()
    g = torch.Generator().manual_seed(seed + 10)
    amp = torch.ones(d, dtype=torch.float64)
    amp[3] = 30.0
    batches = [torch.randn(16, d, generator=g, dtype=torch.float64) * amp for _ in range(3)]
    return lin, batches


def test_output_error_vs_explicit_outputs():
    lin, batches = _salient()
    st = input_stats(lin, batches, {"": lin})[""]
    W = lin.weight.detach()
    W2 = W + 0.01 * torch.randn_like(W)
    ref = sum(float(((x @ W2.T) - (x @ W.T)).pow(2).sum()) for x in batches) / 48
    assert output_error(W, W2, st.H) == pytest.approx(ref, rel=1e-10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_scale_not_worse_than_rtn_and_protects_salient_channel(seed):
    lin, batches = _salient(seed)
    st = input_stats(lin, batches, {"": lin})[""]
    lb = rtn_blocks(layer_blocks({"": lin}, 16, 2), Granularity.GROUP, CFG)[0]
    W = lin.weight.detach().double()
    s, alpha = search_scale(W, st, lb, 3)
    from bayesq.baselines.awq import _rtn
    rtn_err = output_error(W, _rtn(W, lb, 3, 16), st.H)
    awq_err = output_error(W, _rtn(W * s, lb, 3, 16) / s, st.H)
    assert awq_err < 0.9 * rtn_err and alpha > 0
    assert int(s.argmax()) == 3
    assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-12)


def test_awq_quantize_counts_scales_and_rebuilds_from_codes():
    lin, batches = _salient()
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(64, 32).double())
    stats = input_stats(model, batches, quantizable_layers(model))
    res = awq_quantize(model, stats, 4.0, CFG)
    assert res.average_bits <= 4.0
    costs = [int(t.unit_cost[torch.arange(t.unit_cost.shape[0]),
                             [t.bits.index(b) for b in res.allocation.unit_bits[t.blocks.name]]].sum())
             for t in res.table.layers]
    assert res.allocation.total_bits == sum(costs)
    plain = rtn_quantize(model, Granularity.GROUP, 4.0, CFG).table
    for t, p, scaled in zip(res.table.layers, plain.layers, (True, False)):
        # a scaled layer's first unit carries 16 bits per input channel; the 32-row head
        # (16 * 64 > 0.25 * 64 * 32 bits) keeps s = 1 and pays nothing
        extra = 16 * model.get_submodule(t.blocks.name).in_features if scaled else 0
        assert torch.equal(t.unit_cost[0] - p.unit_cost[0], torch.full_like(p.unit_cost[0], extra))
        assert torch.equal(t.unit_cost[1:], p.unit_cost[1:])
        q = res.weights[t.blocks.name]
        assert (q.col_scale is not None) == scaled
        assert torch.equal(res.model.get_submodule(t.blocks.name).weight, q.dequantize())
    s0 = res.weights["0"].col_scale
    assert torch.equal(s0, s0.half().double())
    W = lin.weight.detach()
    err = output_error(W, res.weights["0"].dequantize(), stats["0"].H)
    rtn = rtn_quantize(model, Granularity.GROUP, 4.0, CFG)
    assert err < output_error(W, rtn.weights["0"].dequantize(), stats["0"].H)


def test_awq_depthwise_conv_is_not_scaled():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=4), nn.Flatten(), nn.Linear(16, 64)).double()
    batches = [torch.randn(2, 4, 4, 4, dtype=torch.float64)]
    res = awq_quantize(model, input_stats(model, batches, quantizable_layers(model)), 5.0, CFG)
    assert res.weights["0"].col_scale is None and res.weights["2"].col_scale is not None


def test_awq_missing_stats_raise():
    lin, _ = _salient()
    with pytest.raises(ValueError, match="no input statistics"):
        awq_quantize(lin, {}, 4.0, CFG)


# ---- the selection among budget-feasible variants ------------------------------------------------

GROUP_SIZES = (8, 16, 32, 64)


def _calibrated(seed=0):
    lin, batches = _salient(seed)
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(64, 32).double())
    return model, batches, input_stats(model, batches, quantizable_layers(model))


# stored scales: 64 fp16 values for the 64x64 layer (16 * 64 <= 0.25 * 4096); the 32-row head has none
SCALE_BITS = 16 * 64


@pytest.mark.parametrize("budget", [3.0, 3.5, 4.0])
def test_awq_candidates_meet_budget_and_uniform_smallest_group(budget):
    model, _, stats = _calibrated()
    assert scale_bits_total(quantizable_layers(model), stats) == SCALE_BITS
    cands = awq_candidates(model, stats, budget, CFG, group_sizes=GROUP_SIZES, grid=5)
    check_candidates(model, cands, budget, CFG, GROUP_SIZES, extra=SCALE_BITS)
    for build in cands.values():  # the salient layer keeps its scales in every variant
        assert build().weights["0"].col_scale is not None


def test_awq_select_returns_least_calibration_kl():
    model, batches, stats = _calibrated(1)
    cands = awq_candidates(model, stats, 4.0, CFG, group_sizes=GROUP_SIZES, grid=5)
    assert len(cands) >= 3
    choice = awq_select(model, stats, batches, 4.0, CFG, group_sizes=GROUP_SIZES, grid=5)
    want = {k: explicit_kl(model, build().model, batches) for k, build in cands.items()}
    assert choice.kl == pytest.approx(want, rel=1e-9)
    assert choice.variant == min(want, key=want.get)
    assert choice.avg_bits[choice.variant] == choice.result.average_bits <= 4.0


def test_awq_select_bias_correction_vs_output_shift_of_scaled_weights():
    model, batches, stats = _calibrated(1)
    cands = awq_candidates(model, stats, 4.0, CFG, group_sizes=GROUP_SIZES, grid=5)
    choice = awq_select(model, stats, batches, 4.0, CFG, group_sizes=GROUP_SIZES, grid=5, bias_correction=True)
    assert set(choice.kl) == {k for v in cands for k in (v, f"{v}+bc")}
    assert choice.variant == min(choice.kl, key=choice.kl.get)
    res = next(iter(cands.values()))()
    fixed = corrected(res, model, stats_correction(model, stats, batches)).model
    for n in ("0", "2"):  # bias moved by (W - Q/s) abar, Q/s the dequantised AWQ weight the module holds
        d = model.get_submodule(n).weight - res.model.get_submodule(n).weight
        shift = fixed.get_submodule(n).bias - res.model.get_submodule(n).bias
        assert torch.allclose(shift, d @ stats[n].mean[0], atol=1e-12)
        assert shift.abs().max() > 1e-6  # a real shift, not a no-op


def test_awq_select_infeasible_budget_raises():
    model, batches, stats = _calibrated()
    with pytest.raises(ValueError, match="infeasible for AWQ"):
        awq_select(model, stats, batches, 2.0, CFG, group_sizes=GROUP_SIZES)
