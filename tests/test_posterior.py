import pytest
import torch

from bayesq.config import PosteriorConfig
from bayesq.posterior import fit_diagonal_posterior


def test_fit_diagonal_posterior_damping_and_clipping():
    f = {"l": torch.tensor([0.0, 1.0, 1e20], dtype=torch.float64)}
    w = {"l": torch.tensor([0.1, 0.2, 0.3])}
    post = fit_diagonal_posterior(f, 10, w, PosteriorConfig(prior="fixed", damping=0.5, var_min=1e-6, var_max=1.0, small_calibration=0))
    torch.testing.assert_close(post.variance["l"], torch.tensor([1.0, 1 / 1.5, 1e-6], dtype=torch.float64))
    torch.testing.assert_close(post.mean["l"], w["l"].double())


@pytest.mark.parametrize("n_data", [0, 40])
def test_fit_diagonal_posterior_consume_vs_copy(n_data):
    """consume=True: the same curvature and variances bit for bit, the caller's dict emptied."""
    g = torch.Generator().manual_seed(0)
    f = {"a": torch.randn(5, 7, generator=g, dtype=torch.float64), "b": torch.rand(3, generator=g, dtype=torch.float64)}
    w = {"a": torch.randn(5, 7, generator=g), "b": torch.randn(3, generator=g)}
    cfg = PosteriorConfig(n_data=n_data, small_calibration=0)
    copied = fit_diagonal_posterior({k: v.clone() for k, v in f.items()}, 4, w, cfg, indefinite=True)
    given = {k: v.clone() for k, v in f.items()}
    consumed = fit_diagonal_posterior(given, 4, w, cfg, indefinite=True, consume=True)
    assert given == {}
    for k in f:
        assert torch.equal(consumed.curvature[k], copied.curvature[k])
        assert torch.equal(consumed.variance[k], copied.variance[k])
        assert consumed.prior_precision[k] == copied.prior_precision[k]


def test_fit_diagonal_posterior_scales_to_data_size():
    f = {"l": torch.tensor([2.0], dtype=torch.float64)}
    post = fit_diagonal_posterior(f, 4, {"l": torch.zeros(1)}, PosteriorConfig(prior="fixed", damping=1.0, n_data=40, small_calibration=0))
    # precision = (40 / 4) * 2 + 1
    torch.testing.assert_close(post.precision("l"), torch.tensor([21.0], dtype=torch.float64))


def test_fit_diagonal_posterior_rejects_bad_fisher_and_empty_set():
    w = {"l": torch.zeros(1)}
    with pytest.raises(ValueError, match="layer 'l'"):
        fit_diagonal_posterior({"l": torch.tensor([float("nan")])}, 3, w, PosteriorConfig())
    with pytest.raises(ValueError, match="empty calibration set"):
        fit_diagonal_posterior({"l": torch.ones(1)}, 0, w, PosteriorConfig())


def test_posterior_sample_moments():
    var = torch.full((20000,), 0.25, dtype=torch.float64)
    from bayesq.posterior import Posterior

    post = Posterior({"l": torch.ones(20000, dtype=torch.float64)}, {"l": var}, 1)
    s = post.sample(torch.Generator().manual_seed(0))["l"]
    assert abs(s.mean().item() - 1.0) < 0.02 and abs(s.std().item() - 0.5) < 0.02


def test_fit_diagonal_posterior_small_calibration_rule():
    f = {"l": torch.linspace(0.0, 100.0, 101, dtype=torch.float64)}
    w = {"l": torch.zeros(101)}
    cfg = PosteriorConfig(prior="fixed", damping=1.0, small_calibration=50)
    big = fit_diagonal_posterior(f, 50, w, cfg)  # at the threshold: no rule
    small = fit_diagonal_posterior(f, 49, w, cfg)
    torch.testing.assert_close(big.precision("l"), f["l"] + 1.0)
    # damping x 5, then variances clipped to their own 1% / 99% quantiles
    raw = 1.0 / (f["l"] + 5.0)
    lo, hi = torch.quantile(raw, torch.tensor([0.01, 0.99], dtype=torch.float64))
    torch.testing.assert_close(small.variance["l"], raw.clamp(float(lo), float(hi)))
    assert small.variance["l"].max() < 1 / 5.0


