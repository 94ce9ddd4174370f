"""Export format: exact accounting of the file, round
trips (codes, codebooks, logits) for every codebook and layout, and clear errors on bad files."""

import functools
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bayesq.config import BayesQConfig, Codebook, Granularity, QuantConfig
from bayesq.export import ExportError, FORMAT, load, read_export, save_export
from bayesq.qlayers import QuantConv2d, QuantLinear
from bayesq.quantize import quantize_model


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, groups=2), nn.Flatten(),
                         nn.Linear(6 * 6 * 6, 37), nn.ReLU(), nn.Linear(37, 5)).eval()


def _x(n=24):
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(1))


@functools.lru_cache(maxsize=None)
def _quantized(codebook="uniform", budget=5.5, **quant):
    """BayesQ on the small net (cached: deterministic; callers do not modify the result)."""
    cfg = BayesQConfig()
    rounding = "error-feedback" if codebook in ("uniform", "uniform-fixed", "lloyd-uniform") else "nearest"
    q = replace(cfg.quant, codebook=Codebook(codebook), group_size=16, unit_groups=2, **{"rounding": rounding, **quant})
    cfg = replace(cfg, budget=budget, quant=q, distill=replace(cfg.distill, max_budget=0.0),
                  posterior=replace(cfg.posterior, probes=4))
    x = _x()
    return quantize_model(_net(), [x[:12], x[12:]], cfg, progress=False), q


def _check_round_trip(res, quant, path, skeleton=None):
    info = save_export(path, res.model, res.weights, quant, res.allocation.total_bits)
    assert info.file_bytes == path.stat().st_size == info.payload_bits // 8 + info.fp_bytes + info.header_bytes
    n_streams = 3 * len(res.weights)  # codes, headers, zero-points: each rounded up to whole bytes
    assert res.allocation.total_bits <= info.payload_bits < res.allocation.total_bits + 8 * n_streams
    back = read_export(path)
    for name, qw in res.weights.items():
        assert torch.equal(back.weights[name].dequantize(), qw.dequantize()), name
        assert torch.equal(back.weights[name].group_bits, qw.group_bits)
    model = load(path, skeleton=skeleton or _net())
    x = _x(7)
    with torch.no_grad():
        assert torch.equal(model(x), res.model(x))
    return info, model


@pytest.mark.parametrize("codebook", ["uniform", "lloyd", "mulaw", "lloyd-uniform"])
def test_export_round_trip_codebooks(tmp_path, codebook):
    res, quant = _quantized(codebook)
    _, model = _check_round_trip(res, quant, tmp_path / "m.safetensors")
    assert isinstance(model[0], QuantConv2d) and isinstance(model[4], QuantLinear)


