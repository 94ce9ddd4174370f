"""The in-memory layout the kernels read, built from a :class:`bayesq.result.QuantizedWeight`.

A weight W (N outputs x K inputs; Conv2d: K = in/groups * kh * kw) is cut into groups as in
``bayesq.blocks``: element (n, k) belongs to group

    g = n * GPR + k // gs,  p = k mod gs          (row-aligned layouts, GPR groups per row)
    g = (n K + k) // gs,    p = (n K + k) mod gs  (otherwise; groups may straddle rows)

and its code sits at stream bit ``goff[g] + p * gbits[g]`` (the export's code stream: groups in
order, real weights only, any mix of 2/3/4/8-bit groups, no padding). When every group has the
same width b and is full, that is simply bit ``(n K + k) * b`` and the kernels skip ``goff`` /
``gbits`` (``uniform_bits = b``). It decodes to

    affine:  W[n, k] = scale[g] * (code - zero[g])
    lut:     W[n, k] = lut[lutoff[g] + code]           (Lloyd / mu-law tables; in mixed layers
                                                       uniform groups become 2**b-entry tables)
    dense:   W held dequantised (VQ codebooks, column scales per output-row group)

and AWQ's column scales (one row) divide the input: ``y = W (x / s)``.

Two in-memory orders of the same codes (``layout``):

* ``stream``: the code stream above, row after row; ``scale`` / ``zero`` in group order.
* ``units`` (:func:`to_units`; :func:`pack_weight` picks it for every :func:`unit_aligned`
  weight: one width b in {2, 3, 4, 8}, affine, K and the group size multiples of 32): each row's
  codes come in units of 32 // b codes in one word (b = 3: 32 codes in three words), and the
  words are stored with the rows contiguous, word ``i`` of unit ``u`` of row ``n`` at
  ``(u * WPU + i) * N + n`` (WPU words per unit); ``scale`` / ``zero`` of group column ``c`` of
  row ``n`` at ``c * N + n``. A GEMV thread then holds several rows of one unit, so each input
  element it loads serves all of them, and the word loads stay coalesced (1.6x FP16 on a
  16384^2 layer at batch 1 on an H200, where the row-major stream ran at FP16's speed:
  reports/kernels.md). The bytes are the same; only their order differs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from bayesq.packing import pack_bits, real_codes, words_of


@dataclass(frozen=True)
class PackedWeight:
    """Packed codes and per-group decoding data of one weight.

    Attributes:
        words: (n_words + 1,) int32 code stream (uint32 bit patterns, one slack word).
        goff: (G,) int32 first stream bit of each group (int64 beyond 2**31 bits).
        gbits: (G,) uint8 bit-width of each group.
        scale: (G,) float16 (float32 when the stored scales are fp32); zero: (G,) uint8 (affine).
        lut: (T,) float32 tables (lut mode); lutoff: (G,) int32 start of each group's table.
        dense: (N, K) float32 dequantised weight (dense mode) or None.
        col_scale: (K,) float32 input divisor or None.
        n, k: output and input size; group_size; groups_per_row: GPR (0: not row-aligned);
        uniform_bits: b when every group is full and b bits wide, else 0.
        layout: ``stream`` or ``units`` (module docstring): the order of ``words``, ``scale`` and
            ``zero``.
    Per-group data read by the kernels: 8 bytes (mixed widths) or 3 bytes (uniform_bits) per group.
    """

    words: torch.Tensor
    goff: torch.Tensor
    gbits: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    lut: torch.Tensor
    lutoff: torch.Tensor
    dense: torch.Tensor | None
    col_scale: torch.Tensor | None
    n: int
    k: int
    group_size: int
    groups_per_row: int
    uniform_bits: int = 0
    layout: str = "stream"

    @property
    def mode(self) -> str:
        if self.dense is not None:
            return "dense"
        return "lut" if self.lut.numel() else "affine"

    @property
    def device(self) -> torch.device:
        return self.words.device

    def to(self, device) -> "PackedWeight":
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields (for registering as module buffers)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    @property
    def stream_bytes(self) -> int:
        return self.words.numel() * 4


ALIGNED_MIN_K = 128  # fewest input columns per step of the word-aligned GEMV (its tiles: triton_dequant)


def aligned(pw: PackedWeight) -> bool:
    """The word-aligned GEMV applies: one width in {2, 3, 4, 8}, affine, full power-of-two groups
    dividing both K and the tile, K a multiple of 32 (every row starts on a word)."""
    gs = pw.group_size
    return (pw.uniform_bits in (2, 3, 4, 8) and pw.mode == "affine" and pw.k % 32 == 0 and pw.k % gs == 0
            and gs & (gs - 1) == 0 and ALIGNED_MIN_K % gs == 0)


def unit_aligned(pw: PackedWeight) -> bool:
    """The ``units`` layout applies: one width b in {2, 3, 4, 8}, affine, full groups whose size is
    a multiple of 32 (a unit of 32 codes never straddles two groups), K a multiple of the group."""
    return (pw.uniform_bits in (2, 3, 4, 8) and pw.mode == "affine" and pw.group_size % 32 == 0
            and pw.k % pw.group_size == 0)


def unit_shape(bits: int) -> tuple[int, int]:
    """(codes, words) of one unit of ``bits``-bit codes: (32 // b, 1), or (32, 3) for b = 3."""
    return (32, 3) if bits == 3 else (32 // bits, 1)


def _transpose_parts(pw: PackedWeight, to_units: bool) -> PackedWeight:
    """``pw``'s words (slack word kept last), scales and zeros with rows and columns swapped."""
    n, cols = pw.n, pw.k * pw.uniform_bits // 32  # words per row
    gc = pw.k // pw.group_size
    body = pw.words[:-1]
    if body.numel() != n * cols:
        raise ValueError(f"a {n} x {pw.k} weight of {pw.uniform_bits} bits has {n * cols} code words, not "
                         f"{body.numel()}")

    def swap(t: torch.Tensor, width: int) -> torch.Tensor:
        return (t.reshape(n, width).T if to_units else t.reshape(width, n).T).reshape(-1)

    return replace(pw, words=torch.cat([swap(body, cols), pw.words[-1:]]), scale=swap(pw.scale, gc),
                   zero=swap(pw.zero, gc), layout="units" if to_units else "stream")


def to_units(pw: PackedWeight) -> PackedWeight:
    """The same weight in the ``units`` layout (module docstring); ``pw`` must be :func:`unit_aligned`."""
    if pw.layout == "units":
        return pw
    if not unit_aligned(pw):
        raise ValueError("the units layout needs one width in {2, 3, 4, 8}, affine codes and full groups of a "
                         "multiple of 32 dividing K")
    return _transpose_parts(pw, True)


def to_stream(pw: PackedWeight) -> PackedWeight:
    """The same weight in the ``stream`` layout (the export's code order)."""
    return pw if pw.layout == "stream" else _transpose_parts(pw, False)


def _int32_words(stream: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words_of(stream).numpy().astype("<u4").view("<i4"))


def pack_weight(qw, layout: str = "auto") -> PackedWeight:
    """:class:`PackedWeight` of a :class:`bayesq.result.QuantizedWeight` (codes repacked);
    ``layout``: ``auto`` (``units`` where :func:`unit_aligned`, else ``stream``) or ``stream``."""
    if layout not in ("auto", "stream"):
        raise ValueError(f"layout must be auto or stream, got {layout!r}")
    lb = qw.blocks
    n, k = lb.shape[0], lb.numel // lb.shape[0]
    gpr = lb.groups_per_row if lb.row_aligned else 0
    sizes = lb.group_sizes()
    empty = torch.zeros(0)
    col = None
    if qw.col_scale is not None and qw.col_scale.shape[0] == 1:
        col = qw.col_scale[0].float()
    split = qw.split is not None  # OCS's split channels: decoded and folded once
    dense = any(not b.decodable for b in qw.books.values()) or (qw.col_scale is not None and col is None) or split
    if dense:
        z = torch.zeros(0, dtype=torch.int64)
        w = qw.dequantize()
        n, k = w.shape[0], w[0].numel()
        return PackedWeight(torch.zeros(1, dtype=torch.int32), z.int(), z.to(torch.uint8), empty.half(),
                            z.to(torch.uint8), empty, z.int(), w.reshape(n, k).float(), None, n, k,
                            lb.group_size, gpr)
    gbits = qw.group_bits.to(torch.int64)
    words = _int32_words(pack_bits(real_codes(qw, sizes), gbits.repeat_interleave(sizes)))
    goff = torch.cumsum(gbits * sizes, 0) - gbits * sizes
    goff = goff.int() if int(goff[-1] + gbits[-1] * sizes[-1]) < 2**31 else goff
    full = bool((sizes == lb.group_size).all()) and len(set(gbits.tolist())) == 1
    scale = torch.zeros(lb.n_groups, dtype=torch.float64)
    zero = torch.zeros(lb.n_groups, dtype=torch.float64)
    has_lut = any(b.affine_fields() is None for b in qw.books.values())
    lengths = 2 ** gbits  # LUT entries per group (LUT mode: every group gets a table of its levels)
    lutoff = torch.cumsum(lengths, 0) - lengths
    lut = torch.zeros(int(lengths.sum()) if has_lut else 0, dtype=torch.float64)
    for b, book in qw.books.items():
        sel = torch.nonzero(qw.group_bits == b).reshape(-1)
        affine = book.affine_fields()
        if affine is not None:
            scale[sel], zero[sel] = affine
        if has_lut:
            lut[lutoff[sel][:, None] + torch.arange(2**b)[None, :]] = book.group_levels()  # (n_sel, 2^b)
    lut, lutoff = (lut.float(), lutoff.int()) if has_lut else (empty, torch.zeros(0, dtype=torch.int32))
    stored = scale.half()
    if not torch.equal(stored.double(), scale):
        stored = scale.float()  # fp32 stored scales
    pw = PackedWeight(words, goff, gbits.to(torch.uint8), stored, zero.to(torch.uint8), lut, lutoff, None, col,
                      n, k, lb.group_size, gpr, int(gbits[0]) if full else 0)
    return to_units(pw) if layout == "auto" and unit_aligned(pw) else pw
