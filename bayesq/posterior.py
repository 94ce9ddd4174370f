"""Laplace posterior N(mu, Sigma) over the quantised weights: diagonal, K-FAC or low-rank K-FAC.

Diagonal curvature (Fisher, empirical Fisher, Hutchinson Hessian / GGN), summed over n inputs:

    precision_i = s * C_sum_i + lambda,   s = n_data / n  (1 when n_data = 0)
    sigma_i^2   = clip(1 / precision_i, var_min, var_max),   mu = trained weights.

K-FAC (``curvature/kfac.py``): per-example mean factors A (d_in, d_in), G (d_out, d_out) give the
precision of the row-major flattened weight ``N * (G (x) A) + lambda I`` with ``N = n_data`` (or
n); it is kept in factored form with factored Tikhonov damping (``kfac.damped``)

    precision ~= (N G + sqrt(lambda)/pi I) (x) (A + pi sqrt(lambda) I),

and its diagonal ``N diag(G) diag(A)^T + lambda`` gives the per-weight variances that the
closed-form tables use. Low-rank: each factor is first eigen-truncated to ``rank`` pairs (or
fewer, to ``explained`` of its trace) plus an isotropic rest (``curvature/lowrank.py``).

Damping rules (paper, appendix "Damping schedules" and "Small calib stability"):
* ``auto_damping``: per layer ``lambda_b = max(damping, 0.01 * median(s * C_sum_b))``;
* fewer than ``small_calibration`` inputs: ``lambda x 5`` and the layer's variance spectrum
  clipped to its [1%, 99%] quantiles (a noisy curvature estimate cannot produce extremes);
* an indefinite curvature (Hutchinson Hessian) is clamped at 0 before damping, so a weight
  with negative curvature gets the prior variance ``1 / lambda``;
* back-off: a damped K-FAC factor that is not positive definite to working precision (Cholesky
  fails) gets its damping multiplied by 3 until it is (:func:`spd_backoff`).

The cost of a weight error d is the expected increase of the task loss, ``0.5 d^T Sigma^-1 d``
(docs/method.md section 2); with the diagonal that is ``0.5 sum_i d_i^2 / sigma_i^2``, with K-FAC
``0.5 tr(G' D A' D^T)`` for the damped factors A', G'.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable

import torch
from scipy.optimize import brentq
from torch import nn
from tqdm.auto import tqdm

from bayesq.config import Curvature, PosteriorConfig, Prior
from bayesq.curvature.fisher import empirical_fisher_diagonal, fisher_diagonal
from bayesq.curvature.hutchinson import hutchinson_diagonal
from bayesq.curvature.kfac import KFACFactors, damped, kfac_diagonal, kfac_factors
from bayesq.curvature.lowrank import truncate
from bayesq.curvature.patches import input_rows
from bayesq.forward import (
    Batch, batch_size, by_length, call, collect_logits, drops_padding, layer_calls, padding_mask, split_batches,
    token_rows,
)
from bayesq.memory import release_freed

BACKOFF = 3.0
MAX_BACKOFFS = 8


class WeightMeans(Mapping[str, torch.Tensor]):
    """name -> the trained weight in float64, made on access: the posterior mean of a Laplace
    posterior is the trained weights, so no float64 copy is kept (8 bytes per weight less; the
    values are those of ``weight.double()``). Float64 weights are copied once here, so the mean
    never aliases a tensor the caller may change; lower-precision ones are read from the
    module's weight, which must not change while the posterior is in use."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._w = {n: (w.detach().clone() if w.dtype == torch.float64 else w.detach()) for n, w in weights.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self._w[name]
        return w if w.dtype == torch.float64 else w.double()

    def __iter__(self) -> Iterator[str]:
        return iter(self._w)

    def __len__(self) -> int:
        return len(self._w)


