"""A Tier 1 content is linked only after a byte-for-byte comparison (``ContentStore.link_same``):
one differing byte anywhere (a piece's first, the last of a short last piece) or a source longer
than its manifest says refuses the link, whatever the sizes and CRC32Cs say."""

from __future__ import annotations

import os

import pytest

from core import checksum
from core.storage.content import COMPARE_BYTES, ContentStore


@pytest.mark.parametrize("size", [1, COMPARE_BYTES, 3 * COMPARE_BYTES + 17])
def test_only_equal_bytes_are_linked(tmp_path, size):
    data = os.urandom(size)
    crc = checksum.hash_bytes(data)
    store = ContentStore(tmp_path, 4 << 20)
    store.entry(size, crc).parent.mkdir(parents=True)
    store.entry(size, crc).write_bytes(data)

    def linked(source: bytes, name: str) -> bool:
        (tmp_path / name).write_bytes(source)
        fd = os.open(tmp_path / name, os.O_RDONLY)
        try:
            return store.link_same(fd, size, crc, tmp_path / f"{name}.staged")
        finally:
            os.close(fd)

    assert linked(data, "same")
    for at in {0, size - 1, min(size - 1, COMPARE_BYTES)}:
        other = bytearray(data)
        other[at] ^= 1
        assert not linked(bytes(other), f"differs-at-{at}")
    assert not linked(data + b"x", "longer")
