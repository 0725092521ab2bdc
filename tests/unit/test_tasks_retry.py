"""The retry policy: transient errors retry with growing delays, permanent ones never do."""

from __future__ import annotations

import errno

import pytest
from prefect.states import Completed, Failed

from core.errors import (
    CatalogUnavailable,
    CopyInProgress,
    CorruptCheckpoint,
    PathEscape,
    PruneRefused,
    StorageFull,
    StorageUnavailable,
)
from tasks.retry import backoff_delays, retry_if_transient


@pytest.mark.parametrize("exc,retry", [
    (StorageUnavailable("S3 503"), True),
    (CatalogUnavailable("database is locked"), True),
    (CopyInProgress("another worker"), True),
    (TimeoutError("read timed out"), True),
    (CorruptCheckpoint("bit flip", path="a"), False),
    (PathEscape("../x"), False),
    (PruneRefused("last copy"), False),
    (StorageFull("ENOSPC"), False),
    (OSError(errno.ENOSPC, "No space left on device"), False),
    (OSError(errno.EROFS, "Read-only file system"), False),
    (FileNotFoundError(errno.ENOENT, "gone"), False),
    (PermissionError(errno.EACCES, "denied"), False),
    (OSError(errno.EIO, "Input/output error"), True),
    (ConnectionResetError("reset by peer"), True),
])
def test_only_transient_failures_are_retried(exc, retry):
    assert retry_if_transient(None, None, Failed(data=exc)) is retry


def test_a_completed_state_is_not_retried():
    assert retry_if_transient(None, None, Completed(data=1)) is False


def test_delays_double():
    assert backoff_delays(4, 0.5) == [0.5, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("args,typed", [
    (("run-a", "100", "1", "4"), ("run-a", 100, 1, 4)),
    (("run-a", 7), ("run-a", 7, 0, 1)),
])
def test_checkpoint_references_from_events_are_typed(args, typed):
    from tasks.register import checkpoint_args

    assert checkpoint_args(*args) == typed


@pytest.mark.parametrize("args", [("run-a", ""), ("run-a", "x"), ("../etc", 1), ("run-a", -1),
                                  ("run-a", 1, 4, 4), ("run-a", 1, 0, 0), ("", 1)])
def test_malformed_checkpoint_references_are_bad_events(args):
    from core.errors import BadEvent
    from tasks.register import checkpoint_args

    with pytest.raises(BadEvent):
        checkpoint_args(*args)
