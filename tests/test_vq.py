"""Small vector quantisation (bayesq/vq.py): weighted k-means++ / Lloyd codebooks."""

import itertools

import pytest
import torch

from bayesq.levels import fit_lloyd_levels, levels_cost
from bayesq.storage import vq_cost_bits
from bayesq.vq import fit_vq, vq_assign, vq_expected_cost, vq_lloyd_step

F64 = torch.float64


def _data(seed: int, n: int, g: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, g, dtype=F64, generator=gen) * 0.05
    omega = torch.exp(torch.randn(n, g, dtype=F64, generator=gen))
    return x, omega, gen


def _brute_force_optimum(x: torch.Tensor, omega: torch.Tensor, k: int) -> float:
    """Least D over every assignment of the N vectors to K clusters (weighted centroids)."""
    best = float("inf")
    for labels in itertools.product(range(k), repeat=x.shape[0]):
        a = torch.tensor(labels)
        total = 0.0
        for c in range(k):
            sel = a == c
            if sel.any():
                centre = (omega[sel] * x[sel]).sum(0) / omega[sel].sum(0)
                total += float((omega[sel] * (x[sel] - centre) ** 2).sum())
        best = min(best, total)
    return best


def test_vq_assign_vs_brute_force_nearest():
    x, omega, gen = _data(0, 300, 4)
    codebook = torch.randn(32, 4, dtype=F64, generator=gen) * 0.05
    assign, cost = vq_assign(x, omega, codebook)
    d = (omega[:, None, :] * (codebook[None] - x[:, None, :]) ** 2).sum(-1)  # (N, K)
    assert torch.allclose(cost, d.min(1).values, rtol=1e-12)
    assert torch.equal(assign, d.argmin(1))


@pytest.mark.parametrize("g", [2, 4, 8])
def test_vq_lloyd_step_objective_non_increasing(g):
    x, omega, gen = _data(1, 400, g)
    codebook = x[torch.randperm(400, generator=gen)[:16]].clone()
    objs = []
    for _ in range(25):
        codebook, _, obj = vq_lloyd_step(x, omega, codebook)
        objs.append(obj)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(objs, objs[1:]))
    assert objs[-1] < objs[0]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_fit_vq_vs_brute_force_optimum_tiny(seed):
    # k-means finds local optima: every run is >= the brute-force optimum, and the best of
    # ten k-means++ seeds reaches it on these instances.
    x, omega, _ = _data(10 + seed, 6, 2)
    best = _brute_force_optimum(x, omega, 2)
    costs = [fit_vq(x, omega, 2, iters=50, rtol=0.0, seed=s, lut_bits=64)[2] for s in range(10)]
    assert min(costs) >= best * (1 - 1e-12)
    assert min(costs) == pytest.approx(best, rel=1e-12)


def test_fit_vq_well_separated_clusters_single_seed_exact():
    # two clusters 100x further apart than their spread: any k-means++ draw seeds both clusters
    # (D^2 mass of the far cluster > 1 - 1e-3), and Lloyd then stops at the optimum.
    x = torch.tensor([[0.0, 0.0], [0.01, 0.0], [0.0, 0.01], [1.0, 1.0], [1.01, 1.0], [1.0, 0.99]], dtype=F64)
    omega = torch.tensor([[1.0, 2.0], [0.5, 1.0], [3.0, 1.0], [1.0, 1.0], [2.0, 0.5], [1.0, 4.0]], dtype=F64)
    codebook, assign, cost = fit_vq(x, omega, 2, seed=0, lut_bits=64)
    assert cost == pytest.approx(_brute_force_optimum(x, omega, 2), rel=1e-12)
    assert assign[:3].unique().numel() == 1 and assign[3:].unique().numel() == 1 and assign[0] != assign[3]


def test_fit_vq_codebook_is_fp16_and_cost_consistent():
    x, omega, _ = _data(2, 500, 4)
    codebook, assign, cost = fit_vq(x, omega, 64, seed=5)
    assert codebook.shape == (64, 4) and codebook.dtype == F64
    assert torch.equal(codebook, codebook.half().double())
    a2, c2 = vq_assign(x, omega, codebook)
    assert torch.equal(assign, a2) and cost == pytest.approx(float(c2.sum()), rel=1e-12)
    again = fit_vq(x, omega, 64, seed=5)
    assert torch.equal(again[0], codebook)  # seeded


def test_fit_vq_beats_scalar_lloyd_on_correlated_gaussian():
    # payload 2 bits per weight both ways: VQ g=2 with K=16 vs a 4-level scalar LUT
    gen = torch.Generator().manual_seed(3)
    cov = torch.tensor([[1.0, 0.95], [0.95, 1.0]], dtype=F64)
    x = torch.randn(2000, 2, dtype=F64, generator=gen) @ torch.linalg.cholesky(cov).T
    omega = torch.ones_like(x)
    _, _, vq = fit_vq(x, omega, 16, iters=50, seed=0)
    flat = x.reshape(1, -1)  # (1, 4000): every coordinate shares one scalar codebook
    tiny = torch.full_like(flat, 1e-6)  # sigma -> 0: the expected cost is the plug-in error
    _, scalar = fit_lloyd_levels(flat, tiny, torch.ones_like(flat), 2, omega=torch.ones_like(flat), iters=50)
    assert 2000 * 4 == 4000 * 2  # payload bits: 2000 indices of log2(16) vs 4000 codes of 2 bits
    assert vq_cost_bits(2000, 2, 16) - 16 * 2 * 16 == 4000 * 2
    assert vq < 0.6 * scalar.item()


def test_vq_expected_cost_scalar_vs_closed_form_and_plug_in_bound():
    gen = torch.Generator().manual_seed(4)
    mu = torch.randn(8, 1, dtype=F64, generator=gen) * 0.05
    sigma = torch.exp(torch.randn(8, 1, dtype=F64, generator=gen)) * 0.01
    omega = 1 / sigma**2
    codebook = torch.tensor([[-0.06], [-0.01], [0.02], [0.07]], dtype=F64)
    mc = vq_expected_cost(mu, sigma, omega, codebook, samples=20000, seed=0)
    exact = levels_cost(mu.T, sigma.T, codebook.T).sum().item()  # whitened closed form (g = 1)
    assert mc == pytest.approx(exact, rel=0.01)  # MC standard error here is about 0.25%
    _, plug = vq_assign(mu, omega, codebook)
    bound = float(plug.sum() + (omega * sigma**2).sum())
    assert exact <= bound


def test_fit_vq_rejects_bad_input():
    x, omega, _ = _data(5, 20, 2)
    with pytest.raises(ValueError, match="exceeds 4096"):
        fit_vq(x, omega, 8192)
    with pytest.raises(ValueError, match="power of two"):
        fit_vq(x, omega, 12)
    with pytest.raises(ValueError, match=r"\(N, g\)"):
        fit_vq(x, omega[:, :1], 4)
    with pytest.raises(ValueError, match="non-negative"):
        fit_vq(x, -omega, 4)