def test_fit_diagonal_posterior_auto_damping_uses_layer_median():
    f = {"a": torch.full((5,), 1000.0, dtype=torch.float64), "b": torch.full((5,), 1.0, dtype=torch.float64)}
    w = {"a": torch.zeros(5), "b": torch.zeros(5)}
    post = fit_diagonal_posterior(f, 100, w, PosteriorConfig(prior="fixed", damping=0.5, auto_damping=True))
    torch.testing.assert_close(post.precision("a"), torch.full((5,), 1010.0, dtype=torch.float64))
    torch.testing.assert_close(post.precision("b"), torch.full((5,), 1.5, dtype=torch.float64))


def test_fit_diagonal_posterior_indefinite_curvature_gets_prior_variance():
    f = {"l": torch.tensor([-3.0, 2.0], dtype=torch.float64)}
    w = {"l": torch.zeros(2)}
    with pytest.raises(ValueError, match="negative"):
        fit_diagonal_posterior(f, 100, w, PosteriorConfig(prior="fixed", damping=0.5))
    post = fit_diagonal_posterior(f, 100, w, PosteriorConfig(prior="fixed", damping=0.5), indefinite=True)
    torch.testing.assert_close(post.precision("l"), torch.tensor([0.5, 2.5], dtype=torch.float64))


# ---- K-FAC / low-rank posteriors, back-off, curvature dispatch -----------------------------------

from torch import nn  # noqa: E402

from bayesq.config import Curvature
from bayesq.curvature.kfac import KFACFactors, damped, kfac_factors  # noqa: E402
from bayesq.posterior import fit_kfac_posterior, fit_posterior, spd_backoff  # noqa: E402


