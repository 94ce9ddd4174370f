import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.functional import hessian, jacobian
from torch.func import functional_call

from bayesq.curvature.fisher import fisher_diagonal
from bayesq.curvature.kfac import KFACFactors, damped, kfac_diagonal, kfac_factors, kfac_whitened_cost
from nets import SamePadConv


class PerToken(nn.Module):
    """One Linear applied to every token; all token outputs are model outputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 4) -> (B, T*3)
        return self.lin(x).flatten(1)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        self.unused = nn.Linear(5, 2)

    def forward(self, x):
        return self.net(x)


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def _exact_ggn(model, name, batches):
    """Per-example mean of J^T J, J = d outputs / d (row-major flattened weight) via autograd."""
    W = dict(model.named_parameters())[f"{name}.weight"].detach()
    total, n = 0.0, 0
    for x in batches:
        J = jacobian(lambda w: functional_call(model, {f"{name}.weight": w}, (x,)), W,
                     vectorize=True)  # (B, C, *W.shape)
        J = J.reshape(x.shape[0], -1, W.numel())  # (B, C, out*d_in)
        total = total + torch.einsum("bck,bcl->kl", J, J)
        n += x.shape[0]
    return total / n


def test_kfac_linear_mse_vs_exact_ggn():
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    batches = [torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)]
    f = kfac_factors(model, batches, {"": model}, loss="mse", decay=None, progress=False)[""]
    assert f.A.shape == (5, 5) and f.G.shape == (3, 3) and f.n_examples == 7 and f.A.dtype == torch.float64
    wrapped = nn.Sequential(model)
    torch.testing.assert_close(torch.kron(f.G, f.A), _exact_ggn(wrapped, "0", batches), rtol=1e-10, atol=1e-12)


def test_kfac_linear_tokens_mse_vs_exact_ggn():
    torch.manual_seed(1)
    model = PerToken().double()
    batches = [torch.randn(3, 4, 4, dtype=torch.float64)]
    f = kfac_factors(model, batches, _layers(model), loss="mse", progress=False)["lin"]
    torch.testing.assert_close(torch.kron(f.G, f.A), _exact_ggn(model, "lin", batches), rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=2),
        lambda: nn.Conv2d(2, 3, (3, 2), padding="same"),
        lambda: nn.Conv2d(2, 3, 3, padding=2, padding_mode="reflect", stride=(1, 2)),
        lambda: nn.Conv2d(2, 3, 2, padding=1, padding_mode="circular"),
        lambda: SamePadConv(2, 3, 2, stride=2),
    ],
    ids=["strided-dilated", "same", "reflect", "circular", "pad-in-forward"],
)
def test_kfac_conv_mse_vs_exact_ggn(conv):
    torch.manual_seed(2)
    model = nn.Sequential(conv(), nn.Flatten()).double()
    batches = [torch.randn(3, 2, 6, 7, dtype=torch.float64)]
    f = kfac_factors(model, batches, _layers(model), loss="mse", progress=False)["0"]
    torch.testing.assert_close(torch.kron(f.G, f.A), _exact_ggn(model, "0", batches), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("groups", [2, 4])
def test_kfac_grouped_conv_A_is_group_average_of_exact_blocks(groups):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=groups), nn.Flatten()).double()
    batches = [torch.randn(2, 4, 5, 5, dtype=torch.float64)]
    f = kfac_factors(model, batches, _layers(model), loss="mse", progress=False)["0"]
    ggn = _exact_ggn(model, "0", batches)  # block (o, o) of a row in group k is that group's A_k
    d_in, per_group = f.d_in, 4 // groups
    blocks = [ggn[o * d_in:(o + 1) * d_in, o * d_in:(o + 1) * d_in] for o in range(0, 4, per_group)]
    torch.testing.assert_close(f.A, torch.stack(blocks).mean(0), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.G, torch.eye(4, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_kfac_mlp_hidden_layer_mse_G_vs_output_jacobian():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    f = kfac_factors(model, [x], _layers(model), loss="mse", progress=False)["0"]
    s = model[0](x).detach()
    J = torch.stack([jacobian(lambda v: model[2](torch.tanh(v)), s[i]) for i in range(5)])  # (B, 3, 6)
    torch.testing.assert_close(f.G, torch.einsum("bco,bcp->op", J, J) / 5, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.A, x.T @ x / 5, rtol=1e-10, atol=1e-12)


def test_kfac_ce_exact_single_example_vs_autograd_hessian():
    """Linear model, one input: the CE Hessian in W is exactly (diag p - p p^T) (x) x x^T."""
    torch.manual_seed(5)
    model = nn.Linear(4, 3).double()
    x = torch.randn(1, 4, dtype=torch.float64)
    f = kfac_factors(model, [x], {"": model}, loss="ce_exact", progress=False)[""]
    W, b = model.weight.detach(), model.bias.detach()
    Hs = hessian(lambda w: F.cross_entropy(x @ w.T + b, torch.tensor([1])), W).reshape(12, 12)
    torch.testing.assert_close(torch.kron(f.G, f.A), Hs, rtol=1e-10, atol=1e-12)


def test_kfac_diagonal_vs_fisher_diagonal_single_example():
    """Same sampler, one input, no tokens: diag(G) diag(A) is fisher_diagonal's sum exactly."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = [torch.randn(1, 4, dtype=torch.float64)]
    kf = kfac_factors(model, x, _layers(model), label_samples=5, seed=3, progress=False)
    fd, n = fisher_diagonal(model, x, _layers(model), label_samples=5, seed=3, progress=False)
    for name in kf:
        torch.testing.assert_close(kfac_diagonal(kf[name]), fd[name] / n, rtol=1e-10, atol=1e-14)


