"""bayesq.comparison against independent references: explicit sums, Python loops, the normal approximation."""

import math
import statistics

import pytest
import torch

from bayesq.comparison import (
    agreement_per_example, bootstrap_means, correct_per_example, cosine_per_example, feature_error_per_example,
    fidelity_summary, kl_per_example, mean_se, nearest_neighbours, neighbour_agreement, paired_difference,
    paired_differences, pooled_embeddings,
)


def _logits(n: int, c: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(n, c, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _softmax_row(z: list[float]) -> list[float]:
    m = max(z)
    e = [math.exp(v - m) for v in z]
    return [v / sum(e) for v in e]


def test_kl_per_example_vs_explicit_sum():
    fp, q = _logits(7, 5, 0), _logits(7, 5, 1)
    ref = []
    for zp, zq in zip(fp.tolist(), q.tolist()):
        p, r = _softmax_row(zp), _softmax_row(zq)
        ref.append(sum(pc * math.log(pc / rc) for pc, rc in zip(p, r)))
    kl = kl_per_example(fp, q)
    assert kl.dtype == torch.float64 and kl.shape == (7,)
    assert kl.tolist() == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_kl_per_example_identical_is_zero_and_shift_invariant():
    fp = _logits(6, 4, 2)
    assert kl_per_example(fp, fp).tolist() == [0.0] * 6
    q = _logits(6, 4, 3)
    assert torch.allclose(kl_per_example(fp + 7.0, q - 3.0), kl_per_example(fp, q), rtol=1e-12, atol=0)


def test_kl_per_example_extreme_logits_are_finite():
    fp = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]], dtype=torch.float32)
    q = torch.tensor([[0.0, 1000.0, -1000.0], [0.0, 0.0, 0.0]], dtype=torch.float32)
    kl = kl_per_example(fp, q)
    assert torch.isfinite(kl).all() and kl[0].item() == pytest.approx(1000.0, rel=1e-12) and kl[1] == 0.0


def test_kl_per_example_shape_mismatch_raises():
    with pytest.raises(ValueError, match="one shape"):
        kl_per_example(torch.zeros(3, 2), torch.zeros(3, 4))


def test_agreement_and_correct_vs_python_loop():
    fp, q = _logits(50, 3, 4), _logits(50, 3, 5)
    labels = torch.randint(0, 3, (50,), generator=torch.Generator().manual_seed(6))
    argmax = [max(range(3), key=row.__getitem__) for row in q.tolist()]
    fp_argmax = [max(range(3), key=row.__getitem__) for row in fp.tolist()]
    assert agreement_per_example(fp, q).tolist() == [a == b for a, b in zip(argmax, fp_argmax)]
    assert correct_per_example(q, labels).tolist() == [a == y for a, y in zip(argmax, labels.tolist())]


def test_mean_se_vs_statistics():
    x = _logits(30, 1, 7)[:, 0]
    mean, se = mean_se(x)
    assert mean == pytest.approx(statistics.fmean(x.tolist()), rel=1e-13)
    assert se == pytest.approx(statistics.stdev(x.tolist()) / math.sqrt(30), rel=1e-12)
    assert mean_se(torch.tensor([2.0])) == (2.0, 0.0)


def test_fidelity_summary_vs_hand_values():
    s = fidelity_summary(torch.tensor([0.0, 0.2, 0.4], dtype=torch.float64), torch.tensor([True, True, False]))
    assert s.kl_mean == pytest.approx(0.2, rel=1e-14) and s.kl_se == pytest.approx(0.2 / math.sqrt(3), rel=1e-12)
    assert s.agreement == pytest.approx(2 / 3) and s.n == 3
    assert set(s.as_dict()) == {"kl_mean", "kl_se", "agreement"}


def _loop_bootstrap(a: list[float], b: list[float], resamples: int, seed: int, scale: float):
    """Brute force: one randint draw per resample from the same generator, Python sums, sorted list,
    linear interpolation between order statistics."""
    n = len(a)
    d = [scale * (x - y) for x, y in zip(a, b)]
    g = torch.Generator().manual_seed(seed)
    means = []
    for _ in range(resamples):
        idx = torch.randint(0, n, (n,), generator=g).tolist()
        means.append(sum(d[i] for i in idx) / n)
    means.sort()

    def q(p: float) -> float:
        pos = p * (resamples - 1)
        i = math.floor(pos)
        return means[i] + (pos - i) * (means[min(i + 1, resamples - 1)] - means[i])

    return sum(d) / n, q(0.025), q(0.975)


