"""Per-example comparison with the full-precision model, and paired comparison of two methods.

Every quantised model is scored on the same test examples as the FP model and as every other
method, so differences can be measured example by example:

* :func:`kl_per_example` -- ``KL_i = sum_c p_c log(p_c / q_c)`` with ``p = softmax(z_FP_i)`` and
  ``q = softmax(z_Q_i)`` (nats; float64, from stable log-softmax);
* :func:`agreement_per_example` -- ``argmax_c z_Q_ic == argmax_c z_FP_ic``;
  (both also for a language model's (N, T, V) logits: the mean over each example's real tokens);
* :func:`correct_per_example` -- ``argmax_c z_ic == y_i``;
* for the features ``F_i`` (T, H) of a model without a head: :func:`feature_error_per_example`
  -- ``||F_Q_i - F_FP_i|| / ||F_FP_i||`` over the real tokens (Frobenius norms);
  :func:`pooled_embeddings` -- ``e_i = 1/T_i sum_{t: m_it} F_it`` (mean pooling, as sentence
  encoders are read); :func:`cosine_per_example` -- ``cos(e_Q_i, e_FP_i)``;
  :func:`neighbour_agreement` -- whether ``e_i``'s nearest neighbour by cosine among the other
  examples is the same example for both models (each model's neighbours among its own embeddings,
  as a retrieval index rebuilt with the quantised model finds them);
* :func:`fidelity_summary` -- mean KL, its standard error ``sd(KL) / sqrt(N)`` and the agreement rate;
* :func:`resolved_choice` -- which of several candidates scored on the same examples to keep: a
  reference unless another's paired advantage over it is resolved; :func:`sequential_choice`
  -- the same rule, scoring in two looks and stopping early for candidates resolved worse;
* :func:`paired_differences` -- the mean of ``a_i - b_i`` for two methods on the same examples and
  a percentile 95 % interval from a paired bootstrap over examples: resample ``N`` example indices
  with replacement (the same indices for both methods), take the mean difference, repeat
  ``resamples`` times, and read off the 2.5 % / 97.5 % quantiles. The indices come from
  ``torch.Generator().manual_seed(seed)``: resample ``b`` is the ``b``-th draw of
  ``torch.randint(0, N, (N,))`` from it, so the interval is reproducible and every comparison with
  the same ``N`` and seed uses the same resamples.

The interval covers test-set sampling only (which examples were drawn), not the calibration set,
fine-tuning or any other seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from bayesq.forward import per_input

RESAMPLES = 10_000
SEED = 0
_CHUNK = 256  # resamples per block of the bootstrap (memory: CHUNK x N float64 counts)


def _check_logits(fp_logit: Tensor, q_logit: Tensor, mask: Tensor | None = None) -> Tensor | None:
    """The (N, T) bool real-token mask of (N, T, V) logits (``mask``, or every token), None for (N, C)."""
    if fp_logit.ndim not in (2, 3) or fp_logit.shape != q_logit.shape:
        raise ValueError(f"need two (N, C) (or per-token (N, T, V)) logit tensors of one shape, got "
                         f"{tuple(fp_logit.shape)} and {tuple(q_logit.shape)}")
    if fp_logit.ndim == 2:
        if mask is not None:
            raise ValueError(f"a token mask {tuple(mask.shape)} was given for (N, C) logits {tuple(fp_logit.shape)}: "
                             "pass mask only with per-token (N, T, V) logits")
        return None
    if mask is None:
        return torch.ones(fp_logit.shape[:2], dtype=torch.bool, device=fp_logit.device)
    if tuple(mask.shape) != tuple(fp_logit.shape[:2]):
        raise ValueError(f"token mask {tuple(mask.shape)} does not match (N, T, V) logits {tuple(fp_logit.shape)}: "
                         "pass the (N, T) attention mask of the logits' tokens")
    return mask.to(fp_logit.device) != 0


def kl_per_example(fp_logit: Tensor, q_logit: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-example ``KL(p_FP(.|x_i) || p_Q(.|x_i))`` in nats.

    ``KL_i = sum_c p_ic (log p_ic - log q_ic)``, ``log p = log_softmax(z_FP)``, ``log q = log_softmax(z_Q)``
    in float64; classes with ``p_ic = 0`` contribute 0. Per-token (N, T, V) logits: the mean of the
    per-token KL over example i's real tokens, ``1/T_i sum_{t: m_it} KL_it`` (padding ignored).

    Args:
        fp_logit: (N, C) logits of the reference (full-precision) model, any float dtype, or
            (N, T, V) per-token logits.
        q_logit: (N, C) (or (N, T, V)) logits of the compared (quantised) model.
        mask: (N, T) real tokens of per-token logits (e.g. the attention mask); None: every token.

    Returns:
        (N,) float64, >= 0 (rounding below zero is clamped).
    """
    mask = _check_logits(fp_logit, q_logit, mask)
    if mask is not None:
        return per_input(kl_per_example(fp_logit[mask], q_logit[mask]), mask)
    log_p = torch.log_softmax(fp_logit.double(), dim=-1)
    log_q = torch.log_softmax(q_logit.double(), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(-1).clamp_min(0.0)


def agreement_per_example(fp_logit: Tensor, q_logit: Tensor, mask: Tensor | None = None) -> Tensor:
    """(N,) bool: the two models' top-1 classes agree (``argmax`` of each (N, C) logit tensor);
    for per-token (N, T, V) logits, (N,) float64: the share of example i's real tokens (``mask``,
    None: every token) on which they agree."""
    mask = _check_logits(fp_logit, q_logit, mask)
    if mask is not None:
        return per_input((fp_logit[mask].argmax(-1) == q_logit[mask].argmax(-1)).double(), mask)
    return fp_logit.argmax(-1) == q_logit.argmax(-1)


def feature_error_per_example(fp: Tensor, q: Tensor, mask: Tensor | None = None) -> Tensor:
    """(N,) float64 relative error ``||F_Q_i - F_FP_i|| / ||F_FP_i||`` of per-token features
    (N, T, H) over example i's real tokens (``mask`` (N, T), None: every token), Frobenius norms
    in float64; an example whose FP features are all zero scores its absolute error."""
    mask = _check_logits(fp, q, mask)
    if mask is None:
        mask = torch.ones(fp.shape[:1], dtype=torch.bool, device=fp.device)[:, None]
        fp, q = fp[:, None], q[:, None]
    err = per_input((q[mask].double() - fp[mask].double()).square().sum(-1), mask, reduce="sum")
    ref = per_input(fp[mask].double().square().sum(-1), mask, reduce="sum")
    return (err / torch.where(ref > 0, ref, torch.ones_like(ref))).sqrt()


def pooled_embeddings(features: Tensor, mask: Tensor | None = None) -> Tensor:
    """(N, H) float64 mean of per-token features (N, T, H) over each example's real tokens
    (``mask`` (N, T), None: every token); (N, H) features as they are."""
    if features.ndim == 2:
        return features.double()
    m = _check_logits(features, features, mask).to(torch.float64)
    return (features.double() * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp_min(1)


def cosine_per_example(fp: Tensor, q: Tensor) -> Tensor:
    """(N,) float64 ``cos(e_Q_i, e_FP_i)`` of (N, H) embeddings (0 where one is zero)."""
    return torch.nn.functional.cosine_similarity(fp.double(), q.double(), dim=-1, eps=1e-300)


def nearest_neighbours(emb: Tensor) -> Tensor:
    """(N,) int64: for each of N >= 2 embeddings (N, H), the index of the most cosine-similar
    other one (ties: the lowest index)."""
    if emb.ndim != 2 or len(emb) < 2:
        raise ValueError(f"nearest neighbours need (N, H) embeddings with N >= 2, got {tuple(emb.shape)}")
    u = torch.nn.functional.normalize(emb.double(), dim=-1)
    sim = u @ u.T
    sim.fill_diagonal_(-math.inf)
    return sim.argmax(-1)


def neighbour_agreement(fp: Tensor, q: Tensor) -> Tensor:
    """(N,) bool: example i's nearest neighbour (:func:`nearest_neighbours`) among the FP model's
    embeddings ``fp`` (N, H) is the same example as among the quantised model's ``q``."""
    return nearest_neighbours(fp) == nearest_neighbours(q)


def correct_per_example(logit: Tensor, labels: Tensor) -> Tensor:
    """(N,) bool: ``argmax_c logit_ic == labels_i`` for (N, C) logits and (N,) int64 labels."""
    if logit.ndim != 2 or labels.shape != logit.shape[:1]:
        raise ValueError(f"logits {tuple(logit.shape)} do not match labels {tuple(labels.shape)}")
    return logit.argmax(-1) == labels


def mean_se(values: Tensor) -> tuple[float, float]:
    """``(mean, sd / sqrt(N))`` of (N,) values in float64; ``sd`` with ``N - 1``, SE 0 for N = 1."""
    x = values.double().flatten()
    if x.numel() == 0:
        raise ValueError("mean_se: no values")
    se = float(x.std(correction=1)) / math.sqrt(x.numel()) if x.numel() > 1 else 0.0
    return float(x.mean()), se


@dataclass(frozen=True)
class FidelitySummary:
    """A model against the FP model on N examples: mean KL (nats), its SE, top-1 agreement rate."""

    kl_mean: float
    kl_se: float
    agreement: float
    n: int

    def as_dict(self) -> dict[str, float]:
        """The record / MLflow fields ``kl_mean``, ``kl_se``, ``agreement``."""
        return {"kl_mean": self.kl_mean, "kl_se": self.kl_se, "agreement": self.agreement}


def fidelity_summary(kl: Tensor, agree: Tensor) -> FidelitySummary:
    """Summary of (N,) per-example KL and (N,) bool agreement (:func:`kl_per_example`,
    :func:`agreement_per_example`)."""
    if kl.shape != agree.shape or kl.ndim != 1:
        raise ValueError(f"kl {tuple(kl.shape)} and agreement {tuple(agree.shape)} must be one (N,) shape")
    kl_mean, kl_se = mean_se(kl)
    return FidelitySummary(kl_mean, kl_se, float(agree.double().mean()), kl.numel())


@dataclass(frozen=True)
class PairedDifference:
    """``mean_i(a_i - b_i)`` (times ``scale``) of a method ``a`` and a baseline ``b`` on the same N
    examples, with the ``level`` percentile interval of the paired bootstrap."""

    diff: float
    ci_low: float
    ci_high: float
    n: int
    resamples: int
    seed: int
    level: float

    def as_dict(self) -> dict[str, float]:
        return {"diff": self.diff, "ci_low": self.ci_low, "ci_high": self.ci_high}


def bootstrap_means(values: Tensor, resamples: int = RESAMPLES, seed: int = SEED) -> Tensor:
    """Column means of ``values`` over bootstrap resamples of its rows.

    Resample ``b`` draws ``idx_b = torch.randint(0, N, (N,))`` from
    ``torch.Generator().manual_seed(seed)`` (the ``b``-th draw; drawn in blocks, which gives the
    same numbers) and returns ``mean_i values[idx_b[i]]`` for every column, computed as
    ``counts_b @ values / N`` with ``counts_b[j] = #{i : idx_b[i] = j}``.

    Args:
        values: (N, K) (or (N,)) per-example values; used in float64.

    Returns:
        (resamples, K) float64 (or (resamples,) for 1-D ``values``).
    """
    x = values.double()
    flat = x.ndim == 1
    x = x[:, None] if flat else x
    n = x.shape[0]
    if n == 0 or resamples < 1:
        raise ValueError(f"bootstrap_means: need N >= 1 and resamples >= 1, got {n} and {resamples}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, resamples, _CHUNK):
        rows = min(_CHUNK, resamples - start)
        idx = torch.randint(0, n, (rows, n), generator=g).to(x.device)
        ones = torch.ones(rows, n, dtype=torch.float64, device=x.device)
        counts = torch.zeros(rows, n, dtype=torch.float64, device=x.device).scatter_add_(1, idx, ones)  # (rows, N)
        out.append(counts @ x / n)
    means = torch.cat(out)
    return means[:, 0] if flat else means


def percentile(sorted_values: Tensor, q: float) -> Tensor:
    """Linear-interpolation quantile of values sorted along dim 0 (numpy's default rule):
    ``v[i] + f (v[i+1] - v[i])`` with ``i + f = q (B - 1)``."""
    pos = q * (sorted_values.shape[0] - 1)
    i = min(int(math.floor(pos)), sorted_values.shape[0] - 1)
    f = pos - i
    hi = sorted_values[min(i + 1, sorted_values.shape[0] - 1)]
    return sorted_values[i] + f * (hi - sorted_values[i])


def paired_differences(method: Tensor, baseline: Tensor, resamples: int = RESAMPLES, seed: int = SEED,
                       level: float = 0.95, scale: float = 1.0) -> tuple[PairedDifference, ...]:
    """Paired bootstrap of ``mean(a - b)`` for K comparisons at once (one set of resamples).

    ``d_ik = scale (a_ik - b_ik)``; ``diff_k = mean_i d_ik``; the interval is the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of ``mean_i d_{idx_b[i], k}`` over the
    resamples of :func:`bootstrap_means` (same example indices for method and baseline).

    Args:
        method, baseline: (N,) or (N, K) per-example values on the same examples (e.g. correct as
            0/1, or KL); any dtype, used in float64.
        scale: multiplies the differences (100: accuracy in points).

    Returns:
        K :class:`PairedDifference` (one for 1-D inputs).
    """
    if method.shape != baseline.shape or method.ndim not in (1, 2):
        raise ValueError(f"method {tuple(method.shape)} and baseline {tuple(baseline.shape)} must be one "
                         "(N,) or (N, K) shape")
    d = scale * (method.double() - baseline.double())
    d = d[:, None] if d.ndim == 1 else d
    means = bootstrap_means(d, resamples, seed).sort(dim=0).values
    lo, hi = percentile(means, (1 - level) / 2), percentile(means, (1 + level) / 2)
    mean = d.mean(0)
    return tuple(PairedDifference(float(mean[k]), float(lo[k]), float(hi[k]), d.shape[0], resamples, seed, level)
                 for k in range(d.shape[1]))


def paired_difference(method: Tensor, baseline: Tensor, resamples: int = RESAMPLES, seed: int = SEED,
                      level: float = 0.95, scale: float = 1.0) -> PairedDifference:
    """:func:`paired_differences` of two (N,) per-example value vectors."""
    if method.ndim != 1:
        raise ValueError(f"paired_difference takes (N,) values, got {tuple(method.shape)}")
    return paired_differences(method, baseline, resamples, seed, level, scale)[0]


def resolved_choice(losses: Mapping[str, Tensor], reference: str, resamples: int = RESAMPLES, seed: int = SEED,
                    level: float = 0.95) -> tuple[str, dict[str, PairedDifference]]:
    """Keep ``reference`` unless another candidate's per-example loss is lower by a resolved margin.

    A candidate is admitted when the ``level`` interval of the paired bootstrap of
    ``mean_i(loss_i(candidate) - loss_i(reference))`` (:func:`paired_differences`, one set of
    resamples for all candidates) lies below zero (``ci_high < 0``); the admitted candidate with
    the least mean loss is kept, else ``reference``. The least mean loss alone on a finite draw
    picks the candidate the draw's noise favours as often as the better one when candidates are
    close (the winner's curse); the reference should be the one with the fewest fitted choices.
    A candidate whose losses are not all finite is never admitted; a non-finite reference gives way
    to the finite candidate with the least mean.

    Args:
        losses: candidate name -> (N,) per-example losses on the same N examples (e.g. KL to FP).
        reference: the key kept unless another is resolved better.

    Returns:
        (kept name, {other name: its PairedDifference to the reference}).
    """
    if reference not in losses:
        raise ValueError(f"reference candidate '{reference}' is not among {sorted(losses)}")
    others = [k for k in losses if k != reference]
    finite = {k: bool(torch.isfinite(v).all()) for k, v in losses.items()}
    if not others:
        return reference, {}
    if not finite[reference]:
        means = {k: float(losses[k].double().mean()) for k in others if finite[k]}
        return (min(means, key=means.get) if means else reference), {}
    ok = [k for k in others if finite[k]]
    if not ok:
        return reference, {}
    ref = losses[reference][:, None].expand(-1, len(ok))
    diffs = dict(zip(ok, paired_differences(torch.stack([losses[k] for k in ok], 1), ref, resamples, seed, level)))
    admitted = {k: d.diff for k, d in diffs.items() if d.ci_high < 0}
    return (min(admitted, key=admitted.get) if admitted else reference), diffs


def sequential_choice(score: Callable[[str, slice], Tensor], names: Sequence[str], reference: str,
                      first: int, total: int, resamples: int = RESAMPLES, seed: int = SEED,
                      level: float = 0.95) -> tuple[str, dict[str, PairedDifference], dict[str, Tensor]]:
    """:func:`resolved_choice` on ``total`` batches of examples, with an early stop for futility.

    ``score(name, part)`` gives candidate ``name``'s (n,) per-example losses on the batches
    ``part`` (a slice). First every candidate is scored on the batches ``[0, first)``; a candidate
    resolved *worse* than ``reference`` there (its ``level`` interval above zero) is dropped. If
    only the reference is left, it is kept and the other batches are never scored. Else the
    reference and the rest are scored on ``[first, total)`` and :func:`resolved_choice` decides
    on every batch. A candidate is admitted only by that last interval, so the chance of
    admitting one that is no better than the reference stays at most ``1 - level``: the early
    stop only gives up candidates already resolved worse (the price is power, not error rate).

    Returns:
        (kept name, {other name: its PairedDifference to the reference on the examples it was
        last compared on}, {name: the per-example losses scored, first look then the rest}).
    """
    if reference not in names:
        raise ValueError(f"reference candidate '{reference}' is not among {sorted(names)}")
    losses = {n: score(n, slice(0, min(first, total))) for n in names}
    kept, margins = resolved_choice(losses, reference, resamples, seed, level)
    if first >= total:
        return kept, margins, losses
    alive = [n for n in names if not (n in margins and margins[n].ci_low > 0)]
    if alive == [reference]:
        return reference, margins, losses
    for n in alive:
        losses[n] = torch.cat([losses[n], score(n, slice(first, total))])
    kept, final = resolved_choice({n: losses[n] for n in alive}, reference, resamples, seed, level)
    return kept, {**margins, **final}, losses
