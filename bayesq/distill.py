"""Posterior-predictive distillation of the stored quantiser parameters (calibration only).

The teacher is the posterior predictive at temperature ``tau``:

    p_T(y | x) = 1/M sum_m softmax(f(x; w_m) / tau),   w_m = mu + s * sigma * eps_m,  eps_m ~ N(0, I)

and the student is the quantised model with its integer codes frozen.  Only what the stored
format keeps besides the codes is trained: the per-group scales and integer zero-points of
uniform grids (zero-points through a straight-through rounding), the entries of look-up tables
and, optionally, the layers' biases.  The loss is

    L = tau^2 * KL(p_T || softmax(f_q(x) / tau))     (mean over the batch)

minimised with AdamW (no weight decay) over the unlabelled calibration batches.  Afterwards the
scales and table entries are rounded to their stored precision and the zero-points to integers
in [0, 2^b - 1], so the stored model has exactly the bits it had before.

The calibration inputs are first split by the seed into a fit part and a held-out part
(``holdout`` of the inputs); the teacher, the tempering and the training see only the fit part.
The distilled encoding is kept only if it lowers the held-out

    KL_held(q) = 1/|H| sum_{x in H} KL(softmax(f(x)) || softmax(f_q(x)))     (temperature 1)

of the full-precision model ``f`` against the quantised one, strictly; otherwise the undistilled
encoding is returned unchanged, so distillation cannot make the model worse on held-out inputs.

``s`` tempers the posterior.  A Laplace posterior over millions of weights fitted on a few
hundred inputs is dominated by its prior for most weights (their sampled networks predict at
chance), so ``s`` is the largest value on a log grid whose samples still agree with the mean
model's argmax on ``agreement`` of the calibration inputs (label-free); ``s = 1`` is the
untempered posterior, ``s = 0`` the mean model itself.

A language model's per-token logits (B, T, V) (:mod:`bayesq.forward`): every KL above is per
real token (padding ignored), an input's KL the mean over its real tokens, and the agreement is
counted over real tokens. The teacher of one real token is stored as its ``TEACHER_TOP_K``
largest probabilities and the rest's total mass (:class:`TopKTeacher`): dense float32 teacher
probabilities of a calibration set, N * T * V * 4 bytes, do not fit in memory (128 inputs of 512
tokens over GPT-2's 50257 words: 13 GB; top-128: 67 MB), and the KL the student is fitted on is
then the KL of the two predictives on the partition {each of the top-k words, every other word}
(exact when the teacher's mass lies in its top k, a lower bound of the full KL otherwise). The
held-out KL is exact: the full-precision side is recomputed batch by batch.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F
from tqdm.auto import tqdm

from bayesq.config import DistillConfig
from bayesq.evaluation import token_kl
from bayesq.forward import (
    Batch, Likelihood, batch_size, eval_mode, first_inputs, logits, output_logits, per_input, predicted,
    prediction_rows, predictions, token_mask,
)
from bayesq.posterior import Posterior
from bayesq.result import QuantizedWeight, quantized_copy

SCALE_GRID = tuple(2.0**-k for k in range(0, 17))  # candidate tempering factors s, largest first
TEACHER_TOP_K = 128  # probabilities stored per real token of a per-token teacher (TopKTeacher)


@dataclass(frozen=True)
class DistillResult:
    """What :func:`distill` returns.

    Which encoding is kept: the distilled one when ``accepted``, else the undistilled one
    (``weights`` are then the very QuantizedWeight objects passed in and ``biases`` is empty).

    Attributes:
        weights: name -> QuantizedWeight with the same codes and bit-widths: the trained books if
            ``accepted``, else the input encodings unchanged.
        biases: name -> trained bias (float32) of the layers whose bias was trained, if
            ``accepted`` (else empty: the model's biases stay).
        sample_scale: tempering factor ``s`` of the teacher's posterior samples.
        teacher_agreement: share of the fit part's calibration inputs (real tokens, for per-token
            logits) where the teacher's argmax equals the mean model's.
        loss_first, loss_last: mean distillation loss over the first / last 10% of the steps.
        steps: optimiser steps taken.
        seconds: wall time of the whole distillation (teacher and held-out check included).
        accepted: whether the distilled parameters were kept: ``kl_after < kl_before`` when
            ``cfg.accept``, always True when not (ablation).
        kl_before, kl_after: mean KL(p_FP(y|x) || p_quantised(y|x)) in nats (temperature 1) over
            the held-out calibration inputs, of the undistilled / distilled encoding.
    """

    weights: dict[str, QuantizedWeight]
    biases: dict[str, torch.Tensor]
    sample_scale: float
    teacher_agreement: float
    loss_first: float
    loss_last: float
    steps: int
    seconds: float
    accepted: bool
    kl_before: float
    kl_after: float


def _sampled_weights(posterior: Posterior, scale: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One draw ``mu + scale * sigma * eps`` per layer (float64, diagonal part of the posterior)."""
    return {n: m + scale * posterior.std(n) * torch.randn(m.shape, generator=gen, dtype=m.dtype).to(m.device)
            for n, m in posterior.mean.items()}


