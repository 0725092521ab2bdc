"""copy_part / verify_part / find_committed on real folders and moto's S3 server, with the
faults the pipeline must survive: bit flips, truncation, a SIGKILL mid-copy, ENOSPC, S3 5xx."""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from core.errors import ConflictError, CorruptCheckpoint, StorageFull
from core.layout import checkpoint_prefix, is_staging
from core.manifest_build import build_manifest
from core.storage.local import LocalStore
from core.transfer import copy_part, find_committed, read_committed, verify_part
from tests.kit.checkpoints import ckpt_dir, flip_bit, write_checkpoint

MiB = 1024 * 1024
RUN, STEP = "run-a", 200
PREFIX = checkpoint_prefix(RUN, STEP)


def all_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_copy_tier0_to_tier1_then_verify(tiers):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=MiB)
    src = ckpt_dir(t0.root, RUN, STEP)
    seen = []
    report = copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=3, progress=seen.append)
    assert (report.files, report.bytes, report.skipped) == (len(m.files), m.total_bytes, 0)
    assert seen and seen[-1] == m.total_bytes
    dst = t1.path(PREFIX)
    for f in m.files:
        assert (dst / f.path).read_bytes() == (src / f.path).read_bytes()
    assert (dst / "manifest.json").read_bytes() == (src / "manifest.json").read_bytes()
    assert list(find_committed(t1)) == [(RUN, STEP, 0, 1, "")]
    assert read_committed(t1, RUN, STEP) == m
    assert verify_part(t1, PREFIX, m).files == len(m.files)
    again = copy_part(t0, PREFIX, t1, PREFIX, m)  # the same promotion again: nothing copied
    assert (again.files, again.skipped) == (0, len(m.files))


def test_a_copy_whose_caller_lost_its_claim_after_the_last_file_commits_nothing(tiers, monkeypatch):
    """The progress callback (a claim's check) is asked once more before the manifest: a worker
    whose claim was lost while its last file was written (a stall, a takeover) never commits."""
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=2, shard_bytes=MiB)
    lost, put, written = [], t1.put_verified, []

    def put_verified(key, *args, **kwargs):
        info = put(key, *args, **kwargs)
        written.append(key)
        if len(written) == len(m.files):
            lost.append(key)  # the claim went while the last file was published
        return info

    def check(done: int) -> None:
        if lost:
            raise ConflictError("the claim was lost")

    monkeypatch.setattr(t1, "put_verified", put_verified)
    with pytest.raises(ConflictError, match="the claim was lost"):
        copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=1, progress=check)
    assert lost and not (t1.path(PREFIX) / "manifest.json").exists()


def test_a_late_copy_never_replaces_what_a_newer_holder_published(tiers, tmp_path):
    """A worker that lost its claim and wakes with another version of the part (re-saved: the
    same names, other bytes) publishes nothing over the newer holder's copy: every publish is
    no-overwrite (a file by a link, a fetch's stage by a rename that refuses a folder in use)."""
    from tasks.resume.stages import publish_stage

    t0, t1 = tiers
    newer = write_checkpoint(t0.root, RUN, STEP, shards=2, shard_bytes=MiB, seed=1)
    copy_part(t0, PREFIX, t1, PREFIX, newer)
    published = {f: (t1.path(PREFIX) / f).read_bytes() for f in all_files(t1.path(PREFIX))}
    old_src = LocalStore(tmp_path / "old", 0)
    late = write_checkpoint(old_src.root, RUN, STEP, shards=2, shard_bytes=MiB, seed=2)
    assert [f.path for f in late.files] == [f.path for f in newer.files] and late != newer

    with pytest.raises(ConflictError):
        copy_part(old_src, PREFIX, t1, PREFIX, late)
    with pytest.raises(ConflictError):  # a resume's fetch stage, published onto the folder
        publish_stage(ckpt_dir(old_src.root, RUN, STEP), t1.path(PREFIX), late)

    assert {f: (t1.path(PREFIX) / f).read_bytes() for f in all_files(t1.path(PREFIX))} == published
    assert verify_part(t1, PREFIX, newer).files == len(newer.files)


def test_two_copies_at_once_give_one_set_of_files(tiers):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=MiB)
    errors = []

    def go():
        try:
            copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=2)
        except Exception as exc:  # pragma: no cover - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    assert all_files(t1.path(PREFIX)) == sorted([f.path for f in m.files] + ["manifest.json"])
    verify_part(t1, PREFIX, m)


