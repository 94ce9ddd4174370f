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
from bayesq.kernels.packed import PackedWeight

GEMV_MAX_ROWS = 8  # batch rows up to which the GEMV kernel (no tl.dot) is used
ALIGNED_MIN_K = 128  # fewest input columns per step of the word-aligned GEMV (its tiles: triton_dequant)
# batch-1 unit GEMV (triton_dequant.gemv_words_kernel): BLOCK_N, BLOCK_K, warps, K slices. The
# fastest tile at 3 and 4 bits on 4096^2, 16384^2 and 3072x768 in a sweep on an H200
# (reports/kernels.md); splitting K (atomic sums, two extra launches) was slower there.
WORDS_TILE = (8, 512, 4, 1)


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
        if device.type != "cuda" and not _interpret():
            raise ValueError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before the first "
                             "launch; or use backend='auto' (PyTorch reference on CPU)")
        if pw.mode == "dense":
            raise ValueError("this weight is held dense (VQ codebook or per-row-group column scales): "
                             "use backend='torch'")
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


def aligned(pw: PackedWeight) -> bool:
    """The word-aligned GEMV applies: one width in {2, 3, 4, 8}, affine, full power-of-two groups
    dividing both K and the tile, K a multiple of 32 (every row starts on a word)."""
    gs = pw.group_size
    return (pw.uniform_bits in (2, 3, 4, 8) and pw.mode == "affine" and pw.k % 32 == 0 and pw.k % gs == 0
            and gs & (gs - 1) == 0 and ALIGNED_MIN_K % gs == 0)


def unit_aligned(pw: PackedWeight) -> bool:
    """The batch-1 unit GEMV applies: :func:`aligned`, and groups of a multiple of 32 (a unit of
    32 codes never straddles two groups)."""
    return aligned(pw) and pw.group_size % 32 == 0


def _words_gemv(x2: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None, tile=None) -> torch.Tensor:
    """(1, N) ``x2 W^T (+ bias)`` by ``gemv_words_kernel``; ``tile`` (BLOCK_N, BLOCK_K, warps,
    K slices) overrides :data:`WORDS_TILE` (benchmarks/kernels.py's sweep)."""
    from bayesq.kernels import triton_dequant as tk

    bn, bk, warps, split = tile or WORDS_TILE
    out = torch.zeros(1, pw.n, dtype=torch.float32, device=x2.device) if split > 1 else \
        torch.empty(1, pw.n, dtype=x2.dtype, device=x2.device)
    tk.gemv_words_kernel[(_cdiv(pw.n, bn), split)](
        x2, out, bias if bias is not None else pw.words, pw.col_scale if pw.col_scale is not None else pw.words,
        pw.words, pw.scale, pw.zero, pw.n, pw.k, B=pw.uniform_bits, GS=pw.group_size, HAS_BIAS=bias is not None,
        HAS_COL=pw.col_scale is not None, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps)
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

    Triton: one row by the unit GEMV where :func:`unit_aligned`; up to ``GEMV_MAX_ROWS`` rows by a
    GEMV kernel (the word-aligned one where :func:`aligned`); more rows dequantise the weight once
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
    if m == 1 and unit_aligned(pw):  # its own output buffer (float32 when K is split)
        return _words_gemv(x2, pw, bias).reshape(*x.shape[:-1], pw.n)
    out = torch.empty(m, pw.n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], pw.n)
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
    """(N, K) dense weight in ``dtype`` (Triton ``dequant_kernel`` or the reference)."""
    if resolve_backend(backend, pw.device, pw) == "torch":
        w = reference.dequantize(pw)
        return w.to(dtype)
    from bayesq.kernels import triton_dequant as tk

    out = torch.empty(pw.n, pw.k, dtype=dtype, device=pw.device)
    grid = (_cdiv(pw.n, 32), _cdiv(pw.k, 64))
    tk.dequant_kernel[grid](out, *_args(pw), pw.n, pw.k, pw.group_size, pw.groups_per_row,
                            ROW_ALIGNED=bool(pw.groups_per_row), LUT=pw.mode == "lut", UNIFORM_B=pw.uniform_bits,
                            BLOCK_N=32, BLOCK_K=64)
    if pw.col_scale is not None:
        out = (out.float() / pw.col_scale[None, :]).to(dtype)
    return out
