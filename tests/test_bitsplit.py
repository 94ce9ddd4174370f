"""Bit-Split: the split and stitch against every integer, the weight-space start against a dense
scan, each plane's coordinate step against the full objective, the codes against the exact optimum
of the same objective (every symmetric code of every weight), and the method end to end."""

import itertools

import pytest
import torch
from torch import nn

from bayesq.baselines.activations import input_stats
from bayesq.baselines.bitsplit import (
    BitSplitConfig, bitsplit_rows, plane_sweep, split_planes, stitch, symmetric_grid,
)
from bayesq.methods import Inputs, quantize_with


def _layer(seed: int, out: int = 2, d: int = 6, bits: int = 3):
    """Float64 weights, a correlated PSD metric, per-row groups and Bit-Split's symmetric start."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, d, generator=g, dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    H = A @ A.T + 0.5 * torch.ones(d, d, dtype=torch.float64)  # strongly correlated columns
    groups = torch.arange(out)[:, None].expand(out, d).contiguous()
    maxq = torch.full((out,), 2.0**bits - 1, dtype=torch.float64)
    scale, zero = symmetric_grid(W, H, torch.ones(out, dtype=torch.float64), torch.zeros(out), maxq, groups)
    return W, H, groups, scale[groups], zero[groups], maxq[groups]


def _row_costs(W, H, scale, zero, codes) -> torch.Tensor:
    D = scale * (codes.double() - zero) - W
    return (D * (D @ H)).sum(-1)


def _refit_row(W, H, zero, codes) -> torch.Tensor:
    """Each row's cost at its least-squares scale for fixed codes (the scale Bit-Split stores)."""
    u = codes.double() - zero
    uh = u @ H
    a = (uh * W).sum(-1) / (uh * u).sum(-1)
    return _row_costs(W, H, a[:, None], zero, codes)


def test_split_stitch_round_trip_every_integer():
    """Every integer with |q| < 2^p splits into p ternary planes that stitch back to it."""
    for p in (1, 2, 3, 7):
        q = torch.arange(-(2**p) + 1, 2**p, dtype=torch.float64)
        t = split_planes(q, p)
        assert t.shape == (p, q.numel()) and bool((t.abs() <= 1).all())
        assert torch.equal(stitch(t), q)


