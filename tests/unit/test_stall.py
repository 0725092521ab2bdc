"""A claimed step whose storage stopped answering (``copy_stall_seconds``): every byte moved beats
the process's heartbeat (``core.progress``); a lease stops being renewed once no byte moved for
``stall_s`` (``tasks.claim.Lease``), and the agent kills a part's process or a checkpoint run's
process that stopped moving (``deployments.processes.watch_stall``)."""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import threading
import time

import pytest

from core import checksum, progress
from core.errors import StaleState
from core.layout import checkpoint_prefix
from core.storage.local import LocalStore, kernel_copy
from core.transfer import verify_part
from deployments.processes import Zygote, run_child, start_fork_server, watch_stall
from tasks.claim import Lease
from tests.kit.checkpoints import write_checkpoint


@pytest.fixture(scope="module", autouse=True)
def zygote():
    """The zygote started before a test's log capture, as the agent starts it before anything
    else (importing what children need sets Prefect's logging up, which replaces the root
    logger's handlers); ended with the module."""
    start_fork_server()
    yield
    Zygote.stop()


@pytest.fixture
def long_idle(monkeypatch):
    """The process last moved a byte an hour ago."""
    monkeypatch.setattr(progress._Heart, "last", time.monotonic() - 3600)
    monkeypatch.setattr(progress._Heart, "shared", None)


def test_hashing_and_kernel_copies_beat_the_heartbeat(long_idle, tmp_path):
    before = time.monotonic()
    checksum.hash_stream(io.BytesIO(b"x" * 10_000), 4096)
    assert progress.last_moved() >= before

    progress._Heart.last = before - 3600
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_bytes(b"y" * 10_000)
    with open(src, "rb") as s, open(dst, "wb") as d:
        copied = kernel_copy(s.fileno(), d.fileno(), 10_001)
    if copied is None:
        pytest.skip("this file system copies in the kernel nowhere")
    assert progress.last_moved() >= before


