"""Scale refit for fixed codes vs the exact least-squares solution (bayesq/refit.py)."""

import pytest
import torch

from bayesq.refit import layer_cost, metric_apply, refit_scales, row_block_solve

F64 = torch.float64


def _problem(seed, out=6, d=40, group_size=32, conv_groups=1):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, d, generator=g, dtype=F64)
    Hs = []
    for _ in range(conv_groups):
        A = torch.randn(d, d, generator=g, dtype=F64)
        Hs.append(A @ A.T / d + 0.1 * torch.eye(d, dtype=F64))
    H = torch.stack(Hs) if conv_groups > 1 else Hs[0]
    group = torch.arange(out * d).reshape(out, d) // group_size  # groups straddle rows
    n = int(group.max()) + 1
    scale = torch.full((n,), 0.5, dtype=F64)
    u = torch.round(W / 0.5).clamp(-2, 1)  # 2-bit codes minus zero-point
    return W, u, group, scale, H


def _exact(W, u, group, n, H, keep=None):
    """argmin_a sum_r (a[g] u - w)_r^T H_r (a[g] u - w)_r by one dense solve; groups whose u is
    all zero (J does not depend on them) take ``keep``'s value."""
    X = torch.zeros(W.numel(), n, dtype=F64)
    X[torch.arange(W.numel()), group.reshape(-1)] = u.reshape(-1)
    Hs = H if H.dim() == 3 else H.unsqueeze(0)
    per = W.shape[0] // Hs.shape[0]
    K = torch.block_diag(*[Hs[r // per] for r in range(W.shape[0])])
    live = X.abs().sum(0) > 0
    out = keep.clone() if keep is not None else torch.zeros(n, dtype=F64)
    X = X[:, live]
    out[live] = torch.linalg.solve(X.T @ K @ X, X.T @ K @ W.reshape(-1))
    return out


@pytest.mark.parametrize("conv_groups", [1, 2])
def test_refit_scales_vs_exact_least_squares(conv_groups):
    W, u, group, scale, H = _problem(0, conv_groups=conv_groups)
    new, before, after = refit_scales(W, u, group, scale, H, iters=50, scale_bits=32)
    want = _exact(W, u, group, scale.shape[0], H)
    assert after == pytest.approx(layer_cost(want[group] * u, W, H), rel=1e-6)
    assert before == pytest.approx(layer_cost(scale[group] * u, W, H), rel=1e-12)
    torch.testing.assert_close(new, want.to(torch.float32).double(), rtol=1e-4, atol=1e-6)


def test_refit_scales_stored_fp16_never_worse():
    W, u, group, scale, H = _problem(1)
    new, before, after = refit_scales(W, u, group, scale, H)
    assert torch.equal(new, new.to(torch.float16).double())  # representable as stored
    assert after <= before and after == pytest.approx(layer_cost(new[group] * u, W, H), rel=1e-12)
    # already optimal scales (the fp16 rounding of the optimum cannot be beaten by rounding again)
    again, b2, a2 = refit_scales(W, u, group, new, H)
    assert a2 <= b2 == pytest.approx(after, rel=1e-12)


def test_metric_apply_vs_per_row_matmul():
    W, _, _, _, H = _problem(2, out=4, conv_groups=2)
    want = torch.cat([W[:2] @ H[0], W[2:] @ H[1]])
    torch.testing.assert_close(metric_apply(W, H), want)


def test_refit_scales_shape_mismatch_raises():
    W, u, group, scale, H = _problem(3)
    with pytest.raises(ValueError, match="one \\(out, d\\) shape"):
        refit_scales(W, u[:, :5], group, scale, H)


@pytest.mark.parametrize("conv_groups", [1, 2])
def test_row_block_solve_vs_exact_least_squares(conv_groups):
    """Rows holding whole groups: the exact per-row solve, a group with every code at the zero
    point keeping its scale; straddling groups get None (the iterative path)."""
    W, u, group, scale, H = _problem(3, out=4, d=48, group_size=16, conv_groups=conv_groups)
    u[1, 16:32] = 0.0  # row 1's second group: J does not depend on its scale
    want = _exact(W, u, group, scale.shape[0], H, keep=scale)
    got = row_block_solve(W, u, group, scale, H)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    new, before, after = refit_scales(W, u, group, scale, H, scale_bits=32)
    assert after == pytest.approx(layer_cost(want[group] * u, W, H), rel=1e-6) and after < before
    W2, u2, group2, scale2, H2 = _problem(4, d=40, group_size=32)
    assert row_block_solve(W2, u2, group2, scale2, H2) is None


@pytest.mark.parametrize("conv_groups", [1, 2])
def test_quadratic_cost_vs_layer_cost(conv_groups):
    """J from the normal equations (M, b, c) equals the direct layer cost for any scales."""
    from bayesq.refit import _normal_equations, _quadratic_cost

    W, u, _, _, H = _problem(3, out=6, d=48, conv_groups=conv_groups)
    group = torch.arange(6)[:, None] * 3 + torch.arange(48)[None] // 16  # three whole groups per row
    eq = _normal_equations(W, u, group, 18, H)
    assert eq is not None
    for seed in range(3):
        a = torch.rand(18, generator=torch.Generator().manual_seed(seed), dtype=F64) + 0.1
        assert _quadratic_cost(eq, a) == pytest.approx(layer_cost(a[group] * u, W, H), rel=1e-11)
    assert _normal_equations(W, u, torch.arange(6 * 48).reshape(6, 48) // 32, 9, H) is None  # groups straddle rows


def test_refit_rows_chunked_vs_refit_scales():
    """Normal equations built three rows at a time and concatenated: the scales and costs of
    :func:`refit_scales` on the whole layer, and None when a row's equations are singular."""
    from bayesq.refit import refit_rows, row_equations

    W, u, group, scale, H = _problem(5, out=10, d=48, group_size=16)  # three whole groups per row
    want = refit_scales(W, u, group, scale, H)
    eq = [row_equations(W[r:r + 3], u[r:r + 3], 3, H) for r in range(0, 10, 3)]
    got = refit_rows(tuple(torch.cat(x) for x in zip(*eq)), scale)
    assert torch.equal(got[0], want[0]) and got[1:] == pytest.approx(want[1:], rel=1e-12)
    assert got[2] < got[1]
    M, b, c = (torch.cat(x) for x in zip(*eq))
    M[2] = -M[2]  # not positive definite
    assert refit_rows((M, b, c), scale) is None


def test_row_equations_without_constant_same_scales():
    """constant=False (the encoder's call): the same scales, the same M and b, and both costs
    lower by exactly sum_r W_r^T H W_r (to float64 rounding)."""
    from bayesq.refit import refit_rows, row_equations

    W, u, _, scale, H = _problem(6, out=8, d=48, group_size=16)
    full, bare = row_equations(W, u, 3, H), row_equations(W, u, 3, H, constant=False)
    torch.testing.assert_close(bare[0], full[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(bare[1], full[1], rtol=1e-12, atol=1e-14)
    assert torch.equal(bare[2], torch.zeros(8, dtype=F64))
    want, got = refit_rows(full, scale[:24]), refit_rows(bare, scale[:24])
    assert torch.equal(got[0], want[0])
    shift = float((metric_apply(W, H) * W).sum())
    assert got[1] == pytest.approx(want[1] - shift, rel=1e-9) and got[2] == pytest.approx(want[2] - shift, rel=1e-9)
