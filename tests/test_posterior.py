import pytest
import torch

from bayesq.config import PosteriorConfig
from bayesq.posterior import fit_diagonal_posterior


def test_fit_diagonal_posterior_damping_and_clipping():
    f = {"l": torch.tensor([0.0, 1.0, 1e20], dtype=torch.float64)}
    w = {"l": torch.tensor([0.1, 0.2, 0.3])}
    post = fit_diagonal_posterior(f, 10, w, PosteriorConfig(damping=0.5, var_min=1e-6, var_max=1.0))
    torch.testing.assert_close(post.variance["l"], torch.tensor([1.0, 1 / 1.5, 1e-6], dtype=torch.float64))
    torch.testing.assert_close(post.mean["l"], w["l"].double())


def test_fit_diagonal_posterior_scales_to_data_size():
    f = {"l": torch.tensor([2.0], dtype=torch.float64)}
    post = fit_diagonal_posterior(f, 4, {"l": torch.zeros(1)}, PosteriorConfig(damping=1.0, n_data=40))
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
    from bayesq.posterior import DiagonalPosterior

    post = DiagonalPosterior({"l": torch.ones(20000, dtype=torch.float64)}, {"l": var}, 1)
    s = post.sample(torch.Generator().manual_seed(0))["l"]
    assert abs(s.mean().item() - 1.0) < 0.02 and abs(s.std().item() - 0.5) < 0.02
