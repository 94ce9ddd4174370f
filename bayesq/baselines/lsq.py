"""LSQ, LSQ+ and PACT after training: the weight quantiser's step sizes (LSQ: Esser et al. 2020,
"Learned Step Size Quantization") and offsets (LSQ+: Bhalgat et al. 2020, "LSQ+: Improving
low-bit quantization through learnable offsets and better initialization") learned on the
calibration inputs, the weights themselves left as they are.

Each group ``g`` of a layer has the grid ``w_hat = s_g (round(clip(w / s_g + z_g, 0, Q_p)) - z_g)``
(``Q_p = 2^b - 1``; clipped, then rounded, as in LSQ) with ``round`` passed straight through, so
with ``x = w / s`` and "inside" meaning ``0 < x + z < Q_p``

    d w_hat / d s = round(x) - x   inside,   -z  below,   Q_p - z  above       (LSQ eq. 3)
    d w_hat / d z = 0              inside,   -s  below or above                (LSQ+)

LSQ learns ``s_g``, the zero-point ``z_g`` fixed at the starting grid's. LSQ+ also learns the
offset: ``z_g`` continuous, rounded (straight through) to the stored integer zero-point in every
forward pass, so LSQ+'s offset ``beta = -s z`` lives on the multiples of ``s``: the storage
format every method here shares (an fp16 scale and a b-bit zero-point per group). Both gradients
carry LSQ's gradient scale ``1 / sqrt(n_g Q_p)`` (``n_g`` weights share the step).

The objective is AdaRound's layer-output error ``tr(D H D^T) / (T out)``, ``D = W_hat - W``
(:meth:`bayesq.baselines.activations.InputStats.output_mse_metric`: the mean squared error over output
elements, ``H`` the layer's input second moments over the whole calibration set, so every step
has the exact gradient). The optimiser is Adam with the cosine decay of LSQ's schedule, on
``s_g / s_g^0`` (a step of ``lr`` moves a scale by about ``lr`` of its start, whatever its
magnitude) and on ``z_g`` in code units. Adam normalises each parameter's gradient, so the
gradient scale above is a constant factor it divides out (it changes only Adam's epsilon): LSQ
set it for SGD on weights and steps together. The iterate with the least objective, the start
included, is kept, so the learned grid is never worse than the start on the calibration
objective; its scales are then rounded to fp16 and the codes are the nearest levels.

PACT (Choi et al. 2018, "PACT: Parameterized Clipping Activation for Quantized Neural Networks")
learns the clipping level by the straight-through estimator that passes the quantised value
through as the unquantised one, ``w_hat ~ clip(w)`` inside: its gradient is the clipped ends' only,

    d w_hat / d s = 0   inside,   -z  below,   Q_p - z  above                   (PACT eq. 3)

LSQ's paper contrasts exactly this with its own ``round(x) - x``. PACT has no gradient scale
(``gradient=StepGradient.PACT`` here: the same fit, the inside term and the gradient scale
dropped). PACT clips activations at ``[0, alpha]``; on weights its one learned level per group is
the range ``[-z s, (Q_p - z) s]`` of the group's grid, scaled as ``s`` moves. The L2 penalty PACT
puts on ``alpha`` (it keeps activation ranges small during training) is left out: on the
reconstruction objective it could only raise the error.

Differences from the papers, neutral or in LSQ's favour: only the quantiser is trained (post-
training, calibration inputs only, no labels); the start is GPTQ's min/max grid per group (the
papers' ``2 <|w|> / sqrt(Q_p)`` and LSQ+'s MSE start are for training a network from full
precision); grids, budgets and variants are GPTQ's (:mod:`bayesq.baselines.gptq`: the
mixed-precision rule, the uniform layouts, selection on held-out inputs), so LSQ, AdaRound and
GPTQ differ only in how they fit a layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
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

MIN_RATIO = 1e-2  # a scale shrinks to at most this share of its start


class StepGradient(str, Enum):
    """The straight-through gradient of a grid's step (module docstring): LSQ's (with its
    gradient scale) or PACT's (the clipped ends' only)."""

    LSQ = "lsq"
    PACT = "pact"


#: Adam's step on ``s / s^0`` that measured best per estimator (benchmarks/learned_iters.py, docs/usage.md)
DEFAULT_LR = {StepGradient.LSQ: 0.2, StepGradient.PACT: 0.01}


def nearest_rows(W: torch.Tensor, metric: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
                 **_) -> torch.Tensor:
    """(out, d_in) int64 nearest codes ``clip(round(w / s) + z, 0, maxq)`` of ``W`` on its
    per-element grid (a scale of 0 gives the zero-point code); ``metric`` is not read."""
    live = scale > 0
    s = torch.where(live, scale, torch.ones_like(scale))
    codes = torch.minimum(torch.clamp(torch.round(W / s) + zero, min=0), maxq.to(W.dtype)).to(torch.int64)
    return torch.where(live, codes, zero.round().to(torch.int64))


def lsq_loss(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
             gscale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``tr(D H D^T)`` of the module docstring in autograd form (the reference the fit's
    hand-derived gradient is tested against): ``W, scale, zero, maxq, gscale`` (rows, d) per
    element, ``H`` (d, d); ``round`` straight through, ``zero`` rounded straight through, and the
    gradients of ``scale`` and ``zero`` multiplied by ``gscale`` (LSQ's ``grad_scale``)."""
    s = scale * gscale + (scale - scale * gscale).detach()
    z = zero * gscale + (zero - zero * gscale).detach()
    z = z + (torch.round(z) - z).detach()
    v = torch.minimum(torch.clamp(W / s + z, min=0), maxq.to(W.dtype))
    D = s * (v + (torch.round(v) - v).detach() - z) - W
    return (D * (D @ H)).sum()