def test_load_channels_last_vs_contiguous(tmp_path):
    # channels_last decodes each convolution's weight once into NHWC order: the same outputs up
    # to the convolution's summation order, and the decoded weight is kept in that format
    res, quant = _quantized("uniform")
    path = tmp_path / "m.safetensors"
    save_export(path, res.model, res.weights, quant, res.allocation.total_bits)
    plain, last = load(path, skeleton=_net()), load(path, skeleton=_net(), memory_format=torch.channels_last)
    x = _x(7)
    with torch.no_grad():
        want, got = plain(x), last(x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert last[0].conv.weight.is_contiguous(memory_format=torch.channels_last) and not last[0].conv.weight.is_contiguous()
    assert plain[0].conv.weight.is_contiguous()


def test_export_round_trip_vq(tmp_path):
    res, quant = _quantized("vq", budget=6.0, unit="tensor", vq_dim=2, bits=(2, 3, 4))
    _check_round_trip(res, quant, tmp_path / "vq.safetensors")


@pytest.mark.parametrize("unit", ["channel", "group"])
def test_export_round_trip_units(tmp_path, unit):
    res, quant = _quantized(budget=4.5, unit=unit)
    _check_round_trip(res, quant, tmp_path / f"{unit}.safetensors")


def test_export_round_trip_fp32_scales_and_one_bit_width(tmp_path):
    res, quant = _quantized(budget=6.5, bits=(4,), scale_bits=32)
    info, _ = _check_round_trip(res, quant, tmp_path / "fp32.safetensors")
    from safetensors import safe_open

    with safe_open(info.path, "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("4/scale").dtype == torch.float32
    assert "4/codes" in keys and not any(k.endswith("/header") for k in keys)  # one choice: no header stream


def test_export_round_trip_baselines(tmp_path):
    """RTN per-channel and AWQ (stored column scales) from the same format."""
    from bayesq.baselines.activations import input_stats
    from bayesq.baselines.awq import awq_quantize
    from bayesq.baselines.rtn import rtn_quantize
    from bayesq.blocks import quantizable_layers

    q = QuantConfig(group_size=16, unit_groups=2)
    net = _net()
    rtn = rtn_quantize(net, Granularity.CHANNEL, 4.5, q)
    _check_round_trip(rtn, q, tmp_path / "rtn.safetensors")
    stats = input_stats(net, [_x()], quantizable_layers(net))
    awq = awq_quantize(net, stats, 4.5, q)
    assert any(w.col_scale is not None for w in awq.weights.values())
    _check_round_trip(awq, q, tmp_path / "awq.safetensors")


def test_export_distilled_model_keeps_trained_biases(tmp_path):
    cfg = BayesQConfig()
    q = replace(cfg.quant, group_size=32, unit_groups=2)
    cfg = replace(cfg, budget=3.0, quant=q, distill=replace(cfg.distill, steps=5, train_bias=True, accept=False))  # kept whatever its KL
    x = _x()
    res = quantize_model(_net(), [x[:12], x[12:]], cfg, progress=False)
    assert not torch.equal(res.model[6].bias, _net()[6].bias)  # distillation trained it
    _check_round_trip(res, q, tmp_path / "d.safetensors")


def test_export_wrong_quant_config_is_clear(tmp_path):
    res, quant = _quantized()
    with pytest.raises(ValueError, match="outside quant.bits"):
        save_export(tmp_path / "x.safetensors", res.model, res.weights, replace(quant, bits=(2, 3)),
                    res.allocation.total_bits)
    with pytest.raises(ValueError, match="accounts"):
        save_export(tmp_path / "x.safetensors", res.model, res.weights, replace(quant, scale_bits=32),
                    res.allocation.total_bits)
    assert not (tmp_path / "x.safetensors").exists()


@pytest.fixture
def written(tmp_path):
    res, quant = _quantized()
    path = tmp_path / "m.safetensors"
    save_export(path, res.model, res.weights, quant, res.allocation.total_bits, metadata={"method": "bayesq"})
    return path


def test_read_export_metadata(written):
    c = read_export(written)
    assert c.metadata["format"] == FORMAT and c.user == {"method": "bayesq"}
    assert set(c.weights) == {"0", "2", "4", "6"} and "0.bias" in c.fp_state


def test_read_export_truncated_is_clear(written):
    data = written.read_bytes()
    written.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match="truncated or corrupted"):
        read_export(written)


def test_read_export_corrupted_byte_is_clear(written):
    data = bytearray(written.read_bytes())
    data[-20] ^= 0xFF  # a byte of the tensor data
    written.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="content hash mismatch"):
        read_export(written)


def _rewrite_metadata(path, **changes):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**meta, **changes})


def test_read_export_other_version_is_clear(written):
    _rewrite_metadata(written, format_version="99")
    with pytest.raises(ExportError, match="format version 99; this BayesQ reads version 1"):
        read_export(written)


def test_read_export_not_bayesq_and_missing_are_clear(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ExportError, match="not a BayesQ export"):
        read_export(path)
    with pytest.raises(FileNotFoundError, match="no export at"):
        read_export(tmp_path / "absent.safetensors")


def test_read_export_layout_edited_is_clear(written):
    from safetensors import safe_open

    from bayesq.export import content_hash

    with safe_open(str(written), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    layers = json.loads(meta["layers"])
    layers["4"]["group_size"] = 8  # more groups than the stored streams hold
    lj = json.dumps(layers, sort_keys=True)
    save_file(tensors, str(written), metadata={**meta, "layers": lj, "content_sha256": content_hash(tensors, lj)})
    with pytest.raises(ExportError, match="layer '4'"):
        read_export(written)


def test_load_wrong_skeleton_is_clear(written):
    with pytest.raises(ExportError, match="does not match the module"):
        load(written, skeleton=nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(ExportError, match="names no architecture"):
        load(written)


EMBEDDED = ["lite0-fmnist", "resnet18-fmnist", "minilm-sentiment"]


def _embedded_export(name, tmp_path):
    """(RTN per-group 3-bit result, export info, loaded export, input batches) of an embedded
    architecture with seeded random weights (a mix of widths)."""
    from bayesq.baselines.rtn import rtn_quantize
    from bayesq.harness.models.config import DataConfig
    from bayesq.harness.models.zoo import get_entry

    entry = get_entry(name)
    torch.manual_seed(0)
    model = entry.build(pretrained=False).eval()
    q = QuantConfig()
    res = rtn_quantize(model, Granularity.GROUP, 3.0, q)
    path = tmp_path / f"{name}.safetensors"
    info = save_export(path, res.model, res.weights, q, res.allocation.total_bits, architecture=name)
    if entry.task == "image":
        x = [torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))]
    else:
        x = entry.batches(["a fine film", "dull and long"], 2, DataConfig())
    return res, info, load(path), x  # rebuilt from the architecture named in the file


