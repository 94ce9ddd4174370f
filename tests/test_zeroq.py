"""ZeroQ: the statistics and the BatchNorm loss against hand computations, the distilled inputs
against the running statistics they are fitted to, the sensitivities against a direct KL, and the
method end to end (data-free: the calibration values are never read)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesq.baselines.zeroq import (
    ZeroQConfig, _layer_units, batchnorms, bn_loss, distilled_data, input_statistics, random_batch, sensitivity_table,
)
from bayesq.blocks import quantizable_layers
from bayesq.config import QuantConfig
from bayesq.expected_loss import rtn_table
from bayesq.grids import minmax_grids
from bayesq.methods import Inputs, quantize_with

Q = QuantConfig(group_size=32, unit_groups=2)


def _cnn(seed: int = 0) -> nn.Sequential:
    """Conv-BN-ReLU twice, pooled, a classifier; float64; BN running statistics those of smooth
    "training" images (normalised per channel), which white noise does not have."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).double()
    real = F.avg_pool2d(torch.randn(256, 3, 6, 6, generator=torch.Generator().manual_seed(seed + 1),
                                    dtype=torch.float64), 3, 1, 1)
    real = (real - real.mean((0, 2, 3), keepdim=True)) / real.std((0, 2, 3), keepdim=True)
    for bn in (model[1], model[4]):
        bn.momentum = None  # cumulative average: the running statistics of this one batch
    with torch.no_grad():
        model(real)
    return model.eval()


def test_input_statistics_vs_hand():
    x = torch.arange(24, dtype=torch.float64).reshape(2, 3, 2, 2)
    mu, sigma = input_statistics(x)
    assert mu[1, 2].item() == pytest.approx((20 + 21 + 22 + 23) / 4)
    assert sigma[0, 0].item() == pytest.approx((1.25 + 1e-5) ** 0.5)  # var of 0..3, biased


def test_bn_loss_vs_manual():
    """The hooked loss equals the statistics of each BN's input computed by running the layers."""
    model = _cnn()
    x = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    h1 = model[0](x)
    h2 = model[3](model[2](model[1](h1)))
    want = 0.0
    for h, bn in ((h1, model[1]), (h2, model[4])):
        flat = h.reshape(4, 8, -1)
        mu, var = flat.mean(-1), flat.var(-1, unbiased=False)
        want += ((mu - bn.running_mean) ** 2).sum() / 4
        want += ((torch.sqrt(var + 1e-5) - torch.sqrt(bn.running_var + bn.eps)) ** 2).sum() / 4
    flat = x.reshape(4, 3, -1)
    want += (flat.mean(-1) ** 2).sum() / 4 + ((torch.sqrt(flat.var(-1, unbiased=False) + 1e-5) - 1) ** 2).sum() / 4
    torch.testing.assert_close(bn_loss(model, x, batchnorms(model)), want)


def test_distilled_data_matches_running_statistics_and_keeps_the_model():
    model = _cnn()
    like = torch.zeros(7, 3, 6, 6, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    start, kind0 = random_batch(model, like, 8, torch.Generator().manual_seed(0))
    x, kind = distilled_data(model, like, n=8, iters=300, lr=0.1)
    assert kind0 == "gaussian" and kind == "batchnorm" and x.shape == (8, 3, 6, 6) and not x.requires_grad
    norms = batchnorms(model)
    with torch.no_grad():
        assert float(bn_loss(model, x, norms)) < 1e-3 * float(bn_loss(model, start, norms))
        gap = lambda z: float((input_statistics(model[0](z))[0] - model[1].running_mean).abs().max())  # noqa: E731
        assert gap(x) < 0.01 < 0.05 < gap(start)  # each input's own channel means at the first BN's input
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.requires_grad for p in model.parameters()) and not model.training


