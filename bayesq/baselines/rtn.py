"""Round-to-nearest with min/max grids per tensor, per output channel or per group.

Fractional budgets are met with RTN's own data-free mixed rule: the greedy allocator over the
plain squared rounding error of each unit (units of about ``group_size * unit_groups``
weights, whole tensors for per-tensor grids), under the same exact storage accounting as BayesQ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from bayesq.assignment import allocate
from bayesq.blocks import LayerBlocks, checked_layers, layer_blocks
from bayesq.canonical import on_canonical
from bayesq.config import Granularity, QuantConfig, Target
from bayesq.expected_loss import rtn_table
from bayesq.methods import Inputs, Outcome, register
from bayesq.result import QuantizationResult, baseline_result
from bayesq.rounding import encode


def rtn_blocks(blocks: list[LayerBlocks], granularity: Granularity, cfg: QuantConfig) -> list[LayerBlocks]:
    """Layouts for RTN at a granularity (group = ``cfg.group_size``, channel = one row, tensor = all).

    Under a deployment target other than BayesQ's format (``cfg.target``, :mod:`bayesq.targets`)
    the layout is the target's: groups of ``cfg.group_size`` along each row (row-aligned), one
    allocation unit per row or per layer (``cfg.unit``), at any granularity asked (a grid per row
    or per tensor is not a layout such a target stores).
    """
    if cfg.target != Target.BAYESQ:
        return [b.with_unit(cfg.unit.value, cfg.group_size, cfg.unit_groups, aligned=True) for b in blocks]
    unit_weights = cfg.group_size * cfg.unit_groups
    if granularity == Granularity.TENSOR:
        return [LayerBlocks(b.name, b.shape, b.numel, 1) for b in blocks]
    if granularity == Granularity.CHANNEL:
        return [b.with_granularity(b.row, unit_weights) for b in blocks]
    return [b.with_granularity(cfg.group_size, unit_weights) for b in blocks]


@on_canonical
def rtn_quantize(
    model: nn.Module, granularity: Granularity, budget: float, cfg: QuantConfig = QuantConfig(),
    *, exclude: Sequence[str] = (), progress: bool = False,
) -> QuantizationResult:
    """RTN at ``budget`` average bits (all metadata counted) with the given scale granularity;
    ``exclude``: module names or glob patterns kept in floating point (the result's ``unquantized``);
    ``progress``: bars over the layers' grids, then their encodings."""
    layers = checked_layers(model, exclude=exclude)
    blocks = rtn_blocks(layer_blocks(layers, cfg.group_size, cfg.unit_groups), Granularity(granularity), cfg)
    weights = {n: m.weight for n, m in layers.items()}
    table = rtn_table(weights, blocks, cfg, progress=progress)
    allocation = allocate(table, budget)
    qweights = encode(table, allocation, weights, progress=progress)
    return baseline_result(model, layers, qweights, allocation, table, exclude)


@dataclass(frozen=True)
class RTNConfig:
    """Round-to-nearest on min/max grids at ``granularity`` (:func:`rtn_quantize`; ``progress``:
    its bars)."""

    granularity: Granularity = Granularity.CHANNEL
    quant: QuantConfig = field(default_factory=QuantConfig)
    progress: bool = True


@register(RTNConfig)
def rtn_method(model: nn.Module, config: RTNConfig, budget: float, inputs: Inputs) -> Outcome:
    """:func:`rtn_quantize` (data-free: reads nothing of ``inputs`` but ``exclude``)."""
    return Outcome(rtn_quantize(model, config.granularity, budget, config.quant, exclude=tuple(inputs.exclude),
                                progress=config.progress))
