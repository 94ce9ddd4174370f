"""bayesq.result: how an encoded weight holds its codes."""

import torch

from bayesq.blocks import LayerBlocks
from bayesq.codebook import LevelTables, UniformGrids
from bayesq.result import QuantizedWeight


def _lut_weight(bits: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    """A (4, 8) layer of 4 groups of 8 with one LUT of 2**bits levels per group, and the codes."""
    g = torch.Generator().manual_seed(seed)
    lb = LayerBlocks("fc", (4, 8), 8, 1)
    levels = torch.randn(4, 2**bits, generator=g, dtype=torch.float64).sort(1).values
    codes = torch.randint(0, 2**bits, (4, 8), generator=g)
    book = LevelTables(bits, levels, torch.arange(4))
    return QuantizedWeight(lb, torch.full((4,), bits), codes, {bits: book}), codes


def test_quantized_weight_codes_below_256_held_as_uint8():
    qw, codes = _lut_weight(8)
    assert qw.codes.dtype == torch.uint8
    assert torch.equal(qw.indices(), codes) and qw.indices().dtype == torch.int64
    # the LUT look-up reads the codes as indices, not as a mask: the same weight as int64 codes
    want = qw.books[8].levels.gather(1, codes)
    assert torch.equal(qw.dequantize(), want)


def test_quantized_weight_wide_codes_stay_int64():
    qw, codes = _lut_weight(9)  # up to 511: no byte holds them
    assert int(codes.max()) >= 256 and qw.codes.dtype == torch.int64
    assert torch.equal(qw.dequantize(), qw.books[9].levels.gather(1, codes))


def test_quantized_weight_uniform_dequantize_vs_int64_reference():
    g = torch.Generator().manual_seed(1)
    lb = LayerBlocks("fc", (3, 5), 4, 1)  # 15 weights in 4 groups: the last one padded
    codes = torch.randint(0, 8, (4, 4), generator=g)
    grids = UniformGrids(3, torch.rand(4, generator=g, dtype=torch.float64), torch.full((4,), 3.0, dtype=torch.float64))
    qw = QuantizedWeight(lb, torch.full((4,), 3), codes, {3: grids})
    assert qw.codes.dtype == torch.uint8
    want = (grids.scale[:, None] * (codes.double() - grids.zero[:, None])).reshape(-1)[:15].reshape(3, 5)
    assert torch.equal(qw.dequantize(), want)
