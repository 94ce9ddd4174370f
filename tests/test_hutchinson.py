"""Hutchinson Hessian / GGN diagonals vs exact matrices from torch.autograd.functional.

Every estimate is checked against the exact diagonal with a tolerance set by the estimator's
own variance: for Rademacher probes ``Var[v_i (C v)_i] = sum_{j != i} C_ij^2`` exactly, so M
probes per batch (fresh per batch) give a per-coordinate standard deviation
``sqrt(sum_b sum_{j != i} C_b,ij^2 / M)``.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from bayesq.blocks import quantizable_layers
from bayesq.curvature.fisher import fisher_diagonal
from bayesq.curvature.hutchinson import clip_curvature, hutchinson_diagonal
from nets import TokenModel

Z = 5.0  # sigmas of the estimator's own standard deviation allowed per coordinate


pytestmark = pytest.mark.usefixtures("one_thread")


class AttentionModel(nn.Module):
    """One self-attention layer on scaled_dot_product_attention (no double backward on CPU)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # x: (B, T, 4)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # each (B, 1, T, 4)
        return self.head(F.scaled_dot_product_attention(q, k, v).mean((1, 2)))


def _mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, groups=2), nn.Tanh(),
        nn.Conv2d(4, 2, 3, stride=2), nn.Tanh(), nn.Flatten(),
        nn.Linear(2 * 2 * 2, 3),
    ).double()


def _setup(kind: str, seed: int = 0):
    """(model, layers, batches) in float64 for a named tiny model."""
    torch.manual_seed(seed)
    if kind == "mlp":
        model, batches = _mlp(), [torch.randn(5, 4, dtype=torch.float64) for _ in range(2)]
    elif kind == "cnn":
        model, batches = _cnn(), [torch.randn(3, 2, 5, 5, dtype=torch.float64) for _ in range(2)]
    elif kind == "linear":
        model, batches = nn.Linear(4, 3).double(), [torch.randn(6, 4, dtype=torch.float64)]
    elif kind == "tokens":
        model = TokenModel(3, 4, 3).double()
        batches = [{"input_ids": torch.randn(3, 4, 3, dtype=torch.float64),
                    "mask": (torch.rand(3, 4) > 0.3).double()}]
    else:
        model, batches = AttentionModel().double(), [torch.randn(3, 4, 4, dtype=torch.float64)]
    return model.eval(), quantizable_layers(model), batches


def _call(model, params, batch):
    return functional_call(model, params, (), batch) if isinstance(batch, dict) else functional_call(model, params, (batch,))


def _unflatten(layers, flat):
    """Flat (P,) vector -> {'<layer>.weight': tensor shaped like the weight}."""
    out, i = {}, 0
    for name, mod in layers.items():
        k = mod.weight.numel()
        out[f"{name}.weight"] = flat[i:i + k].reshape(mod.weight.shape)  # (out, in, ...) view
        i += k
    return out


def _flat_weights(layers):
    return torch.cat([m.weight.detach().reshape(-1) for m in layers.values()])  # (P,)


def _exact_matrices(model, layers, batches, curvature):
    """Per batch, the exact (P, P) Hessian of sum_n CE(f(x_n), argmax) or GGN J^T H_out J."""
    w0 = _flat_weights(layers)
    mats = []
    with sdpa_kernel(SDPBackend.MATH):
        for batch in batches:
            with torch.no_grad():
                yhat = _call(model, _unflatten(layers, w0), batch).argmax(-1)
            logits_of = lambda w: _call(model, _unflatten(layers, w), batch)  # noqa: E731
            if curvature == "hessian":
                loss = lambda w: F.cross_entropy(logits_of(w), yhat, reduction="sum")  # noqa: E731
                mats.append(torch.autograd.functional.hessian(loss, w0, vectorize=True))
            else:
                jac = torch.autograd.functional.jacobian(logits_of, w0, vectorize=True)  # (B, C, P)
                p = torch.softmax(logits_of(w0).detach(), -1)  # (B, C)
                h_out = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # (B, C, C)
                mats.append(torch.einsum("bcp,bcd,bdq->pq", jac, h_out, jac))
    return mats


def _diag_and_std(mats, probes):
    """Exact summed diagonal (P,) and the estimator's standard deviation per coordinate (P,)."""
    diag = sum(torch.diagonal(m) for m in mats)
    var = sum((m.pow(2).sum(1) - torch.diagonal(m).pow(2)) for m in mats) / probes
    return diag, var.sqrt()


def _flat(curv, layers):
    return torch.cat([curv[n].reshape(-1) for n in layers])  # (P,)


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "tokens", "attention"])
def test_hutchinson_vs_exact_matrix(kind, curvature):
    model, layers, batches = _setup(kind)
    probes = 300
    got, n = hutchinson_diagonal(model, batches, layers, probes=probes, curvature=curvature,
                                 seed=1, progress=False)
    diag, std = _diag_and_std(_exact_matrices(model, layers, batches, curvature), probes)
    assert n == sum(len(b["mask"]) if isinstance(b, dict) else len(b) for b in batches)
    assert all(got[name].shape == m.weight.shape and got[name].dtype == torch.float64
               for name, m in layers.items())
    err = (_flat(got, layers) - diag).abs()
    assert (err <= Z * std + 1e-12).all(), f"max z = {(err / std.clamp_min(1e-30)).max():.2f}"


