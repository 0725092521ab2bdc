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


class Flaky:
    """Raises each of ``errors`` in turn, then returns its arguments."""

    def __init__(self, *errors: BaseException):
        self.errors, self.calls = list(errors), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return args, kwargs


@pytest.fixture
def slept(monkeypatch):
    """The waits of inline retries, recorded instead of slept."""
    import tasks.retry

    waits: list[float] = []
    monkeypatch.setattr(tasks.retry, "_sleep", waits.append)
    return waits


def test_an_inline_step_retries_transient_errors_after_growing_jittered_delays(caplog, slept):
    from tasks.retry import retrying

    step = Flaky(StorageUnavailable("S3 503"), CopyInProgress("another worker"))
    call = retrying(step, name="tier0-to-tier1", retries=4, base_delay=2.0, draw=lambda: 1.0)

    with caplog.at_level("WARNING", logger="ckpt.retry"):
        assert call("run-a", 7, part=1) == (("run-a", 7), {"part": 1})

    assert step.calls == 3
    assert slept == [3.0, 6.0]  # 2 s then 4 s, each at the top of its +-50 % jitter
    assert [r.getMessage() for r in caplog.records] == [
        "tier0-to-tier1: StorageUnavailable: S3 503; retry 1 of 4 in 3.0 s",
        "tier0-to-tier1: CopyInProgress: another worker; retry 2 of 4 in 6.0 s"]


def test_an_inline_step_fails_at_once_on_a_permanent_error(slept):
    from tasks.retry import retrying

    step = Flaky(CorruptCheckpoint("bit flip", path="a"))
    with pytest.raises(CorruptCheckpoint, match="bit flip"):
        retrying(step, name="hop", retries=4, base_delay=2.0)()
    assert (step.calls, slept) == (1, [])


def test_an_inline_step_raises_the_last_transient_error_once_its_retries_are_spent(slept):
    from tasks.retry import retrying

    step = Flaky(*(StorageUnavailable(f"503 #{i}") for i in range(4)))
    with pytest.raises(StorageUnavailable, match="503 #2"):
        retrying(step, name="hop", retries=2, base_delay=0.5, draw=lambda: 0.0)()
    assert step.calls == 3
    assert slept == [0.25, 0.5]  # the bottom of the jitter: half of 0.5 s and of 1 s


@pytest.mark.parametrize("draw", [0.0, 0.25, 0.5, 0.999])
def test_jitter_stays_within_half_the_delay_either_way(draw):
    from tasks.retry import jittered

    assert 1.0 <= jittered(2.0, draw=lambda: draw) < 3.0


def test_a_flow_runs_the_hops_of_a_part_inline_and_the_once_per_checkpoint_steps_as_tasks():
    from prefect import Task

    from core.settings import Settings
    from flows.common import task_steps

    inline = task_steps(Settings(task_retries=3, task_retry_delay_seconds=0.5))
    assert not isinstance(inline.tier1_hop, Task) and not isinstance(inline.tier2_hop, Task)
    assert isinstance(inline.mark_complete, Task) and inline.mark_complete.retries == 3  # once per checkpoint
