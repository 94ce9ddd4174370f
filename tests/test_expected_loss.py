"""Loss tables: every codebook's closed-form entries vs sampling, exact costs, metrics."""

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from bayesq.blocks import LayerBlocks
from bayesq.config import Codebook, QuantConfig, Whitening
from bayesq.expected_loss import feedback_weights, layer_table, metric_weights, posterior_table, posterior_tables
from bayesq.grid_cost import grid_cost
from bayesq.grids import UniformGrids
from bayesq.levels import LevelTables, mulaw_levels
from bayesq.posterior import Posterior, input_moments

F64 = torch.float64


def _layer(seed=0, shape=(12, 40), heavy=False):
    """Means like trained weights; stds from 0.05 to 1.5 grid steps of a 3-bit group grid."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(shape, generator=g, dtype=F64) * 0.05
    if heavy:
        mu = mu * torch.distributions.StudentT(3.0).sample(shape).to(F64).abs().clamp(max=6)
    sigma = 0.004 * torch.exp(torch.randn(shape, generator=g, dtype=F64))
    return mu, sigma


CODEBOOKS = [c for c in Codebook if c != Codebook.VQ]


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_layer_table_vs_monte_carlo_of_its_own_codebooks(codebook):
    # Independent reference: draw w ~ N(mu, sigma^2), quantise with the table's stored codebook
    # (nearest level, through the book's own quantize/dequantize) and average the whitened
    # error per unit; the closed-form entry must be within 4 standard errors.
    mu, sigma = _layer(1, heavy=True)
    lb = LayerBlocks("l", tuple(mu.shape), 32, 4)  # 480 weights: 15 groups, 4 units (last short)
    cfg = QuantConfig(objective="draws", rounding="nearest", group_size=32, unit_groups=4, codebook=codebook, bits=(2, 3, 4))
    t = layer_table(lb, mu, sigma, cfg)
    gen = torch.Generator().manual_seed(7)
    m_, mask = lb.to_groups(mu.reshape(-1))
    s_, _ = lb.to_groups(sigma.reshape(-1))
    draws, k = 4000, 200  # k draws at a time: the book repeated k times, one copy per draw
    for j, book in enumerate(t.books):
        rep = book.take(torch.arange(lb.n_groups).repeat(k))
        per_unit = torch.zeros(draws, lb.n_units, dtype=F64)
        for d in range(0, draws, k):
            eps = torch.randn((k, *m_.shape), generator=gen, dtype=F64)
            w = (m_ + s_ * eps).reshape(-1, m_.shape[1])  # (k * G, g)
            q = rep.dequantize(rep.quantize(w)).reshape(k, *m_.shape)
            err = (0.5 * ((q - w.reshape(k, *m_.shape)) / s_) ** 2 * mask).sum(2)  # (k, G)
            per_unit[d:d + k] = torch.zeros(k, lb.n_units, dtype=F64).index_add_(1, lb.group_unit(), err)
        z = (per_unit.mean(0) - t.unit_loss[:, j]) / (per_unit.std(0) / math.sqrt(draws))
        assert z.abs().max() < 4, (codebook, t.bits[j], z)


def test_layer_table_costs_match_storage_formulas():
    mu, sigma = _layer(2)
    lb = LayerBlocks("l", tuple(mu.shape), 32, 4)  # units: 4, 4, 4, 3 groups; 128, 128, 128, 96 weights
    sizes = [(128, 4), (128, 4), (128, 4), (96, 3)]
    for codebook in CODEBOOKS:
        cfg = QuantConfig(objective="draws", rounding="nearest", group_size=32, unit_groups=4, codebook=codebook, bits=(2, 3, 4, 8))
        t = layer_table(lb, mu, sigma, cfg)
        for u, (n, g) in enumerate(sizes):
            for j, b in enumerate(cfg.bits):
                header = 2  # four candidates
                if b == 8 or codebook in (Codebook.UNIFORM, Codebook.UNIFORM_FIXED, Codebook.LLOYD_UNIFORM):
                    want = n * b + g * (16 + b) + header  # codes, fp16 scale and b-bit zero per group
                elif codebook == Codebook.LLOYD:
                    want = n * b + 2**b * 16 + header  # codes, one fp16 LUT per unit
                else:  # mu-law: codes, one fp16 scale per group
                    want = n * b + g * 16 + header
                assert int(t.unit_cost[u, j]) == want, (codebook, u, b)
        # candidates with more than 16 levels keep min/max uniform grids
        assert isinstance(t.books[-1], UniformGrids)


def test_lloyd_table_beats_or_matches_uniform_with_one_lut_per_group():
    # One LUT per 32-weight group vs a searched uniform grid per group (same cells to fill):
    # posterior-weighted Lloyd-Max may only do better on the whitened objective.
    mu, sigma = _layer(3, heavy=True)
    lb = LayerBlocks("l", tuple(mu.shape), 32, 1)
    lloyd = layer_table(lb, mu, sigma, QuantConfig(objective="draws", rounding="nearest", group_size=32, unit_groups=1, codebook=Codebook.LLOYD, bits=(2, 3)))
    unif = layer_table(lb, mu, sigma, QuantConfig(objective="draws", rounding="nearest", group_size=32, unit_groups=1, bits=(2, 3)))
    assert (lloyd.unit_loss.sum(0) <= unif.unit_loss.sum(0) * 1.001).all()


def test_mulaw_table_books_are_the_fixed_table_times_group_absmax():
    mu, sigma = _layer(4)
    lb = LayerBlocks("l", tuple(mu.shape), 32, 4)
    t = layer_table(lb, mu, sigma, QuantConfig(objective="draws", rounding="nearest", group_size=32, unit_groups=4, codebook=Codebook.MULAW, bits=(3,)))
    m_, _ = lb.to_groups(mu.reshape(-1))
    book = t.books[0]
    assert isinstance(book, LevelTables)
    assert torch.equal(book.levels[book.row], mulaw_levels(m_.abs().max(1).values, 3, 4.0))


def test_metric_weights_identity_is_plain_squared_error():
    mu, sigma = _layer(5)
    lb = LayerBlocks("l", tuple(mu.shape), 32, 4)
    post = Posterior({"l": mu}, {"l": sigma**2}, 10)
    cfg = QuantConfig(objective="draws", rounding="nearest", group_size=32, unit_groups=4, bits=(2, 3), whitening=Whitening.IDENTITY)
    t = posterior_table(post, [lb], cfg, progress=False).layers[0]
    assert torch.equal(metric_weights(post, "l", Whitening.IDENTITY), torch.ones_like(mu))
    m_, mask = lb.to_groups(mu.reshape(-1))
    s_, _ = lb.to_groups(sigma.reshape(-1))
    for j, g in enumerate(t.books):  # E[(Q(w) - w)^2] = sigma^2 * whitened closed form, per weight
        per_group = 0.5 * (s_ * s_ * grid_cost(m_, s_, g.lo, g.scale, g.levels) * mask).sum(1)
        want = torch.zeros(lb.n_units, dtype=F64).index_add_(0, lb.group_unit(), per_group)
        assert torch.allclose(t.unit_loss[:, j], want, rtol=1e-12)


def test_metric_weights_pca_is_input_second_moment_per_column():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.Flatten(), nn.Linear(3 * 4 * 4, 5))
    batches = [torch.randn(4, 2, 8, 8), torch.randn(3, 2, 8, 8)]
    layers = {"0": model[0], "2": model[2]}
    diag, n = input_moments(model, batches, layers)
    assert n == 7
    x = torch.cat(batches).double()
    cols = nn.functional.unfold(x, 3, padding=1, stride=2)  # (N, 2*9, L)
    assert torch.allclose(diag["0"], cols.pow(2).sum(2).mean(0), rtol=1e-6)
    h = model[1](model[0](x.float())).double()
    assert torch.allclose(diag["2"], h.pow(2).mean(0), rtol=1e-5)
    post = Posterior({k: m.weight.detach().double() for k, m in layers.items()},
                     {k: torch.ones_like(m.weight, dtype=F64) for k, m in layers.items()}, 7)
    omega = metric_weights(post, "0", Whitening.PCA, diag)
    assert torch.equal(omega.reshape(3, -1), diag["0"].expand(3, -1))
    with pytest.raises(ValueError, match="needs the layers' input moments"):
        metric_weights(post, "0", Whitening.PCA, None)


@pytest.mark.parametrize("dim", [2, 4])
def test_vq_table_vs_monte_carlo_of_stored_assignment(dim):
    # Entry = 0.5 E_w[sum omega (C_a - w)^2] for the assignment a made on the means (stored):
    # sampled with a fixed, the estimate must agree within 4 SE; re-assigning each draw to its
    # nearest codeword can only lower it. Costs: indices + one fp16 codebook + header.
    from bayesq.vq import VQBook

    mu, sigma = _layer(9, shape=(8, 40))
    lb = LayerBlocks("l", tuple(mu.shape), 32, 10)  # tensor unit: 10 groups, one unit
    cfg = QuantConfig(objective="draws", rounding="nearest", group_size=32, unit_groups=10, unit="tensor", codebook="vq", vq_dim=dim, bits=(2, 3, 4))
    t = layer_table(lb, mu, sigma, cfg)
    m_, mask = lb.to_groups(mu.reshape(-1))
    s_, _ = lb.to_groups(sigma.reshape(-1))
    gen = torch.Generator().manual_seed(2)
    for j, b in enumerate(cfg.bits):
        book = t.books[j]
        k = 2 ** (b * dim)
        if k > 4096:
            assert isinstance(book, UniformGrids)
            continue
        assert isinstance(book, VQBook) and book.codebook.shape == (k, dim)
        assert int(t.unit_cost[0, j]) == math.ceil(320 / dim) * b * dim + k * dim * 16 + 2
        codes = book.quantize(m_)
        fixed = book.dequantize(codes)  # (G, 32)
        draws = torch.stack([m_ + s_ * torch.randn(m_.shape, generator=gen, dtype=F64) for _ in range(2000)])
        loss_fixed = (0.5 * ((fixed - draws) / s_) ** 2 * mask).sum((1, 2))
        z = (loss_fixed.mean() - t.unit_loss[0, j]) / (loss_fixed.std() / math.sqrt(2000))
        assert abs(z) < 4, z
        nearest = torch.stack([book.dequantize(book.quantize(d)) for d in draws[:200]])
        loss_near = (0.5 * ((nearest - draws[:200]) / s_) ** 2 * mask).sum((1, 2))
        assert (loss_near <= loss_fixed[:200] + 1e-9).all()


# --- deployed objective ----------------------------------------------------------------------------

from bayesq.config import CostTerms, Objective
from bayesq.grids import minmax_grids


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_deployed_table_vs_weighted_error_of_its_books(codebook):
    # Each entry is 0.5 sum_{i in unit} omega_i (Q(mu_i) - mu_i)^2, recomputed here from the
    # stored book's own quantize / dequantize of the means.
    mu, _ = _layer(11, heavy=True)
    omega = torch.rand(mu.shape, generator=torch.Generator().manual_seed(12), dtype=F64) * 100
    lb = LayerBlocks("l", tuple(mu.shape), 32, 4)
    cfg = QuantConfig(rounding="nearest", group_size=32, unit_groups=4, codebook=codebook, bits=(2, 3, 4, 8))
    t = layer_table(lb, mu, None, cfg, omega)
    m_, mask = lb.to_groups(mu.reshape(-1))
    o_, _ = lb.to_groups(omega.reshape(-1))
    for j, book in enumerate(t.books):
        q = book.dequantize(book.quantize(m_))
        per_group = 0.5 * (o_ * (q - m_) ** 2 * mask).sum(1)
        want = torch.zeros(lb.n_units, dtype=F64).index_add_(0, lb.group_unit(), per_group)
        torch.testing.assert_close(t.unit_loss[:, j], want, rtol=1e-9, atol=1e-15)
        if codebook == Codebook.UNIFORM:  # searched per group: never worse than min/max RTN
            rtn = minmax_grids(m_, t.bits[j])
            rtn_cost = 0.5 * (o_ * (rtn.dequantize(rtn.quantize(m_)) - m_) ** 2 * mask).sum(1)
            assert (per_group <= rtn_cost * (1 + 1e-9) + 1e-15).all(), (codebook, t.bits[j])


def test_deployed_table_needs_metric_and_ignores_variances():
    mu, sigma = _layer(13)
    lb = LayerBlocks("l", tuple(mu.shape), 32, 4)
    cfg = QuantConfig(group_size=32, unit_groups=4, bits=(2, 3))
    with pytest.raises(ValueError, match="deployed objective needs the metric weights"):
        layer_table(lb, mu, sigma, cfg)
    omega = torch.ones_like(mu)
    a, b = layer_table(lb, mu, sigma, cfg, omega), layer_table(lb, mu, 10 * sigma, cfg, omega)
    assert torch.equal(a.unit_loss, b.unit_loss)


def test_metric_weights_deployed_cost_terms():
    mu, _ = _layer(14)
    h = torch.rand(mu.shape, generator=torch.Generator().manual_seed(15), dtype=F64)
    post = Posterior({"l": mu}, {"l": 1 / (h + 2.5)}, 10, curvature={"l": h}, prior_precision={"l": 2.5})
    data = metric_weights(post, "l", Whitening.POSTERIOR, objective=Objective.DEPLOYED, cost_terms=CostTerms.DATA)
    both = metric_weights(post, "l", Whitening.POSTERIOR, objective=Objective.DEPLOYED,
                          cost_terms=CostTerms.DATA_PRIOR)
    torch.testing.assert_close(data, h)
    torch.testing.assert_close(both, h + 2.5)
    assert metric_weights(post, "l", Whitening.POSTERIOR, objective=Objective.DRAWS) is None


def test_feedback_weights_vs_loop_over_conv_groups():
    gen = torch.Generator().manual_seed(16)
    omega = torch.rand(6, 2, 3, 3, generator=gen, dtype=F64)  # conv (out, in/groups, kh, kw), 3 groups
    gain = torch.rand(3, 18, generator=gen, dtype=F64)  # (groups, d_in)
    got = feedback_weights(omega, gain).reshape(6, 18)
    for o in range(6):
        torch.testing.assert_close(got[o], omega.reshape(6, 18)[o] * gain[o // 2], rtol=0, atol=0)
    torch.testing.assert_close(feedback_weights(omega, gain[0]).reshape(6, 18), omega.reshape(6, 18) * gain[0])
    with pytest.raises(ValueError, match="does not fit a weight"):
        feedback_weights(omega, torch.ones(4, 18, dtype=F64))


def _gain_case():
    """A layer's means, data curvature h, error-feedback gains, its posterior and blocks."""
    mu, _ = _layer(17)
    h = torch.rand(mu.shape, generator=torch.Generator().manual_seed(18), dtype=F64)
    gain = torch.rand(mu.shape[1], generator=torch.Generator().manual_seed(19), dtype=F64)
    post = Posterior({"l": mu}, {"l": 1 / (h + 1)}, 10, curvature={"l": h}, prior_precision={"l": 1.0})
    lb = LayerBlocks("l", tuple(mu.shape), 32, 4)
    return mu, h, gain, post, lb


