import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats
from torch import nn

from bayesq.grid_cost import grid_cost_chunked
from bayesq.grids import UniformGrids, dequantize, fit_uniform_grids, grids_from_range, minmax_grids, quantize
from bayesq.monte_carlo import (
    MCEstimate, kfac_quadratic, mc_layer_output_loss, mc_logit_kl, mc_whitened_loss, rescale_to_closed_form,
)

F64 = torch.float64


def _q(grids: UniformGrids):
    return lambda w: dequantize(quantize(w, grids), grids)


def _posterior(rows: int, n: int, seed: int, rel_sigma: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(rows, n, generator=gen, dtype=F64)
    sigma = rel_sigma * (0.2 + torch.rand(rows, n, generator=gen, dtype=F64))
    return mu, sigma


def _cell_moments(mu: float, sigma: float, levels: np.ndarray) -> tuple[float, float]:
    """(E[Q(w) - w], E[(Q(w) - w)^2]) for w ~ N(mu, sigma^2), nearest level, by quadrature."""
    bounds = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
    m1 = m2 = 0.0
    for c, a, b in zip(levels, bounds[:-1], bounds[1:]):
        f1 = lambda w, c=c: (c - w) * stats.norm.pdf(w, mu, sigma)
        f2 = lambda w, c=c: (c - w) ** 2 * stats.norm.pdf(w, mu, sigma)
        m1 += integrate.quad(f1, a, b, epsabs=1e-14, epsrel=1e-11, limit=200)[0]
        m2 += integrate.quad(f2, a, b, epsabs=1e-14, epsrel=1e-11, limit=200)[0]
    return m1, m2


def _error_moments(mu: torch.Tensor, sigma: torch.Tensor, grids: UniformGrids):
    """Per-weight E[D], E[D^2] (R, n) of D = Q(w) - w (row r uses grid r), truncated-normal cells.

    Cell k = [t_k, t_{k+1}] around level c_k; in standard units u = (w - mu) / sigma,
    E[(c - w) 1_cell] = sigma (c' P - (phi(a) - phi(b))),
    E[(c - w)^2 1_cell] = sigma^2 (c'^2 P - 2 c' (phi(a) - phi(b)) + P + a phi(a) - b phi(b)).
    """
    k = np.arange(grids.levels)
    lo, step = grids.lo.numpy()[:, None, None], grids.scale.numpy()[:, None, None]
    m, s = mu.numpy()[..., None], sigma.numpy()[..., None]  # (R, n, 1)
    c = (lo + k * step - m) / s  # (R, n, K) whitened level offsets
    edges = np.concatenate([[-np.inf], k[1:] - 0.5, [np.inf]])
    t = np.clip((lo + edges * step - m) / s, -60.0, 60.0)  # (R, n, K + 1) whitened boundaries
    a, b = t[..., :-1], t[..., 1:]
    p = stats.norm.cdf(b) - stats.norm.cdf(a)
    dphi = stats.norm.pdf(a) - stats.norm.pdf(b)
    e1 = (c * p - dphi).sum(-1) * s[..., 0]
    e2 = (c * c * p - 2 * c * dphi + p + a * stats.norm.pdf(a) - b * stats.norm.pdf(b)).sum(-1) * s[..., 0] ** 2
    return torch.from_numpy(e1), torch.from_numpy(e2)


def test_error_moments_reference_vs_quadrature_and_closed_form():
    # the exact reference used below agrees with quadrature and with codebook's closed form
    mu, sigma = _posterior(3, 4, seed=26, rel_sigma=0.5)
    grids = minmax_grids(mu, 3, ratio=0.7)
    m1, m2 = _error_moments(mu, sigma, grids)
    for r, i in ((0, 0), (1, 2), (2, 3)):
        levels = (grids.lo[r] + grids.scale[r] * torch.arange(8, dtype=F64)).numpy()
        q1, q2 = _cell_moments(float(mu[r, i]), float(sigma[r, i]), levels)
        assert float(m1[r, i]) == pytest.approx(q1, rel=1e-7, abs=1e-12)
        assert float(m2[r, i]) == pytest.approx(q2, rel=1e-7)
    closed = grid_cost_chunked(mu, sigma, grids.lo, grids.scale, grids.levels)
    assert torch.allclose((m2 / sigma**2).sum(1), closed, rtol=1e-9)


# ---------------------------------------------------------------- whitened loss (item 1)

def test_mc_whitened_loss_vs_closed_form_zscores():
    rows, n = 60, 16
    mu, sigma = _posterior(rows, n, seed=1)
    mask = torch.ones(rows, n, dtype=F64)
    mask[::7, -3:] = 0.0  # some padding
    grids = []
    for bits in (2, 3, 4):
        grids.append(fit_uniform_grids(mu, sigma, mask, bits)[0])
        grids.append(minmax_grids(mu, bits))
        grids.append(minmax_grids(mu, bits, ratio=0.5))  # heavy clipping
    est = mc_whitened_loss(mu, sigma, mask, [_q(g) for g in grids], samples=128, seed=3)
    exact = torch.stack([0.5 * grid_cost_chunked(mu, sigma, g.lo, g.scale, g.levels, mask) for g in grids])
    assert est.mean.shape == est.se.shape == exact.shape == (len(grids), rows)
    z = ((est.mean - exact) / est.se).flatten()
    assert (z.abs() > 3).double().mean() < 0.01
    assert abs(float(z.mean())) < 0.2
    assert 0.8 < float(z.std()) < 1.2  # the standard errors are calibrated


def test_mc_whitened_loss_mask_excludes_padding():
    mu, sigma = _posterior(4, 8, seed=2)
    g = minmax_grids(mu, 2)
    mask = torch.ones_like(mu)
    mask[:, 5:] = 0
    est = mc_whitened_loss(mu, sigma, mask, [_q(g)], samples=8, seed=0)
    mu2, sigma2 = mu.clone(), sigma.clone()
    mu2[:, 5:], sigma2[:, 5:] = 7.0, 1e-3  # padding far outside the grid: huge cost if counted
    est2 = mc_whitened_loss(mu2, sigma2, mask, [_q(g)], samples=8, seed=0)
    assert torch.allclose(est.mean, est2.mean, rtol=1e-12) and torch.allclose(est.se, est2.se, rtol=1e-12)
    exact = 0.5 * grid_cost_chunked(mu, sigma, g.lo, g.scale, g.levels, mask)
    assert ((est.mean - exact).abs() < 4 * est.se).all()


def test_antithetic_vs_independent_se_at_equal_draws():
    # sigma << step: Q(w) is mostly constant, loss 0.5 (c - eps)^2 has a large odd part -c eps
    rows, n = 20, 32
    mu, sigma = _posterior(rows, n, seed=4, rel_sigma=0.02)
    g = minmax_grids(mu, 3)
    mask = torch.ones_like(mu)
    anti = mc_whitened_loss(mu, sigma, mask, [_q(g)], samples=64, antithetic=True, seed=5)
    indep = mc_whitened_loss(mu, sigma, mask, [_q(g)], samples=64, antithetic=False, seed=5)
    assert anti.values.shape[0] == 32 and indep.values.shape[0] == 64
    ratio = (anti.se / indep.se).median()
    assert ratio < 0.5


def test_common_random_numbers_vs_independent_streams_difference_se():
    # two range candidates of one 3-bit grid, sigma ~ step: their errors share the posterior noise
    rows, n = 30, 32
    mu, sigma = _posterior(rows, n, seed=6, rel_sigma=1.0)
    mask = torch.ones_like(mu)
    g_a, g_b = minmax_grids(mu, 3), minmax_grids(mu, 3, ratio=0.95)
    crn = mc_whitened_loss(mu, sigma, mask, [_q(g_a), _q(g_b)], samples=32, seed=7)
    diff = crn.difference(0, 1)
    a = mc_whitened_loss(mu, sigma, mask, [_q(g_a)], samples=32, seed=8)
    b = mc_whitened_loss(mu, sigma, mask, [_q(g_b)], samples=32, seed=9)
    se_indep = (a.se[0] ** 2 + b.se[0] ** 2).sqrt()
    assert torch.allclose(diff.mean, crn.mean[0] - crn.mean[1])
    assert (diff.se / se_indep).median() < 0.3
    exact = 0.5 * (grid_cost_chunked(mu, sigma, g_a.lo, g_a.scale, 8, mask)
                   - grid_cost_chunked(mu, sigma, g_b.lo, g_b.scale, 8, mask))
    z = (diff.mean - exact) / diff.se
    assert (z.abs() > 3).double().mean() < 0.1


def test_mc_whitened_loss_same_draws_for_every_candidate():
    mu, sigma = _posterior(5, 8, seed=10)
    g2, g3 = minmax_grids(mu, 2), minmax_grids(mu, 3)
    mask = torch.ones_like(mu)
    one = mc_whitened_loss(mu, sigma, mask, [_q(g3)], samples=8, seed=11)
    two = mc_whitened_loss(mu, sigma, mask, [_q(g2), _q(g3)], samples=8, seed=11)
    assert torch.equal(one.mean[0], two.mean[1]) and torch.equal(one.se[0], two.se[1])
    other = mc_whitened_loss(mu, sigma, mask, [_q(g3)], samples=8, seed=12)
    assert not torch.equal(one.mean, other.mean)


def test_mc_whitened_loss_identity_quantizer_is_zero_and_rejects_bad_input():
    mu, sigma = _posterior(3, 4, seed=13)
    mask = torch.ones_like(mu)
    est = mc_whitened_loss(mu, sigma, mask, [lambda w: w], samples=4)
    assert torch.equal(est.mean, torch.zeros(1, 3, dtype=F64))
    with pytest.raises(ValueError, match="same shape"):
        mc_whitened_loss(mu, sigma[:, :2], mask, [lambda w: w])
    with pytest.raises(ValueError, match="sigma must be finite and > 0"):
        mc_whitened_loss(mu, 0 * sigma, mask, [lambda w: w])
    with pytest.raises(ValueError, match="mask"):
        mc_whitened_loss(mu, sigma, mask[:2], [lambda w: w])
    with pytest.raises(ValueError, match="even number >= 4"):
        mc_whitened_loss(mu, sigma, mask, [lambda w: w], samples=5)
    with pytest.raises(ValueError, match="at least 2 draws"):
        mc_whitened_loss(mu, sigma, mask, [lambda w: w], samples=1, antithetic=False)
    with pytest.raises(ValueError, match="quantizers is empty"):
        mc_whitened_loss(mu, sigma, mask, [])
    with pytest.raises(ValueError, match="keep the shape"):
        mc_whitened_loss(mu, sigma, mask, [lambda w: w[:, :1]])
    with pytest.raises(ValueError, match="2-D"):
        mc_whitened_loss(mu.flatten(), sigma.flatten(), mask.flatten(), [lambda w: w])


# ---------------------------------------------------------------- layer output (item 2)

def _spd(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=gen, dtype=F64)
    return x.T @ x / (3 * n)


def test_kfac_quadratic_vs_explicit_kronecker():
    gen = torch.Generator().manual_seed(20)
    d = torch.randn(4, 6, generator=gen, dtype=F64)
    a, g = _spd(6, 21), _spd(4, 22)
    vec = d.reshape(-1)  # (out * in,) row-major
    assert torch.allclose(kfac_quadratic(d, a, g), vec @ torch.kron(g, a) @ vec, rtol=1e-12)
    gd = torch.rand(4, generator=gen, dtype=F64)
    assert torch.allclose(kfac_quadratic(d, a, gd), vec @ torch.kron(torch.diag(gd), a) @ vec, rtol=1e-12)


def _exact_layer_loss(m1, m2, a, g):
    """0.5 * E[tr(G D A D^T)] with independent coordinates: off-diagonal pairs E[D]E[D]."""
    g = torch.diag(g) if g.ndim == 1 else g
    cross = torch.einsum("op,ij,oi,pj->", g, a, m1, m1)
    diag = (torch.diag(g)[:, None] * torch.diag(a)[None, :] * (m2 - m1 * m1)).sum()
    return 0.5 * (cross + diag)


def test_mc_layer_output_loss_vs_exact_expectation():
    out, inp = 5, 7
    mu, sigma = _posterior(out, inp, seed=23, rel_sigma=0.15)
    a, g_full = _spd(inp, 24), _spd(out, 25)
    g_diag = torch.diag(g_full)
    zs = []
    for bits in (2, 3, 4):
        grids = minmax_grids(mu, bits, ratio=0.8)
        m1, m2 = _error_moments(mu, sigma, grids)
        for g in (g_full, g_diag):
            est = mc_layer_output_loss(mu, sigma, a, g, [_q(grids)], samples=256, seed=bits)
            assert est.mean.shape == (1,)
            zs.append(float((est.mean[0] - _exact_layer_loss(m1, m2, a, g)) / est.se[0]))
    assert max(abs(z) for z in zs) < 3, zs


def test_mc_layer_output_loss_rejects_bad_factors():
    mu, sigma = _posterior(3, 4, seed=27)
    q = [lambda w: w]
    with pytest.raises(ValueError, match="A must be"):
        mc_layer_output_loss(mu, sigma, _spd(3, 0), _spd(3, 1), q)
    with pytest.raises(ValueError, match="G must be"):
        mc_layer_output_loss(mu, sigma, _spd(4, 0), _spd(4, 1), q)


# ---------------------------------------------------------------- logit KL (item 3)

def _linear_model(d_in: int, classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, classes)).double()


