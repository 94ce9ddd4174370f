import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesq.baselines import activations
from bayesq.baselines.activations import batch_sums, input_stats
from nets import SamePadConv


def _batches(shape, n_batches=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(n_batches)]


def _conv_output_error(conv, x, D):
    """Mean over inputs of the squared output change of a weight change D (bias-free)."""
    out = F.conv2d(x, D, None, conv.stride, conv.padding, conv.dilation, conv.groups)
    return float(out.pow(2).sum() / x.shape[0])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_input_stats_trace_vs_conv_output_error(groups):
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, 3, padding=1, stride=2, groups=groups, bias=False).double()
    model = nn.Sequential(conv, nn.Flatten())
    batches = _batches((2, 4, 5, 6))
    st = input_stats(model, batches, {"0": conv})["0"]
    D = torch.randn_like(conv.weight)  # (8, 4/groups, 3, 3)
    Dm = D.reshape(groups, 8 // groups, -1)  # (groups, out/groups, d_in)
    trace = float(torch.einsum("goi,gij,goj->", Dm, st.H, Dm))
    ref = sum(_conv_output_error(conv, x, D) * x.shape[0] for x in batches) / 6
    assert st.H.shape == (groups, 4 // groups * 9, 4 // groups * 9) and st.n == 6
    assert trace == pytest.approx(ref, rel=1e-10)
    assert st.positions == 3 * 3  # output pixels per input: 5x6 at stride 2, padding 1


def test_input_stats_same_padding_inside_forward_vs_output_error():
    torch.manual_seed(1)
    conv = SamePadConv(3, 5, 2, bias=False).double()
    batches = _batches((2, 3, 4, 4))
    st = input_stats(nn.Sequential(conv, nn.Flatten()), batches, {"0": conv})["0"]
    D = torch.randn_like(conv.weight)
    ref = sum(float(F.conv2d(F.pad(x, [0, 1, 0, 1]), D).pow(2).sum()) for x in batches) / 6
    Dm = D.reshape(1, 5, -1)
    assert float(torch.einsum("goi,gij,goj->", Dm, st.H, Dm)) == pytest.approx(ref, rel=1e-10)


def test_input_stats_linear_tokens_vs_explicit_sums():
    torch.manual_seed(2)
    lin = nn.Linear(5, 3).double()
    batches = _batches((4, 7, 5))  # (B, T, d)
    st = input_stats(lin, batches, {"": lin})[""]
    X = torch.cat(batches).reshape(-1, 5)  # (N*T, d)
    assert torch.allclose(st.H[0], X.T @ X / 12, rtol=1e-12)
    assert torch.allclose(st.abs_mean[0], X.abs().mean(0), rtol=1e-12)
    assert torch.equal(st.abs_max[0], X.abs().amax(0))  # the largest over every batch
    assert torch.equal(st.row_diag(3), st.H[0].diagonal().expand(3, -1))
    assert st.positions == 7  # tokens per input


class _QKV(nn.Module):
    """Three projections of one input (an attention block's q / k / v), then one of their sum."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(5, 5) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) + self.k(x) + self.v(x))


def test_input_stats_shared_input_computed_once_vs_explicit_sums(monkeypatch):
    torch.manual_seed(3)
    model = _QKV().double()
    batches = _batches((4, 7, 5), 2)
    calls = []
    sums = activations.batch_sums
    monkeypatch.setattr(activations, "batch_sums", lambda rows, *a: calls.append(rows.shape) or sums(rows, *a))
    st = input_stats(model, batches, {n: getattr(model, n) for n in "qkvo"})
    assert len(calls) == 2 * len(batches)  # one for q / k / v, one for o, per batch
    X = torch.cat([b.reshape(-1, 5) for b in batches])
    with torch.no_grad():
        Y = torch.cat([(model.q(b) + model.k(b) + model.v(b)).reshape(-1, 5) for b in batches])
    for name in "qkv":
        torch.testing.assert_close(st[name].H[0], X.T @ X / 8, rtol=1e-12, atol=0)
        torch.testing.assert_close(st[name].abs_mean[0], X.abs().mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(st["o"].H[0], Y.T @ Y / 8, rtol=1e-12, atol=0)


def test_input_stats_without_abs_mean_same_moments_and_awq_says_so():
    from bayesq.baselines.awq import channel_magnitude

    torch.manual_seed(4)
    model = _QKV().double()
    batches = _batches((4, 7, 5), 2)
    layers = {n: getattr(model, n) for n in "qkvo"}
    full, lean = input_stats(model, batches, layers), input_stats(model, batches, layers, abs_mean=False)
    for name in layers:
        assert torch.equal(full[name].H, lean[name].H) and torch.equal(full[name].mean, lean[name].mean)
        assert lean[name].abs_mean is None
    with pytest.raises(ValueError, match="abs_mean=True"):
        channel_magnitude(lean["q"], 1)


def test_input_stats_empty_or_unused_layer_raises():
    lin = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="empty calibration"):
        input_stats(lin, [], {"": lin})
    unused = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="never ran"):
        input_stats(lin, [torch.randn(2, 3)], {"": lin, "u": unused})


@pytest.mark.parametrize("layout", ["rows", "patches"])  # (N, groups, T, d) | a transposed view of (N, groups, d, T)
def test_batch_sums_float32_vs_float64_reference(layout):
    torch.manual_seed(0)  # post-ReLU inputs (all positive: the worst case of a float32 sum), 32 x 1024 rows
    if layout == "rows":
        rows = torch.relu(torch.randn(32, 3, 1024, 9) + 1.0)  # (N, groups, T, d) float32
    else:
        rows = torch.relu(torch.randn(32, 3, 9, 1024) + 1.0).transpose(2, 3)
    H, a, m = batch_sums(rows)
    r = rows.double()
    want = (torch.einsum("ngti,ngtj->gij", r, r), r.abs().sum((0, 2)), r.sum((0, 2)))
    assert H.dtype == torch.float32 and H.shape == (3, 9, 9) and a.shape == m.shape == (3, 9)
    assert torch.equal(H, H.mT)
    for got, ref in zip((H, a, m), want):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-5
    assert float((H.double() - want[0]).norm() / want[0].norm()) > 0  # float32 arithmetic, not float64
