import pytest
import torch
from torch import nn

from bayesq.baselines.activations import input_stats
from bayesq.blocks import quantizable_layers
from bayesq.forward import batch_size, by_length, logits, pass_logits, split_batches


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=32, num_labels=3)
    return BertForSequenceClassification(config).double().eval()


def _padded_batches(lengths: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Right-padded (B, L) batches of random tokens, L the longest of each batch."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for group in lengths:
        width = max(group)
        mask = (torch.arange(width)[None, :] < torch.tensor(group)[:, None]).long()
        ids = torch.randint(1, 50, (len(group), width), generator=gen) * mask
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)})
    return out


def _by_example(model, batches) -> dict[tuple, torch.Tensor]:
    """Each example's logits, keyed by its real tokens."""
    out = {}
    with torch.no_grad():
        for b in batches:
            for i, row in enumerate(logits(model, b)):
                out[tuple(b["input_ids"][i][b["attention_mask"][i].bool()].tolist())] = row
    return out


def test_by_length_same_examples_and_logits_vs_original_batches():
    model = _bert()
    batches = _padded_batches([[3, 9, 2, 9], [5, 1, 7, 4], [8, 2]])
    regrouped = by_length(batches)
    assert [batch_size(b) for b in regrouped] == [4, 4, 2]
    lengths = torch.cat([b["attention_mask"].sum(1) for b in regrouped])
    assert torch.equal(lengths, lengths.sort().values)  # sorted by real tokens
    assert [b["input_ids"].shape[1] for b in regrouped] == [int(b["attention_mask"].sum(1).max()) for b in regrouped]
    want, got = _by_example(model, batches), _by_example(model, regrouped)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-12)


def test_by_length_keeps_tensor_and_left_padded_batches():
    images = [torch.randn(2, 3, 4, 4), torch.randn(1, 3, 4, 4)]
    assert all(a is b for a, b in zip(by_length(images), images))
    left = _padded_batches([[2, 3]])
    left[0]["attention_mask"] = left[0]["attention_mask"].flip(1)
    assert by_length(left)[0] is left[0]


def test_input_stats_by_length_vs_padding_free_sums():
    model = _bert()
    batches = _padded_batches([[3, 9], [9, 3]])  # regrouped: [3, 3], [9, 9], no padding left
    name = "bert.encoder.layer.0.attention.self.query"
    st = input_stats(model, batches, {name: model.get_submodule(name)})[name]
    seen = []  # reference: one sentence at a time, no padding at all
    hook = model.get_submodule(name).register_forward_hook(lambda m, i, o: seen.append(i[0][0]))
    with torch.no_grad():
        for b in batches:
            for i in range(batch_size(b)):
                n = int(b["attention_mask"][i].sum())
                logits(model, {k: v[i:i + 1, :n] for k, v in b.items()})
    hook.remove()
    rows = torch.cat(seen)  # (24, 16) real tokens
    assert torch.allclose(st.H[0], rows.T @ rows / 4, rtol=1e-10, atol=1e-12)
    assert torch.allclose(st.mean[0], rows.mean(0), rtol=1e-10, atol=1e-12)


def test_empirical_fisher_by_length_vs_original_batches():
    from bayesq.curvature.fisher import empirical_fisher_diagonal

    model = _bert()
    batches = _padded_batches([[3, 9, 2, 9], [5, 1, 7, 4], [8, 2]])
    layers = quantizable_layers(model)
    want, n = empirical_fisher_diagonal(model, batches, layers, progress=False)
    got, m = empirical_fisher_diagonal(model, by_length(batches), layers, progress=False)
    assert n == m == 10
    for k in layers:  # padded positions carry no gradient: the sum over examples is the same
        assert torch.allclose(got[k], want[k], rtol=1e-9, atol=1e-15), k


def test_split_batches_fewest_near_equal_parts_same_inputs():
    images = [torch.randn(7, 3, 2, 2), torch.randn(2, 3, 2, 2)]
    parts = split_batches(images, 3)
    assert [batch_size(b) for b in parts] == [3, 2, 2, 2]  # 7 -> three parts, 2 stays whole
    assert torch.equal(torch.cat(parts), torch.cat(images))
    assert split_batches(images, None)[0] is images[0]
    d = split_batches([{"input_ids": torch.arange(10).reshape(5, 2), "mask": torch.ones(5, 2)}], 2)
    assert [b["input_ids"][:, 0].tolist() for b in d] == [[0, 2], [4, 6], [8]]


