"""Monte Carlo estimates of expected-loss table entries, with standard errors.

Every estimator averages a loss ``ell(Q(w), w)`` over posterior draws ``w = mu + sigma * eps``,
``eps ~ N(0, I)`` (diagonal posterior), for several candidate quantisers at once:

* **common random numbers** -- the same draws ``w^(m)`` are used for every candidate, so
  differences between candidates (what the allocator ranks) carry far less noise than the
  entries themselves (:meth:`MCEstimate.difference` gives the paired standard error);
* **antithetic pairs** -- draws come as ``eps`` and ``-eps``; the mean of a pair is one
  independent replicate, so ``samples`` draws give ``P = samples / 2`` replicates.  The loss is
  split into its even and odd parts in ``eps``; the pair mean cancels the odd part exactly, so
  antithetic pairs help when the odd part carries the variance (e.g. a rounding offset that is
  large against ``sigma``: ``0.5 (c - eps)^2`` has odd part ``-c eps``) and give about the same
  standard error as independent draws when the loss is nearly even or a sawtooth in ``eps``
  (a grid much finer than ``sigma``);
* a **standard error** with every mean: ``se = std(replicates, ddof=1) / sqrt(P)``.

Losses (``D = Q(w) - w``):

1. :func:`mc_whitened_loss` -- ``0.5 * sum_n mask * D^2 / sigma^2`` per group (row).  Its
   expectation is the closed-form table entry ``0.5 * codebook.grid_cost_chunked``.
2. :func:`mc_layer_output_loss` -- ``0.5 * tr(G D A D^T)`` for a (out, in) weight with K-FAC
   factors ``A`` (input second moment, (in, in)) and ``G`` (output-gradient second moment,
   (out, out) or its (out,) diagonal).  With row-major ``vec``, ``tr(G D A D^T) =
   vec(D)^T (G kron A) vec(D)``; it is computed through the two factors, never the Kronecker
   product.  When ``G kron A`` is the posterior precision (factors already scaled by
   ``n_data / n_cal`` and damped), this is the whitened cost of docs/method.md section 2.
3. :func:`mc_logit_kl` -- ``sum_x KL(softmax(f(x; w)/T) || softmax(f(x; Q(w))/T))`` with only
   one layer's weight drawn (the rest of the model at its current weights).  This is the
   paper's logit-KL proxy with a per-draw teacher: the paper's plug-in teacher (softmax
   averaged over draws, student at ``Q(mu)``) is biased at finite M and measures a different
   error; the per-draw form is unbiased and has the same ``D = Q(w) - w`` as the other two.
   A language model's per-token logits (B, T, V) count every real token:
   ``sum_x sum_{t: m_xt = 1} KL_xt`` (padding ignored), the KL of the example's token predictions
   taken together, whose quadratic form is the summed token Fisher the posterior is fitted on
   (:mod:`bayesq.curvature.fisher`), so the relation below holds as it stands.

Relation to the closed-form table.  For a small error ``d``,
``KL(p_w || p_{w+d}) = 0.5 d^T F_x d + O(|d|^3)`` with ``F_x`` the Fisher of example ``x``.
The diagonal posterior has precision ``s * F_sum + lambda`` with ``F_sum = sum_x F_x`` over
the ``n_cal`` calibration examples and ``s = n_data / n_cal`` (``posterior.py``), so

    0.5 d^T Sigma^-1 d  ~=  s * sum_x KL_x  =  n_data * mean_x KL_x       (lambda neglected),

i.e. ``(n_data / n_cal) * (summed KL)`` is on the scale of the closed-form table and can replace
its entries for chosen blocks (:func:`rescale_to_closed_form`).  The damping term
``0.5 lambda |d|^2`` and the off-diagonal Fisher (which the diagonal table ignores) are the
differences between the two.

All functions are pure (the model of :func:`mc_logit_kl` is restored exactly, even on error)
and reproducible: draws come from a CPU ``torch.Generator`` seeded with ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from bayesq.evaluation import token_kl
from bayesq.forward import Batch, predicted, predictions

Quantizer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MCEstimate:
    """Monte Carlo mean and standard error of one or more expected losses.

    Attributes:
        mean: (Q, ...) float64, estimate per candidate quantiser (and per row, for
            :func:`mc_whitened_loss`).
        se: same shape, standard error of ``mean``.
        samples: posterior draws used (loss evaluations per candidate).
        values: (P, Q, ...) float64 independent replicates (antithetic pair means, or single
            draws); ``mean = values.mean(0)``, ``se = values.std(0) / sqrt(P)``.
    """

    mean: torch.Tensor
    se: torch.Tensor
    samples: int
    values: torch.Tensor

    def difference(self, i: int, j: int) -> "MCEstimate":
        """Estimate of ``loss[i] - loss[j]`` with its paired (common-random-number) error."""
        return _summarize(self.values[:, i] - self.values[:, j], self.samples)

    def scaled(self, factor: float) -> "MCEstimate":
        """The same estimate multiplied by a constant ``factor``."""
        return MCEstimate(self.mean * factor, self.se * abs(factor), self.samples, self.values * factor)


def _summarize(values: torch.Tensor, samples: int) -> MCEstimate:
    """Mean and standard error over the replicate axis 0 of ``values`` (P, ...)."""
    p = values.shape[0]
    se = values.std(0, unbiased=True) / math.sqrt(p)
    return MCEstimate(mean=values.mean(0), se=se, samples=samples, values=values)


def _check_samples(samples: int, antithetic: bool) -> None:
    if antithetic and (samples < 4 or samples % 2):
        raise ValueError(
            f"samples={samples} with antithetic=True: need an even number >= 4 "
            "(two or more eps/-eps pairs for a standard error); pass e.g. samples=8"
        )
    if not antithetic and samples < 2:
        raise ValueError(f"samples={samples}: need at least 2 draws for a standard error")


def _noise(
    shape: torch.Size, samples: int, antithetic: bool, seed: int, dtype: torch.dtype,
    device: torch.device,
) -> Iterator[torch.Tensor]:
    """Standard-normal draws of ``shape``: ``eps_1, -eps_1, eps_2, -eps_2, ...`` if antithetic."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for m in range(samples):
        if antithetic and m % 2:
            yield -eps
            continue
        eps = torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        yield eps


