"""Label-free diagonal Fisher of Linear/Conv2d weights from per-example gradients.

For each calibration input x_n, labels are sampled from the model's own predictive
``y ~ softmax(f(x_n; w))`` (no dataset labels are used), and

    F_sum = sum_n E_y[ g_n(y)^2 ],   g_n(y) = d/dw  -log p(y | x_n, w),

estimated with ``label_samples`` draws per input.  A language model's (B, T, V) logits give one
label per real token, ``y_nt ~ softmax(f(x_n; w)_t)``, and the example's loss is the sum over its
real tokens (:mod:`bayesq.forward`; padding contributes nothing):

    g_n(y) = d/dw sum_{t: m_nt = 1} -log p(y_nt | x_n, w),

whose square is an unbiased estimate of the summed token Fishers ``sum_t F_nt`` (the cross terms
of different tokens have expectation zero).  Per-example weight gradients come from the
layer inputs and output gradients captured by hooks (``g_out^T a`` for Linear, the same on
unfolded patches for Conv2d), so one backward pass serves a whole batch.  Each layer's squares
are summed as that pass reaches the layer's output (a hook on it, tapped by
:class:`bayesq.forward.Taps`), and the layer's input is released then: the pass holds the output
gradients of the layers it is at, not of all of them (``benchmarks/scale.py --stages``, MiniLM,
8 x 128 tokens a pass: a 1.18 GiB peak against 1.33 collecting them all).  The model runs in
eval mode (no dropout, batch-norm statistics frozen), so examples do not interact.

A model without a head returns features ``f`` (B, T, H) read with a Gaussian likelihood
(:class:`bayesq.forward.Likelihood`, docs/method.md 1b): a draw ``eps ~ N(0, I)`` (R, H) per real
token stands in for the label, the pass back-propagates ``sum_rows <f_r, eps_r>``, and the sums
are divided by ``sigma^2``, the features' mean square over the rows read: in expectation the
Gauss-Newton diagonal ``sum_n diag(J_n^T J_n) / sigma^2`` of the feature-matching loss.

``empirical_fisher_diagonal`` runs the same machinery with one fixed label per input,
``sum_n g_n(y_n)^2``: given labels, or (label-free) the model's argmax prediction.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from bayesq.curvature.patches import input_rows, squared_grad_sum, sum_dtype
from bayesq.forward import (
    Batch, Likelihood, Taps, batch_size, collect_logits, layer_calls, padding_mask, predicted, prediction_rows,
    split_batches, token_rows,
)
from bayesq.memory import release_freed

LABEL_CHUNK = 1 << 22  # float64 probabilities formed at once when labels are sampled (32 MiB)


def _squared_grad_sum(
    model: nn.Module,
    batches: Iterable[Batch],
    layers: dict[str, nn.Module],
    labels_for: Callable[[torch.Tensor, torch.Tensor | None, Likelihood], list[torch.Tensor]],
    desc: str,
    progress: bool,
    on_rows: Callable[[str, torch.Tensor], None] | None = None,
    max_inputs: int | None = None,
    share: float = 1.0,
    logits: list[torch.Tensor | None] | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """``sum_n mean_s g_n(y_s)^2`` per layer, with per-example gradients from hooks: the one
    calibration pass, which owns the loop (parts, the backward share, progress) and hands each part
    to its observers: the Fisher squares (:class:`_Squares`), the layer inputs
    (:class:`_RowsObserver`, with ``on_rows``) and the logits (``logits``).

    ``labels_for(rows, mask, likelihood)`` gets a batch's (R, C) logits (detached) of
    :func:`bayesq.forward.prediction_rows` (R = B for (B, C) logits, the real tokens of
    (B, T, V) ones), their (B, T) token mask (None for (B, C)) and how the output is read
    (:class:`bayesq.forward.Likelihood`), and returns the S targets to back-propagate
    :func:`_loss` at: (R,) int64 labels, or (R, C) floating Gaussian draws; each pass is
    weighted 1/S.  ``on_rows(name, rows)``: called once per batch and layer with the layer's
    inputs as :func:`bayesq.curvature.patches.input_rows` (N, groups, T, d_in), padded tokens'
    rows dropped (:func:`bayesq.forward.token_rows`) where the logits have a token axis, as
    :func:`bayesq.posterior.forward_inputs` calls it (Linear layers reading one tensor get one rows object).

    ``max_inputs``: each batch runs in parts of at most this many inputs
    (:func:`bayesq.forward.split_batches`: the activations of a part, not of a batch); each
    part's squared gradients (summed over its inputs in their dtype) go into the sum (in
    :func:`bayesq.curvature.patches.sum_dtype` of the weight's dtype),
    and a layer with fewer input rows in a part than input features hands ``on_rows`` the batch's
    rows joined once (the same rows as without parts), the others their part's rows.
    ``share``: the backward pass runs on :func:`spread_batches` ``(len(batches), share)`` only, and
    the sum over their n' inputs is scaled by n / n' (an unbiased estimate of the sum over all n
    inputs when the batches are exchangeable; by length-sorted batches a sample stratified by
    length); the other batches run forward only, for ``on_rows``.
    ``logits``: a list that receives the model's logits of every forward call, in the pass's order
    (:func:`bayesq.forward.collect_logits`; :func:`bayesq.forward.pass_logits` orders them as given).
    Returns (name -> tensor shaped like the weight, in ``sum_dtype``, inputs seen).
    """
    if on_rows is not None:
        desc += " + layer-input statistics"
    squares = _Squares(layers, labels_for)
    rows = _RowsObserver(on_rows, layers) if on_rows is not None else None
    batches = list(batches)
    n_all = sum(batch_size(b) for b in batches)
    backward = spread_batches(len(batches), share)
    if rows is None:  # nothing to read from the other batches
        batches = [batches[i] for i in sorted(backward)]
        backward = set(range(len(batches)))
    n_grad = 0
    with layer_calls(model, layers, squares.record, taps=squares.taps):
        for i, batch in enumerate(tqdm(batches, desc=desc, disable=not progress, leave=False)):
            parts = split_batches([batch], max_inputs)
            for part in parts:
                # also under torch.no_grad(); forward only (rows for the observer) outside the share
                with torch.set_grad_enabled(i in backward):
                    z, mask, likelihood = predicted(model, part)
                    collect_logits(logits, z)
                    out = prediction_rows(z, mask)  # (R, C)
                    if rows is not None:  # before the backward pass releases the inputs
                        rows.part(squares.acts, squares.shapes, padding_mask(part) if mask is not None else None,
                                  len(parts) > 1)
                    if i in backward:
                        squares.backward(out, mask, likelihood)
                n_grad += batch_size(part) if i in backward else 0
                del z, out
                squares.clear()
            if rows is not None:
                rows.batch_done()
            release_freed()
    if n_all == 0:
        raise ValueError(
            "empty calibration set: the posterior needs at least one unlabelled input batch"
        )
    if n_grad < n_all:
        for t in squares.total.values():
            t.mul_(n_all / n_grad)
    return squares.total, n_all


class _Squares:
    """The Fisher observer of :func:`_squared_grad_sum`'s pass: each layer's squared per-example
    gradients summed (in :func:`bayesq.curvature.patches.sum_dtype`) as the backward pass reaches
    the layer's output (a hook on it, tapped by :class:`bayesq.forward.Taps`); its input is
    released then, so a layer's input and output gradient are held from when the pass reaches it
    until its squares are summed, not until the pass ends."""

    def __init__(self, layers: dict[str, nn.Module], labels_for) -> None:
        self.total = {name: torch.zeros(m.weight.shape, dtype=sum_dtype(m.weight.dtype), device=m.weight.device)
                      for name, m in layers.items()}
        self.labels_for = labels_for
        self.taps = Taps()
        self.acts: dict[str, torch.Tensor] = {}  # each layer's input in this part (the rows observer reads them)
        self.shapes: dict[str, torch.Size] = {}
        self.passes, self.last = 1, True  # the backward pass under way: how many this part runs, the last?

    def record(self, name: str, mod: nn.Module, a: torch.Tensor, output: torch.Tensor) -> None:
        """:func:`bayesq.forward.layer_calls`' ``on_call``: keep the input; hook a tapped output."""
        self.acts[name] = a = a.detach()
        self.shapes[name] = output.shape
        if output.requires_grad:  # a tapped output (a batch the backward pass reads)
            output.register_hook(self._hook(name, mod, a))

    def _hook(self, name: str, mod: nn.Module, a: torch.Tensor):
        def hook(g: torch.Tensor) -> None:
            if self.acts.get(name) is not a:  # an earlier call of a module called again: its last call counts
                return
            # square and sum the part in the model's dtype, accumulate in sum_dtype (at least float32)
            if self.passes > 1:
                self.total[name] += squared_grad_sum(mod, a, g).to(self.total[name].dtype) / self.passes
            else:  # in place: no copy of the sum (one input's square added straight into it)
                squared_grad_sum(mod, a, g, out=self.total[name])
            if self.last:
                del self.acts[name]
        return hook

    def backward(self, out: torch.Tensor, mask: torch.Tensor | None, likelihood: Likelihood) -> None:
        """The part's backward passes, one per target ``labels_for`` draws (each weighted 1/S)."""
        passes = self.labels_for(out.detach(), mask, likelihood)
        for s, y in enumerate(passes if out.requires_grad else []):  # else no layer reaches the loss
            self.passes, self.last = len(passes), s == len(passes) - 1
            # gradients of the tapped layer outputs only: no weight gradient is formed
            torch.autograd.backward(_loss(out, y), inputs=self.taps.leaves(), retain_graph=not self.last)

    def clear(self) -> None:
        """Forget the part's inputs, output shapes and taps (their graphs)."""
        self.acts.clear()
        self.shapes.clear()
        self.taps.clear()