def test_paired_difference_vs_python_loop_bootstrap_accuracy():
    # 0/1 correctness: every partial sum is an integer, so the bounds agree to the last bit
    g = torch.Generator().manual_seed(8)
    a = (torch.rand(11, generator=g) < 0.7).double()
    b = (torch.rand(11, generator=g) < 0.5).double()
    res = paired_difference(a, b, resamples=700, seed=3, scale=100.0)  # 700 > one block of resamples
    diff, lo, hi = _loop_bootstrap(a.tolist(), b.tolist(), 700, 3, 100.0)
    assert (res.diff, res.ci_low, res.ci_high) == (diff, lo, hi)
    assert res.n == 11 and res.resamples == 700 and res.seed == 3 and res.ci_low <= res.diff <= res.ci_high


def test_paired_difference_vs_python_loop_bootstrap_kl():
    a, b = kl_per_example(_logits(9, 4, 9), _logits(9, 4, 10)), kl_per_example(_logits(9, 4, 9), _logits(9, 4, 11))
    res = paired_difference(a, b, resamples=300, seed=5)
    ref = _loop_bootstrap(a.tolist(), b.tolist(), 300, 5, 1.0)
    assert (res.diff, res.ci_low, res.ci_high) == pytest.approx(ref, rel=1e-12, abs=1e-15)


def test_paired_difference_vs_normal_approximation():
    # correlated per-example values: the paired bootstrap interval ~ mean ± 1.96 sd(d) / sqrt(N)
    g = torch.Generator().manual_seed(12)
    base = torch.rand(5000, generator=g, dtype=torch.float64)
    a = base + 0.3 * torch.randn(5000, generator=g, dtype=torch.float64) + 0.01
    d = a - base
    mean, se = mean_se(d)
    res = paired_difference(a, base, resamples=4000, seed=0)
    half = 1.959964 * se
    assert res.diff == pytest.approx(mean, rel=1e-12)
    assert abs(res.ci_low - (mean - half)) < 0.1 * half and abs(res.ci_high - (mean + half)) < 0.1 * half


def test_paired_difference_identical_inputs_give_zero_interval():
    a = (torch.rand(40, generator=torch.Generator().manual_seed(13)) < 0.6).double()
    res = paired_difference(a, a.clone(), resamples=200, scale=100.0)
    assert (res.diff, res.ci_low, res.ci_high) == (0.0, 0.0, 0.0)


def test_paired_differences_columns_vs_one_at_a_time():
    g = torch.Generator().manual_seed(14)
    a, b = torch.rand(60, 3, generator=g, dtype=torch.float64), torch.rand(60, 3, generator=g, dtype=torch.float64)
    together = paired_differences(a, b, resamples=300, seed=2)
    for k in range(3):
        alone = paired_difference(a[:, k], b[:, k], resamples=300, seed=2)
        assert together[k].as_dict() == pytest.approx(alone.as_dict(), rel=1e-12)


def test_bootstrap_means_shape_and_constant_column():
    means = bootstrap_means(torch.full((20, 2), 3.0, dtype=torch.float64), resamples=10, seed=0)
    assert means.shape == (10, 2) and (means == 3.0).all()


def test_paired_difference_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        paired_difference(torch.zeros(5), torch.zeros(6))


def test_resolved_choice_vs_paired_difference_by_hand():
    from bayesq.comparison import resolved_choice

    g = torch.Generator().manual_seed(3)
    ref = torch.rand(400, generator=g, dtype=torch.float64)
    noise = 0.2 * torch.randn(400, generator=g, dtype=torch.float64)
    noise -= noise.mean()  # every mean difference is exactly its shift
    losses = {"ref": ref, "close": ref - 0.002 + noise, "better": ref - 0.08 + noise, "best": ref - 0.1 + noise,
              "worse": ref + 0.1 + noise}
    kept, margins = resolved_choice(losses, "ref")
    assert set(margins) == {"close", "better", "best", "worse"}
    for k, d in margins.items():
        want = paired_difference(losses[k], ref)
        assert (d.diff, d.ci_low, d.ci_high) == pytest.approx((want.diff, want.ci_low, want.ci_high), rel=1e-12)
    assert margins["close"].diff < 0 < margins["close"].ci_high  # lower on this draw, not resolved
    assert margins["best"].ci_high < 0 and margins["better"].ci_high < 0
    assert kept == "best"
    # the least mean alone would keep an unresolved candidate; the rule keeps the reference
    assert resolved_choice({"ref": ref, "close": losses["close"]}, "ref")[0] == "ref"


