"""LSQ / LSQ+: the hand-derived gradients against autograd and against LSQ's formula, the
learned grids against a brute-force scan of the same objective, and the method end to end."""

import pytest
import torch
from torch import nn

from bayesq.baselines.activations import input_stats
from bayesq.baselines.lsq import LSQConfig, _loss_and_grads, _row_of_group, lsq_grid, lsq_loss, nearest_rows
from bayesq.methods import Inputs, quantize_with


def _rows(seed: int, out: int = 4, d: int = 16, bits: int = 3):
    """Float64 weights, a correlated PSD metric, and one min/max grid per row (fp16 scales)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, d, generator=g, dtype=torch.float64)
    A = torch.randn(d, d, generator=g, dtype=torch.float64)
    H = A @ A.T / d
    q = 2**bits - 1
    lo, hi = W.min(1).values, W.max(1).values
    scale = ((hi - lo) / q).half().double()
    zero = torch.round(-lo / scale).clamp(0, q)
    groups = torch.arange(out)[:, None].expand(out, d).contiguous()
    return W, H, scale, zero, torch.full((out,), q), groups


def _row_cost(w, H, s, z, q) -> float:
    D = s * (torch.clamp(torch.round(w / s) + z, 0, q) - z) - w
    return float(D @ H @ D)


@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_grads_vs_autograd(seed):
    """Rows of the hand-derived gradients (times the gradient scale, which the fit applies per
    group) equal autograd through the straight-through grid, with weights inside, below and above
    the grid."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(3, 8, generator=g, dtype=torch.float64) * 2
    A = torch.randn(8, 8, generator=g, dtype=torch.float64)
    H = A @ A.T
    s = torch.rand(3, 8, generator=g, dtype=torch.float64) * 0.3 + 0.2
    z = torch.full((3, 8), 3.0, dtype=torch.float64)
    maxq = torch.full((3, 8), 7.0, dtype=torch.float64)
    gscale = torch.rand(3, 8, generator=g, dtype=torch.float64)
    v = W / s + z
    assert bool((v < 0).any()) and bool((v > 7).any())  # both ends of the grid are exercised
    sg, zg = s.clone().requires_grad_(), z.clone().requires_grad_()
    ref = lsq_loss(W, H, sg, zg, maxq, gscale)
    ref.backward()
    rows, ds, dz = _loss_and_grads(W[None], H[None], s[None], z[None], maxq[None])
    torch.testing.assert_close(rows.sum(), ref.detach())
    torch.testing.assert_close(ds[0] * gscale, sg.grad)
    torch.testing.assert_close(dz[0] * gscale, zg.grad)


def test_scale_gradient_is_lsq_formula():
    """d w_hat / d s of LSQ's paper (eq. 3): round(x) - x inside, -Q_n / Q_p at the ends (here -z
    and Q_p - z), read off with H = I and D's gradient fixed by one weight per row."""
    W = torch.tensor([[-2.0, 0.26, 0.74, 3.0]], dtype=torch.float64)
    s = torch.full_like(W, 0.5)
    z = torch.full_like(W, 2.0)
    maxq = torch.full_like(W, 7.0)
    _, ds, _ = _loss_and_grads(W[None], torch.eye(4, dtype=torch.float64)[None], s[None], z[None], maxq[None])
    x = W / s  # -4 (below: -z), 0.52 (inside), 1.48 (inside), 6 (above: 7 - 2 = 5 = Q_p - z)
    D = s * (torch.clamp(torch.round(x) + z, 0, 7) - z) - W
    want = 2 * D * torch.tensor([[-2.0, 1 - 0.52, 1 - 1.48, 5.0]], dtype=torch.float64)
    torch.testing.assert_close(ds[0], want)