class _RowsObserver:
    """The layer-input observer of :func:`_squared_grad_sum`'s pass: ``on_rows(name, rows)`` per
    batch and layer with the layer's input rows (:func:`_rows_to`); in a batch run in parts, a
    layer with fewer rows in a part than input features gets the batch's rows joined once
    (:func:`_hand_on`)."""

    def __init__(self, on_rows: Callable[[str, torch.Tensor], None], layers: dict[str, nn.Module]) -> None:
        self.on_rows, self.layers = on_rows, layers
        self.held: dict[str, list[tuple[torch.Tensor, int]]] = {}  # rows handed on once per batch

    def part(self, acts: dict[str, torch.Tensor], shapes: dict[str, torch.Size], rows_mask: torch.Tensor | None,
             in_parts: bool) -> None:
        _rows_to(self.on_rows, self.layers, acts, shapes, rows_mask, self.held if in_parts else None)

    def batch_done(self) -> None:
        _hand_on(self.held, self.on_rows)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed loss over the (R, C) rows ``out`` whose gradient a pass squares: integer labels
    ``y`` (R,), ``sum_r -log softmax(out_r)[y_r]``; a floating ``y`` (R, C) is a Gaussian
    likelihood's draw ``eps`` of ``N(0, I)``, ``sum_r <out_r, eps_r>``, whose gradient ``J^T eps``
    is that of ``-log N(f + eps; f, I)`` up to its sign (so its square is the same)."""
    if y.is_floating_point():
        return (out * y.to(out.dtype)).sum()
    return F.cross_entropy(out, y, reduction="sum")


def spread_batches(n: int, share: float) -> set[int]:
    """Indices of ``max(1, round(share * n))`` of ``n`` batches spread evenly over them (the
    middle of each of that many equal stretches): all of them at ``share = 1``."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share = {share}: the share of batches the backward pass reads must be in (0, 1]")
    k = min(n, max(1, round(share * n)))
    return {int((j + 0.5) * n / k) for j in range(k)} if n else set()