def test_sensitivity_table_vs_direct_kl():
    """Each entry is the mean KL(p_FP || p_Q) on the batch with that layer alone on its min/max
    grids at that width, computed here on a copy of the model."""
    model = _cnn()
    x = torch.randn(6, 3, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    layers = quantizable_layers(model, ())
    table = rtn_table({n: m.weight for n, m in layers.items()}, _layer_units(layers, Q), Q)
    sens = sensitivity_table(model, layers, table, x)
    with torch.no_grad():
        logp = F.log_softmax(model(x), -1)
    for t in sens.layers:
        name = t.blocks.name
        for j, b in enumerate(t.bits):
            copy_ = copy.deepcopy(model)
            w, _ = t.blocks.to_groups(layers[name].weight.detach().reshape(-1))
            book = minmax_grids(w, b)
            with torch.no_grad():
                copy_.get_submodule(name).weight.copy_(t.blocks.from_groups(book.dequantize(book.quantize(w))))
            with torch.no_grad():
                logq = F.log_softmax(copy_(x), -1)
            want = float((logp.exp() * (logp - logq)).sum(-1).mean())
            assert t.unit_loss[0, j].item() == pytest.approx(want, rel=1e-6, abs=1e-12)
        assert t.unit_loss[0, 0] > t.unit_loss[0, -1]  # 2 bits hurt more than 8
    with torch.no_grad():
        torch.testing.assert_close(F.log_softmax(model(x), -1), logp, rtol=0, atol=0)  # every weight put back


def test_zeroq_gives_the_sensitive_layer_more_bits():
    """A layer whose output the classifier amplifies 100x gets at least the bits of the one
    it does not, at a budget where they cannot both have 4."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4)).double().eval()
    with torch.no_grad():
        model[3].weight.mul_(100)
    out = quantize_with(model, ZeroQConfig(Q, progress=False), 3.0,
                        Inputs(calibration=[torch.zeros(4, 32, dtype=torch.float64)]))
    bits = {n: max(b) for n, b in out.result.allocation.unit_bits.items()}
    assert out.details["data"] == "gaussian" and out.result.average_bits <= 3.0
    assert bits["3"] >= bits["2"] and bits["3"] > min(bits.values())


def test_zeroq_method_is_data_free_and_meets_the_budget():
    """Two calibration batches of the same shape but other values give the same result: only
    the shape is read."""
    model = _cnn()
    g = torch.Generator().manual_seed(4)
    a = torch.randn(4, 3, 6, 6, generator=g, dtype=torch.float64)
    cfg = ZeroQConfig(Q, iters=50, progress=False)
    one = quantize_with(model, cfg, 3.0, Inputs(calibration=[a]))
    two = quantize_with(model, cfg, 3.0, Inputs(calibration=[a * 7 + 3]))
    assert one.details["data"] == "batchnorm" and one.result.average_bits <= 3.0 and not one.result.unquantized
    for name, qw in one.result.weights.items():
        torch.testing.assert_close(qw.dequantize(), two.result.weights[name].dequantize(), rtol=0, atol=0)


def test_random_batch_tokens_and_errors():
    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.emb(input_ids).mean(1)

    like = {"input_ids": torch.zeros(2, 5, dtype=torch.int64), "attention_mask": torch.zeros(2, 5, dtype=torch.int64),
            "token_type_ids": torch.ones(2, 5, dtype=torch.int64)}
    batch, kind = random_batch(Tok(), like, 3, torch.Generator().manual_seed(0))
    assert kind == "random tokens" and batch["input_ids"].shape == (3, 5)
    assert int(batch["input_ids"].max()) < 50 and bool((batch["attention_mask"] == 1).all())
    assert bool((batch["token_type_ids"] == 0).all())
    assert distilled_data(Tok(), like, n=3)[1] == "random tokens"
    with pytest.raises(ValueError, match="input_ids"):
        random_batch(Tok(), {"pixels": torch.zeros(2, 3)}, 3, torch.Generator())
    with pytest.raises(ValueError, match="no nn.Embedding"):
        random_batch(nn.Linear(2, 2), like, 3, torch.Generator())


def test_zeroq_config_rejects_bad_values():
    with pytest.raises(ValueError, match="zeroq needs inputs >= 1"):
        ZeroQConfig(inputs=0)
    with pytest.raises(ValueError, match="zeroq.lr must be > 0"):
        ZeroQConfig(lr=0.0)
    with pytest.raises(ValueError, match="ZeroQ .* reads calibration inputs"):
        quantize_with(_cnn(), ZeroQConfig(Q, progress=False), 3.0, Inputs())