def _loss_and_grads(W, H, s, z, maxq, offset: bool = True, gradient: StepGradient = StepGradient.LSQ):
    """(loss of each row, d loss / d s, d loss / d z per element, None unless ``offset``) of
    :func:`lsq_loss` without the gradient scale (the fit applies it per group; the loss is the sum
    of the rows'), batched over convolution groups: ``W, s, z, maxq`` (cgroups, rows, d), ``H``
    (cgroups, d, d), ``z`` already rounded; one product ``D H`` per step. ``gradient`` PACT: the
    step's gradient without LSQ's inside term ``round(x) - x``."""
    x = W / s
    v = x + z
    inside = (v > 0) & (v < maxq)
    c = torch.round(torch.minimum(v.clamp(min=0), maxq))
    D = s * (c - z) - W
    G = D @ H
    rows = (D * G).sum(-1)
    dD = G.mul_(2)
    if gradient == StepGradient.PACT:
        ds = dD * (c - z) * ~inside  # 0 inside, -z below (c = 0), maxq - z above (c = maxq)
    else:
        ds = dD * (c - z - x * inside)  # round(x) - x inside, -z below (c = 0), maxq - z above (c = maxq)
    return rows, ds, (dD * s * (inside.to(s.dtype) - 1) if offset else None)


