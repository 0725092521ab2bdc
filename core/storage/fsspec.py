"""Tier 0/1 on any other fsspec filesystem (``memory://`` in the contract suite, remote
filesystems in principle), with the same contract as ``LocalStore`` through fsspec's file
API. Its publish is ``mv`` of a staging file, atomic only where the filesystem's rename is.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, BinaryIO

from core import checksum
from core.errors import BadInput, ConflictError, NotFound, StorageUnavailable
from core.layout import STAGING_MARK, is_staging, staging_name
from core.paths import safe_relpath
from core.settings import display_url
from core.storage.base import ObjectInfo, TierStore, hash_object
from core.storage.common import check_match, map_os_error
from core.storage.registry import Backend, io_buffer, register

if TYPE_CHECKING:
    from core.settings import Settings


class FsspecStore(TierStore):
    """A tier on any fsspec filesystem (``memory://``, ``sftp://``...), same contract."""

    def __init__(
        self, url: str, tier: int, *, buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES, **storage_options: object
    ) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.tier = tier
        self.root_url = display_url(url.rstrip("/"))  # recorded and shown; ``fs`` holds the credentials
        self.buffer_bytes = buffer_bytes

    def _p(self, key: str) -> str:
        return f"{self.root}/{safe_relpath(key)}"

    def _key(self, path: str) -> str:
        path = path.rstrip("/")
        return path[len(self.root) + 1:] if path.startswith(self.root + "/") else path.lstrip("/")

    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        try:
            fh = self.fs.open(self._p(key), "rb")
        except FileNotFoundError:
            raise NotFound(f"{self.url_for(key)} does not exist") from None
        with fh:
            yield fh

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            info = self.fs.info(self._p(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key=key, size=int(info["size"])) if info.get("type") == "file" else None

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._p(prefix) if prefix else self.root
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        out = [
            ObjectInfo(key=self._key(p), size=int(info["size"]), modified=_mtime(info))
            for p, info in found.items()
            if not is_staging(p.rsplit("/", 1)[-1]) and info.get("type") == "file"
        ]
        return sorted(out, key=lambda o: o.key)

    def folders(self) -> tuple[str, ...]:
        try:
            found = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return ()
        return tuple(sorted(self._key(i["name"]) for i in found if i.get("type") == "directory"))

    def _hash(self, key: str) -> tuple[int, str]:
        return hash_object(self, key, self.buffer_bytes)

    def _same_or_conflict(self, key: str, size: int, checksum_hex: str) -> None:
        got = self._hash(key)
        if got != (size, checksum_hex):
            raise ConflictError(f"{self.url_for(key)} already exists with different bytes; refusing to overwrite")

    def root_exists(self) -> bool:
        return bool(self.fs.isdir(self.root))

    def _staged_write(self, key: str, reader: BinaryIO, size: int, checksum_hex: str) -> None:
        if not self.root_exists():  # a store never creates its root (the tier may not be mounted)
            raise StorageUnavailable(f"tier root {self.root_url} does not exist; a store never creates it")
        path = self._p(key)
        parent, name = path.rsplit("/", 1)
        staging = f"{parent}/{staging_name(name)}"
        try:
            with self.fs.open(staging, "wb") as out:
                got = checksum.hash_stream(reader, self.buffer_bytes, out.write)
            check_match(key, size, checksum_hex, *got, "source")
            with self.fs.open(staging, "rb") as back:
                check_match(key, size, checksum_hex, *checksum.hash_stream(back, self.buffer_bytes), "read-back")
            if self.fs.exists(path):
                self._same_or_conflict(key, size, checksum_hex)
            else:
                self.fs.mv(staging, path)
        except OSError as exc:
            raise map_os_error(exc, self.url_for(key)) from exc
        finally:
            if self.fs.exists(staging):
                self.fs.rm(staging)

    def put_verified(self, key: str, reader: BinaryIO, size: int, checksum: str) -> ObjectInfo:
        if self.stat(key) is not None:
            self._same_or_conflict(key, size, checksum)
        else:
            self._staged_write(key, reader, size, checksum)
        return ObjectInfo(key=key, size=size, checksum=checksum)

    def write_small_atomic(self, key: str, data: bytes) -> ObjectInfo:
        return self.put_verified(key, io.BytesIO(data), len(data), checksum.hash_bytes(data))

    def verify_object(self, key: str, size: int, checksum: str) -> None:
        if self.stat(key) is None:
            raise NotFound(f"{self.url_for(key)} does not exist")
        check_match(key, size, checksum, *self._hash(key), "stored")

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise BadInput("refusing to delete the whole tier (empty prefix)")
        n = len(self.list(prefix))
        path = self._p(prefix)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        return n

    def delete(self, key: str) -> bool:
        path = self._p(key)
        try:
            if self.fs.isdir(path):
                raise BadInput(f"{self.url_for(key)} is a folder, not an object")
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True

    def sweep_staging(self, prefix: str, older_than_s: float = 3600.0, *, keys: Iterable[str] | None = None) -> int:
        """Remove staging files under ``prefix`` whose modification time (where the filesystem
        reports one) is older than ``older_than_s``; with ``keys``, only those objects'."""
        only = None if keys is None else {tuple(self._p(k).rsplit("/", 1)) for k in keys}
        base = self._p(prefix) if prefix else self.root
        cutoff, count = time.time() - older_than_s, 0
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return 0
        for path, info in found.items():
            folder, name = path.rsplit("/", 1)
            if not is_staging(name):
                continue
            if only is not None and (folder, name[len(STAGING_MARK):].split("-", 2)[-1]) not in only:
                continue
            mtime = _mtime(info)
            if mtime is not None and mtime > cutoff:
                continue
            try:
                self.fs.rm_file(path)
                count += 1
            except FileNotFoundError:
                continue
        return count


def _mtime(info: dict) -> float | None:
    """Seconds since the epoch of an fsspec info dict's modification time, if it has one."""
    value = info.get("mtime", info.get("created", info.get("LastModified")))
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


def fsspec_knows(scheme: str) -> bool:
    """Whether fsspec has an implementation of ``scheme`` (each protocol of a chained URL),
    built in or registered at run time (``fsspec.register_implementation``)."""
    import fsspec

    known = set(fsspec.available_protocols()) | set(fsspec.registry)
    return all(p in known for p in scheme.split("::"))


def open_fsspec(url: str, tier: int, settings: Settings | None) -> FsspecStore:
    return FsspecStore(url, tier, buffer_bytes=io_buffer(settings))


register(Backend(name="fsspec", schemes=(), factory=open_fsspec, accepts=fsspec_knows), fallback=True)

