"""bayesq.targets and QuantConfig.for_target: what a target runs, the settings inside it, the
errors that name the fix, and the per-row storage count against a hand count."""

import pytest

from bayesq.config import AllocationUnit, Codebook, QuantConfig, Target
from bayesq.targets import ONNXRUNTIME, TARGETS, matmulnbits_unit_cost_bits, spec


def test_for_target_onnxruntime_keeps_what_it_runs_and_sets_what_it_stores():
    q = QuantConfig().for_target("onnxruntime")
    assert (q.bits, q.group_size, q.unit, q.scale_bits, q.target) == (
        (2, 4, 8), 128, AllocationUnit.TENSOR, 32, Target.ONNXRUNTIME)  # block 128, a width per layer: measured
    assert QuantConfig(bits=(3, 4)).for_target("onnxruntime").bits == (4,)  # of these, the ones it runs
    assert QuantConfig(bits=(3,)).for_target("onnxruntime").bits == ONNXRUNTIME.widths  # none: all of its own
    assert QuantConfig().for_target("onnxruntime", block=64).group_size == 64
    with pytest.raises(ValueError, match="block 48: the onnxruntime target takes blocks of"):
        QuantConfig().for_target("onnxruntime", block=48)
    assert QuantConfig().for_target(Target.BAYESQ) == QuantConfig()


def test_unknown_target_and_settings_a_target_cannot_hold_are_named():
    with pytest.raises(ValueError, match="target 'tensorrt' does not exist: choose one of bayesq, onnxruntime"):
        spec("tensorrt")
    with pytest.raises(ValueError, match=r"quant.bits = \[2, 3, 4, 8\]: the onnxruntime target runs widths"):
        QuantConfig(target=Target.ONNXRUNTIME)
    base = QuantConfig().for_target("onnxruntime")
    import dataclasses

    for change, field in ((dict(unit=AllocationUnit.BLOCK), "quant.unit"), (dict(scale_bits=16), "quant.scale_bits"),
                          (dict(group_size=48), "quant.group_size"),
                          (dict(codebook=Codebook.LLOYD, rounding="nearest"), "quant.codebook")):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(base, **change)
    assert set(TARGETS) == {"bayesq", "onnxruntime"}


@pytest.mark.parametrize("groups, bits, block, choices", [(6, 2, 64, 3), (6, 4, 64, 1), (3, 8, 128, 2), (5, 2, 32, 2)])
def test_matmulnbits_row_cost_vs_hand_count(groups, bits, block, choices):
    codes = groups * block * bits  # each row padded to whole blocks
    scales = groups * 32
    zeros = 8 * -(-groups * bits // 8)  # a row's zero-points in whole bytes
    index = 32 if choices > 1 else 0
    assert matmulnbits_unit_cost_bits(groups, bits, block, choices) == codes + scales + zeros + index


@pytest.mark.parametrize("rows, groups, bits, choices", [(5, 3, 2, 3), (4, 1, 8, 2), (2, 6, 4, 1)])
def test_matmulnbits_layer_cost_vs_rows_without_index(rows, groups, bits, choices):
    """A whole-layer unit (quant.unit: tensor) is its rows' costs, each row's zero-points in whole
    bytes, and no row index whatever the choices: one node per layer."""
    one_row = matmulnbits_unit_cost_bits(groups, bits, 128, 1)
    assert matmulnbits_unit_cost_bits(rows * groups, bits, 128, choices, rows=rows) == rows * one_row
    with pytest.raises(ValueError, match="rows=4"):
        matmulnbits_unit_cost_bits(7, bits, 128, choices, rows=4)


def test_for_target_keeps_a_unit_the_target_holds():
    assert QuantConfig(unit=AllocationUnit.CHANNEL).for_target("onnxruntime").unit == AllocationUnit.CHANNEL
    assert QuantConfig(unit=AllocationUnit.GROUP).for_target("onnxruntime").unit == AllocationUnit.TENSOR
