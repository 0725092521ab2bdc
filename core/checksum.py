"""CRC32C, the manifest's checksum: streamed in buffers of a few MiB, never a whole shard in memory.

Why CRC32C: the ``crc32c`` package hashes faster than a disk reads, on one core, and releases
the GIL (so a thread pool scales), and S3 validates CRC32C natively, so the value the manifest
holds can be checked end to end on Tier 2 (HeadObject, ChecksumMode=ENABLED) without
re-reading the bytes.

Two spellings of the same 32-bit value:
- manifests use 8 lowercase hex digits (``to_hex``);
- S3's ``ChecksumCRC32C`` is the 4 bytes big-endian, base64-encoded (``hex_to_s3``).
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
from collections.abc import Callable
from typing import BinaryIO

import crc32c as _crc32c

from core.progress import moved

ALGORITHM = "crc32c"
DEFAULT_BUFFER_BYTES = 4 * 1024 * 1024  # the fastest measured; much larger buffers are slower (cache misses)


def update(value: int, data: bytes | bytearray | memoryview) -> int:
    """CRC32C of everything hashed so far (``value``) followed by ``data`` (bytes-like)."""
    moved()
    return _crc32c.crc32c(data, value)


def to_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def from_hex(text: str) -> int:
    if len(text) != 8:
        raise ValueError(f"not a crc32c hex digest: {text!r}")
    return int(text, 16)


def hex_to_s3(text: str) -> str:
    """Manifest hex -> S3 ``ChecksumCRC32C`` (base64 of the 4 big-endian bytes)."""
    return base64.b64encode(from_hex(text).to_bytes(4, "big")).decode()


def s3_to_hex(value: str) -> str | None:
    """S3 ``ChecksumCRC32C`` -> manifest hex; None for a composite (``...-N``) or odd value."""
    if not value or "-" in value:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw.hex() if len(raw) == 4 else None


def hash_stream(
    reader: BinaryIO,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    sink: Callable[[memoryview], None] | None = None,
) -> tuple[int, str]:
    """Read ``reader`` to its end in one pass; return (size, crc32c hex).

    ``sink`` (optional) receives every chunk as it is read (the write half of a streaming
    copy); the view is only valid during the call. Readers with ``readinto`` reuse one buffer;
    others (e.g. an HTTP body) are read with ``read(buffer_bytes)``.
    """
    readinto = getattr(reader, "readinto", None)
    if readinto is not None:
        return hash_reads(readinto, memoryview(bytearray(buffer_bytes)), sink)
    value, size = 0, 0
    while True:
        data = reader.read(buffer_bytes)
        if not data:
            break
        value = _crc32c.crc32c(data, value)
        moved()
        size += len(data)
        if sink is not None:
            sink(memoryview(data))
    return size, to_hex(value)


def hash_reads(
    readinto: Callable[[memoryview], int | None],
    view: memoryview,
    sink: Callable[[memoryview], None] | None = None,
) -> tuple[int, str]:
    """(size, crc32c hex) of what ``readinto(view)`` fills, call after call, until it reads
    nothing; ``sink`` as in ``hash_stream``."""
    value, size = 0, 0
    while True:
        n = readinto(view)
        if not n:
            break
        chunk = view[:n]
        value = _crc32c.crc32c(chunk, value)
        moved()
        size += n
        if sink is not None:
            sink(chunk)
    return size, to_hex(value)


def hash_file(path: str | os.PathLike, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> tuple[int, str]:
    """(size, crc32c hex) of a local file, streamed."""
    with open(path, "rb", buffering=0) as fh:
        return hash_stream(fh, buffer_bytes)


def hash_bytes(data: bytes) -> str:
    moved()
    return to_hex(_crc32c.crc32c(data))


# --- combining the CRC32Cs of consecutive pieces (ranged reads, a shard's tensors) ----------------
# CRC(A + B) = shift(CRC(A), len(B)) ^ CRC(B), where shift appends len(B) zero bytes to A's CRC
# register: a multiplication by x^(8 len(B)) modulo CRC32C's polynomial (zlib's crc32_combine,
# on the reflected polynomial 0x82F63B78). The powers x^(2^k) are tabled once; the factor for a
# length is the product of those its bits name (cached: ranged reads combine many pieces of one
# length, a model's tensors come in a few sizes), so each combine is one 32-step product.
_POLY = 0x82F63B78


def _multiply(a: int, b: int) -> int:
    """a x b modulo the polynomial (both reflected: bit 31 is x^0)."""
    m, product = 1 << 31, 0
    while a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers() -> tuple[int, ...]:
    out = [1 << 30]  # x^1
    for _ in range(63):
        out.append(_multiply(out[-1], out[-1]))
    return tuple(out)


_X2N = _powers()  # _X2N[k] = x^(2^k) modulo the polynomial: lengths below 2^61 bytes


@functools.lru_cache(maxsize=4096)
def _shift(length: int) -> int:
    """x^(8 length) modulo the polynomial: what appending ``length`` zero bytes multiplies by."""
    factor, k = 1 << 31, 3  # x^0; a byte is 2^3 bits
    while length:
        if length & 1:
            factor = _multiply(_X2N[k], factor)
        length >>= 1
        k += 1
    return factor


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC32C of A followed by B, from A's CRC, B's CRC and B's length (no bytes re-read)."""
    if length_b <= 0:
        return crc_a
    return _multiply(_shift(length_b), crc_a) ^ crc_b