@pytest.mark.parametrize("damage", ["bitflip", "truncate", "delete"])
def test_bad_source_publishes_nothing(tiers, damage):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=MiB)
    src = ckpt_dir(t0.root, RUN, STEP)
    victim = src / m.files[1].path
    if damage == "bitflip":
        flip_bit(victim, -100)
    elif damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    with pytest.raises(CorruptCheckpoint) as exc:
        copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=1)
    assert exc.value.path == m.files[1].path
    assert list(find_committed(t1)) == []
    published = all_files(t1.root)
    assert f"{PREFIX}/{m.files[1].path}" not in published
    assert not any(is_staging(Path(p).name) for p in published)
    with pytest.raises(CorruptCheckpoint):
        verify_part(t0, PREFIX, m)  # verifying Tier 0 finds it too


def test_resume_after_partial_copy(tiers):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=MiB)
    for f in m.files[:2]:  # an earlier attempt published two files and died
        with t0.open_read(f"{PREFIX}/{f.path}") as r:
            t1.put_verified(f"{PREFIX}/{f.path}", r, f.size, f.checksum)
    report = copy_part(t0, PREFIX, t1, PREFIX, m)
    assert (report.files, report.skipped) == (len(m.files) - 2, 2)
    verify_part(t1, PREFIX, m)


def test_bit_flip_on_tier1_after_copy_is_found(tiers):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=MiB)
    copy_part(t0, PREFIX, t1, PREFIX, m)
    flip_bit(t1.path(f"{PREFIX}/{m.files[2].path}"), offset=5000)
    for deep in (True, False):
        with pytest.raises(CorruptCheckpoint) as exc:
            verify_part(t1, PREFIX, m, deep=deep)
        assert exc.value.path == m.files[2].path
    with pytest.raises(ConflictError):  # a rerun never overwrites what is there
        copy_part(t0, PREFIX, t1, PREFIX, m)


def test_verify_part_checks_the_format_not_just_the_bytes(tiers):
    t0, _ = tiers
    folder = t0.root / RUN / f"step-{STEP:08d}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")
    m = build_manifest(folder, RUN, STEP, fmt="folder")
    with pytest.raises(CorruptCheckpoint, match="header length") as exc:
        verify_part(t0, PREFIX, dataclasses.replace(m, format="safetensors"))
    assert exc.value.path == "model.safetensors"


def test_different_committed_part_is_a_conflict(tiers):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=MiB)
    other = dataclasses.replace(m, files=m.files[:-1])
    t1.write_small_atomic(f"{PREFIX}/manifest.json", other.to_json())
    with pytest.raises(ConflictError):
        copy_part(t0, PREFIX, t1, PREFIX, m)


@pytest.mark.parametrize("path", ["kernel-copy", "streamed", "direct-io"])
def test_enospc_on_tier1_is_storage_full_and_leaves_nothing(tiers, monkeypatch, path):
    import core.storage.direct as direct
    import core.storage.local as fsmod

    t0, t1 = tiers
    t1.direct_io = path == "direct-io"
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=MiB)
    real_write, real_copy, written = fsmod._write_all, fsmod._copy_range, []

    def disk_full_after_2mib():
        if sum(written) > 2 * MiB:
            raise OSError(errno.ENOSPC, "No space left on device")

    def filling_write(fd, data):
        disk_full_after_2mib()
        written.append(len(data))
        real_write(fd, data)

    def filling_copy(src_fd, dst_fd, count):
        disk_full_after_2mib()
        n = real_copy(src_fd, dst_fd, min(count, 256 * 1024))
        written.append(n)
        return n

    monkeypatch.setattr(fsmod, "_write_all", filling_write)
    monkeypatch.setattr(fsmod, "_copy_range", filling_copy)
    real_direct = direct._write

    def filling_direct(fd, data):
        disk_full_after_2mib()
        n = real_direct(fd, data)
        written.append(n)
        return n

    monkeypatch.setattr(direct, "_write", filling_direct)
    if path == "streamed":
        monkeypatch.setattr(fsmod, "local_fd", lambda reader: None)
    with pytest.raises(StorageFull):
        copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=2)
    assert sum(written) > 2 * MiB  # the fault was hit on the path under test
    assert list(find_committed(t1)) == []
    assert not any(is_staging(Path(p).name) for p in all_files(t1.root))
    for p in all_files(t1.root):  # what did get published is complete and correct
        f = next(f for f in m.files if p.endswith(f.path))
        t1.verify_object(p, f.size, f.checksum)


