import pytest
import torch

from bayesq.error_feedback import error_feedback_round


def _correlated_H(d, gen, n=None, damp=1e-3):
    """X X^T / n of strongly correlated inputs, plus a small ridge: (d, d) float64 SPD."""
    n = n or 4 * d
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64)
    X = mix @ torch.randn(d, n, generator=gen, dtype=torch.float64) + 0.5 * torch.randn(d, 1, generator=gen,
                                                                                       dtype=torch.float64)
    H = X @ X.T / n
    return H + damp * H.diagonal().mean() * torch.eye(d, dtype=torch.float64)


def _grid(W, bits):
    """Per-row asymmetric min-max grid, expanded to per-element (out, in) tensors."""
    maxq = 2 ** bits - 1
    lo, hi = W.min(1, keepdim=True).values.clamp(max=0), W.max(1, keepdim=True).values.clamp(min=0)
    scale = (hi - lo) / maxq  # (out, 1)
    zero = torch.round(-lo / scale)
    full = W.shape
    return scale.expand(full).clone(), zero.expand(full).clone(), torch.full(full, maxq, dtype=torch.int64)


def _rtn(W, scale, zero, maxq):
    return torch.minimum(torch.clamp(torch.round(W / scale + zero), min=0), maxq.double()).long()


def _cost(W, codes, scale, zero, H):
    D = scale * (codes - zero) - W
    return torch.trace(D @ H @ D.T)


def _reference(W, H, scale, zero, maxq, order):
    """After fixing each column, re-solve the exact least-squares optimum of all free columns."""
    d = W.shape[1]
    order = list(range(d)) if order is None else [int(i) for i in order]
    cur, qv = W.clone(), torch.zeros_like(W)
    codes = torch.zeros_like(W, dtype=torch.int64)
    for k, j in enumerate(order):
        c = _rtn(cur[:, j:j + 1], scale[:, j:j + 1], zero[:, j:j + 1], maxq[:, j:j + 1])[:, 0]
        codes[:, j] = c
        qv[:, j] = scale[:, j] * (c - zero[:, j])
        fixed, free = order[:k + 1], order[k + 1:]
        if free:
            DQ = qv[:, fixed] - W[:, fixed]  # (out, |Q|)
            DF = -torch.linalg.solve(H[free][:, free], H[free][:, fixed] @ DQ.T).T  # (out, |F|)
            cur[:, free] = W[:, free] + DF
    return codes


def test_error_feedback_identity_H_equals_round_to_nearest():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(6, 20, generator=gen, dtype=torch.float64)
    scale, zero, maxq = _grid(W, 3)
    got = error_feedback_round(W, torch.eye(20, dtype=torch.float64), scale, zero, maxq, block_size=7)
    assert torch.equal(got, _rtn(W, scale, zero, maxq))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("ordering", ["natural", "act", "random"])
def test_error_feedback_vs_exact_least_squares_reference(seed, ordering):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    H = _correlated_H(9, gen)
    scale, zero, maxq = _grid(W, 2)
    order = {"natural": None, "act": torch.argsort(H.diagonal(), descending=True),
             "random": torch.randperm(9, generator=gen)}[ordering]
    got = error_feedback_round(W, H, scale, zero, maxq, block_size=4, order=order)
    ref = _reference(W, H, scale, zero, maxq, order)
    assert torch.equal(got, ref)
    torch.testing.assert_close(_cost(W, got, scale, zero, H), _cost(W, ref, scale, zero, H), rtol=0, atol=1e-9)


def test_error_feedback_beats_round_to_nearest_on_average():
    gen = torch.Generator().manual_seed(7)
    ratios = []
    for _ in range(12):
        W = torch.randn(8, 24, generator=gen, dtype=torch.float64)
        H = _correlated_H(24, gen)
        scale, zero, maxq = _grid(W, 3)
        ef = _cost(W, error_feedback_round(W, H, scale, zero, maxq), scale, zero, H)
        rtn = _cost(W, _rtn(W, scale, zero, maxq), scale, zero, H)
        ratios.append(float(ef / rtn))
    ratios = torch.tensor(ratios)
    assert ratios.mean() < 0.8, ratios
    assert (ratios < 1).float().mean() >= 0.9, ratios


