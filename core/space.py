"""Free space on a local tier, and when it runs low: what the stager checks before it writes.

- ``free_bytes(path)``: one ``statvfs`` of the nearest existing folder at or above ``path``
  (the bytes an unprivileged writer may still use). This is all a save pays on its hot path.
- ``state_size(obj)``: the bytes (and number) of the arrays in a state (a dict of tensors, nested dicts and
  lists as trainers hand them over), so a save knows its size before writing it.
- ``writer_stagings(root)``: the staging folders of saves and fetches in the run folders of a
  node's Tier 0 (``<root>/<run>/.ckpt-staging-<pid>-…``), each judged live or dead: a dead
  writer's staging holds room nobody will free, so the room check and reconcile sweep it.
- ``Headroom``: whether a tier's free space is below a few checkpoints' worth, reported once
  per crossing (a save that crosses the line says so; the saves after it, still below, do not;
  once space is back above, the next crossing is reported again). One per process and tier
  root (``headroom``), so every stager of a process shares what was said.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from core.layout import is_staging, staging_pid

STAGING_IDLE_S = 3600.0  # no write in a staging folder for this long: its writer is gone, whatever its pid


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes free to a non-root writer on the file system holding ``path`` (or its nearest
    existing parent, for a run folder not created yet)."""
    p = Path(path)
    while True:
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except FileNotFoundError:
            if p == p.parent:
                raise
            p = p.parent


def state_bytes(obj: object) -> int:
    """The bytes of every array in ``obj`` (see ``state_size``)."""
    return state_size(obj)[0]


def state_size(obj: object) -> tuple[int, int]:
    """(bytes, arrays) of every array in ``obj``: numpy arrays and anything with an integer
    ``nbytes``, torch tensors (``numel() * element_size()``; a DTensor by its local shard, what
    this process writes), inside mappings, lists and tuples. Other values count 0 (scalars,
    strings: what a trainer adds is small beside the tensors)."""
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        sizes = [state_size(v) for v in obj]
        return sum(b for b, _ in sizes), sum(n for _, n in sizes)
    if callable(getattr(obj, "to_local", None)):
        obj = obj.to_local()  # type: ignore[attr-defined]
    nbytes = getattr(obj, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes, 1
    if callable(getattr(obj, "element_size", None)) and callable(getattr(obj, "numel", None)):
        return int(obj.numel()) * int(obj.element_size()), 1  # type: ignore[attr-defined]
    return 0, 0


def folder_bytes(folder: str | os.PathLike[str]) -> int:
    """The bytes of the regular files under ``folder`` (links not followed)."""
    total = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


@dataclass(frozen=True)
class Staging:
    """A staging folder on Tier 0: its writer's process id, its bytes, and whether that writer is
    gone (``dead``)."""

    path: Path
    pid: int | None
    bytes: int
    dead: bool


def writer_stagings(root: str | os.PathLike[str]) -> list[Staging]:
    """The staging entries directly in the run folders under the Tier 0 ``root`` of this node.
    One is dead when the process that named it (``staging_pid``) is gone on this node, or when
    nothing in it was written for ``STAGING_IDLE_S`` (a pid since reused by another process);
    a live writer's is never dead, however long its save takes, as long as it writes. Pids are
    this node's: callers run on the node whose Tier 0 it is, in its writers' pid namespace.
    Links are judged as entries, never followed; a run folder that is a link is skipped."""
    found = []
    cutoff = time.time() - STAGING_IDLE_S
    for run in _subfolders(Path(root)):
        for entry in _subfolders(run, staging=True):
            try:
                pid = staging_pid(entry.name)
                touched = _newest_write(entry)
                size = folder_bytes(entry) if entry.is_dir() and not entry.is_symlink() else entry.lstat().st_size
            except FileNotFoundError:  # published or removed meanwhile
                continue
            dead = (pid is not None and not process_alive(pid)) or touched < cutoff
            found.append(Staging(entry, pid, size, dead))
    return found


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this node (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _subfolders(folder: Path, *, staging: bool = False) -> list[Path]:
    try:
        with os.scandir(folder) as entries:
            if staging:
                return [Path(e.path) for e in entries if is_staging(e.name)]
            return [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False) and not is_staging(e.name)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _newest_write(entry: Path) -> float:
    """The newest modification time of ``entry`` and anything under it (links not followed)."""
    newest = entry.lstat().st_mtime
    if entry.is_dir() and not entry.is_symlink():
        for dirpath, _dirs, names in os.walk(entry):
            for name in names:
                try:
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
                except FileNotFoundError:
                    continue
    return newest


@dataclass(frozen=True)
class Reading:
    """A tier's free space after a save, against the save's size."""

    tier: int
    free_after: int  # bytes free once the save has landed
    checkpoint_bytes: int
    threshold: float  # checkpoints' worth of headroom below which the tier is low

    @property
    def headroom(self) -> float:
        """Checkpoints of this size that still fit after it."""
        return self.free_after / self.checkpoint_bytes if self.checkpoint_bytes > 0 else float("inf")

    @property
    def low(self) -> bool:
        return self.threshold > 0 and self.checkpoint_bytes > 0 and self.headroom < self.threshold


class Headroom:
    """Whether one tier root is low, remembered between saves so that a crossing is told once."""

    def __init__(self) -> None:
        self._low = False
        self._lock = threading.Lock()

    def crossed(self, reading: Reading) -> bool:
        """True exactly when ``reading`` is low and the one before it was not."""
        with self._lock:
            was, self._low = self._low, reading.low
            return reading.low and not was


_watches: dict[tuple[int, str], Headroom] = {}
_watches_lock = threading.Lock()


def headroom(tier: int, root: str | os.PathLike) -> Headroom:
    """The process-wide ``Headroom`` of ``tier`` at ``root``."""
    key = (tier, os.fspath(root))
    with _watches_lock:
        return _watches.setdefault(key, Headroom())