def _estimate(
    evaluate: Callable[[torch.Tensor], torch.Tensor], shape: torch.Size, samples: int,
    antithetic: bool, seed: int, dtype: torch.dtype, device: torch.device,
) -> MCEstimate:
    """Run ``evaluate(eps) -> (Q, ...)`` on every draw and summarise over replicates."""
    per_draw = torch.stack([evaluate(eps) for eps in _noise(shape, samples, antithetic, seed, dtype, device)])
    per_draw = per_draw.to(torch.float64)  # (samples, Q, ...)
    if antithetic:
        per_draw = per_draw.reshape(samples // 2, 2, *per_draw.shape[1:]).mean(1)  # (P, Q, ...)
    return _summarize(per_draw, samples)


def _check_posterior(mu: torch.Tensor, sigma: torch.Tensor, ndim: int | None) -> None:
    if not (torch.is_floating_point(mu) and torch.is_floating_point(sigma)):
        raise ValueError("mu and sigma must be floating-point tensors (float64 recommended)")
    if mu.shape != sigma.shape:
        raise ValueError(f"mu {tuple(mu.shape)} and sigma {tuple(sigma.shape)} must have the same shape")
    if ndim is not None and mu.ndim != ndim:
        raise ValueError(f"mu must be {ndim}-D, got shape {tuple(mu.shape)}; reshape it first")
    if not (sigma > 0).all() or not torch.isfinite(sigma).all():
        raise ValueError(
            "sigma must be finite and > 0 everywhere (padding should repeat a real weight's "
            "mean and std, with mask 0)"
        )


def _check_quantizers(quantizers: Sequence[Quantizer]) -> list[Quantizer]:
    qs = list(quantizers)
    if not qs:
        raise ValueError("quantizers is empty: pass at least one callable w -> Q(w)")
    if not all(callable(q) for q in qs):
        raise ValueError("every entry of quantizers must be a callable mapping w to Q(w)")
    return qs


def _apply(q: Quantizer, w: torch.Tensor) -> torch.Tensor:
    out = q(w)
    if not isinstance(out, torch.Tensor) or out.shape != w.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"a quantizer returned {got} for input {tuple(w.shape)}; it must keep the shape")
    return out.to(w.dtype)


