"""Output offset: the output layer's bias refitted so that the quantised model's mean prediction
on the calibration and held-out selection inputs is the full-precision model's.

Quantisation errors add up through the network into a shift of the logits that the bias
correction (:mod:`bayesq.bias_correction`) cannot see: it moves each layer's mean output back
for that layer's own weight error on full-precision inputs, not for the errors of the layers
before it. On the embedded MiniLM at 3.0 bits, BayesQ's logit margin of the second class moved by
+0.08 on average, +0.15 next to the decision boundary, so that 48 of the 57 test inputs whose
prediction changed went to that class (docs/findings.md).

The offset ``c`` added to the logits minimises the mean KL to the full-precision model over the
``N`` calibration inputs and, where there are any, the inputs held out to select among
candidates (both sets together: on lite0-fmnist at 3.0 bits its ten offsets fitted on both sets
had a test KL lower than on calibration alone at 4 of 5 seeds, resolved, and it was not worse on
MiniLM: docs/method.md 18h),

    c* = argmin_c  L(c),   L(c) = 1/N sum_n KL(p_n || softmax(z_n + c)),                     (1)

with ``p_n = softmax(z^FP_n)`` and ``z_n = z^Q_n`` the quantised model's (C,) logits. ``L`` is
convex (a mean of log-sum-exp terms minus a linear one), with gradient

    grad L(c) = 1/N sum_n softmax(z_n + c) - 1/N sum_n p_n,

so at the optimum the quantised model's mean predicted distribution equals the full-precision
one's. ``L`` is unchanged by a constant added to every class; the gradient sums to zero, so the
iterates from ``c = 0`` stay on ``sum(c) = 0`` and the solution returned is the one there.

What is applied is half of it, ``c = SHRINK c*`` with ``SHRINK = 1/2``, so that the offset stays
safe when the inputs the model serves do not look like the calibration inputs. The offset that
serves them best lies anywhere between none (the shift was calibration's own) and ``c*`` (it is
the model's everywhere). Along ``c*``, with ``L`` quadratic, applying ``s c*`` when the served
optimum is ``t c*`` changes the served loss by ``g ((s - t)^2 - t^2)`` against no offset (``g``:
the gain of ``c*`` where ``t = 1``). ``s = 1/2`` is the minimax choice over ``t`` in ``[0, 1]``:
it keeps 3/4 of the gain where calibration matches deployment and is never worse than no offset
for ``t >= 1/4``, where the full fit needs ``t >= 1/2``. Measured (docs/method.md 18h,
``reports/shift.md``): MiniLM calibrated on movie reviews and serving tweets, the full fit raised
the KL to the FP model by 7.6 % (resolved), half of it by nothing; restricting the fit to the
classes that calibration supports lost gain on a 1,000-class model calibrated on two of them.

Where it goes, with no new stored parameter: the bias of the Linear layer whose output tensor is
the model's logits (found by identity in one forward pass). No offset, with the reason in
:attr:`OutputOffset.skipped`, where the model returns per-token (B, T, V) logits (a language
model: V offsets on one calibration set are not what this is for), where no Linear's output is
the logits tensor itself (a head that transforms them after its last Linear), or where that
layer has no bias.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from bayesq.context import FPOutputs
from bayesq.evaluation import predict
from bayesq.forward import Batch, batch_size, hooked_call, output_logits

LBFGS_ITERS = 100  # most iterations of the convex fit (1)
SHRINK = 0.5  # the share of the fit (1) applied: minimax between "the shift is calibration's" and "the model's"


@dataclass(frozen=True)
class OutputOffset:
    """The offset (1) and the bias that absorbs it.

    Attributes:
        layer: name of the output Linear layer whose bias holds the offset (None: skipped).
        shift: (C,) float64 offset applied, ``shrink c*`` of (1), summing to zero (None: skipped).
        skipped: why there is no offset ("" when there is one).
        kl_before, kl_after: ``L(0)`` and ``L(shift)`` on the inputs it was fitted on (nats per input).
        inputs: how many inputs it was fitted on (calibration and selection; 0: skipped).
    """

    layer: str | None
    shift: torch.Tensor | None
    skipped: str = ""
    kl_before: float = float("nan")
    kl_after: float = float("nan")
    inputs: int = 0

    @property
    def fitted(self) -> bool:
        """Whether there is an offset (not skipped): what :meth:`apply` adds."""
        return self.layer is not None and self.shift is not None

    def apply(self, qmodel: nn.Module) -> None:
        """Add :attr:`shift` to the output layer's bias of ``qmodel`` in place (nothing when skipped)."""
        if not self.fitted:
            return
        bias = qmodel.get_submodule(self.layer).bias
        with torch.no_grad():
            bias.add_(self.shift.to(device=bias.device, dtype=bias.dtype))


