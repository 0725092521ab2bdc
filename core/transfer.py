"""The transfer engine under the pipeline tasks: verify a part, copy a part between tiers,
find committed parts. Catalog-free; plain values in, reports out, exceptions on failure.

A part is committed on a tier when its manifest is there. ``copy_part`` keeps that true:
each file is streamed once (read -> CRC32C -> write) into a staging name, checked (local
tiers read it back after fsync; S3 checks the server's full-object CRC32C), and published
under its final name only on a match; the manifest is written last. A rerun after any crash
skips the files already published and matching, so it resumes where it stopped. A large file
from a source that reads in ranges (S3) into a local destination is fetched as parallel ranged
reads written at their offsets (``put_written``), checked by the combined CRC32C.

``copy_part(check_source=True)`` makes the copy the source's verify too (a promotion reads
Tier 0 once): every byte read from the source is proven against the manifest on the way
(a file already at the destination is hashed at the source instead of copied), and a
mismatch found by the destination's check is attributed by re-reading that one source file:
bad there -> ``SourceMismatch`` (naming the files this call published, for the caller to
retract); good there -> the destination's fault, raised as before. Only the failure path
reads a source byte twice.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import BinaryIO, TypeVar, cast

from core import checksum, formats
from core.errors import ConflictError, CorruptCheckpoint, NotFound, PathEscape
from core.layout import checkpoint_prefix, parse_manifest_key
from core.manifest import FileEntry, Manifest
from core.manifest_build import read_manifest
from core.progress import moved
from core.storage.base import TierStore, hash_object

Progress = Callable[[int], None]


class SourceMismatch(CorruptCheckpoint):
    """A ``copy_part(check_source=True)`` found the source's bytes differ from the manifest.

    ``published`` lists the destination keys this call published before it stopped (whole,
    matching files of an uncommitted part: the manifest is never written after a mismatch)."""

    def __init__(self, message: str, *, path: str | None = None, published: Sequence[str] = ()):
        super().__init__(message, path=path)
        self.published = list(published)
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class TransferReport:
    files: int  # files copied now
    bytes: int  # bytes copied now
    seconds: float
    skipped: int  # files already published and matching (a resumed or repeated copy)
    first_byte_seconds: float | None = None  # from the start to the first byte read from the source (None: none read)


@dataclass(frozen=True)
class VerifyReport:
    files: int
    bytes: int
    seconds: float
    format: str


def _key(prefix: str, rel: str) -> str:
    return f"{prefix}/{rel}" if prefix else rel


class _Counter:
    """Cumulative bytes across threads, reported to ``progress``; and when the first byte was
    read from the source (``first_at``, monotonic), the hop's first-byte latency: a file found
    already at the destination is counted (``read=False``) but moved no byte."""

    def __init__(self, progress: Progress | None):
        self.progress, self.done, self._lock = progress, 0, threading.Lock()
        self.first_at: float | None = None

    def add(self, n: int, read: bool = True) -> None:
        if read and n and self.first_at is None:  # a race between two first reads keeps either: both are first
            self.first_at = time.monotonic()
        if self.progress is None:
            return
        with self._lock:
            self.done += n
            done = self.done
        self.progress(done)


class _CountingReader:
    """The reader ``put_verified`` is handed: counts the bytes read (or copied in the kernel)."""

    def __init__(self, inner: BinaryIO, counter: _Counter, *, holds: Callable[[], bool] | None = None):
        self.inner, self.counter = inner, counter
        self._holds = holds  # asked only by a store that shares content (``stored_content``)
        if hasattr(inner, "readinto"):
            self._inner_readinto = inner.readinto
            self.readinto = self._readinto

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        self.counter.add(len(data))
        return data

    def _readinto(self, buf: bytearray | memoryview) -> int:
        n = self._inner_readinto(buf) or 0
        self.counter.add(n)
        return n

    def fileno(self) -> int:  # lets a local destination copy in the kernel
        return self.inner.fileno()

    @property
    def stored_content(self) -> bool:
        """Whether this is the source tier's own stored content (``TierStore.holds_content``)."""
        return self._holds is not None and self._holds()

    def note_copied(self, n: int) -> None:
        self.counter.add(n)
        inner = getattr(self.inner, "note_copied", None)  # a reader that counts, too (benchmarks)
        if inner is not None:
            inner(n)