def test_kfac_ce_sampled_converges_to_ce_exact():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = [torch.randn(6, 4, dtype=torch.float64)]
    exact = kfac_factors(model, x, _layers(model), loss="ce_exact", progress=False)["0"]
    sampled = kfac_factors(model, x, _layers(model), label_samples=400, seed=1, progress=False)["0"]
    torch.testing.assert_close(sampled.A, exact.A, rtol=1e-12, atol=1e-12)
    rel = torch.linalg.matrix_norm(sampled.G - exact.G) / torch.linalg.matrix_norm(exact.G)
    assert rel < 0.1, rel


def test_kfac_ema_across_batches_vs_per_batch_factors():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    batches = [torch.randn(b, 3, dtype=torch.float64) for b in (2, 5, 3)]
    layers = _layers(model)
    per = [kfac_factors(model, [x], layers, loss="mse", progress=False)["0"] for x in batches]
    ema = kfac_factors(model, batches, layers, loss="mse", decay=0.9, progress=False)["0"]
    mean = kfac_factors(model, batches, layers, loss="mse", decay=None, progress=False)["0"]
    for attr in ("A", "G"):
        ref = getattr(per[0], attr)
        for p in per[1:]:
            ref = 0.9 * ref + 0.1 * getattr(p, attr)
        torch.testing.assert_close(getattr(ema, attr), ref, rtol=1e-12, atol=1e-14)
        weighted = sum(b.shape[0] * getattr(p, attr) for b, p in zip(batches, per)) / 10
        torch.testing.assert_close(getattr(mean, attr), weighted, rtol=1e-12, atol=1e-14)
    assert ema.n_examples == 10


