import pytest

from bayesq.blocks import LayerBlocks
from bayesq.storage import (
    average_bits, budget_bits, candidate_costs, grid_bits, header_bits, lut_unit_cost_bits,
    mulaw_unit_cost_bits, unit_cost_bits, vq_cost_bits,
)


def test_header_bits_hand_counts():
    assert [header_bits(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]
    with pytest.raises(ValueError):
        header_bits(0)


def test_unit_cost_bits_hand_count():
    # 1024 weights at 3 bits in 16 groups: 3072 payload + 16 * (16 scale + 3 zero) + 2 header
    assert unit_cost_bits(1024, 16, 3, 4) == 3072 + 16 * 19 + 2
    assert grid_bits(100, 2, 8, scale_bits=32) == 800 + 2 * 40


def test_layer_units_partial_group_hand_count():
    lb = LayerBlocks("conv", (10, 3, 3, 3), group_size=64, unit_groups=2)  # 270 weights
    assert (lb.n_groups, lb.n_units) == (5, 3)
    assert lb.unit_sizes() == [(128, 2), (128, 2), (14, 1)]
    costs = candidate_costs(lb.unit_sizes(), (2, 4))
    # unit 3: 14 weights * 2 bits + one group (16 + 2) + 1 header bit
    assert costs[2] == [14 * 2 + 18 + 1, 14 * 4 + 20 + 1]
    total = sum(c[0] for c in costs)
    assert average_bits(total, 270) == pytest.approx(total / 270)


def test_budget_bits_never_exceeds_target():
    assert budget_bits(3.0, 1000) == 3000
    assert budget_bits(3.5, 3) == 10
    with pytest.raises(ValueError):
        average_bits(10, 0)


def test_lut_unit_cost_bits_hand_count():
    # 1024 weights at 3 bits + one 8-entry fp16 table + 2 header bits (4 choices)
    assert lut_unit_cost_bits(1024, 3, 4) == 3072 + 8 * 16 + 2
    # 64 weights at 2 bits, a 4-entry fp32 table, a single bit-width (no header)
    assert lut_unit_cost_bits(64, 2, 1, lut_bits=32) == 128 + 128
    with pytest.raises(ValueError, match="LUT"):
        lut_unit_cost_bits(64, 0, 4)


def test_mulaw_unit_cost_bits_hand_count():
    # 1024 weights at 3 bits in 16 groups: 3072 payload + 16 fp16 scales (no zero-points) + 2 header
    assert mulaw_unit_cost_bits(1024, 16, 3, 4) == 3072 + 256 + 2
    assert mulaw_unit_cost_bits(14, 1, 4, 2, scale_bits=32) == 56 + 32 + 1
    with pytest.raises(ValueError, match="mu-law"):
        mulaw_unit_cost_bits(-1, 1, 2, 4)


def test_vq_cost_bits_hand_count():
    # 512 pairs with a 256-entry codebook: 8-bit indices + 256 * 2 fp16 entries
    assert vq_cost_bits(512, 2, 256) == 4096 + 8192
    assert vq_cost_bits(128, 8, 4096) == 128 * 12 + 4096 * 8 * 16
    assert vq_cost_bits(10, 4, 1, lut_bits=32) == 0 + 128  # one codeword needs no index
    with pytest.raises(ValueError, match="power of two"):
        vq_cost_bits(10, 2, 12)