def _fisher_reference(model: nn.Module, x: torch.Tensor, m1, m2, temperature: float) -> float:
    """0.5 * sum_x E[delta^T F_x delta], delta = D x, F_x = softmax Jacobian / T (logit Fisher)."""
    lin = model[0]
    total = 0.0
    var = m2 - m1 * m1
    for xi in x:
        z = (lin.weight @ xi + lin.bias).detach()
        jac = torch.autograd.functional.jacobian(lambda u: torch.softmax(u / temperature, -1), z)
        fisher = jac / temperature  # (C, C) = (diag p - p p^T) / T^2
        mean_delta = m1 @ xi
        total += float(mean_delta @ fisher @ mean_delta + (torch.diag(fisher)[:, None] * var * xi**2).sum())
    return 0.5 * total


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_mc_logit_kl_vs_fisher_quadratic_form(temperature):
    d_in, classes = 6, 4
    model = _linear_model(d_in, classes, seed=30)
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(24, d_in, generator=gen, dtype=F64)
    batches = [x[:10], x[10:]]
    mu = model[0].weight.detach().clone()
    sigma = 0.002 * torch.ones_like(mu)
    grids = [minmax_grids(mu, b) for b in (6, 8)]
    est = mc_logit_kl(model, batches, "0", mu, sigma, [_q(g) for g in grids], samples=256, seed=32,
                      temperature=temperature)
    for k, g in enumerate(grids):
        m1, m2 = _error_moments(mu, sigma, g)
        ref = _fisher_reference(model, x, m1, m2, temperature)
        # logit errors |D x| / T <= 0.5 * step * |x|_1 ~ 0.1 (6 bits), so the third-order Taylor
        # term is a few percent of the quadratic one; 5% covers it
        assert abs(float(est.mean[k]) - ref) < 3 * float(est.se[k]) + 0.05 * ref, (k, est.mean[k], ref)


