"""Direct I/O (``O_DIRECT``) for a local tier's bulk reads and writes: no page cache.

A buffered copy of a part costs the CPU three memory copies per byte (the source's pages into
Python's buffer, that buffer into new page-cache pages, the read-back's pages into the buffer
again) plus the page cache's own bookkeeping and writeback, and it fills the node's page cache
with bytes nobody reads again. On a training node that CPU and that memory are the job's.
With ``O_DIRECT`` on the destination the device moves the bytes from and back into one
page-aligned buffer (DMA): the CPU copies each byte once (out of the source's page cache, where
the save left it) and computes the CRC32C. benchmarks/training_interference.py measures both
ways in one run.

It also makes the read-back stronger: a buffered read-back after fsync is answered from the
page cache (it proves what the kernel holds); a direct one reads what the device stored (on a
network or parallel file system: what the servers hold, not this client's cache).

Alignment: ``O_DIRECT`` needs the buffer, the file offset and the length aligned to the
device's logical block. The buffer is an anonymous ``mmap`` (page-aligned), offsets advance in
whole buffers, and reads may end short at the end of the file. A write whose length is not a
multiple of ``ALIGN`` (a file's tail) switches that descriptor back to buffered I/O for the rest
of the file (``fcntl F_SETFL``), and the fsync that follows covers both. Where a file system
refuses ``O_DIRECT`` (EINVAL: tmpfs on older kernels, some FUSE mounts), every call here falls
back to buffered I/O with the same results, so the choice changes speed, never outcomes.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable

from core import checksum

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: every call is buffered
_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)
_write = os.write  # one write call (a seam for the disk-full tests)


_local = threading.local()


def _rounded(size: int) -> int:
    return max(ALIGN, -(-size // ALIGN) * ALIGN)


def _mapping(size: int) -> mmap.mmap:
    """Private anonymous memory: page-aligned, as ``O_DIRECT`` needs."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer of ``size`` bytes rounded up to ``ALIGN``, one per thread and
    size, kept for the thread's next file (a new mapping per file costs the kernel a fault
    and a zeroed page per 4 KiB, the pinning of a direct read's first touch included)."""
    size = _rounded(size)
    buf: mmap.mmap | None = getattr(_local, "buffer", None)
    if buf is None or len(buf) != size:
        if buf is not None:
            buf.close()
        buf = _local.buffer = _mapping(size)
    return buf


def set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False (and nothing changed) where refused."""
    if not O_DIRECT:
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = flags | O_DIRECT if on else flags & ~O_DIRECT
    if want == flags:
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, want)
    except OSError as exc:
        if exc.errno in _REFUSED:
            return False
        raise
    return True


class _Reads:
    """``readinto`` for one descriptor: direct while the file system takes it; a direct read
    it refuses is retried buffered, and the descriptor stays buffered from then on."""

    def __init__(self, fd: int, direct: bool) -> None:
        self.fd, self.direct = fd, direct

    def __call__(self, view: memoryview) -> int:
        if self.direct:
            try:
                return os.readv(self.fd, [view])
            except OSError as exc:
                if exc.errno not in _REFUSED or not set_direct(self.fd, False):
                    raise
                self.direct = False
        return os.readv(self.fd, [view])


def hash_fd(fd: int, buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES,
            sink: Callable[[memoryview], None] | None = None, *, direct: bool = True) -> tuple[int, str]:
    """(size, crc32c hex) of ``fd`` read from its current offset to its end, with direct
    reads where the file system allows them (``direct=False``: through the page cache, into
    the same aligned buffer). ``sink`` receives every chunk (valid during the call only), as
    ``checksum.hash_stream``'s does."""
    reads = _Reads(fd, direct and set_direct(fd, True))
    nested = getattr(_local, "busy", False)  # a sink that hashes too gets a buffer of its own
    buf = _mapping(_rounded(buffer_bytes)) if nested else aligned_buffer(buffer_bytes)
    view = memoryview(buf)
    _local.busy = True
    try:
        return checksum.hash_reads(reads, view, sink)
    finally:
        view.release()
        _local.busy = nested
        if nested:
            buf.close()


def hash_file(path: str | os.PathLike, buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES) -> tuple[int, str]:
    """``checksum.hash_file`` reading the device, not the page cache, where it can."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return hash_fd(fd, buffer_bytes)
    finally:
        os.close(fd)


class DirectWriter:
    """Writes chunks in order to ``fd`` from offset 0, directly while each chunk is a whole
    number of blocks, buffered from the first one that is not (a file's tail)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct = set_direct(fd, True)

    def __call__(self, chunk: memoryview) -> None:
        if self.direct and len(chunk) % ALIGN:
            self.direct = not set_direct(self.fd, False)
            if self.direct:  # cannot switch back: nothing unaligned may go direct
                raise OSError(errno.EINVAL, "cannot leave O_DIRECT for an unaligned write")
        while chunk:
            try:
                n = _write(self.fd, chunk)
            except OSError as exc:
                if not self.direct or exc.errno not in _REFUSED or not set_direct(self.fd, False):
                    raise
                self.direct = False
                continue
            chunk = chunk[n:]
            if self.direct and n % ALIGN and chunk:  # a short direct write left us unaligned
                self.direct = not set_direct(self.fd, False)
