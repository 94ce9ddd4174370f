import pytest
import torch
from torch import nn

from bayesq.baselines.activations import input_stats
from bayesq.blocks import quantizable_layers
from bayesq.forward import batch_size, by_length, logits


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


def test_output_logits_reads_every_supported_output_and_names_others():
    import pytest

    from bayesq.forward import output_logits

    z = torch.randn(2, 3)

    class WithLogits:
        logits = z

    for out in (z, WithLogits(), {"logits": z, "hidden": None}, (z, "extra"), [z]):
        assert output_logits(out) is z
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
