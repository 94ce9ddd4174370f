import pytest
import torch

from bayesq.config import PosteriorConfig
from bayesq.posterior import fit_diagonal_posterior


def test_fit_diagonal_posterior_damping_and_clipping():
    f = {"l": torch.tensor([0.0, 1.0, 1e20], dtype=torch.float64)}
    w = {"l": torch.tensor([0.1, 0.2, 0.3])}
    post = fit_diagonal_posterior(f, 10, w, PosteriorConfig(damping=0.5, var_min=1e-6, var_max=1.0, small_calibration=0))
    torch.testing.assert_close(post.variance["l"], torch.tensor([1.0, 1 / 1.5, 1e-6], dtype=torch.float64))
    torch.testing.assert_close(post.mean["l"], w["l"].double())


def test_fit_diagonal_posterior_scales_to_data_size():
    f = {"l": torch.tensor([2.0], dtype=torch.float64)}
    post = fit_diagonal_posterior(f, 4, {"l": torch.zeros(1)}, PosteriorConfig(damping=1.0, n_data=40, small_calibration=0))
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
    cfg = PosteriorConfig(damping=1.0, small_calibration=50)
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
    post = fit_diagonal_posterior(f, 100, w, PosteriorConfig(damping=0.5, auto_damping=True))
    torch.testing.assert_close(post.precision("a"), torch.full((5,), 1010.0, dtype=torch.float64))
    torch.testing.assert_close(post.precision("b"), torch.full((5,), 1.5, dtype=torch.float64))


def test_fit_diagonal_posterior_indefinite_curvature_gets_prior_variance():
    f = {"l": torch.tensor([-3.0, 2.0], dtype=torch.float64)}
    w = {"l": torch.zeros(2)}
    with pytest.raises(ValueError, match="negative"):
        fit_diagonal_posterior(f, 100, w, PosteriorConfig(damping=0.5))
    post = fit_diagonal_posterior(f, 100, w, PosteriorConfig(damping=0.5), indefinite=True)
    torch.testing.assert_close(post.precision("l"), torch.tensor([0.5, 2.5], dtype=torch.float64))
