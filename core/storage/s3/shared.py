"""Tier 2 holding each content once: checkpoint keys that point to one shared object.

S3 has no hard links, so a shared file is two objects: the content, uploaded once under
``CONTENT_DIR/<crc32c[:2]>/<crc32c>-<size>`` (the candidate key the manifest already gives),
with the SHA-256 of its bytes recorded beside it (``<content>.sha256``) once a second copy of
the same (size, CRC32C) has read the stored bytes back and found them equal to its own; and at
the checkpoint's key an empty *pointer* object whose metadata names the content. Every read
of the store resolves a pointer (``open_read``, ``stat``, ``list``, ranged reads,
``verify_object``), so callers see whole checkpoints as before.

A candidate is used only when the local source's SHA-256, read as its CRC32C is checked, equals
the recorded one: a CRC32C collision never substitutes bytes. A source that is its tier's own
stored content (a Tier 1 file linked to the inode its content store keeps) has its SHA-256 noted
on that inode once hashed (``core.storage.content.noted_sha256``), and a later copy of it (a
frozen base, every checkpoint after the second) is shared with no read of its bytes. A note on
any other file (one a trainer wrote, or copied with its extended attributes) is never read.
A content whose hash was never recorded (seen once, or its uploader died) is read back whole by
the next copy of the same (size, CRC32C), and its hash recorded only when the stored bytes'
SHA-256 equals that copy's source's: one download per shared content, after which a copy hashes
at most its source; a content seen once (a pretraining run's every file) is never hashed; stored
bytes are never trusted unread.
Anything else uploads the file whole under its own key, as before. Only files of
``ranged_threshold`` bytes or more are shared: below that the requests a shared object costs
(the candidate's hash, the pointer) weigh more than the upload.

Object Lock: the content is locked at upload and its retention is extended to each new
pointer's, so it is held until the latest lock date of any checkpoint that references it.
Deleting a checkpoint deletes its pointers; ``sweep_contents`` then deletes the contents no
replica references, in two passes: the first takes the content's recorded hash away (so no new
copy points to it) and leaves a mark; a later pass, at least ``grace_s`` after the mark, asks
the catalog again and deletes the content only if still nothing references it. A copy claims
its replica before it reads a recorded hash, so a copy that read it before it went is in the
catalog by then. A content that carries a mark is never pointed to, whatever hash it has (a
read-back may record one after the first pass took it away), and the second pass deletes the
content before its mark: a copy that finds no mark finds no content, or one that the second
pass will find its replica (claimed first) references. A content that is referenced again keeps
its bytes and loses its mark; the next copy of it reads it back and records its hash again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, BinaryIO

from core import checksum as crc
from core.errors import ConflictError, CorruptCheckpoint, NotFound, ObjectLocked, StorageUnavailable
from core.progress import moved
from core.storage.base import ObjectInfo
from core.storage.content import CONTENT_DIR, known_sha256, noted_sha256
from core.storage.s3.errors import IF_NONE_MATCH, SEND_CRC32C, s3_errors
from core.storage.s3.lock import LOCK_MODES

POINTER_META = "ckpt-content"  # x-amz-meta-ckpt-content: the content key a pointer names
HASH_SUFFIX = ".sha256"
MARK_SUFFIX = ".unreferenced"  # left by a sweep that found no reference; its age is the grace


def _crc32c(body: bytes) -> dict[str, str]:
    """A PutObject's checksum arguments (a bucket with Object Lock requires one)."""
    return {"ChecksumAlgorithm": "CRC32C", "ChecksumCRC32C": crc.hex_to_s3(crc.hash_bytes(body))}


def content_key(size: int, checksum: str) -> str:
    return f"{CONTENT_DIR}/{checksum[:2]}/{checksum}-{size}"


class _PreadReader:
    """A local file read from offset 0 by ``pread`` (the caller's reader keeps its offset, so it
    can still be read whole if sharing fails), hashing SHA-256 on the way (``hashing``) and
    telling ``note(n)`` of each chunk (the copy's progress)."""

    def __init__(self, fd: int, note: Callable[[int], object] | None, *, hashing: bool = True):
        self.fd, self.note, self.offset = fd, note, 0
        self.sha256 = hashlib.sha256() if hashing else None

    def read(self, n: int = -1) -> bytes:
        data = os.pread(self.fd, n if n >= 0 else 1 << 24, self.offset)
        self.offset += len(data)
        if self.sha256 is not None:
            self.sha256.update(data)
        moved()
        if self.note is not None and data:
            self.note(len(data))
        return data