@pytest.mark.parametrize("max_inputs", [None, 3])
def test_pass_logits_of_the_curvature_and_statistics_passes_vs_each_batch(max_inputs):
    """The logits the Fisher pass (in parts of ``max_inputs``; half the batches with a backward
    pass) and the layer-input statistics pass collect over the regrouped batches, put back in the
    batches' order: each batch's own logits (float64 model: to rounding)."""
    from bayesq.config import PosteriorConfig
    from bayesq.posterior import fit_posterior

    model = _bert()
    batches = _padded_batches([[3, 9, 2, 9], [5, 1, 7, 4], [8, 2]])
    with torch.no_grad():
        want = [logits(model, b) for b in batches]
    layers = quantizable_layers(model)
    fisher, stats = [], []
    fit_posterior(model, batches, layers, PosteriorConfig(curvature_share=0.5), seed=3, progress=False,
                  on_rows=lambda name, rows: None, max_inputs=max_inputs, logits=fisher)
    input_stats(model, batches, progress=False, logits=stats)
    assert len(fisher) == (5 if max_inputs else 3) and len(stats) == 3  # parts: 2 + 2, 2 + 2, 2
    for outputs in (fisher, stats):
        got = pass_logits(outputs, batches)
        assert [z.shape for z in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            assert torch.allclose(g, w, rtol=0, atol=1e-12)
    assert not torch.allclose(torch.cat(fisher), torch.cat(want), rtol=0, atol=1e-3)  # the pass's order differs


def test_pass_logits_order_by_hand_and_none_unless_one_row_per_input():
    batches = _padded_batches([[3, 2], [4]])  # by length: inputs 1, 0, 2
    z = torch.arange(6.0).reshape(3, 2)
    got = pass_logits([z[:2], z[2:]], batches)
    assert torch.equal(got[0], z[[1, 0]]) and torch.equal(got[1], z[2:])
    images = [torch.zeros(2, 3), torch.zeros(1, 3)]  # kept as they are: the rows in order
    assert torch.equal(torch.cat(pass_logits([z], images)), z)
    assert pass_logits([], batches) is None
    assert pass_logits([z[:2]], batches) is None  # a batch the pass skipped
    assert pass_logits([z, z[:1]], batches) is None  # more calls than inputs
    assert pass_logits([z[:2], None], batches) is None  # per-token logits are not kept

    model = _bert()
    outputs: list = []
    from bayesq.curvature.fisher import fisher_diagonal
    fisher_diagonal(model, batches, quantizable_layers(model), progress=False, share=0.5, logits=outputs)
    assert pass_logits(outputs, batches) is None  # without on_rows the forward-only batch is skipped


def test_input_stats_reads_the_model_output_only_when_asked_for_its_logits():
    """A model whose output holds no logits still gets its layer-input statistics (its output is not
    read); asked for the pass's logits, the pass says what it cannot read."""
    class Features(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return {"features": self.fc(x)}

    model, batches = Features().double(), [torch.randn(5, 4, dtype=torch.float64)]
    stats = input_stats(model, batches, progress=False)
    assert torch.allclose(stats["fc"].H[0], batches[0].T @ batches[0] / 5, rtol=1e-12, atol=0)
    with pytest.raises(TypeError, match="dict"):
        input_stats(model, batches, progress=False, logits=[])


def test_fisher_split_batches_vs_whole_batches():
    """The curvature pass over parts of the batches: the same sums (float64 model) and, for the
    sampled Fisher, the same labels (the generator draws row by row)."""
    from bayesq.config import PosteriorConfig
    from bayesq.posterior import fit_posterior

    model = _bert()
    batches = _padded_batches([[3, 9, 2, 9], [5, 1, 7, 4], [8, 2]])
    layers = quantizable_layers(model)
    for curvature in ("fisher", "empirical-fisher"):
        cfg = PosteriorConfig(curvature=curvature)
        want = fit_posterior(model, batches, layers, cfg, seed=3, progress=False)
        got = fit_posterior(model, batches, layers, cfg, seed=3, progress=False, max_inputs=2)
        assert got.n_examples == want.n_examples == 10
        for k in layers:
            assert torch.allclose(got.curvature[k], want.curvature[k], rtol=1e-9, atol=1e-15), (curvature, k)


def test_output_logits_reads_every_supported_output_and_names_others():
    import pytest

    from bayesq.forward import output_logits

    z = torch.randn(2, 3)

    class WithLogits:
        logits = z

    for out in (z, WithLogits(), {"logits": z, "hidden": None}, (z, "extra"), [z]):
        assert output_logits(out) is z
    # a base model without a head (Hugging Face BaseModelOutput): its per-token features
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from bayesq.forward import Likelihood, output_likelihood

    h = torch.randn(2, 5, 4)
    base = BaseModelOutputWithPooling(last_hidden_state=h, pooler_output=h[:, 0])
    assert output_logits(base) is h and output_likelihood(base) is Likelihood.GAUSSIAN
    for out in (z, WithLogits(), {"logits": z}, (z,)):
        assert output_likelihood(out) is Likelihood.CATEGORICAL
    # a convolutional base model's (B, C, h, w) map: one row of C features per position
    conv = torch.randn(2, 3, 2, 4)
    rows = output_logits(BaseModelOutputWithPooling(last_hidden_state=conv))
    assert rows.shape == (2, 8, 3) and torch.equal(rows[1, 5], conv[1, :, 1, 1])
    with pytest.raises(TypeError, match="returned a str.*tensor, an object with .logits"):
        output_logits("not logits")
    with pytest.raises(TypeError, match="returned a dict"):
        output_logits({"scores": z})


def test_model_batch_tuples_dtype_and_non_finite():
    import pytest

    from bayesq.forward import model_batch

    x = torch.randn(2, 3, dtype=torch.float64)
    got = model_batch((x, torch.tensor([0, 1])), torch.float32)  # (inputs, labels): labels dropped
    assert got.dtype == torch.float32 and torch.equal(got, x.float())
    ids = torch.tensor([[1, 2]])
    d = model_batch({"input_ids": ids, "scale": x}, torch.float32)
    assert d["input_ids"] is ids and d["scale"].dtype == torch.float32
    bad = x.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"calibration batch 3\['pixels'\] holds 1 NaN/Inf"):
        model_batch({"pixels": bad}, None, "calibration batch 3")
    with pytest.raises(TypeError, match="batch is a str"):
        model_batch("text")


def test_kept_state_restores_modes_requires_grad_and_grads():
    from torch import nn

    from bayesq.forward import kept_state

    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(), nn.Linear(3, 2)).train()
    model[1].eval()
    model[2].weight.requires_grad_(False)
    model(torch.randn(4, 3)).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    with kept_state(model):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(True)
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, 3)).sum().backward()
    assert model.training and model[0].training and not model[1].training
    assert [p.requires_grad for p in model.parameters()] == [True, True, False, True]
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads[n] is None) and (p.grad is None or torch.equal(p.grad, grads[n]))


