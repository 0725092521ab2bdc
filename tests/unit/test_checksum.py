"""CRC32C combine: the CRC of consecutive pieces from the pieces' CRCs and lengths, as the
safetensors writer derives a shard's checksum from its header's and its tensors'."""

from __future__ import annotations

import random
from itertools import pairwise

import crc32c
import pytest

from core.checksum import combine


@pytest.mark.parametrize("seed", range(8))
def test_pieces_combine_to_the_crc32c_of_the_whole_at_any_split(seed):
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(0, 300_000))
    cuts = sorted(rng.choice([0, len(data), rng.randrange(len(data) + 1)]) for _ in range(rng.randrange(0, 9)))
    bounds = [0, *cuts, len(data)]  # repeated cuts: empty pieces, at either end and between
    whole = 0
    for start, end in pairwise(bounds):
        whole = combine(whole, crc32c.crc32c(data[start:end]), end - start)
    assert whole == crc32c.crc32c(data)


@pytest.mark.parametrize("length", [1, 7, 8, 4096, (1 << 20) + 3, 5 << 20])
def test_a_piece_of_zero_bytes_combines_like_any_other(length):
    head, zeros = b"checkpoint", bytes(length)  # the shift alone decides: the piece's own CRC is fixed
    assert combine(crc32c.crc32c(head), crc32c.crc32c(zeros), length) == crc32c.crc32c(head + zeros)
    assert combine(crc32c.crc32c(b""), crc32c.crc32c(zeros), length) == crc32c.crc32c(zeros)