def test_symmetric_grid_is_a_least_squares_fixed_point():
    """Per group, the start's scale is the least-squares scale of its own nearest codes (a fixed
    point of the alternation), and its weight-space error is no larger than at ``max |w| / h``."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(4, 32, generator=g, dtype=torch.float64) * torch.tensor([[1.0], [0.1], [3.0], [1.0]])
    groups = (torch.arange(4)[:, None] * 2 + torch.arange(32)[None] // 16)  # two groups of 16 per row
    maxq = torch.tensor([7.0, 7.0, 3.0, 3.0, 15.0, 15.0, 7.0, 7.0])
    scale, zero = symmetric_grid(W, None, torch.ones(8), torch.zeros(8), maxq, groups)
    assert torch.equal(zero, (maxq - 1) / 2)
    for k in range(8):
        w, h = W[groups == k], float(zero[k])
        q = torch.round(w / scale[k]).clamp(-h, h)
        torch.testing.assert_close(scale[k], (w * q).sum() / (q * q).sum())
        s0 = w.abs().max() / h
        assert float(((scale[k] * q - w) ** 2).sum()) <= float(((s0 * torch.round(w / s0) - w) ** 2).sum())


def test_symmetric_grid_keeps_an_all_zero_group():
    W = torch.zeros(1, 8, dtype=torch.float64)
    scale, _ = symmetric_grid(W, None, torch.zeros(1), torch.zeros(1), torch.tensor([7.0]), torch.zeros(1, 8).long())
    assert float(scale[0]) == 0.0


def test_plane_sweep_each_step_minimises_the_full_objective():
    """After one sweep, no single value of the plane can be changed to lower tr(D H D^T) (the last
    column's step is exact given all others), the cost never rose, and D, D H stay consistent."""
    W, H, _, scale, zero, maxq = _layer(5, out=3, d=8)
    q = torch.round(W / scale).clamp(-3, 3)
    t = split_planes(q, 2)[None].transpose(0, 1).contiguous()  # (planes, 1, rows, d)
    step = scale[None] * 2.0
    D = (scale * stitch(t[:, 0]) - W)[None]
    HD = D @ H
    before = float((D * HD).sum())
    plane_sweep(t[1], D, HD, H[None], step, torch.ones_like(D, dtype=torch.bool))
    after = float((D * HD).sum())
    assert after <= before + 1e-12
    torch.testing.assert_close(D[0], scale * stitch(t[:, 0]) - W)
    torch.testing.assert_close(HD, D @ H)
    j = W.shape[1] - 1
    for r in range(W.shape[0]):
        for v in (-1.0, 0.0, 1.0):
            t2 = t.clone()
            t2[1, 0, r, j] = v
            D2 = scale * stitch(t2[:, 0]) - W
            assert float((D2 * (D2 @ H)).sum()) >= after - 1e-9


def test_bitsplit_diagonal_metric_is_nearest_rounding():
    """With independent columns nearest rounding on the symmetric grid is optimal for any scale;
    the codes are exactly it."""
    W, _, groups, scale, zero, maxq = _layer(2, out=3, d=8)
    H = torch.diag(torch.rand(8, generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5)
    codes = bitsplit_rows(W, H, scale, zero, maxq, groups=groups)
    assert torch.equal(codes, (torch.round(W / scale) + zero).clamp(torch.zeros_like(maxq), maxq - 1).long())


def test_bitsplit_vs_exact_optimum_at_two_bits():
    """At 2 bits the one ternary plane is the whole code. On correlated 2 x 6 layers, each row's
    codes (at their refitted scale) cost no more than nearest rounding on the start; of the rows
    where that is not optimal (30 of 32 here), they reach the exact optimum over all 3^6 codes
    (each at its least-squares scale) within 5 % on at least a third, and their mean excess over
    it is less than half of nearest rounding's."""
    hard, solved, ours_excess, near_excess = 0, 0, 0.0, 0.0
    every = torch.tensor(list(itertools.product(range(-1, 2), repeat=6)), dtype=torch.float64)  # (729, 6)
    for seed in range(4, 20):
        W, H, groups, scale, zero, maxq = _layer(seed, bits=2)
        codes = bitsplit_rows(W, H, scale, zero, maxq, groups=groups)
        assert int(codes.min()) >= 0 and int(codes.max()) <= 2
        ours = _refit_row(W, H, zero, codes)
        near = _row_costs(W, H, scale, zero, (torch.round(W / scale) + zero).clamp(0, 2))
        uh = every @ H
        for r in range(W.shape[0]):
            a = (uh @ W[r]) / (uh * every).sum(-1).clamp(min=1e-12)
            D = a[:, None] * every - W[r]
            best = float(((D @ H) * D).sum(-1).min())
            assert float(ours[r]) <= float(near[r]) * (1 + 1e-6)
            if float(near[r]) > best * 1.001:
                hard += 1
                solved += float(ours[r]) <= best * 1.05
                ours_excess += float(ours[r]) / best - 1
                near_excess += float(near[r]) / best - 1
    assert hard >= 16 and solved >= hard / 3 and ours_excess < near_excess / 2, (hard, solved, ours_excess, near_excess)


def test_bitsplit_three_bits_never_worse_than_nearest():
    """At 3 bits (two planes) every row costs no more than nearest rounding on the start, and some
    cost less."""
    lower = 0
    for seed in range(4, 12):
        W, H, groups, scale, zero, maxq = _layer(seed, bits=3)
        codes = bitsplit_rows(W, H, scale, zero, maxq, groups=groups)
        assert int(codes.min()) >= 0 and int(codes.max()) <= 6
        ours = _refit_row(W, H, zero, codes)
        near = _row_costs(W, H, scale, zero, (torch.round(W / scale) + zero).clamp(0, 6))
        assert bool((ours <= near * (1 + 1e-6)).all())
        lower += int((ours < near * 0.99).sum())
    assert lower >= 3


def test_bitsplit_grouped_metric_mixed_widths_and_dead_group():
    """Rows of two convolution groups with their own metrics give the codes of each group alone;
    2-bit weights use one plane (codes 0..2), a scale of 0 gives the zero-point code."""
    W, H, groups, scale, zero, maxq = _layer(7, out=4, d=6)
    H2 = torch.stack([H, torch.eye(6, dtype=torch.float64)])
    scale, zero, maxq = scale.clone(), zero.clone(), maxq.clone()
    scale[3] = 0.0
    scale[2], zero[2], maxq[2] = scale[2] * 3, 1.0, 3.0
    both = bitsplit_rows(W, H2, scale, zero, maxq, groups=groups)
    first = bitsplit_rows(W[:2], H, scale[:2], zero[:2], maxq[:2], groups=groups[:2])
    assert torch.equal(both[:2], first)
    assert int(both[2].max()) <= 2
    assert torch.equal(both[3], zero[3].round().to(torch.int64))


def test_bitsplit_rejects_asymmetric_grid():
    W, H, groups, scale, zero, maxq = _layer(1)
    with pytest.raises(ValueError, match="symmetric grids"):
        bitsplit_rows(W, H, scale, zero + 1, maxq, groups=groups)


def test_bitsplit_config_rejects_bad_epochs():
    with pytest.raises(ValueError, match="bitsplit.epochs must be at least 1"):
        BitSplitConfig(epochs=0)


def test_bitsplit_method_end_to_end_lowers_layer_error_vs_symmetric_nearest():
    """Through quantize_with on a small MLP at 3 bits: every Linear quantised, the budget met, the
    codes symmetric (the top code unused), and each layer's reconstruction error tr(D H D^T) no
    larger than nearest rounding's on Bit-Split's symmetric start."""
    from bayesq.baselines.gptq import LayerRounding, gptq_quantize
    from bayesq.baselines.lsq import nearest_rows
    from bayesq.config import Granularity

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    cal = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cfg = BitSplitConfig(select=False, progress=False)
    res = quantize_with(model, cfg, 3.0, Inputs(calibration=cal)).result
    assert res.average_bits <= 3.0 and not res.unquantized
    stats = input_stats(model, cal, abs_mean=False)
    near = gptq_quantize(model, stats, Granularity.GROUP, 3.0, cfg.quant,
                         rounding=LayerRounding("nearest", lambda st, out: st.H, nearest_rows,
                                                grid_fit=symmetric_grid))
    lower = 0
    for name, qw in res.weights.items():
        assert bool((qw.indices().max(1).values < 2**qw.group_bits - 1).all())
        H = stats[name].H[0].double()
        W = model.get_submodule(name).weight.double()
        err = lambda q: float(((q - W) * ((q - W) @ H)).sum().detach())  # noqa: E731
        ours, theirs = err(qw.dequantize().reshape(W.shape)), err(near.weights[name].dequantize().reshape(W.shape))
        assert ours <= theirs * (1 + 1e-5)
        lower += ours < theirs * 0.99
    assert lower > 0
