import numpy as np
import pytest
import torch
from torch import nn

from bayesq.baselines.blockwise import BlockwiseConfig, blockwise_quantize, weight_table
from bayesq.baselines.rtn import rtn_quantize
from bayesq.config import Granularity, QuantConfig
from bayesq.grids import grid_sq_error, grids_from_range


def _laplace_linear(d_out=8, d_in=128, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(d_in, d_out).double()
    with torch.no_grad():
        layer.weight.copy_(torch.distributions.Laplace(0.0, 0.05).sample((d_out, d_in)))
    return layer


def _kmeans_1d_optimum(x: np.ndarray, k: int) -> float:
    """Least sum of squared distances of sorted 1-D points to k centres: the exact dynamic programme
    over contiguous cells (optimal 1-D clusters are intervals)."""
    x = np.sort(x)
    n = len(x)
    s1, s2 = np.concatenate([[0.0], np.cumsum(x)]), np.concatenate([[0.0], np.cumsum(x * x)])

    def cell(j, i):  # cost of x[j:i] about its mean, vectorised over j
        m = i - j
        return s2[i] - s2[j] - (s1[i] - s1[j]) ** 2 / m

    best = np.array([cell(0, i) if i else 0.0 for i in range(n + 1)])  # one cell
    for _ in range(k - 1):
        new = best.copy()
        for i in range(2, n + 1):
            j = np.arange(1, i)
            new[i] = min(best[i], float((best[j] + cell(j, i)).min()))
        best = new
    return float(best[n])


def test_weight_table_uniform_vs_dense_scan_of_the_clipping_ratio():
    layer = _laplace_linear()
    cfg = QuantConfig(bits=(2, 3), group_size=64, unit_groups=1)
    table = weight_table({"fc": layer}, cfg, "uniform").layers[0]
    w = layer.weight.detach().reshape(-1, 64)  # (16, 64) groups, none padded
    ones = torch.ones_like(w)
    for j, bits in enumerate(cfg.bits):
        book = table.books[j]
        got = grid_sq_error(w, ones, book)
        rhos = torch.linspace(0.2, 1.0, 2001, dtype=torch.float64)
        scan = torch.stack([grid_sq_error(w, ones, grids_from_range(r * w.min(1).values, r * w.max(1).values, bits))
                            for r in rhos])  # (R, G)
        rtn = scan[-1]
        assert bool((got <= rtn + 1e-15).all())  # never worse than RTN's min/max range
        assert float(got.sum()) < 0.9 * float(rtn.sum())  # clipping pays on heavy tails
        assert float((got / scan.min(0).values).median()) < 1.01
        assert float((got / scan.min(0).values).max()) < 1.05
        assert torch.allclose(table.unit_loss[:, j], 0.5 * got, rtol=1e-12, atol=0)  # entries: 0.5 * error


@pytest.mark.parametrize("bits", [1, 2])
def test_weight_table_lloyd_vs_exact_1d_kmeans(bits):
    layer = _laplace_linear(d_out=2, d_in=64, seed=bits)
    cfg = QuantConfig(bits=(bits,), group_size=64, unit_groups=2, lut_bits=32)  # one unit of 128 weights
    table = weight_table({"fc": layer}, cfg, "lloyd").layers[0]
    w = layer.weight.detach().reshape(-1)
    book = table.books[0]
    decoded = book.dequantize(book.quantize(w.reshape(2, 64))).reshape(-1)
    err = float((decoded - w).pow(2).sum())
    optimum = _kmeans_1d_optimum(w.numpy(), 2**bits)
    uniform = grids_from_range(w.min().reshape(1), w.max().reshape(1), bits, 32)
    start = float(grid_sq_error(w.reshape(1, -1), torch.ones(1, 128, dtype=torch.float64), uniform).sum())
    assert optimum <= err * (1 + 1e-12)  # the DP is a lower bound ...
    assert err <= 1.02 * optimum < start  # ... that Lloyd reaches; the min/max levels do not
    assert float(table.unit_loss[0, 0]) == pytest.approx(0.5 * err, rel=1e-12)


def test_blockwise_quantize_meets_the_budget_and_clipping_beats_rtn_per_layer():
    """At one bit-width (the same allocation), every layer's clipped grids beat RTN's min/max
    grids; Lloyd's tables (one per 4 groups) need not, but every weight decodes from its codes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32)).double()
    with torch.no_grad():
        for m in model[::2]:
            m.weight.copy_(torch.distributions.StudentT(3.0).sample(m.weight.shape) * 0.05)
    one = QuantConfig(bits=(3,), group_size=64, unit_groups=4)
    rtn = rtn_quantize(model, Granularity.GROUP, 3.5, one)
    for codebook in ("uniform", "lloyd"):
        res = blockwise_quantize(model, 3.5, one, codebook=codebook)
        assert res.average_bits <= 3.5
        for name, q in res.weights.items():
            w = model.get_submodule(name).weight
            assert torch.equal(res.model.get_submodule(name).weight, q.dequantize().to(w.dtype))
            err = float((q.dequantize() - w.detach()).pow(2).sum())
            assert codebook == "lloyd" or err < float((rtn.weights[name].dequantize() - w.detach()).pow(2).sum())
    mixed = blockwise_quantize(model, 3.5, QuantConfig(group_size=64, unit_groups=4), codebook="lloyd")
    assert 3.0 < mixed.average_bits <= 3.5 and len({b for bits in mixed.allocation.unit_bits.values() for b in bits}) > 1


@pytest.mark.parametrize("codebook", ["vq", "mulaw", "nope"])
def test_blockwise_config_rejects_other_codebooks(codebook):
    with pytest.raises(ValueError, match="BlockwiseConfig.codebook must be one of"):
        BlockwiseConfig(codebook)


def test_blockwise_quantize_names_nan_weights():
    model = nn.Sequential(nn.Linear(8, 4))
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        blockwise_quantize(model, 4.0)
