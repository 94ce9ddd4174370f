"""Checks inputs, picks the backend and launches: Triton on CUDA tensors (or on CPU under
``TRITON_INTERPRET=1`` when asked for explicitly), else the PyTorch reference.

Conv2d: dequantise-then-conv. The Triton ``dequant_kernel`` writes the dense weight and cuDNN
runs the convolution. An im2col GEMM would materialise ``kh*kw`` copies of every activation
and lose cuDNN's Winograd / implicit-GEMM paths, while a conv weight (at most a few MB here)
is dequantised in microseconds; so the packed format saves memory and disk for convolutions,
and the fused decode-in-matmul kernels serve Linear layers, where weight reads dominate.
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional as F

from bayesq.kernels import reference
from bayesq.kernels.packed import PackedWeight, aligned, unit_shape

GEMV_MAX_ROWS = 8  # batch rows up to which a GEMV kernel (no tl.dot) is used
SPLIT_MIN_PROGRAMS = 1024  # fewer row programs than this: the units GEMV splits K (4 ways)


def units_tile(bits: int, m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_U, BLOCK_N, warps, K slices) of the units GEMVs for ``m`` input rows of a (n, k)
    weight. At batch 1 (``gemv_units_row_kernel``): 256 codes per step, 128 rows (3 bits) or 64,
    split 4 ways when there are fewer than :data:`SPLIT_MIN_PROGRAMS` row programs: the fastest
    transposed-codes tiles of the H200 sweeps (reports/kernels.md). More rows
    (``gemv_units_kernel``) divide the units per step by the rows' power of two (the best of
    the two tried at 4 rows); its three-dimensional tiles spilled registers (20-40x slower) at
    4,096 weights per program in the third sweep."""
    cpu, _ = unit_shape(bits)
    block_n = 128 if bits == 3 and m == 1 else 64
    block_u = max(1, 256 // cpu // max(1, 1 << (m - 1).bit_length()))
    units = k // cpu
    split = 4 if _cdiv(n, block_n) < SPLIT_MIN_PROGRAMS and units >= 4 * block_u else 1
    return block_u, block_n, 4, split


def triton_available() -> bool:
    """Triton importable (it is part of the CUDA torch builds)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device, pw: PackedWeight) -> str:
    """``auto`` -> ``triton`` on CUDA for packed weights, else ``torch``; ``triton`` is checked."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and pw.mode != "dense" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package (pip install triton)")
        if pw.mode == "dense":  # on any device
            raise ValueError("this weight is held dense (VQ codebook or per-row-group column scales): "
                             "use backend='torch'")
        if device.type != "cuda" and not _interpret():
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the first "
                             "launch; or use backend='auto' (PyTorch reference on CPU)")
    return backend


def _check(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None) -> None:
    if not x.is_floating_point():
        raise TypeError(f"input must be floating point, got {x.dtype}")
    if x.shape[-1] != pw.k:
        raise ValueError(f"input has {x.shape[-1]} features, the weight expects {pw.k}")
    if x.device != pw.device:
        raise ValueError(f"input on {x.device} but the packed weight on {pw.device}: move one of them")
    if bias is not None and (bias.shape != (pw.n,) or bias.device != x.device):
        raise ValueError(f"bias must be ({pw.n},) on {x.device}, got {tuple(bias.shape)} on {bias.device}")


def _args(pw: PackedWeight):
    """Kernel pointers; unused ones (an empty LUT) point at a non-empty buffer of any type."""
    return (pw.words, pw.goff if pw.goff.numel() else pw.words, pw.gbits, pw.scale, pw.zero,
            pw.lut if pw.lut.numel() else pw.words, pw.lutoff if pw.lutoff.numel() else pw.words)


def _units_gemv(x2: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, tile=None) -> torch.Tensor:
    """(M, N) ``x2 W^T (+ bias)`` for x2 (M <= 8, K) by ``gemv_units_row_kernel`` (M = 1) or
    ``gemv_units_kernel`` (``pw`` in the units layout); ``tile`` (BLOCK_U, BLOCK_N, warps, K slices) overrides :func:`units_tile`
    (benchmarks/kernels.py's sweep)."""
    from bayesq.kernels import triton_dequant as tk

    m = x2.shape[0]
    bu, bn, warps, split = tile or units_tile(pw.uniform_bits, m, pw.n, pw.k)
    out = torch.zeros(m, pw.n, dtype=torch.float32, device=x2.device) if split > 1 else \
        torch.empty(m, pw.n, dtype=x2.dtype, device=x2.device)
    bias_arg = bias if bias is not None else pw.words
    col = pw.col_scale if pw.col_scale is not None else pw.words
    if m == 1:
        tk.gemv_units_row_kernel[(_cdiv(pw.n, bn), split)](
            x2, out, bias_arg, col, pw.words, pw.scale, pw.zero, pw.n, pw.k, B=pw.uniform_bits, GS=pw.group_size,
            HAS_BIAS=bias is not None, HAS_COL=pw.col_scale is not None, BLOCK_U=bu, BLOCK_N=bn, SPLIT_K=split,
            num_warps=warps)
        return out.to(x2.dtype)
    tk.gemv_units_kernel[(_cdiv(pw.n, bn), split)](
        x2, out, bias_arg, col, pw.words, pw.scale, pw.zero, m, pw.n, pw.k, x2.stride(0), out.stride(0),
        B=pw.uniform_bits, GS=pw.group_size,
        HAS_BIAS=bias is not None, HAS_COL=pw.col_scale is not None, BLOCK_M=max(1, 1 << (m - 1).bit_length()),
        BLOCK_U=bu, BLOCK_N=bn, SPLIT_K=split, num_warps=warps)
    return out.to(x2.dtype)