def test_hutchinson_mse_shrinks_as_one_over_probes():
    """MSE over coordinates, averaged over seeds, ~ mean_i sum_{j!=i} H_ij^2 / M for M=8,16,32."""
    model, layers, batches = _setup("mlp")
    mats = _exact_matrices(model, layers, batches, "hessian")
    seeds = range(20)
    mse = {}
    for probes in (8, 16, 32):
        diag, std = _diag_and_std(mats, probes)
        errs = [(_flat(hutchinson_diagonal(model, batches, layers, probes=probes, seed=s,
                                           progress=False)[0], layers) - diag).pow(2).mean()
                for s in seeds]
        mse[probes] = torch.stack(errs).mean().item()
        assert 0.8 < mse[probes] / std.pow(2).mean().item() < 1.25
    assert 3.2 < mse[8] / mse[32] < 5.0


def test_hutchinson_hessian_negative_diagonal_matches_exact():
    """The Hessian is indefinite: negative entries are estimated, the GGN stays >= 0."""
    model, layers, batches = _setup("mlp")
    mats = _exact_matrices(model, layers, batches, "hessian")
    diag, std = _diag_and_std(mats, 400)
    clearly_negative = diag < -Z * std
    assert clearly_negative.any()  # this model/seed has negative curvature (precondition)
    got, _ = hutchinson_diagonal(model, batches, layers, probes=400, seed=2, progress=False)
    assert (_flat(got, layers)[clearly_negative] < 0).all()
    ggn_diag = sum(torch.diagonal(m) for m in _exact_matrices(model, layers, batches, "ggn"))
    assert (ggn_diag >= 0).all()
    clipped = clip_curvature(got)
    assert all((clipped[n] >= 0).all() and torch.equal(clipped[n], got[n].clamp_min(0)) for n in got)


def test_hutchinson_hessian_equals_ggn_for_linear_model():
    """Logits linear in w: H = J^T H_out J exactly, so the same probes give the same estimate."""
    model, layers, batches = _setup("linear")
    hess, _ = hutchinson_diagonal(model, batches, layers, probes=4, curvature="hessian", seed=3, progress=False)
    ggn, _ = hutchinson_diagonal(model, batches, layers, probes=4, curvature="ggn", seed=3, progress=False)
    for name in layers:
        torch.testing.assert_close(hess[name], ggn[name], rtol=1e-10, atol=1e-12)


def _expected_fisher(model, layers, batches):
    """sum_n sum_y p(y|x_n) g_n(y)^2 and sum_n Var_y[g_n(y)^2], by enumerating labels."""
    mean = torch.zeros(sum(m.weight.numel() for m in layers.values()), dtype=torch.float64)
    var = torch.zeros_like(mean)
    weights = [m.weight for m in layers.values()]
    for batch in batches:
        for x in batch:
            out = model(x[None])[0]  # (C,)
            p = torch.softmax(out.detach(), -1)
            sq = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                -torch.log_softmax(out, -1)[y], weights, retain_graph=True)]).pow(2)
                for y in range(len(p))])  # (C, P)
            m1 = p @ sq
            mean += m1
            var += p @ sq.pow(2) - m1.pow(2)
    return mean, var


def test_exact_ggn_vs_expected_fisher_enumeration():
    model, layers, batches = _setup("cnn")
    ggn_diag = sum(torch.diagonal(m) for m in _exact_matrices(model, layers, batches, "ggn"))
    fisher, _ = _expected_fisher(model, layers, batches)
    torch.testing.assert_close(ggn_diag, fisher, rtol=1e-9, atol=1e-12)


def test_hutchinson_ggn_vs_fisher_diagonal_sampled_labels():
    """Both estimate the expected Fisher: agree within their combined standard deviation."""
    model, layers, batches = _setup("mlp")
    probes = samples = 300
    ggn, _ = hutchinson_diagonal(model, batches, layers, probes=probes, curvature="ggn", seed=4, progress=False)
    fisher, _ = fisher_diagonal(model, batches, layers, label_samples=samples, seed=4, progress=False)
    _, std_h = _diag_and_std(_exact_matrices(model, layers, batches, "ggn"), probes)
    _, var_f = _expected_fisher(model, layers, batches)
    std = (std_h.pow(2) + var_f / samples).sqrt()
    assert ((_flat(ggn, layers) - _flat(fisher, layers)).abs() <= Z * std + 1e-12).all()


def test_hutchinson_seed_reproducible():
    model, layers, batches = _setup("mlp")
    a, _ = hutchinson_diagonal(model, batches, layers, probes=3, seed=7, progress=False)
    b, _ = hutchinson_diagonal(model, batches, layers, probes=3, seed=7, progress=False)
    c, _ = hutchinson_diagonal(model, batches, layers, probes=3, seed=8, progress=False)
    assert all(torch.equal(a[n], b[n]) for n in layers)
    assert not all(torch.equal(a[n], c[n]) for n in layers)