def test_mc_logit_kl_deployed_vs_fisher_quadratic_form():
    # deployed: the student is Q(mu) for every draw, so the error w - Q(mu) has mean mu - Q(mu)
    # and variance sigma^2 (not the truncated-normal cell moments of quantised draws)
    d_in, classes = 6, 4
    model = _linear_model(d_in, classes, seed=40)
    x = torch.randn(24, d_in, generator=torch.Generator().manual_seed(41), dtype=F64)
    mu = model[0].weight.detach().clone()
    grids = [minmax_grids(mu, b) for b in (5, 7)]
    sigma = 0.3 * float(grids[0].scale.max()) * torch.ones_like(mu)
    est = mc_logit_kl(model, [x], "0", mu, sigma, [_q(g) for g in grids], samples=512, seed=42, deployed=True)
    for k, g in enumerate(grids):
        m1 = _q(g)(mu) - mu
        ref = _fisher_reference(model, x, m1, m1 * m1 + sigma * sigma, 1.0)
        assert abs(float(est.mean[k]) - ref) < 3 * float(est.se[k]) + 0.05 * ref, (k, est.mean[k], ref)
    # as sigma -> 0 it is the KL of deploying Q(mu): computed directly
    tiny = mc_logit_kl(model, [x], "0", mu, 1e-12 * torch.ones_like(mu), [_q(grids[0])], samples=4, seed=0,
                       deployed=True)
    with torch.no_grad():
        p = torch.log_softmax(model(x), -1)
        w = model[0].weight.clone()
        model[0].weight.copy_(_q(grids[0])(mu))
        q = torch.log_softmax(model(x), -1)
        model[0].weight.copy_(w)
    assert float(tiny.mean[0]) == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-6)