def _spd(d, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(d, d, generator=g, dtype=torch.float64)
    return m @ m.T / d + 0.01 * torch.eye(d, dtype=torch.float64)


def test_fit_kfac_posterior_variance_and_factors_vs_explicit_kronecker():
    A, G = _spd(5, 0), _spd(3, 1)
    w = {"l": torch.randn(3, 5, dtype=torch.float64)}
    cfg = PosteriorConfig(prior="fixed", damping=0.3, n_data=200, small_calibration=0)
    post = fit_kfac_posterior({"l": KFACFactors(A, G, 20)}, w, cfg)
    prec = 200 * torch.kron(G, A)  # row-major vec(W): G (x) A, scaled to n_data
    assert torch.allclose(post.variance["l"].reshape(-1), 1 / (prec.diagonal() + 0.3), rtol=1e-12)
    f = post.kfac["l"]
    want = damped(KFACFactors(A, 200 * G, 20), 0.3)  # factored Tikhonov damping of N G (x) A + lambda
    assert torch.allclose(f.A, want.A) and torch.allclose(f.G, want.G)
    full = torch.kron(f.G, f.A)
    # the factored damping adds lambda I plus cross terms; the undamped product is kept exactly
    assert torch.allclose(full - prec - 0.3 * torch.eye(15, dtype=torch.float64),
                          torch.kron(f.G - 200 * G, A) + torch.kron(200 * G, f.A - A), atol=1e-9)
    assert post.n_data == 200 and post.n_examples == 20


def test_fit_kfac_posterior_lowrank_truncates_factors():
    A = _spd(12, 2)
    G = _spd(4, 3)
    cfg = PosteriorConfig(prior="fixed", damping=0.1, rank=3, explained=1.0, small_calibration=0)
    post = fit_kfac_posterior({"l": KFACFactors(A, G, 50)}, {"l": torch.zeros(4, 12)}, cfg, lowrank=True)
    eig_a = torch.linalg.eigvalsh(A).flip(0)
    a_r = post.kfac["l"].A
    spec = torch.linalg.eigvalsh(a_r).flip(0)
    shift = spec[-1] - eig_a[3:].mean()  # the isotropic rest = mean of the dropped eigenvalues, plus damping
    assert torch.allclose(spec[:3] - shift, eig_a[:3], atol=1e-9)
    assert torch.allclose(spec[3:], spec[-1].expand(9), atol=1e-9)


def test_spd_backoff_multiplies_damping_by_three_until_positive_definite():
    A = torch.diag(torch.tensor([1.0, -0.05], dtype=torch.float64))  # indefinite by noise
    G = torch.eye(2, dtype=torch.float64)
    f, lam = spd_backoff(KFACFactors(A, G, 1), 1e-6)
    assert int(torch.linalg.cholesky_ex(f.A)[1]) == 0
    k = round(torch.log(torch.tensor(lam / 1e-6)).item() / torch.log(torch.tensor(3.0)).item())
    assert lam == pytest.approx(1e-6 * 3**k) and k >= 1
    prev = damped(KFACFactors(A, G, 1), lam / 3)  # one back-off fewer was not enough
    assert int(torch.linalg.cholesky_ex(prev.A)[1]) != 0 or int(torch.linalg.cholesky_ex(prev.G)[1]) != 0
    with pytest.raises(ValueError, match="stay singular after damping"):
        spd_backoff(KFACFactors(torch.diag(torch.tensor([1.0, -1e6], dtype=torch.float64)), G, 1), 1e-12)


@pytest.mark.parametrize("curvature", list(Curvature))
def test_fit_posterior_dispatch_vs_estimator_called_directly(curvature):
    from bayesq.curvature.fisher import empirical_fisher_diagonal, fisher_diagonal
    from bayesq.curvature.hutchinson import hutchinson_diagonal

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    batches = [torch.randn(5, 6, dtype=torch.float64) for _ in range(3)]
    layers = {"0": model[0], "2": model[2]}
    weights = {k: m.weight for k, m in layers.items()}
    cfg = PosteriorConfig(prior="fixed", curvature=curvature, damping=0.1, small_calibration=0, probes=4)
    post = fit_posterior(model, batches, layers, cfg, seed=3, progress=False)
    if curvature in (Curvature.KFAC, Curvature.LOWRANK):
        f = kfac_factors(model, batches, layers, decay=0.95, seed=3, progress=False)
        ref = fit_kfac_posterior(f, weights, cfg, lowrank=curvature == Curvature.LOWRANK)
        assert set(post.kfac) == {"0", "2"}
    else:
        if curvature == Curvature.FISHER:
            c, n = fisher_diagonal(model, batches, layers, seed=3, progress=False, share=cfg.curvature_share)
        elif curvature == Curvature.EMPIRICAL_FISHER:
            c, n = empirical_fisher_diagonal(model, batches, layers, progress=False, share=cfg.curvature_share)
        else:
            kind = "hessian" if curvature == Curvature.HUTCHINSON_HESSIAN else "ggn"
            c, n = hutchinson_diagonal(model, batches, layers, probes=4, curvature=kind, seed=3, progress=False)
        ref = fit_diagonal_posterior(c, n, weights, cfg, indefinite=curvature.value.startswith("hutchinson"))
        assert post.kfac is None
    for k in layers:
        assert torch.allclose(post.variance[k], ref.variance[k], rtol=1e-12)


def test_curvature_backends_cover_every_curvature_and_a_new_one_is_one_class(monkeypatch):
    """fit_posterior dispatches through CURVATURES only: a toy diagonal backend put in the
    registry is what it fits with, and its rows_in_pass flag decides whether on_rows is accepted."""
    from bayesq.posterior import CURVATURES, ROWS_IN_PASS, DiagonalCurvature

    assert set(CURVATURES) == set(Curvature)
    assert set(ROWS_IN_PASS) == {Curvature.FISHER, Curvature.EMPIRICAL_FISHER}

    class Constant(DiagonalCurvature):  # curvature 2 per input and weight
        def diagonal(self, model, calibration, layers, cfg, seed, progress, on_rows):
            n = sum(len(b) for b in calibration)
            return {k: torch.full_like(m.weight, 2.0 * n, dtype=torch.float64) for k, m in layers.items()}, n

    monkeypatch.setitem(CURVATURES, Curvature.FISHER, Constant())
    model = nn.Sequential(nn.Linear(4, 3)).double()
    batches = [torch.randn(5, 4, dtype=torch.float64) for _ in range(2)]
    cfg = PosteriorConfig(prior="fixed", damping=0.5, small_calibration=0)
    post = fit_posterior(model, batches, {"0": model[0]}, cfg, progress=False)
    torch.testing.assert_close(post.variance["0"], torch.full((3, 4), 1 / (20.0 + 0.5), dtype=torch.float64))
    with pytest.raises(ValueError, match="on_rows needs a Fisher curvature pass"):
        fit_posterior(model, batches, {"0": model[0]}, cfg, progress=False, on_rows=lambda name, rows: None)


# --- prior precision fitted by the Laplace marginal likelihood (MacKay) ---------------------------

from bayesq.posterior import LAMBDA_RANGE, Posterior, fit_prior_precision, log_evidence  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_prior_precision_vs_brute_force_evidence(seed):
    g = torch.Generator().manual_seed(seed)
    eig = torch.rand(200, generator=g, dtype=torch.float64).pow(4) * 10 ** (seed + 1)  # spread spectrum
    sq_norm = float(torch.rand(1, generator=g, dtype=torch.float64) * 50 + 1)
    lam = fit_prior_precision(eig, sq_norm)
    grid = torch.logspace(-6, 6, 20001, dtype=torch.float64).tolist()  # step 0.0006 decades
    best = max(grid, key=lambda x: log_evidence(eig, sq_norm, x))
    assert lam == pytest.approx(best, rel=2e-3)
    assert log_evidence(eig, sq_norm, lam) >= log_evidence(eig, sq_norm, best) - 1e-9
    # MacKay's fixed point: lambda |mu|^2 = gamma(lambda)
    assert lam * sq_norm == pytest.approx(float((eig / (eig + lam)).sum()), rel=1e-8)


def test_fit_prior_precision_leaves_no_tensor_in_a_reference_cycle():
    # scipy's brentq keeps the objective in a reference cycle; the float64 copy it closes over must
    # not wait for the garbage collector (it did: the whole model's copies at once, 0.9 GiB at GPT-2)
    import gc

    eig = torch.rand(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        assert LAMBDA_RANGE[0] < fit_prior_precision(eig, 5.0) < LAMBDA_RANGE[1]  # a bracketed root: brentq ran
        gc.collect()
        # its copies are eig-sized; other tensors in the garbage are another test's, freed meanwhile
        # (seen once in a full parallel run: 300 (1, 4) tensors of an earlier test in the same worker)
        cyclic = [o for o in gc.garbage if isinstance(o, torch.Tensor) and o.numel() == eig.numel()]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cyclic == []


def test_fit_prior_precision_degenerate_layers_hit_the_bracket():
    assert fit_prior_precision(torch.zeros(10, dtype=torch.float64), 3.0) == LAMBDA_RANGE[0]
    assert fit_prior_precision(torch.ones(10, dtype=torch.float64), 0.0) == LAMBDA_RANGE[1]


def test_fit_diagonal_posterior_fitted_prior_per_layer():
    # data curvature N/n * F per layer, lambda_l from that layer's spectrum and weights alone
    f = {"a": torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64), "b": torch.tensor([0.5, 0.5], dtype=torch.float64)}
    w = {"a": torch.tensor([0.3, -0.2, 0.1]), "b": torch.tensor([1.0, 2.0])}
    post = fit_diagonal_posterior(f, 10, w, PosteriorConfig(prior="fitted", n_data=20, small_calibration=0))
    for name in f:
        h = 2 * f[name]
        lam = fit_prior_precision(h, float(w[name].double().pow(2).sum()))
        assert post.prior_precision[name] == pytest.approx(lam, rel=1e-12)
        torch.testing.assert_close(post.data_precision(name), h)
        torch.testing.assert_close(post.precision(name), h + lam)


def test_prior_dominated_share_counts_variances_near_the_prior():
    # h <= lambda * 0.1 / 0.9  <=>  1 / (h + lambda) >= 0.9 / lambda
    h = torch.tensor([0.0, 0.1, 0.111, 0.2, 5.0], dtype=torch.float64)
    post = Posterior({"l": torch.zeros(5, dtype=torch.float64)}, {"l": 1 / (h + 1.0)}, 10,
                     curvature={"l": h}, prior_precision={"l": 1.0})
    var_ratio = post.variance["l"] * 1.0  # posterior variance / prior variance
    assert post.prior_dominated_share("l") == pytest.approx(float((var_ratio >= 0.9).double().mean()))
    assert post.prior_dominated_share("l") == pytest.approx(0.6)
    assert post.prior_dominated_share() == pytest.approx(0.6)
    with pytest.raises(ValueError, match="no prior precisions"):
        Posterior({"l": torch.zeros(1)}, {"l": torch.ones(1)}, 1).prior_dominated_share()


def test_fit_kfac_posterior_fitted_prior_uses_kronecker_spectrum():
    A, G = _spd(5, 4), _spd(3, 5)
    w = {"l": torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))}
    post = fit_kfac_posterior({"l": KFACFactors(A, G, 20)}, w,
                              PosteriorConfig(prior="fitted", n_data=200, small_calibration=0))
    eig = torch.linalg.eigvalsh(200 * torch.kron(G, A))  # the explicit Kronecker data curvature
    want = fit_prior_precision(eig, float(w["l"].pow(2).sum()))
    assert post.prior_precision["l"] == pytest.approx(want, rel=1e-8)