def test_resolved_choice_non_finite_and_degenerate_cases():
    from bayesq.comparison import resolved_choice

    a, b = torch.full((50,), 0.5, dtype=torch.float64), torch.full((50,), 0.1, dtype=torch.float64)
    nan = a.clone()
    nan[3] = float("nan")
    assert resolved_choice({"ref": a}, "ref") == ("ref", {})
    assert resolved_choice({"ref": a, "nan": nan - 1}, "ref")[0] == "ref"  # a NaN never wins
    assert resolved_choice({"ref": nan, "x": a, "y": b}, "ref")[0] == "y"  # a NaN reference gives way
    assert resolved_choice({"ref": a, "y": b}, "ref")[0] == "y"  # constant gap: a zero-width interval below 0
    assert resolved_choice({"ref": b, "y": b.clone()}, "ref")[0] == "ref"  # a tie keeps the reference
    with pytest.raises(ValueError, match="reference candidate 'minmax' is not among"):
        resolved_choice({"ref": a}, "minmax")


def _scored(losses: dict, batch: int, calls: list):
    """score(name, part) over batches of ``batch`` examples of ``losses``, logging each call."""
    def score(name, part):
        calls.append((name, part.start, part.stop))
        return losses[name][part.start * batch: part.stop * batch]
    return score


def test_sequential_choice_stops_only_for_candidates_resolved_worse():
    from bayesq.comparison import resolved_choice, sequential_choice

    g = torch.Generator().manual_seed(5)
    ref = torch.rand(800, generator=g, dtype=torch.float64)
    noise = 0.2 * torch.randn(800, generator=g, dtype=torch.float64)
    worse, better, close = ref + 0.1 + noise, ref - 0.1 + noise, ref - 0.002 + noise
    # one candidate resolved worse on the first 2 of 8 batches: the rest is never scored
    calls = []
    kept, margins, losses = sequential_choice(_scored({"ref": ref, "worse": worse}, 100, calls),
                                              ["ref", "worse"], "ref", 2, 8)
    assert kept == "ref" and calls == [("ref", 0, 2), ("worse", 0, 2)]
    assert margins["worse"].ci_low > 0 and margins["worse"].n == 200 and len(losses["worse"]) == 200
    # a better one goes on to every example and the decision is resolved_choice's on all of them
    cands = {"ref": ref, "worse": worse, "better": better, "close": close}
    calls = []
    kept, margins, losses = sequential_choice(_scored(cands, 100, calls), list(cands), "ref", 2, 8)
    assert ("worse", 2, 8) not in calls and ("better", 2, 8) in calls and ("close", 2, 8) in calls
    want, want_margins = resolved_choice({k: cands[k] for k in ("ref", "better", "close")}, "ref")
    assert kept == want == "better" and margins["better"].n == 800 and margins["worse"].n == 200
    for k in ("better", "close"):
        assert torch.equal(losses[k], cands[k])
        assert margins[k].ci_high == pytest.approx(want_margins[k].ci_high, rel=1e-12)
    # one look (first >= total) is resolved_choice itself
    kept, margins, _ = sequential_choice(_scored(cands, 100, []), list(cands), "ref", 8, 8)
    assert (kept, {k: d.ci_high for k, d in margins.items()}) == (
        resolved_choice(cands, "ref")[0], {k: d.ci_high for k, d in resolved_choice(cands, "ref")[1].items()})
    with pytest.raises(ValueError, match="reference candidate 'x' is not among"):
        sequential_choice(_scored(cands, 100, []), list(cands), "x", 2, 8)