@pytest.mark.parametrize("kwargs, match", [
    ({"probes": 0}, "probes=0"),
    ({"probes": 2.5}, "probes=2.5"),
    ({"probes": True}, "probes=True"),
    ({"curvature": "fisher"}, "curvature='fisher'"),
])
def test_hutchinson_bad_arguments_raise(kwargs, match):
    model, layers, batches = _setup("mlp")
    with pytest.raises(ValueError, match=match):
        hutchinson_diagonal(model, batches, layers, progress=False, **kwargs)


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
def test_hutchinson_empty_calibration_raises(curvature):
    model, layers, _ = _setup("mlp")
    with pytest.raises(ValueError, match="empty calibration set"):
        hutchinson_diagonal(model, [], layers, curvature=curvature, progress=False)


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
def test_hutchinson_restores_model_state_and_zero_for_unused_layer(curvature):
    """Train mode, frozen weights, no_grad context and a layer outside the model."""
    model, layers, batches = _setup("cnn")
    model.train()
    for p in model.parameters():
        p.requires_grad_(False)
    unused = nn.Linear(2, 2).double().requires_grad_(False)
    with torch.no_grad():  # the pass enables grad itself
        got, _ = hutchinson_diagonal(model, batches, {**layers, "unused": unused}, probes=2,
                                     curvature=curvature, progress=False)
    assert model.training
    assert not any(p.requires_grad for p in model.parameters()) and not unused.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(got["unused"], torch.zeros(2, 2, dtype=torch.float64))


def test_clip_curvature_non_finite_raises():
    with pytest.raises(ValueError, match="layer 'fc'.*NaN/Inf"):
        clip_curvature({"fc": torch.tensor([1.0, float("nan")], dtype=torch.float64)})


def test_hutchinson_hessian_through_an_op_without_second_derivative_names_the_fix():
    """Hardsigmoid (MobileNetV3) has no double backward in PyTorch: a clear error, not a raw one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Hardsigmoid(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"differentiate the model twice.*hardsigmoid.*kfac.*Inputs\(traces=\.\.\.\)"):
        hutchinson_diagonal(model, [torch.randn(5, 4)], {"0": model[0], "2": model[2]}, probes=1,
                            curvature="hessian", progress=False)


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
def test_hutchinson_language_model_vs_same_probes_on_unpadded_sequences(curvature):
    """(B, T, V) logits: the pseudo-label loss is summed over each sequence's real tokens; the
    estimate equals ``v * (C v)`` with the same probes, C the Hessian (or GGN) of that loss of
    every sequence run alone on its real tokens, summed; more padding appended changes nothing."""
    from torch.func import functional_call

    from bayesq.blocks import quantizable_layers
    from nets import TinyCausalLM, lm_batches, with_padding

    torch.manual_seed(0)
    model = TinyCausalLM(vocab=7, d=6, hidden=8).double().eval()
    layers = quantizable_layers(model)
    batches = lm_batches([[3, 5, 2], [4, 1, 4]], vocab=7)
    got, n = hutchinson_diagonal(model, batches, layers, probes=3, curvature=curvature, seed=4, progress=False)
    padded, _ = hutchinson_diagonal(model, with_padding(batches, 3), layers, probes=3, curvature=curvature,
                                    seed=4, progress=False)
    names = [f"{k}.weight" for k in layers]
    params = {k: v.detach() for k, v in model.named_parameters()}

    def logits_of(ws, seq):  # (T_n, V) with the layers' weights ``ws``
        return functional_call(model, {**params, **dict(zip(names, ws))}, args=(), kwargs=seq)["logits"][0]

    gen = torch.Generator().manual_seed(4)
    ref = [torch.zeros_like(params[k]) for k in names]
    w0 = tuple(params[k] for k in names)
    for b in batches:
        seqs = [{"input_ids": b["input_ids"][i:i + 1, :t]} for i, t in enumerate(b["attention_mask"].sum(1).tolist())]
        for _ in range(3):
            v = tuple((torch.randint(0, 2, w.shape, generator=gen) * 2 - 1).double() for w in w0)
            for seq in seqs:
                if curvature == "hessian":
                    y = logits_of(w0, seq).argmax(-1)
                    loss = lambda *ws: F.cross_entropy(logits_of(ws, seq), y, reduction="sum")  # noqa: E731
                    cv = torch.autograd.functional.hvp(loss, w0, v)[1]
                else:
                    z, jv = torch.func.jvp(lambda *ws: logits_of(ws, seq), w0, v)
                    p = torch.softmax(z, -1)
                    h_jv = p * jv - p * (p * jv).sum(-1, keepdim=True)
                    cv = torch.func.vjp(lambda *ws: logits_of(ws, seq), *w0)[1](h_jv)
                for r, vi, ci in zip(ref, v, cv):
                    r += vi * ci / 3
    assert n == sum(len(b["input_ids"]) for b in batches)
    for k, r in zip(layers, ref):
        torch.testing.assert_close(got[k], r, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(padded[k], got[k], rtol=1e-12, atol=1e-14)
