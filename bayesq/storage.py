"""Exact bit cost of every encoding (payload + scales + zero-points + LUTs + bit-width headers).

Nothing the quantised model needs at inference is left out, and the float weights are never
part of it.  Costs are integers (bits); the average is over the quantised weights.  Encodings
of one allocation unit of n weights (``header_bits = ceil(log2 |bit set|)`` names its choice):

    uniform grid  C = n * b + n_groups * (scale_bits + b) + header    # codes, fp16 scale and
                                                                      # b-bit zero-point per group
    LUT (Lloyd)   C = n * b + 2**b * lut_bits + header                # codes, one K-entry table
                                                                      # per unit, no scales
    mu-law        C = n * b + n_groups * scale_bits + header          # codes, one scale per group
                                                                      # (fixed table, no zero-point)
    VQ            C = n_vectors * log2(K) + K * g * lut_bits          # indices, one (K, g) codebook

    avg_bits  = sum_units C_unit / sum_units n

A layer whose input channels were split (OCS) also stores each split channel's index (16 bits,
32 past 32,768 channels), and its average counts the deployed layer's weights, not the copies'.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def header_bits(n_choices: int) -> int:
    """Bits needed to name one of ``n_choices`` bit-widths (0 when there is no choice)."""
    if n_choices < 1:
        raise ValueError(f"need at least one bit-width choice, got {n_choices}")
    return math.ceil(math.log2(n_choices)) if n_choices > 1 else 0


def grid_bits(n_weights: int, n_groups: int, bits: int, scale_bits: int = 16) -> int:
    """Bits of ``n_weights`` codes at ``bits`` plus one scale and one zero-point per group."""
    if n_weights < 0 or n_groups < 0 or bits < 1:
        raise ValueError(f"invalid encoding: n={n_weights}, groups={n_groups}, bits={bits}")
    return n_weights * bits + n_groups * (scale_bits + bits)


def split_index_dtype(channels: int) -> torch.dtype:
    """How the split channels of a layer with ``channels`` input channels (OCS) are stored: int16
    while every index fits, else int32."""
    return torch.int16 if channels <= 2**15 else torch.int32


def split_bits(n_split: int, channels: int) -> int:
    """Bits of ``n_split`` stored split-channel indices (:func:`split_index_dtype`)."""
    return n_split * (16 if split_index_dtype(channels) == torch.int16 else 32)


def unit_cost_bits(
    n_weights: int, n_groups: int, bits: int, n_choices: int, scale_bits: int = 16
) -> int:
    """Exact cost of one allocation unit: grid bits plus its bit-width header."""
    return grid_bits(n_weights, n_groups, bits, scale_bits) + header_bits(n_choices)


def average_bits(total_bits: float, n_weights: int) -> float:
    """True average bits per quantised weight."""
    if n_weights <= 0:
        raise ValueError("no quantised weights: cannot form an average")
    return total_bits / n_weights


def budget_bits(avg_bits: float, n_weights: int) -> int:
    """Total bit budget for a target average (floored, so the result never exceeds it)."""
    return math.floor(avg_bits * n_weights)


def candidate_costs(
    unit_sizes: Sequence[tuple[int, int]], bit_set: Sequence[int], scale_bits: int = 16
) -> list[list[int]]:
    """Cost table ``[unit][choice]`` for units given as (n_weights, n_groups)."""
    return [
        [unit_cost_bits(n, g, b, len(bit_set), scale_bits) for b in bit_set]
        for n, g in unit_sizes
    ]


def lut_unit_cost_bits(n_weights: int, bits: int, n_choices: int, lut_bits: int = 16) -> int:
    """One allocation unit with a non-uniform LUT: codes + ``2**bits`` stored levels + header."""
    if n_weights < 0 or bits < 1:
        raise ValueError(f"invalid LUT encoding: n={n_weights}, bits={bits}")
    return n_weights * bits + 2**bits * lut_bits + header_bits(n_choices)


def mulaw_unit_cost_bits(n_weights: int, n_groups: int, bits: int, n_choices: int, scale_bits: int = 16) -> int:
    """One allocation unit with the fixed mu-law table: codes + one scale per group + header."""
    if n_weights < 0 or n_groups < 0 or bits < 1:
        raise ValueError(f"invalid mu-law encoding: n={n_weights}, groups={n_groups}, bits={bits}")
    return n_weights * bits + n_groups * scale_bits + header_bits(n_choices)


def vq_cost_bits(n_vectors: int, g: int, k: int, lut_bits: int = 16) -> int:
    """VQ: ``n_vectors`` indices of log2(K) bits plus a (K, g) codebook of ``lut_bits`` entries."""
    if n_vectors < 0 or g < 1 or k < 1 or k & (k - 1):
        raise ValueError(f"invalid VQ encoding: vectors={n_vectors}, g={g}, K={k} (K must be a power of two)")
    return n_vectors * (k.bit_length() - 1) + k * g * lut_bits
