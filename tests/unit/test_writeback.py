"""Early writeback (core/storage/writeback.py): what a writer has written is handed to the kernel
to write as it goes, each byte once, a span per ``WRITEBACK_BYTES``; the copy it serves is
unchanged, and nothing of it happens when switched off."""

from __future__ import annotations

import errno
import io
import itertools
import os
import sys

import pytest

from core import checksum
from core.storage import writeback
from core.storage.local import LocalStore
from core.storage.stage import RestoreStage

MiB = 1024 * 1024
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")


@pytest.fixture
def spans(monkeypatch):
    """Every span handed to the kernel, (fd, offset, length); the real call still made."""
    real = writeback._sync_file_range
    seen: list[tuple[int, int, int]] = []

    def spy(fd: int, offset: int, length: int, flags: int) -> int:
        seen.append((fd, offset, length))
        assert flags == writeback.SYNC_FILE_RANGE_WRITE  # start the I/O, never wait for it here
        return real(fd, offset, length, flags) if real is not None else 0

    monkeypatch.setattr(writeback, "_sync_file_range", spy)
    monkeypatch.setattr(writeback, "ENABLED", True)
    return seen


def covered(seen: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The spans as (start, end), checked to follow one another with no gap or overlap."""
    out = [(off, off + n) for _fd, off, n in seen]
    for (_a, end), (start, _b) in itertools.pairwise(out):
        assert start == end, out
    return out


def test_a_writer_hands_each_span_over_once_it_reaches_the_size(spans, tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        wb = writeback.Writeback(fd, offset=5 * MiB, every=MiB)
        for _ in range(14):  # 3.5 MiB in 256 KiB writes
            os.pwrite(fd, b"x" * (256 * 1024), wb.end)
            wb.wrote(256 * 1024)
    finally:
        os.close(fd)
    assert covered(spans) == [(5 * MiB, 6 * MiB), (6 * MiB, 7 * MiB), (7 * MiB, 8 * MiB)]
    assert {s[0] for s in spans} == {fd}
    assert (wb.start, wb.end) == (8 * MiB, 8 * MiB + MiB // 2)  # the tail is the fsync's


@linux_only
def test_the_call_reaches_the_kernel(tmp_path):
    """The binding passes fd, 64-bit offset and length as the kernel expects: 0 on a file
    (an offset past 4 GiB included), ESPIPE on a pipe, and start_writeback ignores the latter."""
    assert writeback._sync_file_range is not None
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.pwrite(fd, b"y" * MiB, 5 * 1024 * MiB)
        assert writeback._sync_file_range(fd, 5 * 1024 * MiB, MiB, writeback.SYNC_FILE_RANGE_WRITE) == 0
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        import ctypes

        assert writeback._sync_file_range(r, 0, MiB, writeback.SYNC_FILE_RANGE_WRITE) == -1
        assert ctypes.get_errno() == errno.ESPIPE
        writeback.start_writeback(r, 0, MiB)  # a hint: no error of its own
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("store", ["tier", "restore stage"])
def test_a_streamed_copy_starts_writeback_as_it_writes_and_lands_whole(spans, tmp_path, store):
    data = os.urandom(3 * MiB + 5)
    if store == "tier":
        (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
        dst = LocalStore(tmp_path / "t1", 1)
        dst.put_verified("obj", io.BytesIO(data), len(data), checksum.hash_bytes(data))
        got = (tmp_path / "t1" / "obj").read_bytes()
    else:
        with RestoreStage(tmp_path, buffer_bytes=256 * 1024) as stage:
            stage.put_verified("st/obj", io.BytesIO(data), len(data), checksum.hash_bytes(data))
            stage.settle()
        got = (tmp_path / "st" / "obj").read_bytes()
    assert got == data
    assert covered(spans)[0][0] == 0 and covered(spans)[-1][1] >= 3 * MiB - writeback.WRITEBACK_BYTES
    assert all(n >= writeback.WRITEBACK_BYTES for _fd, _off, n in spans)


def test_switched_off_it_hands_nothing_over(spans, tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "ENABLED", False)
    data = os.urandom(3 * MiB)
    (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
    LocalStore(tmp_path / "t1", 1).put_verified("obj", io.BytesIO(data), len(data), checksum.hash_bytes(data))
    assert (tmp_path / "t1" / "obj").read_bytes() == data
    assert spans == []