def test_logits_of_another_rank_name_the_shape():
    lm = nn.Linear(4, 7)  # applied per token: (B, T, V) logits, as a causal language model returns
    with pytest.raises(ValueError, match=r"shape \(2, 3, 7\).*language model"):
        logits(lm, torch.randn(2, 3, 4))
    assert logits(lm, torch.randn(2, 4)).shape == (2, 7)


def test_layer_calls_sees_every_call_and_restores_the_model_even_on_error():
    from bayesq.forward import layer_calls

    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).train()
    model[2].weight.requires_grad_(False)
    seen = []

    def record(name, mod, a, out):
        seen.append((name, tuple(a.shape), out.requires_grad, model.training))

    x = torch.randn(5, 3)
    with layer_calls(model, {"0": model[0], "2": model[2]}, record, weights_require_grad=True):
        model(x)
    assert seen == [("0", (5, 3), True, False), ("2", (5, 4), True, False)]  # eval mode, outputs in the graph
    assert model.training and not model[2].weight.requires_grad and model[0].weight.requires_grad
    with pytest.raises(RuntimeError, match="boom"):
        with layer_calls(model, {"0": model[0]}, record, weights_require_grad=True):
            raise RuntimeError("boom")
    assert model.training and not model[2].weight.requires_grad
    model(x)
    assert len(seen) == 2  # the hooks are gone