@dataclass(frozen=True)
class Posterior:
    """Per-layer Gaussian posterior (float64, shaped like each weight).

    Attributes:
        mean: name -> trained weights ``mu`` (float64 on access; :class:`WeightMeans` keeps no
            float64 copy).
        variance: name -> ``sigma^2``, the inverse of the precision's diagonal (what the
            closed-form tables use).
        n_examples: calibration inputs the curvature was estimated on.
        kfac: for K-FAC / low-rank posteriors, name -> damped factors with
            ``precision ~= G (x) A`` on the row-major flattened weight (all scaling folded in);
            None for diagonal posteriors.
        n_data: data size the precision is scaled to (``posterior.n_data``; 0 = the
            calibration set itself).
        curvature: name -> the data term ``h = N * mean_n C_n`` of the precision's diagonal
            (shaped like the weight, clamped at 0; kept in the dtype it was summed in, float32 for
            a float32 model: :func:`bayesq.curvature.patches.sum_dtype`; read it as float64
            through :meth:`data_precision`); None when only variances are known.
        prior_precision: name -> the layer's prior precision ``lambda_l`` (fitted or fixed).
        input_moment: K-FAC / low-rank posteriors: name -> the undamped input factor A
            (d_in, d_in), the column metric of the data term's error-feedback rounding.
    """

    mean: Mapping[str, torch.Tensor]
    variance: dict[str, torch.Tensor]
    n_examples: int
    kfac: dict[str, KFACFactors] | None = None
    n_data: int = 0
    curvature: dict[str, torch.Tensor] | None = None
    prior_precision: dict[str, float] | None = None
    input_moment: dict[str, torch.Tensor] | None = None

    def std(self, name: str) -> torch.Tensor:
        return self.variance[name].sqrt()

    def precision(self, name: str) -> torch.Tensor:
        return 1.0 / self.variance[name]

    def data_precision(self, name: str) -> torch.Tensor:
        """Data curvature ``h`` of layer ``name``, float64 (the precision less the prior when only
        variances are stored)."""
        if self.curvature is not None:
            return self.curvature[name].double()
        lam = (self.prior_precision or {}).get(name, 0.0)
        return (1.0 / self.variance[name] - lam).clamp_min(0)

    def prior_dominated_share(self, name: str | None = None, tolerance: float = 0.1) -> float:
        """Share of weights whose posterior variance is within ``tolerance`` of the prior's,
        ``1 / (h + lambda) >= (1 - tolerance) / lambda``, i.e. ``h <= lambda * tol / (1 - tol)``
        (one layer, or all layers pooled)."""
        if self.prior_precision is None:
            raise ValueError("this posterior carries no prior precisions (fit it with fit_posterior)")
        names = [name] if name is not None else list(self.mean)
        hit = total = 0
        for n in names:
            lam = self.prior_precision[n]
            hit += int((self.data_precision(n) <= lam * tolerance / (1 - tolerance)).sum())
            total += self.mean[n].numel()
        return hit / max(total, 1)

    def sample(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """One draw ``mu + sigma * eps`` per layer (diagonal part)."""
        return {
            n: m + self.variance[n].sqrt() * torch.randn(m.shape, generator=generator, dtype=m.dtype,
                                                         device=generator.device).to(m.device)
            for n, m in self.mean.items()
        }


LAMBDA_RANGE = (1e-8, 1e12)  # bracket of a fitted prior precision


def _effective(eig: torch.Tensor, lam: float) -> float:
    """gamma(lambda) = sum_i h_i / (h_i + lambda): parameters the data determine (one temporary
    of the layer's size: a Brent step on a large layer holds one float64 copy, not two)."""
    ratio = eig + lam
    return float(torch.div(eig, ratio, out=ratio).sum())


def fit_prior_precision(eig: torch.Tensor, sq_norm: float) -> float:
    """Prior precision maximising one layer's Laplace marginal likelihood (MacKay).

    With precision eigenvalues ``h_i + lambda`` (``h`` the data curvature's eigenvalues; the
    diagonal for a diagonal posterior, ``N g_j a_k`` for K-FAC) and the trained weights ``mu``
    as the mode,

        log Z(lambda) = -lambda/2 |mu|^2 + P/2 log lambda - 1/2 sum_i log(h_i + lambda) + const,

    whose stationary point is MacKay's fixed point ``lambda |mu|^2 = gamma(lambda)``,
    ``gamma = sum_i h_i / (h_i + lambda)``. ``gamma(lambda) - lambda |mu|^2`` falls strictly in
    lambda, so the root is unique; it is found by Brent's method on log lambda inside
    ``LAMBDA_RANGE`` (a layer with no curvature gets the lower end, all-zero weights the upper).

    Args:
        eig: float64 tensor of the data curvature's eigenvalues (any shape), clamped at 0.
        sq_norm: ``|mu|^2`` of the layer's trained weights.
    """
    eig = eig.to(torch.float64, copy=True).clamp_min_(0).reshape(-1)  # one float64 copy
    lo, hi = LAMBDA_RANGE

    def f(t: float) -> float:
        lam = math.exp(t)
        return _effective(eig, lam) - lam * sq_norm

    try:
        if f(math.log(lo)) <= 0:
            return lo
        if f(math.log(hi)) >= 0:
            return hi
        return math.exp(brentq(f, math.log(lo), math.log(hi), xtol=1e-10, rtol=1e-12))
    finally:
        # brentq leaves ``f`` in a reference cycle (scipy's NaN-check wrapper), which would hold
        # the float64 copy until the next garbage collection (the whole model's, 0.9 GiB at
        # GPT-2 small): empty the cell ``f`` reads it through.
        eig = None  # noqa: F841


def log_evidence(eig: torch.Tensor, sq_norm: float, lam: float) -> float:
    """The lambda-dependent part of the Laplace log marginal likelihood (see
    :func:`fit_prior_precision`); for tests and reports."""
    eig = eig.double().clamp_min(0).reshape(-1)
    return float(-0.5 * lam * sq_norm + 0.5 * eig.numel() * math.log(lam) - 0.5 * torch.log(eig + lam).sum())


def layer_damping(curvature: torch.Tensor, cfg: PosteriorConfig, n_examples: int,
                  fitted: float | None = None) -> float:
    """Prior precision of one layer: ``fitted`` (the marginal-likelihood fit) when given, else
    ``cfg.damping``; raised by the auto and small-calibration rules."""
    lam = cfg.damping if fitted is None else fitted
    if cfg.auto_damping:
        lam = max(lam, 0.01 * float(curvature.double().median()))
    if n_examples < cfg.small_calibration:
        lam *= 5.0
    return lam


def _check_curvature(name: str, f: torch.Tensor, indefinite: bool) -> None:
    if not torch.isfinite(f).all() or (not indefinite and (f < 0).any()):
        raise ValueError(
            f"curvature diagonal of layer '{name}' has negative or non-finite entries; "
            "check the model's logits on the calibration data for NaN/Inf"
        )


class Variances(Mapping[str, torch.Tensor]):
    """name -> the clipped variance ``_variance(h, lambda, cfg, N)`` of a layer, computed on access
    from its curvature ``h`` and prior precision ``lambda`` (the values the posterior would store;
    8 bytes per weight less memory). ``curvature`` is the posterior's own dict (not copied)."""

    def __init__(self, curvature: Mapping[str, torch.Tensor], prior: Mapping[str, float], cfg: PosteriorConfig,
                 n_examples: int) -> None:
        self._h, self._lam, self._cfg, self._n = curvature, prior, cfg, n_examples

    def __getitem__(self, name: str) -> torch.Tensor:
        return _variance(self._h[name].double(), self._lam[name], self._cfg, self._n)

    def __iter__(self) -> Iterator[str]:
        return iter(self._h)

    def __len__(self) -> int:
        return len(self._h)


def _variance(h: torch.Tensor, lam: float, cfg: PosteriorConfig, n_examples: int) -> torch.Tensor:
    """``clip(1 / (h + lam))``, plus the small-calibration spectrum clip."""
    v = (1.0 / (h + lam)).clamp(cfg.var_min, cfg.var_max)
    if n_examples < cfg.small_calibration and v.numel() > 1:
        lo, hi = torch.quantile(v.reshape(-1)[: 1 << 24], torch.tensor([0.01, 0.99], dtype=v.dtype, device=v.device))
        v = v.clamp(float(lo), float(hi))
    return v


def fit_diagonal_posterior(
    fisher_sum: dict[str, torch.Tensor],
    n_examples: int,
    weights: dict[str, torch.Tensor],
    cfg: PosteriorConfig,
    *,
    indefinite: bool = False,
    consume: bool = False,
) -> Posterior:
    """Damped, clipped diagonal Laplace posterior from a summed curvature diagonal.

    Args:
        fisher_sum: name -> curvature diagonal summed over the ``n_examples`` inputs.
        indefinite: the curvature may be negative (a Hessian); it is clamped at 0.
        consume: ``fisher_sum`` is the caller's to give away: its entries are emptied from the
            dict and clamped and scaled in place and kept in their dtype (one copy of the
            curvature at a time, not two); otherwise they are copied to float64.

    Raises:
        ValueError: no calibration examples, or a curvature entry that is not finite (or
            negative when ``indefinite`` is False).
    """
    if n_examples < 1:
        raise ValueError("empty calibration set: fit the posterior on at least one input")
    scale = cfg.n_data / n_examples if cfg.n_data else 1.0
    curv: dict[str, torch.Tensor] = {}
    prior: dict[str, float] = {}
    mean = WeightMeans({n: weights[n] for n in fisher_sum})
    for name in list(fisher_sum):
        f = fisher_sum.pop(name) if consume else fisher_sum[name]
        _check_curvature(name, f, indefinite)
        if consume and f.is_floating_point():
            h = f.clamp_(min=0)
            if scale != 1.0:
                h.mul_(scale)
        else:
            h = scale * f.double().clamp(min=0)
        fitted = fit_prior_precision(h, float(mean[name].pow(2).sum())) if cfg.prior == Prior.FITTED else None
        lam = layer_damping(h, cfg, n_examples, fitted)
        curv[name], prior[name] = h, lam
        release_freed()  # the fit's float64 copy: below glibc's mmap threshold it would stay resident
    var = Variances(curv, prior, cfg, n_examples)
    return Posterior(mean=mean, variance=var, n_examples=n_examples, n_data=cfg.n_data, curvature=curv,
                     prior_precision=prior)


def spd_backoff(f: KFACFactors, damping: float) -> tuple[KFACFactors, float]:
    """Factored damping of ``f`` raised by x3 until both factors are positive definite.

    Returns (damped factors, damping used). Raises ``ValueError`` after 8 back-offs.
    """
    lam = damping
    for _ in range(MAX_BACKOFFS + 1):
        d = damped(f, lam)
        ok = all(int(torch.linalg.cholesky_ex(m)[1]) == 0 for m in (d.A, d.G))
        if ok:
            return d, lam
        lam *= BACKOFF
    raise ValueError(
        f"K-FAC factors stay singular after damping {damping:g} x {BACKOFF:g}^{MAX_BACKOFFS}: "
        "raise posterior.damping or check the layer's inputs for NaN/Inf"
    )


def _truncated(m: torch.Tensor, cfg: PosteriorConfig) -> torch.Tensor:
    """Dense form of the low-rank + isotropic truncation of a PSD factor (d, d)."""
    return truncate(0.5 * (m + m.T), rank=cfg.rank, explained=cfg.explained, max_rank=cfg.rank).dense()


def fit_kfac_posterior(
    factors: dict[str, KFACFactors],
    weights: dict[str, torch.Tensor],
    cfg: PosteriorConfig,
    *,
    lowrank: bool = False,
) -> Posterior:
    """K-FAC (or low-rank K-FAC) Laplace posterior from per-example mean factors.

    Precision ``N G (x) A + lambda I`` with ``N = n_data`` (``n_examples`` when 0), damped in
    factored form (``kfac.damped``, back-off :func:`spd_backoff`); variances are the inverse of
    its diagonal ``N diag(G) diag(A)^T + lambda`` (undamped-product diagonal plus the layer
    damping, as in the diagonal posterior), clipped like :func:`fit_diagonal_posterior`.
    """
    n = next(iter(factors.values())).n_examples if factors else 0
    if n < 1:
        raise ValueError("empty calibration set: fit the posterior on at least one input")
    big_n = cfg.n_data or n
    kfac, curv, prior, moment = {}, {}, {}, {}
    mean = WeightMeans({k: weights[k] for k in factors})
    for name, f in factors.items():
        A, G = (_truncated(f.A, cfg), _truncated(f.G, cfg)) if lowrank else (f.A, f.G)
        shape = weights[name].shape
        h = big_n * kfac_diagonal(KFACFactors(A, G, n)).reshape(shape)  # (out, ...) like the weight
        _check_curvature(name, h, indefinite=False)
        fitted = None
        if cfg.prior == Prior.FITTED:
            eig = big_n * torch.outer(*(torch.linalg.eigvalsh(0.5 * (m + m.T)).clamp_min(0) for m in (G, A)))
            fitted = fit_prior_precision(eig, float(mean[name].pow(2).sum()))  # eig: (d_out, d_in)
        lam = layer_damping(h, cfg, n, fitted)
        curv[name], prior[name] = h.clamp(min=0), lam
        kfac[name], _ = spd_backoff(KFACFactors(A, big_n * G, n), lam)
        moment[name] = A
    var = Variances(curv, prior, cfg, n)
    return Posterior(mean=mean, variance=var, n_examples=n, kfac=kfac, n_data=cfg.n_data, curvature=curv,
                     prior_precision=prior, input_moment=moment)


class CurvatureBackend(ABC):
    """One estimator of the data curvature of the layers' weights, turned into a :class:`Posterior`
    (the laplace-torch pattern: one class per backend, one call shape). Registered in
    :data:`CURVATURES` under its :class:`~bayesq.config.Curvature`.

    ``rows_in_pass``: its calibration pass can also hand each layer's input rows to an
    ``on_rows(name, rows)`` callback (as :func:`forward_inputs` does), so one pass also gives
    the layer-input statistics, and its ``fit`` takes a ``logits`` list that receives the
    model's outputs of that pass (one forward call per input)."""

    rows_in_pass: ClassVar[bool] = False

    @abstractmethod
    def fit(self, model: nn.Module, calibration: Iterable[Batch], layers: dict[str, nn.Module],
            cfg: PosteriorConfig, *, seed: int, progress: bool,
            on_rows: Callable[[str, torch.Tensor], None] | None, max_inputs: int | None = None) -> Posterior:
        """The posterior of ``layers``' weights from ``calibration`` (unlabelled batches);
        ``max_inputs``: the most inputs one forward / backward pass may hold (None: a batch)."""


class DiagonalCurvature(CurvatureBackend):
    """Backends that estimate ``sum_n diag C_n`` (a sum over examples, so the batches are
    regrouped by length first, :func:`bayesq.forward.by_length`; passes of at most
    ``max_inputs``), then :func:`fit_diagonal_posterior`. ``indefinite``: the estimate can be
    negative (Hessian probes)."""

    indefinite: ClassVar[bool] = False
    splits_batches: ClassVar[bool] = False  # diagonal() takes max_inputs itself (else it gets the batches split)

    @abstractmethod
    def diagonal(self, model, calibration, layers, cfg, seed, progress, on_rows) -> tuple[dict[str, torch.Tensor], int]:
        """(name -> float64 sum over inputs of the curvature diagonal, shaped like the weight; inputs
        seen). With ``splits_batches``, also ``max_inputs`` (the most inputs of a pass) and ``logits``
        (a list that receives the pass's logits, or None) keywords."""

    def fit(self, model, calibration, layers, cfg, *, seed, progress, on_rows, max_inputs=None, logits=None):
        batches = by_length(calibration)
        if self.splits_batches:
            diag, n = self.diagonal(model, batches, layers, cfg, seed, progress, on_rows, max_inputs=max_inputs,
                                    logits=logits)
        else:
            diag, n = self.diagonal(model, split_batches(batches, max_inputs), layers, cfg, seed, progress, on_rows)
        weights = {name: m.weight for name, m in layers.items()}
        return fit_diagonal_posterior(diag, n, weights, cfg, indefinite=self.indefinite, consume=True)


class FisherCurvature(DiagonalCurvature):
    """Sampled-label Fisher diagonal (``cfg.label_samples`` labels per input from the model's own
    predictive), :func:`bayesq.curvature.fisher.fisher_diagonal`."""

    rows_in_pass = True
    splits_batches = True

    def diagonal(self, model, calibration, layers, cfg, seed, progress, on_rows, max_inputs=None, logits=None):
        return fisher_diagonal(model, calibration, layers, label_samples=cfg.label_samples, seed=seed,
                               progress=progress, on_rows=on_rows, max_inputs=max_inputs,
                               share=cfg.curvature_share, logits=logits)


class EmpiricalFisherCurvature(DiagonalCurvature):
    """Squared gradients at the model's argmax labels,
    :func:`bayesq.curvature.fisher.empirical_fisher_diagonal`."""

    rows_in_pass = True
    splits_batches = True

    def diagonal(self, model, calibration, layers, cfg, seed, progress, on_rows, max_inputs=None, logits=None):
        return empirical_fisher_diagonal(model, calibration, layers, progress=progress, on_rows=on_rows,
                                         max_inputs=max_inputs, share=cfg.curvature_share, logits=logits)


class HutchinsonCurvature(DiagonalCurvature):
    """Rademacher-probe diagonal of the Hessian (``kind = "hessian"``, possibly negative) or of the
    GGN (``"ggn"``), ``cfg.probes`` probes per batch, :func:`bayesq.curvature.hutchinson.hutchinson_diagonal`."""

    indefinite = True  # a probe estimate of a diagonal can come out negative (Hessian or GGN)

    def __init__(self, kind: str):
        self.kind = kind

    def diagonal(self, model, calibration, layers, cfg, seed, progress, on_rows):
        return hutchinson_diagonal(model, calibration, layers, probes=cfg.probes, curvature=self.kind, seed=seed,
                                   progress=progress)


class KroneckerCurvature(CurvatureBackend):
    """K-FAC factors (EMA ``cfg.kfac_decay``, read in batch order), then
    :func:`fit_kfac_posterior`; ``lowrank``: the factors truncated to low rank. The EMA reads
    the batches as given (``max_inputs`` is not applied: splitting would change the average)."""

    def __init__(self, lowrank: bool = False):
        self.lowrank = lowrank

    def fit(self, model, calibration, layers, cfg, *, seed, progress, on_rows, max_inputs=None):
        decay = cfg.kfac_decay if cfg.kfac_decay < 1 else None
        factors = kfac_factors(model, calibration, layers, decay=decay, label_samples=cfg.label_samples,
                               seed=seed, progress=progress)
        return fit_kfac_posterior(factors, {name: m.weight for name, m in layers.items()}, cfg, lowrank=self.lowrank)


CURVATURES: dict[Curvature, CurvatureBackend] = {
    Curvature.FISHER: FisherCurvature(),
    Curvature.EMPIRICAL_FISHER: EmpiricalFisherCurvature(),
    Curvature.HUTCHINSON_HESSIAN: HutchinsonCurvature("hessian"),
    Curvature.HUTCHINSON_GGN: HutchinsonCurvature("ggn"),
    Curvature.KFAC: KroneckerCurvature(),
    Curvature.LOWRANK: KroneckerCurvature(lowrank=True),
}
ROWS_IN_PASS = tuple(c for c, backend in CURVATURES.items() if backend.rows_in_pass)  # passes that report layer inputs


def fit_posterior(
    model: nn.Module,
    calibration: Iterable[Batch],
    layers: dict[str, nn.Module],
    cfg: PosteriorConfig,
    *,
    seed: int = 0,
    progress: bool = True,
    on_rows: Callable[[str, torch.Tensor], None] | None = None,
    max_inputs: int | None = None,
    logits: list[torch.Tensor | None] | None = None,
) -> Posterior:
    """Label-free posterior of ``layers``' weights with the backend :data:`CURVATURES` holds for
    ``cfg.curvature``.

    fisher: sampled-label Fisher diagonal; empirical-fisher: squared gradients at the model's
    argmax labels; hutchinson-hessian / -ggn: Rademacher probes (``cfg.probes`` per batch);
    kfac / lowrank: Kronecker factors with EMA ``cfg.kfac_decay``. No dataset labels are read.
    ``on_rows``: with a backend whose pass reports the layer inputs (:data:`ROWS_IN_PASS`),
    called with each layer's input rows per batch of the same pass, as :func:`forward_inputs`
    calls it (so one pass also gives the layer-input statistics); with any other a ValueError.
    ``max_inputs``: the diagonal backends' pass holds at most this many inputs at once (batches
    run in parts, :func:`bayesq.curvature.fisher.fisher_diagonal`; the same sums up to float rounding, the activation
    memory of a part instead of a batch; e.g. :attr:`bayesq.memory.MemoryEstimate.pass_inputs`); None:
    whole batches. ``logits``: a list that receives the model's logits of each forward call of a
    :data:`ROWS_IN_PASS` backend's pass (:func:`bayesq.forward.pass_logits` puts them in the order of
    ``calibration``); any other backend leaves it empty.
    """
    curv = Curvature(cfg.curvature)
    backend = CURVATURES[curv]
    if on_rows is not None and not backend.rows_in_pass:
        raise ValueError(f"on_rows needs a Fisher curvature pass ({', '.join(c.value for c in ROWS_IN_PASS)}), not "
                         f"'{curv.value}': take the layer inputs with forward_inputs instead")
    extra = {"logits": logits} if logits is not None and backend.rows_in_pass else {}
    return backend.fit(model, calibration, layers, cfg, seed=seed, progress=progress, on_rows=on_rows,
                       max_inputs=max_inputs, **extra)


def forward_inputs(
    model: nn.Module, calibration: Iterable[Batch], layers: dict[str, nn.Module],
    on_rows: Callable[[str, torch.Tensor], None], *, progress: bool = False, desc: str = "layer inputs",
    logits: list[torch.Tensor | None] | None = None,
) -> int:
    """One forward pass (eval mode, no grad) calling ``on_rows(name, rows)`` for every layer call
    (``progress``: a bar over the batches, labelled ``desc``).

    ``rows``: the layer's inputs as (N, groups, T, d_in) in the inputs' dtype (Conv2d: unfolded
    patches, d_in = in/groups*kh*kw, as in K-FAC); callers reduce a batch in that dtype and
    accumulate batches in float64. Linear layers called on the same input tensor (an
    attention block's q / k / v projections) get the same ``rows`` object, so ``on_rows`` can
    reuse what it computed from it. The model's training flag is restored. Batches are
    regrouped by length first (:func:`bayesq.forward.by_length`: callers sum over examples).
    A model with per-token logits (a language model, (B, T, V)) on padded batches gets its
    padded tokens' rows dropped (:func:`bayesq.forward.token_rows`: (1, 1, R, d_in), the R real
    tokens; :func:`bayesq.forward.drops_padding` reads the logits of the first input once); a
    classifier's rows are kept as they are. ``logits``: a list that receives the model's logits
    on each batch of the pass (:func:`bayesq.forward.collect_logits`; :func:`bayesq.forward.pass_logits`
    puts them in the order of ``calibration``). Returns the number of inputs seen.
    """
    last: list = [None, None]  # the last Linear input tensor seen and its rows
    batches = by_length(calibration)
    drop = drops_padding(model, batches)
    mask: list = [None]  # the batch's padding mask, when padded tokens' rows are dropped

    def record(name: str, mod: nn.Module, a: torch.Tensor, output: torch.Tensor) -> None:
        if isinstance(mod, nn.Linear) and last[0] is a:
            rows = last[1]
        else:
            rows = input_rows(mod, a.detach(), output.shape, widen=False)
            if mask[0] is not None:
                rows = token_rows(rows, a, mask[0])
            last[:] = (a, rows) if isinstance(mod, nn.Linear) else (None, None)
        on_rows(name, rows)

    n = 0
    with layer_calls(model, layers, record), torch.no_grad():
        for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
            mask[0] = padding_mask(batch) if drop else None
            collect_logits(logits, call(model, batch))  # the hooks read the layer inputs
            n += batch_size(batch)
            last[:] = (None, None)
    return n


def input_moments(
    model: nn.Module, calibration: Iterable[Batch], layers: dict[str, nn.Module]
) -> tuple[dict[str, torch.Tensor], int]:
    """Diagonal of each layer's input second moment ``A = mean_n sum_t a a^T`` (forward only).

    The data-only ("PCA") metric: ``sum_oi A_ii D_oi^2`` is the diagonal part of the layer-output
    error ``tr(D A D^T)``. Returns (name -> (d_in,) float64, inputs seen); Conv2d inputs are
    unfolded patches (d_in = in/groups*kh*kw), as in K-FAC.
    """
    sums = {name: torch.zeros(math.prod(m.weight.shape[1:]), dtype=torch.float64, device=m.weight.device)
            for name, m in layers.items()}

    def add(name: str, rows: torch.Tensor) -> None:  # rows (N, groups, T, d_in)
        sums[name] += rows.pow(2).sum((0, 2)).double().mean(0)  # (d_in,), groups averaged

    n = forward_inputs(model, calibration, layers, add)
    if n == 0:
        raise ValueError("empty calibration set: the PCA metric needs at least one input batch")
    return {k: v / n for k, v in sums.items()}, n
