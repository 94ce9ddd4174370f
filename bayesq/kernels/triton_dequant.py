"""Triton kernels: decode packed codes (any 1..8-bit mix per group) inside the matmul.

``_decode`` turns a (BLOCK_N, BLOCK_K) tile of (output, input) indices into weights with the
layout of ``packed.py``: group ``g`` and position ``p`` of each element, its stream bit
``goff[g] + p * gbits[g]``, the two 32-bit words that hold it, the code
``(w0 | w1 << 32) >> (bit mod 32) & (2**b - 1)``, then ``scale * (code - zero)`` or
``lut[lutoff[g] + code]``. With ``UNIFORM_B`` (one width, full groups) the bit is
``flat index * b`` and, for b dividing 32, one word load suffices.

* ``gemv_kernel``: up to 8 batch rows per program, each weight tile decoded once; reduction
  in registers (no ``tl.dot``: M < 16).
* ``gemm_kernel``: tiles with ``tl.dot`` (M >= 16).
* ``dequant_kernel``: writes the dense weight (Conv2d runs cuDNN on it, see ``launcher.py``).

All accumulate in float32. Run on CPU with ``TRITON_INTERPRET=1`` (set before the first launch).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode(words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr, lut_ptr, lutoff_ptr,
            rows, cols, mask, K, GS, GPR, ROW_ALIGNED: tl.constexpr, LUT: tl.constexpr, UNIFORM_B: tl.constexpr):
    if ROW_ALIGNED:
        g = rows[:, None].to(tl.int64) * GPR + (cols[None, :] // GS)
        p = cols[None, :] % GS
    else:
        flat = rows[:, None].to(tl.int64) * K + cols[None, :]
        g = flat // GS
        p = flat % GS
    if UNIFORM_B > 0:  # every group full and UNIFORM_B bits wide: bit = flat index * b
        bit = (g * GS + p) * UNIFORM_B
        if 32 % UNIFORM_B == 0:  # a field never straddles two words
            w0 = tl.load(words_ptr + (bit >> 5), mask=mask, other=0).to(tl.uint32, bitcast=True)
            code = ((w0 >> (bit & 31).to(tl.uint32)) & ((1 << UNIFORM_B) - 1)).to(tl.int32)
        else:
            wi = bit >> 5
            w0 = tl.load(words_ptr + wi, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
            w1 = tl.load(words_ptr + wi + 1, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
            code = (((w0 | (w1 << 32)) >> (bit & 31).to(tl.uint64)) & ((1 << UNIFORM_B) - 1)).to(tl.int32)
    else:
        b = tl.load(gbits_ptr + g, mask=mask, other=1).to(tl.int64)
        bit = tl.load(goff_ptr + g, mask=mask, other=0).to(tl.int64) + p * b
        wi = bit >> 5
        w0 = tl.load(words_ptr + wi, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        w1 = tl.load(words_ptr + wi + 1, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        ones = tl.full(b.shape, 1, tl.uint64)
        code = (((w0 | (w1 << 32)) >> (bit & 31).to(tl.uint64)) & ((ones << b.to(tl.uint64)) - 1)).to(tl.int32)
    if LUT:
        start = tl.load(lutoff_ptr + g, mask=mask, other=0)
        w = tl.load(lut_ptr + start + code, mask=mask, other=0.0)
    else:
        s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + g, mask=mask, other=0).to(tl.float32)
        w = (code.to(tl.float32) - z) * s
    return tl.where(mask, w, 0.0)


@triton.jit
def gemv_kernel(x_ptr, out_ptr, bias_ptr, col_ptr, words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr,
                lut_ptr, lutoff_ptr, M, N, K, GS, GPR, stride_xm, stride_om,
                ROW_ALIGNED: tl.constexpr, LUT: tl.constexpr, UNIFORM_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] = sum_k W[n, k] x[m, k] (+ bias[n]) for all M <= BLOCK_M rows at once (each weight
    tile is decoded once); reduction in registers; grid (cdiv(N, BLOCK_N),)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :], mask=(rm[:, None] < M) & kmask[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_K)
        if HAS_COL:
            x = x / tl.load(col_ptr + cols, mask=kmask, other=1.0)[None, :]
        mask = (rows[:, None] < N) & kmask[None, :]
        w = _decode(words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr, lut_ptr, lutoff_ptr,
                    rows, cols, mask, K, GS, GPR, ROW_ALIGNED, LUT, UNIFORM_B)  # (BLOCK_N, BLOCK_K)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    omask = (rm[:, None] < M) & (rows[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def gemm_kernel(x_ptr, out_ptr, bias_ptr, col_ptr, words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr,
                lut_ptr, lutoff_ptr, M, N, K, GS, GPR, stride_xm, stride_om,
                ROW_ALIGNED: tl.constexpr, LUT: tl.constexpr, UNIFORM_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out = x W^T (+ bias) by (BLOCK_M, BLOCK_N) tiles; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :], mask=(rm[:, None] < M) & kmask[None, :],
                    other=0.0).to(tl.float32)
        if HAS_COL:
            x = x / tl.load(col_ptr + cols, mask=kmask, other=1.0)[None, :]
        mask = (rows[:, None] < N) & kmask[None, :]
        w = _decode(words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr, lut_ptr, lutoff_ptr,
                    rows, cols, mask, K, GS, GPR, ROW_ALIGNED, LUT, UNIFORM_B)
        acc += tl.dot(x.to(x_ptr.dtype.element_ty), tl.trans(w).to(x_ptr.dtype.element_ty))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    omask = (rm[:, None] < M) & (rows[None, :] < N)
    tl.store(out_ptr + rm[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def dequant_kernel(out_ptr, words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr, lut_ptr, lutoff_ptr,
                   N, K, GS, GPR, ROW_ALIGNED: tl.constexpr, LUT: tl.constexpr, UNIFORM_B: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = W[n, k]; grid (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = _decode(words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr, lut_ptr, lutoff_ptr,
                rows, cols, mask, K, GS, GPR, ROW_ALIGNED, LUT, UNIFORM_B)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)
