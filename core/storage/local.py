"""Tier 0/1 on a local folder (a path or a ``file://`` URL): os-level I/O, fsync, confinement.

Writes stream read -> CRC32C -> ``os.write`` into a hidden staging file beside the target
(or copy in the kernel from a local source), fsync, read back and compare, and publish with
``link`` (which refuses to replace an existing file, so a different object is never
overwritten); folder fsyncs are batched (``flush``). Reads are confined under the root with
symlinks resolved (``core.paths.confine_local``). Writes and deletes never go through a
symlink under the root: a key whose folder is reached through a link is refused
(``PathEscape``), and a link at the key itself is removed, never its target. The read-back
proves what the file system returns after fsync: buffered, usually from its page cache, not
the media; with ``direct_io`` (``core.storage.direct``) what the device or the file servers
hold. Media faults that appear later are the scrub's job (``verify_object``).
"""

from __future__ import annotations

import errno
import io
import os
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from core import checksum
from core.checksum import hash_stream
from core.errors import BadInput, CkptError, ConflictError, NotFound, PathEscape, StorageUnavailable
from core.layout import STAGING_MARK, is_manifest_name, is_staging, is_tomb, staging_name, tomb_name, tomb_token
from core.manifest import Manifest
from core.paths import confine_local, safe_relpath
from core.progress import moved
from core.storage import direct
from core.storage.base import ObjectInfo, TierStore, Tomb
from core.storage.common import check_match, map_os_error
from core.storage.content import CONTENT_DIR, SHARED_TIERS, ContentStore
from core.storage.registry import PLAIN_PATH, Backend, io_buffer, register
from core.storage.writeback import writing
from core.tiers import Tier

if TYPE_CHECKING:
    from core.settings import Settings


def _write_all(fd: int, data: memoryview) -> None:
    """os.write until every byte is written (short writes happen on some filesystems)."""
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _copy_range(src_fd: int, dst_fd: int, count: int) -> int:
    """One in-kernel copy step (``copy_file_range``) from the current offsets; bytes copied."""
    return os.copy_file_range(src_fd, dst_fd, count)


def local_fd(reader: BinaryIO) -> int | None:
    """The descriptor of ``reader`` when it is a regular local file (kernel copy possible)."""
    try:
        fd = reader.fileno()
        return fd if stat_mod.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None


def kernel_copy(
    src_fd: int, dst_fd: int, limit: int, note: Callable[[int], object] | None = None
) -> int | None:
    """Copy up to ``limit`` bytes in the kernel (no user-space buffer); the byte count, or
    None when this pair of files cannot (cross-device on some kernels, unsupported file
    system) and nothing was copied. ``note(n)`` hears about each step, for progress."""
    done = 0
    while done < limit:
        try:
            n = _copy_range(src_fd, dst_fd, min(limit - done, 1 << 30))
        except OSError as exc:
            if done == 0 and exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                return None
            raise
        if n == 0:
            break
        done += n
        moved()
        if note is not None:
            note(n)
    return done


def _noting(reader: BinaryIO, sink: Callable[[memoryview], None]) -> Callable[[memoryview], None]:
    """``sink``, telling ``reader.note_copied`` (where it has one) of each chunk's bytes."""
    note = getattr(reader, "note_copied", None)
    if note is None:
        return sink

    def noted(chunk: memoryview) -> None:
        sink(chunk)
        note(len(chunk))
    return noted


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mkdirs(root: Path, path: Path) -> list[Path]:
    """Create ``path`` and its missing parents up to ``root``, which must exist (a store never
    creates its tier root: a root that is not there is a tier not mounted, ``StorageUnavailable``);
    return the folders whose entries changed."""
    if not root.is_dir():
        raise StorageUnavailable(f"tier root {root} does not exist (not mounted?); a store never creates it")
    missing = []
    p = path
    while not p.is_dir() and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise map_os_error(exc, str(path)) from exc
    return [m.parent for m in missing]


