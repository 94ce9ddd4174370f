"""Label-free Hutchinson estimate of the Hessian or GGN diagonal of Linear/Conv2d weights.

For each calibration input x_n the loss is the cross-entropy at the model's own argmax
prediction (a pseudo-label; no dataset labels are read), ``l_n(w) = -log p(yhat_n | x_n, w)``,
and for a symmetric matrix ``C = sum_n C_n`` (Hessian or generalized Gauss-Newton of
``sum_n l_n``, taken jointly over the weights of all given layers)

    diag(C) ~= (1 / M) sum_m v_m * (C v_m),     v_m ~ Rademacher({-1, +1})^P,

which is unbiased: ``E[v_i (C v)_i] = C_ii`` with variance ``sum_{j != i} C_ij^2`` per probe.
A language model's (B, T, V) logits give one pseudo-label per real token and
``l_n(w) = sum_{t: m_nt = 1} -log p(yhat_nt | x_n, w)`` (:mod:`bayesq.forward`; padding
contributes nothing); ``H_out`` below is then per real token.
Fresh probes are drawn for every batch, and the per-batch estimates are summed.

Matrix-vector products, with no explicit Hessian or Jacobian:

* ``curvature="hessian"``: ``H v = d/dw (g . v)`` with ``g = d/dw sum_n l_n`` kept in the graph
  (Pearlmutter; two reverse passes, works for every layer type with double backward).
* ``curvature="ggn"``: ``G v = J^T H_out J v`` with ``J = d logits / dw`` and, per input,
  ``H_out = diag(p) - p p^T`` (softmax cross-entropy at the logits, label-independent).
  ``J v`` comes from the double-vjp trick: ``J^T u`` for a dummy cotangent ``u`` kept in the
  graph, then ``J v = d/du (J^T u . v)``; ``J^T`` is one more backward pass.
  ``G`` equals the expected (true) Fisher, so its diagonal is what ``fisher_diagonal``
  estimates by sampling labels.

The Hessian can be indefinite, and any finite-M estimate (even of the PSD GGN) can have
negative entries: ``clip_curvature`` clamps them before a Laplace posterior is fitted.
The model runs in eval mode (examples do not interact); scaled-dot-product attention is forced
onto its math kernel, the one that supports double backward.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from bayesq.forward import GAUSSIAN_UNSUPPORTED, Batch, Likelihood, batch_size, eval_mode, predicted, prediction_rows

CURVATURES = ("hessian", "ggn")
Tensors = list[torch.Tensor]
MatVec = Callable[[Tensors], Tensors]


def _check_args(probes: int, curvature: str) -> None:
    """Raise ``ValueError`` naming a bad ``probes`` or ``curvature``."""
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
        raise ValueError(
            f"probes={probes!r}: pass an integer number of Rademacher probes >= 1 (e.g. 16)"
        )
    if curvature not in CURVATURES:
        raise ValueError(f"curvature={curvature!r}: choose one of {list(CURVATURES)}")


def _vjp(outputs: Sequence[torch.Tensor], inputs: Tensors, cotangents: Sequence[torch.Tensor],
         create_graph: bool = False) -> Tensors:
    """``sum_k c_k^T d outputs_k / d inputs`` per input (shaped like it); zeros where unreachable.

    The graph is retained, so the same forward pass serves every probe.
    """
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    grads: Sequence[torch.Tensor | None] = [None] * len(inputs)
    if pairs:
        try:
            grads = torch.autograd.grad([o for o, _ in pairs], inputs, [c for _, c in pairs],
                                        retain_graph=True, create_graph=create_graph, allow_unused=True)
        except RuntimeError as err:
            if "derivative for" not in str(err) or "not implemented" not in str(err):
                raise
            raise ValueError(f"Hutchinson probes differentiate the model twice, and PyTorch cannot here ({err}): "
                             "for the posterior choose a curvature without second derivatives (fisher, "
                             "empirical-fisher, kfac); for HAWQ pass traces computed another way "
                             "(bayesq.methods.Inputs(traces=...))") from None
    return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]


def _hessian_matvec(out: torch.Tensor, weights: Tensors) -> MatVec:
    """``v -> H v`` for ``H = d^2/dw^2 sum_r CE(out_r, argmax out_r)``; out is (R, C) logits
    (:func:`bayesq.forward.prediction_rows`: inputs, or real tokens)."""
    loss = F.cross_entropy(out, out.detach().argmax(-1), reduction="sum")
    grad = _vjp([loss], weights, [torch.ones_like(loss)], create_graph=True)
    return lambda v: _vjp(grad, weights, v)


def _softmax_ce_hessian(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``H_out z = p * z - p (p . z)`` per row, ``H_out = diag(p) - p p^T``; p, z are (R, C)."""
    return p * z - p * (p * z).sum(-1, keepdim=True)