def _block_n(n: int) -> int:
    """Output rows per GEMV program: the widest of 64 / 32 / 16 that still gives >= 256 programs
    (two waves on a 132-SM H100), so small layers are not served by a few SMs."""
    for bn in (64, 32):
        if _cdiv(n, bn) >= 256:
            return bn
    return 16


def dequant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                   backend: str = "auto", weight: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x W^T + bias``: x (..., K) float16/bfloat16/float32 -> (..., N) in x's dtype.

    Triton: up to ``GEMV_MAX_ROWS`` rows by a GEMV kernel (the units GEMV for the ``units``
    layout, the word-aligned one where :func:`aligned`, else the general one); more rows dequantise the weight once
    into x's dtype (a transient (N, K) tensor) and run ``F.linear`` (cuBLAS: tensor cores, TF32 as PyTorch allows). The tiled Triton
    GEMM with the decode inside ``tl.dot`` tiles measured 20-100x slower than cuBLAS on an H200
    (reports/kernels.md). ``weight``: a cached dequantised weight for the reference path.
    """
    _check(x, pw, bias)
    if resolve_backend(backend, x.device, pw) == "torch":
        return reference.linear(x, pw, bias, weight)
    from bayesq.kernels import triton_dequant as tk

    x2 = x.reshape(-1, pw.k).contiguous()  # (M, K)
    m = x2.shape[0]
    if m > GEMV_MAX_ROWS:  # dequantise once (2-D grid over the weight), then the dense matmul library
        return F.linear(x, dequantize(pw, x.dtype, backend), None if bias is None else bias.to(x.dtype))
    if m == 0:
        return torch.empty(*x.shape[:-1], pw.n, dtype=x.dtype, device=x.device)
    if pw.layout == "units":  # its own output buffer (float32 when K is split)
        return _units_gemv(x2, pw, bias).reshape(*x.shape[:-1], pw.n)
    out = torch.empty(m, pw.n, dtype=x.dtype, device=x.device)
    col = pw.col_scale if pw.col_scale is not None else pw.words
    b = bias if bias is not None else pw.words
    common = dict(ROW_ALIGNED=bool(pw.groups_per_row), LUT=pw.mode == "lut", UNIFORM_B=pw.uniform_bits,
                  HAS_BIAS=bias is not None, HAS_COL=pw.col_scale is not None)
    if aligned(pw):
        n = pw.n
        tk.gemv_aligned_kernel[lambda meta: (_cdiv(n, meta["BLOCK_N"]),)](
            x2, out, b, col, pw.words, pw.scale, pw.zero, m, pw.n, pw.k, x2.stride(0), out.stride(0),
            B=pw.uniform_bits, GS=pw.group_size, HAS_BIAS=bias is not None, HAS_COL=pw.col_scale is not None,
            BLOCK_M=max(1, 1 << (m - 1).bit_length()))
    else:
        bn = _block_n(pw.n)
        tk.gemv_kernel[(_cdiv(pw.n, bn),)](x2, out, b, col, *_args(pw), m, pw.n, pw.k, pw.group_size,
                                           pw.groups_per_row, x2.stride(0), out.stride(0), **common,
                                           BLOCK_M=max(1, 1 << (m - 1).bit_length()), BLOCK_N=bn, BLOCK_K=64)
    return out.reshape(*x.shape[:-1], pw.n)


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32, backend: str = "auto") -> torch.Tensor:
    """(N, K) dense weight in ``dtype`` (Triton ``dequant_kernel`` or the reference). The units
    layout decodes into a (K, N) buffer (rows contiguous, as it stores them) and returns its
    transposed view: ``F.linear`` takes it as it is, and ``reshape`` copies where needed."""
    if resolve_backend(backend, pw.device, pw) == "torch":
        w = reference.dequantize(pw)
        return w.to(dtype)
    from bayesq.kernels import triton_dequant as tk

    if pw.layout == "units":
        out_t = torch.empty(pw.k, pw.n, dtype=dtype, device=pw.device)
        bu, bn = 8, 64
        grid = (_cdiv(pw.n, bn), _cdiv(pw.k // unit_shape(pw.uniform_bits)[0], bu))
        tk.dequant_units_kernel[grid](out_t, pw.words, pw.scale, pw.zero, pw.n, pw.k, B=pw.uniform_bits,
                                      GS=pw.group_size, BLOCK_U=bu, BLOCK_N=bn)
        out = out_t.T
        return out if pw.col_scale is None else (out.float() / pw.col_scale[None, :]).to(dtype)
    out = torch.empty(pw.n, pw.k, dtype=dtype, device=pw.device)
    grid = (_cdiv(pw.n, 32), _cdiv(pw.k, 64))
    tk.dequant_kernel[grid](out, *_args(pw), pw.n, pw.k, pw.group_size, pw.groups_per_row,
                            ROW_ALIGNED=bool(pw.groups_per_row), LUT=pw.mode == "lut", UNIFORM_B=pw.uniform_bits,
                            BLOCK_N=32, BLOCK_K=64)
    if pw.col_scale is not None:
        out = (out.float() / pw.col_scale[None, :]).to(dtype)
    return out
