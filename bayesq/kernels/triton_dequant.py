"""Triton kernels: decode packed codes (any 1..8-bit mix per group) inside the matmul.

``_decode`` turns a (BLOCK_N, BLOCK_K) tile of (output, input) indices into weights with the
layout of ``packed.py``: group ``g`` and position ``p`` of each element, its stream bit
``goff[g] + p * gbits[g]``, the two 32-bit words that hold it, the code
``(w0 | w1 << 32) >> (bit mod 32) & (2**b - 1)``, then ``scale * (code - zero)`` or
``lut[lutoff[g] + code]``. With ``UNIFORM_B`` (one width, full groups) the bit is
``flat index * b`` and, for b dividing 32, one word load suffices.

* ``gemv_kernel``: up to 8 batch rows per program, each weight tile decoded once; reduction
  in registers (no ``tl.dot``: M < 16).
* ``gemv_aligned_kernel``: the same for one width in {2, 3, 4, 8} with rows on word
  boundaries: contiguous word loads unpacked by shifts, scale applied per group.
* ``dequant_kernel``: writes the dense weight (Conv2d runs cuDNN on it, and Linear layers with
  more than 8 input rows cuBLAS: see ``launcher.py``).
* ``gemv_units_row_kernel`` (one input row), ``gemv_units_kernel`` (2-8 rows) and
  ``dequant_units_kernel``: the same for weights in the ``units`` layout (``packed.py``: one width, codes stored with the rows contiguous), decoding a unit of
  32 codes with compile-time shifts.

All accumulate in float32. Run on CPU with ``TRITON_INTERPRET=1`` (set before the first launch).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# word-aligned GEMV tiles tried once per (N, K, batch rows) on a GPU (triton.autotune; the
# interpreter runs the first alone)
ALIGNED_TILES = [(32, 256, 4), (16, 256, 4), (16, 512, 4), (32, 128, 4), (64, 128, 4), (16, 128, 4),
                 (32, 512, 8), (64, 256, 8)]  # BLOCK_N, BLOCK_K, warps
# the first tile alone under the interpreter, or with BAYESQ_AUTOTUNE=0 (correctness runs on a GPU)
_ONE = os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get("BAYESQ_AUTOTUNE", "1") == "0"
_TILES = ALIGNED_TILES[:1] if _ONE else ALIGNED_TILES


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
def _x_tile(x_ptr, col_ptr, rm, cols, kmask, M, stride_xm, HAS_COL: tl.constexpr):
    """(BLOCK_M, BLOCK_K) float32 input rows ``rm`` at ``cols`` (0 outside), divided by AWQ's
    column scale when ``HAS_COL``."""
    x = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :], mask=(rm[:, None] < M) & kmask[None, :],
                other=0.0).to(tl.float32)
    if HAS_COL:
        x = x / tl.load(col_ptr + cols, mask=kmask, other=1.0)[None, :]
    return x


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
        x = _x_tile(x_ptr, col_ptr, rm, cols, kmask, M, stride_xm, HAS_COL)  # (BLOCK_M, BLOCK_K)
        mask = (rows[:, None] < N) & kmask[None, :]
        w = _decode(words_ptr, goff_ptr, gbits_ptr, scale_ptr, zero_ptr, lut_ptr, lutoff_ptr,
                    rows, cols, mask, K, GS, GPR, ROW_ALIGNED, LUT, UNIFORM_B)  # (BLOCK_N, BLOCK_K)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
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


@triton.autotune([triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in _TILES],
                 key=["N", "K", "BLOCK_M"])
@triton.jit
def gemv_aligned_kernel(x_ptr, out_ptr, bias_ptr, col_ptr, words_ptr, scale_ptr, zero_ptr, M, N, K,
                        stride_xm, stride_om, B: tl.constexpr, GS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    """GEMV for one bit-width ``B`` in {2, 3, 4, 8}, affine codes, full groups of ``GS`` (a power
    of two dividing ``BLOCK_K``), ``K % 32 == 0`` and ``K % GS == 0``: each row starts on a word and
    every 32 codes are ``B`` whole words. A tile's words are loaded as one contiguous block and
    unpacked with shifts (no per-element address arithmetic); ``c - z`` is formed exactly in
    float32 as ``float(2**23 + c) - (2**23 + z)`` (one OR, one subtraction) and the scale is
    applied once per group and row:

        y[m, n] = sum_g s[n, g] * sum_{k in g} x[m, k] * (c[n, k] - z[n, g])

    grid (cdiv(N, BLOCK_N),); float32 accumulation; BLOCK_N, BLOCK_K from :data:`ALIGNED_TILES`."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rm = tl.arange(0, BLOCK_M)
    NG: tl.constexpr = BLOCK_K // GS
    row_word = rows.to(tl.int64) * (K // 32 * B)  # (BLOCK_N,) first word of each row
    row_group = rows.to(tl.int64) * (K // GS)
    gi = tl.arange(0, NG)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        x = _x_tile(x_ptr, col_ptr, rm, cols, kmask, M, stride_xm, HAS_COL)  # (BLOCK_M, BLOCK_K)
        if 32 % B == 0:  # 32 // B codes per word
            PER: tl.constexpr = 32 // B
            wi = tl.arange(0, BLOCK_K // PER)
            wmask = rmask[:, None] & ((k0 + wi * PER) < K)[None, :]
            w = tl.load(words_ptr + row_word[:, None] + (k0 // PER) + wi[None, :], mask=wmask,
                        other=0).to(tl.uint32, bitcast=True)  # (BLOCK_N, BLOCK_K / PER)
            shifts = (tl.arange(0, PER) * B).to(tl.uint32)
            c = tl.reshape((w[:, :, None] >> shifts[None, None, :]) & ((1 << B) - 1), (BLOCK_N, BLOCK_K))
        else:  # B == 3: 32 codes in 3 words; codes 10 and 21 straddle two
            ch = tl.arange(0, BLOCK_K // 32)
            base = row_word[:, None] + (k0 // 32 * 3) + ch[None, :] * 3  # (BLOCK_N, BLOCK_K / 32)
            cmask = rmask[:, None] & ((k0 + ch * 32) < K)[None, :]
            w0 = tl.load(words_ptr + base, mask=cmask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)[:, :, None]
            w1 = tl.load(words_ptr + base + 1, mask=cmask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)[:, :, None]
            w2 = tl.load(words_ptr + base + 2, mask=cmask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)[:, :, None]
            bit = tl.arange(0, 32) * 3
            word = (bit >> 5)[None, None, :]
            lo = tl.where(word == 0, w0, tl.where(word == 1, w1, w2))
            hi = tl.where(word == 0, w1, w2)
            both = (lo | (hi << 32)) >> (bit & 31).to(tl.uint64)[None, None, :]
            c = tl.reshape((both & 7).to(tl.uint32), (BLOCK_N, BLOCK_K))
        g = row_group[:, None] + (k0 // GS) + gi[None, :]  # (BLOCK_N, NG)
        gmask = rmask[:, None] & ((k0 + gi * GS) < K)[None, :]
        s = tl.load(scale_ptr + g, mask=gmask, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + g, mask=gmask, other=0).to(tl.float32)
        magic = tl.reshape(c | 0x4B000000, (BLOCK_N, NG, GS)).to(tl.float32, bitcast=True)  # 2**23 + c
        wz = magic - (z + 8388608.0)[:, :, None]  # c - z, exact
        part = tl.sum(tl.reshape(x, (BLOCK_M, NG, GS))[:, None, :, :] * wz[None, :, :, :], axis=3)  # (BM, BN, NG)
        acc += tl.sum(part * s[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
    omask = (rm[:, None] < M) & rmask[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _field(w0, w1, w2, J: tl.constexpr, B: tl.constexpr):
    """Code ``J`` (0 <= J < 32) of a unit of 32 ``B``-bit codes held in ``B`` words, as uint32; the
    unit's words are ``w0`` (B in {2, 4, 8}: one word of 32 // B codes, w1 and w2 unused) or ``w0,
    w1, w2`` (B == 3: codes 10 and 21 straddle two words). Shifts and masks are compile-time."""
    BIT: tl.constexpr = J * B
    OFF: tl.constexpr = BIT % 32
    MASK: tl.constexpr = (1 << B) - 1
    if B != 3:
        c = (w0 >> OFF) & MASK
    elif BIT < 32:
        if OFF + B <= 32:
            c = (w0 >> OFF) & MASK
        else:
            c = ((w0 >> OFF) | (w1 << (32 - OFF))) & MASK
    elif BIT < 64:
        if OFF + B <= 32:
            c = (w1 >> OFF) & MASK
        else:
            c = ((w1 >> OFF) | (w2 << (32 - OFF))) & MASK
    else:
        c = (w2 >> OFF) & MASK
    return c


@triton.jit
def _unit_tile(words_ptr, scale_ptr, zero_ptr, u, rows, rmask, n_units, N, B: tl.constexpr, GS: tl.constexpr):
    """Units ``u`` (BLOCK_U,) of ``rows`` (BLOCK_N,) in the ``units`` layout: (umask, mask, w0, w1,
    w2, s, z), the words (BLOCK_U, BLOCK_N) uint32 (w1, w2 repeat w0 unless B == 3) and each
    unit's group scale and zero-point as float32 (0 where masked)."""
    CPU: tl.constexpr = 32 if B == 3 else 32 // B
    WPU: tl.constexpr = 3 if B == 3 else 1
    umask = u < n_units
    mask = umask[:, None] & rmask[None, :]
    wp = words_ptr + (u * WPU).to(tl.int64)[:, None] * N + rows[None, :]
    w0 = tl.load(wp, mask=mask, other=0).to(tl.uint32, bitcast=True)
    w1 = w0
    w2 = w0
    if B == 3:
        w1 = tl.load(wp + N, mask=mask, other=0).to(tl.uint32, bitcast=True)
        w2 = tl.load(wp + 2 * N, mask=mask, other=0).to(tl.uint32, bitcast=True)
    gp = (u * CPU // GS).to(tl.int64)[:, None] * N + rows[None, :]
    s = tl.load(scale_ptr + gp, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + gp, mask=mask, other=0).to(tl.float32)
    return umask, mask, w0, w1, w2, s, z


@triton.jit
def gemv_units_row_kernel(x_ptr, out_ptr, bias_ptr, col_ptr, words_ptr, scale_ptr, zero_ptr, N, K,
                          B: tl.constexpr, GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_COL: tl.constexpr,
                          BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K):
    """:func:`gemv_units_kernel` for one input row (x (1, K) contiguous) with two-dimensional
    (units, rows) tiles: the three-dimensional tiles with a batch axis of 1 ran 1.7-2.2x slower
    on an H200 (reports/kernels.md). Same equation, grid and split-K contract."""
    CPU: tl.constexpr = 32 if B == 3 else 32 // B  # codes per unit
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    n_units = K // CPU
    span = tl.cdiv(tl.cdiv(n_units, SPLIT_K), BLOCK_U) * BLOCK_U
    u_lo = tl.program_id(1) * span
    acc = tl.zeros((BLOCK_U, BLOCK_N), dtype=tl.float32)
    for u0 in range(u_lo, tl.minimum(u_lo + span, n_units), BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        umask, mask, w0, w1, w2, s, z = _unit_tile(words_ptr, scale_ptr, zero_ptr, u, rows, rmask, n_units, N, B, GS)
        zz = z + 8388608.0  # 2**23 + z
        part = tl.zeros((BLOCK_U, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(CPU):
            xj = tl.load(x_ptr + u * CPU + j, mask=umask, other=0.0).to(tl.float32)
            if HAS_COL:
                xj = xj / tl.load(col_ptr + u * CPU + j, mask=umask, other=1.0)
            magic = (_field(w0, w1, w2, j, B) | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + c
            part += (magic - zz) * xj[:, None]
        acc += part * s
    y = tl.sum(acc, axis=0)
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)
    else:
        if HAS_BIAS:
            first = (tl.program_id(1) == 0).to(tl.float32)
            y += first * tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.atomic_add(out_ptr + rows, y, mask=rmask)


@triton.jit
def gemv_units_kernel(x_ptr, out_ptr, bias_ptr, col_ptr, words_ptr, scale_ptr, zero_ptr, M, N, K,
                      stride_xm, stride_om, B: tl.constexpr, GS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_COL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_U: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT_K):
    """GEMV for M <= BLOCK_M input rows on the ``units`` layout (``packed.py``): one width ``B`` in
    {2, 3, 4, 8}, affine codes, groups of ``GS`` (a multiple of 32) dividing K. A tile is (units,
    rows) with the rows contiguous; code ``j`` of every unit is one shift and mask of its words
    (``j`` unrolled, shifts known at compile time), ``c - z`` is exact in float32 as
    ``float(2**23 + c) - (2**23 + z)``, decoded once for all M input rows, and meets input column
    ``u * CPU + j`` (CPU codes per unit):

        y[m, n] = sum_u s[g(u), n] * sum_j x[m, u * CPU + j] * (c[n, u * CPU + j] - z[g(u), n])

    grid (cdiv(N, BLOCK_N), SPLIT_K): program (i, s) sums unit slice s of rows i; with
    ``SPLIT_K > 1`` the slices add atomically into a zeroed float32 ``out`` (the bias from slice
    0), else ``out`` is written in its own dtype. float32 accumulation."""
    CPU: tl.constexpr = 32 if B == 3 else 32 // B  # codes per unit
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    rm = tl.arange(0, BLOCK_M)
    n_units = K // CPU
    span = tl.cdiv(tl.cdiv(n_units, SPLIT_K), BLOCK_U) * BLOCK_U
    u_lo = tl.program_id(1) * span
    acc = tl.zeros((BLOCK_M, BLOCK_U, BLOCK_N), dtype=tl.float32)
    for u0 in range(u_lo, tl.minimum(u_lo + span, n_units), BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        umask, mask, w0, w1, w2, s, z = _unit_tile(words_ptr, scale_ptr, zero_ptr, u, rows, rmask, n_units, N, B, GS)
        zz = z + 8388608.0  # 2**23 + z
        xmask = (rm[:, None] < M) & umask[None, :]
        part = tl.zeros((BLOCK_M, BLOCK_U, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(CPU):
            col = u * CPU + j
            xj = tl.load(x_ptr + rm[:, None] * stride_xm + col[None, :], mask=xmask, other=0.0).to(tl.float32)
            if HAS_COL:
                xj = xj / tl.load(col_ptr + col, mask=umask, other=1.0)[None, :]
            magic = (_field(w0, w1, w2, j, B) | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + c
            part += (magic - zz)[None, :, :] * xj[:, :, None]
        acc += part * s[None, :, :]
    y = tl.sum(acc, axis=1)  # (BLOCK_M, BLOCK_N)
    omask = (rm[:, None] < M) & rmask[None, :]
    optr = out_ptr + rm[:, None] * stride_om + rows[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
        tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        if HAS_BIAS:
            first = (tl.program_id(1) == 0).to(tl.float32)
            y += first * tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
        tl.atomic_add(optr, y, mask=omask)


@triton.jit
def dequant_units_kernel(out_ptr, words_ptr, scale_ptr, zero_ptr, N, K, B: tl.constexpr, GS: tl.constexpr,
                         BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr):
    """W transposed from the ``units`` layout: out[k, n] = s[g, n] * (c[n, k] - z[g, n]), out
    (K, N) (each store a row of contiguous outputs); grid (cdiv(N, BLOCK_N), cdiv(K / CPU, BLOCK_U))."""
    CPU: tl.constexpr = 32 if B == 3 else 32 // B
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    u = tl.program_id(1) * BLOCK_U + tl.arange(0, BLOCK_U)
    _, mask, w0, w1, w2, s, z = _unit_tile(words_ptr, scale_ptr, zero_ptr, u, rows, rows < N, K // CPU, N, B, GS)
    for j in tl.static_range(CPU):
        w = (_field(w0, w1, w2, j, B).to(tl.float32) - z) * s  # (c - z) exact, one rounding
        tl.store(out_ptr + (u * CPU + j).to(tl.int64)[:, None] * N + rows[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=mask)