def lsq_grid(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor,
             groups: torch.Tensor, *, offset: bool = False, iters: int = 10000, lr: float = 0.2,
             zero_lr: float = 0.02, gradient: StepGradient = StepGradient.LSQ, progress: bool = False,
             name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The learned grids of the groups of rows ``W``.

    Args:
        W: (out, d_in) float64 weights; rows ``c*out/cgroups ...`` belong to convolution group c.
        H: (cgroups, d_in, d_in) or (d_in, d_in) reconstruction metric (:meth:`InputStats.output_mse_metric`).
        scale, zero, maxq: (g,) the starting grid of each of the rows' g groups (``w ~ scale *
            (code - zero)``, codes in ``[0, maxq]``; a scale of 0, an all-zero group, stays).
        groups: (out, d_in) int64 index in ``[0, g)`` of each weight's group.
        offset: LSQ+ (zero-points learned too), else LSQ.
        iters, lr, zero_lr: Adam steps (cosine decay to 0), step on ``s / s^0`` and on ``z``.
        gradient: the step's straight-through gradient, LSQ's (with its gradient scale) or PACT's.
        progress: a bar over the steps, named ``name``.

    Returns:
        (g,) float64 scales and (g,) integer-valued float64 zero-points in ``[0, maxq]``.
    """
    Hg = H if H.dim() == 3 else H[None]
    cgroups, (n_out, d) = Hg.shape[0], W.shape
    dt = torch.float32

    def grouped(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(cgroups, n_out // cgroups, d)

    live = scale > 0
    s0 = torch.where(live, scale, torch.ones_like(scale)).to(dt)
    counts = torch.bincount(groups.reshape(-1), minlength=scale.numel()).to(dt)
    gscale = 1.0 / torch.sqrt(counts * maxq.to(dt))  # (g,) LSQ's gradient scale
    if gradient == StepGradient.PACT:
        gscale = torch.ones_like(gscale)
    Ht, Wt, mt = Hg.to(dt), grouped(W.to(dt)), grouped(maxq.to(dt)[groups])
    u = torch.ones_like(s0, requires_grad=True)  # s = s0 * u
    zt = zero.to(dt).clone().requires_grad_(offset)
    params = [{"params": [u], "lr": lr}] + ([{"params": [zt], "lr": zero_lr}] if offset else [])
    opt = torch.optim.Adam(params)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=iters)
    flat = groups.reshape(-1)

    def grid(u_: torch.Tensor, z_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = torch.where(live, s0 * u_.clamp(min=MIN_RATIO), s0)
        return s, torch.round(z_.clamp(torch.zeros_like(z_), maxq.to(dt)))

    owner = _row_of_group(groups, scale.numel())  # the part of the objective each group's grid is kept by
    best_loss = torch.full((int(owner.max()) + 1,), math.inf, dtype=dt, device=W.device)
    best_u, best_z = u.detach().clone(), zt.detach().clone()
    label = "PACT" if gradient == StepGradient.PACT else f"LSQ{'+' if offset else ''}"
    for step in tqdm(range(iters + 1), desc=f"{label} {name}".strip(), disable=not progress, leave=False,
                     mininterval=1.0):
        s, z = grid(u.detach(), zt.detach())
        rows, ds, dz = _loss_and_grads(Wt, Ht, grouped(s[groups]), grouped(z[groups]), mt, offset, gradient)
        loss = rows.reshape(-1) if best_loss.numel() > 1 else rows.sum().reshape(1)
        better = (loss < best_loss)[owner]
        best_loss = torch.minimum(loss, best_loss)
        best_u, best_z = torch.where(better, u.detach(), best_u), torch.where(better, zt.detach(), best_z)
        if step == iters:  # the last iterate scored, not moved
            break
        inside = live & (u.detach() > MIN_RATIO)  # the clamp passes no gradient below MIN_RATIO
        u.grad = torch.zeros_like(u).index_add_(0, flat, ds.reshape(-1)) * (gscale * s0 * inside)
        if offset:
            free = (zt.detach() >= 0) & (zt.detach() <= maxq.to(dt)) & live
            zt.grad = torch.zeros_like(zt).index_add_(0, flat, dz.reshape(-1)) * (gscale * free)
        opt.step()
        sched.step()
    s, z = grid(best_u, best_z)
    return torch.where(live, s.double(), scale), z.double()


def _row_of_group(groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(n_groups,) int64: the row each group lies in when no group straddles two rows (rows are
    independent given ``H``, so each row keeps its own best grids), else all 0 (one objective)."""
    rows = torch.arange(groups.shape[0], device=groups.device)[:, None].expand_as(groups).reshape(-1)
    flat = groups.reshape(-1)
    lo = torch.full((n_groups,), groups.shape[0], dtype=torch.int64, device=groups.device)
    lo = lo.scatter_reduce(0, flat, rows, "amin")
    hi = torch.full((n_groups,), -1, dtype=torch.int64, device=groups.device).scatter_reduce(0, flat, rows, "amax")
    return lo if bool((lo == hi).all()) else torch.zeros_like(lo)