def _forward(model: nn.Module, over: Mapping[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """(B, C) (or per-token (B, T, V)) logits of ``model`` on ``batch`` with the named parameters
    replaced by ``over``."""
    if isinstance(batch, Mapping):
        out = functional_call(model, dict(over), args=(), kwargs=dict(batch), strict=False)
    else:
        out = functional_call(model, dict(over), args=(batch,), strict=False)
    return output_logits(out)


def _logits_with(model: nn.Module, weights: Mapping[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """(B, C) (or (B, T, V)) logits of ``model`` with the ``<layer>.weight`` tensors replaced by ``weights``."""
    over = {f"{n}.weight": w.to(model.get_submodule(n).weight.dtype) for n, w in weights.items()}
    return _forward(model, over, batch)


def _take(batch: Batch, rows: torch.Tensor) -> Batch:
    """The examples ``rows`` ((k,) int64) of a tensor batch, or of every tensor of a dict batch."""
    if isinstance(batch, Mapping):
        return {key: v[rows.to(v.device)] for key, v in batch.items()}
    return batch[rows.to(batch.device)]


def split_calibration(batches: Sequence[Batch], holdout: float, seed: int = 0) -> tuple[list[Batch], list[Batch]]:
    """Split the calibration inputs into a fit part and a held-out part, deterministically by ``seed``.

    Of the ``N`` inputs, the first ``n_held = round(holdout * N)`` (Python's ``round``, clamped to
    [1, N - 1]) of a permutation drawn from ``torch.Generator().manual_seed(seed)`` are held out.
    Every batch is cut into its fit rows and its held-out rows (order kept, empty parts dropped),
    so tensor batches stay tensors of the same trailing shape and dict batches keep their keys
    (all values indexed along dim 0, as :func:`bayesq.forward.first_inputs` slices them).

    Returns:
        ``(fit, held)``: two lists of batches of the input's kind; together they hold every
        input exactly once.

    Raises:
        ValueError: ``holdout`` not in (0, 1), or fewer than 2 inputs.
    """
    if isinstance(holdout, bool) or not 0 < holdout < 1:
        raise ValueError(f"distill.holdout = {holdout!r}: must be in (0, 1) "
                         "(share of calibration inputs held out)")
    sizes = [batch_size(b) for b in batches]
    n = sum(sizes)
    if n < 2:
        raise ValueError(f"distill: the calibration set has {n} input(s), but distillation's held-out check needs "
                         "at least 2 (one to fit, one held out): pass more calibration inputs")
    n_held = min(n - 1, max(1, round(holdout * n)))
    held = torch.zeros(n, dtype=torch.bool)
    held[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:n_held]] = True
    fit_part, held_part, start = [], [], 0
    for batch, k in zip(batches, sizes):
        mask = held[start:start + k]
        start += k
        for part, rows in ((fit_part, ~mask), (held_part, mask)):
            if bool(rows.any()):
                part.append(_take(batch, torch.nonzero(rows).squeeze(1)))
    return fit_part, held_part


def _encoding(model: nn.Module, weights: Mapping[str, QuantizedWeight],
              biases: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Parameter overrides running an encoding: dequantised weights and biases, cast to the layers'
    dtype and device (the values :func:`bayesq.result.quantized_copy` / :func:`apply_distilled` store)."""
    over = {}
    for n, qw in weights.items():
        w = model.get_submodule(n).weight
        over[f"{n}.weight"] = qw.dequantize().to(device=w.device, dtype=w.dtype)
    for n, b in biases.items():
        ref = model.get_submodule(n).bias
        over[f"{n}.bias"] = b.to(device=ref.device, dtype=ref.dtype)
    return over


def _mean_kls(model: nn.Module, overs: Sequence[Mapping[str, torch.Tensor]], batches: Sequence[Batch]) -> list[float]:
    """Per parameter override in ``overs``, ``1/N sum_x KL(p_FP(.|x) || p_over(.|x))`` in nats (float64)
    over the N inputs of ``batches``, batch by batch (the full-precision side computed once per batch,
    nothing kept across batches); per-token logits: each input's KL is the mean over its real tokens."""
    totals, n = [0] * len(overs), 0
    with torch.no_grad():
        for b in batches:
            z = _forward(model, {}, b)
            mask = token_mask(b, z)
            log_p = F.log_softmax(z.double(), dim=-1) if mask is None else None
            for k, over in enumerate(overs):
                zq = _forward(model, over, b)
                if mask is None:
                    totals[k] += float(F.kl_div(F.log_softmax(zq.double(), dim=-1), log_p, reduction="sum",
                                                log_target=True))
                else:
                    totals[k] += float(per_input(token_kl(z, zq, mask), mask).sum())
            n += len(z)
    return [t / n for t in totals]


def predictive_kl(model: nn.Module, weights: Mapping[str, QuantizedWeight], batches: Sequence[Batch],
                  biases: Mapping[str, torch.Tensor] | None = None) -> float:
    """Mean KL(p_FP(y|x) || p_quantised(y|x)) in nats (temperature 1, float64) over the inputs of ``batches``
    (per-token logits: each input's KL the mean over its real tokens, padding ignored).

    ``p_FP`` is ``model``'s softmax; ``p_quantised`` that of ``model`` with the layers in
    ``weights`` dequantised and the biases in ``biases`` (name -> (out,) tensor) replaced;
    ``model`` is not modified.
    """
    return _mean_kls(model, [_encoding(model, weights, biases or {})], batches)[0]


def sample_agreement(model: nn.Module, posterior: Posterior, batches: Sequence[Batch], scale: float,
                     samples: int, seed: int) -> float:
    """Mean share of inputs (of real tokens, for per-token logits) on which a tempered posterior
    sample predicts the mean model's argmax."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ref = [(prediction_rows(z, mask).argmax(-1), mask) for z, mask in (predictions(model, b) for b in batches)]
        agree, n = 0, 0
        for _ in range(samples):
            w = _sampled_weights(posterior, scale, gen)
            for b, (r, mask) in zip(batches, ref):
                agree += int((prediction_rows(_logits_with(model, w, b), mask).argmax(-1) == r).sum())
                n += len(r)
    return agree / max(n, 1)


def tempering_scale(model: nn.Module, posterior: Posterior, batches: Sequence[Batch], agreement: float,
                    samples: int = 2, seed: int = 0) -> float:
    """Largest ``s`` in :data:`SCALE_GRID` whose samples agree with the mean model on >= ``agreement``.

    Bisection over the grid (agreement falls as ``s`` grows); 0.0 when even the smallest fails.
    """
    lo, hi = 0, len(SCALE_GRID)  # invariant: SCALE_GRID[hi] passes (hi = len: "0" passes), lo-1 fails
    while lo < hi:
        mid = (lo + hi) // 2
        if sample_agreement(model, posterior, batches, SCALE_GRID[mid], samples, seed) >= agreement:
            hi = mid
        else:
            lo = mid + 1
    return SCALE_GRID[hi] if hi < len(SCALE_GRID) else 0.0


@dataclass(frozen=True)
class TopKTeacher:
    """A per-token teacher of one batch: for each of its R real tokens the ``k`` largest teacher
    probabilities and their words; the rest, ``1 - sum(probs)``, is one more outcome.

    Attributes:
        probs: (R, k) float32, descending per row.
        index: (R, k) int32 word ids of ``probs``.
        mask: (B, T) bool real tokens (rows in example then token order).
    """

    probs: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def of(cls, probs: torch.Tensor, mask: torch.Tensor, k: int = TEACHER_TOP_K) -> TopKTeacher:
        """From a batch's dense (B, T, V) teacher probabilities and its (B, T) token mask."""
        top = torch.topk(probs[mask], min(k, probs.shape[-1]), dim=-1)
        return cls(top.values.float(), top.indices.int(), mask)

    def argmax(self, dim: int = -1) -> torch.Tensor:
        """(R,) the teacher's most probable word per real token (``dim``: as a tensor's, -1 only)."""
        return self.index[:, 0].long()

    def kl(self, z: torch.Tensor, tau: float) -> torch.Tensor:
        """(B,) per input, the mean over its real tokens of ``KL(teacher || softmax(z / tau))`` on the
        partition {each stored word, every other word}; ``z``: the student's (B, T, V) logits.

            KL_t = sum_j p_j log(p_j / q_j) + p_rest log(p_rest / q_rest),
            p_rest = 1 - sum_j p_j,  q_rest = sum_{v not stored} q_v

        (no rest term when every word is stored, k = V)."""
        logq = F.log_softmax(prediction_rows(z, self.mask).float() / tau, dim=-1)  # (R, V)
        idx = self.index.long()
        q_top = logq.gather(1, idx)
        kl = (torch.xlogy(self.probs, self.probs) - self.probs * q_top).sum(-1)
        if idx.shape[1] < logq.shape[1]:
            p_rest = (1 - self.probs.sum(-1)).clamp_min(0)
            q_rest = logq.scatter(1, idx, float("-inf")).logsumexp(-1)
            kl = kl + torch.xlogy(p_rest, p_rest) - p_rest * q_rest
        return per_input(kl, self.mask)


def _sample_generator(seed: int, m: int) -> torch.Generator:
    """The generator of a per-token teacher's draw ``m`` (drawn again for every batch)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + m)


def teacher_probs(model: nn.Module, posterior: Posterior, batches: Sequence[Batch], scale: float,
                  samples: int, tau: float, seed: int = 0) -> list[torch.Tensor | TopKTeacher]:
    """Per batch, (B, C) float32 ``1/M sum_m softmax(f(x; w_m) / tau)`` (M = ``samples``).

    Per-token logits (B, T, V): a :class:`TopKTeacher` per batch, the same average over M draws,
    each draw taken again for each batch from its own generator (no draw is kept across
    batches: M copies of the weights do not fit either), the dense (B, T, V) average held for
    one batch at a time.
    """
    with torch.no_grad():
        per_token = bool(batches) and predictions(model, first_inputs(batches, 1)[0])[1] is not None
    if per_token:
        return [_token_teacher(model, posterior, b, scale, samples, tau, seed) for b in batches]
    gen = torch.Generator().manual_seed(seed)
    out = [0.0 for _ in batches]
    with torch.no_grad():
        for _ in range(samples):
            w = _sampled_weights(posterior, scale, gen) if scale > 0 else None
            for i, b in enumerate(batches):
                z = logits(model, b) if w is None else _logits_with(model, w, b)
                out[i] = out[i] + F.softmax(z.float() / tau, dim=-1) / samples
    return out


def _token_teacher(model: nn.Module, posterior: Posterior, batch: Batch, scale: float, samples: int, tau: float,
                   seed: int) -> TopKTeacher:
    """:func:`teacher_probs` of one batch of per-token logits, as a :class:`TopKTeacher`."""
    total, mask = 0.0, None
    with torch.no_grad():
        for m in range(samples):
            w = _sampled_weights(posterior, scale, _sample_generator(seed, m)) if scale > 0 else None
            z = _forward(model, {}, batch) if w is None else _logits_with(model, w, batch)
            mask = token_mask(batch, z)
            total = total + F.softmax(z.float() / tau, dim=-1) / samples
    return TopKTeacher.of(total, mask)


class _Trainable(nn.Module):
    """The trainable part of one layer's stored encoding; ``weight()`` decodes differentiably."""

    def __init__(self, qw: QuantizedWeight) -> None:
        super().__init__()
        self.qw = qw
        self.books = nn.ModuleDict({str(b): nn.ParameterDict({k: nn.Parameter(v.float().clone())
                                                             for k, v in book.trainable().items()})
                                    for b, book in qw.books.items()})

    def weight(self) -> torch.Tensor:
        """Weight of ``blocks.shape`` (float32) from the frozen codes and the trainable books."""
        qw = self.qw
        parts, order = [], []
        for b, book in qw.books.items():
            sel = torch.nonzero(qw.group_bits == b).squeeze(1)
            parts.append(book.decode_trained(dict(self.books[str(b)]), qw.indices(sel)))
            order.append(sel)
        w = qw.blocks.from_groups(torch.cat(parts)[torch.argsort(torch.cat(order))])
        if qw.col_scale is None:
            return w
        n_out = qw.blocks.shape[0]
        s = qw.col_scale.repeat_interleave(n_out // qw.col_scale.shape[0], dim=0).float()
        return (w.reshape(n_out, -1) / s).reshape(qw.blocks.shape)

    def stored(self, scale_bits: int, lut_bits: int) -> QuantizedWeight:
        """The encoding with the trained books rounded to their stored precision."""
        books, codes = dict(self.qw.books), self.qw.codes.to(torch.int64, copy=True)  # written below
        for b, book in self.qw.books.items():
            params = {k: v.detach().double() for k, v in self.books[str(b)].items()}
            if params:
                sel = torch.nonzero(self.qw.group_bits == b).squeeze(1)
                books[b], codes[sel] = book.from_trained(params, codes[sel], scale_bits, lut_bits)
        return QuantizedWeight(self.qw.blocks, self.qw.group_bits, codes, books, self.qw.col_scale)


def _train(model: nn.Module, weights: Mapping[str, QuantizedWeight], batches: Sequence[Batch],
           teacher: Sequence[torch.Tensor], cfg: DistillConfig, scale_bits: int, lut_bits: int,
           progress: bool = False) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor], list[float]]:
    """AdamW on ``tau^2 KL(teacher || softmax(f_q / tau))`` (mean over the batch's inputs; per-token
    logits: of each input's mean over its real tokens, :meth:`TopKTeacher.kl`), cycling over ``batches``.

    Returns the trained encodings rounded to their stored precision, the trained biases
    (float32 copies; empty unless ``cfg.train_bias``) and the per-step losses.
    """
    modules = dict(model.named_modules())
    layers = nn.ModuleDict({n.replace(".", "/"): _Trainable(qw) for n, qw in weights.items()})
    params = list(layers.parameters())
    biases: dict[str, nn.Parameter] = {}
    if cfg.train_bias:
        for n in weights:
            bias = getattr(modules[n], "bias", None)
            if bias is not None:
                biases[n] = nn.Parameter(bias.detach().clone())
        params += list(biases.values())
    trained = {id(modules[n].weight) for n in weights}  # a weight tied elsewhere follows its layer's
    frozen = {k: v.detach() for k, v in itertools.chain(model.named_parameters(), model.named_buffers())
              if id(v) not in trained}
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    losses = []
    order = itertools.cycle(range(len(batches)))
    bar = tqdm(range(cfg.steps), desc="distil scales", unit="step", disable=not progress, leave=False)
    for _ in bar:
        i = next(order)
        over = dict(frozen)
        over.update({f"{n}.weight": layers[n.replace(".", "/")].weight().to(modules[n].weight.dtype)
                     for n in weights})  # the codes train in float32; the model may run in float64
        over.update({f"{n}.bias": b for n, b in biases.items()})
        z = _forward(model, over, batches[i])
        if isinstance(teacher[i], TopKTeacher):  # per-token logits: mean over inputs of the token-mean KL
            loss = cfg.temperature**2 * teacher[i].kl(z, cfg.temperature).mean()
        else:
            logq = F.log_softmax(z.float() / cfg.temperature, dim=-1)
            loss = cfg.temperature**2 * F.kl_div(logq, teacher[i], reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)
    out = {n: layers[n.replace(".", "/")].stored(scale_bits, lut_bits) for n in weights}
    return out, {n: b.detach().clone() for n, b in biases.items()}, losses


def distill(
    model: nn.Module, weights: Mapping[str, QuantizedWeight], posterior: Posterior,
    batches: Sequence[Batch], cfg: DistillConfig = DistillConfig(), *, scale_bits: int = 16,
    lut_bits: int = 16, seed: int = 0, progress: bool = False,
) -> DistillResult:
    """Fit the stored scales / zero-points / LUT entries (and biases) to the posterior teacher.

    The calibration inputs are split by ``seed`` (:func:`split_calibration`, ``cfg.holdout``
    held out); the teacher, its tempering and the fit use the fit part.  The distilled encoding
    is kept only if its mean KL(p_FP || p_quantised) on the held-out part is strictly below the
    undistilled encoding's (``cfg.accept``; always kept when false); otherwise the result holds
    the input ``weights`` unchanged and no biases.

    Args:
        model: the full-precision model (its weights are the posterior mean); put in eval mode,
            its parameters are not modified.
        weights: name -> QuantizedWeight of every quantised layer (codes stay fixed).
        posterior: the posterior the teacher samples from (its diagonal ``variance``).
        batches: unlabelled calibration batches (tensors or dicts of tensors); the fit part is
            cycled for ``cfg.steps`` steps.
        scale_bits, lut_bits: stored precision of scales and table entries (``quant``).
        seed: seeds the split, the tempering probe and the teacher's draws.
        progress: a bar over the steps (with the running loss).

    Ctrl-C stops it with ``KeyboardInterrupt``: the fit trains copies, so ``model`` and
    ``weights`` are as they were.

    Raises:
        ValueError: no calibration inputs, fewer than 2, or a quantised layer the model does
            not have.
    """
    batches = list(batches)
    if not batches or sum(batch_size(b) for b in batches) == 0:
        raise ValueError("distillation needs calibration inputs: pass at least one non-empty batch")
    with torch.no_grad(), eval_mode(model):
        if predicted(model, first_inputs(batches, 1)[0])[2] is Likelihood.GAUSSIAN:
            raise ValueError("the model has no head (it returns features, read with a Gaussian likelihood) and "
                             "distillation matches a softmax teacher: quantise it without distillation")
    missing = sorted(set(weights) - {n for n, _ in model.named_modules()})
    if missing:
        raise ValueError(f"distill: the model has no layer(s) {missing[:5]}; pass the model the weights came from")
    fit, held = split_calibration(batches, cfg.holdout, seed)
    start = time.perf_counter()
    model.eval()
    probe = first_inputs(fit, 256)
    scale = tempering_scale(model, posterior, probe, cfg.agreement, samples=2, seed=seed)
    teacher = teacher_probs(model, posterior, fit, scale, cfg.samples, cfg.temperature, seed)
    with torch.no_grad():
        mean_pred = [prediction_rows(*predictions(model, b)).argmax(-1) for b in fit]
    agreement = float(sum(int((t.argmax(-1) == r).sum()) for t, r in zip(teacher, mean_pred))
                      / sum(len(r) for r in mean_pred))
    out, biases, losses = _train(model, weights, fit, teacher, cfg, scale_bits, lut_bits, progress)

    kl_before, kl_after = _mean_kls(model, [_encoding(model, weights, {}), _encoding(model, out, biases)], held)
    accepted = kl_after < kl_before or not cfg.accept
    if not accepted:
        out, biases = dict(weights), {}
    tail = max(1, len(losses) // 10)
    return DistillResult(
        weights=out, biases=biases, sample_scale=scale, teacher_agreement=agreement,
        loss_first=sum(losses[:tail]) / tail if losses else math.nan,
        loss_last=sum(losses[-tail:]) / tail if losses else math.nan,
        steps=len(losses), seconds=time.perf_counter() - start,
        accepted=accepted, kl_before=kl_before, kl_after=kl_after,
    )


def apply_distilled(model: nn.Module, result: DistillResult) -> nn.Module:
    """Copy of ``model`` running the kept encoding: the distilled one (dequantised weights, trained
    biases) if ``result.accepted``, else the undistilled one (``result.weights`` are then the input
    encodings and ``result.biases`` is empty, so the model's biases stay)."""
    qmodel = quantized_copy(model, result.weights)
    with torch.no_grad():
        for n, b in result.biases.items():
            qmodel.get_submodule(n).bias.copy_(b)
    return qmodel
