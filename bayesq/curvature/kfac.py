"""Label-free K-FAC (Kronecker-factored) curvature of Linear/Conv2d weights.

For a layer with weight ``W`` (out x in; a Conv2d weight (out, in/groups, kh, kw) is read as
out x (in/groups*kh*kw) unfolded patches), flattened row-major (output channel first), the
per-example Fisher / generalised Gauss-Newton is approximated by a Kronecker product

    F_mean = (1/n) sum_n E_y[ vec(dL_n/dW) vec(dL_n/dW)^T ]  ~  G (x) A,
    A = (1/n) sum_n  sum_t a_{n,t} a_{n,t}^T                 (d_in, d_in)
    G = (1/n) sum_n  (1/T) sum_t E_y[ g_{n,t} g_{n,t}^T ]    (d_out, d_out)

where ``a_{n,t}`` is the layer input at token / spatial position ``t`` of example ``n`` (an
unfolded patch for Conv2d), ``g_{n,t} = dL_n/d out_{n,t}`` the gradient of the example's loss
w.r.t. the layer output there, and ``T`` the number of positions.  This is the KFC convention
of Grosse & Martens (2016): A summed over positions, G averaged over them, so that for a single
Linear or Conv2d layer under a unit-variance Gaussian likelihood (``loss="mse"``), where K-FAC is
exact, ``G (x) A`` equals the exact per-example-mean GGN (``tests/test_kfac.py``).

Scale convention: the Kronecker precision of the flattened weight from n calibration inputs is
``n * (G (x) A)`` (plus the prior), i.e. ``kfac_diagonal`` approximates ``fisher_diagonal``'s
summed Fisher divided by n.  Expected loss increase of a weight error D (out x in):
``0.5 * n * tr(G D A D^T)`` (``kfac_whitened_cost`` returns the trace).

Output gradients (no dataset labels are read):
* ``loss="ce"``: labels sampled from the model's own softmax, ``g = softmax(z) - onehot(y)``,
  ``label_samples`` draws per input, same sampler and order as ``fisher_diagonal``;
* ``loss="ce_exact"``: the expectation over the softmax labels in closed form: the logit
  Hessian ``diag(p) - p p^T = L L^T`` with columns ``L_k = sqrt(p_k) (e_k - p)`` is
  back-propagated column by column (C backward passes per batch);
* ``loss="mse"``: unit-variance Gaussian likelihood, whose logit Hessian is I: the exact GGN
  ``J^T J`` from back-propagating every output unit ``e_k`` (C backward passes per batch).

Across batches the per-batch means are combined by an exponential moving average
(``decay``, the first batch initialises; ``decay=None`` gives the plain mean over examples).
Grouped Conv2d: all groups share one A, the average over groups of each group's patch second
moment (a group's own A is exact for its rows; sharing trades that for one (d_in, d_in) matrix).
Biases are not modelled (only weights are quantised). The model runs in eval mode (frozen
batch norm, no dropout).

Per-token outputs (a language model's (B, T, V) logits, :mod:`bayesq.forward`): the example's
loss is the sum over its real tokens (labels sampled per token), and the positions ``t`` of a
layer that reads one row per token are its ``T_n`` real tokens only: padded tokens' inputs do
not enter ``A`` and ``G`` averages over the real tokens,
``G = (1/n) sum_n (1/T_n) sum_{t real} E_y[g g^T]``. Classifiers ((B, C) logits) count every
position of a token input, padding included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.curvature.patches import input_rows, output_rows
from bayesq.forward import (
    GAUSSIAN_UNSUPPORTED, Batch, Likelihood, batch_size, layer_calls, padding_mask, predicted, prediction_rows,
    token_rows,
)

LOSSES = ("ce", "ce_exact", "mse")


@dataclass(frozen=True)
class KFACFactors:
    """Kronecker factors of one layer: per-example mean Fisher ~ ``G (x) A`` (row-major W).

    Attributes:
        A: (d_in, d_in) float64 input second moment (d_in = in_features, or
            in_channels/groups*kh*kw for Conv2d).
        G: (d_out, d_out) float64 output-gradient second moment (d_out = out_features/channels).
        n_examples: calibration inputs seen (the precision is ``n_examples * G (x) A``).
    """

    A: torch.Tensor
    G: torch.Tensor
    n_examples: int

    @property
    def d_in(self) -> int:
        return int(self.A.shape[0])

    @property
    def d_out(self) -> int:
        return int(self.G.shape[0])


def _output_rows(mod: nn.Module, g: torch.Tensor) -> torch.Tensor:
    """Output gradients as (N, T, d_out) float64 (Conv2d: T = out_h*out_w positions)."""
    return output_rows(mod, g.double())


def _batch_A(rows: torch.Tensor, n: int) -> torch.Tensor:
    """A_b = mean over the n examples and the groups of sum_t a a^T; rows (n, groups, T, d_in),
    or the (1, 1, R, d_in) real-token rows of n examples (:func:`bayesq.forward.token_rows`)."""
    groups = rows.shape[1]
    return torch.einsum("ngti,ngtj->ij", rows, rows) / (n * groups)


def _batch_G(rows: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """G_b contribution = mean over examples of (1/T) sum_t g g^T; rows (N, T, d_out).

    ``mask``: (N, T) real tokens of rows read one per token: ``(1/T_n) sum_{t real} g g^T``
    (padded tokens' rows carry no gradient; ``T_n`` counts the real ones)."""
    n, t = rows.shape[:2]
    if mask is None or tuple(mask.shape) != (n, t):
        return torch.einsum("nto,ntp->op", rows, rows) / (n * t)
    per = 1.0 / mask.sum(1).clamp_min(1).to(rows)  # (N,) 1 / T_n
    return torch.einsum("nto,ntp,n->op", rows, rows, per) / n


def _grad_directions(
    out: torch.Tensor, loss: str, label_samples: int, gen: torch.Generator
) -> Iterator[tuple[torch.Tensor, float]]:
    """(grad of the summed loss w.r.t. logits (R, C), weight) pairs whose weighted g g^T sum is
    the per-example output Hessian / Fisher of the chosen likelihood (see module docstring);
    R rows of :func:`bayesq.forward.prediction_rows` (inputs, or real tokens)."""
    z = out.detach().double()
    c = z.shape[-1]
    eye = torch.eye(c, dtype=torch.float64, device=z.device)
    if loss == "mse":
        for k in range(c):
            yield eye[k].expand_as(z).to(out.dtype), 1.0
        return
    probs = torch.softmax(z, -1)
    if loss == "ce_exact":
        for k in range(c):
            col = probs[:, k : k + 1].sqrt() * (eye[k] - probs)  # L_k = sqrt(p_k)(e_k - p): (B, C)
            yield col.to(out.dtype), 1.0
        return
    for _ in range(label_samples):
        y = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(1).to(z.device)
        yield (probs - eye[y]).to(out.dtype), 1.0 / label_samples


def _validate(loss: str, decay: float | None, label_samples: int, layers: dict) -> None:
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not supported; use one of {LOSSES}")
    if decay is not None and not 0.0 <= decay < 1.0:
        raise ValueError(f"decay={decay} must lie in [0, 1) (or be None for a plain mean)")
    if label_samples < 1:
        raise ValueError(f"label_samples={label_samples} must be >= 1")
    for name, mod in layers.items():
        if not isinstance(mod, (nn.Linear, nn.Conv2d)):
            raise ValueError(
                f"layer '{name}' is a {type(mod).__name__}; K-FAC supports only nn.Linear and "
                "nn.Conv2d (and their subclasses): drop it from `layers`"
            )


class _Accumulator:
    """EMA (or example-weighted mean) of per-batch factor estimates for one layer."""

    def __init__(self, decay: float | None):
        self.decay, self.A, self.G, self.weight = decay, None, None, 0

    def update(self, A_b: torch.Tensor, G_b: torch.Tensor, n_b: int) -> None:
        if self.A is None:
            self.A, self.G = A_b, G_b
        elif self.decay is None:
            w = n_b / (self.weight + n_b)
            self.A, self.G = (1 - w) * self.A + w * A_b, (1 - w) * self.G + w * G_b
        else:
            d = self.decay
            self.A.mul_(d).add_(A_b, alpha=1 - d)
            self.G.mul_(d).add_(G_b, alpha=1 - d)
        self.weight += n_b


def _zeros_factors(mod: nn.Module, n: int) -> KFACFactors:
    w = mod.weight
    d_in, d_out = math.prod(w.shape[1:]), w.shape[0]
    z = dict(dtype=torch.float64, device=w.device)
    return KFACFactors(torch.zeros(d_in, d_in, **z), torch.zeros(d_out, d_out, **z), n)


def kfac_factors(
    model: nn.Module,
    batches: Iterable[Batch],
    layers: dict[str, nn.Module],
    *,
    decay: float | None = 0.95,
    label_samples: int = 1,
    seed: int = 0,
    loss: str = "ce",
    progress: bool = True,
) -> dict[str, KFACFactors]:
    """K-FAC factors of every layer in ``layers`` from unlabelled calibration batches.

    Per batch, ``A_b = mean_n sum_t a a^T`` and ``G_b = mean_n (1/T) sum_t E[g g^T]`` (module
    docstring); across batches ``X <- decay X + (1 - decay) X_b`` (first batch initialises;
    ``decay=None``: mean over all examples). ``n * (G (x) A)`` approximates the summed Fisher of
    the row-major flattened weight, so ``kfac_diagonal`` ~ ``fisher_diagonal`` sum / n.

    Args:
        model: classifier returning (B, C) logits, or language model returning (B, T, V) logits
            (or an object with ``.logits``, see :mod:`bayesq.forward`).
        batches: calibration input batches (no labels); padded tokens contribute nothing.
        layers: name -> Linear/Conv2d module of ``model``.
        decay: EMA factor in [0, 1), or None for the plain mean.
        label_samples: labels drawn per input from the predictive (``loss="ce"`` only).
        seed: seed of the label sampler.
        loss: "ce" (sampled softmax labels), "ce_exact" (closed-form expectation over them)
            or "mse" (unit-variance Gaussian: exact GGN); the last two cost C backward passes.

    Returns:
        name -> KFACFactors (float64 A (d_in, d_in), G (d_out, d_out), n_examples). A layer
        never called by the model gets zero factors.

    Raises:
        ValueError: empty ``batches``, unsupported layer type or loss, bad decay/label_samples.
    """
    _validate(loss, decay, label_samples, layers)
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, tuple[torch.Tensor, torch.Size]] = {}
    outputs: dict[str, torch.Tensor] = {}
    accs = {name: _Accumulator(decay) for name in layers}

    def record(name: str, mod: nn.Module, a: torch.Tensor, output: torch.Tensor) -> None:
        if name in inputs:
            raise ValueError(
                f"layer '{name}' ran twice in one forward (shared weights); K-FAC here "
                "supports one call per forward: leave it out of `layers`"
            )
        inputs[name] = (a.detach(), output.shape)  # A_b once the logits say which tokens are real
        if output.requires_grad:
            outputs[name] = output

    n_seen = 0
    with layer_calls(model, layers, record, weights_require_grad=True):
        for batch in tqdm(batches, desc="kfac", disable=not progress, leave=False):
            _batch_update(model, batch, layers, inputs, outputs, accs, loss, label_samples, gen)
            n_seen += batch_size(batch)
            inputs.clear()
            outputs.clear()
    if n_seen == 0:
        raise ValueError("empty calibration set: K-FAC needs at least one unlabelled input batch")
    return {
        name: KFACFactors(acc.A, acc.G, n_seen) if acc.A is not None else _zeros_factors(layers[name], n_seen)
        for name, acc in accs.items()
    }