def _hand_on(held: dict[str, list[tuple[torch.Tensor, int]]], on_rows) -> None:
    """``on_rows(name, rows)`` with each layer's parts' rows joined into the batch's (the same
    values and memory layout as one pass over the batch; layers that read one rows object per
    part get one joined object). ``held`` is emptied as it goes: one joined object is made at a
    time and released with its pieces once its layers have read it, so the batch's rows are
    not held twice (GPT-2 medium: 0.7 GiB)."""
    by_key: dict[tuple, list[str]] = {}
    for name, pieces in held.items():
        by_key.setdefault(tuple(id(p) for p, _ in pieces), []).append(name)
    for names in by_key.values():
        pieces = held[names[0]]
        if len({d for _, d in pieces}) > 1:  # a part without padding kept its (N, 1, T, d) rows, the others
            # their real tokens' (1, 1, R, d): the former are the real-token rows of a mask of ones
            pieces = [(p if d == 2 else p.reshape(1, 1, -1, p.shape[-1]), 2) for p, d in pieces]
        dim = pieces[0][1]
        if pieces[0][0].is_contiguous():
            joined = torch.cat([p for p, _ in pieces], dim)
        else:  # unfolded patches: a transposed view of (N, groups, d_in, T)
            joined = torch.cat([p.mT for p, _ in pieces], dim).mT
        for name in names:
            del held[name]
        del pieces
        for name in names:
            on_rows(name, joined)
        del joined