def test_mc_logit_kl_se_shrinks_as_inverse_sqrt_samples():
    model = _linear_model(5, 3, seed=33)
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(34), dtype=F64)
    mu = model[0].weight.detach().clone()
    sigma = 0.05 * torch.ones_like(mu)
    q = [_q(minmax_grids(mu, 3))]
    scaled = [float(mc_logit_kl(model, [x], "0", mu, sigma, q, samples=m, seed=35).se[0]) * math.sqrt(m)
              for m in (32, 128, 512)]
    assert max(scaled) / min(scaled) < 1.5, scaled


class _Dict(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, inputs, scale):
        return self.drop(self.fc(inputs)) * scale


def test_mc_logit_kl_restores_model_on_success_and_error():
    model = _Dict()  # float32, dropout: eval mode must be used inside
    model.train()
    model.fc.eval()  # mixed flags must come back as they were
    before = model.fc.weight.detach().clone()
    batches = [{"inputs": torch.randn(8, 4, generator=torch.Generator().manual_seed(36)),
                "scale": torch.ones(8, 1)}]
    mu = before.double()
    sigma = 0.01 * torch.ones_like(mu)
    q = _q(minmax_grids(mu, 4))
    a = mc_logit_kl(model, batches, "fc", mu, sigma, [q], samples=4, seed=0)
    b = mc_logit_kl(model, batches, "fc", mu, sigma, [q], samples=4, seed=0)
    assert torch.equal(a.mean, b.mean)  # deterministic: dropout was off
    assert torch.equal(model.fc.weight, before)
    assert model.training and model.drop.training and not model.fc.training

    calls = []

    def failing(w):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return q(w)

    with pytest.raises(RuntimeError, match="boom"):
        mc_logit_kl(model, batches, "fc", mu, sigma, [failing], samples=4)
    assert torch.equal(model.fc.weight, before)
    assert model.training and model.drop.training and not model.fc.training


