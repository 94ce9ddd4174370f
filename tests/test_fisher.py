import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bayesq.blocks import quantizable_layers
from bayesq.curvature.fisher import fisher_diagonal
from nets import SamePadConv, TokenModel


def _cnn():
    return nn.Sequential(
        SamePadConv(2, 4, 2, stride=2), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=2), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, groups=4, dilation=1), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    ).double()


def _reference(model, layers, batches, label_samples, seed):
    """Per-example loop with the same sampled labels (generator replayed in the same order)."""
    gen = torch.Generator().manual_seed(seed)
    ref = {n: torch.zeros_like(m.weight) for n, m in layers.items()}
    for batch in batches:
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        probs = torch.softmax(out.detach().double(), -1)
        for _ in range(label_samples):
            y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            for i in range(len(y)):
                item = {k: v[i:i + 1] for k, v in batch.items()} if isinstance(batch, dict) else batch[i:i + 1]
                o = model(**item) if isinstance(item, dict) else model(item)
                grads = torch.autograd.grad(F.cross_entropy(o, y[i:i + 1]), [m.weight for m in layers.values()])
                for (n, _), g in zip(layers.items(), grads):
                    ref[n] += g.pow(2) / label_samples
    return ref


@pytest.mark.parametrize("label_samples", [1, 3])
def test_fisher_diagonal_vs_per_example_autograd_cnn(label_samples):
    torch.manual_seed(0)
    model = _cnn().eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(4, 2, 6, 6, dtype=torch.float64) for _ in range(2)]
    got, n = fisher_diagonal(model, batches, layers, label_samples=label_samples, seed=3, progress=False)
    ref = _reference(model, layers, batches, label_samples, 3)
    assert n == 8
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("conv", [dict(padding=1, padding_mode="reflect"), dict(padding=1, padding_mode="circular"),
                                  dict(padding=2, padding_mode="replicate", dilation=2),
                                  dict(padding="same", dilation=2), dict(padding="same", padding_mode="reflect")])
def test_fisher_diagonal_vs_per_example_autograd_padding_modes(conv):
    """Padding modes other than zeros and ``padding="same"``: the patches are padded as the
    convolution pads them (before: zero-padded, 62-73 % off; "same" raised)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, **conv), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3)).double()
    model(torch.zeros(1, 2, 6, 6, dtype=torch.float64))  # materialise the lazy layer
    model.eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(4, 2, 6, 6, dtype=torch.float64)]
    got, _ = fisher_diagonal(model, batches, layers, seed=2, progress=False)
    ref = _reference(model, layers, batches, 1, 2)
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def test_fisher_diagonal_vs_per_example_autograd_tokens():
    torch.manual_seed(1)
    model = TokenModel().double().eval()
    layers = quantizable_layers(model)
    batches = [{"input_ids": torch.randn(3, 4, 5, dtype=torch.float64),
                "mask": (torch.rand(3, 4) > 0.3).double()}]
    got, _ = fisher_diagonal(model, batches, layers, seed=5, progress=False)
    ref = _reference(model, layers, batches, 1, 5)
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def test_fisher_diagonal_float32_model_vs_float64():
    """A float32 model squares, sums and accumulates its batches in float32 (``sum_dtype``): the
    diagonal matches the float64 model's to float32 accuracy, and comes back in float32."""
    torch.manual_seed(2)
    model = _cnn().eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(32, 2, 6, 6, dtype=torch.float64) for _ in range(2)]
    ref, _ = fisher_diagonal(model, batches, layers, seed=4, progress=False)
    model32 = model.float()
    got, _ = fisher_diagonal(model32, [b.float() for b in batches], quantizable_layers(model32), seed=4,
                             progress=False)
    for name in layers:
        assert got[name].dtype == torch.float32  # summed in the model's dtype (sum_dtype)
        torch.testing.assert_close(got[name].double(), ref[name], rtol=1e-4, atol=1e-9 * float(ref[name].max()))


def test_fisher_diagonal_empty_calibration_raises():
    model = _cnn()
    with pytest.raises(ValueError, match="empty calibration set"):
        fisher_diagonal(model, [], quantizable_layers(model), progress=False)