def test_posterior_table_with_gains_is_the_table_of_the_scaled_metric():
    mu, h, gain, post, lb = _gain_case()
    cfg = QuantConfig(group_size=32, unit_groups=4, bits=(2, 3, 8), feedback_search=True)
    got = posterior_table(post, [lb], cfg, progress=False, gains={"l": gain}).layers[0]
    want = layer_table(lb, mu, None, cfg, h * gain)
    torch.testing.assert_close(got.unit_loss, want.unit_loss, rtol=0, atol=0)


def test_posterior_table_with_gains_searches_the_plain_metric_and_prices_the_scaled_one():
    mu, h, gain, post, lb = _gain_case()
    cfg = QuantConfig(group_size=32, unit_groups=4, bits=(2, 3, 8), feedback_search=False)
    got = posterior_table(post, [lb], cfg, progress=False, gains={"l": gain}).layers[0]
    plain = layer_table(lb, mu, None, cfg, h)
    w, _ = lb.to_groups(mu.reshape(-1))
    weight, _ = lb.to_groups((h * gain).reshape(-1))
    for j, (book, ref) in enumerate(zip(got.books, plain.books)):
        torch.testing.assert_close(book.scale, ref.scale, rtol=0, atol=0)  # searched without the gains
        torch.testing.assert_close(book.zero, ref.zero, rtol=0, atol=0)
        err = weight * (book.dequantize(book.quantize(w)) - w) ** 2  # (G, g): priced with them
        unit = lb.group_unit()  # (G,)
        want = torch.tensor([0.5 * float(err[unit == u].sum()) for u in range(int(unit.max()) + 1)], dtype=F64)
        torch.testing.assert_close(got.unit_loss[:, j], want, rtol=1e-12, atol=0)


