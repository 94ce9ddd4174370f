import itertools
from contextlib import nullcontext

import pytest
import torch

import bayesq.error_feedback as ef
from bayesq.error_feedback import (
    coordinate_descent, error_feedback_groups, error_feedback_round, feedback_gain, shared_factors,
)


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


def _problem(seed, out, d, bits):
    """Random (out, d) weights, a correlated (d, d) metric and their min-max grid."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(out, d, generator=gen, dtype=torch.float64)
    return (W, _correlated_H(d, gen), *_grid(W, bits))


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
    with pytest.raises(ValueError, match="W has NaN"):
        error_feedback_round(W.clone().fill_(float("nan")), eye, scale, zero, maxq)
    asym, nan_H = eye + torch.triu(torch.ones(4, 4, dtype=torch.float64), 1), eye.clone()
    nan_H[1, 2] = float("nan")
    for bad, what in ((asym, "not symmetric"), (nan_H, "H has NaN")):  # the grouped solver, in and out of the memo
        for scope in (nullcontext, shared_factors):
            with scope(), pytest.raises(ValueError, match=what):
                error_feedback_groups(W, bad, scale, zero, maxq)
    with pytest.raises(ValueError, match="scale must be finite and >= 0"):
        error_feedback_round(W, eye, -torch.ones_like(scale), zero, maxq)
    with pytest.raises(ValueError, match="maxq must be an integer"):
        error_feedback_round(W, eye, scale, zero, maxq.double())
    with pytest.raises(ValueError, match="not broadcastable"):
        error_feedback_round(W, eye, scale[:2], zero, maxq)
    with pytest.raises(ValueError, match="permutation of range\\(4\\)"):
        error_feedback_round(W, eye, scale, zero, maxq, order=torch.tensor([0, 1, 1, 3]))
    with pytest.raises(ValueError, match="block_size"):
        error_feedback_round(W, eye, scale, zero, maxq, block_size=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_error_feedback_groups_vs_loop_over_groups(act_order):
    """All groups solved at once give each group's codes of the one-group solver, and those match
    the exact least-squares reference (the groups' act-orders differ)."""
    gen = torch.Generator().manual_seed(8)
    groups, per, d = 5, 3, 6
    W = torch.randn(groups * per, d, generator=gen, dtype=torch.float64)
    H = torch.stack([_correlated_H(d, gen) for _ in range(groups)])
    scale, zero, maxq = _grid(W, 2)
    got = error_feedback_groups(W, H, scale, zero, maxq, act_order=act_order, block_size=4)
    orders = [torch.argsort(H[g].diagonal(), descending=True, stable=True) if act_order else None
              for g in range(groups)]
    assert len({tuple(o.tolist()) for o in orders}) > 1 if act_order else True
    for g in range(groups):
        r = slice(g * per, (g + 1) * per)
        one = error_feedback_round(W[r], H[g], scale[r], zero[r], maxq[r], order=orders[g])
        assert torch.equal(got[r], one)
        assert torch.equal(got[r], _reference(W[r], H[g], scale[r], zero[r], maxq[r], orders[g]))
    assert torch.equal(error_feedback_groups(W[:per], H[0], scale[:per], zero[:per], maxq[:per], act_order=act_order),
                       got[:per])


def test_error_feedback_groups_bad_input_raises():
    W = torch.randn(6, 4, dtype=torch.float64)
    scale, zero, maxq = _grid(W, 2)
    H = torch.eye(4, dtype=torch.float64).repeat(3, 1, 1)
    H[2, 1, 1] = -1.0
    with pytest.raises(ValueError, match="not positive definite in group 2.*damping"):
        error_feedback_groups(W, H, scale, zero, maxq)
    with pytest.raises(ValueError, match="6 output rows do not split into 4 groups"):
        error_feedback_groups(W, torch.eye(4, dtype=torch.float64).repeat(4, 1, 1), scale, zero, maxq)
    with pytest.raises(ValueError, match="expected \\(4, 4\\)"):
        error_feedback_groups(W, torch.eye(5, dtype=torch.float64).repeat(3, 1, 1), scale, zero, maxq)


@pytest.mark.parametrize("act_order", [False, True])
def test_feedback_gain_vs_schur_complement(act_order):
    gen = torch.Generator().manual_seed(3)
    H = torch.stack([_correlated_H(7, gen) for _ in range(2)])  # (groups, d, d)
    got = feedback_gain(H, act_order=act_order)
    for g in range(2):
        order = torch.argsort(H[g].diagonal(), descending=True, stable=True) if act_order else torch.arange(7)
        for k, j in enumerate(order.tolist()):
            F = order[k + 1:]
            schur = H[g, j, j] - (H[g, j, F] @ torch.linalg.solve(H[g][F][:, F], H[g, F, j]) if len(F) else 0.0)
            torch.testing.assert_close(got[g, j], schur / H[g, j, j], rtol=1e-10, atol=0)
    torch.testing.assert_close(feedback_gain(H[0], act_order=act_order), got[0], rtol=0, atol=0)
    assert float(got.max()) <= 1 + 1e-12 and float(got.min()) > 0


@pytest.mark.parametrize("act_order", [False, True])
def test_shared_factors_factor_each_metric_once_with_the_same_results(monkeypatch, act_order):
    """Inside shared_factors two roundings of one metric factor it once, and give the same codes
    bit for bit; an in-place change of the metric, another order or leaving the scope factors
    again."""
    W, H, scale, zero, maxq = _problem(11, 6, 9, 3)
    plain = error_feedback_groups(W, H, scale, zero, maxq, act_order=act_order)
    calls, checks = [], []
    real, check = ef._inverse_cholesky, ef._metric64
    monkeypatch.setattr(ef, "_inverse_cholesky", lambda M: calls.append(1) or real(M))
    monkeypatch.setattr(ef, "_metric64", lambda M, device: checks.append(1) or check(M, device))
    with shared_factors():
        with shared_factors():  # nested: the outer memo serves
            first = error_feedback_groups(W, H, scale, zero, maxq, act_order=act_order)
        codes = [first] + [error_feedback_groups(W, H, scale, zero, maxq, act_order=act_order) for _ in range(2)]
        assert len(calls) == 1 and len(checks) == 1  # the metric checked (finite, symmetric) once too
        error_feedback_groups(W, H, scale, zero, maxq, act_order=not act_order)
        assert len(calls) == 2
        H.mul_(2.0)  # in place: a new version, a new factor
        error_feedback_groups(W, H, scale, zero, maxq, act_order=act_order)
        assert len(calls) == 3
    for c in codes:
        assert torch.equal(c, plain)
    error_feedback_groups(W, H, scale, zero, maxq, act_order=act_order)
    error_feedback_groups(W, H, scale, zero, maxq, act_order=act_order)
    assert len(calls) == 5  # outside the scope: nothing memoised


@pytest.mark.parametrize("act_order", [False, True])
def test_feedback_gain_vs_inverse_factor_diagonal(act_order):
    """The gains from one Cholesky factor in the reversed order equal ``1 / (U_jj^2 H_jj)`` from
    the rounding's factor U of the permuted inverse (to float64 rounding)."""
    _, H, *_ = _problem(13, 4, 40, 3)
    perm, Hp = ef._solver_order(H.unsqueeze(0), act_order)
    U = ef._inverse_cholesky(Hp)[0]
    want = torch.empty(40, dtype=torch.float64)
    want[perm[0]] = 1.0 / (U.diagonal() ** 2 * Hp[0].diagonal())
    torch.testing.assert_close(feedback_gain(H, act_order=act_order), want, rtol=1e-12, atol=0)


def test_feedback_gain_predicts_error_feedback_cost_vs_simulation():
    """Fine grid, no clipping: the realised cost of error-feedback rounding over many rows is
    sum_j d_j step^2 / 12 per row (independent uniform rounding errors), d_j = r_j H_jj."""
    gen = torch.Generator().manual_seed(11)
    d, n_out, step = 12, 4000, 0.05
    H = _correlated_H(d, gen, damp=1e-2)
    W = torch.randn(n_out, d, generator=gen, dtype=torch.float64)
    scale = torch.full((n_out, d), step, dtype=torch.float64)
    zero = torch.full((n_out, d), 2.0**15, dtype=torch.float64)
    maxq = torch.full((n_out, d), 2**16 - 1, dtype=torch.int64)
    codes = error_feedback_groups(W, H, scale, zero, maxq, act_order=True)
    realised = float(_cost(W, codes, scale, zero, H)) / n_out
    predicted = float((feedback_gain(H, act_order=True) * H.diagonal()).sum()) * step**2 / 12
    nearest = float(H.diagonal().sum()) * step**2 / 12
    assert abs(realised / predicted - 1) < 0.05, (realised, predicted)
    assert predicted < 0.5 * nearest  # correlated inputs: feedback removes most of the cost


def test_coordinate_descent_vs_brute_force_optimum():
    """The exhaustive optimum over all 4^4 codes of each row is a fixed point of the sweeps, and
    from error-feedback codes the cost never rises and never drops below that optimum."""
    gen = torch.Generator().manual_seed(5)
    W = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    H = _correlated_H(4, gen)
    scale, zero, maxq = _grid(W, 2)
    codes = torch.empty(3, 4, dtype=torch.int64)
    for r in range(3):
        best = min(itertools.product(range(4), repeat=4),
                   key=lambda c: float(_cost(W[r:r + 1], torch.tensor([c]), scale[r:r + 1], zero[r:r + 1], H)))
        codes[r] = torch.tensor(best)
    assert torch.equal(coordinate_descent(W, H, scale, zero, maxq, codes, passes=3), codes)
    ef = error_feedback_round(W, H, scale, zero, maxq)
    polished = coordinate_descent(W, H, scale, zero, maxq, ef, passes=5)
    optimum = float(_cost(W, codes, scale, zero, H))
    assert optimum - 1e-12 <= float(_cost(W, polished, scale, zero, H)) <= float(_cost(W, ef, scale, zero, H)) + 1e-12


@pytest.mark.parametrize("seed", [0, 1])
def test_coordinate_descent_reaches_a_coordinate_optimum(seed):
    """After enough sweeps no single code change lowers the cost (checked by trying every level)."""
    W, H, scale, zero, maxq = _problem(seed, 6, 12, 3)
    codes = coordinate_descent(W, H, scale, zero, maxq, _rtn(W, scale, zero, maxq), passes=50)
    base = float(_cost(W, codes, scale, zero, H))
    for r, j, level in itertools.product(range(6), range(12), range(8)):
        trial = codes.clone()
        trial[r, j] = level
        assert float(_cost(W, trial, scale, zero, H)) >= base - 1e-9


def test_coordinate_descent_groups_vs_loop_over_groups():
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    H = torch.stack([_correlated_H(5, gen), _correlated_H(5, gen)])
    scale, zero, maxq = _grid(W, 2)
    start = _rtn(W, scale, zero, maxq)
    both = coordinate_descent(W, H, scale, zero, maxq, start, passes=2)
    for g in range(2):
        r = slice(4 * g, 4 * g + 4)
        assert torch.equal(both[r], coordinate_descent(W[r], H[g], scale[r], zero[r], maxq[r], start[r], passes=2))
    assert torch.equal(coordinate_descent(W, H, scale, zero, maxq, start, passes=0), start)


def _naive_sweeps(W, H, scale, zero, maxq, codes, passes):
    """Coordinate descent with D H recomputed from scratch for every column (no kept state)."""
    codes = codes.clone()
    for _ in range(passes):
        for j in range(W.shape[1]):
            D = scale * (codes - zero) - W  # (out, d)
            q = scale[:, j] * (codes[:, j] - zero[:, j]) - (D @ H)[:, j] / H[j, j]
            codes[:, j] = torch.minimum(torch.clamp(torch.round(q / scale[:, j] + zero[:, j]), min=0),
                                        maxq[:, j].double()).long()
    return codes


@pytest.mark.parametrize("passes", [1, 3])
def test_coordinate_descent_vs_naive_sweeps(passes):
    """Kept-current D H (lazy inside a block, one product per block, the last sweep's blocks
    behind it skipped) gives the codes of recomputing D H for every column."""
    W, H, scale, zero, maxq = _problem(7, 9, 23, 3)
    start = _rtn(W, scale, zero, maxq)
    ref = _naive_sweeps(W, H, scale, zero, maxq, start, passes)
    assert not torch.equal(ref, start)  # the sweeps move codes: the comparison has teeth
    for b in (1, 4, 23):
        assert torch.equal(coordinate_descent(W, H, scale, zero, maxq, start, passes=passes, block_size=b), ref)


def test_coordinate_descent_float32_vs_float64():
    """float32 D H (the encoder's CD_DTYPE) moves codes only at float32 near-ties: on 200 rows of
    64 columns almost every code equals float64's, the cost agrees to 1e-5, and float32 too
    lowers the cost of its start."""
    W, H, scale, zero, maxq = _problem(21, 200, 64, 3)
    start = _rtn(W, scale, zero, maxq)
    c64 = coordinate_descent(W, H, scale, zero, maxq, start, passes=2)
    c32 = coordinate_descent(W, H, scale, zero, maxq, start, passes=2, dtype=torch.float32)
    assert c32.dtype == torch.int64 and not torch.equal(c64, start)
    assert float((c32 != c64).double().mean()) < 1e-3
    cost = {k: float(_cost(W, c, scale, zero, H)) for k, c in (("start", start), ("64", c64), ("32", c32))}
    assert abs(cost["32"] / cost["64"] - 1) < 1e-5 and cost["32"] < 0.99 * cost["start"], cost


@pytest.mark.parametrize("seed", [0, 1])
def test_coordinate_descent_block_size_does_not_change_codes(seed):
    W, H, scale, zero, maxq = _problem(seed, 8, 37, 3)
    start = _rtn(W, scale, zero, maxq)
    ref = coordinate_descent(W, H, scale, zero, maxq, start, passes=3, block_size=37)
    for b in (1, 5, 16):
        assert torch.equal(coordinate_descent(W, H, scale, zero, maxq, start, passes=3, block_size=b), ref)


def test_zero_scale_groups_get_the_zero_point_code_in_every_rounding():
    """One rounding rule (codebook.rounding_divisor): nearest rounding, error feedback and the
    coordinate-descent polish give a zero-scale row (all its weights 0) its zero-point code, and
    agree with codebook.quantize on the other rows when H = I."""
    from bayesq.grids import UniformGrids, quantize

    gen = torch.Generator().manual_seed(4)
    W = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    W[2] = 0.0
    scale = torch.tensor([0.1, 0.2, 0.0, 0.15], dtype=torch.float64)
    zero = torch.tensor([3.0, 4.0, 2.0, 5.0], dtype=torch.float64)
    grids = UniformGrids(bits=3, scale=scale, zero=zero)
    want = quantize(W, grids)
    assert torch.equal(want[2], torch.full((6,), 2, dtype=torch.int64))
    s, z, m = scale[:, None].expand(4, 6), zero[:, None].expand(4, 6), torch.full((4, 6), 7, dtype=torch.int64)
    H = torch.eye(6, dtype=torch.float64)
    codes = error_feedback_groups(W, H, s, z, m)
    assert torch.equal(codes, want)
    assert torch.equal(coordinate_descent(W, H, s, z, m, codes, passes=2), want)


def test_lazy_metrics_make_on_read_keep_the_last_and_the_gains():
    """damped_metrics makes each layer's damped metric when read (the same values as
    damped_metric), returns one object for repeated reads of a layer, and makes the gains of
    every layer once per column order."""
    from bayesq.error_feedback import LazyMetrics, damped_metric, damped_metrics

    _, H1, *_ = _problem(11, 6, 9, 3)
    _, H2, *_ = _problem(12, 5, 7, 1)
    moments = {"a": H1.clone(), "b": H2.clone()}
    metrics = damped_metrics(moments, 0.01)
    assert list(metrics) == ["a", "b"] and len(metrics) == 2
    for name, m in moments.items():
        assert torch.equal(metrics[name], damped_metric(m, 0.01))
    made = []
    lazy = LazyMetrics(["a", "b"], lambda n: made.append(n) or damped_metric(moments[n]))
    first = lazy["a"]
    assert lazy["a"] is first and made == ["a"]  # the layer read last is kept
    lazy["b"]
    assert lazy["a"] is not first and made == ["a", "b", "a"]
    gains = lazy.gains(True)
    for name in ("a", "b"):
        torch.testing.assert_close(gains[name], feedback_gain(damped_metric(moments[name]), act_order=True),
                                   rtol=0, atol=0)
    count = len(made)
    assert lazy.gains(True) is gains and len(made) == count  # kept: no metric made again
    lazy.gains(False)
    assert len(made) == count + 2
    with pytest.raises(KeyError):
        lazy["c"]
    with pytest.raises(ValueError, match="damp"):
        damped_metrics(moments, 0.0)
