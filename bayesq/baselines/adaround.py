"""AdaRound (Nagel et al. 2020, "Up or Down? Adaptive Rounding for Post-Training Quantization").

Each weight is rounded down or up on a fixed grid, the choice learned per layer: with
``c0 = floor(w / s) + z`` (the code below the weight) the soft code is ``c0 + h(V)``, where

    h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1)          (rectified sigmoid, zeta 1.1, gamma -0.1)

and ``V`` (one logit per weight, started at ``h(V) = w / s - floor(w / s)``) minimises by Adam

    tr(D H D^T) / (T out)  +  lambda * sum_{o,j} (1 - |2 h(V_oj) - 1|^beta)    D = s (clip(c0 + h(V), 0, maxq) - z) - W

the layer-output reconstruction error on the calibration inputs plus the regulariser that drives
``h`` to 0 or 1. ``H`` are the layer's input second moments (:mod:`bayesq.baselines.activations`:
mean over inputs of the sum over positions), ``T`` the positions per input and ``out`` the
output features, so the first term is the mean squared error over output elements, the loss of
the authors' implementation that ``lambda = 0.01`` was set for. A sum over output features
weighs the error ``out`` times more against the regulariser: on the 2 x 6 layers of
tests/test_adaround.py a factor of 2-4 already left some ``h`` between 0 and 1 and the codes worse
than nearest rounding. ``beta`` anneals linearly from 20 to 2 after a warm-up (the first 20 % of the iterations, without the regulariser). The codes are
``c0 + [h(V) >= 1/2]``, clipped to the grid.

Differences from the paper, all of them neutral or in AdaRound's favour:

* the full calibration set enters every step through ``H`` (exact gradient, deterministic),
  where the paper samples a batch of 32 inputs per step;
* the reconstruction is of the layer's linear output, the paper's main variant (its asymmetric
  variant with the activation function and quantised predecessors is BRECQ's territory);
* grids, budgets and variants are GPTQ's (:mod:`bayesq.baselines.gptq`: min/max grids per group
  or channel, the mixed-precision rule, uniform layouts, selection on held-out inputs), so that
  AdaRound and GPTQ differ only in how they round.
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

ZETA, GAMMA = 1.1, -0.1


def rectified_sigmoid(v: torch.Tensor) -> torch.Tensor:
    """``h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1)``, elementwise."""
    return (torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA).clamp(0.0, 1.0)


def initial_logits(rest: torch.Tensor) -> torch.Tensor:
    """``V`` with ``h(V) = rest`` for ``rest`` in [0, 1): the inverse of :func:`rectified_sigmoid`."""
    return -torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)


def beta_at(step: int, iters: int, warmup: float, beta: tuple[float, float]) -> float | None:
    """The regulariser's exponent at ``step``: None during the warm-up (no regulariser), then
    linear from ``beta[0]`` to ``beta[1]`` over the remaining steps."""
    start = int(warmup * iters)
    if step < start:
        return None
    return beta[1] + (beta[0] - beta[1]) * max(0.0, 1.0 - (step - start) / max(1, iters - start))


def adaround_loss(v: torch.Tensor, W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  maxq: torch.Tensor, low: torch.Tensor, lam: float, b: float | None) -> torch.Tensor:
    """The objective of the module docstring for one group of rows (autograd form; the solver
    uses its hand-derived gradient, :class:`Relaxation`): ``W, v, scale, zero, maxq, low``
    (rows, d), ``H`` (d, d)."""
    D = scale * ((low + rectified_sigmoid(v)).clamp(torch.zeros_like(maxq), maxq) - zero) - W
    rec = (D * (D @ H)).sum()
    if b is None:
        return rec
    return rec + lam * (1 - (2 * rectified_sigmoid(v) - 1).abs().pow(b)).sum()


class Relaxation:
    """:func:`adaround_loss`'s gradient in ``v``, derived by hand, for groups of rows on fixed grids.

    ``W, scale, zero, maxq, low`` (groups, rows, d), ``H`` (groups, d, d), one dtype. What no step
    changes is computed once: ``low - zero``, the codes' bounds ``[clamp(low, 0, maxq),
    clamp(low + 1, 0, maxq)] - zero`` (the rectified sigmoid's clip and the grid's in one clamp:
    ``clamp(low + clamp(r, 0, 1), 0, maxq) = clamp(low + r, clamp(low, 0, maxq), clamp(low + 1, 0,
    maxq))``), and the constant factors of both terms. A step then runs one ``D H`` product and
    about fifteen elementwise passes; the loss itself, which Adam never reads, is not computed.
    """

    def __init__(self, W, H, scale, zero, maxq, low):
        self.H, self.scale = H, scale
        self.neg_w = -W
        self.shift = low - zero
        self.lo = low.clamp(torch.zeros_like(maxq), maxq) - zero
        self.hi = (low + 1).clamp(torch.zeros_like(maxq), maxq) - zero
        self.rec = 2 * (ZETA - GAMMA) * scale  # d rec / d r = 2 (D H) * scale inside the grid; dr/dsig = zeta - gamma

    def grad(self, v: torch.Tensor, lam: float, b: float | None) -> torch.Tensor:
        """d :func:`adaround_loss` / d ``v``, shaped as ``v``; ``b`` None: the reconstruction term alone."""
        sig = torch.sigmoid(v)
        raw = sig * (ZETA - GAMMA) + GAMMA  # rectified sigmoid before its clip
        y = raw + self.shift  # code - zero before the clamps
        cz = torch.clamp(y, self.lo, self.hi)
        g = torch.addcmul(self.neg_w, self.scale, cz) @ self.H  # D H
        g.mul_(self.rec).mul_(cz == y)  # no gradient where the grid clamps the code
        if b is not None:  # lam (1 - |u|^b), u = 2 h - 1: d/dr = -2 lam b |u|^(b-1) sign(u)
            u = raw * 2 - 1
            g.sub_(torch.copysign(u.abs().pow_(b - 1), u), alpha=2 * lam * b * (ZETA - GAMMA))
        live = (raw > 0) & (raw < 1)  # the clip passes no gradient outside (0, 1)
        return g.mul_(live).mul_(torch.addcmul(sig, sig, sig, value=-1))  # dsig/dv = sig (1 - sig)


def adaround_rows(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
                  *, iters: int = 10000, lam: float = 0.01, beta: tuple[float, float] = (20.0, 2.0),
                  warmup: float = 0.2, lr: float = 1e-3, progress: bool = False, name: str = "", **_) -> torch.Tensor:
    """AdaRound codes of the rows ``W`` on their fixed grids.

    Args:
        W: (out, d_in) float weights; rows ``g*out/groups ...`` belong to convolution group g.
        H: (groups, d_in, d_in) or (d_in, d_in) reconstruction metric (:meth:`InputStats.output_mse_metric`;
            PSD, no damping needed: nothing is inverted).
        scale, zero, maxq: (out, d_in) per-element grid (``w ~ scale * (code - zero)``, codes in
            ``[0, maxq]``; a scale of 0 gives the zero-point code).
        iters, lam, beta, warmup, lr: the paper's schedule (module docstring).
        progress: a bar over the steps, named ``name``.

    Returns:
        (out, d_in) int64 codes, each the code below its weight or the one above.
    """
    Hg = H if H.dim() == 3 else H[None]
    groups, (n_out, d) = Hg.shape[0], W.shape
    dt = torch.float32

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(groups, n_out // groups, d)

    live = scale > 0
    s = torch.where(live, scale, torch.ones_like(scale))
    ratio = W.double() / s.double()
    low = torch.floor(ratio) + zero  # (out, d) code below the weight
    Ht = Hg.to(dt)
    Wt, st, zt, mt, lt = (grouped(x.to(dt)) for x in (W, s, zero, maxq, low))
    v = grouped(initial_logits((ratio - torch.floor(ratio)).clamp(0.0, 1 - 1e-6)).to(dt)).requires_grad_()
    relaxed = Relaxation(Wt, Ht, st, zt, mt, lt)
    opt = torch.optim.Adam([v], lr=lr)
    for step in tqdm(range(iters), desc=f"AdaRound {name}".strip(), disable=not progress, leave=False,
                     mininterval=1.0):
        v.grad = relaxed.grad(v.detach(), lam, beta_at(step, iters, warmup, beta))
        opt.step()
    up = (rectified_sigmoid(v.detach()) >= 0.5).reshape(n_out, d)
    codes = torch.minimum(torch.clamp(low + up, min=0), maxq.double()).to(torch.int64)
    return torch.where(live, codes, zero.round().to(torch.int64))


@dataclass(frozen=True)
class AdaRoundConfig:
    """AdaRound on GPTQ's grids and variants (:mod:`bayesq.baselines.gptq`): with ``select`` the
    variant with the least KL on the selection inputs (``group_sizes`` its uniform layouts,
    ``bias_correction``: each variant also bias-corrected), else the ``mixed`` rule at
    ``granularity``. ``iters``, ``lam``, ``beta``, ``warmup``, ``lr``: the paper's schedule."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    bias_correction: bool = True
    iters: int = 10000
    lam: float = 0.01
    beta: tuple[float, float] = (20.0, 2.0)
    warmup: float = 0.2
    lr: float = 1e-3
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "AdaRoundConfig")
        check_schedule("adaround", self)


