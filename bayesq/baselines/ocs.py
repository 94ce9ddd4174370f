"""OCS (Zhao et al. 2019, "Improving Neural Network Quantization without Retraining using Outlier
Channel Splitting"): the input channels holding the largest weights are split in two.

A layer ``y = W x`` computes the same function as ``y = W' [x; x_s]``, where ``x_s`` repeats the
split input channels ``s`` and ``W'`` holds halves of their columns twice:

    repeat k = ceil(expand_ratio * c) times: the channel (original or a copy) holding the largest
    |w| is halved, and its half appended as a new channel (a copy of the same input channel).

Halving the outliers shrinks each group's range, so the grid is finer for every other weight, at
the price of k more input channels to store (each split channel's index counted too:
:func:`bayesq.storage.split_bits`). The expanded layer is quantised as GPTQ quantises any layer
(:mod:`bayesq.baselines.gptq`: its grids, variants, allocation and error feedback), under the
expanded inputs' second moment ``H' = E H E^T`` (E copies the split channels' rows). Error feedback on the
duplicated columns does what the paper's quantisation-aware splitting does by hand: the second
half compensates the first half's rounding error. The budget counts the deployed layer's weights:
the expanded codes, their scales and the split indices fit ``budget`` bits per original weight.

What runs is the expanded encoding folded back (:attr:`bayesq.result.QuantizedWeight.split`: each
copy's decoded column added to its channel), so the quantised model has the original
architecture; the export stores the expanded codes and the split indices.

Split: Linear layers, and Conv2d layers with one group (an input channel of a grouped
convolution belongs to one group, and a copy would need its own); every other layer (grouped
and depthwise convolutions, a layer whose weight another module shares) is quantised by GPTQ
unsplit, and :func:`ocs_split` says why. The expand ratios are a variant of the selection, as
GPTQ's grid layouts are: every ratio's GPTQ variants are scored on the selection inputs.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from bayesq.baselines.activations import InputStats
from bayesq.baselines.gptq import DAMP, gptq_candidates, gptq_quantize
from bayesq.baselines.select import (
    GROUP_SIZES, BaselineChoice, choice_outcome, group_sizes_setting, mixed_outcome, select_variants, stats_of,
)
from bayesq.blocks import checked_layers, tied_layers
from bayesq.canonical import on_canonical
from bayesq.config import Granularity, QuantConfig
from bayesq.context import KnownOutputs
from bayesq.expected_loss import LossTable
from bayesq.forward import Batch
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import Allocation, QuantizationResult, baseline_result
from bayesq.settings import setting, validate, within
from bayesq.storage import budget_bits, split_bits

EXPAND_RATIOS = (0.01, 0.02, 0.05)  # share of a layer's input channels split; selected on held-out inputs


def split_channels(W: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OCS's split of ``k`` input channels of one weight.

    Args:
        W: (out, c, ...) weight (Linear (out, c); Conv2d (out, c, kh, kw)).
        k: channels to add.

    Returns:
        (W' (out, c + k, ...) in W's dtype, split (k,) int64): k times, the channel holding the
        largest |w| (an original one or a copy) is halved and the half appended; ``split[i]`` is
        the original channel that appended channel ``c + i`` copies, so folding the copies back
        (:func:`bayesq.result.fold_split`) gives W exactly (halving is exact in binary floats).
    """
    c = W.shape[1]
    peak = W.abs().transpose(0, 1).reshape(c, -1).amax(1).tolist()  # (c,) largest |w| per channel
    columns = list(W.unbind(1))
    owner = list(range(c))
    for _ in range(k):
        j = max(range(len(peak)), key=peak.__getitem__)  # the first of equal peaks
        columns[j] = columns[j] / 2
        peak[j] /= 2
        columns.append(columns[j])
        peak.append(peak[j])
        owner.append(owner[j])
    return torch.stack(columns, 1), torch.tensor(owner[c:], dtype=torch.int64)


def ocs_split(layers: Mapping[str, nn.Module], model: nn.Module, ratio: float) -> tuple[dict[str, int], dict[str, str]]:
    """(layer -> channels to split, layer -> why it is not split) at ``ratio``: ``ceil(ratio * c)``
    of a Linear's or one-group Conv2d's c input channels."""
    tied = set(tied_layers(model, layers).values())
    counts, why = {}, {}
    for name, mod in layers.items():
        if getattr(mod, "groups", 1) != 1:
            why[name] = f"a grouped convolution ({mod.groups} groups): an input channel belongs to one group"
        elif name in tied:
            why[name] = "its weight is shared with another module"
        elif isinstance(mod, nn.Linear) and type(mod).forward is not nn.Linear.forward:
            why[name] = f"a {type(mod).__name__}: a Linear with its own forward, which may read the weight itself"
        else:
            counts[name] = math.ceil(ratio * mod.weight.shape[1])
    return counts, why


