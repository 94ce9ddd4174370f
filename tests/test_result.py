"""bayesq.result: how an encoded weight holds its codes."""

import torch

from bayesq.blocks import LayerBlocks
from bayesq.grids import UniformGrids
from bayesq.levels import LevelTables
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


def test_quantized_weight_dequantize_chunks_vs_hand_decode(monkeypatch):
    """Mixed widths (a uniform 2-bit grid per group, 3-bit LUTs shared by units of two groups),
    decoded a chunk of groups at a time: each group decoded by hand from its own book row."""
    import bayesq.result as result

    g = torch.Generator().manual_seed(2)
    lb = LayerBlocks("fc", (6, 8), 4, 2)  # 12 groups of 4, 6 units
    group_bits = torch.tensor([2, 2, 3, 3, 2, 2, 3, 3, 3, 3, 2, 2])
    n2, n3 = int((group_bits == 2).sum()), int((group_bits == 3).sum())
    grids = UniformGrids(2, torch.rand(n2, generator=g, dtype=torch.float64) + 0.1,
                         torch.full((n2,), 1.0, dtype=torch.float64))
    luts = LevelTables(3, torch.randn(3, 8, generator=g, dtype=torch.float64).sort(1).values,
                       torch.arange(n3) // 2)  # group -> its unit's table
    codes = torch.where((group_bits == 2)[:, None], torch.randint(0, 4, (12, 4), generator=g),
                        torch.randint(0, 8, (12, 4), generator=g))
    qw = QuantizedWeight(lb, group_bits, codes, {2: grids, 3: luts})
    want = torch.empty(12, 4, dtype=torch.float64)
    i2 = i3 = 0
    for grp in range(12):
        if group_bits[grp] == 2:
            want[grp] = grids.scale[i2] * (codes[grp].double() - grids.zero[i2])
            i2 += 1
        else:
            want[grp] = luts.levels[luts.row[i3], codes[grp]]
            i3 += 1
    for elements in (1 << 21, 8, 4):  # whole, two groups, one group per chunk
        monkeypatch.setattr(result, "DEQUANTIZE_ELEMENTS", elements)
        assert torch.equal(qw.dequantize(), want.reshape(6, 8))
