"""The canonical rewrite (attention, Conv1d, Hugging Face Conv1D as Linear/Conv2d) against the
modules it replaces, and tied weights encoded once and kept tied."""

import itertools

import pytest
import torch
from torch import nn

from bayesq.baselines.activations import input_stats
from bayesq.baselines.rtn import rtn_quantize
from bayesq.blocks import quantizable_layers, tied_layers
from bayesq.canonical import Conv1dAs2d, SplitAttention, canonical, make_canonical
from bayesq.config import BayesQConfig, Granularity, QuantConfig
from bayesq.export import load, save_export
from bayesq.quantize import quantize_model

D = torch.float64


def _qkv(n, length, s, e, kd, batch_first, g):
    q, k, v = (torch.randn(n, t, d, dtype=D, generator=g) for t, d in ((length, e), (s, kd), (s, kd)))
    return (q, k, v) if batch_first else (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))


@pytest.mark.parametrize("batch_first,kdim,bias", list(itertools.product([True, False], [None, 12], [True, False])))
def test_split_attention_vs_multihead_attention(batch_first, kdim, bias):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    e, h, n, length, s = 16, 4, 3, 5, 7
    mha = nn.MultiheadAttention(e, h, batch_first=batch_first, kdim=kdim, vdim=kdim, bias=bias).double().eval()
    split = SplitAttention(mha)
    q, k, v = _qkv(n, length, s, e, kdim or e, batch_first, g)
    pad = torch.zeros(n, s, dtype=torch.bool)
    pad[0, -2:] = True
    masks = [{}, {"key_padding_mask": pad}, {"attn_mask": torch.randn(length, s, dtype=D, generator=g)},
             {"attn_mask": torch.rand(n * h, length, s, generator=g) > 0.7},
             {"attn_mask": torch.randn(length, s, dtype=D, generator=g), "key_padding_mask": pad.double() * -1e4}]
    for kw, need, average in itertools.product(masks, [True, False], [True, False]):
        want = mha(q, k, v, need_weights=need, average_attn_weights=average, **kw)
        got = split(q, k, v, need_weights=need, average_attn_weights=average, **kw)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
        assert (got[1] is None) == (want[1] is None)
        if need:
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-12)


def test_split_attention_unbatched_and_causal_vs_multihead_attention():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2).double().eval()
    split = SplitAttention(mha)
    x = torch.randn(6, 16, dtype=D)
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=D)
    for kw in ({}, {"attn_mask": causal, "is_causal": True, "need_weights": False}):
        want, got = mha(x, x, x, **kw), split(x, x, x, **kw)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)


def test_split_attention_weights_are_the_in_projection_blocks():
    mha = nn.MultiheadAttention(8, 2)
    split = SplitAttention(mha)
    blocks = mha.in_proj_weight.detach().chunk(3)
    for lin, w, b in zip((split.q_proj, split.k_proj, split.v_proj), blocks, mha.in_proj_bias.detach().chunk(3)):
        assert isinstance(lin, nn.Linear) and torch.equal(lin.weight, w) and torch.equal(lin.bias, b)
    assert split.out_proj is mha.out_proj
    with pytest.raises(ValueError, match="add_bias_kv"):
        SplitAttention(nn.MultiheadAttention(8, 2, add_bias_kv=True))


@pytest.mark.parametrize("kw", [dict(padding=1, padding_mode="reflect"), dict(padding="same", dilation=2, groups=2),
                                dict(stride=2, padding=2, padding_mode="circular"), dict(bias=False)])
def test_conv1d_as_2d_vs_conv1d(kw):
    torch.manual_seed(0)
    conv = nn.Conv1d(4, 6, 3, **kw).double()
    x = torch.randn(2, 4, 11, dtype=D)
    torch.testing.assert_close(Conv1dAs2d(conv)(x), conv(x), rtol=0, atol=1e-12)
    torch.testing.assert_close(Conv1dAs2d(conv)(x[0]), conv(x[0]), rtol=0, atol=1e-12)  # unbatched (C, L)


