"""OCS: the split against a hand computation, the expanded model against the original's function,
the expanded statistics against statistics taken on the expanded model, the bits against the
budget (split indices counted), and the export round trip."""

import pytest
import torch
from torch import nn

from bayesq.baselines.activations import input_stats
from bayesq.baselines.ocs import (
    OCSConfig, expanded, expanded_stats, ocs_split, split_channels, unsplit_layers,
)
from bayesq.blocks import quantizable_layers
from bayesq.config import QuantConfig
from bayesq.export import load, save_export
from bayesq.methods import Inputs, quantize_with
from bayesq.result import fold_split
from bayesq.storage import split_bits

F64 = torch.float64


class _Net(nn.Module):
    """A conv (one group), a depthwise conv (never split) and two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc1 = nn.Linear(8 * 16, 64)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dw(torch.relu(self.conv(x))))
        h = nn.functional.adaptive_avg_pool2d(h, 4).flatten(1)
        return self.fc2(torch.relu(self.fc1(h)))


def _net(dtype=F64) -> nn.Module:
    torch.manual_seed(0)
    net = _Net().to(dtype).eval()
    with torch.no_grad():
        net.fc1.weight[:, 5] *= 20.0  # an outlier channel
    return net


def _batches(n: int = 4, dtype=F64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 8, 8, generator=g, dtype=dtype) for _ in range(n)]


def test_split_channels_vs_hand_computation():
    """Channel peaks [4, 1, 3]: split 0 (4 -> 2, 2), then 2 (3 -> 1.5, 1.5); peaks [8, 1, 1]: split
    0 twice (the halved channel is still the largest). The copies fold back to W exactly."""
    W = torch.tensor([[4.0, -1.0, 3.0], [1.0, 0.5, -2.0]], dtype=F64)
    Wx, split = split_channels(W, 2)
    assert split.tolist() == [0, 2]
    want = torch.tensor([[2.0, -1.0, 1.5, 2.0, 1.5], [0.5, 0.5, -1.0, 0.5, -1.0]], dtype=F64)
    assert torch.equal(Wx, want) and torch.equal(fold_split(Wx, split), W)
    V = torch.tensor([[-8.0, 1.0, 1.0]], dtype=F64)
    Vx, split = split_channels(V, 2)
    assert split.tolist() == [0, 0]
    assert torch.equal(Vx, torch.tensor([[-2.0, 1.0, 1.0, -4.0, -2.0]], dtype=F64))
    assert torch.equal(fold_split(Vx, split), V)
    C = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(2), dtype=F64)
    Cx, split = split_channels(C, 3)
    assert Cx.shape == (4, 6, 2, 2) and torch.equal(fold_split(Cx, split), C)


def test_expanded_model_computes_the_same_function():
    net, x = _net(), _batches(1)[0]
    layers = quantizable_layers(net)
    counts, why = ocs_split(layers, net, 0.1)
    assert set(counts) == {"conv", "fc1", "fc2"} and "groups" in why["dw"]
    assert counts == {"conv": 1, "fc1": 13, "fc2": 7}  # ceil(0.1 c)
    with torch.no_grad():
        want = net(x)
        with expanded(net, layers, counts) as splits:
            assert net.fc1.inner.weight.shape == (64, 128 + 13) and 5 in splits["fc1"].tolist()
            got = net(x)
    assert isinstance(net.fc1, nn.Linear)  # restored
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_expanded_stats_vs_stats_of_the_expanded_model():
    net, batches = _net(), _batches()
    layers = quantizable_layers(net)
    stats = input_stats(net, batches)
    counts, _ = ocs_split(layers, net, 0.1)
    with expanded(net, layers, counts) as splits:
        want = input_stats(net, batches)
        for name in ("conv", "fc1", "fc2"):
            got = expanded_stats(stats[name], splits[name], layers[name].weight[0, 0].numel())
            ref = want[f"{name}.inner"]
            torch.testing.assert_close(got.H.double(), ref.H.double(), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got.mean, ref.mean, rtol=1e-10, atol=1e-12)


def test_ocs_meets_the_budget_with_split_indices_counted_and_round_trips(tmp_path):
    """3.0 bits per original weight, the split indices counted; the encodings decode to the
    deployed shapes, and the export (whose payload is checked against the accounted bits) loads
    back to the same logits."""
    net, batches = _net(torch.float32), _batches(dtype=torch.float32)
    quant = QuantConfig(group_size=64, unit_groups=2)
    out = quantize_with(net, OCSConfig(quant=quant, select=False, expand_ratios=(0.1,)), 3.0,
                        Inputs(calibration=batches))
    res = out.result
    assert res.average_bits <= 3.0 + 1e-12 and res.average_bits > 2.5
    n = sum(m.weight.numel() for m in quantizable_layers(net).values())
    assert res.allocation.n_weights == n
    split = {name: qw.split for name, qw in res.weights.items() if qw.split is not None}
    assert set(split) == {"conv", "fc1", "fc2"} and res.weights["dw"].split is None
    assert out.details["unsplit"] == unsplit_layers(net)
    extra = sum(split_bits(s.numel(), res.weights[k].shape[1]) for k, s in split.items())
    codes = sum(int((qw.group_bits * qw.blocks.group_sizes()).sum()) for qw in res.weights.values())
    assert codes + extra <= res.allocation.total_bits  # the expanded codes and the indices are both in it
    for name, qw in res.weights.items():
        assert qw.shape == tuple(net.get_submodule(name).weight.shape) == qw.dequantize().shape
    info = save_export(tmp_path / "m.safetensors", res.model, res.weights, quant, res.allocation.total_bits)
    loaded = load(info.path, _net(torch.float32))
    with torch.no_grad():
        torch.testing.assert_close(loaded(batches[0]), res.model(batches[0]), rtol=0, atol=0)


def test_ocs_outlier_channel_lowers_the_layer_error():
    """An outlier input channel: at 3 bits everywhere (a budget both fit, OCS's copies and
    indices included), OCS's folded fc1 has a smaller output error on the calibration inputs
    than GPTQ's (the paper's point, on the layer it is made for)."""
    from bayesq.baselines.gptq import GPTQConfig

    net, batches = _net(torch.float32), _batches(dtype=torch.float32)
    quant = QuantConfig(group_size=128, unit_groups=1, bits=(3,))
    stats = input_stats(net, batches)
    err = {}
    for label, cfg in (("ocs", OCSConfig(quant=quant, select=False, expand_ratios=(0.05,))),
                       ("gptq", GPTQConfig(quant=quant, select=False))):
        res = quantize_with(net, cfg, 3.4, Inputs(calibration=batches, stats=stats)).result
        D = res.weights["fc1"].dequantize() - net.fc1.weight.detach().double()
        err[label] = float(torch.einsum("oi,ij,oj->", D, stats["fc1"].H[0].double(), D))
    assert err["ocs"] < 0.9 * err["gptq"], err


def test_ocs_selection_scores_every_ratio_and_keeps_the_least_kl():
    net, batches = _net(torch.float32), _batches(6, dtype=torch.float32)
    quant = QuantConfig(group_size=64, unit_groups=2)
    out = quantize_with(net, OCSConfig(quant=quant, expand_ratios=(0.05, 0.2)), 3.0,
                        Inputs(calibration=batches[:4], selection=batches[4:]))
    kl = out.details["variant_kl"]
    assert {k.split("-")[0] for k in kl} == {"r0.05", "r0.2"} and any(k.endswith("-mixed") for k in kl)
    assert out.details["variant"] == min(kl, key=kl.get)
    assert all(b <= 3.0 + 1e-12 for b in out.details["variant_bits"].values())
    assert out.result.average_bits == out.details["variant_bits"][out.details["variant"]]


def test_ocs_infeasible_budget_names_the_expanded_share():
    net, batches = _net(torch.float32), _batches(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"OCS at expand ratio 0.1: 2.3 bits per weight leave .* per weight of the "
                                         r"expanded layers.*infeasible"):
        quantize_with(net, OCSConfig(quant=QuantConfig(group_size=64, unit_groups=2), select=False,
                                     expand_ratios=(0.1,)), 2.3, Inputs(calibration=batches))


def test_ocs_export_with_an_edited_split_index_is_clear(tmp_path):
    """A split index outside the deployed layer's channels (the hash recomputed, as an editor would)
    is named as a corrupt file, not decoded into a wrong weight."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from bayesq.export import content_hash, read_export
    from bayesq.packing import ExportError

    net, batches = _net(torch.float32), _batches(dtype=torch.float32)
    quant = QuantConfig(group_size=64, unit_groups=2)
    res = quantize_with(net, OCSConfig(quant=quant, select=False, expand_ratios=(0.1,)), 3.0,
                        Inputs(calibration=batches)).result
    info = save_export(tmp_path / "m.safetensors", res.model, res.weights, quant, res.allocation.total_bits)
    with safe_open(str(info.path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    split = tensors["fc2/split"].clone()
    split[0] = 64  # fc2 has 64 input channels: 0 ... 63
    tensors["fc2/split"] = split
    save_file(tensors, str(info.path), metadata={**meta, "content_sha256": content_hash(tensors, meta["layers"])})
    with pytest.raises(ExportError, match=r"layer 'fc2': its split channels do not index .*corrupted or was edited"):
        read_export(info.path)


def test_ocs_config_names_a_bad_ratio():
    with pytest.raises(ValueError, match=r"expand_ratios.*\(0, 1\]"):
        OCSConfig(expand_ratios=(0.0,))
    with pytest.raises(ValueError, match="expand_ratios"):
        OCSConfig(expand_ratios=())