def _batch_update(model: nn.Module, batch: Batch, layers: dict[str, nn.Module],
                  inputs: dict[str, tuple[torch.Tensor, torch.Size]], outputs: dict[str, torch.Tensor],
                  accs: dict[str, _Accumulator], loss: str, label_samples: int, gen: torch.Generator) -> None:
    """One batch of :func:`kfac_factors`: its forward pass (``inputs`` / ``outputs`` filled by the
    layer hooks), each layer's ``A_b`` and ``G_b`` (one backward pass per gradient direction of
    ``loss``), folded into ``accs``."""
    z, mask, likelihood = predicted(model, batch)
    if likelihood is Likelihood.GAUSSIAN:
        raise ValueError(GAUSSIAN_UNSUPPORTED.format(what="K-FAC"))
    out = prediction_rows(z, mask)  # (R, C)
    rows_mask = padding_mask(batch) if mask is not None else None  # padded tokens' layer rows
    acts = {}
    for name, (a, shape) in inputs.items():
        rows = input_rows(layers[name], a, shape)
        acts[name] = _batch_A(token_rows(rows, a, rows_mask), rows.shape[0])
    dirs = list(_grad_directions(out, loss, label_samples, gen))
    names = list(outputs)
    grads: dict[str, torch.Tensor] = {}
    for k, (v, w) in enumerate(dirs):
        # gradients of the layer outputs only: no weight gradient is formed
        gs = torch.autograd.grad(out, [outputs[n] for n in names], grad_outputs=v,
                                 retain_graph=k < len(dirs) - 1, allow_unused=True) if names else ()
        for name, g in zip(names, gs):
            if g is not None:
                g_mask = rows_mask if rows_mask is not None and tuple(g.shape[:2]) == tuple(rows_mask.shape) \
                    and g.dim() == 3 else None
                grads[name] = grads.get(name, 0.0) + w * _batch_G(_output_rows(layers[name], g), g_mask)
    for name, A_b in acts.items():
        G_b = grads.get(name)
        if G_b is None:  # output does not reach the loss
            G_b = torch.zeros(layers[name].weight.shape[0], layers[name].weight.shape[0],
                              dtype=torch.float64, device=A_b.device)
        accs[name].update(A_b, G_b, batch_size(batch))


