"""Direct I/O on a local tier (core/storage/direct.py, ``tier1_direct_io``): the same bytes and
the same verdicts as buffered I/O, at every alignment, and no page cache filled by the copy; a
file system that refuses O_DIRECT gets buffered I/O and the same results."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import mmap
import os
import sys
from pathlib import Path

import pytest

from core import checksum
from core.errors import CorruptCheckpoint
from core.settings import Settings
from core.storage import direct
from core.storage.local import LocalStore, open_local

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not direct.O_DIRECT,
                                reason="O_DIRECT is Linux's")

BUF = 8192  # two blocks: small files still take several reads and a tail
SIZES = [0, 1, 4095, 4096, 4097, 3 * BUF, 3 * BUF + 100]


def write(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def resident(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore on a mapping of it)."""
    size = path.stat().st_size
    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(-(-size // page))
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


@pytest.fixture
def refused(monkeypatch):
    """A file system that refuses O_DIRECT (as tmpfs on older kernels and some FUSE mounts do):
    none here does, so turning it on answers EINVAL, as those do."""
    real = fcntl.fcntl

    def fcntl_(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & direct.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", fcntl_)


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_read_hashes_what_a_buffered_one_does(tmp_path, size):
    write(tmp_path / "f", size)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = direct.hash_fd(fd, BUF)
        assert fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT  # it did read directly
    finally:
        os.close(fd)
    assert got == checksum.hash_file(tmp_path / "f") == direct.hash_file(tmp_path / "f", BUF)


@pytest.mark.parametrize("size", SIZES)
def test_a_direct_write_stores_every_byte_at_every_alignment(tmp_path, size):
    data = write(tmp_path / "src", size)
    fd = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        sink = direct.DirectWriter(fd)
        assert sink.direct
        src = os.open(tmp_path / "src", os.O_RDONLY)
        try:
            assert direct.hash_fd(src, BUF, sink) == (size, checksum.hash_bytes(data))
        finally:
            os.close(src)
    finally:
        os.close(fd)
    assert (tmp_path / "dst").read_bytes() == data


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct", "buffered"])
def test_a_direct_copy_leaves_no_copy_in_the_page_cache(tmp_path, direct_io):
    """What a training node's operator checks: the promotion's bytes do not fill its memory.
    (Buffered, the same copy leaves the file cached: the measure is a real one.)"""
    size = 8 * 1024 * 1024 + 123  # an unaligned tail: the one part written through the cache
    data = write(tmp_path / "src", size)
    (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
    store = LocalStore(tmp_path / "t1", 1, buffer_bytes=1 << 20, direct_io=direct_io)
    with open(tmp_path / "src", "rb", buffering=0) as fh:
        store.put_verified("ck/f", fh, size, checksum.hash_bytes(data))

    target = tmp_path / "t1" / "ck" / "f"
    pages, cached = -(-size // mmap.PAGESIZE), resident(target)
    if direct_io:
        assert cached <= 2, f"{cached} of {pages} pages cached"  # the tail's page, at most
    else:
        assert cached > pages // 2
    assert target.read_bytes() == data  # (after the count: this read fills the cache)


def test_a_bad_source_is_caught_on_the_way_and_nothing_is_published(tmp_path):
    data = write(tmp_path / "src", 5 * BUF + 7)
    (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
    store = LocalStore(tmp_path / "t1", 1, buffer_bytes=BUF, direct_io=True)
    wrong = checksum.hash_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the manifest's view: one bit off
    with open(tmp_path / "src", "rb", buffering=0) as fh, pytest.raises(CorruptCheckpoint, match="source"):
        store.put_verified("ck/f", fh, len(data), wrong)
    assert list((tmp_path / "t1").rglob("*")) == [tmp_path / "t1" / "ck"]  # no file, no staging file


def test_a_tier1_that_refuses_o_direct_gets_the_same_copy_buffered(tmp_path, refused):
    data = write(tmp_path / "src", 3 * BUF + 5)
    (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
    store = LocalStore(tmp_path / "t1", 1, buffer_bytes=BUF, direct_io=True)
    with open(tmp_path / "src", "rb", buffering=0) as fh:
        store.put_verified("ck/f", fh, len(data), checksum.hash_bytes(data))
    assert (tmp_path / "t1" / "ck" / "f").read_bytes() == data
    store.verify_object("ck/f", len(data), checksum.hash_bytes(data))
    with pytest.raises(CorruptCheckpoint):
        store.verify_object("ck/f", len(data), checksum.hash_bytes(data + b"x"))


def test_a_direct_read_refused_midway_goes_on_buffered(tmp_path, monkeypatch):
    """Some file systems accept the flag and refuse the read itself (EINVAL): the rest of the
    file is read buffered, and the hash is the file's."""
    write(tmp_path / "f", 4 * BUF + 9)
    real, calls = os.readv, []

    def readv(fd, buffers):
        calls.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT))
        if len(calls) == 2 and calls[-1]:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers)

    monkeypatch.setattr(direct.os, "readv", readv)
    assert direct.hash_file(tmp_path / "f", BUF) == checksum.hash_file(tmp_path / "f")
    assert calls[:3] == [True, True, False] and not any(calls[3:])


def test_a_sink_that_hashes_another_file_does_not_share_the_buffer(tmp_path):
    a, b = write(tmp_path / "a", 3 * BUF + 1), write(tmp_path / "b", 2 * BUF + 3)
    inner: list[tuple[int, str]] = []
    fd = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        got = direct.hash_fd(fd, BUF, lambda chunk: inner.append(direct.hash_file(tmp_path / "b", BUF)))
    finally:
        os.close(fd)
    assert got == (len(a), checksum.hash_bytes(a))
    assert set(inner) == {(len(b), checksum.hash_bytes(b))} and len(inner) == 4


def test_the_setting_makes_tier1_direct_and_leaves_tier0_buffered(tmp_path):
    on = Settings(data_dir=tmp_path, tier1_direct_io=True)
    assert open_local(str(tmp_path / "t1"), 1, on).direct_io
    assert not open_local(str(tmp_path / "t0"), 0, on).direct_io
    assert not open_local(str(tmp_path / "t1"), 1, Settings(data_dir=tmp_path)).direct_io
    assert not open_local(str(tmp_path / "t1"), 1, None).direct_io


def test_a_small_write_from_memory_is_unchanged(tmp_path):
    """A non-file source (the manifest, an S3 body) is streamed as before; its read-back is direct."""
    (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
    store = LocalStore(tmp_path / "t1", 1, direct_io=True)
    store.write_small_atomic("ck/manifest.json", b'{"a": 1}')
    assert (tmp_path / "t1" / "ck" / "manifest.json").read_bytes() == b'{"a": 1}'
    store.put_verified("ck/g", io.BytesIO(b"xyz"), 3, checksum.hash_bytes(b"xyz"))
    assert (tmp_path / "t1" / "ck" / "g").read_bytes() == b"xyz"
