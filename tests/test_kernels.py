"""Kernels vs the PyTorch reference and the reference vs ``QuantizedWeight.dequantize``: exact
unpacking, fp32 matmul within tolerance, across bit-widths, group sizes, layouts and odd shapes.

The ``test_triton_*`` tests run the compiled kernels on a CUDA GPU when there is one, else
Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in conftest); ``test_cuda_*`` need a GPU.
"""

import pytest
import torch

from bayesq.kernels import dequant_linear, dequantize, pack_weight
from bayesq.kernels import reference
from bayesq.kernels.launcher import GEMV_MAX_ROWS
from tests.nets import random_quantized

CASES = [  # shape, group size, unit groups, bit choices, row-aligned, LUT widths
    ((16, 64), 64, 1, (4,), False, ()),
    ((24, 96), 32, 2, (3,), False, ()),
    ((37, 50), 16, 3, (2, 3, 4, 8), False, ()),  # groups straddle rows, mixed widths
    ((5, 300), 128, 1, (2, 8), False, ()),
    ((33, 70), 32, 3, (2, 3, 4, 8), True, ()),  # row-aligned: last group of each row is short
    ((20, 40), 16, 1, (2, 3, 4, 8), False, (2, 3, 4)),  # LUT groups mixed with uniform 8-bit ones
    ((9, 27), 8, 2, (3, 4), True, (3, 4)),
]
IDS = ["4bit", "3bit", "mixed-straddle", "2-8bit-tall", "row-aligned", "lut-mixed", "lut-row-aligned"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton, or its interpreter
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _codes_matrix(qw):
    """(N, K) codes of a QuantizedWeight through the layer layout (independent of the packer)."""
    return qw.blocks.from_groups(qw.codes).reshape(qw.blocks.shape[0], -1)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_unpack_codes_vs_layout(case):
    shape, gs, ug, bits, aligned, lut = case
    qw = random_quantized(shape, gs, ug, bits, aligned, lut, seed=1)
    pw = pack_weight(qw)
    assert torch.equal(reference.unpack_codes(pw), _codes_matrix(qw))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_dequantize_vs_quantized_weight(case):
    shape, gs, ug, bits, aligned, lut = case
    qw = random_quantized(shape, gs, ug, bits, aligned, lut, seed=2)
    w = reference.dequantize(pack_weight(qw))
    assert w.dtype == torch.float32
    assert torch.equal(w, qw.dequantize().reshape(shape[0], -1).float())  # bit for bit


def test_pack_weight_stream_is_dense():
    """3-bit codes take 3 bits each: 24 x 96 weights -> 864 bytes of code words (+1 slack word)."""
    pw = pack_weight(random_quantized((24, 96), 32, 1, (3,)))
    assert pw.words.numel() == 24 * 96 * 3 // 32 + 1


def test_pack_weight_uniform_fast_path_only_for_full_single_width_groups():
    assert pack_weight(random_quantized((16, 64), 64, 1, (4,))).uniform_bits == 4
    assert pack_weight(random_quantized((24, 96), 32, 1, (3,))).uniform_bits == 3
    assert pack_weight(random_quantized((5, 300), 128, 1, (4,))).uniform_bits == 0  # short last group
    assert pack_weight(random_quantized((37, 64), 16, 1, (2, 8))).uniform_bits == 0  # mixed widths


def test_quant_linear_half_keeps_packed_types():
    """``.half()`` casts the bias, not the fp16 scales / fp32 tables the kernels decode with."""
    from bayesq.qlayers import QuantLinear

    qw = random_quantized((20, 40), 16, 1, (2, 3, 4, 8), lut_bits=(3,), seed=13)
    layer = QuantLinear(pack_weight(qw), torch.randn(20)).half()
    assert layer.lut.dtype == torch.float32 and layer.scale.dtype == torch.float16 and layer.bias.dtype == torch.float16
    x = torch.randn(3, 40)
    torch.testing.assert_close(layer(x.half()).float(), x.half().float() @ qw.dequantize().float().T + layer.bias.float(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_dequant_vs_reference(case):
    shape, gs, ug, bits, aligned, lut = case
    pw = pack_weight(random_quantized(shape, gs, ug, bits, aligned, lut, seed=3))
    assert torch.equal(dequantize(pw.to(DEVICE), torch.float32, "triton").cpu(), reference.dequantize(pw))


@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_gemv_vs_reference(case, rows):
    shape, gs, ug, bits, aligned, lut = case
    pw = pack_weight(random_quantized(shape, gs, ug, bits, aligned, lut, seed=4))
    g = torch.Generator().manual_seed(5)
    x, bias = torch.randn(rows, shape[1], generator=g), torch.randn(shape[0], generator=g)
    y = dequant_linear(x.to(DEVICE), pw.to(DEVICE), bias.to(DEVICE), "triton").cpu()
    ref = x.double() @ reference.dequantize(pw).double().T + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_many_rows_vs_reference(case):
    """More than 8 rows: the Triton dequantise kernel, then F.linear."""
    shape, gs, ug, bits, aligned, lut = case
    pw = pack_weight(random_quantized(shape, gs, ug, bits, aligned, lut, seed=6))
    x = torch.randn(2, 19, shape[1], generator=torch.Generator().manual_seed(7))  # 38 rows
    y = dequant_linear(x.to(DEVICE), pw.to(DEVICE), None, "triton").cpu()
    assert y.shape == (2, 19, shape[0])
    ref = x.double() @ reference.dequantize(pw).double().T
    # a float32 matmul: error relative to the output's scale (8-bit groups give terms up to ~25)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))


def test_triton_column_scale_vs_reference():
    """AWQ's single-row column scale: the kernel divides the input, the reference the weight."""
    from dataclasses import replace

    qw = random_quantized((12, 40), 16, 1, (3, 4), seed=8)
    s = torch.rand(1, 40, generator=torch.Generator().manual_seed(9), dtype=torch.float64).add(0.5).half().double()
    pw = pack_weight(replace(qw, col_scale=s))
    assert pw.mode == "affine" and pw.col_scale is not None
    assert torch.equal(reference.dequantize(pw), replace(qw, col_scale=s).dequantize().float())
    x = torch.randn(20, 40, generator=torch.Generator().manual_seed(10))
    ref = x.double() @ reference.dequantize(pw).double().T
    for rows in (x[:2], x):
        y = dequant_linear(rows.to(DEVICE), pw.to(DEVICE), None, "triton").cpu()
        torch.testing.assert_close(y.double(), ref[: len(rows)], rtol=1e-5, atol=1e-5)


def test_aligned_gemv_applies_to_one_word_aligned_width():
    """The word-aligned GEMV serves the 4-bit and 3-bit cases above in the stream layout; short
    groups, mixed widths and tables go to the general one."""
    from bayesq.kernels.launcher import aligned

    assert [aligned(pack_weight(random_quantized(*c[:6], seed=3), "stream")) for c in CASES] == [
        True, True, False, False, False, False, False]
    assert aligned(pack_weight(random_quantized((8, 256), 64, 1, (2,))))
    assert aligned(pack_weight(random_quantized((8, 256), 64, 1, (8,))))
    assert not aligned(pack_weight(random_quantized((8, 80), 16, 1, (4,))))  # K % 32 != 0


def test_pack_weight_units_layout_where_unit_aligned():
    """``auto`` stores one-width weights with groups of a multiple of 32 in the units layout (the
    4-bit and 3-bit cases above, groups of 96 too); groups of 16, mixed widths and tables stay a stream."""
    assert [pack_weight(random_quantized(*c[:6], seed=3)).layout for c in CASES] == [
        "units", "units"] + ["stream"] * 5
    assert pack_weight(random_quantized((8, 192), 96, 1, (4,))).layout == "units"
    assert pack_weight(random_quantized((8, 256), 16, 1, (4,))).layout == "stream"
    with pytest.raises(ValueError, match="layout must be auto or stream"):
        pack_weight(random_quantized((8, 256), 16, 1, (4,)), "rows")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_to_units_vs_stream_layout(bits):
    """Word i of unit u of row n sits at (u * WPU + i) * N + n, scale / zero of group column c at
    c * N + n (hand-indexed from the stream), and to_stream inverts to_units exactly."""
    from bayesq.kernels.packed import to_stream, to_units, unit_shape

    n, k, gs = 5, 192, 64
    stream = pack_weight(random_quantized((n, k), gs, 1, (bits,), seed=bits), "stream")
    units = to_units(stream)
    cpu, wpu = unit_shape(bits)
    per_row = k * bits // 32
    assert units.layout == "units" and units.words.numel() == stream.words.numel()
    for row in range(n):
        for u in range(k // cpu):
            for i in range(wpu):
                assert units.words[(u * wpu + i) * n + row] == stream.words[row * per_row + u * wpu + i]
        for c in range(k // gs):
            assert units.scale[c * n + row] == stream.scale[row * (k // gs) + c]
            assert units.zero[c * n + row] == stream.zero[row * (k // gs) + c]
    back = to_stream(units)
    assert back.layout == "stream"
    for name in ("words", "scale", "zero"):
        assert torch.equal(getattr(back, name), getattr(stream, name))
    assert torch.equal(reference.dequantize(units), reference.dequantize(stream))


def test_quant_linear_keeps_layout_and_width():
    """The module rebuilds the PackedWeight it was given (width and layout too), so the GPU path
    takes the units kernels for a loaded export."""
    from bayesq.qlayers import QuantLinear

    pw = pack_weight(random_quantized((16, 64), 64, 1, (4,), seed=2))
    back = QuantLinear(pw, None).packed()
    assert (back.uniform_bits, back.layout) == (4, "units")


@pytest.mark.parametrize("col", [False, True], ids=["plain", "column-scale"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_triton_units_gemv_vs_reference(bits, col):
    """The units GEMVs at 1 (row kernel), 2 and 5 input rows, at tiles the launcher may pick and
    others (K split 1-3 ways with atomic sums, a partial last tile, groups of 32, 64 and 96, rows
    past the tile), with a bias and optionally AWQ's column scale."""
    from dataclasses import replace

    from bayesq.kernels.launcher import _units_gemv

    for (n, k, gs), tile in (((20, 320, 64), (4, 16, 4, 1)), ((37, 1024, 32), (2, 32, 4, 3)),
                             ((20, 384, 96), (2, 16, 4, 2)), ((70, 256, 64), None)):
        qw = random_quantized((n, k), gs, 1, (bits,), seed=bits)
        s = torch.rand(1, k, generator=torch.Generator().manual_seed(9), dtype=torch.float64).add(0.5).half().double()
        g = torch.Generator().manual_seed(n)
        x, bias = torch.randn(5, k, generator=g), torch.randn(n, generator=g)
        pw = pack_weight(replace(qw, col_scale=s) if col else qw)
        assert pw.layout == "units"
        ref = x.double() @ reference.dequantize(pw).double().T + bias.double()
        for m in (1, 2, 5):
            y = _units_gemv(x[:m].to(DEVICE), pw.to(DEVICE), bias.to(DEVICE), tile).cpu().double()
            assert (y - ref[:m]).abs().max() <= 1e-6 * ref.abs().max(), (tile, m)  # float32 sums
        y = dequant_linear(x[:1].to(DEVICE), pw.to(DEVICE), None, "triton").cpu().double()  # the launcher's tile
        assert (y - (ref[:1] - bias.double())).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_triton_units_dequant_vs_reference(bits):
    """The units dequantise kernel equals the reference bit for bit (groups of 32 and 96, a
    partial last tile of rows and of units), with and without a column scale."""
    from dataclasses import replace

    for n, k, gs in ((70, 288, 32), (9, 384, 96)):
        qw = random_quantized((n, k), gs, 1, (bits,), seed=bits + 20)
        s = torch.rand(1, k, generator=torch.Generator().manual_seed(9), dtype=torch.float64).add(0.5).half().double()
        for pw in (pack_weight(qw), pack_weight(replace(qw, col_scale=s))):
            assert pw.layout == "units"
            assert torch.equal(dequantize(pw.to(DEVICE), torch.float32, "triton").cpu(), reference.dequantize(pw))


def test_launcher_auto_on_cpu_is_reference():
    pw = pack_weight(random_quantized((8, 32), 16, 1, (4,)))
    x = torch.randn(3, 32)
    assert torch.equal(dequant_linear(x, pw), reference.linear(x, pw))


def test_launcher_rejects_bad_inputs(monkeypatch):
    pw = pack_weight(random_quantized((8, 32), 16, 1, (4,)))
    with pytest.raises(ValueError, match="31 features, the weight expects 32"):
        dequant_linear(torch.randn(2, 31), pw)
    with pytest.raises(TypeError, match="floating point"):
        dequant_linear(torch.ones(2, 32, dtype=torch.int64), pw)
    with pytest.raises(ValueError, match=r"bias must be \(8,\)"):
        dequant_linear(torch.randn(2, 32), pw, torch.randn(7))
    with pytest.raises(ValueError, match="backend must be auto, triton or torch"):
        dequant_linear(torch.randn(2, 32), pw, backend="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        dequant_linear(torch.randn(2, 32), pw, backend="triton")


def test_launcher_dense_weight_needs_torch_backend():
    from dataclasses import replace

    qw = random_quantized((8, 32), 16, 1, (4,))
    pw = pack_weight(replace(qw, col_scale=torch.ones(2, 32, dtype=torch.float64)))  # two row groups
    assert pw.mode == "dense"
    with pytest.raises(ValueError, match="backend='torch'"):
        dequant_linear(torch.randn(2, 32), pw, backend="triton")
    x = torch.randn(2, 32)
    torch.testing.assert_close(dequant_linear(x, pw), x @ qw.dequantize().float().T)


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cuda_kernels_vs_reference(case):
    shape, gs, ug, bits, aligned, lut = case
    pw = pack_weight(random_quantized(shape, gs, ug, bits, aligned, lut, seed=11))
    ref = reference.dequantize(pw)
    gpu = pw.to("cuda")
    assert torch.equal(dequantize(gpu, torch.float32).cpu(), ref)
    for rows in (1, 40):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(12))
        y = dequant_linear(x.cuda().half(), gpu).float().cpu()
        torch.testing.assert_close(y, x.half().float() @ ref.T, rtol=2e-2, atol=2e-2)


@needs_cuda
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", [(3072, 768), (768, 3072), (1000, 4096)], ids=["3072x768", "768x3072", "1000x4096"])
def test_cuda_large_shapes_vs_reference(shape, bits):
    """The benchmark's layer shapes on many programs: every batch size the launcher routes
    differently (GEMV 1 / 8 rows, dequantise + F.linear 16 / 64 / 200 rows), fp16 / bf16 / fp32 inputs, uniform
    fast path (full 64-groups) against the float64 reference."""
    pw = pack_weight(random_quantized(shape, 64, 1, (bits,), seed=bits))
    assert pw.uniform_bits == bits
    w = reference.dequantize(pw).double()
    gpu = pw.to("cuda")
    assert torch.equal(dequantize(gpu, torch.float32).cpu(), w.float())
    for rows in (1, 8, 16, 64, 200):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows), dtype=torch.float64)
        for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
            xd = x.to(dtype)
            y = dequant_linear(xd.cuda(), gpu).cpu().double()
            ref = xd.double() @ w.to(dtype).double().T  # the weight as F.linear would see it in dtype
            scale = ref.abs().max()
            assert (y - ref).abs().max() <= tol * scale, (rows, dtype)


@needs_cuda
def test_cuda_quant_layers_follow_model_to_gpu():
    """A loaded export moved with ``.cuda()`` runs the Triton path and gives the CPU's logits;
    ``.half()`` keeps the packed buffers' types (the kernels read them)."""
    from bayesq.qlayers import QuantLinear

    qw = random_quantized((96, 160), 32, 1, (2, 3, 4, 8), lut_bits=(3,), seed=14)
    layer = QuantLinear(pack_weight(qw), torch.randn(96, generator=torch.Generator().manual_seed(15)))
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(16))
    ref = layer(x)
    gpu = layer.cuda()
    assert gpu.words.is_cuda and gpu.backend == "auto"
    # float32 sums in another order: the error is relative to the output's scale (up to ~180 here),
    # where one float32 ulp is ~1e-5
    torch.testing.assert_close(gpu(x.cuda()).cpu(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    half = gpu.half()
    assert half.scale.dtype == torch.float16 and half.lut.dtype == torch.float32
    torch.testing.assert_close(half(x.cuda().half()).float().cpu(), ref, rtol=2e-2, atol=2e-2)