def test_posterior_tables_vs_one_table_each():
    """The error-feedback table with and without the gains in its search, built together (their
    range searches shared), equals each built alone, a padded layer included; a configuration of
    another codebook is built alongside, unshared."""
    mu, h, gain, post, lb = _gain_case()
    mu2 = torch.randn(5, 40, generator=torch.Generator().manual_seed(3), dtype=F64)  # padded groups of 32
    h2 = torch.rand(mu2.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    post = Posterior({"l": mu, "p": mu2}, {"l": 1 / (h + 1), "p": 1 / (h2 + 1)}, 10, curvature={"l": h, "p": h2},
                     prior_precision={"l": 1.0, "p": 1.0})
    blocks = [lb, LayerBlocks("p", tuple(mu2.shape), 32, 2)]
    gains = {"l": gain, "p": torch.rand(40, generator=torch.Generator().manual_seed(5), dtype=F64)}
    base = QuantConfig(group_size=32, unit_groups=4, bits=(2, 3, 8))
    cfgs = [base, replace(base, feedback_search=False), replace(base, codebook=Codebook.LLOYD, rounding="nearest")]
    together = posterior_tables(post, blocks, cfgs, progress=False, gains=gains)
    for cfg, got in zip(cfgs, together):
        alone = posterior_table(post, blocks, cfg, progress=False, gains=gains)
        for g, a in zip(got.layers, alone.layers):
            assert torch.equal(g.unit_loss, a.unit_loss) and torch.equal(g.unit_cost, a.unit_cost)
            for gb, ab in zip(g.books, a.books):
                assert all(torch.equal(x, y) for x, y in zip(gb.affine_fields() or (), ab.affine_fields() or ()))
    assert not torch.equal(together[0].layers[0].unit_loss, together[1].layers[0].unit_loss)


def test_posterior_tables_free_each_layers_fits_without_the_collector():
    """A layer's fits (their layer-sized metric weights) go when the layer is done, by reference
    counting alone: no reference cycle keeps them until a garbage collection (on BERT-base that
    held 1.3 GiB through the encoding)."""
    import gc

    from bayesq.expected_loss import _DeployedFit

    mu, h, gain, post, lb = _gain_case()
    base = QuantConfig(group_size=32, unit_groups=4, bits=(2, 3))
    gc.collect()
    gc.disable()
    try:
        posterior_tables(post, [lb], [base, replace(base, feedback_search=False)], progress=False,
                         gains={"l": gain})
        alive = [o for o in gc.get_objects() if type(o) is _DeployedFit]
    finally:
        gc.enable()
    assert alive == []

@pytest.mark.parametrize("chunk", [1 << 18, 40])
def test_rtn_table_vs_hand_rounding_error(monkeypatch, chunk):
    """Min/max grids per group and ``sum_u omega (Q(w) - w)^2`` per unit, by hand per group, for
    a padded and an unpadded layer; the errors scored in row chunks (``chunk`` weights) or whole."""
    import bayesq.grids as codebook
    from bayesq.expected_loss import rtn_table

    monkeypatch.setattr(codebook, "_BATCH_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(0)
    cfg = QuantConfig(group_size=8, bits=(2, 3))
    blocks = [LayerBlocks("a", (6, 16), 8, 2), LayerBlocks("b", (5, 7), 8, 2)]  # b: the last group padded
    weights = {lb.name: torch.randn(lb.shape, generator=g) for lb in blocks}
    omega = {lb.name: torch.rand(lb.shape, generator=g, dtype=torch.float64) for lb in blocks}
    table = rtn_table(weights, blocks, cfg, element_weight=omega)
    for lb, t in zip(blocks, table.layers):
        w, om = weights[lb.name].double().reshape(-1), omega[lb.name].reshape(-1)
        for j, b in enumerate(cfg.bits):
            err = []
            for start in range(0, lb.numel, 8):
                x, o = w[start:start + 8], om[start:start + 8]
                scale = ((x.max() - x.min()) / (2**b - 1)).half().double()  # stored in fp16
                zero = torch.round(-x.min() / scale).clamp(0, 2**b - 1)
                q = scale * (torch.clamp(torch.round(x / scale) + zero, 0, 2**b - 1) - zero)
                err.append(float((o * (q - x) ** 2).sum()))
            want = [sum(err[u:u + 2]) for u in range(0, len(err), 2)]
            torch.testing.assert_close(t.unit_loss[:, j], torch.tensor(want, dtype=torch.float64),
                                       rtol=1e-12, atol=1e-15)
