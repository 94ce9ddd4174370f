"""Bit packing: fields of any width in [0, 32] packed densely into a byte stream and read back.

Bit order: value ``i`` of a stream occupies stream bits ``[o_i, o_i + w_i)``, ``o_i = sum_{j<i} w_j``,
least significant bit first; stream bit ``t`` is bit ``t mod 8`` of byte ``t div 8``. The export
format (:mod:`bayesq.export`) and the kernels' in-memory layout (:mod:`bayesq.kernels.packed`)
both read and write through these functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from bayesq.result import QuantizedWeight


class ExportError(ValueError):
    """A file that is not a readable BayesQ export (truncated, corrupted, other version)."""


def pack_bits(values: torch.Tensor, widths: torch.Tensor | int) -> np.ndarray:
    """Pack (n,) non-negative int64 ``values`` of ``widths`` bits each into ceil(sum w / 8) bytes.

    ``values[i] < 2**widths[i] <= 2**32``; returns a uint8 array (layout: module docstring).
    """
    values = values.reshape(-1).to(torch.int64)
    widths = torch.as_tensor(widths, dtype=torch.int64).expand(values.shape).reshape(-1)
    if bool((widths < 0).any()) or bool((widths > 32).any()):
        raise ValueError("bit widths must lie in [0, 32]")
    if bool((values < 0).any()) or bool((values >= (1 << widths)).any()):
        raise ValueError("a value does not fit its bit width")
    end = torch.cumsum(widths, 0)
    total = int(end[-1]) if end.numel() else 0
    off = end - widths  # (n,) first bit of each value
    words = torch.zeros(total // 32 + 2, dtype=torch.int64)
    sh = off & 31
    words.index_add_(0, off >> 5, (values << sh) & 0xFFFFFFFF)  # fields never overlap: add == or
    words.index_add_(0, (off >> 5) + 1, values >> (32 - sh))
    raw = words.numpy().astype("<u4").view(np.uint8)
    return raw[: (total + 7) // 8].copy()


def words_of(data: np.ndarray | bytes) -> torch.Tensor:
    """Stream bytes -> int64 tensor of its 32-bit little-endian words, plus one zero word of
    slack (a field that ends in the last word reads the next one)."""
    buf = np.frombuffer(bytes(data), dtype=np.uint8)
    pad = (-buf.size) % 4 + 4
    words = np.concatenate([buf, np.zeros(pad, np.uint8)]).view("<u4")
    return torch.from_numpy(words.astype(np.int64))


def unpack_bits(data: np.ndarray | bytes | torch.Tensor, offsets: torch.Tensor, widths: torch.Tensor | int) -> torch.Tensor:
    """Inverse of :func:`pack_bits` at given bit ``offsets``: (n,) int64 values.

    ``data``: the stream's bytes, or its words from :func:`words_of`.
    """
    words = data if isinstance(data, torch.Tensor) else words_of(data)
    offsets = offsets.to(torch.int64)
    widths = torch.as_tensor(widths, dtype=torch.int64).expand(offsets.shape)
    idx = offsets >> 5
    if offsets.numel() and int((offsets + widths).max()) > 32 * (words.numel() - 1):
        raise ExportError("a packed stream is shorter than its layout says: the file is truncated or corrupted")
    both = words[idx] | (words[idx + 1] << 32)  # wraps for high words; bits below 64 are intact
    return (both >> (offsets & 31)) & ((1 << widths) - 1)


def offsets_of(widths: torch.Tensor) -> torch.Tensor:
    """(n,) int64 first bit of each field of a stream with (n,) ``widths``."""
    widths = widths.to(torch.int64)
    return torch.cumsum(widths, 0) - widths


def real_codes(qw: QuantizedWeight, sizes: torch.Tensor) -> torch.Tensor:
    """The codes of the real (unpadded) fields, group by group: (sum sizes,) int64."""
    mask = torch.arange(qw.codes.shape[1])[None, :] < sizes[:, None]  # (G, width)
    return qw.codes[mask].long()
