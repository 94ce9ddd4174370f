import pytest
import torch
from torch import nn

from bayesq.baselines.activations import InputStats, input_stats
from bayesq.baselines.awq import _rtn
from bayesq.baselines.rtn import rtn_blocks
from bayesq.baselines.smoothquant import SmoothQuantConfig, smooth_scales
from bayesq.blocks import layer_blocks
from bayesq.config import Granularity, QuantConfig
from bayesq.methods import Inputs, quantize_with


def _outlier_linear(seed=0, d=32, out=64):
    """A Linear layer whose input channel 5 carries activations 40x larger than the others."""
    torch.manual_seed(seed)
    lin = nn.Linear(d, out).double()
    g = torch.Generator().manual_seed(seed + 10)
    amp = torch.ones(d, dtype=torch.float64)
    amp[5] = 40.0
    return lin, [torch.randn(16, d, generator=g, dtype=torch.float64) * amp for _ in range(3)]


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.85, 1.0])
def test_smooth_scales_linear_vs_hand_formula(alpha):
    lin, batches = _outlier_linear()
    st = input_stats(lin, batches, {"": lin})[""]
    W = lin.weight.detach()
    X = torch.cat(batches)
    want = X.abs().amax(0).pow(alpha) / W.abs().amax(0).pow(1 - alpha)  # (d,) the paper's eq. 4
    torch.testing.assert_close(smooth_scales(W, st, 1, alpha)[0], want, rtol=1e-12, atol=0)


def test_smooth_scales_conv_per_input_channel_over_kernel_positions():
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    batches = [torch.randn(2, 3, 5, 5, dtype=torch.float64) * torch.tensor([1.0, 9.0, 0.1]).view(1, 3, 1, 1)]
    st = input_stats(conv, batches, {"": conv})[""]
    W = conv.weight.detach()
    s = smooth_scales(W.reshape(4, -1), st, 9)
    act = batches[0].abs().amax((0, 2, 3))  # padding zeros never win
    want = (act.sqrt() / W.abs().amax((0, 2, 3)).sqrt()).repeat_interleave(9)
    torch.testing.assert_close(s[0], want, rtol=1e-12, atol=0)


def test_smoothquant_weights_are_the_rounded_migrated_weights_divided_back():
    """W_hat = RTN(W diag(s)) diag(s)^-1 with s stored in fp16, at one bit-width (no selection)."""
    lin, batches = _outlier_linear(d=64)
    q = QuantConfig(bits=(3,), group_size=16, unit_groups=2)
    out = quantize_with(lin, SmoothQuantConfig(q, select=False), 5.0, Inputs(calibration=batches))
    st = input_stats(lin, batches, {"": lin})[""]
    W = lin.weight.detach()
    s = smooth_scales(W, st, 1).to(torch.float16).double()
    lb = rtn_blocks(layer_blocks({"": lin}, 16, 2), Granularity.GROUP, q)[0]
    want = _rtn(W * s, lb, 3, 16) / s
    got = out.result.weights[""]
    assert torch.equal(got.col_scale, s)
    torch.testing.assert_close(got.dequantize(), want, rtol=1e-12, atol=0)
    assert torch.equal(out.result.model.weight, got.dequantize().to(W.dtype))
    scales_bits = 16 * 64
    groups = 64 * 64 // 16
    assert out.result.allocation.total_bits == 64 * 64 * 3 + groups * (16 + 3) + scales_bits  # codes, grids, s


def test_smoothquant_selects_a_variant_within_the_budget():
    lin, batches = _outlier_linear(d=64)
    out = quantize_with(lin, SmoothQuantConfig(QuantConfig(group_size=16, unit_groups=2), group_sizes=(16, 32)), 3.5,
                        Inputs(calibration=batches, selection=_outlier_linear(seed=3, d=64)[1]))
    assert out.result.average_bits <= 3.5
    assert out.details["variant"] in out.details["variant_kl"] and "mixed" in out.details["variant_kl"]


def test_smooth_scales_without_abs_max_names_the_fix():
    lin, batches = _outlier_linear()
    st = input_stats(lin, batches, {"": lin})[""]
    lean = InputStats(st.H, st.abs_mean, st.n, st.mean, st.positions)
    with pytest.raises(ValueError, match="abs_mean=True"):
        smooth_scales(lin.weight.detach(), lean, 1)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_smoothquant_config_rejects_alpha_outside_unit_interval(alpha):
    with pytest.raises(ValueError, match=r"SmoothQuantConfig.alpha"):
        SmoothQuantConfig(alpha=alpha)
