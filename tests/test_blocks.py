import pytest
import torch

from bayesq.blocks import LayerBlocks


@pytest.mark.parametrize("row_aligned", [False, True])
@pytest.mark.parametrize("shape", [(5, 7), (4, 3, 3, 3), (3, 64), (2, 130)])
def test_layer_blocks_groups_round_trip(shape, row_aligned):
    lb = LayerBlocks("w", shape, group_size=16, unit_groups=2, row_aligned=row_aligned)
    w = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    groups, mask = lb.to_groups(w.reshape(-1))
    assert groups.shape == (lb.n_groups, 16) and mask.shape == groups.shape
    assert torch.equal(lb.from_groups(groups), w)
    assert int(mask.sum()) == lb.numel
    assert torch.equal(mask.sum(1).long(), lb.group_sizes())
    # padding repeats a real value of its own group, so min/max are unchanged
    for g, m in zip(groups, mask):
        real = g[m > 0]
        assert g.min() == real.min() and g.max() == real.max()


@pytest.mark.parametrize("row_aligned", [False, True])
@pytest.mark.parametrize("shape", [(5, 7), (4, 3, 3, 3), (3, 64), (2, 130)])
def test_element_groups_vs_from_groups_index(shape, row_aligned):
    lb = LayerBlocks("w", shape, group_size=16, unit_groups=2, row_aligned=row_aligned)
    index = torch.arange(lb.n_groups)[:, None].expand(-1, 16).double()
    want = lb.from_groups(index).reshape(shape[0], -1).long()
    assert torch.equal(lb.element_groups(slice(0, shape[0])), want)
    assert torch.equal(lb.element_groups(slice(1, shape[0])), want[1:])


def test_layer_blocks_row_aligned_groups_never_straddle_rows():
    lb = LayerBlocks("w", (3, 20), group_size=8, unit_groups=1, row_aligned=True)
    w = torch.arange(60, dtype=torch.float64).reshape(3, 20)
    groups, mask = lb.to_groups(w.reshape(-1))
    assert lb.groups_per_row == 3 and lb.n_groups == 9
    for k, (g, m) in enumerate(zip(groups, mask)):
        row = k // 3
        assert ((g[m > 0] // 20) == row).all()
    assert lb.group_sizes().tolist() == [8, 8, 4] * 3


@pytest.mark.parametrize("unit,expect_units", [("block", 4), ("group", 7), ("channel", 5), ("tensor", 1)])
def test_layer_blocks_with_unit_counts(unit, expect_units):
    lb = LayerBlocks("w", (5, 20), 16, 2).with_unit(unit, 16, 2)  # 100 weights
    assert lb.n_units == expect_units
    sizes = lb.unit_sizes()
    assert sum(n for n, _ in sizes) == 100
    if unit == "channel":
        assert sizes == [(20, 2)] * 5
    with pytest.raises(ValueError, match="allocation unit"):
        lb.with_unit("layer", 16, 2)


def test_kept_matrices_counts_shared_parameters_once():
    from torch import nn

    from bayesq.blocks import kept_matrices

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(10, 10))
    model[1].weight = model[0].weight  # tied (10, 4): the output layer shares the embedding table
    assert kept_matrices(model, ["2"]) == (40, 40 * 32)  # the tied table once
    assert kept_matrices(model, ["1", "2"]) == (0, 0)  # quantised in one of its places: not kept
    assert kept_matrices(model.double(), []) == (140, 140 * 64)


def test_to_groups_unpadded_is_a_view_with_a_broadcast_mask():
    """Without padding the rows are a view of the tensor and the mask one broadcast 1 (no
    full-size copies of a large layer); with padding the mask is real 0s and 1s."""
    lb = LayerBlocks("w", (4, 32), group_size=16, unit_groups=2, row_aligned=True)
    w = torch.randn(4 * 32, dtype=torch.float64)
    groups, mask = lb.to_groups(w)
    assert not lb.padded and groups.data_ptr() == w.data_ptr()
    assert mask.stride() == (0, 0) and torch.equal(mask, torch.ones(8, 16, dtype=torch.float64))
    padded = LayerBlocks("v", (4, 30), group_size=16, unit_groups=2, row_aligned=True)
    _, mask = padded.to_groups(torch.randn(4 * 30, dtype=torch.float64))
    assert padded.padded and int(mask.sum()) == 120 and mask.stride() != (0, 0)
