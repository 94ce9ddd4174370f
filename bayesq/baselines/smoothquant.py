"""SmoothQuant (Xiao et al. 2023), weight-only: activation outliers migrated into the weights.

SmoothQuant divides each input channel ``j`` of a layer's activation by

    s_j = max|X_j|^alpha / max_o |W_oj|^(1 - alpha)        (alpha = 0.5, the paper's default)

and multiplies the weight's column ``j`` by it, so that ``X W^T = (X diag(s)^-1)(W diag(s))^T``
is unchanged; then it quantises both (W8A8). ``max|X_j|`` is the largest activation magnitude of
the channel over the calibration inputs and positions (:attr:`InputStats.abs_max`), ``max_o``
over the weight's output rows; both are clamped to at least 1e-5, as in the reference code.
Conv2d: per input channel over its kernel positions.

Weight-only, the activation stays in floating point: the migration changes only the weight that
is quantised, ``W_hat = Q(W diag(s)) diag(s)^-1``. That is AWQ's form with SmoothQuant's
closed-form scale in place of AWQ's searched one, so it runs on AWQ's code
(:func:`bayesq.baselines.awq.awq_select`): the inverse scales stored in fp16 and counted, the
same layers scaled (none with one input channel per group, nor small heads), AWQ's mixed rule,
and the same selection among mixed and uniform variants on the selection inputs. SmoothQuant's
goal is the reverse of weight-only quantisation's: it makes activations easier by making weights
harder, and ``docs/findings.md`` reports what that costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from bayesq.baselines.activations import InputStats
from bayesq.baselines.awq import awq_quantize, awq_select
from bayesq.baselines.select import choice_outcome, group_sizes_setting, mixed_outcome, stats_of
from bayesq.config import Granularity, QuantConfig
from bayesq.methods import Inputs, Outcome, register
from bayesq.settings import validate

ALPHA = 0.5
#: Floor of both maxima (the reference implementation's clamp).
FLOOR = 1e-5


def smooth_scales(W: torch.Tensor, stats: InputStats, kernel: int, alpha: float = ALPHA) -> torch.Tensor:
    """SmoothQuant's column scales of one layer.

    Args:
        W: (out, d_in) float64 weight matrix (Conv2d unfolded channel-major: d_in = c_in/groups * kernel).
        stats: the layer's input statistics, with ``abs_max`` (groups, d_in).
        kernel: kernel positions per input channel (kh*kw; 1 for Linear).
        alpha: migration strength in [0, 1].

    Returns:
        (groups, d_in) float64 ``s``: ``max|X_c|^alpha / max|W_c|^(1-alpha)`` of each input
        channel ``c``, repeated over its kernel positions.
    """
    if stats.abs_max is None:
        raise ValueError("SmoothQuant reads the layers' largest input magnitudes, but these statistics were taken "
                         "without them: compute them with input_stats(..., abs_mean=True) (the default)")
    g, d = stats.abs_max.shape
    act = stats.abs_max.reshape(g, d // kernel, kernel).amax(-1)  # (groups, c_in)
    wmax = W.abs().reshape(g, W.shape[0] // g, d // kernel, kernel).amax((1, 3))  # (groups, c_in)
    s = act.clamp_min(FLOOR).pow(alpha) / wmax.clamp_min(FLOOR).pow(1 - alpha)
    return s.repeat_interleave(kernel, dim=1)


@dataclass(frozen=True)
class SmoothQuantConfig:
    """SmoothQuant weight-only (:func:`smooth_scales` on AWQ's code) with migration strength
    ``alpha``; ``select``, ``group_sizes``, ``bias_correction``, ``granularity``, ``progress`` as
    :class:`bayesq.baselines.awq.AWQConfig`."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    alpha: float = ALPHA
    bias_correction: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "SmoothQuantConfig")
        if not 0.0 <= float(self.alpha) <= 1.0:
            raise ValueError(f"SmoothQuantConfig.alpha = {self.alpha!r}: the migration strength must lie in [0, 1] "
                             "(the paper uses 0.5)")


@register(SmoothQuantConfig)
def smoothquant_method(model: nn.Module, config: SmoothQuantConfig, budget: float, inputs: Inputs) -> Outcome:
    """SmoothQuant from ``inputs.stats`` (else computed from the calibration batches), selection
    as :func:`bayesq.baselines.awq.awq_method`."""
    batches, stats, known = stats_of(model, inputs, "SmoothQuant", config.progress)
    rule = partial(smooth_scales, alpha=float(config.alpha))
    exclude = tuple(inputs.exclude)
    if not config.select:
        return mixed_outcome(awq_quantize(model, stats, budget, config.quant, granularity=config.granularity,
                                          exclude=exclude, scales=rule, progress=config.progress), inputs)
    choice = awq_select(model, stats, batches, budget, config.quant, granularity=config.granularity,
                        group_sizes=config.group_sizes, bias_correction=config.bias_correction,
                        selection=inputs.selection, known=known, exclude=exclude, scales=rule,
                        method="SmoothQuant", progress=config.progress)
    return choice_outcome(choice, inputs)
