"""bayesq.onnx_export: packing against a bit loop, the file's MatMulNBits tensors against the
encoding bit for bit, ONNX Runtime's outputs against float64 references and against BayesQ's own
quantised model, the layouts the format cannot hold, and a run with only onnxruntime and numpy."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from bayesq.blocks import LayerBlocks  # noqa: E402
from bayesq.onnx_export import (  # noqa: E402
    OnnxExportError, export_onnx, pack_bits, run_onnx, segments, unsupported,
)
from nets import random_quantized  # noqa: E402


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Python loop: value i of a row sits at bits [bits * (i % per), ...) of byte i // per."""
    per = 8 // bits
    out = np.zeros((*packed.shape[:-1], count), dtype=np.int64)
    for idx in np.ndindex(*packed.shape[:-1]):
        for i in range(count):
            out[idx + (i,)] = (int(packed[idx + (i // per,)]) >> (bits * (i % per))) & (2**bits - 1)
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_bits_vs_python_loop(bits):
    rng = np.random.default_rng(bits)
    v = rng.integers(0, 2**bits, (3, 16)).astype(np.uint8)
    packed = pack_bits(v, bits)
    assert packed.shape == (3, 16 * bits // 8) and packed.dtype == np.uint8
    assert np.array_equal(_unpack(packed, bits, 16), v)


def _channel_weight(shape=(6, 200), seed=0, bit_choices=(2, 4, 8)):
    """A random encoding with one width per row (row-aligned groups of 64, the last of each row 8)."""
    lb = LayerBlocks("w", shape, 64, 1, True)
    return random_quantized(shape, 64, unit_groups=lb.groups_per_row, bit_choices=bit_choices, row_aligned=True,
                            seed=seed)


def _linear(qw, bias=True):
    lin = nn.Linear(qw.shape[1], qw.shape[0], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(qw.dequantize())
        if bias:
            lin.bias.copy_(torch.linspace(-1, 1, qw.shape[0]))
    return lin


def test_segments_hold_the_encoding_bit_for_bit():
    qw = _channel_weight()
    segs = segments(qw)
    assert sorted(s.bits for s in segs) == sorted(qw.books) and len(segs) >= 2
    per_row = qw.blocks.groups_per_row
    rows_bits = qw.group_bits.reshape(qw.shape[0], per_row)[:, 0]
    for s in segs:
        assert np.array_equal(s.rows, torch.nonzero(rows_bits == s.bits).squeeze(1).numpy())
        book = qw.books[s.bits]
        codes = _unpack(s.codes, s.bits, qw.blocks.group_size)  # (N_b, blocks, block)
        want = qw.indices(torch.nonzero(qw.group_bits == s.bits).squeeze(1)).reshape(codes.shape).numpy()
        assert np.array_equal(codes, want)
        assert np.array_equal(s.scales.astype(np.float64), book.scale.numpy())  # fp16-valued: exact in float32
        zeros = _unpack(s.zeros.reshape(len(s.rows), -1), s.bits, per_row)
        assert np.array_equal(zeros.reshape(-1), book.zero.numpy().astype(np.int64))


@pytest.mark.parametrize("accuracy_level, tol", [(1, 1e-6), (4, 2e-2)])
def test_export_linear_vs_float64_reference(tmp_path, accuracy_level, tol):
    """One layer with rows at 2, 4 and 8 bits (K = 200: the last block of each row padded) and a
    bias: ONNX Runtime's output against x W^T + b in float64 (level 4 quantises the activations)."""
    qw = _channel_weight()
    model = nn.Sequential(_linear(qw)).eval()
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(3))
    ex = export_onnx(model, {"0": qw}, x, tmp_path / "m.onnx", accuracy_level=accuracy_level)
    assert ex.quantized == {"0": tuple(sorted(qw.books))} and not ex.kept
    y = run_onnx(ex.path, x)
    ref = (x.double() @ qw.dequantize().T + model[0].bias.detach().double()).numpy()
    assert np.abs(y - ref).max() <= tol * np.abs(ref).max()
    y3 = run_onnx(ex.path, x[:3])  # the batch axis is dynamic
    assert y3.shape == (3, 6)


def test_default_level_quantises_activations_and_a_level_one_run_of_the_file_is_exact(tmp_path):
    """export_onnx writes accuracy level 4 unless told (int8 activations: close to the float64
    reference, not equal); OnnxModel(..., accuracy_level=1) runs the same file in float32, equal
    to float rounding."""
    qw = _channel_weight()
    model = nn.Sequential(_linear(qw)).eval()
    x = torch.randn(5, 200, generator=torch.Generator().manual_seed(3))
    ex = export_onnx(model, {"0": qw}, x, tmp_path / "m.onnx")
    ref = (x.double() @ qw.dequantize().T + model[0].bias.detach().double()).numpy()
    scale = np.abs(ref).max()
    assert ex.accuracy_level == 4
    assert 1e-6 * scale < np.abs(run_onnx(ex.path, x) - ref).max() <= 2e-2 * scale
    assert np.abs(run_onnx(ex.path, x, accuracy_level=1) - ref).max() <= 1e-6 * scale


def test_file_bits_of_a_split_layer_vs_the_target_row_cost(tmp_path):
    """The bits a file stores for a layer split by width (codes, scales, zero-points, row index)
    are the sum of bayesq.targets' per-row costs, to the bit."""
    from bayesq.targets import matmulnbits_unit_cost_bits

    qw = _channel_weight(shape=(9, 200), seed=4)
    ex = export_onnx(nn.Sequential(_linear(qw)).eval(), {"0": qw}, torch.randn(2, 200), tmp_path / "m.onnx")
    per_row = qw.blocks.groups_per_row
    row_bits = qw.group_bits.reshape(9, per_row)[:, 0].tolist()
    assert len(set(row_bits)) > 1
    assert ex.quantized_bits == sum(matmulnbits_unit_cost_bits(per_row, b, 64, 3) for b in row_bits)


def test_unsupported_layouts_name_their_reason():
    assert "uniform grids" in unsupported(random_quantized((4, 64), 64, lut_bits=(2, 4), bit_choices=(2, 4), seed=1))
    assert "widths [3]" in unsupported(_channel_weight(bit_choices=(3, 4)))
    assert "group size 48" in unsupported(random_quantized((4, 96), 48, unit_groups=2, bit_choices=(4,),
                                                           row_aligned=True))
    assert "straddle rows" in unsupported(random_quantized((4, 100), 64, bit_choices=(4,)))
    assert "change within a row" in unsupported(random_quantized((4, 128), 64, bit_choices=(2, 4), seed=2,
                                                                 row_aligned=True))
    assert "convolution" in unsupported(random_quantized((4, 2, 3, 3), 16, bit_choices=(4,)))
    qw = _channel_weight(shape=(4, 64))
    assert "split input channels" in unsupported(replace(qw, split=torch.tensor([0])))
    assert "grouped layer" in unsupported(replace(qw, col_scale=torch.ones(2, 64, dtype=torch.float64)))
    assert unsupported(replace(qw, col_scale=torch.ones(1, 64, dtype=torch.float64))) == ""
    with pytest.raises(OnnxExportError, match="w: a convolution"):
        segments(random_quantized((4, 2, 3, 3), 16, bit_choices=(4,)))


class _ConvThenLinear(nn.Module):
    def __init__(self, qw):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.fc = _linear(qw)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


def test_a_layer_the_format_cannot_hold_stays_in_floating_point_with_its_reason(tmp_path):
    qw = _channel_weight(shape=(3, 64))
    conv_qw = random_quantized((4, 2, 3, 3), 16, bit_choices=(4,))
    model = _ConvThenLinear(qw).eval()
    with torch.no_grad():
        model.conv.weight.copy_(conv_qw.dequantize())
    x = torch.randn(2, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    ex = export_onnx(model, {"conv": conv_qw, "fc": qw}, x, tmp_path / "m.onnx", accuracy_level=1)
    assert set(ex.quantized) == {"fc"} and "convolution" in ex.kept["conv"]
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(ex.path)).metadata_props}
    assert "convolution" in meta["bayesq.kept"] and "fc" in meta["bayesq.quantized"]
    want = model(x).detach().numpy()
    assert np.abs(run_onnx(ex.path, x) - want).max() <= 1e-6 * np.abs(want).max()


def test_bad_accuracy_level_and_a_failing_export_write_nothing(tmp_path):
    qw = _channel_weight(shape=(3, 64))
    model = nn.Sequential(_linear(qw)).eval()
    with pytest.raises(OnnxExportError, match="accuracy_level = 7"):
        export_onnx(model, {"0": qw}, torch.randn(2, 64), tmp_path / "a.onnx", accuracy_level=7)

    class Bad(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # control flow on a value: torch.export refuses it

    with pytest.raises(OnnxExportError, match="could not export Bad"):
        export_onnx(Bad(), {}, torch.randn(2, 3), tmp_path / "b.onnx", accuracy_level=1)
    assert not list(tmp_path.iterdir())


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=40, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
        max_position_embeddings=32, num_labels=3)).eval()


def _text_batches(n, b=8, t=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        mask = torch.ones(b, t, dtype=torch.long)
        mask[0, t - 3:] = 0
        out.append({"input_ids": torch.randint(0, 40, (b, t), generator=g), "attention_mask": mask})
    return out


def test_bayesq_bert_in_onnx_runtime_vs_its_own_quantised_model(tmp_path):
    """BayesQ at 3.5 bits inside the onnxruntime target with quant.unit: channel (one width per
    row from {2, 4, 8}, blocks of 128, float32 scales): every quantised layer is MatMulNBits in the file, rows of several widths
    split and put back in order; the allocation counted exactly what the file stores plus a row
    index for the rows of layers that came out at one width; and ONNX Runtime's logits on other
    inputs (another batch size and length, with padding) match BayesQ's quantised model to float32
    rounding."""
    import onnx

    from bayesq import BayesQConfig, QuantConfig, quantize_model

    model = _tiny_bert()
    from bayesq.config import AllocationUnit

    quant = QuantConfig(unit=AllocationUnit.CHANNEL).for_target("onnxruntime")
    res = quantize_model(model, _text_batches(3), BayesQConfig(budget=3.5, quant=quant, progress=False))
    ex = export_onnx(res.model, res.weights, _text_batches(1)[0], tmp_path / "bert.onnx", accuracy_level=1)
    assert set(ex.quantized) == set(res.weights) and not ex.kept
    assert any(len(w) > 1 for w in ex.quantized.values())  # some layer split by width
    unsplit_rows = sum(qw.shape[0] for k, qw in res.weights.items() if len(ex.quantized[k]) == 1)
    assert res.allocation.total_bits - ex.quantized_bits == 32 * unsplit_rows
    assert res.average_bits <= 3.5
    ops = [n.op_type for n in onnx.load(str(ex.path)).graph.node]
    assert ops.count("MatMulNBits") == sum(len(w) for w in ex.quantized.values())
    test = _text_batches(1, b=5, t=13, seed=9)[0]
    got = run_onnx(ex.path, test)
    want = res.model(**test).logits.detach().numpy()
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_one_width_per_layer_has_one_node_per_layer_and_costs_what_the_file_stores(tmp_path):
    """quant.unit: tensor under the onnxruntime target (its default): each layer at one width from {2, 4, 8} in
    row-aligned blocks (K = 200 is not a multiple of the block), one MatMulNBits node per layer
    and no Gather; the allocation's bits are the file's, to the bit."""
    import onnx

    from bayesq import BayesQConfig, QuantConfig, quantize_model
    from bayesq.config import AllocationUnit

    model = _tiny_bert()
    quant = QuantConfig().for_target("onnxruntime", block=64)
    assert quant.unit == AllocationUnit.TENSOR
    res = quantize_model(model, _text_batches(3), BayesQConfig(budget=3.5, quant=quant, progress=False))
    ex = export_onnx(res.model, res.weights, _text_batches(1)[0], tmp_path / "bert.onnx", accuracy_level=1)
    assert all(len(w) == 1 for w in ex.quantized.values()) and len({w for w in ex.quantized.values()}) > 1
    assert res.allocation.total_bits == ex.quantized_bits and res.average_bits <= 3.5
    nodes = onnx.load(str(ex.path)).graph.node
    outs = {o for n in nodes if n.op_type == "MatMulNBits" for o in n.output}
    assert sum(n.op_type == "MatMulNBits" for n in nodes) == len(res.weights)
    assert not [n.name for n in nodes if n.op_type in ("Concat", "Gather") and set(n.input) & outs]
    test = _text_batches(1, b=5, t=13, seed=9)[0]
    want = res.model(**test).logits.detach().numpy()
    assert np.abs(run_onnx(ex.path, test) - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_awq_scales_become_a_div_on_the_input_and_cost_what_the_file_stores(tmp_path):
    """AWQ under the onnxruntime target: every layer MatMulNBits, each scaled layer's input divided
    by its float16 scales first (one Div per scaled layer), the allocation's bits (scales
    included) the file's to the bit, and ONNX Runtime's logits those of AWQ's quantised model."""
    import onnx

    from bayesq.baselines.awq import AWQConfig
    from bayesq.config import QuantConfig
    from bayesq.methods import Inputs, quantize_with

    model = _tiny_bert()
    res = quantize_with(model, AWQConfig(QuantConfig().for_target("onnxruntime", block=64), select=False), 3.5,
                        Inputs(calibration=_text_batches(3))).result
    scaled = [k for k, qw in res.weights.items() if qw.col_scale is not None]
    assert scaled
    ex = export_onnx(res.model, res.weights, _text_batches(1)[0], tmp_path / "awq.onnx", accuracy_level=1)
    assert set(ex.quantized) == set(res.weights) and not ex.kept
    assert res.allocation.total_bits == ex.quantized_bits
    nodes = onnx.load(str(ex.path)).graph.node
    assert sum(n.op_type == "Div" and n.name.endswith("_in_scale_Div") for n in nodes) == len(scaled)
    test = _text_batches(1, b=5, t=13, seed=9)[0]
    want = res.model(**test).logits.detach().numpy()
    assert np.abs(run_onnx(ex.path, test) - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_the_file_runs_with_only_onnxruntime_and_numpy(tmp_path):
    qw = _channel_weight(shape=(3, 64))
    model = nn.Sequential(_linear(qw)).eval()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    ex = export_onnx(model, {"0": qw}, x, tmp_path / "m.onnx", accuracy_level=1)
    np.save(tmp_path / "x.npy", x.numpy())
    code = ("import sys, numpy as np, onnxruntime as ort\n"
            f"s = ort.InferenceSession({str(ex.path)!r}, providers=['CPUExecutionProvider'])\n"
            f"y = s.run(None, {{s.get_inputs()[0].name: np.load({str(tmp_path / 'x.npy')!r})}})[0]\n"
            f"np.save({str(tmp_path / 'y.npy')!r}, y)\n"
            "assert 'torch' not in sys.modules and 'bayesq' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    assert np.abs(np.load(tmp_path / "y.npy") - model(x).detach().numpy()).max() < 1e-5


@pytest.mark.parametrize("vocab", [40, 100])
def test_gpt2_conv1d_layers_and_the_tied_head_become_matmulnbits(tmp_path, vocab):
    """A causal LM from a config (Hugging Face Conv1D projections, a head tied to the token
    embedding): every quantised layer is MatMulNBits in the file, the head too, whether the
    exporter folded its transpose into a new initializer (vocabulary 40) or reads it through a
    Transpose of the embedding table (100), which then stays for the embedding's Gather; the
    per-token logits match BayesQ's model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from bayesq import BayesQConfig, QuantConfig, quantize_model

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=128, n_layer=2, n_head=2,
                                       use_cache=False, bos_token_id=0, eos_token_id=0)).eval()
    batches = _text_batches(2, b=4, t=12)
    res = quantize_model(model, batches, BayesQConfig(budget=3.5, quant=QuantConfig().for_target("onnxruntime"),
                                                      progress=False))
    ex = export_onnx(res.model, res.weights, batches[0], tmp_path / "gpt2.onnx", accuracy_level=1)
    assert set(ex.quantized) == set(res.weights) and "lm_head" in res.weights and not ex.kept
    test = _text_batches(1, b=3, t=9, seed=5)[0]
    want = res.model(**test).logits.detach().numpy()
    assert np.abs(run_onnx(ex.path, test) - want).max() <= 1e-5 * np.abs(want).max()


def test_latencies_time_every_file_on_every_input_with_one_live_session(tmp_path, monkeypatch):
    import bayesq.onnx_export as ox

    qw = _channel_weight(shape=(3, 64))
    model = nn.Sequential(_linear(qw)).eval()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    files = {k: export_onnx(model, {"0": qw}, x, tmp_path / f"{k}.onnx", accuracy_level=lv).path
             for k, lv in (("a", 1), ("b", 4))}
    live, most = [0], [0]

    class Counted(ox.OnnxModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            live[0] += 1
            most[0] = max(most[0], live[0])

        def __del__(self):
            live[0] -= 1

    monkeypatch.setattr(ox, "OnnxModel", Counted)
    ms = ox.latencies(files, {1: x[:1], 2: x}, threads=1, repeats=2, rounds=2)
    assert set(ms) == {"a", "b"} and all(set(v) == {1, 2} and min(v.values()) > 0 for v in ms.values())
    assert most[0] == 1 and live[0] == 0
