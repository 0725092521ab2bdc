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


def test_only_a_content_stores_own_inode_holds_its_content(tmp_path):
    """``LocalStore.holds_content``: a Tier 1 file linked to the content its store keeps, never a
    copy of it (even one carrying its extended attributes), nor a store without contents."""
    import io
    import shutil

    from core import checksum
    from core.storage.local import LocalStore

    data = os.urandom(1 << 16)
    crc = checksum.hash_bytes(data)
    store, plain = LocalStore(tmp_path / "tier1", 1, shared_content=True), LocalStore(tmp_path / "plain", 1)
    (tmp_path / "tier1").mkdir()
    (tmp_path / "plain").mkdir()
    store.put_verified("run/step-1/base.bin", io.BytesIO(data), len(data), crc)
    plain.put_verified("run/step-1/base.bin", io.BytesIO(data), len(data), crc)
    shutil.copy2(tmp_path / "tier1" / "run/step-1/base.bin", tmp_path / "copy.bin")

    with store.open_read("run/step-1/base.bin") as fh:
        assert store.holds_content(fh, len(data), crc)
        assert not store.holds_content(fh, len(data) + 1, crc)
    with open(tmp_path / "copy.bin", "rb") as fh:
        assert not store.holds_content(fh, len(data), crc)
    with plain.open_read("run/step-1/base.bin") as fh:
        assert not plain.holds_content(fh, len(data), crc)