@pytest.mark.parametrize("seed", [0, 1])
def test_error_feedback_block_size_does_not_change_codes(seed):
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(8, 37, generator=gen, dtype=torch.float64)
    H = _correlated_H(37, gen)
    scale, zero, maxq = _grid(W, 3)
    order = torch.randperm(37, generator=gen)
    results = [error_feedback_round(W, H, scale, zero, maxq, block_size=b, order=order) for b in (1, 5, 16, 37, 128)]
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_error_feedback_codes_within_range_and_broadcast_grid():
    gen = torch.Generator().manual_seed(3)
    W = 3 * torch.randn(4, 12, generator=gen, dtype=torch.float64)
    H = _correlated_H(12, gen)
    scale, zero, maxq = _grid(W, 2)
    full = error_feedback_round(W, H, scale, zero, maxq)
    assert full.dtype == torch.int64 and full.min() >= 0 and full.max() <= 3
    row = error_feedback_round(W, H, scale[:, :1], zero[:, :1], torch.tensor(3))
    assert torch.equal(full, row)


def test_kfac_update_independent_of_G_vs_kronecker_solve():
    """The optimal free-column update under tr(G D A D^T) does not depend on G (explicit kron)."""
    gen = torch.Generator().manual_seed(11)
    n_out, d = 3, 6
    A, G = _correlated_H(d, gen), _correlated_H(n_out, gen)
    DQ = torch.randn(n_out, 2, generator=gen, dtype=torch.float64)  # errors of fixed columns 0, 1
    fixed, free = [0, 1], [2, 3, 4, 5]
    P = torch.kron(G, A)  # precision of row-major vec(D)
    idx_f = torch.tensor([o * d + i for o in range(n_out) for i in free])
    idx_q = torch.tensor([o * d + i for o in range(n_out) for i in fixed])
    dq = DQ.reshape(-1)  # row-major vec of (out, |Q|)
    df = -torch.linalg.solve(P[idx_f][:, idx_f], P[idx_f][:, idx_q] @ dq)
    via_A = -torch.linalg.solve(A[free][:, free], A[free][:, fixed] @ DQ.T).T  # (out, |F|)
    torch.testing.assert_close(df.reshape(n_out, len(free)), via_A, rtol=1e-10, atol=1e-12)


def test_error_feedback_bad_input_raises():
    W = torch.randn(3, 4, dtype=torch.float64)
    scale, zero, maxq = _grid(W, 2)
    eye = torch.eye(4, dtype=torch.float64)
    indefinite = eye.clone()
    indefinite[0, 0] = -1.0
    with pytest.raises(ValueError, match="not positive definite.*damping"):
        error_feedback_round(W, indefinite, scale, zero, maxq)
    with pytest.raises(ValueError, match="not positive definite"):
        error_feedback_round(W, torch.zeros(4, 4, dtype=torch.float64), scale, zero, maxq)
    with pytest.raises(ValueError, match="expected \\(4, 4\\)"):
        error_feedback_round(W, torch.eye(5, dtype=torch.float64), scale, zero, maxq)
    with pytest.raises(ValueError, match="not symmetric"):
        error_feedback_round(W, eye + torch.triu(torch.ones(4, 4, dtype=torch.float64), 1), scale, zero, maxq)
    with pytest.raises(ValueError, match="NaN"):
        error_feedback_round(W.clone().fill_(float("nan")), eye, scale, zero, maxq)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        error_feedback_round(W, eye, torch.zeros_like(scale), zero, maxq)
    with pytest.raises(ValueError, match="maxq must be an integer"):
        error_feedback_round(W, eye, scale, zero, maxq.double())
    with pytest.raises(ValueError, match="not broadcastable"):
        error_feedback_round(W, eye, scale[:2], zero, maxq)
    with pytest.raises(ValueError, match="permutation of range\\(4\\)"):
        error_feedback_round(W, eye, scale, zero, maxq, order=torch.tensor([0, 1, 1, 3]))
    with pytest.raises(ValueError, match="block_size"):
        error_feedback_round(W, eye, scale, zero, maxq, block_size=0)
