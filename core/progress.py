"""An optional observer of long copies, for progress bars in the CLI; and the process's
heartbeat, when it last moved a byte (``moved``), which tells a hung storage from a slow one.

The pipeline's steps take plain values, so a progress bar cannot be passed down through them;
instead the CLI installs an observer for the duration of a command (``observe``) and each copy
reports ``(label, bytes_done, bytes_total)`` to it. Outside ``observe`` nothing is reported.
The observer is read once, in the thread that starts the copy, and then called from the copy's
worker threads, so it must be thread-safe (rich's ``Progress`` is).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

Observer = Callable[[str, int, int], None]
_observer: ContextVar[Observer | None] = ContextVar("ckpt_progress_observer", default=None)


@contextmanager
def observe(fn: Observer) -> Iterator[None]:
    token = _observer.set(fn)
    try:
        yield
    finally:
        _observer.reset(token)


def reporter(label: str, total: int) -> Callable[[int], None] | None:
    """A ``progress(bytes_done)`` callback for one copy, or None when nobody observes."""
    fn = _observer.get()
    if fn is None:
        return None
    return lambda done: fn(label, done, total)


# --- the process's heartbeat: when it last moved a byte ----------------------------------------
# Every byte the pipeline moves is hashed (the manifest's CRC32C) or copied in the kernel, and
# those loops call ``moved()`` once per chunk (1-4 MiB: a clock read and two stores). A claimed
# operation whose storage hangs (a file system or object store that stops answering) stops
# calling it: its lease stops being renewed (``tasks.claim.Lease``, ``copy_stall_seconds``) and
# the agent kills a promotion's process (``deployments.processes.watch_stall``). The clock is CLOCK_MONOTONIC,
# one for every process of the machine, so a parent can compare a child's beats with its own.
class _Heart:
    last = time.monotonic()  # the last beat (the module's import before any)
    shared: Any = None  # a ``multiprocessing.Value('d')`` the parent reads (``share``)
    held = 0  # phases under way that must not be cut short (``uninterrupted``)
    lock = threading.Lock()


def moved() -> None:
    """This process moved bytes (or a claimed step came back to its claim) now."""
    now = _Heart.last = time.monotonic()
    shared = _Heart.shared
    if shared is not None:
        if not _Heart.held:
            shared.value = now
        if _Heart.held:  # an uninterrupted phase (begun meanwhile, too): its infinite beat stands
            shared.value = math.inf


def last_moved() -> float:
    """``time.monotonic()`` of this process's last ``moved()`` (its start before any); infinite
    (never stalled) while an ``uninterrupted`` phase runs."""
    return math.inf if _Heart.held else _Heart.last


@contextmanager
def uninterrupted() -> Iterator[None]:
    """A phase that must not be cut short once begun: deleting a part's published files under a
    claim (a corrupt copy before it is copied again, a scrub repair's rotten copy, a failed
    copy's retraction). A worker stalled there and taken over, which then woke, would go on
    deleting names the new holder had published meanwhile. While one runs the process never
    counts as stalled (its claims keep being renewed, the agent does not kill it): a hang there
    holds the part, as every hang did before stalls were detected."""
    with _Heart.lock:
        _Heart.held += 1
        if _Heart.shared is not None:
            _Heart.shared.value = math.inf
    try:
        yield
    finally:
        with _Heart.lock:
            _Heart.held -= 1
        moved()


def share(value: Any) -> None:
    """Also write each beat into ``value`` (a shared ``multiprocessing.Value('d')``), where the
    process that started this one watches it; starts the count now."""
    _Heart.shared = value
    moved()
