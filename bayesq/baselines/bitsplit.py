"""Bit-Split and Stitching (Wang et al. 2020, "Towards Accurate Post-Training Network Quantization
via Bit-Split and Stitching").

A b-bit weight is ``alpha * q`` with the signed integer ``q`` in ``[-(2^(b-1) - 1), 2^(b-1) - 1]``
(symmetric, ``2^b - 1`` levels, one scale ``alpha`` per group) *split* into ``b - 1`` ternary
planes, ``q = sum_i 2^i t_i`` with ``t_i`` in {-1, 0, 1}, and *stitched* back after each plane is
optimised with the others fixed. The objective is the layer's output reconstruction on the
calibration inputs, ``tr(D H D^T)`` with ``D = alpha * q - W`` and ``H`` the inputs' second
moments (:meth:`bayesq.baselines.activations.InputStats.output_mse_metric`, as AdaRound's and
LSQ's). The method alternates

* the scales: each group's ``alpha`` by least squares in ``H`` for the fixed codes (the paper's
  closed form per output channel; rows that hold several groups solve their small normal
  equations, :func:`bayesq.refit.refit_scales`);
* each plane ``i`` in turn: exact coordinate descent over the columns, each weight's ``t_i`` the
  best of {-1, 0, 1} given every other weight (``Delta = 2 delta (D H)_j + delta^2 H_jj`` for the
  change ``delta = alpha 2^i (t' - t)``), ``D H`` kept current;

until an epoch changes no code (or ``epochs`` epochs); the scales are then refitted to the final
codes once more (:func:`bayesq.rounding.encode`'s ``refit``). The start is the paper's: per group
the alternation of nearest rounding and the least-squares scale in weight space (its "fixed-point
weight approximation"), from ``max |w| / (2^(b-1) - 1)``. The paper's second start-up stage, the
same alternation over planes in weight space, is left out: for a fixed scale, weight space is
separable and nearest rounding is its exact optimum, so that stage ends where the first does.

The grid is stored as every method's here (an fp16 scale and a b-bit zero-point per group): the
zero-point is ``2^(b-1) - 1`` and code ``2^b - 1`` is never used, the paper's symmetric range. At 2
bits that is one ternary plane (3 levels). Grids, budgets and variants are GPTQ's
(:mod:`bayesq.baselines.gptq`: the mixed-precision rule, uniform layouts, selection on held-out
inputs), so Bit-Split, AdaRound and GPTQ differ only in how they fit a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.baselines.activations import InputStats
from bayesq.baselines.gptq import LayerRounding, grid_method_outcome
from bayesq.baselines.select import group_sizes_setting
from bayesq.config import Granularity, QuantConfig
from bayesq.methods import Inputs, Outcome, register
from bayesq.refit import refit_scales
from bayesq.settings import validate

START_ITERS = 100  # the weight-space start: alternations at most (it stops when no scale moves)


def symmetric_grid(W: torch.Tensor, metric: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   maxq: torch.Tensor, groups: torch.Tensor, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's start: each group's symmetric grid by alternating nearest codes
    ``q = clip(round(w / alpha), -h, h)`` (``h = (maxq - 1) / 2``) and the least-squares scale
    ``alpha = <w, q> / <q, q>`` in weight space, from ``alpha = max |w| / h``.

    Args:
        W: (r, d_in) float64 rows; groups: (r, d_in) int64 index in ``[0, g)`` of each weight's group.
        scale, zero, maxq: (g,) the starting grids (only ``maxq`` and which groups are all zero,
            ``scale == 0``, are read); ``metric`` is not read.

    Returns:
        (g,) float64 scales and (g,) float64 zero-points ``h``.
    """
    flat, w = groups.reshape(-1), W.reshape(-1).double()
    half = ((maxq.double() - 1) / 2).floor()
    top = torch.zeros_like(half).scatter_reduce(0, flat, w.abs(), "amax")
    alpha = torch.where((top > 0) & (half > 0), top / half.clamp(min=1), torch.zeros_like(top))
    for _ in range(START_ITERS):
        a = alpha[flat]
        s = torch.where(a > 0, a, torch.ones_like(a))
        q = torch.minimum(torch.maximum(torch.round(w / s), -half[flat]), half[flat]) * (a > 0)
        num = torch.zeros_like(alpha).index_add_(0, flat, w * q)
        den = torch.zeros_like(alpha).index_add_(0, flat, q * q)
        new = torch.where(den > 0, num / den.clamp(min=1e-300), alpha)
        new = torch.where(new > 0, new, alpha)
        if torch.equal(new, alpha):
            break
        alpha = new
    return torch.where(scale > 0, alpha, scale.double()), half


