"""What each deployment target can run, and so what a method quantises for and counts.

A target names the file a quantised model is written to and the runtime that runs it. Its spec
(:class:`TargetSpec`) is what the runtime's kernels take: the code widths, the block sizes along
the input dimension, how often the width may change (per row, or anything BayesQ's own format
holds), the stored dtype of the scales, and the layer kinds. :meth:`bayesq.config.QuantConfig.for_target`
turns any quantisation settings into settings inside the target, so the allocator, the grids and
the error feedback work within what the file can hold, and :func:`unit_cost_bits` counts what the
file stores for one allocation unit, so a budget of 3.0 bits is 3.0 bits of that file.

``onnxruntime`` (``com.microsoft`` ``MatMulNBits``, :mod:`bayesq.onnx_export`): widths 2, 4 and 8;
blocks of 16 to 256 weights along K (128 unless told otherwise: measured best of 64, 128 and 256),
each row padded to whole blocks; a float32 scale and a
``bits``-bit zero-point per block, the zero-points of a row packed into whole bytes; one width per
output row, a layer's rows of several widths held by one node per width, put back in order by a
``Gather`` with one int32 index per row. One allocation unit is one row of ``n_groups`` blocks
(``quant.unit: channel``, the default), or a whole layer of ``rows`` such rows at one width
(``quant.unit: tensor``: one node per layer, no ``Concat``, ``Gather`` or row index):

    C_row(b) = n_groups * block * b + n_groups * 32 + 8 * ceil(n_groups * b / 8) + 32 [n_choices > 1]
    C_layer(b) = rows * C_row(b) without the index

The baselines on uniform grids (GPTQ, OPTQ, RTN: :func:`bayesq.baselines.rtn.rtn_blocks`,
:func:`bayesq.baselines.select.layout_bits`) use the same layout and costs under a target.

The row index is counted for every row whenever there is more than one width to choose from:
a layer whose rows all come out at one width stores none, so the file is at most the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TargetSpec:
    """What one target runs.

    Attributes:
        name: the target's name (``bayesq.config.Target`` value).
        widths: code widths the kernels run (None: any of 1-8).
        block_sizes: group sizes along the input dimension (None: any).
        scale_bits: stored width of a scale (None: ``quant.scale_bits``).
        unit: the allocation unit it takes unless told otherwise (None: any).
        units: the allocation units it can hold (None: any).
        suffix: the file it writes.
        layers: the layer kinds it quantises (others stay in floating point, with the reason).
        row_index_bits: bits stored per output row of a layer whose rows hold several widths.
        block: the block size it quantises with unless told otherwise (None: ``quant.group_size``).
    """

    name: str
    widths: tuple[int, ...] | None
    block_sizes: tuple[int, ...] | None
    scale_bits: int | None
    unit: str | None
    suffix: str
    layers: str
    row_index_bits: int = 0
    block: int | None = None
    units: tuple[str, ...] | None = None


BAYESQ = TargetSpec("bayesq", None, None, None, None, ".safetensors", "Linear and Conv2d")
# block 128, measured (docs/findings.md, 2026-12-07): the embedded MiniLM at 3.0 bits, KL to FP 0.00641 against
# 0.00894 at block 64 (float32 scales cost twice what BayesQ's fp16 ones do) and 0.01456 at 256.
# One width per layer (unit "tensor"), measured (docs/findings.md, 2026-12-07, "One width per layer"): on MiniLM at
# 128 tokens it runs at 0.96-1.05x FP32's speed where rows split by width run at 0.36-0.75x, for 1.2-1.7x the KL
# (still 4x less than ONNX Runtime's RTN at more bits); per-row widths stay one setting away (quant.unit: channel)
ONNXRUNTIME = TargetSpec("onnxruntime", (2, 4, 8), (16, 32, 64, 128, 256), 32, "tensor", ".onnx",
                         "Linear (MatMulNBits); convolutions stay in floating point", row_index_bits=32, block=128,
                         units=("channel", "tensor"))
TARGETS = {t.name: t for t in (BAYESQ, ONNXRUNTIME)}


def spec(name: str) -> TargetSpec:
    """The spec of the target ``name``.

    Raises:
        ValueError: an unknown name, naming the targets there are.
    """
    key = getattr(name, "value", name)
    if key not in TARGETS:
        raise ValueError(f"target {key!r} does not exist: choose one of {', '.join(TARGETS)}")
    return TARGETS[key]


def matmulnbits_unit_cost_bits(n_groups: int, bits: int, block: int, n_choices: int, scale_bits: int = 32,
                               rows: int = 1) -> int:
    """Bits one allocation unit of ``n_groups`` blocks at ``bits`` takes in an ONNX Runtime file:
    padded codes, a scale and a zero-point per block (each row's zero-points in whole bytes), and
    the row's index when a one-row unit has widths to choose between; a unit of ``rows > 1`` rows
    is a whole layer at one width, one node without an index (module docstring)."""
    if n_groups < 1 or bits < 1 or block < 1 or rows < 1 or n_groups % rows:
        raise ValueError(f"invalid unit: groups={n_groups}, bits={bits}, block={block}, rows={rows}")
    per_row = n_groups // rows
    index = ONNXRUNTIME.row_index_bits if n_choices > 1 and rows == 1 else 0
    return rows * (per_row * block * bits + per_row * scale_bits + 8 * math.ceil(per_row * bits / 8)) + index


__all__ = ["BAYESQ", "ONNXRUNTIME", "TARGETS", "TargetSpec", "matmulnbits_unit_cost_bits", "spec"]