def damped(f: KFACFactors, damping: float, pi: bool = True) -> KFACFactors:
    """Factored Tikhonov damping: ``A + pi sqrt(lambda) I`` and ``G + sqrt(lambda)/pi I``.

    ``pi = sqrt((tr A / d_in) / (tr G / d_out))`` (Martens & Grosse 2015, sec. 6.3) balances the
    two factors so the added term ``(G + c/pi I) (x) (A + c pi I)`` has the same relative size in
    both; ``pi=False`` uses the paper's plain ``sqrt(lambda)`` on both. When either trace is 0
    the balance is undefined and pi = 1 is used.

    Raises:
        ValueError: negative or non-finite ``damping``.
    """
    if not math.isfinite(damping) or damping < 0:
        raise ValueError(f"damping={damping} must be a finite number >= 0")
    c = math.sqrt(damping)
    p = 1.0
    if pi:
        ta, tg = float(torch.trace(f.A)) / f.d_in, float(torch.trace(f.G)) / f.d_out
        if ta > 0 and tg > 0:
            p = math.sqrt(ta / tg)
    eye_a = torch.eye(f.d_in, dtype=f.A.dtype, device=f.A.device)
    eye_g = torch.eye(f.d_out, dtype=f.G.dtype, device=f.G.device)
    return KFACFactors(f.A + p * c * eye_a, f.G + (c / p) * eye_g, f.n_examples)