class _SideBranch(nn.Module):
    """A classifier with a Linear whose output never reaches the logits."""

    def __init__(self):
        super().__init__()
        self.body, self.side, self.head = nn.Linear(3, 4), nn.Linear(3, 2), nn.Linear(4, 3)

    def forward(self, x):
        self.side(x)  # computed, not used
        return self.head(torch.tanh(self.body(x)))


def test_fisher_diagonal_layer_off_the_loss_path_is_zero_and_others_vs_autograd():
    torch.manual_seed(0)
    model = _SideBranch().double().eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(3, 3, dtype=torch.float64) for _ in range(2)]
    got, n = fisher_diagonal(model, batches, layers, label_samples=2, seed=5, progress=False)
    reached = {k: v for k, v in layers.items() if k != "side"}
    ref = _reference(model, reached, batches, 2, 5)
    assert n == 6 and torch.equal(got["side"], torch.zeros_like(got["side"]))
    for name in reached:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)


def test_fisher_diagonal_restores_model_state():
    model = _cnn().train()
    for p in model.parameters():
        p.requires_grad_(False)
    fisher_diagonal(model, [torch.randn(2, 2, 6, 6, dtype=torch.float64)], quantizable_layers(model), progress=False)
    assert model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_fisher_diagonal_leaves_existing_grads_and_sets_no_other():
    model = _cnn()
    head = model[-1]
    head.weight.grad = torch.full_like(head.weight, 7.0)  # the user's own gradient
    fisher_diagonal(model, [torch.randn(2, 2, 6, 6, dtype=torch.float64)], quantizable_layers(model), progress=False)
    assert torch.equal(head.weight.grad, torch.full_like(head.weight, 7.0))
    assert all(p.grad is None for p in model.parameters() if p is not head.weight)


def _lm_reference(model, layers, batches, label_samples, seed):
    """Per-sequence loop: labels drawn per real token from the model's predictive (generator
    replayed in the same order, rows in example then token order), each sequence run alone and
    cut to its real tokens, its loss the sum over them of -log p(y_t); squares of its gradient."""
    gen = torch.Generator().manual_seed(seed)
    ref = {n: torch.zeros_like(m.weight) for n, m in layers.items()}
    for batch in batches:
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            probs = torch.softmax(model(**batch)["logits"][mask].double(), -1)
        for _ in range(label_samples):
            y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            start = 0
            for i, n in enumerate(mask.sum(1).tolist()):
                z = model(input_ids=batch["input_ids"][i:i + 1, :n])["logits"][0]  # (n, V), no padding
                loss = F.cross_entropy(z, y[start:start + n], reduction="sum")
                start += n
                grads = torch.autograd.grad(loss, [m.weight for m in layers.values()])
                for (name, _), g in zip(layers.items(), grads):
                    ref[name] += g.pow(2) / label_samples
    return ref


@pytest.mark.parametrize("label_samples", [1, 2])
def test_fisher_diagonal_language_model_vs_per_sequence_autograd(monkeypatch, label_samples):
    """(B, T, V) logits: one sampled label per real token, the sequence's loss summed over its
    real tokens; padding contributes nothing (more of it appended gives the same Fisher). Labels
    sampled from a few rows' probabilities at a time (LABEL_CHUNK: one row, then two) are those
    of the whole (R, V) at once: the identical Fisher."""
    import bayesq.curvature.fisher as fisher
    from nets import TinyCausalLM, lm_batches, with_padding

    torch.manual_seed(0)
    model = TinyCausalLM().double().eval()
    layers = quantizable_layers(model)
    batches = lm_batches([[3, 5, 2], [4, 1, 4]])
    got, n = fisher_diagonal(model, batches, layers, label_samples=label_samples, seed=3, progress=False)
    ref = _lm_reference(model, layers, batches, label_samples, 3)
    padded, m = fisher_diagonal(model, with_padding(batches, 3), layers, label_samples=label_samples, seed=3,
                                progress=False)
    assert n == m == sum(len(b["input_ids"]) for b in batches)
    for name in layers:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(padded[name], got[name], rtol=1e-12, atol=1e-14)
    vocab = model(**batches[0])["logits"].shape[-1]
    for chunk in (1, 2 * vocab):
        monkeypatch.setattr(fisher, "LABEL_CHUNK", chunk)
        chunked, _ = fisher_diagonal(model, batches, layers, label_samples=label_samples, seed=3, progress=False)
        for name in layers:
            assert torch.equal(chunked[name], got[name])


