"""What a quantisation produces: the allocation, each layer's encoding, the result, and the
quantised copy of the model assembled from the encodings alone.

These value types sit below every method (BayesQ, the baselines, distillation), so each of them
imports this module and none imports another method's module for them.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from bayesq.bias_correction import BiasCorrection
from bayesq.blocks import LayerBlocks, kept_matrices, unquantized_weights
from bayesq.expected_loss import Book, LossTable
from bayesq.output_offset import OutputOffset
from bayesq.posterior import Posterior
from bayesq.storage import average_bits


@dataclass(frozen=True)
class Allocation:
    """Chosen bit-width of every unit and the exact storage it implies.

    Attributes:
        unit_bits: layer name -> (U,) bit-width per unit.
        total_bits: exact bits of payload, scales, zero-points, LUTs and headers.
        n_weights: number of quantised weights.
        budget_bits: the budget the allocator was given.
        expected_loss: the table's total expected loss of this allocation.
        binding: False when the budget covers every unit at its widest candidate (it did
            not constrain the allocation; :func:`allocate` warns when a unit had more than one
            candidate, i.e. when something could have been traded).
    """

    unit_bits: dict[str, tuple[int, ...]]
    total_bits: int
    n_weights: int
    budget_bits: int
    expected_loss: float = float("nan")
    binding: bool = True

    @property
    def average_bits(self) -> float:
        return average_bits(self.total_bits, self.n_weights)


DEQUANTIZE_ELEMENTS = 1 << 21  # weights decoded at a time (a 50,257 x 768 projection in 19 chunks)


@dataclass(frozen=True)
class QuantizedWeight:
    """Deployable encoding of one weight.

    Attributes:
        blocks: group / unit layout.
        group_bits: (G,) int64 bit-width of each group.
        codes: (G, group_size) codes (padding of the last group included); VQ layers hold
            (G, group_size / vq_dim) codeword indices. Held as uint8 when every code is below 256
            (1 byte per weight instead of 8, exact; :meth:`indices` gives them as int64), else as
            given.
        books: bit-width -> codebook of the groups at that width, rows in group order
            (``UniformGrids``: ``scale * (code - zero)``; ``LevelTables``: ``levels[row, code]``).
        col_scale: optional (groups, d_in) float64 stored per-input-channel scale s (AWQ): the
            codes encode ``W * s`` and the layer uses ``W_hat[o, j] = decoded[o, j] / s[g(o), j]``.
        split: optional (k,) int64 split input channels (OCS, :mod:`bayesq.baselines.ocs`): the
            codes encode a weight of ``c + k`` input channels (``blocks.shape[1]``) whose last k
            channels are copies of channels ``split`` of the deployed ``c``; the layer uses
            ``W_hat[:, j] = decoded[:, j] + sum_{i: split[i] = j} decoded[:, c + i]`` (:attr:`shape`:
            ``blocks.shape`` with ``c`` input channels).
    """

    blocks: LayerBlocks
    group_bits: torch.Tensor
    codes: torch.Tensor
    books: Mapping[int, Book]
    col_scale: torch.Tensor | None = None
    split: torch.Tensor | None = None

    def __post_init__(self) -> None:
        c = self.codes  # uint8 when every code fits (the attribute's docstring)
        if c.dtype in (torch.int16, torch.int32, torch.int64) and c.numel():
            lo, hi = torch.aminmax(c)
            if int(lo) >= 0 and int(hi) < 256:
                object.__setattr__(self, "codes", c.to(torch.uint8))

    @property
    def shape(self) -> tuple[int, ...]:
        """The deployed weight's shape: ``blocks.shape``, less the split channels."""
        if self.split is None:
            return self.blocks.shape
        out, channels, *kernel = self.blocks.shape
        return (out, channels - self.split.numel(), *kernel)

    @property
    def numel(self) -> int:
        """Weights of the deployed layer (the average bits' denominator)."""
        return math.prod(self.shape)

    def indices(self, sel: torch.Tensor | None = None) -> torch.Tensor:
        """The codes (of the groups ``sel`` selects) as int64, the dtype indexing needs."""
        return (self.codes if sel is None else self.codes[sel]).long()

    def dequantize(self) -> torch.Tensor:
        """Weight of :attr:`shape` (float64) from the codes, codebooks (and col_scale, split) only."""
        w = torch.zeros(self.codes.shape[0], self.blocks.group_size, dtype=torch.float64, device=self.codes.device)
        step = max(1, DEQUANTIZE_ELEMENTS // self.blocks.group_size)  # int64 codes and decoded copies of a chunk
        for b, book in self.books.items():
            sel = torch.nonzero(self.group_bits == b).squeeze(1)  # the groups of book rows 0, 1, ...
            for i in range(0, sel.numel(), step):
                part = sel[i : i + step]
                rows = torch.arange(i, i + part.numel(), device=sel.device)
                w[part] = book.take(rows).dequantize(self.indices(part))
        w = self.blocks.from_groups(w)
        if self.split is not None:
            return fold_split(w, self.split)
        if self.col_scale is None:
            return w
        n_out = self.blocks.shape[0]
        s = self.col_scale.repeat_interleave(n_out // self.col_scale.shape[0], dim=0)  # (out, d_in)
        return (w.reshape(n_out, -1) / s).reshape(self.blocks.shape)


def fold_split(w: torch.Tensor, split: torch.Tensor) -> torch.Tensor:
    """(out, c, ...) weight of a (out, c + k, ...) one whose last k input channels copy channels
    ``split`` (k,): each copy added back to its channel."""
    c = w.shape[1] - split.numel()
    return w[:, :c].clone().index_add_(1, split.to(w.device), w[:, c:])


@dataclass(frozen=True)
class QuantizationResult:
    """What :func:`quantize_model` returns.

    ``posterior``: the posterior the tables were built from, when asked for
    (``quantize_model(..., keep_posterior=True)``; None otherwise). ``encoding`` names the grids
    kept (``searched``, ``searched-plain``, ``searched-gained`` or ``minmax``,
    :func:`grid_candidates`); ``selection_kl`` maps every candidate built to its KL to
    the full-precision model on the selection inputs (the calibration inputs when none were
    given; empty when there was one candidate); ``correction`` is the bias correction
    applied to ``model`` (None: ``quant.bias_correction`` off; its ``skipped`` lists the layers
    whose output shift had nowhere to go). ``unquantized``: every other floating parameter with
    two or more dimensions, by name, with the reason it stays in floating point
    (:func:`bayesq.blocks.unquantized_weights`). ``output_offset``: the output layer's bias
    refit applied to ``model`` last (:mod:`bayesq.output_offset`; None: ``quant.output_offset``
    off or no calibration; its ``skipped`` says why a model has none).
    """

    model: nn.Module
    weights: dict[str, QuantizedWeight]
    allocation: Allocation
    table: LossTable
    posterior: Posterior | None = None
    encoding: str = ""
    selection_kl: Mapping[str, float] = field(default_factory=dict)
    correction: BiasCorrection | None = None
    unquantized: Mapping[str, str] = field(default_factory=dict)
    output_offset: OutputOffset | None = None

    @property
    def average_bits(self) -> float:
        """Bits per quantised weight, everything stored for them counted (the budget's measure)."""
        return self.allocation.average_bits

    @property
    def average_bits_all(self) -> float:
        """Bits per weight over every floating parameter with two or more dimensions: the
        quantised ones as :attr:`average_bits` counts them, the :attr:`unquantized` ones at their
        storage width (float32: 32)."""
        return average_bits_all(self.model, self.weights, self.allocation)


def average_bits_all(model: nn.Module, weights: Mapping[str, QuantizedWeight], allocation: Allocation) -> float:
    """Bits per weight over every floating parameter of ``model`` with two or more dimensions:
    ``weights``' layers as ``allocation`` counts them, the others at their storage width,
    ``(total_bits + kept bits) / (n_weights + kept weights)`` (:func:`bayesq.blocks.kept_matrices`)."""
    n, bits = kept_matrices(model, weights)
    return (allocation.total_bits + bits) / (allocation.n_weights + n)


def quantized_copy(
    model: nn.Module, weights: dict[str, QuantizedWeight], correction: BiasCorrection | None = None,
) -> nn.Module:
    """Deep copy of ``model`` whose quantised layers hold the dequantised weights, then (given
    ``correction``) each layer's mean output shift moved back into its bias or BatchNorm."""
    qmodel = copy.deepcopy(model)
    load_quantized(qmodel, model, weights, correction)
    return qmodel.eval()


def load_quantized(
    qmodel: nn.Module, model: nn.Module, weights: Mapping[str, QuantizedWeight],
    correction: BiasCorrection | None = None,
) -> None:
    """Make ``qmodel`` (a copy of ``model``, possibly holding another encoding already) exactly
    :func:`quantized_copy` of ``weights``: the tensors a correction shifts reset to ``model``'s, the
    dequantised weights copied in, then ``correction`` applied. One copy
    then serves several candidate encodings in turn."""
    modules, state = dict(qmodel.named_modules()), dict(qmodel.named_parameters()) | dict(qmodel.named_buffers())
    source = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for key in (correction.targets.values() if correction is not None else ()):
            state[key].copy_(source[key])
        for name, qw in weights.items():
            mod = modules[name]
            mod.weight.copy_(qw.dequantize())  # converted as it is copied: no second full-size temporary
    if correction is not None:
        correction.apply(qmodel, model)


def baseline_result(
    model: nn.Module, layers: Mapping[str, nn.Module], weights: dict[str, QuantizedWeight], allocation: Allocation,
    table: LossTable, exclude: Sequence[str] = (),
) -> QuantizationResult:
    """A baseline's :class:`QuantizationResult`: the quantised copy of ``model`` holding
    ``weights`` (the encodings of ``layers``), and every other weight listed in ``unquantized``
    with its reason (``exclude``: the patterns the caller left out)."""
    return QuantizationResult(quantized_copy(model, weights), weights, allocation, table,
                              unquantized=unquantized_weights(model, dict(layers), tuple(exclude)))