def kfac_whitened_cost(D: torch.Tensor, A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Whitened distortion ``tr(G D A D^T) = vec(D)^T (G (x) A) vec(D)`` (row-major vec).

    Args:
        D: (..., d_out, d_in) weight error(s) (conv: reshape to (out, in/groups*kh*kw)).
        A: (d_in, d_in) symmetric PSD; G: (d_out, d_out) symmetric PSD.

    Returns:
        (...) cost, computed with two matmuls ``sum((G D A) * D)``, never an explicit Kronecker.
    """
    if D.shape[-2:] != (G.shape[0], A.shape[0]):
        raise ValueError(
            f"D has trailing shape {tuple(D.shape[-2:])} but G, A imply ({G.shape[0]}, {A.shape[0]});"
            " reshape the weight error to (out, in/groups*kh*kw)"
        )
    return ((G @ D @ A) * D).sum(dim=(-2, -1))


def kfac_diagonal(f: KFACFactors) -> torch.Tensor:
    """Diagonal of ``G (x) A``: (d_out, d_in) float64, ``diag(G)[o] * diag(A)[i]``.

    Reshape to the weight shape (Conv2d: (out, in/groups, kh, kw)) at the caller.
    """
    return torch.outer(torch.diagonal(f.G), torch.diagonal(f.A))