@dataclass(frozen=True)
class WorkerPriority:
    """The CPU and I/O priority the transfer's worker threads take on (each thread its own:
    Linux keeps niceness and I/O priority per thread, so the caller's thread is untouched).
    ``nice`` is added to the thread's niceness; ``io_class`` 'best-effort' is that class at
    its lowest level (7), 'idle' the idle class, 'unchanged' leaves it."""

    nice: int = 0
    io_class: str = "unchanged"

    def apply(self) -> None:
        """Lower the calling thread to this priority (idempotent: ``nice`` above the process's)."""
        tid = threading.get_native_id()
        try:
            target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + self.nice)
            if self.nice and os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
            if self.io_class in _IO_CLASSES:
                _ioprio_set(tid, _IO_CLASSES[self.io_class])
        except OSError as exc:  # a platform or sandbox without it: the copy runs anyway
            _warn_once(f"could not lower the copy threads' priority ({self}): {exc}")


NORMAL = WorkerPriority()


def run_at(priority: WorkerPriority, fn: Callable[[], _R]) -> _R:
    """``fn()`` on a thread of its own at ``priority`` (the caller's thread keeps its own, and
    threads ``fn`` starts inherit the lower one); context variables go along. NORMAL: here."""
    if priority == NORMAL:
        return fn()
    import contextvars

    ctx = contextvars.copy_context()
    results: list[_R] = []
    errors: list[BaseException] = []

    def body() -> None:
        priority.apply()
        try:
            results.append(ctx.run(fn))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=body, name="ckpt-lowered")
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    return results[0]
_IO_CLASSES = {"best-effort": (2 << 13) | 7, "idle": 3 << 13}  # IOPRIO_PRIO_VALUE(class, level)
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        logging.getLogger("ckpt.transfer").warning(msg)