class LocalStore(TierStore):
    """A tier rooted at a local folder. ``root`` may be a path or a ``file://`` URL."""

    def __init__(self, root: str | os.PathLike, tier: int, *, buffer_bytes: int = checksum.DEFAULT_BUFFER_BYTES,
                 direct_io: bool = False, shared_content: bool = False):
        root = str(root)
        root = root.removeprefix("file://")
        self.root = Path(root).expanduser().absolute()
        self.tier = tier
        self.root_url = str(self.root)
        self.buffer_bytes = buffer_bytes
        self.direct_io = direct_io  # bulk reads and writes bypass the page cache (core.storage.direct)
        self._unsynced: set[Path] = set()  # folders with published entries not yet fsynced
        self._lock = threading.Lock()
        # each content's bytes once, checkpoint files linked to them (core.storage.content)
        self.content = ContentStore(self.root, buffer_bytes) if shared_content else None

    def path(self, key: str) -> Path:
        """The local path of ``key`` for reading, confined under the root (symlinks resolved)."""
        return confine_local(self.root, key)

    def local_path(self, key: str) -> Path | None:
        return self.path(key)

    def holds_content(self, reader: BinaryIO, size: int, checksum: str) -> bool:
        if self.content is None or (fd := local_fd(reader)) is None:
            return False
        try:
            ours, stored = os.fstat(fd), os.stat(self.content.entry(size, checksum))
        except (OSError, ValueError):
            return False
        return (ours.st_dev, ours.st_ino) == (stored.st_dev, stored.st_ino)

    def in_place(self, key: str = "") -> Path | None:
        return self.path(key) if key else self.root

    def root_exists(self) -> bool:
        return self.root.is_dir()

    def write_path(self, key: str) -> Path:
        """The local path of ``key`` for a write or a delete: under the (resolved) root with no
        symlink on the way. A link in a folder of the key raises ``PathEscape`` (through it a
        write or delete would land on another checkpoint's bytes); a link at the key itself is
        returned as it is, for the caller to treat as the object (never its target)."""
        safe_relpath(key)
        here = self.root.resolve()  # the root itself may be a link an operator configured
        *folders, name = key.split("/")
        for seg in folders:
            here = here / seg
            if here.is_symlink():
                raise PathEscape(f"{self.url_for(key)}: {here} is a symlink; writes and deletes "
                                 "never go through a link under a tier root")
        return here / name

    # --- reads -------------------------------------------------------------------------
    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        with ExitStack() as stack:  # only the open's errors are mapped, not the caller's
            try:
                fh = stack.enter_context(open(self.path(key), "rb", buffering=0))
            except FileNotFoundError:
                raise NotFound(f"{self.url_for(key)} does not exist") from None
            except OSError as exc:
                raise map_os_error(exc, key) from exc
            yield fh

    def stat(self, key: str) -> ObjectInfo | None:
        p = self.path(key)
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key=key, size=st.st_size) if p.is_file() else None

    def list(self, prefix: str) -> list[ObjectInfo]:
        root = self.root.resolve()
        base = self.path(prefix) if prefix else root
        out: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)) and not is_tomb(d)
                           and d != CONTENT_DIR]
            for name in filenames:
                full = os.path.join(dirpath, name)
                if is_staging(name) or os.path.islink(full):
                    continue
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                try:
                    st = os.stat(full)
                    out.append(ObjectInfo(key=rel, size=st.st_size, modified=st.st_mtime))
                except FileNotFoundError:
                    continue
        return sorted(out, key=lambda o: o.key)

    def folders(self) -> tuple[str, ...]:
        try:
            with os.scandir(self.root.resolve()) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False) and not is_staging(e.name)
                         and e.name != CONTENT_DIR]
        except FileNotFoundError:
            return ()
        return tuple(sorted(names))

    def _hash(self, path: Path) -> tuple[int, str]:
        if self.direct_io:
            return direct.hash_file(path, self.buffer_bytes)
        return checksum.hash_file(path, self.buffer_bytes)

    # --- writes ------------------------------------------------------------------------
    def _publish(self, staging: Path, target: Path, key: str, size: int, checksum_hex: str) -> bool:
        """Link ``staging`` to ``target`` without replacing; True if published, False if an
        identical file was already there. Different bytes there raise ConflictError."""
        try:
            os.link(staging, target)
        except FileExistsError:
            self._same_or_conflict(target, key, size, checksum_hex)
            return False
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EOPNOTSUPP):
                raise map_os_error(exc, key) from exc
            if target.exists():  # no hard links here: check, then rename (small race window)
                self._same_or_conflict(target, key, size, checksum_hex)
                return False
            os.rename(staging, target)
        finally:
            staging.unlink(missing_ok=True)
        self._changed([target.parent])
        return True

    def _changed(self, folders: Iterable[Path]) -> None:
        with self._lock:
            self._unsynced.update(folders)

    def flush(self) -> None:
        """Make every name published so far durable (fsync each changed folder once).

        ``put_verified`` fsyncs the file's bytes before publishing it but leaves the folder
        fsync to here: one per folder instead of one per file. ``write_small_atomic`` (the
        commit marker) flushes before and after itself, so a marker is never durable before
        the names it commits; a crash before that loses names, never bytes under a name."""
        with self._lock:
            folders, self._unsynced = sorted(self._unsynced, key=lambda p: -len(p.parts)), set()
        for folder in folders:  # deepest first
            try:
                fsync_dir(folder)
            except FileNotFoundError:
                continue

    def _same_or_conflict(self, target: Path, key: str, size: int, checksum_hex: str) -> None:
        got = self._hash(target)
        if got != (size, checksum_hex):
            raise ConflictError(
                f"{self.url_for(key)} already exists with different bytes "
                f"(size {got[0]}, crc32c {got[1]}); refusing to overwrite"
            )

    @contextmanager
    def _staging(self, target: Path, key: str) -> Iterator[tuple[Path, int]]:
        """A new staging file beside ``target`` (path, write fd); removed unless published,
        OS errors mapped (ENOSPC -> StorageFull)."""
        self._changed(_mkdirs(self.root, target.parent))
        staging = target.parent / staging_name(target.name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            try:
                fd = os.open(staging, flags, 0o644)
            except FileNotFoundError:  # an emptied folder removed (``remove_empty``) since _mkdirs: again
                self._changed(_mkdirs(self.root, target.parent))
                fd = os.open(staging, flags, 0o644)
            try:
                yield staging, fd
            finally:
                os.close(fd)
        except OSError as exc:
            raise map_os_error(exc, self.url_for(key)) from exc
        finally:
            staging.unlink(missing_ok=True)

    def put_verified(self, key: str, reader: BinaryIO, size: int, checksum: str) -> ObjectInfo:
        """Copy into a staging file, fsync, read it back, publish only on a full match.

        From a local regular file (a reader with ``fileno()``) the bytes are copied in the
        kernel (``copy_file_range``: no trip through Python) and the read-back is the check;
        with ``direct_io`` they are streamed instead, read through the source's page cache into
        one aligned buffer, checked on the way and written with ``O_DIRECT``
        (``core.storage.direct``), and the read-back is direct too; from any other
        reader they are streamed and checked on the way in. A reader may offer
        ``note_copied(n)`` to hear of bytes it did not read itself.

        With a content store (``shared_content``) bytes the tier already holds are linked, not
        written: a stored candidate of the same size and CRC32C is compared byte for byte with
        the local source, and that comparison is the read-back of the linked bytes. A source
        that is not a local file (a body read from Tier 2) is written and verified first, then
        compared with the candidate the same way, and the candidate linked in its place when
        equal: the tier still holds the bytes once. A file published is remembered as the
        content (``core.storage.content``), which replaces a stored name only when its bytes differ.

        Postcondition on return: the bytes under ``key`` were fsynced, read back from this
        tier and match (size, checksum); the name itself is durable after ``flush`` (which the
        next ``write_small_atomic`` does first). Already there with the same bytes: no-op.
        """
        return self._put(key, reader, size, checksum, shared=self.content is not None)

    def _put(self, key: str, reader: BinaryIO, size: int, checksum: str, *, shared: bool) -> ObjectInfo:
        target = self.write_path(key)
        if target.is_symlink():
            raise PathEscape(f"{self.url_for(key)} is a symlink; refusing to write through it")
        if target.is_file():
            self._same_or_conflict(target, key, size, checksum)
            return ObjectInfo(key=key, size=size, checksum=checksum)
        src_fd = local_fd(reader)
        note = getattr(reader, "note_copied", None)
        if shared and src_fd is not None and self._link_stored(target, key, src_fd, note, size, checksum):
            return ObjectInfo(key=key, size=size, checksum=checksum)
        with self._staging(target, key) as (staging, fd):
            got: tuple[int, str] | None = None
            if src_fd is not None and self.direct_io:  # the source through its page cache, written directly
                got = direct.hash_fd(src_fd, self.buffer_bytes, _noting(reader, writing(fd, direct.DirectWriter(fd))),
                                     direct=False)
            elif src_fd is None or kernel_copy(src_fd, fd, size + 1, getattr(reader, "note_copied", None)) is None:
                got = hash_stream(reader, self.buffer_bytes, writing(fd, lambda chunk: _write_all(fd, chunk)))
            if got is not None:  # streamed: the source is checked as it went; a kernel copy is by the read-back
                check_match(key, size, checksum, *got, "source")
            os.fsync(fd)
            check_match(key, size, checksum, *self._hash(staging), "read-back")
            if shared and src_fd is None and self._link_written(staging, target, key, size, checksum):
                return ObjectInfo(key=key, size=size, checksum=checksum)
            published = self._publish(staging, target, key, size, checksum)
        if shared and published:
            self._remember(target, size, checksum)
        return ObjectInfo(key=key, size=size, checksum=checksum)

    def _link_stored(self, target: Path, key: str, src_fd: int, note: Callable[[int], object] | None, size: int,
                     checksum: str) -> bool:
        """Publish ``target`` as a link to the stored content when its bytes equal the source's."""
        assert self.content is not None
        self._changed(_mkdirs(self.root, target.parent))
        staging = target.parent / staging_name(target.name)
        try:
            if not self.content.link_same(src_fd, size, checksum, staging, note):
                return False
        except OSError as exc:
            raise map_os_error(exc, self.url_for(key)) from exc
        self._publish(staging, target, key, size, checksum)
        return True

    def _link_written(self, staging: Path, target: Path, key: str, size: int, checksum: str) -> bool:
        """For a source that is not a local file (Tier 2 rehydrating Tier 1, a restore), whose
        bytes could not be compared before they were written: publish ``target`` as a link to
        the stored content when its bytes equal the verified ``staging`` file's (compared now
        that they are here); False when there is none or it differs (the caller publishes
        ``staging``). The staging file's bytes were counted as they arrived: not again."""
        assert self.content is not None
        try:
            fd = os.open(staging, os.O_RDONLY)
        except OSError as exc:
            raise map_os_error(exc, self.url_for(key)) from exc
        try:
            return self._link_stored(target, key, fd, None, size, checksum)
        finally:
            os.close(fd)

    def _remember(self, target: Path, size: int, checksum: str) -> None:
        assert self.content is not None
        try:
            changed = self.content.remember(target, size, checksum)
        except OSError as exc:
            raise map_os_error(exc, str(target)) from exc
        if changed is not None:
            self._changed([changed])

    def put_written(self, key: str, write: Callable[[int], tuple[int, str]], size: int, checksum: str) -> ObjectInfo:
        """``put_verified`` for a writer that fills a file itself (parallel ranged reads
        writing at offsets): ``write(fd)`` fills the staging file and returns (size, crc32c
        hex) of what it wrote; then fsync, read-back and publish exactly as ``put_verified``
        (with a content store, as from a source that is not a local file)."""
        target = self.write_path(key)
        if target.is_symlink():
            raise PathEscape(f"{self.url_for(key)} is a symlink; refusing to write through it")
        if target.is_file():
            self._same_or_conflict(target, key, size, checksum)
            return ObjectInfo(key=key, size=size, checksum=checksum)
        with self._staging(target, key) as (staging, fd):
            check_match(key, size, checksum, *write(fd), "source")
            os.fsync(fd)
            check_match(key, size, checksum, *self._hash(staging), "read-back")
            if self.content is not None and self._link_written(staging, target, key, size, checksum):
                return ObjectInfo(key=key, size=size, checksum=checksum)
            published = self._publish(staging, target, key, size, checksum)
        if self.content is not None and published:
            self._remember(target, size, checksum)
        return ObjectInfo(key=key, size=size, checksum=checksum)

    def write_small_atomic(self, key: str, data: bytes) -> ObjectInfo:
        """Staging file + fsync + link + fsync dir. Existing same bytes: no-op; different
        bytes: ``ConflictError``.

        Before the marker, every folder under the marker's folder is fsynced (with whatever
        else this store published): names published by an earlier, crashed attempt that a
        rerun skipped are made durable too, so the marker never outlives a name it commits."""
        parent = self.write_path(key).parent
        if parent.is_dir():
            self._changed([parent, *(Path(d) for d, _, _ in os.walk(parent))])
        self.flush()  # a marker is never shared: its name commits one checkpoint alone
        info = self._put(key, io.BytesIO(data), len(data), checksum.hash_bytes(data), shared=False)
        self.flush()
        return info

    def verify_object(self, key: str, size: int, checksum: str) -> None:
        target = self.path(key)
        if not target.is_file():
            raise NotFound(f"{self.url_for(key)} does not exist")
        try:
            got = self._hash(target)
        except OSError as exc:
            raise map_os_error(exc, key) from exc
        check_match(key, size, checksum, *got, "stored")

    def delete(self, key: str) -> bool:
        """Unlink one file (a symlink there is unlinked itself) and fsync its folder."""
        target = self.write_path(key)
        try:
            if target.is_dir() and not target.is_symlink():
                raise BadInput(f"{self.url_for(key)} is a folder, not an object")
            target.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise map_os_error(exc, self.url_for(key)) from exc
        fsync_dir(target.parent)
        return True

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise BadInput("refusing to delete the whole tier (empty prefix)")
        base = self.write_path(prefix)
        if base.is_symlink() or base.is_file():  # a link is removed itself, never what it points at
            return int(self.delete(prefix))
        if not base.exists():
            return 0
        return self._remove_tree(base)

    # --- fenced deletes: a claim's tombstone ------------------------------------------------
    def bury(self, prefix: str, paths: Sequence[str] | None, *, token: str) -> Tomb:
        """Move what the claim ``token`` deletes into its tombstone beside ``prefix``
        (``.ckpt-tomb-<token>-<name>``): the whole folder in one rename (``paths`` None: the
        part owns it), else each of ``paths`` (a file or a link; anything else is not an object
        and stays), the manifest first as given. A tombstone of the same token found there is
        this claim's own, left by its earlier try: deleted first. Links are moved, never
        followed."""
        base = self.write_path(prefix)
        parent, _, name = prefix.rpartition("/")
        tomb_key = f"{parent}/{tomb_name(token, name)}" if parent else tomb_name(token, name)
        tomb = self.write_path(tomb_key)
        self._remove_tree(tomb)
        moved: list[tuple[str, str]] = []
        if paths is None:
            if self._move(base, tomb):
                moved.append((prefix, tomb_key))
        else:
            for rel in paths:
                src = self.write_path(f"{prefix}/{rel}")
                if src.is_symlink() or src.is_file():
                    (tomb / rel).parent.mkdir(parents=True, exist_ok=True)
                    if self._move(src, tomb / rel):
                        moved.append((f"{prefix}/{rel}", f"{tomb_key}/{rel}"))
        if moved:
            fsync_dir(base.parent)
        return Tomb(token, tuple(t for _, t in moved), folder=tomb_key, moved=tuple(moved))

    def exhume(self, tomb: Tomb) -> int:
        """Move back what ``tomb`` took where its name is still free: a file by a link (which
        never replaces a name a newer holder published), a folder by a rename (which refuses a
        folder that is not empty)."""
        back = 0
        for original, buried in reversed(tomb.moved):
            src, dst = self.write_path(buried), self.write_path(original)
            try:
                if src.is_dir() and not src.is_symlink():
                    os.rename(src, dst)
                else:
                    os.link(src, dst, follow_symlinks=False)
                    os.unlink(src)
            except OSError:  # the name was taken again (or the source went): theirs stays
                continue
            fsync_dir(dst.parent)
            back += 1
        return back

    def delete_tomb(self, tomb: Tomb, check: Callable[[], None]) -> int:
        """Delete the tombstone folder: the claim's alone, so no ``check`` is needed, and a
        worker that wakes after its claim went deletes only what it moved there itself. Stored
        content no checkpoint links any more goes with it (``_remove_tomb``)."""
        return 0 if tomb.folder is None else self._remove_tomb(self.write_path(tomb.folder))

    def sweep_tombs(self, prefix: str, live: Callable[[Collection[str]], Collection[str]]) -> int:
        base = self.write_path(prefix)
        if base.is_symlink() or not base.is_dir():
            return 0
        with os.scandir(base) as entries:
            tombs = {e.name: token for e in entries if (token := tomb_token(e.name)) is not None}
        held = set(live(set(tombs.values()))) if tombs else set()
        gone = [name for name, token in tombs.items() if token not in held]
        for name in gone:
            self._remove_tomb(base / name)
        return len(gone)

    def _remove_tomb(self, tomb: Path) -> int:
        """Remove a tombstone folder (``_remove_tree``) and the stored contents only its files
        linked: those its manifests list whose inode they share, once no checkpoint links them
        (``ContentStore.linked_by``, ``drop``). The cost is the tombstone's, not the content
        store's; a name a file outside the manifests linked stays for the periodic sweep."""
        linked = [] if self.content is None else self.content.linked_by(tomb, self._manifests_in(tomb))
        gone = self._remove_tree(tomb)
        if linked:
            assert self.content is not None
            self.content.drop(linked)
        return gone

    @staticmethod
    def _manifests_in(folder: Path) -> tuple[Manifest, ...]:
        """The part manifests at the top of ``folder`` (a tombstone) that parse; none if it is a link."""
        if folder.is_symlink() or not folder.is_dir():
            return ()
        found: list[Manifest] = []
        with os.scandir(folder) as entries:
            for e in entries:
                if is_manifest_name(e.name) and e.is_file(follow_symlinks=False):
                    with suppress(OSError, CkptError):
                        found.append(Manifest.from_json(Path(e.path).read_bytes()))
        return tuple(found)

    @staticmethod
    def _move(src: Path, dst: Path) -> bool:
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return False
        return True

    @staticmethod
    def _remove_tree(path: Path) -> int:
        """Remove ``path`` (a folder, a file or a link) and everything under it, never through a
        link; what vanished meanwhile (another sweep of the same tombstone) is skipped. Returns
        the files removed, staging files not counted."""
        if path.is_symlink() or path.is_file():
            with suppress(FileNotFoundError):
                path.unlink()
                return 0 if is_staging(path.name) else 1
            return 0
        count = 0
        for dirpath, dirnames, filenames in os.walk(path, topdown=False):  # never follows links
            for name in filenames:
                with suppress(FileNotFoundError):
                    os.unlink(os.path.join(dirpath, name))
                    count += 0 if is_staging(name) else 1
            for d in dirnames:
                full = os.path.join(dirpath, d)
                with suppress(FileNotFoundError):
                    os.unlink(full) if os.path.islink(full) else os.rmdir(full)
        with suppress(FileNotFoundError):
            os.rmdir(path)
            fsync_dir(path.parent)
        return count

    def remove_empty(self, prefix: str) -> bool:
        """Remove the folder ``prefix`` if nothing but empty folders is left in it (a
        checkpoint's folder once its last part went); True if it went. Links are never
        followed or removed; a folder a copy is writing into holds its staging file, so it
        stays (``rmdir`` refuses a folder that is not empty)."""
        base = self.write_path(prefix)
        if base.is_symlink() or not base.is_dir():
            return False
        for dirpath, dirnames, _files in os.walk(base, topdown=False):  # never follows links
            for d in dirnames:
                full = os.path.join(dirpath, d)
                if not os.path.islink(full):
                    with suppress(OSError):  # not empty (or gone): left as it is
                        os.rmdir(full)
        try:
            os.rmdir(base)
        except OSError:
            return False
        fsync_dir(base.parent)
        return True

    def sweep_staging(self, prefix: str, older_than_s: float = 3600.0, *, keys: Iterable[str] | None = None) -> int:
        """Remove staging files under ``prefix`` older than ``older_than_s`` (left by a copy
        that was killed); returns how many. The age guard spares copies still running,
        on this node or another one sharing the tier. ``keys`` (tier-relative) limits the
        sweep to the staging files of those objects (one part's own files); None: all."""
        base = self.write_path(prefix) if prefix else self.root.resolve()
        if base.is_symlink():
            return 0
        only = None if keys is None else {safe_relpath(k) for k in keys}
        cutoff, count = time.time() - older_than_s, 0
        for dirpath, _dirs, found in os.walk(base):
            for name in found:
                full = os.path.join(dirpath, name)
                if not is_staging(name):
                    continue
                if only is not None and self._staged_key(prefix, base, dirpath, name) not in only:
                    continue
                try:
                    if os.lstat(full).st_mtime <= cutoff:
                        os.unlink(full)
                        count += 1
                except FileNotFoundError:
                    continue
        return count

    @staticmethod
    def _staged_key(prefix: str, base: Path, dirpath: str, name: str) -> str:
        """The key a staging file (``staging_name``) is destined for."""
        final = name[len(STAGING_MARK):].split("-", 2)[-1]
        rel = os.path.relpath(dirpath, base)
        parts = [p for p in (prefix, "" if rel == "." else rel.replace(os.sep, "/"), final) if p]
        return "/".join(parts)


def open_local(url: str, tier: int, settings: Settings | None) -> LocalStore:
    return LocalStore(url, tier, buffer_bytes=io_buffer(settings),
                      direct_io=settings is not None and Tier(tier).shared_fs and settings.tier1_direct_io,
                      shared_content=tier in SHARED_TIERS)


register(Backend(name="local", schemes=(PLAIN_PATH,), factory=open_local))