def source_hashes(fd: int, size: int, buffer_bytes: int, note: Callable[[int], object] | None) -> tuple[int, str, str]:
    """(size, CRC32C hex, SHA-256 hex) of the local file ``fd``, read once by offset."""
    reader, value, got = _PreadReader(fd, note), 0, 0
    while got <= size:
        data = reader.read(buffer_bytes)
        if not data:
            break
        value, got = crc.update(value, data), got + len(data)
    assert reader.sha256 is not None
    return got, crc.to_hex(value), reader.sha256.hexdigest()


class SharedContentMixin:
    """Shared content and pointers of an ``S3Store`` (its client, bucket, keys and uploads)."""

    client: Any
    bucket: str
    lock_days: float | None
    lock_mode: str
    ranged_threshold: int
    buffer_bytes: int

    if TYPE_CHECKING:
        def _head(self, key: str) -> dict | None: ...
        def _k(self, key: str) -> str: ...
        def url_for(self, key: str) -> str: ...
        def _lock_args(self) -> dict[str, Any]: ...
        def _upload(self, key: str, reader: Any, size: int, checksum: str) -> None: ...
        def _send(self, key: str, reader: Any, size: int, checksum: str) -> None: ...
        def _same_or_conflict(self, key: str, size: int, checksum: str) -> None: ...
        def read_small(self, key: str, limit: int = ...) -> bytes: ...
        def open_read(self, key: str) -> AbstractContextManager[BinaryIO]: ...
        def delete(self, key: str) -> bool: ...
        def verify_object(self, key: str, size: int, checksum: str) -> None: ...
        def _rel(self, full: str) -> str: ...

    def shares(self, size: int) -> bool:
        return size >= self.ranged_threshold

    @staticmethod
    def pointed(head: dict | None) -> str | None:
        """The content key a HeadObject/GetObject answer's pointer names (None: not a pointer)."""
        return ((head or {}).get("Metadata") or {}).get(POINTER_META)

    def resolve(self, key: str) -> str:
        """The key whose bytes ``key`` holds: its content when it is a pointer, else itself."""
        return self.pointed(self._head(key)) or key

    def put_shared(self, key: str, fd: int, note: Callable[[int], object] | None, size: int,
                   checksum: str, *, noted: bool = False) -> bool:
        """Publish ``key`` as a pointer to the shared content of the local source ``fd``,
        uploading the content first when the tier does not hold it; False when it cannot be
        shared (a content with other bytes, one being swept, or one uploaded meanwhile by
        another writer): then the caller uploads the file whole. A content seen for the first
        time is uploaded with no hash recorded: most never come again (a pretraining run's every
        file), and hashing them would cost every upload; the next copy of the same (size,
        CRC32C), if one comes, reads the stored bytes back and records it (``_recover_hash``),
        once. ``noted``: the source is its tier's own stored content (``TierStore.holds_content``),
        whose inode may carry its SHA-256 (read, and noted once hashed); any other source is
        hashed every time.

        Requests: one listing says whether the content, its hash and a sweep's mark exist; after
        the pointer, the mark and then the content are asked after, in that order (the sweep
        deletes the content before its mark: module doc), and the content verified as any
        upload is. A first-seen content costs three small requests more than a plain upload."""
        content = content_key(size, checksum)
        seen = self._beside(content)
        if MARK_SUFFIX in seen or (HASH_SUFFIX in seen and "" not in seen):  # being swept, or its stray hash
            return False
        recorded = self._recorded_hash(content) if HASH_SUFFIX in seen else None
        uploaded = False
        if "" not in seen:
            try:
                self._send(content, _PreadReader(fd, note, hashing=False), size, checksum)
            except ConflictError:  # another writer's upload of it: its hash may not be recorded yet
                return False
            uploaded = True
        elif recorded is None:  # seen once before (or its uploader died): the stored bytes decide
            try:
                if not self._recover_hash(content, fd, size, checksum, note, noted):
                    return False
            except NotFound:  # swept meanwhile: a question of the destination, never of the source
                return False
        elif not noted or known_sha256(fd) != recorded:  # a noted stored content needs no read
            got = _hashed(fd, size, self.buffer_bytes, note, noted)
            if got != (size, checksum, recorded):
                return False
        try:
            if not self._hold(content):
                return False  # swept meanwhile (its mark goes after it)
            self._put_pointer(key, content, size, checksum)
        except NotFound:
            return False
        try:  # what the pointer names: no mark (a hash read before it is not trusted), then the content
            if self._head(content + MARK_SUFFIX) is not None:
                raise NotFound(f"{self.url_for(content)} is being swept")
            self.verify_object(content, size, checksum)
        except (NotFound, CorruptCheckpoint) as exc:
            self.delete(key)
            if uploaded and isinstance(exc, CorruptCheckpoint):  # ours: changed on the way; taken back
                self.delete(content)
            return False  # the caller uploads the file whole
        return True

    def _beside(self, content: str) -> dict[str, int]:
        """Which of ``content``, its recorded hash and a sweep's mark exist (suffix -> size), from
        one listing of the content's name."""
        full = self._k(content)
        found: dict[str, int] = {}
        with s3_errors(f"list {self.url_for(content)}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for o in page.get("Contents", []):
                    rest = o["Key"][len(full):]
                    if rest in ("", HASH_SUFFIX, MARK_SUFFIX):
                        found[rest] = int(o["Size"])
        return found

    def _recover_hash(self, content: str, fd: int, size: int, checksum: str,
                      note: Callable[[int], object] | None, noted: bool) -> bool:
        """Record the hash of a content stored without one when its bytes, read back whole, equal
        the local source's (size, CRC32C and SHA-256 of both); True when the recorded hash is
        the source's. One download, once per such content, in place of an upload per copy."""
        known = known_sha256(fd) if noted else None
        want = (size, checksum, known) if known is not None else _hashed(fd, size, self.buffer_bytes, note, noted)
        if want[:2] != (size, checksum):
            return False
        sha256, value, got = hashlib.sha256(), 0, 0
        with self.open_read(content) as body:
            while data := body.read(self.buffer_bytes):
                sha256.update(data)
                value, got = crc.update(value, data), got + len(data)
                moved()
        if (got, crc.to_hex(value), sha256.hexdigest()) != want:
            return False
        self._record_hash(content, want[2])
        return self._recorded_hash(content) == want[2]  # another writer's record, if first, must agree

    def _recorded_hash(self, content: str) -> str | None:
        try:
            text = self.read_small(content + HASH_SUFFIX, 128).decode("ascii", "replace").strip()
        except NotFound:
            return None
        return text if len(text) == 64 else None

    def _record_hash(self, content: str, sha256: str) -> None:
        try:
            with s3_errors(self.url_for(content + HASH_SUFFIX), SEND_CRC32C + IF_NONE_MATCH):
                self.client.put_object(Bucket=self.bucket, Key=self._k(content + HASH_SUFFIX),
                                       Body=sha256.encode(), IfNoneMatch="*", **_crc32c(sha256.encode()))
        except ConflictError:  # recorded by another writer of the same bytes
            pass

    def _put_pointer(self, key: str, content: str, size: int, checksum: str) -> None:
        try:
            with s3_errors(self.url_for(key), SEND_CRC32C + IF_NONE_MATCH):
                self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=b"", IfNoneMatch="*",
                                       Metadata={POINTER_META: content}, **_crc32c(b""), **self._lock_args())
        except ConflictError:
            self._same_or_conflict(key, size, checksum)  # published first by another writer

    def _hold(self, content: str) -> bool:
        """Extend the content's Object Lock to what a new pointer gets (never shortened); False
        when the content is gone (swept meanwhile)."""
        if not self.lock_days:
            return True
        until = datetime.now(UTC) + timedelta(days=self.lock_days)
        head = self._head(content)
        if head is None:
            return False
        held = head.get("ObjectLockRetainUntilDate")
        if held is not None and held >= until:
            return True
        with s3_errors(f"Object Lock of {self.url_for(content)}"):
            self.client.put_object_retention(
                Bucket=self.bucket, Key=self._k(content), VersionId=head.get("VersionId"),
                Retention={"Mode": LOCK_MODES[self.lock_mode], "RetainUntilDate": until})
        return True

    def resolved_info(self, key: str, head: dict) -> ObjectInfo | None:
        """``stat`` of a pointer: the content's size and checksum under the pointer's key."""
        target = self._head(self.pointed(head) or key)
        if target is None:
            return None
        return ObjectInfo(key=key, size=int(target["ContentLength"]),
                          checksum=(crc.s3_to_hex(target.get("ChecksumCRC32C", ""))
                                    if target.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT" else None),
                          etag=target.get("ETag"), version_id=head.get("VersionId"))

    def sweep_contents(self, referenced: Callable[[], Collection[tuple[int, str]]], *, grace_s: float,
                       deleted: Callable[[str, int], None] | None = None) -> int:
        """Delete the contents no replica references (``referenced()``: (size, CRC32C) of every
        content the catalog's replicas on this tier may reference), in two passes ``grace_s``
        apart (module doc); ``deleted(key, size)`` hears of each before it goes. A content
        under Object Lock stays. The catalog is asked twice per sweep, not per content: once
        before the marks, once before the deletes. One content that fails (a request refused)
        fails alone: the others are swept, then the first failure is raised with the count.
        Returns how many went."""
        from core.storage.s3.store import server_clock  # deferred: cycle — the store is built on this mixin

        found: dict[str, dict[str, Any]] = {}
        now = datetime.now(UTC)
        base = self._k(CONTENT_DIR) + "/"
        with s3_errors(f"list {self.url_for(CONTENT_DIR)}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                now = server_clock(page)
                for o in page.get("Contents", []):
                    key = self._rel(o["Key"])
                    name, suffix = (key[:-len(sfx)], sfx) if (sfx := _suffix(key)) else (key, "")
                    found.setdefault(name, {})[suffix] = o
        live = set(referenced())
        failed: list[tuple[str, Exception]] = []
        due: list[tuple[str, tuple[int, str]]] = []  # marked past the grace: asked about again, then deleted

        def tidy(name: str, parts: dict[str, Any], held: tuple[int, str] | None) -> None:
            """The first pass over one content: marks, hashes and strays."""
            mark = parts.get(MARK_SUFFIX)
            if "" not in parts or held is None:  # a hash or mark left alone: nothing to keep it for
                for sfx in parts:
                    self.delete(name + sfx)
            elif held in live:
                if mark is not None:  # referenced again: kept (shared again once a copy reads it back)
                    self.delete(name + MARK_SUFFIX)
            elif mark is None:  # no new copy points to it from now on
                self.delete(name + HASH_SUFFIX)
                self._put_small(name + MARK_SUFFIX, b"")
            elif now - mark["LastModified"] >= timedelta(seconds=grace_s):
                due.append((name, held))

        for name, parts in sorted(found.items()):
            try:
                tidy(name, parts, _identity(name))
            except Exception as exc:  # noqa: BLE001 - one content fails alone (docstring)
                failed.append((name, exc))
        still = set(referenced()) if due else set()
        gone = 0
        for name, held in due:
            if held in still:
                continue
            try:
                if deleted is not None:
                    deleted(name, held[0])
                self.delete(name)  # before its mark: a copy that finds no mark finds no content
                self.delete(name + HASH_SUFFIX)  # recorded again by a read-back since the mark
                self.delete(name + MARK_SUFFIX)
                gone += 1
            except ObjectLocked:  # held for a milestone still: a later sweep takes it
                continue
            except Exception as exc:  # noqa: BLE001 - one content fails alone (docstring)
                failed.append((name, exc))
        if failed:
            first, why = failed[0]
            raise StorageUnavailable(f"{len(failed)} of {len(found)} shared contents of {self.url_for(CONTENT_DIR)} "
                                     f"could not be swept ({gone} were); the first, {first}: "
                                     f"{type(why).__name__}: {why}") from why
        return gone

    def _put_small(self, key: str, body: bytes) -> None:
        with s3_errors(self.url_for(key), SEND_CRC32C):
            self.client.put_object(Bucket=self.bucket, Key=self._k(key), Body=body, **_crc32c(body))


def _hashed(fd: int, size: int, buffer_bytes: int, note: Callable[[int], object] | None,
            noted: bool) -> tuple[int, str, str]:
    """``source_hashes`` of ``fd``; with ``noted`` (a stored content) its SHA-256 noted on its
    inode when the file was read whole and did not change while it was read (size, modification
    and change times the same before and after)."""
    before = os.fstat(fd) if noted else None
    got = source_hashes(fd, size, buffer_bytes, note)
    if before is not None:
        after = os.fstat(fd)
        if got[0] == after.st_size and (before.st_size, before.st_mtime_ns, before.st_ctime_ns) == \
                (after.st_size, after.st_mtime_ns, after.st_ctime_ns):
            noted_sha256(fd, got[2])
    return got


def _suffix(key: str) -> str:
    return next((sfx for sfx in (HASH_SUFFIX, MARK_SUFFIX) if key.endswith(sfx)), "")


def _identity(key: str) -> tuple[int, str] | None:
    """(size, CRC32C) a content key names (``content_key``), None for any other name."""
    checksum, _, size = key.rsplit("/", 1)[-1].partition("-")
    return (int(size), checksum) if size.isdigit() and len(checksum) == 8 else None
