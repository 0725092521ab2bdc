"""The tier storage contract. Every backend (local/fsspec for Tier 0/1, S3 for Tier 2)
implements ``TierStore``; one contract suite (tests/unit/test_storage_contract.py) runs on all.

Keys are '/'-separated paths relative to the tier root, confined by ``core.paths.safe_relpath``
(and, for local folders, by resolving symlinks). A checkpoint part lives under
``<run>/step-<step:08d>/`` (see ``checkpoint_prefix``).

Contract for implementations:
- ``put_verified`` streams from a reader into a staging name, checksums the bytes it writes,
  and publishes (rename / multipart complete) only if size and checksum match the expected
  values; otherwise nothing is published and ``CorruptCheckpoint`` is raised. Re-putting the
  same bytes to an existing key is a no-op success; different bytes at an existing key raise
  ``ConflictError`` (never a silent overwrite).
- ``verify_object`` proves the stored bytes match (size, checksum): local tiers read the bytes
  back; S3 asks the server for its full-object checksum (HeadObject, ChecksumMode=ENABLED)
  where the endpoint is known to validate checksums, and reads the bytes back where not.
- ``write_small_atomic`` is the commit marker write (manifest): atomic, durable (fsync file and
  directory locally).
- ``sweep_staging(prefix, older_than_s, *, keys=None)`` (backends with staging data: local
  staging files, S3 multipart uploads) removes staging data under ``prefix`` older than
  ``older_than_s``; ``keys`` (tier-relative) limits it to those objects' staging data, so a
  retry of one part never touches another part's copy in flight; None: the whole prefix.
- Transient backend failures raise ``StorageUnavailable``; ENOSPC/quota raises ``StorageFull``;
  a missing key raises ``NotFound``. All operations are idempotent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO

from core.manifest import MAX_MANIFEST_BYTES, checkpoint_dirname
from core.paths import safe_run_name


def checkpoint_prefix(run: str, step: int) -> str:
    return f"{safe_run_name(run)}/{checkpoint_dirname(step)}"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    checksum: str | None = None  # crc32c hex when the backend knows it without reading
    etag: str | None = None
    version_id: str | None = None


class TierStore(ABC):
    tier: int
    root_url: str

    def url_for(self, key: str) -> str:
        return self.root_url.rstrip("/") + "/" + key

    @abstractmethod
    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A streaming reader; never loads the whole object."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """None when the key does not exist."""

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursive), keys relative to the root, sorted."""

    @abstractmethod
    def read_small(self, key: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        """Read a small object (a manifest); larger than ``limit`` raises ``CorruptCheckpoint``."""

    @abstractmethod
    def write_small_atomic(self, key: str, data: bytes, *, overwrite: bool = False) -> ObjectInfo:
        """Atomic, durable write of a small object (the commit marker)."""

    @abstractmethod
    def put_verified(self, key: str, reader: BinaryIO, size: int, checksum: str) -> ObjectInfo:
        """Stream, checksum, publish atomically only on a match (see module contract)."""

    @abstractmethod
    def verify_object(self, key: str, size: int, checksum: str) -> None:
        """Raise ``CorruptCheckpoint`` / ``NotFound`` unless the stored bytes match."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix`` (or the one object named ``prefix``); return
        how many. Missing prefix: 0. An empty prefix (the whole tier) raises ``BadInput``."""

    def free_bytes(self) -> int | None:
        """Free space at the root, when the backend can tell."""
        return None


def read_limited(store: TierStore, key: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """``read_small`` through ``open_read``: at most ``limit`` bytes, else ``CorruptCheckpoint``."""
    from core.errors import CorruptCheckpoint

    chunks, got = [], 0
    with store.open_read(key) as fh:
        while got <= limit:
            data = fh.read(limit + 1 - got)
            if not data:
                break
            chunks.append(data)
            got += len(data)
    if got > limit:
        raise CorruptCheckpoint(f"{key}: larger than {limit} bytes", path=key)
    return b"".join(chunks)


def hash_object(store: TierStore, key: str, buffer_bytes: int = 4 * 1024 * 1024) -> tuple[int, str]:
    """(size, crc32c hex) of a stored object, streamed through ``open_read``."""
    from core.checksum import hash_stream

    with store.open_read(key) as fh:
        return hash_stream(fh, buffer_bytes)