def lsq_solver(offset: bool, iters: int, lr: float, zero_lr: float, progress: bool,
               gradient: StepGradient = StepGradient.LSQ):
    """The grid fit :func:`bayesq.rounding.encode` calls per row chunk (:func:`lsq_grid`)."""
    return partial(lsq_grid, offset=offset, iters=iters, lr=lr, zero_lr=zero_lr, gradient=gradient,
                   progress=progress)


@dataclass(frozen=True)
class LSQConfig:
    """LSQ (``offset`` False) or LSQ+ (True), or PACT (``gradient`` PACT, no offset), on GPTQ's
    grids and variants (:mod:`bayesq.baselines.gptq`): with ``select`` the variant with the least
    KL on the selection inputs (``group_sizes`` its uniform layouts, ``bias_correction``: each
    variant also bias-corrected), else the ``mixed`` rule at ``granularity``. ``iters``, ``lr``,
    ``zero_lr``, ``gradient``: :func:`lsq_grid`'s schedule and estimator (``lr`` None: the
    estimator's :data:`DEFAULT_LR`)."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    bias_correction: bool = True
    offset: bool = False
    iters: int = 10000
    lr: float | None = None
    zero_lr: float = 0.02
    gradient: StepGradient = StepGradient.LSQ
    progress: bool = True

    def __post_init__(self) -> None:
        try:
            gradient = StepGradient(self.gradient)
        except ValueError:
            raise ValueError(f"lsq.gradient must be one of {[g.value for g in StepGradient]}, "
                             f"got {self.gradient!r}") from None
        object.__setattr__(self, "gradient", gradient)
        object.__setattr__(self, "lr", DEFAULT_LR[gradient] if self.lr is None else self.lr)
        validate(self, "LSQConfig")
        if self.iters < 1:
            raise ValueError(f"lsq.iters must be at least 1, got {self.iters}")
        if not (self.lr > 0 and self.zero_lr > 0):
            raise ValueError(f"lsq needs lr > 0 and zero_lr > 0, got lr={self.lr}, zero_lr={self.zero_lr}")
        if gradient == StepGradient.PACT and self.offset:
            raise ValueError("lsq.offset is LSQ+'s learned zero-point; PACT learns one clipping level per group "
                             "(gradient='pact' needs offset=False)")

    @property
    def method(self) -> str:
        if self.gradient == StepGradient.PACT:
            return "PACT"
        return "LSQ+" if self.offset else "LSQ"


def lsq_rounding(config: LSQConfig) -> LayerRounding:
    """GPTQ's pipeline with LSQ's learned grids (:func:`lsq_grid` in
    :meth:`InputStats.output_mse_metric`) and nearest rounding on them."""
    fit = lsq_solver(config.offset, config.iters, config.lr, config.zero_lr, config.progress, config.gradient)
    return LayerRounding(config.method, InputStats.output_mse_metric, nearest_rows, grid_fit=fit)


@register(LSQConfig)
def lsq_method(model: nn.Module, config: LSQConfig, budget: float, inputs: Inputs) -> Outcome:
    """LSQ / LSQ+ / PACT from ``inputs.stats`` (else computed from the calibration batches); with
    ``config.select``, ``inputs.allocation`` is one more variant and the variants are scored on
    ``inputs.selection`` (else the calibration batches) against ``inputs.reference`` when given."""
    return grid_method_outcome(model, config, budget, inputs, config.method, rounding=lsq_rounding(config))