def mc_whitened_loss(
    mu: torch.Tensor, sigma: torch.Tensor, mask: torch.Tensor, quantizers: Sequence[Quantizer],
    *, samples: int = 16, antithetic: bool = True, seed: int = 0,
) -> MCEstimate:
    """Expected whitened distortion of each row under each quantiser, by Monte Carlo.

        L_q[r] = E_{w ~ N(mu, sigma^2)} 0.5 * sum_n mask[r, n] * (Q_q(w)[r, n] - w[r, n])^2 / sigma[r, n]^2

    Args:
        mu, sigma, mask: (R, n) float64 posterior means, stds (> 0) and 0/1 mask of real weights.
        quantizers: callables mapping a (R, n) sample to its (R, n) quantised value.
        samples: posterior draws (even and >= 4 when antithetic).

    Returns:
        MCEstimate with mean/se of shape (len(quantizers), R).
    """
    _check_posterior(mu, sigma, 2)
    if mask.shape != mu.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the shape of mu {tuple(mu.shape)}")
    _check_samples(samples, antithetic)
    qs = _check_quantizers(quantizers)
    weight = mask.to(mu.dtype) / (sigma * sigma)  # (R, n)

    def evaluate(eps: torch.Tensor) -> torch.Tensor:
        w = mu + sigma * eps
        return torch.stack([0.5 * (weight * (_apply(q, w) - w) ** 2).sum(-1) for q in qs])  # (Q, R)

    return _estimate(evaluate, mu.shape, samples, antithetic, seed, mu.dtype, mu.device)