def _ioprio_set(tid: int, value: int) -> None:
    """``ioprio_set(IOPRIO_WHO_PROCESS, tid, value)`` (no wrapper in Python's os module)."""
    import ctypes
    import platform

    nr = _IOPRIO_SET.get(platform.machine())
    if nr is None or not sys.platform.startswith("linux"):
        raise OSError(f"ioprio_set is not known on {sys.platform}/{platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(nr, 1, tid, value) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _run_all(fn: Callable[[_T], _R], items: Sequence[_T], parallelism: int,
             priority: WorkerPriority = NORMAL) -> list[_R]:
    """fn over items in a bounded pool; the first exception cancels what has not started."""
    if not items:
        return []
    init = priority.apply if priority != NORMAL else None
    with ThreadPoolExecutor(max(1, min(parallelism, len(items))), thread_name_prefix="ckpt-xfer",
                            initializer=init) as pool:
        futures = [pool.submit(fn, it) for it in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and not f.cancelled():
                exc = f.exception()
                if exc is not None:
                    for g in futures:
                        g.cancel()
                    raise exc
        return [f.result() for f in futures]


def _hash_stored(store: TierStore, key: str, rel: str, entry: FileEntry, buffer_bytes: int) -> None:
    try:
        size, crc = hash_object(store, key, buffer_bytes)
    except NotFound:
        raise CorruptCheckpoint(f"{rel}: missing from {store.url_for(key)}", path=rel) from None
    if size != entry.size:
        raise CorruptCheckpoint(f"{rel}: size {size} != manifest {entry.size}", path=rel)
    if crc != entry.checksum:
        raise CorruptCheckpoint(f"{rel}: crc32c {crc} != manifest {entry.checksum}", path=rel)


def verify_part(
    store: TierStore,
    prefix: str,
    manifest: Manifest,
    *,
    parallelism: int = 4,
    buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES,
    deep: bool = True,
    priority: WorkerPriority = NORMAL,
) -> VerifyReport:
    """Prove the part under ``prefix`` matches ``manifest``: sizes, checksums and format.

    ``deep`` re-reads every byte; ``deep=False`` lets the store prove it its own way
    (``verify_object``: S3 compares the server's full-object CRC32C without a download; local
    tiers read anyway). Raises ``CorruptCheckpoint`` naming the first bad file and why.
    """
    t0 = time.monotonic()
    if manifest.algorithm != checksum.ALGORITHM:
        raise CorruptCheckpoint(f"unsupported checksum algorithm {manifest.algorithm!r}")

    def one(entry: FileEntry) -> None:
        key = _key(prefix, entry.path)
        if deep:
            _hash_stored(store, key, entry.path, entry, buffer_bytes)
            return
        try:
            store.verify_object(key, entry.size, entry.checksum)
        except NotFound:
            raise CorruptCheckpoint(f"{entry.path}: missing from {store.url_for(key)}", path=entry.path) from None
        except CorruptCheckpoint as exc:
            raise CorruptCheckpoint(str(exc), path=entry.path) from None
        moved()  # proved without a byte read here (S3's own checksum): progress all the same

    _run_all(one, list(manifest.files), parallelism, priority)
    sizes = {f.path: f.size for f in manifest.files}
    formats.validate(manifest.format, sizes, lambda rel: store.open_read(_key(prefix, rel)),
                     complete=manifest.parts == 1)
    return VerifyReport(len(manifest.files), manifest.total_bytes, time.monotonic() - t0, manifest.format)


def _already_there(store: TierStore, key: str, entry: FileEntry) -> bool:
    """True if ``key`` holds exactly this file; ConflictError if it holds something else."""
    try:
        store.verify_object(key, entry.size, entry.checksum)
    except NotFound:
        return False
    except CorruptCheckpoint as exc:
        raise ConflictError(f"{store.url_for(key)} holds different bytes ({exc}); refusing to overwrite") from None
    return True


def copy_part(
    src_store: TierStore,
    src_prefix: str,
    dst_store: TierStore,
    dst_prefix: str,
    manifest: Manifest,
    *,
    parallelism: int = 4,
    progress: Progress | None = None,
    check_source: bool = False,
    buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES,
    priority: WorkerPriority = NORMAL,
    confirm: Callable[[], Manifest] | None = None,
) -> TransferReport:
    """Copy one committed part to another tier and commit it there (manifest last).

    Every file is read once from the source and checked against the manifest as it streams;
    a mismatch (bit flip, truncation at the source) raises ``CorruptCheckpoint`` and
    publishes nothing for that file, and the manifest is never written. Files already at the
    destination and matching are skipped. ``StorageFull`` leaves no staging data behind.
    ``progress(bytes_done)`` receives the cumulative bytes read (from several threads).

    ``priority``: the CPU and I/O priority of the worker threads (``WorkerPriority``).

    ``confirm``: the manifest to commit, asked for once every file is in (e.g. the source's
    manifest, read while the files streamed and proven against the catalog, which listed the
    files to copy: one round trip less before the first byte). It must describe the same files
    (the same digest) as ``manifest``, else ``CorruptCheckpoint`` and nothing is committed; an
    error it raises goes on unchanged.

    ``check_source``: the copy is also the source's verify (module doc): every file is proven
    at the source, a source mismatch raises ``SourceMismatch`` and a file missing at the
    source raises ``NotFound`` (the verdicts ``verify_part`` would give the source).
    """
    t0 = time.monotonic()
    manifest_key = _key(dst_prefix, manifest.name)
    marker = manifest.to_json()
    counter = _Counter(progress)
    published: list[str] = []  # list.append is atomic: the pool's threads share it

    def source_bad(entry: FileEntry) -> CorruptCheckpoint | None:
        try:
            _hash_stored(src_store, _key(src_prefix, entry.path), entry.path, entry, buffer_bytes)
        except CorruptCheckpoint as exc:
            return exc
        return None

    def one(entry: FileEntry) -> int:
        key = _key(dst_prefix, entry.path)
        if check_source:  # a link out of the source tier is as bad as a bit flip (verify_part's verdict)
            try:
                src_store.stat(_key(src_prefix, entry.path))
            except PathEscape as exc:
                raise SourceMismatch(str(exc), path=entry.path) from None
        if _already_there(dst_store, key, entry):
            if check_source and (bad := source_bad(entry)) is not None:
                raise SourceMismatch(str(bad), path=entry.path)
            counter.add(entry.size, read=False)
            return -1
        try:
            if _ranged(src_store, dst_store, entry.size):
                _fetch_ranged(src_store, _key(src_prefix, entry.path), dst_store, key, entry, counter)
                return entry.size
            with src_store.open_read(_key(src_prefix, entry.path)) as reader:
                # duck-typed: it has the reads put_verified makes (read, readinto, fileno, note_copied)
                counting = cast(BinaryIO, _CountingReader(
                    reader, counter, holds=lambda: src_store.holds_content(reader, entry.size, entry.checksum)))
                dst_store.put_verified(key, counting, entry.size, entry.checksum)
        except NotFound:
            if check_source:
                raise NotFound(f"{entry.path}: missing from {src_store.url_for(src_prefix)}") from None
            if confirm is not None:  # the part gone whole, manifest too, is missing (NotFound), not corrupt
                confirm()
            raise CorruptCheckpoint(f"{entry.path}: missing at the source", path=entry.path) from None
        except CorruptCheckpoint as exc:
            if check_source and (bad := source_bad(entry)) is not None:  # the source's fault, not the copy's
                raise SourceMismatch(str(bad), path=entry.path) from None
            raise CorruptCheckpoint(str(exc), path=entry.path) from None
        published.append(key)
        return entry.size

    committed = dst_store.stat(manifest_key) is not None
    if committed and _commits_other(dst_store, manifest_key, manifest):
        raise ConflictError(f"{dst_store.url_for(manifest_key)} commits a different part; refusing to overwrite")
    try:
        results = _run_all(one, list(manifest.files), parallelism, priority)
    except SourceMismatch as exc:  # every worker has stopped: ``published`` is complete
        raise SourceMismatch(str(exc), path=exc.path, published=published) from None
    if confirm is not None:
        final = confirm()
        if final.digest() != manifest.digest() or final.name != manifest.name:
            raise CorruptCheckpoint(f"{src_store.url_for(_key(src_prefix, manifest.name))} describes other files "
                                    "than were copied", path=manifest.name)
        marker = final.to_json()
    if not committed:
        counter.add(0)  # the caller's last word first (a claim lost while the last file was written: no commit)
        dst_store.write_small_atomic(manifest_key, marker)
    copied = [r for r in results if r >= 0]
    first = counter.first_at - t0 if counter.first_at is not None else None
    return TransferReport(len(copied), sum(copied), time.monotonic() - t0, len(results) - len(copied), first)


def _ranged(src: TierStore, dst: TierStore, size: int) -> bool:
    """Whether a file is fetched as parallel ranged reads: a source that offers them for this
    size (S3 above ``ranged_threshold``) into a destination that can be written at offsets."""
    reads_ranged = getattr(src, "reads_ranged", None)
    return reads_ranged is not None and reads_ranged(size) and hasattr(dst, "put_written")


def _fetch_ranged(src: TierStore, src_key: str, dst: TierStore, dst_key: str, entry: FileEntry,
                  counter: _Counter) -> None:
    def write(fd: int) -> tuple[int, str]:
        return src.read_ranges_into(src_key, fd, entry.size, counter.add)  # type: ignore[attr-defined]

    dst.put_written(dst_key, write, entry.size, entry.checksum)  # type: ignore[attr-defined]


def _commits_other(store: TierStore, key: str, manifest: Manifest) -> bool:
    """True when the committed manifest at ``key`` describes different content than ``manifest``."""
    try:
        other = Manifest.from_json(store.read_small(key))
    except CorruptCheckpoint:
        return True
    return other.digest() != manifest.digest()


def find_committed(store: TierStore, prefix: str = "") -> Iterator[tuple[str, int, int, int, str]]:
    """(run, step, part, parts, attempt) of every committed part under the tier (or ``prefix``),
    found by the manifests' names; sorted by key."""
    for found, _ in committed_at(store, prefix):
        yield found


def committed_at(store: TierStore, prefix: str = "") -> Iterator[tuple[tuple[str, int, int, int, str], float | None]]:
    """``find_committed``'s parts, each with when its manifest was written (seconds since the
    epoch on the tier's clock; None where the backend does not say)."""
    for info in store.list(prefix):
        found = parse_manifest_key(info.key)
        if found is not None:
            yield found, info.modified


def read_committed(store: TierStore, run: str, step: int, part: int = 0, parts: int = 1, attempt: str = "") -> Manifest:
    """The committed manifest of (run, step, part) of ``attempt`` on ``store`` (``NotFound`` if none)."""
    return read_manifest(store, checkpoint_prefix(run, step, attempt), part, parts)
