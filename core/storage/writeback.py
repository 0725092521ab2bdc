"""Early writeback: bytes written to a file start going to disk while the rest still arrives.

A fetch or a copy writes into the page cache and fsyncs each file once it matched. The page
cache holds the bytes until that fsync, so the disk idles while they arrive and then has the
whole file to write at once: a cluster resume spent a good part of its time after its last
byte arrived waiting for the writeback. ``start_writeback`` asks the kernel to start writing a
range now (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it queues the pages' I/O and
returns without waiting), so by the fsync most of the file is already on disk.

It changes nothing about durability: the fsync still follows and is still what makes a file
durable and reports a write error (``sync_file_range`` with WRITE alone neither waits for the
I/O nor consumes the file's error state, so an EIO is still the fsync's to report). Pages stay
in the page cache (no ``POSIX_FADV_DONTNEED``): the trainer loads what it just fetched.
Where the call does not exist (not Linux) or the file system refuses it, it is a no-op.

``Writeback`` keeps the bookkeeping for one writer: the bytes written since the last call, a
call each ``WRITEBACK_BYTES``. ``ENABLED`` switches it off for a same-run baseline
(benchmarks/cluster_restore.py).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

# How much a writer lets accumulate before it starts the writeback of it: small enough that
# the disk starts early and works steadily, large enough that the calls cost nothing (one
# syscall per MiB). benchmarks/writeback.py measures it against no early writeback.
WRITEBACK_BYTES = 1024 * 1024
SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of dirty pages in the range, do not wait

ENABLED = True  # False: no early writeback (the fsync writes everything), for a same-run baseline


def _load() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn: Any = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing ``length`` bytes of ``fd`` from ``offset`` to disk, without waiting; a
    no-op where unsupported. Errors are left to the fsync that must follow."""
    if ENABLED and _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE)  # a hint: its result is not ours to act on


class Writeback:
    """One writer's early writeback: ``wrote(n)`` after each ``n`` bytes written contiguously
    from ``offset``; every ``every`` bytes the kernel is asked to start writing them."""

    def __init__(self, fd: int, offset: int = 0, every: int = WRITEBACK_BYTES) -> None:
        self.fd, self.every = fd, every
        self.start = self.end = offset  # [start, end): written, writeback not started yet

    def wrote(self, n: int) -> None:
        self.end += n
        if self.end - self.start >= self.every:
            start_writeback(self.fd, self.start, self.end - self.start)
            self.start = self.end


def writing(fd: int, write: Callable[[memoryview], None]) -> Callable[[memoryview], None]:
    """``write`` (a sink that writes each chunk to ``fd`` in order, from offset 0) with early
    writeback of what it wrote."""
    wb = Writeback(fd)

    def sink(chunk: memoryview) -> None:
        write(chunk)
        wb.wrote(len(chunk))

    return sink


__all__ = ["ENABLED", "WRITEBACK_BYTES", "Writeback", "start_writeback", "writing"]