def test_sequential_choice_admits_no_worse_candidate_more_often_than_level():
    """Under the null (the candidate no better than the reference), the two-look rule admits it in
    at most about 5 % of draws, as the one-look rule does (Monte Carlo, 200 draws)."""
    from bayesq.comparison import sequential_choice

    g = torch.Generator().manual_seed(11)
    admitted = 0
    for _ in range(200):
        ref = torch.rand(400, generator=g, dtype=torch.float64)
        same = ref + 0.3 * torch.randn(400, generator=g, dtype=torch.float64)
        kept, _, _ = sequential_choice(_scored({"ref": ref, "same": same}, 50, []), ["ref", "same"], "ref", 2, 8,
                                       resamples=200)
        admitted += kept == "same"
    assert admitted / 200 < 0.05 + 3 * math.sqrt(0.05 * 0.95 / 200)


def test_kl_and_agreement_per_example_of_per_token_logits_mean_over_real_tokens():
    """(N, T, V) logits with an (N, T) mask: the mean over each example's real tokens of the
    (N, C) quantities; padding's logits are never read; no mask: every token."""
    g = torch.Generator().manual_seed(0)
    fp, q = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    kl, agree = kl_per_example(fp, q, mask), agreement_per_example(fp, q, mask)
    for i, n in enumerate(mask.sum(1).tolist()):
        assert float(kl[i]) == pytest.approx(float(kl_per_example(fp[i, :n], q[i, :n]).mean()), rel=1e-12)
        assert float(agree[i]) == pytest.approx(float(agreement_per_example(fp[i, :n], q[i, :n]).double().mean()))
    junk = fp.clone()
    junk[mask == 0] = 1e6
    assert torch.equal(kl_per_example(junk, q, mask), kl)
    every_token = kl_per_example(fp.flatten(0, 1), q.flatten(0, 1)).view(3, 4).mean(1)
    torch.testing.assert_close(kl_per_example(fp, q), every_token)
    with pytest.raises(ValueError, match=r"token mask \(3, 2\) does not match"):
        kl_per_example(fp, q, mask[:, :2])
    with pytest.raises(ValueError, match=r"\(N, C\) \(or per-token \(N, T, V\)\) logit tensors"):
        kl_per_example(fp[..., None], q[..., None])


def _features(seed: int, n: int = 5, t: int = 4, h: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[1, 2:] = False
    mask[3, 1:] = False
    return torch.randn(n, t, h, generator=g, dtype=torch.float64), mask


def test_feature_error_and_pooled_embeddings_vs_python_loops():
    fp, mask = _features(0)
    q = fp + 0.1 * _features(1)[0]
    q[~mask] = 99.0  # padding is never read
    err, emb = feature_error_per_example(fp, q, mask), pooled_embeddings(fp, mask)
    for i in range(len(fp)):
        real = [t for t in range(fp.shape[1]) if mask[i, t]]
        num = sum(float(q[i, t, k] - fp[i, t, k]) ** 2 for t in real for k in range(fp.shape[2]))
        den = sum(float(fp[i, t, k]) ** 2 for t in real for k in range(fp.shape[2]))
        assert float(err[i]) == pytest.approx(math.sqrt(num / den), rel=1e-12)
        for k in range(fp.shape[2]):
            assert float(emb[i, k]) == pytest.approx(statistics.fmean(float(fp[i, t, k]) for t in real), rel=1e-12)
    assert torch.equal(feature_error_per_example(fp, fp, mask), torch.zeros(len(fp), dtype=torch.float64))


def test_cosine_and_neighbour_agreement_vs_python_loops():
    g = torch.Generator().manual_seed(2)
    fp = torch.randn(7, 3, generator=g, dtype=torch.float64)
    q = fp + 0.8 * torch.randn(7, 3, generator=g, dtype=torch.float64)

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    def nn_of(e, i):
        return max((j for j in range(len(e)) if j != i), key=lambda j: cos(e[i].tolist(), e[j].tolist()))

    c = cosine_per_example(fp, q)
    agree = neighbour_agreement(fp, q)
    for i in range(7):
        assert float(c[i]) == pytest.approx(cos(fp[i].tolist(), q[i].tolist()), rel=1e-12)
        assert int(nearest_neighbours(fp)[i]) == nn_of(fp, i)
        assert bool(agree[i]) == (nn_of(fp, i) == nn_of(q, i))
    assert 0 < int(agree.sum()) < 7  # the noise moved some neighbours, not all
    assert bool(neighbour_agreement(fp, 2.5 * fp).all())  # scale does not move a cosine neighbour
    with pytest.raises(ValueError, match="N >= 2"):
        nearest_neighbours(fp[:1])