class _SplitInput(nn.Module):
    """``inner([x; x_split])``: the expanded layer fed its split input channels twice (Linear:
    the last axis; Conv2d: axis 1)."""

    def __init__(self, inner: nn.Module, split: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("split", split)
        self.dim = -1 if isinstance(inner, nn.Linear) else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.cat([x, x.index_select(self.dim, self.split.to(x.device))], self.dim))


def _expanded_module(mod: nn.Module, W: torch.Tensor) -> nn.Module:
    """A copy of ``mod`` (its forward and settings) holding the (out, c + k, ...) weight ``W``."""
    weight = mod._parameters["weight"]
    mod._parameters["weight"] = None  # not deep-copied (the copy gets its own); the key keeps its place
    try:
        new = copy.deepcopy(mod)
    finally:
        mod._parameters["weight"] = weight
    new.weight = nn.Parameter(W.detach().contiguous(), requires_grad=False)
    if isinstance(new, nn.Linear):
        new.in_features = W.shape[1]
    else:
        new.in_channels = W.shape[1]
    return new


def expanded_stats(s: InputStats, split: torch.Tensor, kernel: int) -> InputStats:
    """The statistics of ``[x; x_split]`` from those of x: rows and columns of the split channels'
    entries repeated (each input channel owns ``kernel`` consecutive columns of unfolded patches)."""
    c = s.H.shape[-1] // kernel
    channels = torch.cat([torch.arange(c), split.cpu()])
    cols = (channels[:, None] * kernel + torch.arange(kernel)[None, :]).reshape(-1).to(s.H.device)

    def take(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.index_select(-1, cols.to(x.device))

    return replace(s, H=s.H.index_select(1, cols).index_select(2, cols), abs_mean=take(s.abs_mean),
                   mean=take(s.mean), abs_max=take(s.abs_max))


def _stats_of_expanded(stats: Mapping[str, InputStats], layers: Mapping[str, nn.Module],
                       splits: Mapping[str, torch.Tensor]) -> dict[str, InputStats]:
    """The statistics of the expanded model's layers (a split layer's under ``<layer>.inner``)."""
    out = {}
    for name in layers:
        if name in splits:
            out[f"{name}.inner"] = expanded_stats(stats[name], splits[name], math.prod(layers[name].weight.shape[2:]))
        elif name in stats:
            out[name] = stats[name]
    return out


@contextmanager
def expanded(model: nn.Module, layers: Mapping[str, nn.Module], counts: Mapping[str, int]) -> Iterator[dict]:
    """``model`` with each layer of ``counts`` replaced by its split (:class:`_SplitInput`, its
    expanded layer named ``<layer>.inner``) while inside; yields layer -> split (k,) int64."""
    splits, swaps = {}, []
    for name, k in counts.items():
        mod = layers[name]
        W, splits[name] = split_channels(mod.weight.detach(), k)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swaps.append((parent, child, mod))
        setattr(parent, child, _SplitInput(_expanded_module(mod, W), splits[name]))
    try:
        yield splits
    finally:
        for parent, child, mod in reversed(swaps):
            setattr(parent, child, mod)


def folded(res: QuantizationResult, model: nn.Module, layers: Mapping[str, nn.Module], splits: Mapping[str, torch.Tensor],
           budget: float, exclude: Sequence[str]) -> QuantizationResult:
    """The result of the expanded model's quantisation ``res`` as one of ``model``: encodings under
    the original names, each split layer's with its ``split`` (it decodes to the original shape),
    and the allocation counting the split indices and the original weights."""
    inner = {f"{n}.inner": n for n in splits}
    weights = {}
    for name, qw in res.weights.items():
        orig = inner.get(name, name)
        weights[orig] = replace(qw, blocks=replace(qw.blocks, name=orig), split=splits.get(orig))
    extra = sum(split_bits(s.numel(), layers[n].weight.shape[1]) for n, s in splits.items())
    n = sum(m.weight.numel() for m in layers.values())
    a = res.allocation
    allocation = Allocation({inner.get(k, k): v for k, v in a.unit_bits.items()}, a.total_bits + extra, n,
                            budget_bits(budget, n), a.expected_loss, a.binding)
    table = LossTable(tuple(replace(t, blocks=replace(t.blocks, name=inner.get(t.blocks.name, t.blocks.name)))
                            for t in res.table.layers))
    return baseline_result(model, layers, weights, allocation, table, exclude)


def _expanded_budget(budget: float, layers: Mapping[str, nn.Module], counts: Mapping[str, int]) -> float:
    """Average bits per expanded weight that leave room for the split indices within ``budget``
    bits per original weight."""
    n = sum(m.weight.numel() for m in layers.values())
    extra = sum(split_bits(k, layers[name].weight.shape[1]) for name, k in counts.items())
    n_ext = n + sum(k * layers[name].weight[:, :1].numel() for name, k in counts.items())
    return (budget_bits(budget, n) - extra) / n_ext


@on_canonical
def ocs_candidates(
    model: nn.Module, stats: Mapping[str, InputStats], budget: float, cfg: QuantConfig = QuantConfig(), *,
    granularity: Granularity = Granularity.GROUP, group_sizes: Sequence[int] = GROUP_SIZES,
    expand_ratios: Sequence[float] = EXPAND_RATIOS, act_order: bool = True, damp: float = DAMP,
    exclude: Sequence[str] = (), mixed_only: bool = False, progress: bool = False,
) -> dict[str, Callable[[], QuantizationResult]]:
    """Every expand ratio's GPTQ variants (:func:`bayesq.baselines.gptq.gptq_candidates` on the
    expanded model), named ``r<ratio>-<variant>``, unbuilt, each building a result of ``model``;
    ``mixed_only``: each ratio's ``mixed`` rule alone; ``progress``: a bar over the layers each
    build encodes.

    Raises:
        ValueError: missing statistics, or no variant fits the budget at any ratio.
    """
    layers = checked_layers(model, stats, "input statistics", "run input_stats on the same model", exclude)
    out: dict[str, Callable[[], QuantizationResult]] = {}
    errors = []
    for ratio in expand_ratios:
        counts, _ = ocs_split(layers, model, ratio)
        inner_budget = _expanded_budget(budget, layers, counts)

        def build(variant: str, counts=counts, inner_budget=inner_budget, ratio=ratio) -> QuantizationResult:
            with expanded(model, layers, counts) as splits:
                ext = _stats_of_expanded(stats, layers, splits)
                opts = dict(act_order=act_order, damp=damp, exclude=exclude, progress=progress)
                try:
                    if variant == "mixed" and mixed_only:
                        res = gptq_quantize(model, ext, granularity, inner_budget, cfg, **opts)
                    else:
                        res = gptq_candidates(model, ext, inner_budget, cfg, granularity=granularity,
                                              group_sizes=group_sizes, **opts)[variant]()
                except ValueError as err:
                    raise ValueError(f"OCS at expand ratio {ratio:g}: {budget} bits per weight leave "
                                     f"{inner_budget:.4f} per weight of the expanded layers (their copies and "
                                     f"split indices take the rest): {err}") from None
            return folded(res, model, layers, splits, budget, exclude)

        if mixed_only:
            out[f"r{ratio:g}-mixed"] = lambda build=build: build("mixed")
            continue
        with expanded(model, layers, counts) as splits:
            ext = _stats_of_expanded(stats, layers, splits)
            try:
                names = list(gptq_candidates(model, ext, inner_budget, cfg, granularity=granularity,
                                             group_sizes=group_sizes, act_order=act_order, damp=damp, exclude=exclude))
            except ValueError as err:
                errors.append(f"expand ratio {ratio:g}: {err}")
                continue
        for v in names:
            out[f"r{ratio:g}-{v}"] = lambda v=v, build=build: build(v)
    if not out:
        raise ValueError("OCS: no variant fits the budget at any expand ratio (" + "; ".join(errors) + ")")
    return out


@on_canonical
def ocs_quantize(
    model: nn.Module, stats: Mapping[str, InputStats], budget: float, cfg: QuantConfig = QuantConfig(), *,
    ratio: float = EXPAND_RATIOS[0], granularity: Granularity = Granularity.GROUP, act_order: bool = True,
    damp: float = DAMP, exclude: Sequence[str] = (), progress: bool = False, **_,
) -> QuantizationResult:
    """OCS at one expand ratio with GPTQ's ``mixed`` rule at ``granularity`` (no selection;
    ``progress``: a bar over the layers)."""
    build = ocs_candidates(model, stats, budget, cfg, granularity=granularity, expand_ratios=(ratio,),
                           act_order=act_order, damp=damp, exclude=exclude, mixed_only=True, progress=progress)
    return next(iter(build.values()))()


@on_canonical
def ocs_select(
    model: nn.Module, stats: Mapping[str, InputStats], batches: Sequence[Batch], budget: float,
    cfg: QuantConfig = QuantConfig(), *, granularity: Granularity = Granularity.GROUP,
    group_sizes: Sequence[int] = GROUP_SIZES, expand_ratios: Sequence[float] = EXPAND_RATIOS,
    act_order: bool = True, damp: float = DAMP, bias_correction: bool = False,
    selection: Sequence[Batch] | None = None, known: KnownOutputs | None = None,
    exclude: Sequence[str] = (), progress: bool = False,
) -> BaselineChoice:
    """The OCS variant of :func:`ocs_candidates` with the least mean ``KL(p_FP || p_Q)`` on
    ``selection`` (else ``batches``), each also bias-corrected with ``bias_correction`` (fitted on
    ``batches``: the folded model has the original layers), as :func:`bayesq.baselines.gptq.gptq_select`
    (``progress`` too)."""
    cands = ocs_candidates(model, stats, budget, cfg, granularity=granularity, group_sizes=group_sizes,
                           expand_ratios=expand_ratios, act_order=act_order, damp=damp, exclude=exclude,
                           progress=progress)
    return select_variants(cands, model, stats, batches, bias_correction, selection, known, progress)


@dataclass(frozen=True)
class OCSConfig:
    """OCS on GPTQ's rounding (module docstring). ``select``: the variant (expand ratio and GPTQ
    variant) with the least KL on the selection inputs, else the ``mixed`` rule at the first of
    ``expand_ratios``; ``granularity``, ``group_sizes``, ``act_order``, ``damp``,
    ``bias_correction``, ``progress`` as :class:`bayesq.baselines.gptq.GPTQConfig`."""

    quant: QuantConfig = field(default_factory=QuantConfig)
    granularity: Granularity = Granularity.GROUP
    select: bool = True
    group_sizes: tuple[int, ...] = group_sizes_setting()
    expand_ratios: tuple[float, ...] = EXPAND_RATIOS
    act_order: bool = True
    damp: float = setting(DAMP, within("(0, 1)", "GPTQ uses 0.01"))
    bias_correction: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        validate(self, "OCSConfig")
        ratios = tuple(self.expand_ratios)
        if not ratios or any(not 0.0 < float(r) <= 1.0 for r in ratios):
            raise ValueError(f"OCSConfig.expand_ratios = {ratios!r}: give one or more shares of a layer's input "
                             "channels to split, each in (0, 1] (the paper sweeps 0.01-0.05)")


@register(OCSConfig)
def ocs_method(model: nn.Module, config: OCSConfig, budget: float, inputs: Inputs) -> Outcome:
    """OCS from ``inputs.stats`` (else computed from the calibration batches); ``details`` as
    GPTQ's (its ``variant`` names the expand ratio) plus ``unsplit``: layer -> why it was not split."""
    batches, stats, known = stats_of(model, inputs, "OCS", config.progress)
    exclude = tuple(inputs.exclude)
    opts = dict(granularity=config.granularity, group_sizes=config.group_sizes, act_order=config.act_order,
                damp=config.damp, exclude=exclude, progress=config.progress)
    if not config.select:
        outcome = mixed_outcome(ocs_quantize(model, stats, budget, config.quant, ratio=config.expand_ratios[0],
                                             **opts), inputs)
    else:
        outcome = choice_outcome(ocs_select(model, stats, batches, budget, config.quant,
                                            expand_ratios=config.expand_ratios, selection=inputs.selection,
                                            bias_correction=config.bias_correction, known=known, **opts), inputs)
    return replace(outcome, details={**outcome.details, "unsplit": unsplit_layers(model, exclude=exclude)})


@on_canonical
def unsplit_layers(model: nn.Module, *, exclude: Sequence[str] = ()) -> dict[str, str]:
    """Quantised layers OCS does not split (:func:`ocs_split`), with the reason."""
    layers = checked_layers(model, exclude=exclude)
    return ocs_split(layers, model, 1.0)[1]