def test_fisher_pass_layer_input_statistics_of_a_language_model_vs_forward_pass():
    """The Fisher pass's on_rows gets the real tokens' rows only, as the forward pass of
    input_stats does (padding appended to the batches: the same statistics)."""
    from bayesq.baselines.activations import StatsSums, input_stats
    from nets import TinyCausalLM, lm_batches, with_padding

    torch.manual_seed(0)
    model = TinyCausalLM().double().eval()
    layers = quantizable_layers(model)
    batches = lm_batches([[3, 5, 2], [4, 1, 4]])
    sums = StatsSums()
    _, n = fisher_diagonal(model, with_padding(batches, 2), layers, seed=3, progress=False, on_rows=sums)
    got, want = sums.stats(layers, n), input_stats(model, batches, layers)
    for name in layers:
        for f in ("H", "mean", "abs_mean"):
            torch.testing.assert_close(getattr(got[name], f), getattr(want[name], f), rtol=1e-12, atol=1e-14)


def test_empirical_fisher_language_model_token_labels():
    """Given (B, T) labels of a language model, the real tokens' entries are read (padding's are
    not); the model's own argmax labels are the label-free default; a (B,) label tensor is
    refused naming the (B, T) shape."""
    from bayesq.curvature.fisher import empirical_fisher_diagonal
    from nets import TinyCausalLM, lm_batches

    torch.manual_seed(0)
    model = TinyCausalLM().double().eval()
    layers = quantizable_layers(model)
    batches = lm_batches([[3, 5, 2], [4, 1, 4]])
    with torch.no_grad():
        argmax = [model(**b)["logits"].argmax(-1) for b in batches]
    junk = [torch.where(b["attention_mask"].bool(), y, torch.full_like(y, 10**6)) for b, y in zip(batches, argmax)]
    free, _ = empirical_fisher_diagonal(model, batches, layers, progress=False)
    given, _ = empirical_fisher_diagonal(model, batches, layers, labels=junk, progress=False)
    for name in layers:
        torch.testing.assert_close(given[name], free[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"labels\[0\] has shape \(3,\).*\(3, 5\).*\(B, T\)"):
        empirical_fisher_diagonal(model, batches, layers, labels=[y[:, 0] for y in argmax], progress=False)


@pytest.mark.parametrize("kind", ["cnn", "tokens", "tokens-unpadded-part"])
def test_fisher_in_parts_vs_whole_batches(kind):
    """Batches run in parts of two inputs: the same sampled labels and Fisher sums (float64 model),
    and the same layer-input statistics; a layer with fewer rows per part than input features
    gets its batch's rows joined (the identical sums, also for transposed conv patches, and where
    one part of a padded batch has no padding: before, joining its rows with the others' real-token
    rows raised)."""
    from bayesq.baselines.activations import StatsSums

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    if kind == "cnn":
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 6, 1), nn.Flatten(),
                              nn.Linear(6 * 9, 5)).double().eval()
        batches = [torch.randn(5, 3, 5, 5, generator=g, dtype=torch.float64) for _ in range(2)]
    else:
        from nets import TinyCausalLM

        model = TinyCausalLM().double().eval()  # per-token logits: rows of real tokens (d = 16 and 32)
        ids = torch.randint(0, 23, (5, 7), generator=g)
        mask = torch.ones_like(ids)
        mask[1 if kind == "tokens" else 2:, 5:] = 0
        batches = [{"input_ids": ids, "attention_mask": mask}]
    layers = quantizable_layers(model)
    whole_rows, part_rows = StatsSums(), StatsSums()
    whole, n = fisher_diagonal(model, batches, layers, seed=4, progress=False, on_rows=whole_rows)
    parts, m = fisher_diagonal(model, batches, layers, seed=4, progress=False, on_rows=part_rows, max_inputs=2)
    assert n == m
    held = 0
    want, got = whole_rows.stats(layers, n), part_rows.stats(layers, n)
    for k in layers:
        assert torch.allclose(parts[k], whole[k], rtol=1e-12, atol=0), k
        assert torch.allclose(got[k].H, want[k].H, rtol=1e-12, atol=1e-15), k
        held += torch.equal(got[k].H, want[k].H)
    assert held >= 1  # at least one layer took the joined rows (bit for bit the whole batch's sums)


