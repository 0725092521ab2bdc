"""A local tier's content store: each file's bytes held once, checkpoint folders hard-linked to them.

The store is a folder under the tier root (``CONTENT_DIR``) with one name per content,
``<crc32c>-<size>`` (the candidate key the manifest already gives). A checkpoint file is a hard
link to the same inode, so the checkpoint folder stays a plain folder the trainer loads in place,
and the file system's link count is the reference count: deleting a checkpoint's file unlinks
its name only, and the bytes go when the last checkpoint that links them goes. The content
store's own name is an index, never a reference: ``sweep`` drops the names no checkpoint links
any more (link count 1), and a name dropped under a copy that was about to use it costs that
copy a plain write, never bytes.

A candidate is used only after a byte comparison with the source (``link_same``): equal CRC32C
and size are a hint, the bytes decide, so a collision never substitutes bytes. The comparison
reads the stored bytes, so it is also the read-back of the bytes the new name resolves to. A
name whose bytes differ (a collision, or bytes that rotted) is replaced by the next verified
copy (``remember``, which compares the bytes itself, so a good content is never replaced);
checkpoints still linked to the old inode keep it, for the scrub to find.
Stored inodes are never written in place: every write goes to a staging name and is published
by a link, so a content's bytes change only by a fault.

A local file whose bytes were read whole and hashed carries the SHA-256 found in an extended
attribute of its inode (``noted_sha256``), with the size and modification time it had then, so
every name that links the inode shares it. Tier 2 shares a content only once the source's
SHA-256 equals the one recorded for the stored object; a Tier 1 file that links a content hashed
before needs no read at all for that (``known_sha256``), which is what makes a fine-tune's frozen
base cost its Tier 2 hop a few requests, not a read of every byte. A note whose size or
modification time no longer matches the inode is ignored (the file was written since); a file
system without user extended attributes, or a file this process may not annotate, simply hashes
its bytes every time, as before.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from core.checksum import to_hex, update
from core.layout import staging_name
from core.progress import moved

if TYPE_CHECKING:
    from core.manifest import Manifest

CONTENT_DIR = ".ckpt-content"
COMPARE_BYTES = 256 << 10  # a comparison's piece: two of them stay in a core's cache
SHA256_ATTR = "user.ckpt.sha256"  # "<sha256 hex> <size> <mtime ns>" of the inode's bytes when hashed
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK)
SHARED_TIERS = frozenset({1, 2})  # Tier 0 is a node's scratch, written by the trainer: nothing to share


def known_sha256(fd: int) -> str | None:
    """The SHA-256 noted on the inode of ``fd`` (``noted_sha256``) while its size and modification
    time are still those it was noted with; None when there is no such note."""
    try:
        sha256, size, mtime = os.getxattr(fd, SHA256_ATTR).decode("ascii").split()
        st = os.fstat(fd)
    except (OSError, ValueError):  # no note, no xattr support, or a note that is not ours
        return None
    if len(sha256) != 64 or (str(st.st_size), str(st.st_mtime_ns)) != (size, mtime):
        return None
    return sha256


def noted_sha256(fd: int, sha256: str) -> None:
    """Note ``sha256`` (of the bytes of ``fd`` just read whole) on its inode, for ``known_sha256``.
    Best effort: a file system or a file that refuses it is hashed again next time."""
    try:
        st = os.fstat(fd)
        os.setxattr(fd, SHA256_ATTR, f"{sha256} {st.st_size} {st.st_mtime_ns}".encode("ascii"))
    except OSError:
        pass


def _read_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset`` (short reads continued); the bytes read (fewer at
    the end of the file)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


class ContentStore:
    """The content store under ``root`` (a tier root on a file system with hard links)."""

    def __init__(self, root: Path, buffer_bytes: int):
        self.folder = root / CONTENT_DIR
        self.buffer_bytes = buffer_bytes

    def entry(self, size: int, checksum: str) -> Path:
        """The name of the content of this size and CRC32C (two hex digits fan the folder out)."""
        return self.folder / checksum[:2] / f"{checksum}-{size}"

    def link_same(self, src_fd: int, size: int, checksum: str, staging: Path,
                  note: Callable[[int], object] | None = None) -> bool:
        """Link the stored content to ``staging`` when its bytes equal the source's (read from
        ``src_fd`` by offset, so its file offset stays where it is) and the source matches
        (size, CRC32C); False when there is no such content or it differs (then the caller
        copies). The inode linked is the one compared: a name replaced meanwhile is refused."""
        try:
            fd = os.open(self.entry(size, checksum), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return False
        try:
            compared = os.fstat(fd)
            if compared.st_size != size or not self._same_bytes(src_fd, fd, size, checksum, note):
                return False
            try:
                os.link(self.entry(size, checksum), staging)
            except FileNotFoundError:  # swept meanwhile: a plain copy
                return False
            if os.stat(staging).st_ino != compared.st_ino:  # replaced meanwhile: not what was compared
                staging.unlink()
                return False
            return True
        finally:
            os.close(fd)

    def _same_bytes(self, src_fd: int, fd: int, size: int, checksum: str,
                    note: Callable[[int], object] | None) -> bool:
        """Both files equal byte for byte over ``size`` bytes and the source's CRC32C is
        ``checksum``. Read in ``COMPARE_BYTES`` pieces into two buffers made once: both stay in
        the core's cache while they are compared and hashed, and no read allocates a new
        ``bytes`` (reads of ``buffer_bytes`` into fresh objects were the comparison's cost)."""
        ours, theirs = bytearray(min(COMPARE_BYTES, size)), bytearray(min(COMPARE_BYTES, size))
        ours_view, theirs_view = memoryview(ours), memoryview(theirs)
        crc, offset = 0, 0
        while offset < size:
            want = min(len(ours), size - offset)
            if _read_into(src_fd, ours_view[:want], offset) != want or \
                    _read_into(fd, theirs_view[:want], offset) != want:
                return False
            if want == len(ours):
                if ours != theirs:
                    return False
                crc = update(crc, ours)
            else:
                if ours_view[:want] != theirs_view[:want]:
                    return False
                crc = update(crc, ours_view[:want])
            offset += want
            moved()
            if note is not None:
                note(want)
        return to_hex(crc) == checksum and not os.pread(src_fd, 1, size)

    def remember(self, published: Path, size: int, checksum: str) -> Path | None:
        """Make ``published`` (a verified file of this size and CRC32C) the stored content: a
        new name, or in place of a name whose bytes differ from it (a collision, or rot),
        compared here byte for byte; a name whose bytes are equal stays what it is. The folder
        whose entries changed, or None when nothing changed or this file system has no hard
        links."""
        name = self.entry(size, checksum)
        name.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(published, name)
            return name.parent
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno in _NO_LINKS:
                return None
            raise
        if self._equal(published, name, size, checksum):
            return None
        staged = name.parent / staging_name(name.name)
        os.link(published, staged)
        try:
            os.rename(staged, name)  # replaces a content whose bytes differ (compared above)
        finally:
            staged.unlink(missing_ok=True)
        return name.parent

    def _equal(self, published: Path, name: Path, size: int, checksum: str) -> bool:
        """``name`` is ``published`` or holds the same bytes (False when it went meanwhile)."""
        try:
            fd = os.open(name, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            src = os.open(published, os.O_RDONLY)
            try:
                st, ours = os.fstat(fd), os.fstat(src)
                if (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
                    return True
                return st.st_size == size and self._same_bytes(src, fd, size, checksum, None)
            finally:
                os.close(src)
        finally:
            os.close(fd)

    def linked_by(self, folder: Path, manifests: Iterable[Manifest]) -> list[tuple[Path, int]]:
        """The content names the files of ``manifests`` under ``folder`` link (same inode): (name,
        inode) of each, for ``drop`` once those files went. A file the manifests do not list, or
        one that links no content, is not here; the periodic ``sweep`` finds those names."""
        out: list[tuple[Path, int]] = []
        for manifest in manifests:
            if manifest.algorithm != "crc32c":  # content names are CRC32C's
                continue
            for f in manifest.files:
                name = self.entry(f.size, f.checksum)
                try:
                    ours, stored = os.lstat(folder / f.path), os.lstat(name)
                except (OSError, ValueError):  # not there (or no such name): nothing it links
                    continue
                if (ours.st_dev, ours.st_ino) == (stored.st_dev, stored.st_ino):
                    out.append((name, stored.st_ino))
        return out

    def drop(self, names: Iterable[tuple[Path, int]]) -> int:
        """Drop those of ``names`` (from ``linked_by``) that no checkpoint links any more (link
        count 1) and still name the inode noted; how many went. A prune's own contents only,
        however many the store holds."""
        gone = 0
        for name, inode in names:
            try:
                st = os.lstat(name)
                if st.st_ino == inode and st.st_nlink <= 1:
                    os.unlink(name)
                    gone += 1
            except FileNotFoundError:
                continue
        return gone

    def sweep(self) -> int:
        """Drop the names no checkpoint links any more (link count 1); how many went. It reads
        every name the store holds, so it is the periodic pass's (``tasks.contents``), never a
        prune's: a prune drops its own names (``linked_by``, ``drop``)."""
        gone = 0
        if not self.folder.is_dir():
            return 0
        for fan in os.scandir(self.folder):
            if not fan.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(fan.path):
                try:
                    if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_nlink <= 1:
                        os.unlink(entry.path)
                        gone += 1
                except FileNotFoundError:
                    continue
        return gone
