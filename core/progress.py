"""An optional observer of long copies, for progress bars in the CLI.

The pipeline's steps take plain values, so a progress bar cannot be passed down through them;
instead the CLI installs an observer for the duration of a command (``observe``) and each copy
reports ``(label, bytes_done, bytes_total)`` to it. Outside ``observe`` nothing is reported.
The observer is read once, in the thread that starts the copy, and then called from the copy's
worker threads, so it must be thread-safe (rich's ``Progress`` is).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

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
