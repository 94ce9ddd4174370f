"""DoReFa's weight quantiser fine-tuned after training (Zhou et al. 2016, "DoReFa-Net: Training Low
Bitwidth Convolutional Neural Networks with Low Bitwidth Gradients").

DoReFa trains latent full-precision weights through a k-bit quantiser whose rounding is passed
straight through (``d quantize_k(r) / d r = 1``). Here that rule fine-tunes each layer's latent
weights on the calibration inputs, the grid fixed: with the latent weight ``w + s * delta``
(``delta`` in code units, started at 0, i.e. at nearest rounding)

    c = round(clip(w / s + delta + z, 0, Q_p))      D = s (c - z) - W      loss = tr(D H D^T)

and the straight-through gradient ``d loss / d delta = 2 (D H) s`` where ``0 <= w / s + delta + z
<= Q_p`` (no gradient where the clip holds the code). ``H`` and the loss are AdaRound's and LSQ's
(:meth:`bayesq.baselines.activations.InputStats.output_mse_metric`, the mean squared error over
output elements, exact over the whole calibration set at every step). Adam with a cosine decay to
0; each row keeps the codes of its best iterate (rows are independent given ``H``), nearest
rounding included, so the result never costs more than nearest rounding on the calibration
objective.

Differences from the paper, neutral or in DoReFa's favour:

* only the quantiser's codes move, by the layer's output reconstruction on calibration inputs, no
  labels (post-training, "short fine-tuning");
* DoReFa's ``tanh`` normalisation maps a network's latent weights into its quantiser's range
  ``[0, 1]`` while it trains from scratch; a post-training grid already covers the trained
  weights (GPTQ's min/max per group), so the latent weights feed the grid directly;
* grids, budgets and variants are GPTQ's (:mod:`bayesq.baselines.gptq`), as for AdaRound and LSQ:
  DoReFa's rule (straight-through codes), AdaRound's (a relaxed up/down choice) and GPTQ's (error
  feedback) differ only in how they round.
"""

from __future__ import annotations

import math
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
from bayesq.settings import validate


def dorefa_loss(delta: torch.Tensor, W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                maxq: torch.Tensor) -> torch.Tensor:
    """``tr(D H D^T)`` of the module docstring in autograd form (the reference the solver's
    hand-derived gradient is tested against): ``delta, W, scale, zero, maxq`` (rows, d), ``H``
    (d, d); ``round`` straight through, the clip's gradient 0 where it holds."""
    v = torch.minimum(torch.clamp(W / scale + delta + zero, min=0), maxq.to(W.dtype))  # clipped, then rounded
    D = scale * (v + (torch.round(v) - v).detach() - zero) - W
    return (D * (D @ H)).sum()


def _loss_and_grad(delta, W, H, scale, zero, maxq):
    """(loss of each row, d loss / d delta, codes) of :func:`dorefa_loss`, batched over groups of
    rows: ``delta, W, scale, zero, maxq`` (groups, rows, d), ``H`` (groups, d, d); one product
    ``D H``. The codes are returned as scored: near the end of the schedule the straight-through
    iterates sit on rounding boundaries, where recomputing them in another precision flips codes."""
    v = W / scale + delta + zero
    inside = (v >= 0) & (v <= maxq)
    c = torch.round(v).clamp(torch.zeros_like(maxq), maxq)
    D = scale * (c - zero) - W
    G = D @ H
    return (D * G).sum(-1), 2 * G * scale * inside, c


def dorefa_rows(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
                *, iters: int = 10000, lr: float = 2e-4, progress: bool = False, name: str = "", **_) -> torch.Tensor:
    """DoReFa's straight-through codes of the rows ``W`` on their fixed grids.

    Args:
        W: (out, d_in) float weights; rows ``g*out/groups ...`` belong to convolution group g.
        H: (groups, d_in, d_in) or (d_in, d_in) reconstruction metric (:meth:`InputStats.output_mse_metric`).
        scale, zero, maxq: (out, d_in) per-element grid (``w ~ scale * (code - zero)``, codes in
            ``[0, maxq]``; a scale of 0 gives the zero-point code).
        iters, lr: Adam steps (cosine decay to 0) and step on ``delta`` in code units.
        progress: a bar over the steps, named ``name``.

    Returns:
        (out, d_in) int64 codes in ``[0, maxq]``; each row's are those of its least-loss iterate.
    """
    Hg = H if H.dim() == 3 else H[None]
    groups, (n_out, d) = Hg.shape[0], W.shape
    dt = torch.float32

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(groups, n_out // groups, d)

    live = scale > 0
    s = torch.where(live, scale, torch.ones_like(scale))
    Ht = Hg.to(dt)
    Wt, st, zt, mt = (grouped(x.to(dt)) for x in (W, s, zero, maxq))
    delta = torch.zeros_like(Wt, requires_grad=True)
    opt = torch.optim.Adam([delta], lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iters)
    best_loss = torch.full(Wt.shape[:2], math.inf, dtype=dt, device=W.device)
    best = torch.zeros_like(Wt)
    for step in tqdm(range(iters + 1), desc=f"DoReFa {name}".strip(), disable=not progress, leave=False,
                     mininterval=1.0):
        rows, grad, codes = _loss_and_grad(delta.detach(), Wt, Ht, st, zt, mt)
        better = rows < best_loss
        best_loss = torch.minimum(rows, best_loss)
        best = torch.where(better[..., None], codes, best)
        if step == iters:  # the last iterate scored, not moved
            break
        delta.grad = grad
        opt.step()
        sched.step()
    return torch.where(live, best.reshape(n_out, d).to(torch.int64), zero.round().to(torch.int64))


@dataclass(frozen=True)
class DoReFaConfig:
    """DoReFa's straight-through fine-tuning on GPTQ's grids and variants
    (:mod:`bayesq.baselines.gptq`): with ``select`` the variant with the least KL on the selection
    inputs (``group_sizes`` its uniform layouts, ``bias_correction``: each variant also
    bias-corrected), else the ``mixed`` rule at ``granularity``. ``iters``, ``lr``:
    :func:`dorefa_rows`' schedule."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    bias_correction: bool = True
    iters: int = 10000
    lr: float = 2e-4
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "DoReFaConfig")
        if self.iters < 1:
            raise ValueError(f"dorefa.iters must be at least 1, got {self.iters}")
        if not self.lr > 0:
            raise ValueError(f"dorefa.lr must be > 0 (Adam's step on the latent weights in code units), "
                             f"got {self.lr}")


def dorefa_rounding(config: DoReFaConfig) -> LayerRounding:
    """GPTQ's pipeline with DoReFa's rounding (:func:`dorefa_rows` in :meth:`InputStats.output_mse_metric`)."""
    solver = partial(dorefa_rows, iters=config.iters, lr=config.lr, progress=config.progress)
    return LayerRounding("DoReFa", InputStats.output_mse_metric, solver)


@register(DoReFaConfig)
def dorefa_method(model: nn.Module, config: DoReFaConfig, budget: float, inputs: Inputs) -> Outcome:
    """DoReFa from ``inputs.stats`` (else computed from the calibration batches); with
    ``config.select``, ``inputs.allocation`` is one more variant and the variants are scored on
    ``inputs.selection`` (else the calibration batches) against ``inputs.reference`` when given."""
    return grid_method_outcome(model, config, budget, inputs, "DoReFa", rounding=dorefa_rounding(config))
