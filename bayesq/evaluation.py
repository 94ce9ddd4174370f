"""Test-set evaluation of a (quantised) model: logits, then accuracy, calibration and tail metrics.

:func:`predict` runs the model; :func:`prediction_summary` turns (N, C) logits and labels into
the numbers the reports use (all from :mod:`bayesq.metrics`); :func:`mean_kl` scores a quantised
model against :func:`reference_log_probs` of the full-precision one (the calibration KL that
selections use).

A language model's per-token logits (B, T, V) are scored per input as the mean over its real
tokens (:func:`bayesq.forward.token_mask`) of the per-token KL, padding ignored:

    KL_n = 1/T_n sum_{t: m_nt = 1} sum_v p_ntv (log p_ntv - log q_ntv).

Their full-precision reference is recomputed batch by batch (:class:`FPReference`): the float64
log-probabilities of a calibration set, N * T * V * 8 bytes, do not fit in memory (64 inputs of
512 tokens over GPT-2's 50257 words: 13 GB).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from bayesq import metrics
from bayesq.forward import (
    Batch, Likelihood, call, eval_mode, first_inputs, logits, output_logits, per_input, positions, predicted,
    split_batches,
)
from bayesq.memory import release_freed


def each_batch(model: nn.Module, batches: Iterable[Batch], fn: Callable[[nn.Module, Batch], Tensor],
               desc: str | None = None, terminal_only: bool = False) -> list[Tensor]:
    """The one evaluation loop: ``fn(model, batch)`` for every batch in order, in eval mode
    without gradients (every module's mode restored afterwards); ``desc``: a progress bar
    over the batches with that label (``terminal_only``: shown on a terminal only, not in logs).
    No batches give an empty list; callers that need at least one input say so (:func:`predict`)."""
    with eval_mode(model), torch.no_grad():
        hide = True if desc is None else (None if terminal_only else False)
        return [fn(model, b) for b in tqdm(batches, desc=desc, disable=hide, leave=False)]


def predict(model: nn.Module, batches: Iterable[Batch], desc: str = "predict") -> Tensor:
    """(N, C) float32 logits of ``model`` over ``batches`` in order (:func:`each_batch`; a
    progress bar labelled ``desc`` on a terminal).

    Raises:
        ValueError: no batches (there is nothing to evaluate).
    """
    out = each_batch(model, batches, lambda m, b: logits(m, b).float(), desc, terminal_only=True)
    if not out:
        raise ValueError("predict: no batches to evaluate; pass at least one input batch")
    return torch.cat(out)


def _log_probs(model: nn.Module, batch: Batch) -> torch.Tensor:
    """(B, C) float64 log-probabilities of ``model`` on ``batch``."""
    return log_probs(logits(model, batch))


def log_probs(z: Tensor) -> Tensor:
    """(R, C) float64 ``log_softmax`` of logits ``z`` (..., C) in any float dtype: what
    :func:`reference_log_probs` holds per batch."""
    return F.log_softmax(z.reshape(-1, z.shape[-1]).double(), dim=-1)


KL_PART_POSITIONS = 256  # token positions per forward pass when kl_per_input scores per-token logits
# against an FPReference: a batch is scored in parts (split_batches), so that the two models' float32
# logits held at once are those of a part (51 MiB each at GPT-2's 50,257-token vocabulary)

KL_CHUNK = 1 << 22  # float64 elements of one chunk of token rows in token_kl (32 MiB per temporary)


def token_kl(z_p: Tensor, z_q: Tensor, mask: Tensor, temperature: float = 1.0,
             likelihood: Likelihood = Likelihood.CATEGORICAL) -> Tensor:
    """Per real token ``KL(softmax(z_p / T) || softmax(z_q / T))``: (R,) float64; for features
    read with a Gaussian likelihood (``likelihood="gaussian"``, unit variance), the Gaussians' KL
    ``||z_p - z_q||^2 / 2`` (``temperature`` unused): what a selection among candidates ranks by.

    Args:
        z_p, z_q: (B, T, V) logits (or log-probabilities) of the reference and the compared model.
        mask: (B, T) bool real tokens; R = ``mask.sum()``, rows in example then token order.
        temperature: T > 0.
        likelihood: how the outputs are read (:class:`bayesq.forward.Likelihood`).

    Computed in float64 on chunks of ``KL_CHUNK // V`` rows, so the temporaries stay small
    whatever the vocabulary.
    """
    gaussian = Likelihood(likelihood) is Likelihood.GAUSSIAN
    b, t = mask.to(z_p.device).nonzero(as_tuple=True)
    step = max(1, KL_CHUNK // max(1, z_p.shape[-1]))
    out = [torch.zeros(0, dtype=torch.float64, device=z_p.device)]
    for s in range(0, len(b), step):
        i, j = b[s:s + step], t[s:s + step]
        if gaussian:
            out.append(0.5 * (z_p[i, j].double() - z_q[i, j].double()).square().sum(-1))
            continue
        lp = F.log_softmax(z_p[i, j].double() / temperature, dim=-1)
        lq = F.log_softmax(z_q[i, j].double() / temperature, dim=-1)
        out.append((lp.exp() * (lp - lq)).sum(-1))
    return torch.cat(out)


class FPReference(Sequence[Tensor]):
    """The full-precision model's predictive on ``batches``, recomputed where it is read.

    What :func:`reference_log_probs` returns for a model with per-token logits: item ``i`` is
    batch ``i``'s (B, T, V) float64 log-probabilities (computed on access), a slice the
    reference of those batches, and :func:`kl_per_input` reads :meth:`logits_of` a part of a batch
    at a time, so only one part's logits are held. ``model`` must not change while the reference is
    in use (the quantised models scored against it are copies).
    """

    def __init__(self, model: nn.Module, batches: Sequence[Batch]) -> None:
        self.model, self.batches = model, list(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return FPReference(self.model, self.batches[i])
        return F.log_softmax(self.logits(i).double(), dim=-1)

    def logits(self, i: int) -> Tensor:
        """(B, T, V) logits of the model on batch ``i`` (eval mode, no gradients)."""
        return self.logits_of(self.batches[i])

    def logits_of(self, batch: Batch) -> Tensor:
        """(B, T, V) logits of the model on ``batch`` (e.g. some inputs of one of its batches)."""
        return each_batch(self.model, [batch], lambda m, b: output_logits(call(m, b)))[0]


def _per_token(model: nn.Module, batches: Sequence[Batch]) -> bool:
    """Whether ``model``'s logits on ``batches`` have a token axis (one forward pass of the first input)."""
    probe = first_inputs(batches, 1)
    return bool(probe) and each_batch(model, probe, lambda m, b: output_logits(call(m, b)).dim() == 3)[0]


def reference_log_probs(model: nn.Module, batches: Iterable[Batch], desc: str | None = None) -> Sequence[Tensor]:
    """Full-precision log-probabilities, one (B, C) float64 tensor per batch (``desc``: a
    progress bar with that label); for a model with per-token logits an :class:`FPReference`
    (recomputed per batch where it is read: (N, T, V) float64 does not fit in memory)."""
    batches = list(batches)
    if _per_token(model, batches):
        return FPReference(model, batches)
    return each_batch(model, batches, _log_probs, desc)


def kl_per_input(reference: Sequence[torch.Tensor], model: nn.Module, batches: Sequence[Batch],
                 desc: str | None = None, logits: list[Tensor] | None = None) -> torch.Tensor:
    """Per input, ``KL(p_ref || p_model) = sum_c p_ref (log p_ref - log p_model)``: (N,) float64.

    Per-token logits (B, T, V): the mean over the input's real tokens of the per-token KL
    (:func:`token_kl`, :func:`bayesq.forward.per_input`; padding ignored, an input without a
    real token scores 0); features of a model without a head, the Gaussian KL of
    :func:`token_kl`. Against an :class:`FPReference`, each batch is scored in parts of at
    most ``KL_PART_POSITIONS`` token positions (at least one input; the same inputs in order).

    Args:
        reference: :func:`reference_log_probs` on the same ``batches`` (for per-token logits an
            :class:`FPReference`, or (B, T, V) log-probabilities per batch).
        model: the quantised model.
        batches: the calibration batches (tensors or dicts of tensors), same order.
        desc: a progress bar over the batches with this label (None: none).
        logits: given, ``model``'s (B, C) float32 logits of each batch of row logits are
            appended to it in order, as :func:`predict` gives them (per-token logits append
            nothing): the scores' by-product, for a caller that reads them again (the output
            offset's fit, which then fits what a forward pass would give, bit for bit).

    Raises:
        ValueError: a reference of another number of batches, or a batch whose reference has
            another shape than the model's log-probabilities.
    """
    if len(reference) != len(batches):
        raise ValueError(f"reference has {len(reference)} batches of log-probabilities for {len(batches)} input "
                         "batches: pass reference_log_probs of the same batches, in the same order")

    def mismatch(i: int, ref: Tensor, got: tuple) -> ValueError:
        return ValueError(f"reference batch {i} has shape {tuple(ref.shape)} but the model gives {got} on that "
                          "batch: pass reference_log_probs of the same batches, in the same order")

    def scored(m: nn.Module, i: int, batch: Batch, ref_of: Callable[[], Tensor]) -> Tensor:
        z, mask, likelihood = predicted(m, batch)
        if mask is None:
            logq = F.log_softmax(z.reshape(-1, z.shape[-1]).double(), dim=-1)
            ref = ref_of()
            if ref.shape != logq.shape:
                raise mismatch(i, ref, tuple(logq.shape))
            if logits is not None:
                logits.append(z.detach().float())
            return (ref.exp() * (ref - logq)).sum(-1)
        ref = ref_of()
        if ref.shape != z.shape:
            raise mismatch(i, ref, tuple(z.shape))
        kl = per_input(token_kl(ref, z, mask, likelihood=likelihood), mask)
        del ref, z
        release_freed()  # a batch's (B, T, V) logits and their chunks' temporaries: heap a large vocabulary fragments
        return kl

    def one(m: nn.Module, item: tuple[int, Batch]) -> Tensor:
        i, batch = item
        if not isinstance(reference, FPReference):
            return scored(m, i, batch, lambda: reference[i])
        parts = split_batches([batch], max(1, KL_PART_POSITIONS // positions(batch)))
        return torch.cat([scored(m, i, part, lambda part=part: reference.logits_of(part)) for part in parts])

    rows = each_batch(model, list(enumerate(batches)), one, desc)
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64)


def mean_kl(reference: Sequence[torch.Tensor], model: nn.Module, batches: Sequence[Batch]) -> float:
    """Mean over inputs of :func:`kl_per_input`."""
    return float(kl_per_input(reference, model, batches).mean())


SE_RESAMPLES = 100  # bootstrap resamples of the test examples behind every standard error


def _scalars(p: Tensor, labels: Tensor, n_bins: int, repeats: int, seed: int) -> dict[str, float]:
    """Every scalar metric of :func:`prediction_summary` from (N, C) float64 probabilities."""
    loss = metrics.nll(p, labels)
    out = {"accuracy": metrics.topk_accuracy(p, labels, 1), "nll": float(loss.mean()),
           "worst5": metrics.worst_k_accuracy(p, labels, 0.05),
           "worst10": metrics.worst_k_accuracy(p, labels, 0.10),
           "cvar90": metrics.cvar(loss, 0.90), "cvar95": metrics.cvar(loss, 0.95)}
    if p.shape[1] > 5:
        out["top5"] = metrics.topk_accuracy(p, labels, 5)
    if p.shape[1] == 2:
        out["f1"] = metrics.f1_binary(p.argmax(1), labels)
    out.update(metrics.calibration_error(p, labels, n_bins, repeats=repeats, seed=seed))
    return out


def _example_values(p: Tensor, labels: Tensor) -> Tensor:
    """(N, 5) float64 per-example columns every :func:`_scalars` metric but the random-bin ones is
    a function of: top-1 confidence, correct (0/1), NLL of the label, label in the top 5 (0/1;
    0 when C <= 5) and the predicted class."""
    conf, pred = p.max(1)
    top5 = ((torch.topk(p, 5, dim=1).indices == labels[:, None]).any(1) if p.shape[1] > 5
            else torch.zeros_like(conf, dtype=torch.bool))
    return torch.stack([conf, (pred == labels).double(), metrics.nll(p, labels), top5.double(), pred.double()], 1)


def _example_scalars(values: Tensor, labels: Tensor, n_classes: int, n_bins: int) -> dict[str, float]:
    """:func:`_scalars` without random bins, from :func:`_example_values` rows (the same numbers;
    no (N, C) pass, so a bootstrap resample costs O(N log N))."""
    conf, correct, loss, top5, pred = values.T.contiguous()  # contiguous columns: the sums of _scalars
    out = {"accuracy": float(correct.mean()), "nll": float(loss.mean()),
           "worst5": metrics.least_confident_accuracy(conf, correct, 0.05),
           "worst10": metrics.least_confident_accuracy(conf, correct, 0.10),
           "cvar90": metrics.cvar(loss, 0.90), "cvar95": metrics.cvar(loss, 0.95)}
    if n_classes > 5:
        out["top5"] = float(top5.mean())
    if n_classes == 2:
        out["f1"] = metrics.f1_binary(pred.long(), labels)
    out.update(zip(("ece", "mce"), metrics.bin_errors(conf, correct,
                                                      torch.linspace(0, 1, n_bins + 1, dtype=torch.float64))))
    return out


def bootstrap_se(p: Tensor, labels: Tensor, fn, resamples: int = SE_RESAMPLES, seed: int = 0) -> dict[str, float]:
    """Bootstrap standard error over examples of every float ``fn(p, labels)`` returns.

    Resample ``N`` example indices with replacement (``torch.Generator().manual_seed(seed)``),
    recompute ``fn`` on them, ``resamples`` times; the SE of metric k is the standard deviation
    (n - 1 denominator) of its ``resamples`` values.

    Args:
        p: (N, ...) per-example rows (e.g. (N, C) probabilities); labels: (N,) int64.
        fn: ``(p, labels) -> {name: float}``.
    """
    if resamples < 2:
        raise ValueError(f"bootstrap_se needs at least 2 resamples, got {resamples}")
    g = torch.Generator().manual_seed(seed)
    draws: dict[str, list[float]] = {}
    for _ in range(resamples):
        idx = torch.randint(0, p.shape[0], (p.shape[0],), generator=g)
        for k, v in fn(p[idx], labels[idx]).items():
            draws.setdefault(k, []).append(float(v))
    return {k: float(torch.tensor(v, dtype=torch.float64).std()) for k, v in draws.items()}


def prediction_summary(logit: Tensor, labels: Tensor, n_bins: int = 15, repeats: int = 20,
                       seed: int = 0, resamples: int = SE_RESAMPLES) -> dict:
    """Accuracy, top-5, ECE / MCE (fixed and random bins), NLL, worst-k accuracy, CVaR, F1, each
    with its bootstrap standard error over the test examples.

    Args:
        logit: (N, C) logits; probabilities are ``softmax(logit)`` in float64.
        labels: (N,) int64 class ids.
        resamples: bootstrap resamples behind ``se`` (:func:`bootstrap_se`, generator seed ``seed``).

    Returns:
        Floats ``accuracy``, ``top5`` (C > 5 only), ``f1`` (C = 2 only), ``ece``, ``mce``,
        ``ece_random`` (± ``ece_random_sd`` over bin edges), ``mce_random``, ``nll`` (mean),
        ``worst5`` / ``worst10`` (accuracy on the 5 % / 10 % least confident), ``cvar90`` /
        ``cvar95`` (of the per-example NLL); ``se``: metric -> its standard error over test examples
        (test-set sampling only; every metric but the random-bin ones); and ``bins``: the fixed-bin reliability diagram as lists ``count``,
        ``accuracy``, ``confidence``.
    """
    if logit.shape[0] != labels.shape[0]:
        raise ValueError(f"{logit.shape[0]} logits but {labels.shape[0]} labels")
    p = torch.softmax(logit.double(), dim=-1)

    out: dict = _scalars(p, labels, n_bins, repeats, seed)
    # the random-bin metrics vary over bin edges too (``*_random_sd``); resampling those inside
    # every bootstrap draw would cost ``repeats`` times more, so they get no test-sampling SE
    out["se"] = bootstrap_se(_example_values(p, labels), labels,
                             lambda v, y: _example_scalars(v, y, p.shape[1], n_bins), resamples, seed)
    conf, pred = p.max(1)
    count, acc, cf = metrics.reliability_bins(conf, (pred == labels).double(),
                                              torch.linspace(0, 1, n_bins + 1, dtype=torch.float64))
    out["bins"] = {"count": count.tolist(), "accuracy": acc.tolist(), "confidence": cf.tolist()}
    return out
