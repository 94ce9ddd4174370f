"""Bit packing against a '0'/'1' bit-string reference."""

import pytest
import torch

from bayesq.packing import offsets_of, pack_bits, unpack_bits


def _bitstring_pack(values, widths) -> bytes:
    """Reference: '0'/'1' characters, least significant bit first, cut into bytes."""
    bits = "".join(format(v, f"0{w}b")[::-1] if w else "" for v, w in zip(values, widths))
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8][::-1], 2) for i in range(0, len(bits), 8))


def test_pack_bits_vs_bitstring_reference():
    g = torch.Generator().manual_seed(0)
    widths = torch.tensor([2, 3, 4, 8] * 50 + [1, 5, 16, 32, 0, 7])[torch.randperm(206, generator=g)]
    values = (torch.rand(206, generator=g, dtype=torch.float64) * (2.0 ** widths)).floor().long()
    packed = pack_bits(values, widths)
    assert packed.tobytes() == _bitstring_pack(values.tolist(), widths.tolist())
    assert torch.equal(unpack_bits(packed, offsets_of(widths), widths), values)


def test_pack_bits_three_bit_is_dense():
    """8 three-bit codes are 3 bytes, not 4 (no padding to nibbles)."""
    assert pack_bits(torch.arange(8), 3).nbytes == 3
    assert pack_bits(torch.arange(8), 3).tobytes() == _bitstring_pack(list(range(8)), [3] * 8)


def test_pack_bits_rejects_values_wider_than_their_width():
    with pytest.raises(ValueError, match="does not fit its bit width"):
        pack_bits(torch.tensor([4]), 2)
