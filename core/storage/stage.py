"""Where a restore lands: a private, hidden staging folder beside the destination, filled part
by part, checked file by file, made durable and renamed into place whole.

Contract:
- Nothing in the stage is visible under its final name until ``publish`` renames the folder,
  so files are written straight under their keys (no per-file staging name, link and
  directory fsync, as a shared tier needs). A file stays in the stage only once its bytes
  matched the manifest; a mismatch removes it and raises ``CorruptCheckpoint``. So a file
  already there when another copy is tried is good and is not fetched again.
- From a local tier (``fetch_local_part``) each file is copied inside the kernel
  (``copy_file_range``) and the copy is then hashed: less CPU than streaming it through
  Python (read, checksum, write), and it checks the bytes that landed rather than the bytes
  that were sent. Other tiers (S3) stream through
  ``core.transfer.copy_part`` into ``RestoreStage.put_verified``.
- Durability: each file is handed, once it matched, to a pool of fsync threads, so its
  writeback overlaps the copy of the next files (an fsync inside the copy threads stalls them;
  one fsync of everything at the end leaves the disk idle during the copy). ``publish`` waits
  for them, fsyncs every file and folder once more (cheap when clean; it covers files from an earlier copy attempt),
  renames, fsyncs the parent. No read-back of what was just written: it would come from the
  page cache and prove nothing more than the checksum did.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Self

from core import checksum
from core.errors import ConflictError, CorruptCheckpoint
from core.manifest import FileEntry, Manifest
from core.storage.base import ObjectInfo, TierStore
from core.storage.local import LocalStore, fsync_dir
from core.storage.writeback import writing

FSYNC_PARALLELISM = 8  # files fsynced at once when a restore is published
CLONE_CHUNK_BYTES = 64 * 1024 * 1024  # one copy_file_range call (progress moves per chunk)
_NO_CLONE = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


class RestoreStage(LocalStore):
    """The staging folder's parent as a store: keys are ``<stage name>/<file>``. Use as a
    context manager: leaving it waits for the fsyncs in flight."""

    def __init__(self, root: Path, *, buffer_bytes: int, fsync_parallelism: int = FSYNC_PARALLELISM):
        super().__init__(root, 0, buffer_bytes=buffer_bytes)
        self._fsyncs = ThreadPoolExecutor(fsync_parallelism, thread_name_prefix="restore-fsync")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

    def sync_soon(self, path: Path) -> None:
        """Start making ``path`` durable without holding up the caller."""
        with self._lock:
            self._pending.append(self._fsyncs.submit(_fsync_file, str(path)))

    def settle(self) -> None:
        """Wait for every fsync started so far; raise the first failure (EIO, ENOSPC)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._fsyncs.shutdown(wait=True)

    def put_verified(self, key: str, reader: BinaryIO, size: int, checksum_hex: str) -> ObjectInfo:
        """Stream ``reader`` into ``key``, checksummed as it goes; kept only on a match."""
        return self.put_written(
            key, lambda fd: checksum.hash_stream(reader, self.buffer_bytes,
                                                 writing(fd, lambda chunk: _write_all(fd, chunk))),
            size, checksum_hex)

    def put_written(self, key: str, write: Callable[[int], tuple[int, str]], size: int,
                    checksum_hex: str) -> ObjectInfo:
        """``write(fd)`` fills ``key`` (ranged reads at offsets) and returns what it wrote's
        (size, crc32c); kept only on a match, as ``put_verified``."""
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _check(key, write(fd), size, checksum_hex)
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.sync_soon(target)
        return ObjectInfo(key=key, size=size, checksum=checksum_hex)


def fetch_local_part(src: TierStore, src_prefix: str, stage: RestoreStage, dst_prefix: str, manifest: Manifest,
                     *, parallelism: int, progress: Callable[[int], None]) -> None:
    """Copy a part from a local tier into the stage: in-kernel copy, then hash the copy against
    the manifest; the manifest last. ``progress(bytes_done)`` as ``copy_part`` calls it."""
    lock, done = threading.Lock(), [0]

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            now = done[0]
        progress(now)

    def one(entry: FileEntry) -> None:
        key = f"{dst_prefix}/{entry.path}"
        target = stage.path(key)
        if not target.exists():  # else: kept by an earlier copy, so it matched the manifest
            try:
                source = src.local_path(f"{src_prefix}/{entry.path}")
                assert source is not None, "fetch_local_part needs a store on a local folder"
                target.parent.mkdir(parents=True, exist_ok=True)
                _clone(source, target, stage.buffer_bytes, advance)
                _check(key, checksum.hash_file(target, stage.buffer_bytes), entry.size, entry.checksum)
                stage.sync_soon(target)
            except FileNotFoundError:
                target.unlink(missing_ok=True)
                raise CorruptCheckpoint(f"{entry.path}: missing at the source", path=entry.path) from None
            except BaseException:
                target.unlink(missing_ok=True)
                raise
        else:
            advance(entry.size)

    with ThreadPoolExecutor(max(1, min(parallelism, len(manifest.files)))) as pool:
        for _ in pool.map(one, manifest.files):
            pass
    stage.write_small_atomic(f"{dst_prefix}/{manifest.name}", manifest.to_json())


def _clone(source: Path, target: Path, buffer_bytes: int, advance: Callable[[int], None]) -> None:
    """Copy ``source`` to a new ``target`` inside the kernel; stream where the kernel cannot."""
    with open(source, "rb", buffering=0) as fin, open(target, "xb", buffering=0) as fout:
        while True:
            try:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), CLONE_CHUNK_BYTES)
            except OSError as exc:
                if exc.errno not in _NO_CLONE:
                    raise
                def sink(chunk: memoryview) -> None:
                    _write_all(fout.fileno(), chunk)
                    advance(len(chunk))

                checksum.hash_stream(fin, buffer_bytes, sink)
                return
            if n == 0:
                return
            advance(n)


def _check(key: str, got: tuple[int, str], size: int, checksum_hex: str) -> None:
    if got != (size, checksum_hex):
        raise CorruptCheckpoint(f"{key}: size {got[0]} crc32c {got[1]} != manifest size {size} "
                                f"crc32c {checksum_hex}", path=key)


def _write_all(fd: int, chunk: memoryview) -> None:
    while chunk:
        chunk = chunk[os.write(fd, chunk):]


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(stage: Path, target: Path, *, parallelism: int = FSYNC_PARALLELISM,
            pending: RestoreStage | None = None) -> None:
    """Rename the complete ``stage`` onto ``target`` (absent or empty) in one step, durably:
    the fsyncs in flight (``pending``) are awaited, every file and folder in it is fsynced,
    the parent after."""
    if pending is not None:
        pending.settle()
    folders, files = [], []
    for folder, _dirs, names in os.walk(stage, topdown=False):
        folders.append(folder)
        files += [os.path.join(folder, n) for n in names]
    with ThreadPoolExecutor(parallelism) as pool:
        for _ in pool.map(_fsync_file, files):
            pass
    for folder in folders:
        fsync_dir(folder)
    try:
        os.rename(stage, target)  # replaces an empty folder atomically; refuses a non-empty one
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise ConflictError(f"{target} was filled while restoring; nothing was overwritten") from None
        raise
    fsync_dir(target.parent)