def split_planes(q: torch.Tensor, planes: int) -> torch.Tensor:
    """(planes, *q.shape) ternary planes of integer-valued ``q`` with ``|q| < 2^planes``:
    ``t_i = sign(q) * bit_i(|q|)``, so ``sum_i 2^i t_i = q`` (the paper's split)."""
    mag, sign = q.abs().to(torch.int64), torch.sign(q)
    return torch.stack([((mag >> i) & 1).to(q.dtype) * sign for i in range(planes)])


def stitch(t: torch.Tensor) -> torch.Tensor:
    """``sum_i 2^i t_i`` of (planes, ...) ternary planes: the signed integers."""
    powers = 2.0 ** torch.arange(t.shape[0], dtype=t.dtype, device=t.device)
    return (t * powers.reshape(-1, *([1] * (t.dim() - 1)))).sum(0)


def plane_sweep(t: torch.Tensor, D: torch.Tensor, HD: torch.Tensor, H: torch.Tensor, step: torch.Tensor,
                free: torch.Tensor) -> int:
    """One pass of exact coordinate descent over the columns of one ternary plane, in place.

    Args:
        t: (cg, r, d) the plane's values in {-1, 0, 1}.
        D, HD: (cg, r, d) ``W_hat - W`` and ``D H`` (kept current).
        H: (cg, d, d) symmetric metric. step: (cg, r, d) ``alpha 2^i``. free: (cg, r, d) bool,
            the weights whose plane may move (live group, plane below the weight's width).

    Returns:
        How many values changed.
    """
    changed = 0
    options = torch.tensor([-1.0, 0.0, 1.0], dtype=t.dtype, device=t.device)
    for j in range(t.shape[-1]):
        cur, g, a = t[..., j], HD[..., j], step[..., j]
        h = H[:, j, j][:, None, None]
        delta = a[..., None] * (options - cur[..., None])  # (cg, r, 3)
        gain = 2 * delta * g[..., None] + delta * delta * h  # the cost's change for each choice
        best = gain.argmin(-1, keepdim=True)
        move = free[..., j] & (gain.gather(-1, best).squeeze(-1) < 0)
        if not bool(move.any()):
            continue
        dj = torch.where(move, delta.gather(-1, best).squeeze(-1), torch.zeros_like(cur))
        t[..., j] = torch.where(move, options[best.squeeze(-1)], cur)
        D[..., j] += dj
        HD += dj[..., None] * H[:, j, None, :]
        changed += int(move.sum())
    return changed