def test_mc_logit_kl_rejects_bad_input():
    model = _linear_model(3, 2, seed=37)
    x = torch.randn(4, 3, dtype=F64)
    mu = model[0].weight.detach().clone()
    sigma = 0.01 * torch.ones_like(mu)
    q = [lambda w: w]
    with pytest.raises(ValueError, match="no module 'fc'"):
        mc_logit_kl(model, [x], "fc", mu, sigma, q)
    with pytest.raises(ValueError, match="must have the shape"):
        mc_logit_kl(model, [x], "0", mu.T, sigma.T, q)
    with pytest.raises(ValueError, match="temperature"):
        mc_logit_kl(model, [x], "0", mu, sigma, q, temperature=0.0)
    with pytest.raises(ValueError, match="batches is empty"):
        mc_logit_kl(model, [], "0", mu, sigma, q)


# ---------------------------------------------------------------- closed-form scale (item 4)

def test_rescale_to_closed_form_scales_by_data_ratio():
    v = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=F64)  # (P=2, Q=2)
    est = MCEstimate(mean=v.mean(0), se=v.std(0) / math.sqrt(2), samples=4, values=v)
    out = rescale_to_closed_form(est, n_data=1000, n_cal=10)
    assert torch.allclose(out.mean, 100 * est.mean) and torch.allclose(out.se, 100 * est.se)
    assert torch.allclose(out.difference(0, 1).se, 100 * est.difference(0, 1).se)
    assert torch.equal(rescale_to_closed_form(est, n_data=0, n_cal=10).mean, est.mean)
    with pytest.raises(ValueError, match="n_cal"):
        rescale_to_closed_form(est, n_data=10, n_cal=0)


def test_mc_logit_kl_language_model_sums_over_real_tokens_padding_ignored():
    """(B, T, V) logits: ``sum_x`` runs over every real token (the scale of the summed token
    Fisher); with sigma -> 0 and the deployed student it is the summed per-token KL of deploying
    Q(mu), computed on each sequence alone; more padding appended gives the same estimate."""
    from nets import TinyCausalLM, lm_batches, with_padding

    torch.manual_seed(0)
    model = TinyCausalLM().double().eval()
    batches = lm_batches([[3, 5, 2], [4, 1, 4]])
    mu = model.fc1.weight.detach().clone()
    quant = _q(minmax_grids(mu, 3))
    tiny = 1e-12 * torch.ones_like(mu)
    est = mc_logit_kl(model, batches, "fc1", mu, tiny, [quant], samples=4, seed=0, deployed=True, temperature=2.0)
    padded = mc_logit_kl(model, with_padding(batches, 3), "fc1", mu, tiny, [quant], samples=4, seed=0,
                         deployed=True, temperature=2.0)
    want = 0.0
    w = model.fc1.weight.detach().clone()
    with torch.no_grad():
        for b in batches:
            for i, n in enumerate(b["attention_mask"].sum(1).tolist()):
                ids = b["input_ids"][i:i + 1, :n]
                lp = torch.log_softmax(model(input_ids=ids)["logits"][0] / 2.0, -1)
                model.fc1.weight.copy_(quant(mu))
                lq = torch.log_softmax(model(input_ids=ids)["logits"][0] / 2.0, -1)
                model.fc1.weight.copy_(w)
                want += float((lp.exp() * (lp - lq)).sum())
    assert want > 0 and float(est.mean[0]) == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(padded.values, est.values, rtol=1e-12, atol=0)
    assert torch.equal(model.fc1.weight, w)