def kfac_quadratic(d: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``tr(G D A D^T) = vec(D)^T (G kron A) vec(D)`` (row-major vec) without the Kronecker product.

    Args:
        d: (out, in) weight error D.
        a: (in, in) symmetric input factor A.
        g: (out, out) symmetric output factor G, or (out,) its diagonal.

    Returns:
        0-d tensor: ``sum_{o,i} (G D)_{oi} (D A)_{oi}``.
    """
    da = d @ a  # (out, in)
    gd = g[:, None] * d if g.ndim == 1 else g @ d  # (out, in)
    return (gd * da).sum()


def _check_factors(shape: torch.Size, a: torch.Tensor, g: torch.Tensor) -> None:
    out, inp = shape
    if a.shape != (inp, inp):
        raise ValueError(
            f"A must be (in, in) = ({inp}, {inp}) for a weight of shape {tuple(shape)}, "
            f"got {tuple(a.shape)}"
        )
    if g.shape not in ((out, out), (out,)):
        raise ValueError(
            f"G must be (out, out) = ({out}, {out}) or its diagonal ({out},) for a weight of shape "
            f"{tuple(shape)}, got {tuple(g.shape)}"
        )


def mc_layer_output_loss(
    mu: torch.Tensor, sigma: torch.Tensor, A: torch.Tensor, G: torch.Tensor,
    quantizers: Sequence[Quantizer], *, samples: int = 8, antithetic: bool = True, seed: int = 0,
) -> MCEstimate:
    """K-FAC layer-output error proxy ``0.5 * E_w[tr(G D A D^T)]``, ``D = Q(w) - w``.

    Args:
        mu, sigma: (out, in) float64 posterior means and stds (> 0) of a Linear weight
            (reshape a Conv2d weight to (out, in * kh * kw) to match its unfolded A).
        A: (in, in) input second moment; G: (out, out) output-gradient second moment or (out,).
        quantizers: callables mapping a (out, in) sample to its (out, in) quantised value.

    Returns:
        MCEstimate with mean/se of shape (len(quantizers),).
    """
    _check_posterior(mu, sigma, 2)
    _check_factors(mu.shape, A, G)
    _check_samples(samples, antithetic)
    qs = _check_quantizers(quantizers)
    a, g = A.to(mu.dtype), G.to(mu.dtype)

    def evaluate(eps: torch.Tensor) -> torch.Tensor:
        w = mu + sigma * eps
        return torch.stack([0.5 * kfac_quadratic(_apply(q, w) - w, a, g) for q in qs])  # (Q,)

    return _estimate(evaluate, mu.shape, samples, antithetic, seed, mu.dtype, mu.device)


def _log_probs(logit: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, C) float64 ``log softmax(logit / T)`` as ``z - logsumexp(z)`` (stable; on some CPU
    builds of torch this is ~100x faster than ``torch.log_softmax`` for small batches)."""
    z = logit.double() / temperature
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def _kl_sum(teacher_logp: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``sum_x KL(p_T || p_Q)`` in float64 from teacher log-probs and student logits (B, C)."""
    student_logp = _log_probs(student_logits, temperature)
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum()


def mc_logit_kl(
    model: nn.Module, batches: Sequence[Batch], layer_name: str, mu: torch.Tensor,
    sigma: torch.Tensor, quantizers: Sequence[Quantizer], *, samples: int = 8,
    antithetic: bool = True, seed: int = 0, temperature: float = 1.0, deployed: bool = False,
) -> MCEstimate:
    """Summed logit KL between the model at a posterior draw of one layer and at its quantisation.

        L_q = E_{w ~ N(mu, sigma^2)} sum_x KL(softmax(f(x; w)/T) || softmax(f(x; Q_q(w))/T)),

    ``w`` replacing ``layer_name``'s weight only (per-token logits (B, T, V): ``sum_x`` also runs
    over each input's real tokens, padding ignored; the teacher's logits are held one batch at a
    time). ``deployed``: the student is the deployed
    quantisation of the means, ``Q_q(mu)``, the same for every draw (the posterior-expected KL
    of deploying it); otherwise each draw is quantised (the ``draws`` objective).  The model runs in eval mode under
    ``torch.no_grad()``; its weights and every module's training flag are restored exactly
    afterwards, also when an exception is raised.

    Args:
        model: network whose ``get_submodule(layer_name)`` has a ``weight``.
        batches: calibration batches (tensors or dicts of tensors, see ``forward.predictions``);
            iterated ``samples * (1 + len(quantizers))`` times.
        mu, sigma: posterior means and stds (> 0), shaped like the weight.
        quantizers: callables mapping a weight-shaped sample to its quantised value.
        temperature: softmax temperature T > 0.

    Returns:
        MCEstimate with mean/se of shape (len(quantizers),), in nats summed over examples.
    """
    try:
        weight = model.get_submodule(layer_name).weight
    except AttributeError as err:
        raise ValueError(
            f"model has no module '{layer_name}' with a weight; use a name from named_modules()"
        ) from err
    _check_posterior(mu, sigma, None)
    if mu.shape != weight.shape:
        raise ValueError(
            f"mu {tuple(mu.shape)} must have the shape of {layer_name}.weight {tuple(weight.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_samples(samples, antithetic)
    qs = _check_quantizers(quantizers)
    batch_list = list(batches)
    if not batch_list:
        raise ValueError("batches is empty: pass at least one calibration batch")

    fixed = [_apply(q, mu) for q in qs] if deployed else None

    def evaluate(eps: torch.Tensor) -> torch.Tensor:
        w = mu + sigma * eps
        w_q = fixed if fixed is not None else [_apply(q, w) for q in qs]
        total = torch.zeros(len(qs), dtype=torch.float64)
        for batch in batch_list:
            weight.copy_(w)
            z, mask, likelihood = predicted(model, batch)
            teacher = _log_probs(z, temperature) if mask is None else z
            for k, wq in enumerate(w_q):
                weight.copy_(wq)
                student, _ = predictions(model, batch)
                kl = (_kl_sum(teacher, student, temperature) if mask is None
                      else token_kl(teacher, student, mask, temperature, likelihood).sum())
                total[k] += kl.cpu()
        return total  # (Q,)

    original = weight.detach().clone()
    flags = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            return _estimate(evaluate, mu.shape, samples, antithetic, seed, mu.dtype, mu.device)
    finally:
        with torch.no_grad():
            weight.copy_(original)
        for m, flag in flags.items():
            m.training = flag


def rescale_to_closed_form(estimate: MCEstimate, n_data: int, n_cal: int) -> MCEstimate:
    """Put a summed-KL estimate on the closed-form table's scale: multiply by ``n_data / n_cal``.

    ``n_data = 0`` means the posterior was not rescaled (``posterior.py`` uses ``s = 1``), so the
    estimate is returned unchanged.  See the module docstring for the derivation.
    """
    if n_cal < 1 or n_data < 0:
        raise ValueError(f"need n_cal >= 1 and n_data >= 0, got n_cal={n_cal}, n_data={n_data}")
    return estimate.scaled(n_data / n_cal if n_data else 1.0)
