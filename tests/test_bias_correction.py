import pytest
import torch
from torch import nn
import torch.nn.functional as F

from bayesq.baselines.activations import input_stats
from bayesq.bias_correction import BiasCorrection, output_shift
from bayesq.blocks import quantizable_layers
from bayesq.config import BayesQConfig, DistillConfig, QuantConfig
from bayesq.quantize import quantize_model
from bayesq.result import quantized_copy
from bayesq.rounding import bias_correction


def _rounded(w: torch.Tensor, step: float = 0.25) -> torch.Tensor:
    return torch.round(w / step) * step


def _batches(shape, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5 for _ in range(n)]  # mean far from 0


def test_output_shift_vs_mean_output_difference_conv_groups_padding():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False).double()
    batches = _batches((5, 4, 7, 7))
    stats = input_stats(conv, batches, {"": conv})
    q = _rounded(conv.weight.detach())
    x = torch.cat(batches)
    direct = (F.conv2d(x, conv.weight, padding=1, groups=2) - F.conv2d(x, q, padding=1, groups=2)).mean((0, 2, 3))
    torch.testing.assert_close(output_shift(conv.weight, q, stats[""].mean), direct, rtol=1e-12, atol=1e-12)


def test_output_shift_vs_mean_output_difference_linear_tokens():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3).double()
    batches = _batches((4, 6, 5))  # (batch, tokens, features)
    stats = input_stats(lin, batches, {"": lin})
    q = _rounded(lin.weight.detach())
    x = torch.cat(batches)
    direct = (x @ (lin.weight - q).T).mean((0, 1))
    torch.testing.assert_close(output_shift(lin.weight, q, stats[""].mean), direct, rtol=1e-12, atol=1e-12)


class _Net(nn.Module):
    """conv->BN (target: running_mean), conv with bias (target: bias), conv->ReLU (no target),
    conv read by a BN and by another conv (skipped: two readers)."""

    def __init__(self):
        super().__init__()
        self.a, self.bn_a = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.b = nn.Conv2d(4, 4, 1)
        self.c, self.relu = nn.Conv2d(4, 4, 1, bias=False), nn.ReLU()
        self.d, self.bn_d, self.e = nn.Conv2d(4, 4, 1, bias=False), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.relu(self.c(self.b(self.bn_a(self.a(x)))))
        z = self.d(y)
        return (self.bn_d(z) + self.e(z)).mean((2, 3))


def _net():
    torch.manual_seed(0)
    net = _Net().double().eval()
    for bn in (net.bn_a, net.bn_d):
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    return net


def test_fit_targets_bias_batchnorm_and_skips_with_reasons():
    net = _net()
    batches = _batches((2, 3, 5, 5))
    stats = input_stats(net, batches, quantizable_layers(net))
    corr = bias_correction(net, stats, batches)
    assert dict(corr.targets) == {"a": "bn_a.running_mean", "b": "b.bias", "e": "e.bias"}
    assert set(corr.skipped) == {"c", "d"}
    assert "no BatchNorm" in corr.skipped["c"] and "read by 2 modules" in corr.skipped["d"]


def test_apply_restores_mean_output_and_lowers_error_by_shift_squared():
    net = _net()
    batches = _batches((2, 3, 5, 5))
    stats = input_stats(net, batches, quantizable_layers(net))
    corr = bias_correction(net, stats, batches)
    weights = {n: _rounded(m.weight.detach()) for n, m in quantizable_layers(net).items()}
    plain = _copy_with(net, weights)
    fixed = _copy_with(net, weights)
    corr.apply(fixed, net)
    x = torch.cat(batches)
    with torch.no_grad():
        fp_out = net.bn_a(net.a(x))
        before, after = plain.bn_a(plain.a(x)), fixed.bn_a(fixed.a(x))
    # the corrected layer's mean output (after its BatchNorm) is the full-precision one
    torch.testing.assert_close(after.mean((0, 2, 3)), fp_out.mean((0, 2, 3)), rtol=1e-10, atol=1e-12)
    assert (before.mean((0, 2, 3)) - fp_out.mean((0, 2, 3))).abs().max() > 1e-3
    # least squares over an output offset: the mean squared error drops by exactly |shift|^2 (BN-scaled)
    scale = net.bn_a.weight / (net.bn_a.running_var + net.bn_a.eps).sqrt()
    shift = output_shift(net.a.weight, weights["a"], corr.means["a"]) * scale
    drop = ((before - fp_out) ** 2).mean((0, 2, 3)) - ((after - fp_out) ** 2).mean((0, 2, 3))
    torch.testing.assert_close(drop, shift.detach() ** 2, rtol=1e-9, atol=1e-12)


def test_apply_on_a_model_that_is_one_linear_layer_vs_mean_output():
    """The quantised layer may be the model itself (module name ""): its bias is the target, and
    the corrected mean output is the full-precision one."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 4).double()
    batches = _batches((5, 6))
    stats = input_stats(lin, batches, {"": lin})
    corr = bias_correction(lin, stats, batches)
    assert corr.targets == {"": "bias"}
    fixed = _copy_with(lin, {"": _rounded(lin.weight.detach())})
    corr.apply(fixed, lin)
    x = torch.cat(batches)
    with torch.no_grad():
        torch.testing.assert_close(fixed(x).mean(0), lin(x).mean(0), rtol=1e-10, atol=1e-12)


def _copy_with(net, weights):
    import copy

    out = copy.deepcopy(net)
    with torch.no_grad():
        for n, w in weights.items():
            out.get_submodule(n).weight.copy_(w)
    return out


def test_fit_empty_calibration_names_the_fix():
    net = _net()
    with pytest.raises(ValueError, match="bias_correction: false"):
        BiasCorrection.fit(net, {"a": torch.zeros(1, 27, dtype=torch.float64)}, [])


def _cnn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                        nn.Flatten(), nn.Linear(16 * 6 * 6, 10))
    for m in net:
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1)
    return net.eval()


def test_quantize_model_correction_in_model_and_export(tmp_path):
    from bayesq.export import load, save_export

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 3, 6, 6, generator=g) for _ in range(2)]
    q = QuantConfig(group_size=32, unit_groups=2)
    cfg = BayesQConfig(budget=4.0, quant=q, distill=DistillConfig(max_budget=0))
    res = quantize_model(_cnn(), batches, cfg, progress=False)
    assert dict(res.correction.targets) == {"0": "1.running_mean", "3": "4.running_mean", "7": "7.bias"}
    assert res.model[1].running_mean.ne(_cnn()[1].running_mean).any()
    # the model returned is the uncorrected encoding plus the correction, then the output offset
    rebuilt = quantized_copy(_cnn(), res.weights, res.correction)
    assert res.output_offset.layer == "7"
    res.output_offset.apply(rebuilt)
    torch.testing.assert_close(res.model(batches[0]), rebuilt(batches[0]), rtol=0, atol=0)
    save_export(tmp_path / "m.safetensors", res.model, res.weights, q, res.allocation.total_bits)
    back = load(tmp_path / "m.safetensors", skeleton=_cnn())
    with torch.no_grad():
        assert torch.equal(back(batches[1]), res.model(batches[1]))
    off = quantize_model(_cnn(), batches, BayesQConfig(budget=4.0, quant=QuantConfig(
        group_size=32, unit_groups=2, bias_correction=False), distill=DistillConfig(max_budget=0)), progress=False)
    assert off.correction is None and torch.equal(off.model[1].running_mean, _cnn()[1].running_mean)
