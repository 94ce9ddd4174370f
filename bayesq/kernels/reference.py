"""PyTorch reference of the kernels: the CPU path and the test oracle (float64 decoding, so the
dequantised weight equals ``QuantizedWeight.dequantize()`` cast to float32 bit for bit)."""

from __future__ import annotations

import torch

from bayesq.kernels.packed import PackedWeight, to_stream


def element_groups(pw: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) int64 group of every element and its position in the group (see ``packed.py``)."""
    rows = torch.arange(pw.n, device=pw.device)[:, None]
    cols = torch.arange(pw.k, device=pw.device)[None, :]
    if pw.groups_per_row:
        return rows * pw.groups_per_row + cols // pw.group_size, (cols % pw.group_size).expand(pw.n, -1)
    flat = rows * pw.k + cols  # (N, K)
    return flat // pw.group_size, flat % pw.group_size


def unpack_codes(pw: PackedWeight) -> torch.Tensor:
    """(N, K) int64 codes from the packed stream (either layout)."""
    pw = to_stream(pw)
    g, p = element_groups(pw)
    b = pw.gbits.to(torch.int64)[g]
    off = pw.goff.to(torch.int64)[g] + p * b
    words = pw.words.to(torch.int64) & 0xFFFFFFFF
    idx = off >> 5
    both = words[idx] | (words[idx + 1] << 32)
    return (both >> (off & 31)) & ((1 << b) - 1)


def dequantize(pw: PackedWeight) -> torch.Tensor:
    """(N, K) float32 weight: the decoding of ``packed.py`` in float64, then rounded once."""
    if pw.dense is not None:
        return pw.dense
    pw = to_stream(pw)
    g, _ = element_groups(pw)
    code = unpack_codes(pw)
    if pw.lut.numel():
        w = pw.lut.double()[pw.lutoff.to(torch.int64)[g] + code]
    else:
        w = (code.double() - pw.zero.double()[g]) * pw.scale.double()[g]
    if pw.col_scale is not None:
        w = w / pw.col_scale.double()[None, :]
    return w.float()


def linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
           weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` for x (..., K) -> (..., N) with the dequantised W (or ``weight``, a
    cached :func:`dequantize` result)."""
    w = dequantize(pw) if weight is None else weight
    return torch.nn.functional.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