def check_schedule(method: str, cfg) -> None:
    """``ValueError`` naming ``<method>.<field>`` unless ``cfg``'s AdaRound schedule (``iters``,
    ``warmup``, ``lam``, ``lr``, ``beta``) is valid (AdaRound, BRECQ)."""
    if cfg.iters < 1:
        raise ValueError(f"{method}.iters must be at least 1, got {cfg.iters}")
    if not (0 <= cfg.warmup < 1):
        raise ValueError(f"{method}.warmup must be in [0, 1), got {cfg.warmup}")
    if not (cfg.lam >= 0 and cfg.lr > 0 and all(b > 0 and math.isfinite(b) for b in cfg.beta)):
        raise ValueError(f"{method} needs lam >= 0, lr > 0 and positive betas, got lam={cfg.lam}, "
                         f"lr={cfg.lr}, beta={cfg.beta}")


def adaround_rounding(config: AdaRoundConfig) -> LayerRounding:
    """GPTQ's pipeline with AdaRound's rounding (:func:`adaround_rows` in :meth:`InputStats.output_mse_metric`)."""
    solver = partial(adaround_rows, iters=config.iters, lam=config.lam, beta=tuple(config.beta),
                     warmup=config.warmup, lr=config.lr, progress=config.progress)
    return LayerRounding("AdaRound", InputStats.output_mse_metric, solver)


@register(AdaRoundConfig)
def adaround_method(model: nn.Module, config: AdaRoundConfig, budget: float, inputs: Inputs) -> Outcome:
    """AdaRound from ``inputs.stats`` (else computed from the calibration batches); with
    ``config.select``, ``inputs.allocation`` is one more variant and the variants are scored on
    ``inputs.selection`` (else the calibration batches) against ``inputs.reference`` when given."""
    return grid_method_outcome(model, config, budget, inputs, "AdaRound", rounding=adaround_rounding(config))