@pytest.mark.parametrize("with_rows", [False, True])
def test_fisher_share_vs_spread_batches_reference(with_rows):
    """``share``: the backward pass reads the spread batches only, with the labels they get alone
    (the sampler draws row by row), and their sum is scaled by all inputs / their inputs; the
    layer-input statistics still read every batch (equal to a full pass's)."""
    from bayesq.baselines.activations import StatsSums
    from bayesq.curvature.fisher import spread_batches

    torch.manual_seed(0)
    model = _cnn().eval()
    layers = quantizable_layers(model)
    batches = [torch.randn(n, 2, 6, 6, dtype=torch.float64) for n in (4, 3, 4, 4, 2, 4, 4, 3)]  # 28 inputs, 8 read
    chosen = sorted(spread_batches(len(batches), 0.25))
    assert chosen == [2, 6]  # the middle of each half
    full_rows, share_rows = StatsSums(), StatsSums()
    got, n = fisher_diagonal(model, batches, layers, seed=3, progress=False, share=0.25,
                             on_rows=share_rows if with_rows else None)
    ref = _reference(model, layers, [batches[i] for i in chosen], 1, 3)
    assert n == 28
    for name in layers:
        torch.testing.assert_close(got[name], ref[name] * 28 / 8, rtol=1e-9, atol=1e-12)
    if with_rows:
        fisher_diagonal(model, batches, layers, seed=3, progress=False, on_rows=full_rows)
        want, have = full_rows.stats(layers, 28), share_rows.stats(layers, 28)
        for name in layers:
            torch.testing.assert_close(have[name].H, want[name].H, rtol=1e-12, atol=1e-15)


def test_spread_batches_even_and_at_least_one():
    from bayesq.curvature.fisher import spread_batches

    assert spread_batches(8, 1.0) == set(range(8))
    assert spread_batches(8, 0.5) == {1, 3, 5, 7}
    assert spread_batches(10, 0.01) == {5}
    assert spread_batches(0, 0.5) == set()
    with pytest.raises(ValueError, match=r"share = 0.0.*\(0, 1\]"):
        spread_batches(4, 0.0)


def test_empirical_fisher_share_with_labels_refused():
    from bayesq.curvature.fisher import empirical_fisher_diagonal

    model = _cnn().eval()
    batches = [torch.randn(2, 2, 6, 6, dtype=torch.float64)]
    with pytest.raises(ValueError, match="labels come one tensor per batch"):
        empirical_fisher_diagonal(model, batches, quantizable_layers(model), labels=[torch.zeros(2, dtype=torch.long)],
                                  share=0.5, progress=False)