def mean_kl(fp_logits: torch.Tensor, q_logits: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``L(c)`` of (1): the mean over rows of ``KL(softmax(fp) || softmax(q + c))``, float64
    scalar, for (N, C) logits and a (C,) offset."""
    log_p = torch.log_softmax(fp_logits.double(), dim=-1)
    log_q = torch.log_softmax(q_logits.double() + c, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def logit_offset(fp_logits: torch.Tensor, q_logits: torch.Tensor, iters: int = LBFGS_ITERS) -> torch.Tensor:
    """``c*`` of (1) by L-BFGS with a strong-Wolfe line search from ``c = 0`` in float64.

    Args:
        fp_logits, q_logits: (N, C) logits of the full-precision and the quantised model on the
            same inputs, any float dtype.

    Returns:
        (C,) float64 offset with ``sum(c*) = 0`` (up to rounding).

    Raises:
        ValueError: logits that are not (N, C) of one shape with N >= 1, or not finite.
    """
    if fp_logits.ndim != 2 or fp_logits.shape != q_logits.shape or len(fp_logits) == 0:
        raise ValueError(f"need two (N, C) logit tensors of one shape with N >= 1, got {tuple(fp_logits.shape)} "
                         f"and {tuple(q_logits.shape)}")
    if not (torch.isfinite(fp_logits).all() and torch.isfinite(q_logits).all()):
        raise ValueError("non-finite logits: the output offset needs finite outputs of both models on every "
                         "calibration input")
    fp, q = fp_logits.detach().double().cpu(), q_logits.detach().double().cpu()
    c = torch.zeros(fp.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([c], max_iter=iters, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = mean_kl(fp, q, c)
        loss.backward()
        return loss

    opt.step(closure)
    out = c.detach()
    return out - out.mean()


def output_layer(model: nn.Module, batch: Batch) -> tuple[str | None, str]:
    """(name of the Linear layer whose output tensor ``model`` returns as its logits on ``batch``,
    "") or (None, why there is none to offset), from one forward pass in eval mode. The layers'
    outputs are held by weak references only, so the pass needs no more memory than a plain one
    (the Linear outputs of one BERT-base batch of 64 x 128 tokens: about 2.7 GB in float32)."""
    outputs: dict[int, tuple[str, weakref.ref]] = {}  # id -> (layer, weak reference to its output)

    def hook(name):
        def post(mod, inputs, output):
            outputs[id(output)] = (name, weakref.ref(output))
        return post

    z = output_logits(hooked_call(model, batch, post=[(m, hook(n)) for n, m in model.named_modules()
                                                      if isinstance(m, nn.Linear)]))
    if z.dim() != 2:
        return None, f"the model returns logits of shape {tuple(z.shape)}, not one row of class logits per input"
    hit = outputs.get(id(z))
    if hit is None or hit[1]() is not z:  # a dead reference: another tensor's id, reused
        return None, "no Linear layer's output is the model's logits tensor (the head transforms it further)"
    name = hit[0]
    if model.get_submodule(name).bias is None:
        return None, f"the output layer {name} has no bias to hold the offset"
    return name, ""


def fit_output_offset(model: nn.Module, qmodel: nn.Module, calibration: Iterable[Batch],
                      progress: bool = False, *, selection: Iterable[Batch] | None = None,
                      fp: FPOutputs | None = None, scored_q: Sequence[torch.Tensor] | None = None,
                      shrink: float = SHRINK) -> OutputOffset:
    """The :class:`OutputOffset` of ``qmodel`` (the quantised copy of ``model``): ``shrink c*``,
    ``c*`` fitted (1) on the calibration inputs and the held-out ``selection`` inputs together:
    the output layer found on the first calibration batch, then both models' logits on every
    batch (a progress bar each with ``progress``). Neither model is changed.

    Args:
        selection: inputs held out of ``calibration`` (None or empty: the calibration inputs alone).
        fp: the FP model's outputs where the run already has them (:class:`bayesq.context.FPOutputs`):
            its log-probabilities on the scored inputs (read for ``selection``: (1) reads them
            through a softmax only, so log-probabilities serve as logits) and its logits on
            ``calibration`` (float32 logits as :func:`bayesq.evaluation.predict` gives give the
            same offset bit for bit); what it does not hold is computed by a forward pass.
        scored_q: ``qmodel``'s logits or log-probabilities on the scored inputs (``selection``
            when there are some, else ``calibration``), one (B, C) tensor per batch in order,
            where the caller has them (the selection's scores), instead of a forward pass.

    Raises:
        ValueError: empty calibration set; given outputs of another number of rows than their
            inputs.
    """
    batches = list(calibration)
    if not batches:
        raise ValueError("empty calibration set: the output offset is fitted on calibration inputs "
                         "(or set quant.output_offset: false)")
    layer, why = output_layer(qmodel, batches[0])
    if layer is None:
        return OutputOffset(None, None, why)
    held = list(selection or ())
    given_fp = fp.logits if fp is not None else None
    z_fp = _given_or_predicted(given_fp, model, batches, "FP", progress, "calibration")
    q = _given_or_predicted(None if held else scored_q, qmodel, batches, "quantised", progress, "calibration")
    if held:
        fp_held = _given_or_predicted(fp.known_log_probs() if fp is not None else None, model, held, "FP", progress,
                                      "selection")
        q_held = _given_or_predicted(scored_q, qmodel, held, "quantised", progress, "selection")
        z_fp, q = torch.cat([z_fp, fp_held]), torch.cat([q, q_held])
    if not 0.0 <= shrink <= 1.0:
        raise ValueError(f"shrink is the share of the fitted offset applied, in [0, 1]; got {shrink}")
    c = shrink * logit_offset(z_fp, q)
    zero = torch.zeros_like(c)
    # a KL is >= 0; the float64 sum of its terms can round to -1e-17 when the two match
    before, after = (max(0.0, float(mean_kl(z_fp, q, s))) for s in (zero, c))
    return OutputOffset(layer, c, "", before, after, len(z_fp))


def _given_or_predicted(given: Sequence[torch.Tensor] | None, model: nn.Module, batches: list[Batch], which: str,
                        progress: bool, inputs: str) -> torch.Tensor:
    """(N, C) float64: the caller's per-batch logits ``given`` on ``batches`` (the ``inputs``
    ones; checked against their count), else ``model``'s by a forward pass."""
    if given is None:
        return predict(model, batches, f"output offset: {which} logits, {inputs}" if progress else None).double()
    out = torch.cat([z.detach().reshape(-1, z.shape[-1]).double().cpu() for z in given])
    n = sum(batch_size(b) for b in batches)
    if len(out) != n:
        raise ValueError(f"{which} logits on the {inputs} inputs have {len(out)} rows for {n} {inputs} inputs: "
                         f"pass one (B, C) tensor per {inputs} batch, in order (or None to compute them)")
    return out