def bitsplit_rows(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
                  *, groups: torch.Tensor, epochs: int = 100, scale_bits: int = 16, progress: bool = False,
                  name: str = "") -> torch.Tensor:
    """Bit-Split's codes of the rows ``W`` (module docstring), its scales alternated with them.

    Args:
        W: (out, d_in) float weights; rows ``c*out/cgroups ...`` belong to convolution group c.
        H: (cgroups, d_in, d_in) or (d_in, d_in) reconstruction metric (:meth:`InputStats.output_mse_metric`).
        scale, zero, maxq: (out, d_in) per-element symmetric grid (:func:`symmetric_grid`:
            ``zero = (maxq - 1) / 2``; a scale of 0 gives the zero-point code).
        groups: (out, d_in) int64 index of each weight's group (its scale) among these rows'.
        epochs: at most this many alternations (scales, then every plane once).
        scale_bits: the stored precision of the scales the alternation uses.
        progress: a bar over the epochs, named ``name``.

    Returns:
        (out, d_in) int64 codes in ``[0, maxq - 1]``.

    Raises:
        ValueError: a grid that is not symmetric (``zero != (maxq - 1) / 2`` on a live group).
    """
    live = scale > 0
    if bool((live & (zero != (maxq - 1) / 2)).any()):
        raise ValueError("Bit-Split needs symmetric grids (zero-point (maxq - 1) / 2 per group): "
                         "fit them with bayesq.baselines.bitsplit.symmetric_grid")
    Hg = (H if H.dim() == 3 else H[None]).double()
    cg, (n_out, d) = Hg.shape[0], W.shape

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(cg, n_out // cg, d)

    Wd, z = W.double(), zero.double()
    flat = groups.reshape(-1)
    alpha = torch.zeros(int(flat.max()) + 1, dtype=torch.float64, device=W.device).scatter_(0, flat, scale.double().reshape(-1))
    s = torch.where(live, scale.double(), torch.ones_like(Wd))
    q = (torch.minimum(torch.clamp(torch.round(Wd / s) + z, min=0), maxq - 1) - z) * live
    widths = torch.log2(maxq.double() + 1).round().to(torch.int64)  # b per weight
    n_planes = int(widths.max()) - 1
    t = split_planes(grouped(q), n_planes)  # (planes, cg, r, d)
    frees = [grouped(live & (widths - 1 > i)) for i in range(n_planes)]
    for _ in tqdm(range(epochs), desc=f"Bit-Split {name}".strip(), disable=not progress, leave=False):
        u = stitch(t)  # (cg, r, d) signed integers
        alpha = refit_scales(Wd, u.reshape(n_out, d), groups, alpha, Hg, scale_bits=scale_bits)[0]
        a = grouped(alpha[groups] * live)
        D = a * u - grouped(Wd)
        HD = torch.einsum("crd,cde->cre", D, Hg)
        changed = sum(plane_sweep(t[i], D, HD, Hg, a * 2.0 ** i, frees[i]) for i in range(n_planes))
        if changed == 0:
            break
    codes = stitch(t).reshape(n_out, d) + z
    return torch.where(live, codes, zero.round()).to(torch.int64)


@dataclass(frozen=True)
class BitSplitConfig:
    """Bit-Split on GPTQ's grid layouts and variants (:mod:`bayesq.baselines.gptq`), each group's
    grid symmetric (:func:`symmetric_grid`): with ``select`` the variant with the least KL on the
    selection inputs (``group_sizes`` its uniform layouts, ``bias_correction``: each variant also
    bias-corrected), else the ``mixed`` rule at ``granularity``. ``epochs``: :func:`bitsplit_rows`'
    cap on alternations (the paper's 100)."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    bias_correction: bool = True
    epochs: int = 100
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "BitSplitConfig")
        if self.epochs < 1:
            raise ValueError(f"bitsplit.epochs must be at least 1, got {self.epochs}")


def bitsplit_rounding(config: BitSplitConfig) -> LayerRounding:
    """GPTQ's pipeline with Bit-Split's symmetric grids, plane-wise codes and refitted scales."""
    solver = partial(bitsplit_rows, epochs=config.epochs, scale_bits=config.quant.scale_bits,
                     progress=config.progress)
    return LayerRounding("Bit-Split", InputStats.output_mse_metric, solver, grid_fit=symmetric_grid, refit=True)


@register(BitSplitConfig)
def bitsplit_method(model: nn.Module, config: BitSplitConfig, budget: float, inputs: Inputs) -> Outcome:
    """Bit-Split from ``inputs.stats`` (else computed from the calibration batches); with
    ``config.select``, ``inputs.allocation`` is one more variant and the variants are scored on
    ``inputs.selection`` (else the calibration batches) against ``inputs.reference`` when given."""
    return grid_method_outcome(model, config, budget, inputs, "Bit-Split", rounding=bitsplit_rounding(config))