KILL_SCRIPT = r"""
import os, sys, time
import core.storage.local as fsmod
from core.storage.local import LocalStore
from core.transfer import copy_part, read_committed
fsmod._copy_range = lambda s, d, n: os.copy_file_range(s, d, min(n, 64 * 1024))  # a slow disk
t0, t1 = LocalStore(sys.argv[1], 0), LocalStore(sys.argv[2], 1)
m = read_committed(t0, sys.argv[3], int(sys.argv[4]))
copy_part(t0, sys.argv[5], t1, sys.argv[5], m, parallelism=1,
          progress=lambda done: time.sleep(0.01))
"""


def test_copy_killed_with_sigkill_then_rerun(tiers):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=6, shard_bytes=MiB)
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(t0.root), str(t1.root), RUN, str(STEP), PREFIX])
    dst = t1.root / PREFIX
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until one file is published and the next is staging
        names = [p.name for p in dst.iterdir()] if dst.exists() else []
        if any(is_staging(n) for n in names) and any(not is_staging(n) for n in names):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    published = [n for n in os.listdir(dst) if not is_staging(n)]
    assert 0 < len(published) < len(m.files) and "manifest.json" not in published
    assert list(find_committed(t1)) == []
    for name in published:  # nothing partial under a final name
        f = next(f for f in m.files if f.path == name)
        t1.verify_object(f"{PREFIX}/{name}", f.size, f.checksum)
    report = copy_part(t0, PREFIX, t1, PREFIX, m)
    assert report.skipped == len(published) and report.files == len(m.files) - len(published)
    verify_part(t1, PREFIX, m)
    assert list(find_committed(t1)) == [(RUN, STEP, 0, 1, "")]
    assert t1.sweep_staging(PREFIX, older_than_s=0) == 1  # the dead copy's staging file
    assert not any(is_staging(n) for n in os.listdir(dst))


def test_folders_are_fsynced_before_the_commit_marker(tiers, monkeypatch):
    """Names (and the new folders holding them) become durable before the manifest does."""
    import core.storage.local as fsmod

    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=12, shard_bytes=64 * 1024)
    marker = t1.root / PREFIX / "manifest.json"
    synced, real = [], fsmod.fsync_dir

    def spy(path):
        synced.append((Path(path), marker.exists()))
        real(path)

    monkeypatch.setattr(fsmod, "fsync_dir", spy)
    copy_part(t0, PREFIX, t1, PREFIX, m)
    before = {p for p, marker_there in synced if not marker_there}
    assert {t1.root, t1.root / RUN, t1.root / PREFIX} <= before
    assert (t1.root / PREFIX, True) in synced  # and the marker's own entry after it
    assert len(synced) < len(m.files)  # once per folder, not once per file


@pytest.mark.parametrize(("a", "b"), [(0, 5), (1, 1), (7, 1000), (65536, 65536), (100_000, 12_345), (3, 0)])
def test_crc32c_of_consecutive_pieces_combines_to_the_whole(a, b):
    import os

    import crc32c

    from core.checksum import combine

    x, y = os.urandom(a), os.urandom(b)
    assert combine(crc32c.crc32c(x), crc32c.crc32c(y), b) == crc32c.crc32c(x + y)


def test_copy_workers_run_at_the_lower_priority_and_the_caller_keeps_its_own(tiers, monkeypatch):
    from core.transfer import WorkerPriority

    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=3, shard_bytes=64 << 10)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []
    real = type(t1).put_verified
    data = {f"{PREFIX}/{f.path}" for f in m.files}

    def put_verified(self, key, reader, size, checksum):
        if key in data:  # the manifest is written by the caller's thread, after the pool
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(self, key, reader, size, checksum)

    monkeypatch.setattr(type(t1), "put_verified", put_verified)
    copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=2, priority=WorkerPriority(nice=5, io_class="best-effort"))

    assert len(seen) == len(m.files) and all(n == min(caller + 5, 19) for n in seen)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    verify_part(t1, PREFIX, m, parallelism=2)  # the copy is intact at any priority


def test_a_copy_times_its_first_byte_from_the_source(tiers, monkeypatch):
    """The hop's first-byte latency is the wait from its start to the first byte the source
    gave: a source slow to answer shows in it; a repeat that moves no byte has none."""
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=2, shard_bytes=MiB)
    opened = t0.open_read

    def slow_to_answer(key, *args, **kwargs):
        time.sleep(0.3)
        return opened(key, *args, **kwargs)

    monkeypatch.setattr(t0, "open_read", slow_to_answer)
    report = copy_part(t0, PREFIX, t1, PREFIX, m, parallelism=2)
    assert report.first_byte_seconds is not None
    assert 0.3 <= report.first_byte_seconds <= report.seconds
    assert copy_part(t0, PREFIX, t1, PREFIX, m).first_byte_seconds is None  # every file already there
