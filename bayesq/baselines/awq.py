"""AWQ, weight-only (Lin et al. 2024): activation-aware per-input-channel scales.

Salient input channels (large mean activation magnitude) are protected by scaling them up
before quantisation and dividing the decoded weight by the same factor:

    W_hat = Q(W diag(s)) diag(s)^-1,   s_j = m_j^alpha / sqrt(max_k m_k^alpha * min_k m_k^alpha),

``m_j = mean |a_j|`` over calibration inputs and positions (Conv2d: averaged over the kernel
positions of input channel j). ``alpha`` is searched on AWQ's grid {0, 1/20, ..., 19/20}
minimising the calibration layer-output error ``tr(D H D^T)``, ``D = W_hat - W``
(:mod:`bayesq.baselines.activations`), with per-group min/max grids at the reference
bit-width: the largest candidate not above the budget (3 at 3.0 and 3.5 bits). ``alpha = 0`` is RTN, so the search
never does worse than RTN on that objective. Depthwise convolutions (one input channel per
group) have nothing to scale and are quantised as RTN.

The inverse scale is stored, not folded into the preceding operation (folding needs the
graph: a LayerNorm or BatchNorm right before the layer): ``in_channels`` fp16 values per
scaled layer, counted in the first allocation unit of the layer. Layers where that would cost
more than ``MAX_SCALE_BITS`` bits per weight (classifier heads) are not scaled. Fractional budgets: the greedy
knapsack over units with loss ``sum_{o,j} (H_jj / s_j^2) (Q_b(w_oj s_j) - w_oj s_j)^2`` (the
diagonal of the output error, in the original weight space). :func:`awq_select` instead picks,
on the calibration inputs, the best of that rule and uniform bit-widths with the smallest group
size that fits, the stored scales counted in every variant (:mod:`bayesq.baselines.select`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from bayesq.assignment import allocate
from bayesq.baselines.activations import InputStats
from bayesq.baselines.select import (
    GROUP_SIZES, BaselineChoice, baseline_blocks, cheapest_bits, check_feasible, choice_outcome, group_sizes_setting,
    mixed_min_bits, mixed_outcome, select_variants, stats_of, uniform_variants,
)
from bayesq.blocks import LayerBlocks, checked_layers
from bayesq.canonical import on_canonical
from bayesq.config import Granularity, QuantConfig
from bayesq.context import KnownOutputs
from bayesq.expected_loss import LossTable, rtn_table
from bayesq.forward import Batch
from bayesq.grids import minmax_grids
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import QuantizationResult, baseline_result
from bayesq.rounding import encode
from bayesq.settings import integer, setting, validate
from bayesq.storage import budget_bits

GRID = 20
#: (W (out, d_in) float64, the layer's statistics, kernel positions per input channel) ->
#: (groups, d_in) float64 column scales ``s``: a closed-form scale in place of AWQ's search (SmoothQuant)
ScaleRule = Callable[[torch.Tensor, InputStats, int], torch.Tensor]
#: A layer is scaled only if its stored scales cost at most this many bits per weight of the
#: layer (16 * c_in <= 0.25 * out * c_in * kh * kw, i.e. out * kh * kw >= 64): small heads such as
#: a 10-class classifier keep s = 1, as AWQ leaves the LM head alone.
MAX_SCALE_BITS = 0.25


def channel_magnitude(stats: InputStats, kernel: int) -> torch.Tensor:
    """(groups, c_in) float64 mean |a| per input channel (patch columns are channel-major)."""
    if stats.abs_mean is None:
        raise ValueError("AWQ reads the layers' mean input magnitudes, but these statistics were taken without "
                         "them: compute them with input_stats(..., abs_mean=True) (the default)")
    g, d = stats.abs_mean.shape
    return stats.abs_mean.reshape(g, d // kernel, kernel).mean(-1)  # (groups, c_in, k) -> mean over k


def output_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """``sum_g tr(D_g H[g] D_g^T)``, D = W_hat - W as (out, d_in), rows split into H's groups."""
    g = H.shape[0]
    D = (W_hat - W).reshape(g, W.shape[0] // g, -1)  # (groups, out/groups, d_in)
    return float(torch.einsum("goi,gij,goj->", D, H.to(D.dtype), D))


def _rtn(W: torch.Tensor, lb: LayerBlocks, bits: int, scale_bits: int) -> torch.Tensor:
    """Min/max-grid round trip of an (out, d_in) matrix with ``lb``'s groups."""
    groups, _ = lb.to_groups(W.reshape(-1))
    g = minmax_grids(groups, bits, scale_bits)
    return lb.from_groups(g.dequantize(g.quantize(groups))).reshape(W.shape)


def search_scale(
    W: torch.Tensor, stats: InputStats, lb: LayerBlocks, bits: int, kernel: int = 1,
    scale_bits: int = 16, grid: int = GRID,
) -> tuple[torch.Tensor, float]:
    """AWQ's scale search for one layer.

    Args:
        W: (out, d_in) float64 weight matrix (Conv2d unfolded: d_in = c_in/groups * kernel).
        stats: the layer's input statistics.
        lb: group layout used for the search's min/max grids.
        bits: reference bit-width.
        kernel: kernel positions per input channel (kh*kw; 1 for Linear).

    Returns:
        (s, alpha): (groups, d_in) float64 column scales (channel scale repeated over its
        kernel positions) and the chosen exponent.
    """
    mag = channel_magnitude(stats, kernel).clamp_min(1e-8)  # (groups, c_in)
    best = (math.inf, None, 0.0)
    for i in range(grid):
        alpha = i / grid
        s = mag.pow(alpha)
        s = s / (s.amax(1, keepdim=True) * s.amin(1, keepdim=True)).sqrt()
        s = s.repeat_interleave(kernel, dim=1)  # (groups, d_in)
        cols = s.repeat_interleave(W.shape[0] // s.shape[0], dim=0)  # (out, d_in)
        err = output_error(W, _rtn(W * cols, lb, bits, scale_bits) / cols, stats.H)
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def scale_count(mod: nn.Module, stats: InputStats) -> int:
    """Stored fp16 scales of one layer: ``groups * c_in_per_group`` if AWQ scales it, else 0.

    A layer is scaled when it has more than one input channel per group and its scales cost
    at most ``MAX_SCALE_BITS`` bits per weight.
    """
    w = mod.weight
    c_in = w[0].numel() // math.prod(w.shape[2:])  # input channels per group
    n_scales = stats.groups * c_in
    return n_scales if c_in > 1 and 16 * n_scales <= MAX_SCALE_BITS * w.numel() else 0


def scale_bits_total(layers: dict[str, nn.Module], stats: dict[str, InputStats]) -> int:
    """Bits of every stored AWQ scale over ``layers`` (16 per scale)."""
    return sum(16 * scale_count(m, stats[n]) for n, m in layers.items())


def _add_scale_cost(table: LossTable, extra: dict[str, int]) -> LossTable:
    """Charge ``extra[name]`` bits to every candidate of the first unit of each layer."""
    layers = []
    for t in table.layers:
        cost = t.unit_cost.clone()
        cost[0] += extra.get(t.blocks.name, 0)
        layers.append(replace(t, unit_cost=cost))
    return LossTable(tuple(layers))


@on_canonical
def awq_quantize(
    model: nn.Module, stats: dict[str, InputStats], budget: float, cfg: QuantConfig = QuantConfig(),
    *, granularity: Granularity = Granularity.GROUP, grid: int = GRID, exclude: Sequence[str] = (),
    scales: ScaleRule | None = None, progress: bool = False,
) -> QuantizationResult:
    """AWQ at ``budget`` average bits (codes, grids, headers and the stored scales counted).

    ``grid``: exponents searched, ``alpha = i / grid`` for i < grid. ``exclude``: module names or
    glob patterns kept in floating point (the result's ``unquantized``; they need no statistics).
    ``scales``: each scaled layer's column scales from this rule instead of AWQ's search
    (SmoothQuant's, :mod:`bayesq.baselines.smoothquant`); storage and mixed rule unchanged.
    ``progress``: a bar over the layers' scale searches, then one over their encodings.

    Raises:
        ValueError: missing stats, an infeasible budget, non-finite weights.
    """
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model", exclude)
    blocks = baseline_blocks(layers, Granularity(granularity), cfg)
    ref_bits = max((b for b in cfg.bits if b <= budget), default=min(cfg.bits))
    scaled, omega, col_scale, extra = {}, {}, {}, {}
    for lb in tqdm(blocks, desc="AWQ scales", disable=not progress, leave=False):
        mod = layers[lb.name]
        W = mod.weight.detach().double().reshape(lb.shape[0], -1)  # (out, d_in)
        kernel = math.prod(mod.weight.shape[2:])
        st = stats[lb.name]
        cols = torch.ones_like(W)
        n_scales = scale_count(mod, st)
        if n_scales:
            s = (scales(W, st, kernel) if scales is not None
                 else search_scale(W, st, lb, ref_bits, kernel, cfg.scale_bits, grid)[0])
            col_scale[lb.name] = s.to(torch.float16).double()  # stored in fp16
            cols = col_scale[lb.name].repeat_interleave(W.shape[0] // s.shape[0], dim=0)  # (out, d_in)
            extra[lb.name] = 16 * n_scales
        scaled[lb.name] = (W * cols).reshape(lb.shape)
        omega[lb.name] = st.row_diag(W.shape[0]) / cols.pow(2)
    table = _add_scale_cost(rtn_table(scaled, blocks, cfg, element_weight=omega, progress=progress), extra)
    allocation = allocate(table, budget)
    qweights = encode(table, allocation, scaled, progress=progress)
    qweights = {n: replace(q, col_scale=col_scale.get(n)) for n, q in qweights.items()}
    return baseline_result(model, layers, qweights, allocation, table, exclude)


@on_canonical
def awq_candidates(
    model: nn.Module, stats: dict[str, InputStats], budget: float, cfg: QuantConfig = QuantConfig(), *,
    granularity: Granularity = Granularity.GROUP, group_sizes: Sequence[int] = GROUP_SIZES, grid: int = GRID,
    exclude: Sequence[str] = (), scales: ScaleRule | None = None, method: str = "AWQ", progress: bool = False,
) -> dict[str, Callable[[], QuantizationResult]]:
    """Budget-feasible AWQ variants, unbuilt: ``mixed`` (:func:`awq_quantize` at ``granularity``)
    when its cheapest allocation fits, and ``uniform-<b>-g<G>`` / ``uniform-<b>-channel`` for
    each width of ``cfg.bits`` with a fitting layout from ``group_sizes`` (scale search at
    that width). The stored scales (:func:`scale_bits_total`) are counted in every variant.
    ``exclude``: module names or glob patterns kept in floating point (the result's
    ``unquantized``; they need no statistics). ``scales``, ``progress``: as :func:`awq_quantize`;
    ``method``: the name errors give.

    Raises:
        ValueError: missing stats, or no variant fits the budget (naming the minimum feasible one).
    """
    granularity = Granularity(granularity)
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model", exclude)
    n = sum(m.weight.numel() for m in layers.values())
    extra = scale_bits_total(layers, stats)
    out: dict[str, Callable[[], QuantizationResult]] = {}
    if mixed_min_bits(layers, granularity, cfg, extra) <= budget_bits(budget, n):
        out["mixed"] = partial(awq_quantize, model, stats, budget, cfg, granularity=granularity, grid=grid,
                               exclude=exclude, scales=scales, progress=progress)
    for v in uniform_variants(layers, budget, cfg, group_sizes, extra):
        out[v.name] = partial(awq_quantize, model, stats, budget, v.config(cfg), granularity=v.granularity,
                              grid=grid, exclude=exclude, scales=scales, progress=progress)
    check_feasible(out, method, budget, cheapest_bits(layers, granularity, cfg, group_sizes, extra))
    return out


@on_canonical
def awq_select(
    model: nn.Module, stats: dict[str, InputStats], batches: Iterable[Batch], budget: float,
    cfg: QuantConfig = QuantConfig(), *, granularity: Granularity = Granularity.GROUP,
    group_sizes: Sequence[int] = GROUP_SIZES, grid: int = GRID, bias_correction: bool = False,
    selection: Iterable[Batch] | None = None, known: KnownOutputs | None = None,
    exclude: Sequence[str] = (), scales: ScaleRule | None = None, method: str = "AWQ",
    progress: bool = False,
) -> BaselineChoice:
    """The AWQ variant of :func:`awq_candidates` with the least mean calibration
    ``KL(p_FP || p_Q)`` on ``batches`` (the inputs ``stats`` come from); ``bias_correction``:
    each variant also in its bias-corrected form (:func:`bayesq.baselines.select.select_best`).
    ``selection``: inputs held out of ``batches`` to score the variants on instead (the
    bias correction is still fitted on ``batches``). ``known``: the FP model's outputs the caller
    has (its log-probabilities on the scored inputs, its logits on ``batches``: the offset's fit;
    :class:`bayesq.context.KnownOutputs`). ``scales``,
    ``method``, ``progress``: as :func:`awq_candidates` (``progress``: also bars over the variants
    and the scoring passes, :func:`bayesq.baselines.select.select_best`).

    Raises:
        ValueError: as :func:`awq_candidates`; an empty ``batches``.
    """
    cands = awq_candidates(model, stats, budget, cfg, granularity=granularity, group_sizes=group_sizes, grid=grid,
                           exclude=exclude, scales=scales, method=method, progress=progress)
    return select_variants(cands, model, stats, batches, bias_correction, selection, known, progress)


@dataclass(frozen=True)
class AWQConfig:
    """AWQ (:func:`awq_quantize`, ``grid`` scale exponents searched); with ``select`` the variant
    of :func:`awq_select` with the least KL on the selection inputs, else the ``mixed`` rule;
    ``progress``: bars over the statistics pass, the scale searches, the variants and the scoring."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    grid: int = setting(GRID, integer(1))  # alpha searched on {0, 1/grid, ..., (grid - 1)/grid}
    bias_correction: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "AWQConfig")


@register(AWQConfig)
def awq_method(model: nn.Module, config: AWQConfig, budget: float, inputs: Inputs) -> Outcome:
    """AWQ from ``inputs.stats`` (else computed from the calibration batches), selection as
    :func:`bayesq.baselines.gptq.gptq_method` (no allocation variant)."""
    batches, stats, known = stats_of(model, inputs, "AWQ", config.progress)
    exclude = tuple(inputs.exclude)
    if not config.select:
        return mixed_outcome(awq_quantize(model, stats, budget, config.quant, granularity=config.granularity,
                                          grid=config.grid, exclude=exclude, progress=config.progress), inputs)
    choice = awq_select(model, stats, batches, budget, config.quant, granularity=config.granularity,
                        group_sizes=config.group_sizes, grid=config.grid, bias_correction=config.bias_correction,
                        selection=inputs.selection, known=known, exclude=exclude,
                        progress=config.progress)
    return choice_outcome(choice, inputs)