def test_predictions_token_mask_rows_and_per_input_of_per_token_logits():
    from bayesq.forward import per_input, prediction_rows, predictions, row_examples
    from nets import TinyCausalLM, lm_batches

    torch.manual_seed(0)
    model = TinyCausalLM().double().eval()
    (batch,) = lm_batches([[3, 1, 4]])
    with torch.no_grad():
        z, mask = predictions(model, batch)
    assert z.shape[:2] == batch["input_ids"].shape and mask.dtype == torch.bool
    assert torch.equal(mask, batch["attention_mask"].bool())
    rows = prediction_rows(z, mask)
    assert torch.equal(rows, torch.cat([z[i, :n] for i, n in enumerate(batch["attention_mask"].sum(1).tolist())]))
    assert torch.equal(row_examples(mask, 3), torch.repeat_interleave(torch.arange(3), mask.sum(1)))
    values = torch.randn(len(rows), dtype=torch.float64)
    starts = [0] + mask.sum(1).cumsum(0).tolist()
    want = torch.stack([values[a:b].sum() for a, b in zip(starts, starts[1:])])
    torch.testing.assert_close(per_input(values, mask, "sum"), want, rtol=0, atol=0)
    torch.testing.assert_close(per_input(values, mask), want / mask.sum(1), rtol=1e-15, atol=0)
    # a classifier: the logits themselves, one row per input, no mask
    clf = nn.Linear(4, 3).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    z2, none = predictions(clf, x)
    two = values[:2]
    assert none is None and prediction_rows(z2, none) is z2 and per_input(two, None) is two
    # no attention_mask: every token counts
    _, every = predictions(model, {"input_ids": batch["input_ids"]})
    assert bool(every.all()) and every.shape == batch["input_ids"].shape


def test_per_token_logits_with_another_token_axis_or_rank_name_the_shape():
    from bayesq.forward import predictions

    lm = nn.Linear(4, 7)
    with pytest.raises(ValueError, match=r"per-token logits of shape \(2, 3, 7\).*attention_mask has shape \(2, 5\)"):
        predictions(lambda **b: lm(b["x"]), {"x": torch.randn(2, 3, 4), "attention_mask": torch.ones(2, 5)})
    with pytest.raises(ValueError, match=r"logits of shape \(2, 3, 5, 7\)"):
        predictions(lm, torch.randn(2, 3, 5, 4))


def test_token_rows_drop_padded_tokens_of_token_inputs_only():
    from bayesq.curvature.patches import input_rows
    from bayesq.forward import token_rows

    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).bool()
    a = torch.randn(2, 3, 4)
    lin = nn.Linear(4, 5)
    rows = input_rows(lin, a, lin(a).shape)
    got = token_rows(rows, a, mask)
    assert got.shape == (1, 1, 3, 4) and torch.equal(got[0, 0], a.double()[mask])
    assert token_rows(rows, a, None) is rows
    pooled = a.mean(1)  # a head on a pooled (B, d) input: not one row per token
    r2 = input_rows(lin, pooled, lin(pooled).shape)
    assert token_rows(r2, pooled, mask) is r2


def test_drops_padding_only_for_per_token_logits_on_padded_batches():
    from bayesq.forward import drops_padding
    from nets import TinyCausalLM, lm_batches

    lm = TinyCausalLM().eval()
    padded, full = lm_batches([[3, 1]]), lm_batches([[2, 2]])
    assert drops_padding(lm, padded) and not drops_padding(lm, full)
    assert not drops_padding(_bert(), _padded_batches([[3, 1]]))  # a classifier's rows stay as they are
    assert not drops_padding(nn.Linear(3, 2), [torch.randn(2, 3)])


