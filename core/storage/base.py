"""The tier storage contract. Every backend (``local`` and ``fsspec`` for Tiers 0/1, ``s3`` for
Tier 2) implements ``TierStore``; one contract suite (tests/integration/storage/test_storage_contract.py,
with tests/unit/test_storage_contract.py for the backends that need no server) runs on all, so
callers never need to know which backend they hold.

Keys are '/'-separated paths relative to the tier root, confined by ``core.paths.safe_relpath``
(and, for local folders, by symlink checks); where a checkpoint's keys live is
``core.layout``'s rule.

Contract for implementations (every operation idempotent):
- ``put_verified`` streams from a reader into a staging name, checksums the bytes it writes,
  and publishes (rename / multipart complete) only if size and checksum match the expected
  values; otherwise nothing is published and ``CorruptCheckpoint`` is raised. Re-putting the
  same bytes to an existing key is a no-op success; different bytes at an existing key raise
  ``ConflictError`` (never a silent overwrite).
- ``verify_object`` proves the stored bytes match (size, checksum): local tiers read the bytes
  back; S3 asks the server for its full-object checksum (HeadObject, ChecksumMode=ENABLED)
  where the endpoint is known to validate checksums, and reads the bytes back where not.
- ``write_small_atomic`` is the commit marker write (manifest): atomic and durable, with the
  same no-overwrite rule as ``put_verified``; everything published before it is durable first.
- ``delete`` removes one object and ``delete_prefix`` everything under a prefix; neither ever
  follows a symlink (a local link is removed itself, never its target, and a key whose folder
  is reached through a link is refused with ``PathEscape``).
- ``sweep_staging(prefix, older_than_s, *, keys=None)`` removes staging data (local staging
  files, S3 multipart uploads) under ``prefix`` older than ``older_than_s``; ``keys``
  (tier-relative) limits it to those objects' staging data, so a retry of one part never
  touches another part's copy in flight; None: the whole prefix.
- Deletes under a claim are fenced (``bury`` -> ``delete_tomb``): what the claim deletes is first
  set aside under the claim's token, so a worker that wakes after its claim went can delete only
  what it set aside, never what a newer holder published under the same names. A file system
  moves it into a tombstone folder named for the token (``core.layout.tomb_name``; a whole
  prefix in one atomic rename) and deletes only that folder; ``exhume`` puts back what a claim
  found lost right after its move; ``sweep_tombs`` removes tombstones of claims that are over.
  A store that cannot rename (S3) lists what it will delete and deletes it in place, with the
  claim checked before each object (its semantics: ``core.storage.s3.store``).
- ``locked_until(keys)`` is the latest date until which the store refuses to delete any of
  ``keys`` (S3 Object Lock), None where nothing is locked; a delete of a locked object raises
  ``ObjectLocked`` and leaves it whole.
- ``root_exists`` says whether the root is there (a folder, a bucket); no store ever creates
  its root or the root's parents (folders under it are fine), so a tier that is not mounted
  is never silently replaced by an empty folder (``core.storage.identity`` proves the rest).
- Transient backend failures raise ``StorageUnavailable``; ENOSPC/quota raises ``StorageFull``;
  a missing key raises ``NotFound``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, Self

from core import checksum
from core.errors import BadInput, CorruptCheckpoint
from core.layout import is_manifest_name
from core.manifest import MAX_MANIFEST_BYTES


@dataclass(frozen=True)
class Tomb:
    """What one claim set aside to delete (``TierStore.bury``): ``keys``, where those objects are
    now; on a file system ``folder``, the tombstone that holds them (deleted as a whole), and
    ``moved``, each (original key, key in the tombstone), for ``exhume``; on a versioned object
    store ``versions``, each (key, version id) listed, the only versions deleted."""

    token: str
    keys: tuple[str, ...] = ()
    folder: str | None = None
    moved: tuple[tuple[str, str], ...] = ()
    versions: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    checksum: str | None = None  # crc32c hex when the backend knows it without reading
    etag: str | None = None
    version_id: str | None = None
    modified: float | None = None  # when last written (seconds since the epoch, the tier's clock), from ``list``


class TierStore(ABC):
    tier: int
    root_url: str
    buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES

    @property
    def read_chunk_bytes(self) -> int:
        """What one read of a stream from ``open_read`` asks for (the copy buffer unless the
        store says otherwise: S3 reads a GET's body in smaller pieces)."""
        return self.buffer_bytes

    def url_for(self, key: str) -> str:
        return self.root_url.rstrip("/") + "/" + key

    # --- reads -------------------------------------------------------------------------
    @abstractmethod
    def open_read(self, key: str) -> AbstractContextManager[BinaryIO]:
        """A streaming reader; never loads the whole object."""

    @abstractmethod
    def stat(self, key: str) -> ObjectInfo | None:
        """None when the key does not exist."""

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (recursive), keys relative to the root, sorted;
        staging objects are never listed."""

    def keys(self, prefix: str) -> tuple[str, ...]:
        """The keys ``list`` gives, sorted, for a caller that needs no sizes (a backend may answer
        this for less: S3's pointers are listed without resolving each one)."""
        return tuple(o.key for o in self.list(prefix))

    def folders(self) -> tuple[str, ...]:
        """The names of the folders at the root (on this project's tiers: one per run), sorted,
        without listing what is inside them (backends override this with a shallow listing)."""
        return tuple(sorted({o.key.split("/", 1)[0] for o in self.list("") if "/" in o.key}))

    def read_small(self, key: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
        """A small object (a manifest): at most ``limit`` bytes, else ``CorruptCheckpoint``."""
        return read_limited(self, key, limit)

    def root_exists(self) -> bool:
        """Whether the tier's root is there (a folder, a bucket); a store never creates it."""
        return True

    def local_path(self, key: str) -> Path | None:
        """The path of ``key`` on a local folder (reads may then copy in the kernel), or None
        when the tier is not one."""
        return None

    def holds_content(self, reader: BinaryIO, size: int, checksum: str) -> bool:
        """Whether ``reader`` (opened by ``open_read``) reads this tier's stored content of that
        size and CRC32C itself (the inode its content store keeps): only such a file's SHA-256
        note is trusted (``core.storage.content.known_sha256``), never one on a file a trainer
        or anyone else wrote. A store without a content store holds none."""
        return False

    def in_place(self, key: str = "") -> Path | None:
        """Where a trainer on this machine reads ``key`` as it lies ('': the tier's root), or
        None when it must be fetched first (an object store, a file system reached only through
        its API). The one backend question a resume asks; a store that answers with a folder
        also takes writes there (``write_path``: a part fetched into it is staged whole beside
        its folder and renamed into place)."""
        return None

    def write_path(self, key: str) -> Path:
        """The local path to write or delete ``key`` at, on a store that ``in_place`` answers
        with a folder; no other store has one (``BadInput``)."""
        raise BadInput(f"{self.url_for(key)} is not a folder on this machine")

    @abstractmethod
    def verify_object(self, key: str, size: int, checksum: str) -> None:
        """Raise ``CorruptCheckpoint`` / ``NotFound`` unless the stored bytes match."""

    # --- writes ------------------------------------------------------------------------
    @abstractmethod
    def put_verified(self, key: str, reader: BinaryIO, size: int, checksum: str) -> ObjectInfo:
        """Stream, checksum, publish atomically only on a match (see module contract)."""

    @abstractmethod
    def write_small_atomic(self, key: str, data: bytes) -> ObjectInfo:
        """Atomic, durable write of a small object (the commit marker); never overwrites
        different bytes."""

    def flush(self) -> None:  # noqa: B027 - a no-op where publishing is already durable
        """Make every name published so far durable (local folders batch their fsyncs)."""

    # --- deletes -----------------------------------------------------------------------
    @abstractmethod
    def delete(self, key: str) -> bool:
        """Delete one object; False when it was not there. Never follows a symlink."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix``; return how many. Missing prefix: 0. An empty
        prefix (the whole tier) raises ``BadInput``."""

    def remove_empty(self, prefix: str) -> bool:
        """Remove the folder ``prefix`` when nothing but empty folders is left in it; True if
        it went. Object stores have no folders of their own: nothing to do (False)."""
        return False

    def delete_part(self, prefix: str, manifest_name: str, paths: Iterable[str], *,
                    keep: Collection[str] = ()) -> int:
        """Uncommit a part, then delete its files: the manifest first (so a half-deleted part
        never looks committed), then each of ``paths`` not in ``keep`` (paths another part of
        the same checkpoint still lists). Returns the objects deleted."""
        deleted = int(self.delete(f"{prefix}/{manifest_name}"))
        return deleted + sum(self.delete(f"{prefix}/{p}") for p in paths if p not in keep)

    def bury(self, prefix: str, paths: Sequence[str] | None, *, token: str) -> Tomb:
        """Set aside under the claim ``token`` what a delete takes: each of ``paths`` (relative to
        ``prefix``, in the order given: the manifest first) or, with None, everything under
        ``prefix`` (its manifests first). A missing object is skipped. This default (a store that
        cannot rename) only lists them, to be deleted in place by ``delete_tomb``."""
        present = self.keys(prefix)
        if paths is None:
            keys = sorted(present, key=lambda k: not is_manifest_name(k.rsplit("/", 1)[-1]))
        else:
            listed = set(present)
            keys = [k for k in (f"{prefix}/{p}" for p in paths) if k in listed]
        return Tomb(token, tuple(keys))

    def exhume(self, tomb: Tomb) -> int:
        """Put back what ``tomb`` moved where nothing took its name since (its claim was found
        lost right after the move); returns how many. Nothing moved here: 0."""
        return 0

    def delete_tomb(self, tomb: Tomb, check: Callable[[], None]) -> int:
        """Delete what ``bury`` set aside; returns the objects deleted. A tombstone folder is the
        claim's alone and goes whole; objects left in place are deleted one by one, ``check()``
        (the claim's, raising once it is lost) before each."""
        deleted = 0
        for key in tomb.keys:
            check()
            deleted += int(self.delete(key))
        return deleted

    def sweep_tombs(self, prefix: str, live: Callable[[Collection[str]], Collection[str]]) -> int:
        """Remove the tombstones directly under ``prefix`` (a run's folder) whose claim is over:
        ``live(tokens)`` names the tokens still held. Returns how many went; none here."""
        return 0

    @property
    def retains(self) -> bool:
        """Whether objects here can be under retention (S3 Object Lock): when False,
        ``locked_until`` is always None and callers need not gather keys for it."""
        return False

    def locked_until(self, keys: Iterable[str]) -> datetime | None:
        """The latest retain-until date, still in the future, of any of ``keys``; None when the
        store can delete them all now (backends without retention: always)."""
        return None

    @abstractmethod
    def sweep_staging(self, prefix: str, older_than_s: float = 3600.0, *, keys: Iterable[str] | None = None) -> int:
        """Remove staging data under ``prefix`` (a killed copy's) older than ``older_than_s``;
        return how many. The age bound spares copies still running elsewhere; ``keys`` limits
        the sweep to those objects' staging data (None: everything under ``prefix``)."""

    # --- lifetime ----------------------------------------------------------------------
    def close(self) -> None:  # noqa: B027 - most backends hold nothing
        """Release what the store holds (S3: its transfer threads). Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def read_limited(store: TierStore, key: str, limit: int = MAX_MANIFEST_BYTES) -> bytes:
    """At most ``limit`` bytes of ``key`` through ``open_read``, else ``CorruptCheckpoint``."""
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


def hash_object(store: TierStore, key: str, buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES) -> tuple[int, str]:
    """(size, crc32c hex) of a stored object, streamed through ``open_read``."""
    with store.open_read(key) as fh:
        return checksum.hash_stream(fh, buffer_bytes)
