"""bayesq.curvature.patches: the one input-unfolding path, against the convolution itself and
against per-example autograd, for every Conv2d configuration."""

import pytest
import torch
from torch import nn

from bayesq.curvature.patches import input_rows, per_example_grad
from nets import SamePadConv

CONVS = {
    "zeros": dict(kernel_size=3, padding=1),
    "reflect": dict(kernel_size=3, padding=1, padding_mode="reflect"),
    "replicate": dict(kernel_size=3, padding=2, padding_mode="replicate", dilation=2),
    "circular": dict(kernel_size=3, padding=1, padding_mode="circular", stride=2),
    "same": dict(kernel_size=3, padding="same", dilation=2),
    "same-even-kernel": dict(kernel_size=(2, 4), padding="same", padding_mode="reflect"),
    "groups-stride": dict(kernel_size=3, padding=(1, 0), groups=2, stride=(2, 1)),
    "depthwise": dict(kernel_size=5, padding=2, groups=4, padding_mode="circular"),
    "pointwise": dict(kernel_size=1),
    "pointwise-groups": dict(kernel_size=1, groups=2),
    "pointwise-padded": dict(kernel_size=1, padding=1, padding_mode="reflect"),
    "pointwise-stride": dict(kernel_size=1, stride=2),
}


def _conv(cfg):
    torch.manual_seed(0)
    return nn.Conv2d(4, 6 if cfg.get("groups", 1) != 4 else 4, **cfg).double()


@pytest.mark.parametrize("name", [*CONVS, "tf-same"])
def test_input_rows_reproduce_the_convolution(name):
    torch.manual_seed(1)
    conv = SamePadConv(4, 6, 3, stride=2).double() if name == "tf-same" else _conv(CONVS[name])
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    out = conv(x)
    rows = input_rows(conv, x, out.shape)  # (N, groups, L, d_in)
    w = conv.weight.reshape(conv.groups, conv.out_channels // conv.groups, -1)  # (groups, out/groups, d_in)
    rebuilt = torch.einsum("ngli,goi->ngol", rows, w).reshape(2, conv.out_channels, *out.shape[-2:])
    torch.testing.assert_close(rebuilt + conv.bias.view(1, -1, 1, 1), out, rtol=1e-12, atol=1e-12)


def _layer_grad(name: str, seed: int):
    """(layer, inputs x, the input its hook saw, loss weights, output gradient) of the loss
    ``sum(out * target)`` on a float64 layer of ``CONVS`` or a per-token Linear."""
    torch.manual_seed(seed)
    if name == "linear-tokens":
        mod, x = nn.Linear(5, 3).double(), torch.randn(3, 4, 5, dtype=torch.float64)
    else:
        mod, x = _conv(CONVS[name]), torch.randn(3, 4, 9, 8, dtype=torch.float64)
    captured = {}
    mod.register_forward_hook(lambda m, i, o: captured.update(a=i[0].detach(), out=o))
    out = mod(x)
    target = torch.randn_like(out)
    return mod, x, captured["a"], target, torch.autograd.grad((out * target).sum(), captured["out"])[0]


@pytest.mark.parametrize("name", [*CONVS, "linear-tokens"])
def test_per_example_grad_vs_autograd(name):
    mod, x, a, target, g = _layer_grad(name, 2)
    fast = per_example_grad(mod, a, g)
    for n in range(len(x)):  # the loss is a sum over examples: example n's gradient alone
        ref = torch.autograd.grad((mod(x[n:n + 1]) * target[n:n + 1]).sum(), mod.weight)[0]
        torch.testing.assert_close(fast[n], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["pointwise", "pointwise-groups"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_input_rows_pointwise_view_vs_unfold(name, layout):
    import torch.nn.functional as F

    conv = _conv(CONVS[name])
    x = torch.randn(3, 4, 5, 7, dtype=torch.float64).to(memory_format=layout)
    rows = input_rows(conv, x, conv(x).shape, widen=False)
    ref = F.unfold(x, 1).reshape(3, conv.groups, -1, 35).transpose(2, 3)  # the general path's patches
    assert rows.shape == ref.shape and torch.equal(rows, ref)
    assert rows.data_ptr() == x.data_ptr()  # no copy


@pytest.mark.parametrize("name", ["groups-stride", "linear-tokens"])
@pytest.mark.parametrize("limit", [0, 1 << 20])  # one example at a time | all at once
def test_squared_grad_sum_vs_per_example_grad(name, limit, monkeypatch):
    import bayesq.curvature.patches as patches

    monkeypatch.setattr(patches, "BATCHED_GRAD_ELEMENTS", limit)
    mod, _, a, _, g = _layer_grad(name, 3)
    ref = per_example_grad(mod, a, g).pow(2).sum(0)
    torch.testing.assert_close(patches.squared_grad_sum(mod, a, g), ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["groups-stride", "linear-tokens"])
@pytest.mark.parametrize("examples", [1, 3])  # straight into out | a batch sum added
@pytest.mark.parametrize("inputs", [torch.float64, torch.float32])  # out in their dtype | wider (add_widened)
def test_squared_grad_sum_into_out_vs_per_example_grad(name, examples, inputs):
    """``out=`` (float64) adds the squares into a running sum in place and returns it: the sum so
    far plus the squares of these examples, for one example (added directly when the dtypes
    match) and several, from float64 inputs and from float32 ones."""
    import bayesq.curvature.patches as patches

    mod, _, a, _, g = _layer_grad(name, 3)
    a, g = a[:examples], g[:examples]
    start = torch.rand(mod.weight.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = start + per_example_grad(mod, a, g).pow(2).sum(0)
    out = start.clone()
    got = patches.squared_grad_sum(mod.to(inputs), a.to(inputs), g.to(inputs), out=out)
    assert got is out
    tol = 1e-12 if inputs == torch.float64 else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [1, 7, (1 << 16) + 3, 3 * (1 << 16)])
def test_add_widened_vs_mixed_dtype_add(n):
    """Chunked conversion gives exactly torch's mixed-dtype add (float32 -> float64 is exact),
    for sizes below, at and across the chunk, on a weight-shaped (non-flat) pair."""
    from bayesq.curvature.patches import add_widened

    g = torch.Generator().manual_seed(n)
    total = torch.randn(n, 1, dtype=torch.float64, generator=g) * 1e3
    x = torch.randn(n, 1, generator=g)
    want = total.clone().add_(x)
    out = add_widened(total, x)
    assert out is total and torch.equal(total, want)
    same = torch.randn(4, dtype=torch.float64, generator=g)
    assert torch.equal(add_widened(same.clone(), same), same + same)  # one dtype: a plain add