def test_input_stats_of_a_language_model_real_tokens_only():
    """Layer-input statistics of per-token outputs: padded tokens' rows never enter (more padding
    appended changes nothing), and H / mean are the sums over the real tokens' inputs."""
    from nets import TinyCausalLM, lm_batches, with_padding

    torch.manual_seed(0)
    model = TinyCausalLM().double().eval()
    batches = lm_batches([[3, 5, 2], [4, 1, 4]])
    layers = quantizable_layers(model)
    st = input_stats(model, batches, layers)
    more = input_stats(model, with_padding(batches, 3), layers)
    seen = []
    hook = model.fc1.register_forward_hook(lambda m, i, o: seen.append(i[0][0]))
    with torch.no_grad():
        for b in batches:
            for i in range(batch_size(b)):
                n = int(b["attention_mask"][i].sum())
                model(**{k: v[i:i + 1, :n] for k, v in b.items()})
    hook.remove()
    rows = torch.cat(seen)  # the real tokens' inputs, one sentence at a time, no padding at all
    n = sum(batch_size(b) for b in batches)
    torch.testing.assert_close(st["fc1"].H[0], rows.T @ rows / n, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["fc1"].mean[0], rows.mean(0), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["fc1"].abs_mean[0], rows.abs().mean(0), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(st["fc1"].abs_max[0], rows.abs().amax(0), rtol=1e-12, atol=0)  # padding never wins
    for k in layers:
        for f in ("H", "mean", "abs_mean", "abs_max"):
            torch.testing.assert_close(getattr(more[k], f), getattr(st[k], f), rtol=1e-12, atol=1e-14)


def test_gpt2_passes_read_real_tokens_only():
    """A Hugging Face causal LM (GPT2LMHeadModel from a config, random weights; its quantisable
    nn.Linear today is the head): the Fisher, K-FAC and layer-input passes and the per-input KL
    give the same numbers with more right padding appended (padding ignored)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from bayesq.curvature.fisher import fisher_diagonal
    from bayesq.curvature.kfac import kfac_factors
    from bayesq.evaluation import kl_per_input, reference_log_probs
    from nets import lm_batches, with_padding

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=64)
    model, other = GPT2LMHeadModel(config).double().eval(), GPT2LMHeadModel(config).double().eval()
    layers = quantizable_layers(model)
    batches = lm_batches([[3, 5, 2], [4, 1, 4]], vocab=97)
    padded = with_padding(batches, 3)

    def passes(bs):
        fisher, _ = fisher_diagonal(model, bs, layers, seed=1, progress=False)
        kfac = kfac_factors(model, bs, layers, progress=False)
        stats = input_stats(model, bs, layers)
        kl = kl_per_input(reference_log_probs(model, bs), other, bs)
        return [fisher[k] for k in layers] + [t for k in layers for t in (kfac[k].A, kfac[k].G, stats[k].H)] + [kl]

    for want, got in zip(passes(batches), passes(padded)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-15)


def test_layer_calls_taps_keep_outputs_and_differentiate_outputs_not_weights():
    from bayesq.forward import Taps, layer_calls

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    model[2].weight.requires_grad_(False)  # the user's own setting, kept
    x = torch.randn(5, 3, dtype=torch.float64)
    seen, grads, taps = {}, {}, Taps()

    def record(name, mod, a, out):
        seen[name] = (out.requires_grad, any(p.requires_grad for p in model.parameters()))
        if out.requires_grad:
            out.register_hook(lambda g, name=name: grads.__setitem__(name, g))

    with layer_calls(model, {"0": model[0], "2": model[2]}, record, taps=taps):
        y = model(x)
        torch.autograd.backward(y.pow(2).sum(), inputs=taps.leaves())
    assert seen == {"0": (True, False), "2": (True, False)}  # in the graph, no parameter requiring grad
    assert torch.equal(y, model(x))  # the tapped outputs carry the same values
    out0 = model[0](x).detach().requires_grad_(True)
    z = model[2](torch.tanh(out0))
    want0, want2 = torch.autograd.grad(z.pow(2).sum(), [out0, z])
    assert torch.equal(grads["2"], want2) and torch.allclose(grads["0"], want0, rtol=1e-12, atol=0)
    assert all(p.grad is None for p in model.parameters())  # no weight gradient formed
    assert model[0].weight.requires_grad and not model[2].weight.requires_grad  # restored
    with torch.no_grad(), layer_calls(model, {"0": model[0]}, record, taps=Taps()):
        model(x)
    assert seen["0"] == (False, False)  # no gradients: nothing tapped


def test_hooked_call_runs_hooks_once_in_eval_and_gives_each_module_its_mode_back():
    """One pass with the hooks, no gradients, every module in eval mode; afterwards a mixed-mode
    model has each module's own mode back (not the top module's) and the hooks are gone, also
    after an error; the passes built on :func:`eval_mode` (evaluation, bias-correction readers,
    output layer, memory estimate) keep mixed modes too."""
    from bayesq.bias_correction import _readers
    from bayesq.evaluation import predict
    from bayesq.forward import eval_mode, hooked_call
    from bayesq.memory import estimate
    from bayesq.output_offset import output_layer

    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2)).eval()
    model[1].train()  # a user's mixed modes: the top module in eval, one child training
    modes = [m.training for m in model.modules()]
    seen = []
    x = torch.randn(5, 3, requires_grad=True)
    out = hooked_call(model, x, post=[(model[2], lambda m, i, o: seen.append(("post", o.requires_grad, m.training)))],
                      pre=[(model[0], lambda m, i: seen.append(("pre", model[1].training)))])
    assert seen == [("pre", False), ("post", False, False)] and not out.requires_grad
    assert [m.training for m in model.modules()] == modes
    hooked_call(model, x)
    assert len(seen) == 2  # the hooks are gone
    with pytest.raises(RuntimeError, match="boom"):
        with eval_mode(model):
            assert not any(m.training for m in model.modules())
            raise RuntimeError("boom")
    assert [m.training for m in model.modules()] == modes
    layers = {"0": model[0], "2": model[2]}
    predict(model, [x.detach()], None)
    _readers(model, x.detach(), layers)
    output_layer(model, x.detach())
    estimate(model, layers, [x.detach()])
    assert [m.training for m in model.modules()] == modes
