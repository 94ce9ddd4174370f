"""Candidate batch-1 GEMV kernels for one bit-width, timed side by side with the library's
(``python benchmarks/kernels.py --sweep`` runs them on a GPU; not used by the library until one
wins there).

The first H200 run (reports/kernels.md) put the library's GEMVs at 2-9 % of the copy bandwidth.
These variants separate the suspects, one change each:

* ``gather``: the word-aligned decode without reshapes: every element loads the word holding its
  code (neighbours share it: one transaction per word) and its group's scale and zero, and
  forms ``(c - z) * s`` in two dimensions (no 4-D broadcast, no layout conversion).
* ``SPLIT_K > 1``: the K range cut over a second grid axis, partial sums added atomically into a
  float32 output (more programs for short, wide layers; the caller zeroes the output).
* ``loads_only``: the same loads summed without decoding: the bandwidth Triton reaches with this
  access pattern, the ceiling of any decode on top of it.

All index arithmetic is int32 within a row (a row's words fit easily), int64 only for the row
offset. Run them on CPU under ``TRITON_INTERPRET=1`` to check the values (``check()``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bayesq.kernels.triton_dequant import _field, _unit_tile


@triton.jit
def gemv_gather_kernel(x_ptr, out_ptr, words_ptr, scale_ptr, zero_ptr, N, K,
                       B: tl.constexpr, GS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, LOADS_ONLY: tl.constexpr):
    """out[n] (+)= sum_k x[k] * s[n, g(k)] * (c[n, k] - z[n, g(k)]) over this program's K slice;
    B in {2, 4, 8} (32 % B == 0), K % 32 == 0, K % GS == 0; out float32 (zeroed when SPLIT_K > 1)."""
    PER: tl.constexpr = 32 // B
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    row_word = rows.to(tl.int64) * (K // PER)  # (BLOCK_N,)
    row_group = rows.to(tl.int64) * (K // GS)
    span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.program_id(1) * span
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_start + span, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        mask = rmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(words_ptr + row_word[:, None] + (cols // PER)[None, :], mask=mask, other=0)
        if LOADS_ONLY:
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        else:
            c = (w.to(tl.uint32, bitcast=True) >> ((cols % PER) * B).to(tl.uint32)[None, :]) & ((1 << B) - 1)
            g = row_group[:, None] + (cols // GS)[None, :]
            s = tl.load(scale_ptr + g, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + g, mask=mask, other=0).to(tl.float32)
            acc += tl.sum(x[None, :] * ((c.to(tl.float32) - z) * s), axis=1)
    if SPLIT_K == 1:
        tl.store(out_ptr + rows, acc, mask=rmask)
    else:
        tl.atomic_add(out_ptr + rows, acc, mask=rmask)


def gather_gemv(x: torch.Tensor, pw, block_n: int, block_k: int, split_k: int, warps: int,
                loads_only: bool = False):
    """A launch closure computing ``x (1, K) @ W^T`` into a float32 (N,) buffer with this variant;
    returns (run, out). ``pw``: a PackedWeight with ``uniform_bits`` in {2, 4, 8}, K % 32 == 0."""
    out = torch.zeros(pw.n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(pw.n, block_n), split_k)

    def run():
        if split_k > 1:
            out.zero_()
        gemv_gather_kernel[grid](x, out, pw.words, pw.scale, pw.zero, pw.n, pw.k, B=pw.uniform_bits,
                                 GS=pw.group_size, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                                 LOADS_ONLY=loads_only, num_warps=warps)
    return run, out


def check(seed: int = 0) -> float:
    """Largest relative error of every variant against the float64 reference on small random
    weights (CPU under TRITON_INTERPRET=1, or a GPU)."""
    from bayesq.blocks import LayerBlocks
    from bayesq.grids import UniformGrids
    from bayesq.kernels import pack_weight, reference
    from bayesq.result import QuantizedWeight

    device = "cuda" if torch.cuda.is_available() else "cpu"
    worst = 0.0
    for bits in (2, 4, 8):
        gen = torch.Generator().manual_seed(seed + bits)
        n, k = 40, 320
        lb = LayerBlocks("w", (n, k), 64, 1)
        codes = torch.randint(0, 2**bits, (lb.n_groups, 64), generator=gen)
        scale = torch.rand(lb.n_groups, generator=gen, dtype=torch.float64).add(0.1).half().double()
        zero = torch.randint(0, 2**bits, (lb.n_groups,), generator=gen).double()
        pw = pack_weight(QuantizedWeight(lb, torch.full((lb.n_groups,), bits), codes,
                                         {bits: UniformGrids(bits, scale, zero)}), "stream")  # the row-major stream
        x = torch.randn(1, k, generator=gen)
        ref = (x.double() @ reference.dequantize(pw).double().T)[0]
        pw = pw.to(device)
        for split in (1, 3):
            run, out = gather_gemv(x.to(device), pw, 16, 64, split, 4)
            run()
            worst = max(worst, float((out.cpu().double() - ref).abs().max() / ref.abs().max()))
    return worst



# The second session's two-dimensional GEMV on a transposed copy of the codes (gemv_cols_kernel)
# became the library's batch-1 kernel after the third (triton_dequant.gemv_units_row_kernel on the
# ``units`` layout of bayesq/kernels/packed.py), and left this file.


# --- for the fourth GPU session: the batch-1 units GEMV with fewer integer operations per code -----
#
# The row kernel decodes code j of a word as ((w >> OFF) & MASK) | 0x4B000000, a shift and a
# mask-and-or: two integer operations per weight, and Hopper issues 64 integer operations per SM
# per cycle against 128 float ones. Here a field that lies in bits [P, P + B) of a word with
# P + B <= 23 is made a float with no shift: (w & (MASK << P)) | ((150 - P) << 23) is the float
# 2**(23 - P) + c exactly (the field lands in the mantissa at its own position, and the exponent
# scales it back to units), so c = that - 2**(23 - P), a float subtraction of a constant. Fields
# higher in the word are read from w >> 12 (one shift per word, shared by its codes); the two
# 3-bit codes that straddle words keep the shift-or path. The zero-point is folded out of the
# inner loop: sum_j x_j (c_j - z) = sum_j x_j c_j - z sum_j x_j, the second sum per unit, shared
# by every row.


@triton.jit
def _code_f32(w0, w1, w2, J: tl.constexpr, B: tl.constexpr):
    """Code ``J`` of a unit (as :func:`bayesq.kernels.triton_dequant._field`) as an exact float32."""
    BIT: tl.constexpr = J * B
    OFF: tl.constexpr = BIT % 32
    MASK: tl.constexpr = (1 << B) - 1
    if OFF + B > 32:  # a 3-bit code across two words
        c = (_field(w0, w1, w2, J, B) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        if BIT < 32:
            w = w0
        elif BIT < 64:
            w = w1
        else:
            w = w2
        if OFF + B <= 23:
            P: tl.constexpr = OFF
            src = w
        else:
            P: tl.constexpr = OFF - 12
            src = w >> 12
        c = ((src & (MASK << P)) | ((150 - P) << 23)).to(tl.float32, bitcast=True) - (1 << (23 - P))
    return c


@triton.jit
def gemv_mantissa_kernel(x_ptr, out_ptr, words_ptr, scale_ptr, zero_ptr, N, K, B: tl.constexpr,
                         GS: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K):
    """y[n] (+)= sum_u s[g(u), n] * (sum_j x[u CPU + j] c[n, u CPU + j] - z[g(u), n] sum_j x[u CPU + j])
    on the ``units`` layout; the row kernel's grid, tiles and split-K contract, no bias or column scale."""
    CPU: tl.constexpr = 32 if B == 3 else 32 // B
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    n_units = K // CPU
    span = tl.cdiv(tl.cdiv(n_units, SPLIT_K), BLOCK_U) * BLOCK_U
    u_lo = tl.program_id(1) * span
    acc = tl.zeros((BLOCK_U, BLOCK_N), dtype=tl.float32)
    for u0 in range(u_lo, tl.minimum(u_lo + span, n_units), BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U)
        umask, mask, w0, w1, w2, s, z = _unit_tile(words_ptr, scale_ptr, zero_ptr, u, rows, rmask, n_units, N, B, GS)
        part = tl.zeros((BLOCK_U, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((BLOCK_U,), dtype=tl.float32)
        for j in tl.static_range(CPU):
            xj = tl.load(x_ptr + u * CPU + j, mask=umask, other=0.0).to(tl.float32)
            xs += xj
            part += _code_f32(w0, w1, w2, j, B) * xj[:, None]
        acc += s * (part - z * xs[:, None])
    y = tl.sum(acc, axis=0)
    if SPLIT_K == 1:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)
    else:
        tl.atomic_add(out_ptr + rows, y, mask=rmask)


def mantissa_gemv(x: torch.Tensor, pw, tile):
    """A launch closure computing ``x (1, K) @ W^T`` with :func:`gemv_mantissa_kernel`; ``pw`` in the
    units layout, ``tile`` (BLOCK_U, BLOCK_N, warps, K slices) as the library's."""
    bu, bn, warps, split = tile
    grid = (triton.cdiv(pw.n, bn), split)

    def run():
        out = torch.zeros(1, pw.n, dtype=torch.float32, device=x.device) if split > 1 else \
            torch.empty(1, pw.n, dtype=x.dtype, device=x.device)
        gemv_mantissa_kernel[grid](x, out, pw.words, pw.scale, pw.zero, pw.n, pw.k, B=pw.uniform_bits,
                                   GS=pw.group_size, BLOCK_U=bu, BLOCK_N=bn, SPLIT_K=split, num_warps=warps)
        return out.to(x.dtype)
    return run


def check_mantissa(seed: int = 0) -> float:
    """Largest error of :func:`gemv_mantissa_kernel` relative to the output's scale against the
    float64 reference, every width, K split 1 and 3, groups of 32 and 64 (CPU under TRITON_INTERPRET=1, or a GPU)."""
    from bayesq.blocks import LayerBlocks
    from bayesq.grids import UniformGrids
    from bayesq.kernels import pack_weight, reference
    from bayesq.result import QuantizedWeight

    device = "cuda" if torch.cuda.is_available() else "cpu"
    worst = 0.0
    for bits in (2, 3, 4, 8):
        for gs in (32, 64):
            gen = torch.Generator().manual_seed(seed + bits + gs)
            n, k = 40, 384
            lb = LayerBlocks("w", (n, k), gs, 1)
            codes = torch.randint(0, 2**bits, (lb.n_groups, gs), generator=gen)
            scale = torch.rand(lb.n_groups, generator=gen, dtype=torch.float64).add(0.1).half().double()
            zero = torch.randint(0, 2**bits, (lb.n_groups,), generator=gen).double()
            pw = pack_weight(QuantizedWeight(lb, torch.full((lb.n_groups,), bits), codes,
                                             {bits: UniformGrids(bits, scale, zero)}))
            assert pw.layout == "units"
            x = torch.randn(1, k, generator=gen)
            ref = (x.double() @ reference.dequantize(pw).double().T)[0]
            for split in (1, 3):
                out = mantissa_gemv(x.to(device), pw.to(device), (4, 16, 4, split))().cpu().double()[0]
                worst = max(worst, float((out - ref).abs().max() / ref.abs().max()))
    return worst


if __name__ == "__main__":
    print(f"largest relative error of the variants: {check():.2e}; mantissa decode: {check_mantissa():.2e}")