def test_hf_conv1d_becomes_linear_with_the_transposed_weight():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
    torch.manual_seed(0)
    model = nn.Sequential(pytorch_utils.Conv1D(6, 4), nn.ReLU()).double()  # Conv1D(nf=out, nx=in)
    x = torch.randn(3, 5, 4, dtype=D)
    want = model(x)
    stored = model[0].weight
    with canonical(model):
        lin = model[0]
        assert type(lin) is nn.Linear and lin.weight.shape == (6, 4)
        # a transposed view of the original weight, not a copy (GPT-2 medium: 1.1 GiB)
        assert lin.weight.data_ptr() == stored.data_ptr() and torch.equal(lin.weight, stored.T)
        torch.testing.assert_close(model(x), want, rtol=0, atol=1e-12)
    assert type(model[0]) is pytorch_utils.Conv1D


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(30, 16)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                         enable_nested_tensor=True)
        self.head = nn.Linear(16, 3)

    def forward(self, ids, attention_mask):
        h = self.enc(self.emb(ids), src_key_padding_mask=attention_mask == 0)
        keep = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


def _ids(g, n=6, t=7):
    mask = torch.ones(n, t, dtype=torch.long)
    mask[: n // 2, -3:] = 0
    return {"ids": torch.randint(0, 30, (n, t), generator=g), "attention_mask": mask}


def test_canonical_rewrites_in_place_and_restores_the_model():
    model = _Encoder().eval()
    attn = model.enc.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    batch = _ids(g)
    with torch.no_grad():
        want = model(**batch)
        with canonical(model):
            assert isinstance(model.enc.layers[0].self_attn, SplitAttention)
            assert not model.enc.use_nested_tensor
            got = model(**batch)
            names = set(quantizable_layers(model))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert model.enc.layers[0].self_attn is attn and model.enc.use_nested_tensor
    assert {"enc.layers.0.self_attn.q_proj", "enc.layers.1.self_attn.out_proj", "head"} <= names
    with canonical(model, exclude=["enc.layers.1*"]):
        assert isinstance(model.enc.layers[0].self_attn, SplitAttention)
        assert type(model.enc.layers[1].self_attn) is nn.MultiheadAttention


def test_quantize_model_attention_every_projection_quantised_and_export_round_trip(tmp_path):
    model = _Encoder().eval()
    g = torch.Generator().manual_seed(0)
    batches = [_ids(g) for _ in range(3)]
    res = quantize_model(model, batches, BayesQConfig(budget=4.0), progress=False)
    assert type(model.enc.layers[0].self_attn) is nn.MultiheadAttention  # the user's model as it was
    for i, p in itertools.product(range(2), ("q_proj", "k_proj", "v_proj", "out_proj")):
        assert f"enc.layers.{i}.self_attn.{p}" in res.weights
    assert set(res.unquantized) == {"emb.weight"}
    stats = input_stats(model, batches)
    assert set(stats) == set(res.weights)  # every projection's inputs seen
    info = save_export(tmp_path / "m.safetensors", res.model, res.weights, BayesQConfig().quant,
                       res.allocation.total_bits)
    loaded = load(info.path, _Encoder())
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batches[0]), res.model(**batches[0]), rtol=0, atol=0)


def test_attention_left_as_is_lists_its_projections():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, add_zero_attn=True, batch_first=True)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.attn(x, x, x)[0].mean(1))

    model = Model().eval()
    res = rtn_quantize(model, Granularity.CHANNEL, 4.0, QuantConfig())
    assert set(res.weights) == {"head"}
    assert set(res.unquantized) == {"attn.in_proj_weight", "attn.out_proj.weight"}
    assert all("add_zero_attn" in why for why in res.unquantized.values())