def _rows_to(on_rows, layers: dict[str, nn.Module], acts: dict[str, torch.Tensor], shapes: dict[str, torch.Size],
             rows_mask: torch.Tensor | None, held: dict | None) -> None:
    """``on_rows(name, rows)`` for each layer called in this part (:func:`_rows`; padded tokens'
    rows dropped where ``rows_mask`` is given). ``held``: the batch runs in parts, and a layer with
    fewer rows in a part than input features has its rows kept there (with the dimension to join
    them on) to be handed on once per batch (:func:`_hand_on`)."""
    shared: dict = {}
    for name, mod in layers.items():
        if name not in acts:
            continue
        rows = _rows(mod, acts[name], shapes[name], shared)
        real = rows if rows_mask is None else _real_rows(rows, acts[name], rows_mask, shared)
        if held is not None and real.shape[0] * real.shape[2] < real.shape[3]:
            held.setdefault(name, []).append((real, 2 if real is not rows else 0))
        else:
            on_rows(name, real)


def _rows(mod: nn.Module, a: torch.Tensor, out_shape: torch.Size, shared: dict) -> torch.Tensor:
    """The layer's input rows (:func:`input_rows`, unwidened); Linear layers that read one input
    tensor (q / k / v) get one rows object, kept in ``shared`` for the batch."""
    if not isinstance(mod, nn.Linear):
        return input_rows(mod, a, out_shape, widen=False)
    key = (a.data_ptr(), tuple(a.shape), a.stride())  # detached views of one input share it
    if key not in shared:
        shared[key] = input_rows(mod, a, out_shape, widen=False)
    return shared[key]


def _real_rows(rows: torch.Tensor, a: torch.Tensor, mask: torch.Tensor, shared: dict) -> torch.Tensor:
    """:func:`token_rows` of ``rows``, one object per rows object in ``shared`` (q / k / v)."""
    key = ("real", id(rows))
    if key not in shared:
        shared[key] = (rows, token_rows(rows, a, mask))  # rows kept alive: its id stays its own
    return shared[key][1]