@pytest.mark.parametrize("name", EMBEDDED)
def test_export_embedded_models_round_trip(tmp_path, name, one_thread):
    """Every layer type of the embedded architectures (depthwise convs, BERT linears) packs and
    loads back to identical logits (RTN per-group at 3 bits: a mix of widths)."""
    from bayesq.evaluation import predict

    res, info, loaded, x = _embedded_export(name, tmp_path)
    assert info.payload_bits - res.allocation.total_bits < 8 * 3 * len(res.weights)
    assert torch.equal(predict(loaded, x), predict(res.model, x))
    assert math.isclose(info.payload_avg_bits, res.average_bits, rel_tol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", EMBEDDED)
def test_export_embedded_models_on_cuda_vs_cpu(tmp_path, name, monkeypatch):
    """A loaded export moved to the GPU (Triton GEMV / GEMM for Linear, dequantise + cuDNN for
    Conv2d) gives the CPU reference's logits in float32 (TF32 off), and close ones in float16."""
    from bayesq.evaluation import predict
    from bayesq.forward import logits

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    _, _, loaded, x = _embedded_export(name, tmp_path)
    cpu = predict(loaded, x)
    gpu_model = loaded.cuda()
    def on_gpu(b, dtype):  # token ids as they are, images in the model's dtype
        return {k: v.cuda() for k, v in b.items()} if isinstance(b, dict) else b.to("cuda", dtype)

    with torch.inference_mode():
        out = torch.cat([logits(gpu_model, on_gpu(b, torch.float32)).float().cpu() for b in x])
        torch.testing.assert_close(out, cpu, rtol=1e-4, atol=1e-4)
        half = gpu_model.half()
        out16 = torch.cat([logits(half, on_gpu(b, torch.float16)).float().cpu() for b in x])
    assert (out16 - cpu).abs().max() <= 0.05 * cpu.abs().max()


def test_save_export_all_avg_bits_vs_result(tmp_path):
    from safetensors import safe_open

    from bayesq.baselines.rtn import rtn_quantize
    from nets import AttentionModel

    model = AttentionModel().eval()
    res = rtn_quantize(model, Granularity.GROUP, 4.0, QuantConfig(group_size=16), exclude=["attn"])
    assert set(res.unquantized) == {"emb.weight", "attn.in_proj_weight", "attn.out_proj.weight"}
    path = tmp_path / "m.safetensors"
    info = save_export(path, res.model, res.weights, QuantConfig(group_size=16), res.allocation.total_bits)
    kept = [model.emb.weight, model.attn.in_proj_weight, model.attn.out_proj.weight]
    assert info.fp_matrix_weights == sum(p.numel() for p in kept)
    assert info.fp_matrix_bits == 32 * info.fp_matrix_weights
    n_all = info.n_weights + info.fp_matrix_weights
    assert info.all_avg_bits == pytest.approx((info.payload_bits + info.fp_matrix_bits) / n_all, rel=1e-12)
    # the file's payload exceeds the accounted bits by the byte rounding of its packed streams only
    assert abs(info.all_avg_bits - res.average_bits_all) <= 8 * 3 * len(res.weights) / n_all
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    assert float(meta["avg_bits_all"]) == pytest.approx(res.average_bits_all, abs=1e-6)
    assert float(meta["avg_bits"]) == pytest.approx(res.average_bits, abs=1e-6)
    assert res.average_bits <= 4.0 < 20 < res.average_bits_all


_QUANTIZE_SCRIPT = """
import sys
import torch
from torch import nn
from bayesq.config import BayesQConfig, DistillConfig
from bayesq.export import save_export
from bayesq.quantize import quantize_model

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
g = torch.Generator().manual_seed(1)
cal = [torch.randn(32, 16, generator=g) for _ in range(4)]
cfg = BayesQConfig(budget=3.0, seed=17, distill=DistillConfig(max_budget=3.5))  # distillation on
res = quantize_model(model, cal, cfg, progress=False)
save_export(sys.argv[1], res.model, res.weights, cfg.quant, res.allocation.total_bits,
            metadata={"seed": "17", "method": "bayesq-distill", "budget": "3.0"})
"""


def test_export_same_seed_byte_identical_across_processes(tmp_path):
    """Posterior, table, allocation, distillation and export run twice in fresh processes (each with
    its own hash seed): the two files are byte for byte the same."""
    import subprocess
    import sys

    from bayesq.tensorfile import file_sha256

    paths = [tmp_path / f"run{i}.safetensors" for i in range(2)]
    for i, p in enumerate(paths):
        subprocess.run([sys.executable, "-c", _QUANTIZE_SCRIPT, str(p)], check=True, cwd=Path(__file__).parent.parent,
                       env={**os.environ, "PYTHONHASHSEED": str(i + 1), "OMP_NUM_THREADS": "1"})
    assert file_sha256(paths[0]) == file_sha256(paths[1])
    assert read_export(paths[0]).user["seed"] == "17"