def _tiny_bert():
    """A base BERT (no head: it returns ``last_hidden_state``) from a config, float64, eval."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     max_position_embeddings=16, attn_implementation="eager")
    return BertModel(cfg).double().eval()


def _feature_batches():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 30, (3, 5), generator=g),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])},
            {"input_ids": torch.randint(0, 30, (2, 5), generator=g), "attention_mask": torch.ones(2, 5, dtype=torch.long)}]


@pytest.mark.parametrize("label_samples", [1, 2])
def test_fisher_diagonal_of_features_vs_per_example_autograd(label_samples):
    """A model without a head: Gaussian draws ``eps`` (R, H) per batch from the same generator,
    each example's gradient of ``sum_t <f_t, eps_t>`` over its real tokens squared, the sum divided
    by the features' mean square ``sigma^2``."""
    model = _tiny_bert()
    layers = quantizable_layers(model)
    batches = _feature_batches()
    got, n = fisher_diagonal(model, batches, layers, label_samples=label_samples, seed=4, progress=False)
    gen = torch.Generator().manual_seed(4)
    ref = {name: torch.zeros_like(m.weight) for name, m in layers.items()}
    square, count = 0.0, 0
    for batch in batches:
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            rows = model(**batch).last_hidden_state[mask]
        square, count = square + float(rows.square().sum()), count + rows.numel()
        draws = [torch.randn(rows.shape, generator=gen, dtype=torch.float64) for _ in range(label_samples)]
        starts = [0, *mask.sum(1).cumsum(0).tolist()]
        for i in range(len(mask)):
            item = {k: v[i:i + 1] for k, v in batch.items()}
            for eps in draws:
                f = model(**item).last_hidden_state[mask[i:i + 1]]
                grads = torch.autograd.grad((f * eps[starts[i]:starts[i + 1]]).sum(),
                                            [m.weight for m in layers.values()], allow_unused=True)
                for name, gr in zip(layers, grads):  # None: the pooler, off the features' path
                    ref[name] += 0 if gr is None else gr.square() / label_samples
    assert n == 5
    for name in layers:
        torch.testing.assert_close(got[name], ref[name] / (square / count), rtol=1e-9, atol=1e-14)


def test_fisher_diagonal_of_features_vs_exact_gauss_newton():
    """In expectation over the draws, the Fisher of the Gaussian likelihood is the Gauss-Newton
    diagonal ``sum_rows diag(J^T J) / sigma^2`` (J = d features / d weight, exact by jacrev): 2,000
    draws land within 10 % of it (Monte Carlo error about 3 %); the pooler, off the features'
    path, gets zero."""
    from torch.func import functional_call, jacrev

    model = _tiny_bert()
    layers = quantizable_layers(model)
    batch = _feature_batches()[0]
    got, _ = fisher_diagonal(model, [batch], layers, label_samples=2000, seed=0, progress=False)
    params = dict(model.named_parameters())
    names = [f"{n}.weight" for n in layers]
    mask = batch["attention_mask"].bool()

    def features(ws):
        return functional_call(model, {**params, **ws}, args=(), kwargs=batch).last_hidden_state[mask]

    with torch.no_grad():
        sigma2 = features({}).square().mean()
    assert "pooler.dense" in layers
    jac = jacrev(features)({k: params[k].detach() for k in names})
    for name, key in zip(layers, names):
        exact = (jac[key].square().sum((0, 1)) / sigma2).detach()
        if name == "pooler.dense":
            assert not exact.any() and not got[name].any()
            continue
        assert float((got[name] - exact).norm() / exact.norm()) < 0.1, name


def test_fisher_diagonal_of_features_is_scale_free():
    """sigma^2 is the features' mean square: features scaled by 3 give the same Fisher."""
    model = _tiny_bert()

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, **kw):
            out = self.inner(**kw)
            out.last_hidden_state = 3 * out.last_hidden_state
            return out

    batches = _feature_batches()
    plain, _ = fisher_diagonal(model, batches, quantizable_layers(model), seed=2, progress=False)
    scaled_model = Scaled()
    scaled, _ = fisher_diagonal(scaled_model, batches, quantizable_layers(scaled_model), seed=2, progress=False)
    for name, f in plain.items():
        torch.testing.assert_close(scaled[f"inner.{name}"], f, rtol=1e-9, atol=1e-14)


def test_curvatures_that_read_a_softmax_refuse_a_model_without_a_head():
    from bayesq.curvature.fisher import empirical_fisher_diagonal
    from bayesq.curvature.hutchinson import hutchinson_diagonal
    from bayesq.curvature.kfac import kfac_factors

    model = _tiny_bert()
    layers = quantizable_layers(model)
    batches = _feature_batches()
    for run in (lambda: empirical_fisher_diagonal(model, batches, layers, progress=False),
                lambda: hutchinson_diagonal(model, batches, layers, probes=1, curvature="ggn", progress=False),
                lambda: kfac_factors(model, batches, layers, progress=False)):
        with pytest.raises(ValueError, match="no head.*posterior.curvature: fisher"):
            run()