def test_damped_pi_balances_factor_traces():
    A = torch.diag(torch.tensor([4.0, 2.0], dtype=torch.float64))  # tr/d = 3
    G = torch.diag(torch.tensor([0.5, 0.2, 0.2], dtype=torch.float64))  # tr/d = 0.3
    f = KFACFactors(A, G, 10)
    lam = 0.04
    d = damped(f, lam)
    pi = math.sqrt(3.0 / 0.3)
    torch.testing.assert_close(d.A, A + pi * 0.2 * torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(d.G, G + 0.2 / pi * torch.eye(3, dtype=torch.float64))
    plain = damped(f, lam, pi=False)
    torch.testing.assert_close(plain.A, A + 0.2 * torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(plain.G, G + 0.2 * torch.eye(3, dtype=torch.float64))
    # the damping term's cross part is sqrt(lam)^2 I (x) I = lam I either way
    dense = torch.kron(d.G, d.A) - torch.kron(G, A) - 0.2 / pi * torch.kron(torch.eye(3, dtype=torch.float64), A) \
        - pi * 0.2 * torch.kron(G, torch.eye(2, dtype=torch.float64))
    torch.testing.assert_close(dense, lam * torch.eye(6, dtype=torch.float64))
    zero_g = damped(KFACFactors(A, torch.zeros(3, 3, dtype=torch.float64), 1), lam)
    torch.testing.assert_close(zero_g.G, 0.2 * torch.eye(3, dtype=torch.float64))
    assert d.n_examples == 10
    with pytest.raises(ValueError, match="damping"):
        damped(f, -1.0)


def test_kfac_whitened_cost_vs_explicit_kronecker():
    gen = torch.Generator().manual_seed(9)
    X, Y = torch.randn(4, 8, generator=gen, dtype=torch.float64), torch.randn(3, 8, generator=gen, dtype=torch.float64)
    A, G = X @ X.T, Y @ Y.T
    D = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)  # two errors (batch, out, in)
    P = torch.kron(G, A)
    ref = torch.stack([d.reshape(-1) @ P @ d.reshape(-1) for d in D])
    torch.testing.assert_close(kfac_whitened_cost(D, A, G), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kfac_diagonal(KFACFactors(A, G, 1)).reshape(-1), P.diagonal())
    with pytest.raises(ValueError, match="reshape the weight error"):
        kfac_whitened_cost(D.transpose(-1, -2), A, G)


def test_kfac_bad_input_raises():
    model = nn.Sequential(nn.Linear(3, 2)).double()
    layers = _layers(model)
    x = [torch.randn(2, 3, dtype=torch.float64)]
    with pytest.raises(ValueError, match="empty calibration set"):
        kfac_factors(model, [], layers, progress=False)
    with pytest.raises(ValueError, match="loss='nll' is not supported"):
        kfac_factors(model, x, layers, loss="nll", progress=False)
    with pytest.raises(ValueError, match="decay"):
        kfac_factors(model, x, layers, decay=1.0, progress=False)
    with pytest.raises(ValueError, match="label_samples"):
        kfac_factors(model, x, layers, label_samples=0, progress=False)
    conv1d = nn.Sequential(nn.Conv1d(1, 1, 1))
    with pytest.raises(ValueError, match="only nn.Linear and nn.Conv2d"):
        kfac_factors(conv1d, x, {"0": conv1d[0]}, progress=False)
    shared = nn.Linear(3, 3).double()
    twice = nn.Sequential(shared, nn.Tanh(), shared)
    with pytest.raises(ValueError, match="ran twice in one forward"):
        kfac_factors(twice, [torch.randn(2, 3, dtype=torch.float64)], {"0": shared}, progress=False)


def test_kfac_restores_model_state_and_unused_layer_is_zero():
    model = WithUnused().double().train()
    unused = model.unused
    for p in model.parameters():
        p.requires_grad_(False)
    layers = {"0": model.net[0], "2": model.net[2], "unused": unused}
    out = kfac_factors(model, [torch.randn(2, 3, dtype=torch.float64)], layers, progress=False)
    assert model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert out["unused"].A.shape == (5, 5) and not out["unused"].A.any() and not out["unused"].G.any()
    assert out["0"].A.any() and out["0"].G.any()


def test_kfac_leaves_existing_grads_and_sets_no_other():
    model = WithUnused().double()
    first = model.net[0]
    first.weight.grad = torch.full_like(first.weight, 7.0)  # the user's own gradient
    kfac_factors(model, [torch.randn(2, 3, dtype=torch.float64)], {"0": first, "2": model.net[2]}, progress=False)
    assert torch.equal(first.weight.grad, torch.full_like(first.weight, 7.0))
    assert all(p.grad is None for p in model.parameters() if p is not first.weight)


def test_kfac_language_model_factors_over_real_tokens_vs_per_sequence_loop():
    """(B, T, V) logits, ``loss="mse"`` (output Hessian I per real token, exact): per sequence,
    ``A_n = sum_{t real} a a^T`` and ``G_n = (1/T_n) sum_{t real} sum_{s real, k} g g^T`` with
    ``g_t = d z_{s,k} / d out_t``, averaged over sequences; each sequence run alone and cut to
    its real tokens. More padding appended gives the same factors (ce and mse)."""
    from bayesq.blocks import quantizable_layers
    from nets import TinyCausalLM, lm_batches, with_padding

    torch.manual_seed(0)
    model = TinyCausalLM(vocab=7, d=6, hidden=8).double().eval()
    layers = quantizable_layers(model)
    batches = lm_batches([[3, 5, 2], [4, 1, 4]], vocab=7)
    got = kfac_factors(model, batches, layers, decay=None, loss="mse", progress=False)
    seqs = [{"input_ids": b["input_ids"][i:i + 1, :n]} for b in batches
            for i, n in enumerate(b["attention_mask"].sum(1).tolist())]
    for name, layer in layers.items():
        A = torch.zeros_like(got[name].A)
        G = torch.zeros_like(got[name].G)
        for seq in seqs:
            seen = {}
            hook = layer.register_forward_hook(lambda m, i, o: seen.update(a=i[0][0], out=o))
            z = model(**seq)["logits"][0]  # (T_n, V)
            hook.remove()
            A += seen["a"].T @ seen["a"]
            for s in range(z.shape[0]):
                for k in range(z.shape[1]):
                    g = torch.autograd.grad(z[s, k], seen["out"], retain_graph=True)[0][0]  # (T_n, d_out)
                    G += g.T @ g / z.shape[0]
        torch.testing.assert_close(got[name].A, A / len(seqs), rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(got[name].G, G / len(seqs), rtol=1e-10, atol=1e-13)
    for loss in ("ce", "mse"):
        plain = kfac_factors(model, batches, layers, loss=loss, progress=False)
        padded = kfac_factors(model, with_padding(batches, 3), layers, loss=loss, progress=False)
        for name in layers:
            torch.testing.assert_close(padded[name].A, plain[name].A, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(padded[name].G, plain[name].G, rtol=1e-12, atol=1e-14)
