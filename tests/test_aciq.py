import math

import pytest
import torch
from scipy import integrate
from torch import nn

from bayesq.baselines.aciq import aciq_grids, aciq_quantize, laplace_clip_mse, laplace_clip_ratio
from bayesq.config import QuantConfig
from bayesq.grids import minmax_grids


@pytest.mark.parametrize("bits, paper", [(2, 2.83), (3, 3.89), (4, 5.03), (8, 9.89)])
def test_laplace_clip_ratio_vs_paper_table(bits, paper):
    assert laplace_clip_ratio(bits) == pytest.approx(paper, abs=0.01)


@pytest.mark.parametrize("alpha", [1.0, 3.0, 5.5])
def test_laplace_clip_mse_clipping_term_vs_numerical_integration(alpha):
    # E[(|x| - alpha)^2; |x| > alpha] for Laplace(0, 1), density exp(-|x|)/2
    clip, _ = integrate.quad(lambda x: (x - alpha) ** 2 * math.exp(-x), alpha, math.inf)
    assert laplace_clip_mse(alpha, 3) - alpha**2 / (3 * 4**3) == pytest.approx(clip, rel=1e-9)


def test_laplace_clip_ratio_vs_brute_force_grid():
    grid = torch.linspace(0.5, 12, 2301, dtype=torch.float64)  # step 0.005
    for bits in (2, 4):
        vals = torch.tensor([laplace_clip_mse(float(a), bits) for a in grid])
        coarse = float(grid[int(vals.argmin())])
        assert laplace_clip_ratio(bits) == pytest.approx(coarse, abs=0.006)


def test_aciq_grids_beat_minmax_on_laplace_weights_at_low_bits():
    torch.manual_seed(0)
    w = torch.distributions.Laplace(0.0, 1.0).sample((64, 512)).double()
    mask = torch.ones_like(w)
    for bits in (2, 3):
        a, m = aciq_grids(w, bits, mask), minmax_grids(w, bits)
        err_a = (a.dequantize(a.quantize(w)) - w).pow(2).mean()
        err_m = (m.dequantize(m.quantize(w)) - w).pow(2).mean()
        assert err_a < 0.8 * err_m
        assert bool((a.scale < m.scale).all())  # a clipped (narrower) range per row


def test_aciq_quantize_within_budget_and_rebuilt_from_codes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    res = aciq_quantize(model, 3.5, QuantConfig(group_size=16, unit_groups=2))
    assert res.average_bits <= 3.5
    for n, q in res.weights.items():
        assert torch.equal(res.model.get_submodule(n).weight, q.dequantize())