def fisher_diagonal(
    model: nn.Module,
    batches: Iterable[Batch],
    layers: dict[str, nn.Module],
    *,
    label_samples: int = 1,
    seed: int = 0,
    progress: bool = True,
    on_rows: Callable[[str, torch.Tensor], None] | None = None,
    max_inputs: int | None = None,
    share: float = 1.0,
    logits: list[torch.Tensor | None] | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Sum over inputs of the sampled-label Fisher diagonal of every layer in ``layers``.

    Args:
        model: classifier returning (B, C) logits, or language model returning (B, T, V) logits
            (a tensor, or an object with ``.logits``, see :mod:`bayesq.forward`).
        batches: calibration input batches (no labels); a language model's padded tokens
            (``attention_mask`` 0) contribute nothing.
        layers: name -> Linear/Conv2d module of ``model``.
        label_samples: labels drawn per input (per real token) from the model's predictive.
        seed: seed of the label sampler (a generator on the logits' device).
        on_rows: called with each layer's input rows per batch (see ``_squared_grad_sum``), e.g.
            :class:`bayesq.baselines.activations.StatsSums`.
        max_inputs: the most inputs one forward / backward pass holds (batches run in parts; the
            labels are the same: the sampler draws row by row); None: whole batches.
        share: the share of the batches the backward pass reads, spread evenly over them; the
            sum over their inputs scaled to all inputs (``_squared_grad_sum``); ``on_rows`` still
            sees every batch. 1: every batch.
        logits: a list that receives the model's logits of every forward call (see
            ``_squared_grad_sum``).

    Returns:
        (fisher, n): name -> tensor shaped like the weight holding ``F_sum`` (in
        :func:`bayesq.curvature.patches.sum_dtype`: the model's dtype, at least float32); and n,
        the number of inputs seen.

    Raises:
        ValueError: if ``batches`` is empty.
    """
    gen: list[torch.Generator] = []  # on the logits' device, made on the first batch
    features = [0.0, 0]  # Gaussian outputs: the sum of squares of the features the passes read, their count

    def sampled_labels(out: torch.Tensor, mask: torch.Tensor | None, likelihood: Likelihood) -> list[torch.Tensor]:
        if not gen:
            gen.append(torch.Generator(device=out.device).manual_seed(seed))
        if likelihood is Likelihood.GAUSSIAN:
            features[0] += float(out.double().square().sum())
            features[1] += out.numel()
            return [torch.randn(out.shape, generator=gen[0], device=out.device, dtype=out.dtype)
                    for _ in range(label_samples)]
        step = max(1, LABEL_CHUNK // max(1, out.shape[1]))
        chunks = out.split(step)  # the float64 probabilities of a chunk of rows at a time; the
        # sampler draws row by row, so the labels are those of the whole (R, C) at once
        return [torch.cat([torch.multinomial(torch.softmax(c.double(), -1), 1, generator=gen[0]).squeeze(1)
                           for c in chunks]) for _ in range(label_samples)]

    total, n = _squared_grad_sum(model, batches, layers, sampled_labels, "fisher", progress, on_rows, max_inputs,
                                 share, logits)
    if features[1]:  # sigma^2 = the features' mean square: J^T J / sigma^2, whatever the features' scale
        sigma2 = max(features[0] / features[1], torch.finfo(torch.float32).tiny)
        for t in total.values():
            t.div_(sigma2)
    return total, n


def _check_labels(y: torch.Tensor, out: torch.Tensor, mask: torch.Tensor | None, index: int) -> torch.Tensor:
    """``y`` as (R,) int64 on the logits' device, one label per row of ``out`` (R, C): (B,) labels
    of (B, C) logits (``mask`` None), or the real tokens' entries of (B, T) labels of (B, T, V)
    logits; ``ValueError`` if it does not fit."""
    if not isinstance(y, torch.Tensor) or y.dtype.is_floating_point or y.dtype.is_complex \
            or y.dtype == torch.bool:
        raise ValueError(f"labels[{index}] must be an integer tensor of class indices (int64), "
                         f"got {type(y).__name__} {getattr(y, 'dtype', '')}")
    if mask is not None:
        if y.shape != mask.shape:
            raise ValueError(f"labels[{index}] has shape {tuple(y.shape)} but batch {index} has per-token logits "
                             f"for {tuple(mask.shape)} (inputs, tokens): pass one (B, T) label tensor per batch, "
                             "in order")
        y = y.to(mask.device)[mask]
    elif y.shape != out.shape[:1]:
        raise ValueError(f"labels[{index}] has shape {tuple(y.shape)} but batch {index} has "
                         f"{out.shape[0]} inputs: pass one (B,) label tensor per batch, in order")
    if y.numel() and (y.min() < 0 or y.max() >= out.shape[1]):
        raise ValueError(f"labels[{index}] holds class indices outside [0, {out.shape[1]}): "
                         "labels must index the model's logits")
    return y.to(device=out.device, dtype=torch.int64)


def empirical_fisher_diagonal(
    model: nn.Module,
    batches: Iterable[Batch],
    layers: dict[str, nn.Module],
    *,
    labels: Iterable[torch.Tensor] | None = None,
    progress: bool = True,
    on_rows: Callable[[str, torch.Tensor], None] | None = None,
    max_inputs: int | None = None,
    share: float = 1.0,
    logits: list[torch.Tensor | None] | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Sum over inputs of the empirical Fisher diagonal ``sum_n g_n(y_n)^2``.

    ``g_n(y) = d/dw -log p(y | x_n, w)`` at the given ``labels`` or, when ``labels`` is None,
    at the model's own argmax prediction ``y_n = argmax_c f(x_n; w)_c`` (label-free); for
    (B, T, V) logits, the sum over the real tokens of ``-log p(y_nt | x_n, w)``, one label per
    token (as ``fisher_diagonal``).

    Args:
        model, batches, layers, on_rows, max_inputs, share, logits: as in ``fisher_diagonal`` (``max_inputs``
            and ``share`` only without ``labels``, which come one per batch).
        labels: one (B,) int64 tensor of class indices per batch, aligned with ``batches``; for
            (B, T, V) logits one (B, T) tensor (entries at padded tokens are not read).

    Returns:
        (fisher, n): name -> tensor shaped like the weight (``sum_dtype``); n, the number of inputs.

    Raises:
        ValueError: empty ``batches``; ``labels`` with fewer or more entries than ``batches``,
            a wrong shape, a non-integer dtype or out-of-range class indices.
    """
    if labels is not None and max_inputs is not None:
        raise ValueError("max_inputs splits batches, but labels come one tensor per batch: pass labels= or "
                         "max_inputs=, not both")
    if labels is not None and share != 1.0:
        raise ValueError(f"share = {share} skips batches, but labels come one tensor per batch: pass labels= or "
                         "share=, not both")
    label_iter = iter(labels) if labels is not None else None
    count = 0

    def given_or_argmax(out: torch.Tensor, mask: torch.Tensor | None, likelihood: Likelihood) -> list[torch.Tensor]:
        nonlocal count
        count += 1
        if likelihood is Likelihood.GAUSSIAN:
            raise ValueError("the model has no head (it returns features, read with a Gaussian likelihood): the "
                             "empirical Fisher needs class labels; use posterior.curvature: fisher (its Gauss-Newton "
                             "matrix on the features)")
        if label_iter is None:
            return [out.argmax(-1)]
        y = next(label_iter, None)
        if y is None:
            raise ValueError(f"labels has fewer entries than batches ({count - 1}): "
                             "pass one (B,) label tensor per batch")
        return [_check_labels(y, out, mask, count - 1)]

    desc = "empirical-fisher"
    result = _squared_grad_sum(model, batches, layers, given_or_argmax, desc, progress, on_rows, max_inputs, share,
                               logits)
    if label_iter is not None and next(label_iter, None) is not None:
        raise ValueError(f"labels has more entries than batches ({count}): "
                         "pass one (B,) label tensor per batch")
    return result