@pytest.mark.parametrize("offset", [False, True])
def test_lsq_grid_vs_brute_force_scan(offset):
    """On correlated 4 x 16 layers (one group per row) each row's learned grid costs no more than
    its min/max start (the best iterate is kept per row), and on the median row it is within 25 %
    of the best scale (LSQ+: scale and zero-point) of a dense scan of the same objective; LSQ
    keeps the zero-points."""
    ratios = []
    for seed in range(6):
        W, H, scale, zero, maxq, groups = _rows(seed)
        s, z = lsq_grid(W, H, scale, zero, maxq, groups, offset=offset, iters=1000)
        q = int(maxq[0])
        if not offset:
            assert torch.equal(z, zero)
        for r in range(W.shape[0]):
            scan = torch.linspace(0.3, 1.5, 1201, dtype=torch.float64) * scale[r]
            zs = range(q + 1) if offset else [int(zero[r])]
            best = min(_row_cost(W[r], H, sv, zv, q) for sv in scan[:: 4 if offset else 1] for zv in zs)
            ours = _row_cost(W[r], H, s[r], z[r], q)
            assert ours <= _row_cost(W[r], H, scale[r], zero[r], q) * (1 + 1e-3)  # fp32 steps
            ratios.append(ours / best)
    assert sorted(ratios)[len(ratios) // 2] <= 1.25, ratios


def test_lsq_grid_dead_group_and_grouped_metric():
    """A scale of 0 (an all-zero group) stays 0; rows of two convolution groups with their own
    metrics learn the grids each group learns alone."""
    W, H, scale, zero, maxq, groups = _rows(3)
    scale = scale.clone()
    scale[3] = 0.0
    H2 = torch.stack([H, torch.eye(16, dtype=torch.float64)])
    s, z = lsq_grid(W, H2, scale, zero, maxq, groups, iters=200)
    first, _ = lsq_grid(W[:2], H, scale[:2], zero[:2], maxq[:2], groups[:2], iters=200)
    assert s[3] == 0 and z[3] == zero[3]
    torch.testing.assert_close(s[:2], first)


def test_row_of_group_only_when_no_group_straddles_rows():
    rows = torch.tensor([[0, 0, 1, 1], [2, 2, 3, 3]])
    assert _row_of_group(rows, 4).tolist() == [0, 0, 1, 1]
    straddle = torch.tensor([[0, 0, 0, 1], [1, 1, 2, 2]])
    assert _row_of_group(straddle, 3).tolist() == [0, 0, 0]


def test_nearest_rows_dead_scale_gives_zero_point():
    W = torch.tensor([[0.4, -0.4, 9.0]], dtype=torch.float64)
    scale = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    zero = torch.tensor([[1.0, 1.0, 2.0]], dtype=torch.float64)
    assert nearest_rows(W, None, scale, zero, torch.full((1, 3), 3)).tolist() == [[2, 0, 2]]


def test_lsq_config_rejects_bad_schedule():
    with pytest.raises(ValueError, match="lsq.iters must be at least 1"):
        LSQConfig(iters=0)
    with pytest.raises(ValueError, match="lsq needs lr > 0"):
        LSQConfig(lr=0.0)


@pytest.mark.parametrize("offset", [False, True])
def test_lsq_method_end_to_end_lowers_layer_error_vs_minmax_nearest(offset):
    """Through quantize_with on a small MLP at 3 bits: every Linear quantised, the budget met,
    scales learned (not all min/max), and each layer's output error tr(D H D^T) no larger than
    nearest rounding on the min/max grids of the same allocation."""
    from bayesq.baselines.gptq import LayerRounding, gptq_quantize
    from bayesq.config import Granularity

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    cal = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    cfg = LSQConfig(select=False, offset=offset, iters=300, progress=False)
    res = quantize_with(model, cfg, 3.0, Inputs(calibration=cal)).result
    assert res.average_bits <= 3.0 and not res.unquantized
    stats = input_stats(model, cal, abs_mean=False)
    near = gptq_quantize(model, stats, Granularity.GROUP, 3.0, cfg.quant,
                         rounding=LayerRounding("nearest", lambda st, out: st.H, nearest_rows))
    moved = 0
    for name, qw in res.weights.items():
        H = stats[name].H[0].double()
        W = model.get_submodule(name).weight.double()
        err = lambda q: float(((q - W) * ((q - W) @ H)).sum().detach())  # noqa: E731
        assert err(qw.dequantize().reshape(W.shape)) <= err(near.weights[name].dequantize().reshape(W.shape)) * 1.001
        mine = [b.affine_fields()[0] for b in qw.books.values()]
        theirs = [b.affine_fields()[0] for b in near.weights[name].books.values()]
        moved += sum(int((a != b).sum()) for a, b in zip(mine, theirs))
    assert moved > 0


def _pact_loss(W, H, s, z, maxq):
    """PACT's straight-through form (an independent reference): inside the grid ``w_hat`` is passed
    through as ``w`` itself, so only the clipped ends depend on the step."""
    v = torch.minimum(torch.clamp(W / s + z, min=0), maxq)
    D = s * (v - z) + (s * (torch.round(v) - v)).detach() - W
    return (D * (D @ H)).sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_pact_gradient_vs_autograd(seed):
    """PACT's step gradient (no gradient scale, no inside term) equals autograd through
    :func:`_pact_loss`, with weights inside, below and above the grid."""
    from bayesq.baselines.lsq import StepGradient

    g = torch.Generator().manual_seed(seed)
    W = torch.randn(3, 8, generator=g, dtype=torch.float64) * 2
    A = torch.randn(8, 8, generator=g, dtype=torch.float64)
    H = A @ A.T
    s = torch.rand(3, 8, generator=g, dtype=torch.float64) * 0.3 + 0.2
    z = torch.full((3, 8), 3.0, dtype=torch.float64)
    maxq = torch.full((3, 8), 7.0, dtype=torch.float64)
    v = W / s + z
    assert bool((v < 0).any()) and bool((v > 7).any()) and bool(((v > 0) & (v < 7)).any())
    sg = s.clone().requires_grad_()
    ref = _pact_loss(W, H, sg, z, maxq)
    ref.backward()
    rows, ds, _ = _loss_and_grads(W[None], H[None], s[None], z[None], maxq[None], False, StepGradient.PACT)
    torch.testing.assert_close(rows.sum(), ref.detach())
    torch.testing.assert_close(ds[0], sg.grad)
    assert bool((ds[0][(v > 0) & (v < 7)] == 0).all())


def test_pact_learns_clipping_where_it_pays():
    """On a row whose weights crowd at 0 with two outliers outside a grid set by the bulk, PACT's
    gradient (the clipped ends' error only) widens the step until the clipping no longer pays:
    its grid costs 0.61x the start on H = I (a dense scan's best is 0.60x). LSQ, whose gradient
    also sees the rounding inside, ends lower still, at a smaller step."""
    from bayesq.baselines.lsq import StepGradient

    g = torch.Generator().manual_seed(5)
    w = torch.cat([torch.randn(30, generator=g, dtype=torch.float64) * 0.1, torch.tensor([1.0, -1.0])])
    W, H = w[None], torch.eye(32, dtype=torch.float64)
    scale, zero, maxq = torch.tensor([0.2]).double(), torch.tensor([3.0]).double(), torch.tensor([7])  # [-0.6, 0.8]
    groups = torch.zeros(1, 32, dtype=torch.int64)
    s, z = lsq_grid(W, H, scale, zero, maxq, groups, iters=2000, gradient=StepGradient.PACT)
    start, pact = _row_cost(w, H, scale, zero, 7), _row_cost(w, H, s, z, 7)
    scan = min(_row_cost(w, H, sv, zero, 7) for sv in torch.linspace(0.1, 0.5, 401, dtype=torch.float64))
    s_lsq, _ = lsq_grid(W, H, scale, zero, maxq, groups, iters=2000)
    assert float(s) > 1.3 * float(scale) and pact < 0.65 * start and scan <= pact
    assert _row_cost(w, H, s_lsq, zero, 7) < pact and float(s_lsq) < float(s)


def test_pact_config_names_and_rejects():
    from bayesq.baselines.lsq import StepGradient

    pact = LSQConfig(gradient="pact")
    assert pact.method == "PACT" and pact.gradient is StepGradient.PACT and pact.lr == 0.01
    assert LSQConfig().lr == 0.2 and LSQConfig(gradient="pact", lr=0.5).lr == 0.5
    with pytest.raises(ValueError, match="lsq.gradient must be one of"):
        LSQConfig(gradient="qil")
    with pytest.raises(ValueError, match="PACT learns one clipping level"):
        LSQConfig(gradient="pact", offset=True)