class _Tied(nn.Module):
    """Two Linear layers sharing one weight, and an embedding tied to the output layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)
        self.b.weight = self.a.weight
        self.emb = nn.Embedding(10, 64)
        self.out = nn.Linear(64, 10)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids).mean(1)
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


def test_tied_weights_encoded_once_kept_tied_and_exported_once(tmp_path):
    model = _Tied().eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 10, (8, 5), generator=g) for _ in range(3)]
    for res in (quantize_model(model, batches, BayesQConfig(budget=3.0), progress=False),
                rtn_quantize(model, Granularity.CHANNEL, 3.0, QuantConfig())):
        assert set(res.weights) == {"a", "out"}  # b and emb hold those weights
        assert res.unquantized == {}
        assert res.allocation.n_weights == 2 * 64 * 64 - 64 * 64 + 10 * 64  # each shared matrix counted once
        q = res.model
        assert q.b.weight is q.a.weight and q.emb.weight is q.out.weight
        torch.testing.assert_close(q.a.weight, res.weights["a"].dequantize().float(), rtol=0, atol=0)
        info = save_export(tmp_path / "t.safetensors", q, res.weights, QuantConfig(), res.allocation.total_bits)
        loaded = load(info.path, _Tied())
        assert loaded.b.words is loaded.a.words  # one packed encoding runs both
        torch.testing.assert_close(loaded.emb.weight, q.emb.weight, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(loaded(batches[0]), q(batches[0]), rtol=0, atol=1e-6)
    assert tied_layers(model, {"a": model.a, "out": model.out}) == {"b": "a", "emb": "out"}


def test_tied_layer_statistics_sum_over_both_uses():
    model = _Tied().double().eval()
    x = torch.randint(0, 10, (8, 5))
    stats = input_stats(model, [x])
    with torch.no_grad():
        h_a = model.emb(x).mean(1)
        h_b = torch.relu(model.a(h_a))
    want = (h_a.T @ h_a + h_b.T @ h_b) / 8
    torch.testing.assert_close(stats["a"].H[0], want, rtol=1e-12, atol=1e-12)


def test_make_canonical_is_idempotent():
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(3, 2))
    make_canonical(model)
    first = model[0]
    make_canonical(model)
    assert model[0] is first and isinstance(first, Conv1dAs2d)


def test_quantize_model_conv1d_quantised_and_export_round_trip(tmp_path):
    class Audio(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.c1 = nn.Conv1d(4, 32, 5, padding=2, padding_mode="reflect")
            self.c2 = nn.Conv1d(32, 32, 3, padding="same", groups=4, dilation=2)
            self.head = nn.Linear(32, 3)

        def forward(self, x):
            return self.head(self.c2(torch.relu(self.c1(x))).mean(-1))

    model = Audio().eval()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 4, 24, generator=g) for _ in range(3)]
    res = quantize_model(model, batches, BayesQConfig(budget=4.0), progress=False)
    assert set(res.weights) == {"c1.conv", "c2.conv", "head"} and res.unquantized == {}
    assert type(model.c1) is nn.Conv1d
    info = save_export(tmp_path / "a.safetensors", res.model, res.weights, BayesQConfig().quant,
                       res.allocation.total_bits)
    loaded = load(info.path, Audio())
    with torch.no_grad():
        torch.testing.assert_close(loaded(batches[0]), res.model(batches[0]), rtol=0, atol=0)


def test_canonical_transformer_decoder_self_and_cross_attention_vs_original():
    torch.manual_seed(0)
    dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 2, 32, batch_first=True), 2).double().eval()
    g = torch.Generator().manual_seed(1)
    tgt, memory = torch.randn(3, 5, 16, dtype=D, generator=g), torch.randn(3, 7, 16, dtype=D, generator=g)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=D)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, -3:] = True
    kw = dict(tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
    with torch.no_grad():
        want = dec(tgt, memory, **kw)
        with canonical(dec):
            assert isinstance(dec.layers[0].multihead_attn, SplitAttention)
            got = dec(tgt, memory, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_quantize_model_leaves_hooks_dtype_device_mode_and_grads_of_the_users_model():
    model = _Encoder().train()
    calls = []
    handle = model.enc.layers[0].self_attn.register_forward_hook(lambda m, i, o: calls.append(1))
    model.head.weight.grad = torch.ones_like(model.head.weight)
    model.emb.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    quantize_model(model, [_ids(g) for _ in range(2)], BayesQConfig(budget=4.0), progress=False)
    assert model.training and all(m.training for m in model.modules())
    assert torch.equal(model.head.weight.grad, torch.ones_like(model.head.weight))
    assert not model.emb.weight.requires_grad and model.head.weight.requires_grad
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype and v.device == before[k].device
               for k, v in model.state_dict().items())
    calls.clear()
    model.eval()(**_ids(g))
    assert calls == [1]  # the user's hook is still on the attention, and fires once
    handle.remove()