def _ggn_matvec(out: torch.Tensor, weights: Tensors) -> MatVec:
    """``v -> J^T H_out J v`` with ``J = d out / dw``; out is (R, C) logits (inputs, or real tokens)."""
    u = torch.zeros_like(out, requires_grad=True)  # (R, C) dummy cotangent
    jt_u = _vjp([out], weights, [u], create_graph=True)  # linear in u
    p = torch.softmax(out.detach().double(), -1)  # (R, C)

    def matvec(v: Tensors) -> Tensors:
        jv = _vjp(jt_u, [u], v)[0]  # (R, C) = J v
        h_jv = _softmax_ce_hessian(p, jv.double()).to(out.dtype)
        return _vjp([out], weights, [h_jv])

    return matvec


_MATVECS: dict[str, Callable[[torch.Tensor, Tensors], MatVec]] = {
    "hessian": _hessian_matvec, "ggn": _ggn_matvec,
}


def _rademacher(weights: Tensors, gen: torch.Generator) -> Tensors:
    """One probe: +-1 entries shaped, typed and placed like each weight (drawn on the CPU)."""
    return [
        (torch.randint(0, 2, w.shape, generator=gen) * 2 - 1).to(device=w.device, dtype=w.dtype)
        for w in weights
    ]


def _batch_diagonal(matvec: MatVec, weights: Tensors, probes: int, gen: torch.Generator) -> Tensors:
    """``(1/M) sum_m v_m * (C v_m)`` per weight, float64."""
    acc = [torch.zeros(w.shape, dtype=torch.float64, device=w.device) for w in weights]
    for _ in range(probes):
        v = _rademacher(weights, gen)
        for a, vi, cvi in zip(acc, v, matvec(v)):
            a += (vi * cvi).double() / probes
    return acc


def hutchinson_diagonal(
    model: nn.Module,
    batches: Iterable[Batch],
    layers: dict[str, nn.Module],
    *,
    probes: int = 16,
    curvature: str = "hessian",
    seed: int = 0,
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], int]:
    """Sum over inputs of the Hutchinson-estimated curvature diagonal of the pseudo-label loss.

    Same contract as ``bayesq.curvature.fisher.fisher_diagonal``.

    Args:
        model: classifier returning (B, C) logits, or language model returning (B, T, V) logits
            (or an object with ``.logits``, see :mod:`bayesq.forward`).
        batches: calibration input batches (tensors or dicts of tensors; no labels); padded
            tokens contribute nothing.
        layers: name -> Linear/Conv2d module of ``model``.
        probes: Rademacher probes M per batch.
        curvature: ``"hessian"`` (may be indefinite) or ``"ggn"`` (= expected Fisher, PSD);
            a ``str`` Enum with these values works too.
        seed: seed of the probe generator.

    Returns:
        (curv, n): name -> float64 tensor shaped like the weight holding the estimate of
        ``sum_n diag(C_n)`` (entries may be negative, see ``clip_curvature``); and n, the
        number of inputs seen.

    Raises:
        ValueError: ``probes`` < 1, unknown ``curvature``, or empty ``batches``.
    """
    curvature = getattr(curvature, "value", curvature)  # a str Enum member from a config
    _check_args(probes, curvature)
    gen = torch.Generator().manual_seed(seed)
    names = list(layers)
    weights = [layers[n].weight for n in names]
    curv = {n: torch.zeros(w.shape, dtype=torch.float64, device=w.device) for n, w in zip(names, weights)}
    needs_grad = [w.requires_grad for w in weights]
    n_seen = 0
    try:
        for w in weights:
            w.requires_grad_(True)
        with eval_mode(model), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            desc = f"hutchinson-{curvature}"
            for batch in tqdm(batches, desc=desc, disable=not progress, leave=False):
                z, mask, likelihood = predicted(model, batch)
                if likelihood is Likelihood.GAUSSIAN:
                    raise ValueError(GAUSSIAN_UNSUPPORTED.format(what=f"hutchinson-{curvature}"))
                matvec = _MATVECS[curvature](prediction_rows(z, mask), weights)
                for n, d in zip(names, _batch_diagonal(matvec, weights, probes, gen)):
                    curv[n] += d
                n_seen += batch_size(batch)
    finally:
        for w, req in zip(weights, needs_grad):
            w.requires_grad_(req)
    if n_seen == 0:
        raise ValueError(
            "empty calibration set: the posterior needs at least one unlabelled input batch"
        )
    return curv, n_seen


def clip_curvature(curv: dict[str, torch.Tensor], floor: float = 0.0) -> dict[str, torch.Tensor]:
    """``max(c_i, floor)`` per entry: a PSD-compatible diagonal for ``fit_diagonal_posterior``.

    Negative entries come from negative curvature (Hessian) or from probe noise; the paper
    clamps them (App. 4, "Fisher vs. Hessian"). Raises ``ValueError`` for a NaN/Inf entry.
    """
    for name, c in curv.items():
        if not torch.isfinite(c).all():
            raise ValueError(
                f"curvature of layer '{name}' has NaN/Inf entries; check the model's logits "
                "on the calibration data"
            )
    return {name: c.clamp(min=floor) for name, c in curv.items()}
