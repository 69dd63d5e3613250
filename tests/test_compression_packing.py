"""Exhaustive tests of sub-byte packing (megacomp.compression.packing)."""
import itertools

import pytest
import torch

from megacomp.compression.packing import pack_bits, packed_nbytes, unpack_bits


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_every_byte_value_unpacks_and_repacks(bits):
    every_byte = torch.arange(256, dtype=torch.uint8)
    per = 8 // bits
    codes = unpack_bits(every_byte, bits, 256 * per)
    assert codes.max().item() < 2 ** bits
    assert torch.equal(pack_bits(codes, bits), every_byte)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_every_code_in_every_slot(bits):
    """Every combination of codes that fits one byte (all 2^8 of them) survives pack -> unpack."""
    per = 8 // bits
    combos = torch.tensor(list(itertools.product(range(2 ** bits), repeat=per)), dtype=torch.uint8).reshape(-1)
    assert combos.numel() == 256 * per
    assert torch.equal(unpack_bits(pack_bits(combos, bits), bits, combos.numel()), combos)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 8, 9, 1001])
def test_odd_lengths_round_trip(bits, numel):
    codes = torch.randint(0, 2 ** bits, (numel,), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.numel() == packed_nbytes(numel, bits) == (numel * bits + 7) // 8
    assert torch.equal(unpack_bits(packed, bits, numel), codes)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="uint8"):
        pack_bits(torch.zeros(4, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="need"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 4, 5)
