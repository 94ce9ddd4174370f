"""Layer-input statistics of the data-aware baselines (GPTQ's Hessian, AWQ's activation scale).

For a Linear/Conv2d layer with weight read as ``W`` (out x d_in; Conv2d: d_in = in/groups*kh*kw
unfolded patches, as in K-FAC) and inputs ``a_{n,t}`` (example n, token / spatial position t):

    H[g]        = (1/N) sum_n sum_t a_{n,t} a_{n,t}^T        (groups, d_in, d_in), float32 or float64
    abs_mean[g] = mean_{n,t} |a_{n,t}|                        (groups, d_in) float64
    abs_max[g]  = max_{n,t} |a_{n,t}|                         (groups, d_in) float64
    mean[g]     = mean_{n,t} a_{n,t}                          (groups, d_in) float64

per convolution group g (Linear: one group). ``tr(D H[g] D^T)`` is the mean over calibration
inputs of the squared layer-output error ``sum_t ||D a_t||^2`` caused by a weight error D of the
rows of group g: the objective GPTQ minimises and AWQ searches its scales on (SmoothQuant reads
``abs_max``). Statistics are
taken on the full-precision model in one forward pass (not sequentially on the partly
quantised model), so every baseline sees the same inputs; each batch is reduced in the model's
dtype (one GEMM per group) and batches are added in float64, but ``H`` in the model's dtype, at
least float32 (:func:`bayesq.curvature.patches.sum_dtype`: the largest memory term of a large
model halved; a relative rounding of about B * 2^-24 over B batches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import nn

from bayesq.blocks import quantizable_layers
from bayesq.canonical import on_canonical
from bayesq.curvature.patches import add_widened, sum_dtype
from bayesq.forward import Batch
from bayesq.posterior import forward_inputs


@dataclass(frozen=True)
class InputStats:
    """Second moment and mean magnitude of one layer's inputs.

    Attributes:
        H: (groups, d_in, d_in) mean over inputs of ``sum_t a a^T``, in ``sum_dtype`` of the
            model's dtype (float32 for a float32 model; consumers read it as float64 per layer).
        abs_mean: (groups, d_in) float64 mean of ``|a|`` over inputs and positions (AWQ's
            activation scale); None when not taken (``input_stats(..., abs_mean=False)``).
        n: calibration inputs seen.
        mean: (groups, d_in) float64 mean of ``a`` over inputs and positions (bias correction).
        positions: mean positions (tokens, output pixels) per input, ``T``: ``H / T`` is the
            second moment per position (AdaRound's loss scale).
        abs_max: (groups, d_in) float64 largest ``|a|`` over inputs and positions (SmoothQuant's
            activation scale); None when not taken (with ``abs_mean``).
    """

    H: torch.Tensor
    abs_mean: torch.Tensor | None
    n: int
    mean: torch.Tensor | None = None
    positions: float = 1.0
    abs_max: torch.Tensor | None = None

    @property
    def groups(self) -> int:
        return self.H.shape[0]

    def output_mse_metric(self, n_out: int) -> torch.Tensor:
        """(groups, d_in, d_in) float64 ``H / (T out)``: ``tr(D M D^T)`` is the mean squared error
        over a layer's output elements (positions and ``n_out`` features), the layer objective of
        the learned rivals (AdaRound, LSQ)."""
        return self.H.double() / (self.positions * n_out)

    def row_diag(self, n_out: int) -> torch.Tensor:
        """(out, d_in) float64: ``diag(H[g])`` for each output row (rows split evenly into groups)."""
        per = n_out // self.groups
        return self.H.diagonal(dim1=1, dim2=2).double().repeat_interleave(per, dim=0)


def batch_sums(rows: torch.Tensor, absolute: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One batch's ``sum a a^T`` (groups, d, d), ``sum |a|`` (None unless ``absolute``) and
    ``sum a`` (groups, d) over examples and positions, in the dtype of ``rows`` (N, groups, T, d).

    Rows that are a transposed view of (N, groups, d, T) patches (unfolded convolution inputs)
    take one (d, T) x (T, d) product per example and group, read in place, then a sum over the
    N examples (2-3x faster on depthwise layers with T >= 64 positions than copying them into one
    matrix; with fewer positions the many tiny products are slower); other rows
    form one (N*T, d) matrix per group and one batched product. A float32 sum over the batch's
    rows carries a relative error of order (block + N*T / block) * 2^-24 for the GEMM's
    accumulation blocks (docs/method.md, section 18f), or (block + T / block + N) * 2^-24 per
    example first; :func:`input_stats` adds batches in float64.
    """
    g, d = rows.shape[1], rows.shape[3]
    if rows.mT.is_contiguous() and rows.shape[2] >= 64:  # fewer positions: tiny products, slower
        h = (rows.mT @ rows).sum(0)  # (groups, d, d)
        magnitude, total = rows.abs().sum((0, 2)) if absolute else None, rows.sum((0, 2))
    else:
        X = rows.transpose(0, 1).reshape(g, -1, d)  # (groups, N*T, d)
        h = X.mT @ X
        magnitude, total = X.abs().sum(1) if absolute else None, X.sum(1)
    # the GEMM sums each triangle in its own order: symmetrise exactly
    return 0.5 * (h + h.mT), magnitude, total


class StatsSums:
    """Per-layer sums of :func:`batch_sums` (``sum a a^T`` in ``sum_dtype``, the others in
    float64), fed one batch's rows at a time: the
    ``on_rows(name, rows)`` callback of a pass over the calibration inputs
    (:func:`bayesq.posterior.forward_inputs`, or the diagonal Fisher's own pass,
    :func:`bayesq.posterior.fit_posterior`'s ``on_rows``). ``abs_mean``: also sum ``|a|`` and
    keep its largest value (AWQ's and SmoothQuant's activation scales; BayesQ and GPTQ do not
    read them)."""

    def __init__(self, abs_mean: bool = True) -> None:
        self.abs_mean = abs_mean
        self._sums: dict[str, list] = {}
        self._last: list = [None, None]  # rows, their sums: q / k / v read the same rows object

    def __call__(self, name: str, rows: torch.Tensor) -> None:
        """Add one batch's rows (N, groups, T, d_in), in the model's dtype, of layer ``name``."""
        if self._last[0] is rows:
            new = self._last[1]
        else:
            peak = rows.abs().amax((0, 2)) if self.abs_mean else None  # (groups, d)
            new = [*batch_sums(rows, self.abs_mean), peak, rows.shape[0] * rows.shape[2]]
            self._last[:] = rows, new
        old = self._sums.get(name)
        if old is None:  # sums of the batches' sums (added in place: no float64 temporary)
            h, a, m, peak = new[:-1]
            wide = [None if x is None else x.to(torch.float64, copy=True) for x in (a, m, peak)]
            self._sums[name] = [h.to(sum_dtype(h.dtype), copy=True), *wide, new[-1]]
        else:
            for x, y in zip(old[:-2], new[:-2]):
                if x is not None:
                    add_widened(x, y)
            if old[-2] is not None:
                torch.maximum(old[-2], new[-2].to(torch.float64), out=old[-2])
            old[-1] += new[-1]

    def stats(self, layers: dict[str, nn.Module], n: int) -> dict[str, InputStats]:
        """:class:`InputStats` of ``layers`` over the ``n`` inputs the rows came from (the sums are
        divided in place and handed over: the object is empty afterwards).

        Raises:
            ValueError: empty calibration set; a layer that never ran.
        """
        self._last[:] = None, None
        if n == 0:
            raise ValueError("empty calibration set: GPTQ / AWQ need at least one calibration batch")
        missing = [k for k in layers if k not in self._sums]
        if missing:
            raise ValueError(f"layers {missing[:3]} never ran in the forward pass (a weight used functionally, "
                             "or a module the model holds but never calls): keep them in floating point with "
                             "exclude=[...] (names or glob patterns)")
        sums, self._sums = self._sums, {}  # consumed: each H is divided in place (no second copy)
        return {k: InputStats(h.div_(n), None if a is None else a.div_(t), n, m.div_(t), t / n, peak)
                for k, (h, a, m, peak, t) in sums.items() if k in layers}


@on_canonical
def input_stats(
    model: nn.Module, calibration: Iterable[Batch], layers: dict[str, nn.Module] | None = None, *,
    progress: bool = False, abs_mean: bool = True, exclude: Sequence[str] = (),
    logits: list[torch.Tensor | None] | None = None,
) -> dict[str, InputStats]:
    """:class:`InputStats` of every layer in ``layers`` from one forward pass (eval mode, no grad;
    ``progress``: a bar over the batches; ``abs_mean``: also AWQ's mean magnitudes; ``logits``: a
    list that receives the model's logits of that pass, :func:`bayesq.posterior.forward_inputs`).

    ``layers``: by default every quantisable layer of the model as :mod:`bayesq.canonical`
    rewrites it (an attention's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``out_proj``, ...) but
    those ``exclude`` matches (names or glob patterns); a dict given here must come from that
    rewritten model (:func:`bayesq.blocks.quantizable_layers` inside :func:`bayesq.canonical.canonical`).

    Raises:
        ValueError: empty calibration set; a layer that never ran.
    """
    if layers is None:
        layers = quantizable_layers(model, tuple(exclude))
    sums = StatsSums(abs_mean)
    n = forward_inputs(model, calibration, layers, sums, progress=progress, desc="layer-input statistics",
                       logits=logits)
    return sums.stats(layers, n)
