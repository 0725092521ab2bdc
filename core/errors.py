"""The project's error taxonomy.

Two families matter to every caller: ``TransientError`` (a retry may succeed: I/O timeouts,
S3 5xx/throttling, a database that is briefly unreachable) and ``PermanentError`` (a retry
cannot help: corrupt data, bad input, a rule of the catalog refusing a change). Prefect tasks
retry only on transient errors (see ``is_transient``); permanent ones fail the task at once.
"""

from __future__ import annotations


class CkptError(Exception):
    """Base of every error this project raises on purpose."""


class TransientError(CkptError):
    """A retry may succeed."""


class PermanentError(CkptError):
    """A retry cannot succeed without a change of input or state."""


# --- transient -------------------------------------------------------------------------
class CatalogUnavailable(TransientError):
    """The catalog database is temporarily unavailable (connection, lock timeout, serialization)."""


class StorageUnavailable(TransientError):
    """A tier is temporarily unavailable (I/O timeout, S3 5xx, throttling)."""


class TierUnavailable(StorageUnavailable):
    """A tier root that does not prove it is the one the catalog recorded: missing, showing no
    identity marker, or another one (``core.storage.identity``). Never a verdict on any copy
    there. ``tier``, ``url`` (display form) and ``reason`` say which and why."""

    def __init__(self, tier: int, url: str, reason: str) -> None:
        super().__init__(f"tier {tier} at {url} is unavailable: {reason}; nothing was judged or written there")
        self.tier, self.url, self.reason = tier, url, reason


class CopyInProgress(TransientError):
    """Another worker holds a live claim on this replica; retry later and it will be done."""


# --- permanent -------------------------------------------------------------------------
class ConfigError(PermanentError):
    """Settings are missing or invalid."""


class SchemaOutdated(PermanentError):
    """The catalog's schema is behind the code; run ``ckpt db upgrade``."""


class NotFound(PermanentError):
    """A run, checkpoint or replica the caller named does not exist."""


class UnknownRun(NotFound):
    """The run is not registered in the catalog."""


class ConflictError(PermanentError):
    """The request contradicts what is already recorded or stored (never silently overwritten)."""


class ReusedRunName(ConflictError):
    """A launch that never resumed saving into a run with a history it did not resume from (a
    run name reused by mistake): refused at every step, so the job is stopped (``db.attempts``)."""


class CollidingPaths(ConflictError):
    """Two parts of one checkpoint write one relative path with other bytes: every checkpoint of
    that layout would be refused alike, so the job is stopped."""


class StaleState(ConflictError):
    """A compare-and-set lost: the row was not in the expected state."""


class IllegalTransition(PermanentError):
    """A replica state change that the state machine does not allow."""


class PruneRefused(PermanentError):
    """Deleting this replica would break a retention or durability guarantee."""


class ObjectLocked(PermanentError):
    """The object store refused a delete because the object is under retention (S3 Object Lock)
    until ``until`` (None when the store did not say): kept, not an error to retry."""

    def __init__(self, message: str, until: object = None) -> None:
        super().__init__(message)
        self.until = until


class LineageCycle(PermanentError):
    """Adding this lineage edge would make a checkpoint its own ancestor."""


class BadInput(PermanentError):
    """Malformed input: an event, an API call, a CLI argument."""


class BadArgument(BadInput):
    """A malformed command-line argument (the command line records it as a rejection)."""


class BadEvent(BadInput):
    """A malformed or hostile checkpoint event."""


class AlreadyRejected(BadInput):
    """The same manifest of a part was refused before (see the catalog's rejections): refused
    again without being judged, audited or announced again. Save the part anew to retry."""


class EventTooLarge(BadEvent):
    """An event over the orchestrator's size limit: the server would answer 204 and drop it."""


class ValueRefused(BadInput):
    """The catalog refused a value it was given (out of its column's range, length or type):
    the input is bad, and the same value would be refused on every retry."""


class PathEscape(BadInput):
    """A path that would leave its tier root (``..``, absolute, or through a symlink)."""


class CorruptCheckpoint(PermanentError):
    """The bytes or the format of a checkpoint do not match its manifest.

    ``path`` is the file (relative to the checkpoint) that failed, when one did.
    """

    def __init__(self, message: str, *, path: str | None = None):
        super().__init__(message)
        self.path = path


class StorageFull(PermanentError):
    """The destination tier has no space left (ENOSPC / quota), or, raised by the training-side
    stager before it writes a byte, would not have room for the checkpoint being saved even
    after this node's Tier 0 retention ran. Then ``free`` and ``needed`` (bytes) and
    ``waiting`` (checkpoints on this node's Tier 0 not yet promoted, whose copies retention
    may not drop yet: ``(count, bytes)``) and ``staging`` (live writers' staging folders on it:
    ``(count, bytes)``) say why; None when not known."""

    def __init__(self, message: str, *, free: int | None = None, needed: int | None = None,
                 waiting: tuple[int, int] | None = None, staging: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.free, self.needed, self.waiting, self.staging = free, needed, waiting, staging


def quoted(value: object, limit: int = 40) -> str:
    """``repr(value)`` as an error quotes it: cut to ``limit`` characters, so that a message
    about a hostile string (a 300-character name) stays one short line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_transient(exc: BaseException) -> bool:
    """True when retrying the operation that raised ``exc`` may succeed."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, PermanentError):
        return False
    import errno

    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False  # the same call fails the same way: a missing file, a path, rights
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return False
    return isinstance(exc, (TimeoutError, ConnectionError, OSError))
