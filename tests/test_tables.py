"""Loss tables of configurations: the Monte Carlo proxies vs the closed form (bayesq/tables.py)."""

import pytest
import torch
from torch import nn

from bayesq.blocks import LayerBlocks
from bayesq.config import QuantConfig
from bayesq.curvature.kfac import KFACFactors
from bayesq.expected_loss import posterior_table
from bayesq.posterior import Posterior
from bayesq.tables import apply_mc_proxy, top_layers

F64 = torch.float64


def _kfac_posterior():
    """Diagonal K-FAC factors: the precision G (x) A is diagonal and equals 1 / variance, so the
    output proxy's expectation is exactly the closed-form whitened entry."""
    g = torch.Generator().manual_seed(8)
    means, var, kfac = {}, {}, {}
    for name, (o, i) in {"a": (6, 24), "b": (8, 16), "c": (4, 16)}.items():
        means[name] = torch.randn(o, i, generator=g, dtype=F64) * 0.05
        a = torch.exp(torch.randn(i, generator=g, dtype=F64))
        gg = 4e4 * torch.exp(torch.randn(o, generator=g, dtype=F64))
        var[name] = 1.0 / torch.outer(gg, a)
        kfac[name] = KFACFactors(torch.diag(a), torch.diag(gg), 100)
    return Posterior(means, var, 100, kfac)


def test_apply_mc_proxy_output_vs_closed_form_within_3_se():
    post = _kfac_posterior()
    cfg = QuantConfig(objective="draws", rounding="nearest", group_size=16, unit_groups=2, bits=(2, 3, 4), mc_samples=400, mc_top_fraction=0.5)
    blocks = [LayerBlocks(n, tuple(m.shape), 16, 2) for n, m in post.mean.items()]
    closed = posterior_table(post, blocks, cfg, progress=False)
    mc = apply_mc_proxy(closed, post, cfg, kind="output", seed=3, progress=False)
    top = top_layers(closed, 0.5)
    assert len(top) == 2  # ceil(0.5 * 3)
    for i, (c, m) in enumerate(zip(closed.layers, mc.layers)):
        if i not in top:
            assert torch.equal(c.unit_loss, m.unit_loss) and (m.unit_se == 0).all()
            continue
        total, se = m.unit_loss.sum(0), m.unit_se.sum(0)
        assert (se > 0).all()
        assert ((total - c.unit_loss.sum(0)).abs() < 3 * se).all(), (total, c.unit_loss.sum(0), se)
        # shared out over units in proportion to the closed form
        assert torch.allclose(m.unit_loss / total, c.unit_loss / c.unit_loss.sum(0), rtol=1e-12)


def test_apply_mc_proxy_kl_on_closed_form_scale():
    # Linear softmax model, tiny posterior spread and fine grids: KL(p_w || p_{w+d}) ~ 0.5 d^T F d,
    # so n_data / n_kl * summed KL ~ 0.5 d^T (n_data * mean F) d. With the posterior variance set
    # to 1 / (n_data * mean Fisher diagonal) the rescaled entries match the closed form up to the
    # off-diagonal Fisher terms (which the diagonal table ignores; ~10% here).
    torch.manual_seed(0)
    model = nn.Linear(16, 5).double()
    x = torch.randn(200, 16, dtype=F64)
    p = torch.softmax(model(x), -1).detach()
    fisher_mean = torch.einsum("no,ni->oi", p * (1 - p), x * x) / x.shape[0]  # exact diagonal of the GGN
    n_data = 5000
    mu = model.weight.detach().clone()
    post = Posterior({"w": mu}, {"w": 1.0 / (n_data * fisher_mean)}, 200, n_data=n_data)
    wrapper = nn.Module()
    wrapper.w = model  # layer name "w"
    wrapper.forward = lambda inp: model(inp)
    cfg = QuantConfig(objective="draws", rounding="nearest", group_size=16, unit_groups=1, bits=(5, 6), mc_samples=64, mc_top_fraction=1.0)
    blocks = [LayerBlocks("w", tuple(mu.shape), 16, 1)]
    closed = posterior_table(post, blocks, cfg, progress=False)
    mc = apply_mc_proxy(closed, post, cfg, kind="kl", model=wrapper, batches=[x[:100], x[100:]], n_kl=200,
                        seed=0, progress=False)
    ratio = mc.layers[0].unit_loss.sum(0) / closed.layers[0].unit_loss.sum(0)
    assert ((ratio - 1).abs() < 0.25).all(), ratio
    with pytest.raises(ValueError, match="needs the model and calibration batches"):
        apply_mc_proxy(closed, post, cfg, kind="kl")
    with pytest.raises(ValueError, match="no K-FAC factors"):
        apply_mc_proxy(closed, post, cfg, kind="output")
