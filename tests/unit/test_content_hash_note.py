"""The SHA-256 noted on a local inode (``core.storage.content``): every name that links the
inode shares it, and it holds only while the file keeps the size and modification time it had
when its bytes were hashed."""

from __future__ import annotations

import hashlib
import os

from core.storage.content import SHA256_ATTR, known_sha256, noted_sha256


def _fd(path) -> int:
    return os.open(path, os.O_RDONLY)


def test_a_note_is_shared_by_every_link_and_dropped_by_a_new_write(tmp_path):
    data = os.urandom(4096)
    path, link = tmp_path / "content", tmp_path / "checkpoint-file"
    path.write_bytes(data)
    os.link(path, link)
    digest = hashlib.sha256(data).hexdigest()
    fd = _fd(path)
    try:
        assert known_sha256(fd) is None  # never hashed
        noted_sha256(fd, digest)
    finally:
        os.close(fd)
    fd = _fd(link)
    try:
        assert known_sha256(fd) == digest
    finally:
        os.close(fd)

    st = path.stat()
    with open(path, "ab") as fh:  # grows: another size
        fh.write(b"x")
    fd = _fd(path)
    try:
        assert known_sha256(fd) is None
    finally:
        os.close(fd)
    with open(path, "r+b") as fh:  # the old size again, written later: another modification time
        fh.truncate(len(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    fd = _fd(path)
    try:
        assert known_sha256(fd) is None
    finally:
        os.close(fd)


def test_a_note_that_is_not_ours_is_ignored(tmp_path):
    path = tmp_path / "content"
    path.write_bytes(b"abc")
    st = path.stat()
    for value in (b"not a note", f"{'0' * 63} {st.st_size} {st.st_mtime_ns}".encode(), b"\xff\xfe", b""):
        os.setxattr(path, SHA256_ATTR, value)
        fd = _fd(path)
        try:
            assert known_sha256(fd) is None, value
        finally:
            os.close(fd)