def test_an_object_the_store_proves_without_a_read_is_progress_too(long_idle, tmp_path):
    """A shallow verify (S3 compares its own checksum: no byte read here) beats once per object,
    so a part of many objects is not taken for stalled."""
    (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
    store = LocalStore(tmp_path / "t1", 1)
    m = write_checkpoint(store.root, "r", 1, shards=2, shard_bytes=1024)
    proved = []
    store.verify_object = lambda key, size, crc: proved.append((key, progress.last_moved()))  # no read
    before = time.monotonic()
    verify_part(store, checkpoint_prefix("r", 1), m, deep=False, parallelism=1)
    assert len(proved) == len(m.files) and proved[-1][1] >= before  # the first proof beat before the last


def test_a_shared_beat_is_written_where_the_parent_reads_it(long_idle):
    beat = multiprocessing.get_context("spawn").Value("d", 0.0, lock=False)
    progress.share(beat)
    checksum.hash_bytes(b"z")
    assert beat.value == progress.last_moved() > 0


class Beats:
    """A catalog that takes every heartbeat."""

    def __init__(self) -> None:
        self.count = 0

    def heartbeat(self, replica_id: int, token: str) -> None:
        self.count += 1


def test_a_lease_counts_as_stalled_only_past_its_limit_since_the_last_byte_or_the_claim(long_idle):
    lease = Lease(Beats(), 1, "t", 120, stall_s=600)
    now = time.monotonic()
    lease._taken = now - 1000
    progress._Heart.last = now - 599
    assert lease.stalled(now) is None  # a byte moved 599 s ago
    progress._Heart.last = now - 601
    assert lease.stalled(now) == pytest.approx(601)
    lease._taken = now - 10  # taken 10 s ago: its own work has not started moving yet
    assert lease.stalled(now) is None
    lease.check()  # the work came back to its claim: that is progress
    assert progress.last_moved() >= now
    assert Lease(Beats(), 1, "t", 120).stalled(now + 10**6) is None  # no limit: never stalled


def test_an_uninterrupted_phase_never_counts_as_stalled_here_or_in_the_parent(long_idle):
    beat = multiprocessing.get_context("spawn").Value("d", 0.0, lock=False)
    progress.share(beat)
    lease = Lease(Beats(), 1, "t", 120, stall_s=600)
    now = time.monotonic()
    lease._taken = progress._Heart.last = now - 10_000
    with progress.uninterrupted():
        with progress.uninterrupted():  # nested: still held until the outer one ends
            pass
        assert lease.stalled(now) is None
        assert beat.value == float("inf")  # the agent's watch: idle is negative, never past the limit
        checksum.hash_bytes(b"x")  # a beat meanwhile does not end it
        assert beat.value == float("inf")
    assert beat.value == progress.last_moved() >= now  # its end counts as a beat
    assert lease.stalled(now + 601) is not None


def _wait_for(cond, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_stalled_lease_stops_renewing_and_its_holder_is_told(long_idle, caplog):
    cat = Beats()
    lease = Lease(cat, 7, "t", 0.25, stall_s=0.05).start()  # renewed every 0.05 s
    try:
        _wait_for(lambda: lease._lost is not None)
        seen = cat.count
        time.sleep(0.3)  # six renewal periods
        assert cat.count == seen  # nobody renews a stalled claim: it lapses after its lease
        with pytest.raises(StaleState, match="replica 7: stalled, no byte moved"):
            lease.check()
    finally:
        lease.stop()
    assert "stalled" in caplog.text


def test_a_lease_without_a_stall_limit_is_renewed_while_nothing_moves(long_idle):
    cat = Beats()
    lease = Lease(cat, 7, "t", 0.25).start()
    try:
        _wait_for(lambda: cat.count >= 5)
        lease.check()
    finally:
        lease.stop()


def _hang(ready) -> None:
    ready.set()
    time.sleep(3600)


def _exit_with(code: int) -> None:
    time.sleep(0.2)
    os._exit(code)


@pytest.fixture
def ctx():
    return multiprocessing.get_context("fork")


def test_a_process_that_moves_no_byte_is_killed(ctx, caplog):
    beat = ctx.Value("d", time.monotonic(), lock=False)
    ready = ctx.Event()
    process = ctx.Process(target=_hang, args=(ready,), daemon=True)
    process.start()
    assert ready.wait(30)
    with caplog.at_level(logging.ERROR, logger="ckpt.agent.parts"):
        why = watch_stall(process, beat, 0.1, "promotion of 'r' step 1 part 0")
    process.join(30)
    assert process.exitcode == -9 and why is not None and why.startswith("stalled, no byte moved")
    assert "promotion of 'r' step 1 part 0: stalled, no byte moved" in caplog.text


def test_a_process_that_keeps_moving_is_waited_for_and_its_code_left_to_whoever_joins_it(ctx):
    beat = ctx.Value("d", 0.0, lock=False)
    process = ctx.Process(target=_exit_with, args=(1,), daemon=True)
    process.start()
    # its beat always fresh (the clock reads the beat itself): waited for however long it runs
    assert watch_stall(process, beat, 0.05, "x", clock=lambda: beat.value) is None
    process.join(30)
    assert process.exitcode == 1


def _exit_with_beat(code: int, beat) -> None:
    os._exit(code)


def _hang_after_a_beat(beat) -> None:
    progress.share(beat)  # as a part's child does: its beats reach the agent
    time.sleep(3600)


def test_an_agent_child_that_stalls_is_killed_and_the_agent_says_so(caplog):
    """A part's child, forked from the zygote as the agent forks it (``run_child``): one
    that moves no byte past the limit is killed, and the agent's log says which and why, once."""
    with caplog.at_level(logging.ERROR, logger="ckpt.agent.parts"):
        code, _ = run_child(_hang_after_a_beat, (), stall_s=0.5, what="promotion of 'r' step 1 part 0")
    assert code == -9
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ckpt.agent.parts"]
    assert line.startswith("promotion of 'r' step 1 part 0: stalled, no byte moved"), line


def test_an_agent_child_that_dies_otherwise_is_one_line_with_its_exit_code(caplog):
    with caplog.at_level(logging.ERROR, logger="ckpt.agent.parts"):
        code, _ = run_child(_exit_with_beat, (7,), stall_s=60, what="promotion of 'r' step 2 part 0")
    assert code == 7
    (line,) = [r.getMessage() for r in caplog.records if r.name == "ckpt.agent.parts"]
    assert "promotion of 'r' step 2 part 0: its process (pid " in line and "exited with code 7" in line


class Unkillable:
    """A process stuck in the kernel (a hung mount): the kill does not end it."""

    pid = 4242

    def __init__(self) -> None:
        self.killed = threading.Event()
        self.sentinel, self._w = os.pipe()  # never ready: nobody writes or closes the other end

    def kill(self) -> None:
        self.killed.set()


def test_a_process_the_kill_cannot_end_is_left_behind(caplog):
    stuck = Unkillable()

    class Beat:
        value = 0.0

    try:
        with caplog.at_level(logging.ERROR, logger="ckpt.agent.parts"):
            assert watch_stall(stuck, Beat(), 10, "x", clock=lambda: 11.0, kill_wait_s=0.01) is not None
    finally:
        os.close(stuck.sentinel)
        os.close(stuck._w)
    assert stuck.killed.is_set()
    assert "left behind, the next one goes on" in caplog.text


def _answer(value, beat):
    progress.share(beat)
    return {"value": value, "pid": os.getpid()}


def test_a_child_returns_its_value_and_the_zygote_forks_each_child_apart_from_the_agent():
    """What the reconcile pass hands back comes back; each child is a process of its own, forked
    from the zygote (not the agent: the agent's threads are never forked)."""
    code, got = run_child(_answer, ([1, 2],), stall_s=60, what="x")
    code2, got2 = run_child(_answer, ("b",), stall_s=60, what="x")

    assert (code, got["value"], code2, got2["value"]) == (0, [1, 2], 0, "b")
    assert len({os.getpid(), got["pid"], got2["pid"], Zygote.get().pid}) == 4


def test_a_zygote_that_died_is_started_again():
    first = Zygote.get()
    os.kill(first.pid, 9)
    os.waitpid(first.pid, 0)
    try:
        code, got = run_child(_answer, (3,), stall_s=60, what="x")
        assert (code, got["value"]) == (0, 3)
        assert Zygote.get().pid != first.pid
    finally:
        first.sock.close()


def _big(n: int, beat):
    return os.urandom(n)


def _sleep_then_exit(seconds: float, beat):
    time.sleep(seconds)


def test_a_large_value_comes_back_whole():
    """A value far larger than a pipe holds: the child never blocks on handing it back."""
    code, got = run_child(_big, (1 << 20,), stall_s=60, what="x")
    assert code == 0 and len(got) == 1 << 20


def test_a_child_the_agent_gave_up_on_does_not_take_the_zygote_down():
    """A child left behind (the kill could not end it in time: the agent closed its side) that
    ends later: the zygote lives on and serves the next child."""
    zygote = Zygote.get()
    child = zygote.fork(_sleep_then_exit, (0.5,))
    child.close()  # given up on, as run_child does once a kill did not end it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until it ended and the zygote reaped it (its pid gone)
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    code, got = run_child(_answer, ("after",), stall_s=60, what="x")
    assert (code, got["value"]) == (0, "after")
    assert Zygote.get().pid == zygote.pid and zygote.alive()
