import numpy as np
import pytest
import scipy.linalg
import torch

from bayesq.curvature.lowrank import truncate


def _spd_with_spectrum(eig, seed):
    gen = torch.Generator().manual_seed(seed)
    d = len(eig)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    M = Q @ torch.diag(torch.tensor(eig, dtype=torch.float64)) @ Q.T
    return 0.5 * (M + M.T)


def _random_spd(d, seed):
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(d, 3 * d, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 3, d, dtype=torch.float64)[:, None]
    return X @ X.T / (3 * d)


def test_truncate_full_rank_is_exact_vs_solve_and_scipy():
    M = _random_spd(12, 0)
    f = truncate(M, rank=12)
    X = torch.randn(12, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert f.rank == 12 and f.delta == 0.0
    torch.testing.assert_close(f.dense(), M, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.matmul(X), M @ X, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.diag(), M.diagonal(), rtol=1e-10, atol=1e-12)
    eye = torch.eye(12, dtype=torch.float64)
    torch.testing.assert_close(f.inv_matmul(X, 0.3), torch.linalg.solve(M + 0.3 * eye, X), rtol=1e-9, atol=1e-12)
    ref = torch.from_numpy(np.real(scipy.linalg.fractional_matrix_power((M + 0.3 * eye).numpy(), -0.5))) @ X
    torch.testing.assert_close(f.inv_sqrt_matmul(X, 0.3), ref, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("r", [0, 3, 7])
def test_truncate_low_rank_vs_dense_eigendecomposition(r):
    M = _random_spd(10, 2)
    f = truncate(M, rank=r)
    ref_eig = torch.linalg.eigvalsh(M).flip(0)
    delta = float(ref_eig[r:].mean())
    assert f.rank == r and f.delta == pytest.approx(delta, rel=1e-12)
    expected = torch.cat([ref_eig[:r], torch.full((10 - r,), delta, dtype=torch.float64)]).sort().values
    torch.testing.assert_close(torch.linalg.eigvalsh(f.dense()), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.trace(f.dense()), torch.trace(M), rtol=1e-12, atol=0)
    gen = torch.Generator().manual_seed(3)
    X, x = torch.randn(10, 4, generator=gen, dtype=torch.float64), torch.randn(10, generator=gen, dtype=torch.float64)
    dense = f.dense() + 0.05 * torch.eye(10, dtype=torch.float64)
    torch.testing.assert_close(f.matvec(x), f.dense() @ x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.diag(), f.dense().diagonal(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.inv_matmul(X, 0.05), torch.linalg.solve(dense, X), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(f.inv_matmul(x, 0.05), torch.linalg.solve(dense, x), rtol=1e-9, atol=1e-12)
    inv_sqrt = torch.from_numpy(np.real(scipy.linalg.fractional_matrix_power(dense.numpy(), -0.5)))
    torch.testing.assert_close(f.inv_sqrt_matmul(X, 0.05), inv_sqrt @ X, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs, r",
    [
        ({"explained": 0.5}, 1),
        ({"explained": 0.8}, 2),
        ({"explained": 0.81}, 3),
        ({"explained": 0.95}, 4),
        ({"explained": 1.0}, 5),
        ({"explained": 0.95, "max_rank": 2}, 2),
        ({"explained": 0.95, "rank": 3}, 3),
        ({"rank": 4}, 4),
        ({}, 5),
        ({"max_rank": 1}, 1),
    ],
)
def test_truncate_explained_trace_rule_known_spectrum(kwargs, r):
    M = _spd_with_spectrum([5.0, 30.0, 50.0, 10.0, 5.0], seed=4)  # cumulative: 50, 80, 90, 95, 100
    f = truncate(M, **kwargs)
    assert f.rank == r
    discarded = [50.0, 30.0, 10.0, 5.0, 5.0][r:]
    assert f.delta == pytest.approx(sum(discarded) / len(discarded) if discarded else 0.0, rel=1e-10)
    torch.testing.assert_close(f.eig, torch.tensor([50.0, 30.0, 10.0, 5.0, 5.0][:r], dtype=torch.float64),
                               rtol=1e-10, atol=1e-10)


def test_truncate_psd_singular_matrix_needs_damping():
    M = _spd_with_spectrum([3.0, 1.0, 0.0, 0.0], seed=5)
    f = truncate(M, rank=2)
    assert f.delta == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="singular.*damping > 0"):
        f.inv_matmul(torch.ones(4, dtype=torch.float64))
    X = torch.ones(4, 2, dtype=torch.float64)
    torch.testing.assert_close(f.inv_sqrt_matmul(f.inv_sqrt_matmul(X, 1e-2), 1e-2), f.inv_matmul(X, 1e-2),
                               rtol=1e-10, atol=1e-12)


def test_truncate_bad_input_raises():
    M = _random_spd(4, 6)
    with pytest.raises(ValueError, match="square"):
        truncate(torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="not symmetric"):
        truncate(M + torch.triu(torch.ones(4, 4, dtype=torch.float64), 1))
    with pytest.raises(ValueError, match="not positive semi-definite"):
        truncate(-M)
    with pytest.raises(ValueError, match="NaN"):
        truncate(M * float("nan"))
    with pytest.raises(ValueError, match="explained"):
        truncate(M, explained=0.0)
    with pytest.raises(ValueError, match="rank"):
        truncate(M, rank=-1)
    with pytest.raises(ValueError, match="rows"):
        truncate(M, rank=2).matmul(torch.ones(5, dtype=torch.float64))
