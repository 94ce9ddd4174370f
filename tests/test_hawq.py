import pytest
import torch
from torch import nn

from bayesq.baselines.hawq import hawq_quantize, hessian_traces
from bayesq.blocks import quantizable_layers
from bayesq.config import QuantConfig
from bayesq.curvature.hutchinson import hutchinson_diagonal

CFG = QuantConfig(group_size=16, unit_groups=2)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5)).double()


def test_hessian_traces_are_the_hutchinson_diagonal_sums_per_input():
    model = _model()
    batches = [torch.randn(8, 32, dtype=torch.float64) for _ in range(2)]
    traces = hessian_traces(model, batches, probes=4, seed=3)
    diag, n = hutchinson_diagonal(model, batches, quantizable_layers(model), probes=4, seed=3, progress=False)
    for k, v in diag.items():
        assert traces[k] == pytest.approx(max(float(v.sum()) / n, 0.0), rel=1e-12)


def test_hessian_traces_vs_exact_hessian_trace():
    """Within 4 standard errors of the exact trace: a Rademacher trace estimate of a symmetric H
    has variance ``2 sum_{i != j} H_ij^2 / M`` (layer traces stay positive on this net)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    yhat = model(x).argmax(1)
    params = dict(model.named_parameters())

    def loss_of(name):
        def f(w):
            p = {k: (w if k == name else v) for k, v in params.items()}
            out = torch.func.functional_call(model, p, (x,))
            return nn.functional.cross_entropy(out, yhat, reduction="sum")
        return f

    est = hessian_traces(model, [x], probes=4000, seed=0)
    for layer in ("0", "2"):
        name = f"{layer}.weight"
        H = torch.autograd.functional.hessian(loss_of(name), params[name].detach())
        H = H.reshape(params[name].numel(), -1) / 6
        off = H - torch.diag(H.diagonal())
        se = float((2 * off.pow(2).sum() / 4000).sqrt())
        assert float(H.trace()) > 0
        assert se < 0.1 * float(H.trace())  # the check below is tight
        assert abs(est[layer] - float(H.trace())) < 4 * se


def test_hawq_one_bit_width_per_layer_and_sensitive_layer_gets_more_bits():
    model = _model()
    traces = {"0": 1e4, "2": 1e-4, "4": 1.0}
    res = hawq_quantize(model, traces, 4.0, CFG)
    assert res.average_bits <= 4.0
    bits = {n: set(b) for n, b in res.allocation.unit_bits.items()}
    assert all(len(b) == 1 for b in bits.values())
    assert max(bits["0"]) > max(bits["2"])
    for n, q in res.weights.items():
        assert torch.equal(res.model.get_submodule(n).weight, q.dequantize())


def test_hawq_missing_trace_raises():
    with pytest.raises(ValueError, match="no Hessian trace"):
        hawq_quantize(_model(), {"0": 1.0}, 4.0, CFG)
