"""Fault injection on real parts: a copy killed with SIGKILL, S3 answering 503 (a proxy in front
of moto's server), Tier 1 out of space (a real 4 MiB tmpfs where this machine allows mounting
one, and an injected ENOSPC everywhere)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core.errors import CatalogUnavailable, CopyInProgress, StorageFull, StorageUnavailable, is_transient
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tasks.register import register_stored_part
from tests.kit.checkpoints import (
    ckpt_dir,
    expire_claims,
    open_catalog,
    published_files,
    replica_states,
    same_bytes,
    shard_paths,
    write_checkpoint,
)
from tests.kit.pipeline import pipeline_settings
from tests.kit.require import require
from tests.kit.s3 import FaultProxy

RUN = "run-a"
ROOT = Path(__file__).resolve().parents[2]


def assert_nothing_partial_published(settings, step: int) -> None:
    """Tier 1 holds no manifest for the part, and every file under a final name is whole."""
    d = ckpt_dir(settings.tier1_url, RUN, step)
    assert not (d / "manifest.json").exists()
    for rel in published_files(settings.tier1_url, RUN, step):
        if ".ckpt-staging-" in rel:
            continue
        assert same_bytes(d / rel, ckpt_dir(settings.tier0_url, RUN, step) / rel), rel


# --- SIGKILL mid-copy -----------------------------------------------------------------------
KILLED_COPY = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import core.storage.local as fs
    from core.settings import load_settings
    from tasks.copy import copy_to_tier1

    original = fs.LocalStore.put_verified

    class Stalling:
        # hands over half of the second file, then stalls until the test kills this process
        def __init__(self, inner, size):
            self.inner, self.left = inner, size // 2
        def read(self, n=-1):
            if self.left <= 0:
                print("MIDWAY", flush=True)
                time.sleep(120)
            data = self.inner.read(min(n, self.left) if n and n > 0 else self.left)
            self.left -= len(data)
            return data

    calls = []
    def put_verified(self, key, reader, size, checksum):
        if self.tier == 1:
            calls.append(key)
            if len(calls) == 2:
                reader = Stalling(reader, size)
        return original(self, key, reader, size, checksum)

    fs.LocalStore.put_verified = put_verified
    settings = load_settings(data_dir=sys.argv[2], node="node-0", catalog_url=sys.argv[3], copy_parallelism=1)
    copy_to_tier1(settings, "run-a", int(sys.argv[4]))
    print("FINISHED", flush=True)
""")


def test_copy_killed_midway_publishes_nothing_and_a_rerun_completes(settings_factory, db_url):
    from tasks.copy import copy_to_tier1
    from tasks.verify import verify_replica

    settings = pipeline_settings(settings_factory, db_url)
    m = write_checkpoint(settings.tier0_url, RUN, 100, shards=3, shard_bytes=4 << 20)
    register_stored_part(settings, RUN, 100)
    verify_replica(settings, RUN, 100, tier=0)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_COPY, str(ROOT), str(settings.data_dir),
                             settings.catalog_url, "100"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "MIDWAY", line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL

    assert_nothing_partial_published(settings, 100)
    assert [p for p in published_files(settings.tier1_url, RUN, 100) if ".ckpt-staging-" in p]  # half a file
    assert replica_states(settings, RUN, 100)[(1, 0)] == "copying"  # a dead claim, never verified
    with pytest.raises(CopyInProgress):
        copy_to_tier1(settings, RUN, 100)  # its lease still runs
    expire_claims(settings)  # as if a whole lease passed without a heartbeat

    hop = copy_to_tier1(settings, RUN, 100)  # the lease ran out: taken over, resumed

    assert not hop.skipped and hop.files == len(m.files) - 1  # the file published before the kill is kept
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    for src in shard_paths(settings.tier0_url, RUN, 100):
        assert same_bytes(src, ckpt_dir(settings.tier1_url, RUN, 100) / src.name)
    assert (ckpt_dir(settings.tier1_url, RUN, 100) / "manifest.json").is_file()
    assert not [p for p in published_files(settings.tier1_url, RUN, 100) if ".ckpt-staging-" in p]


# --- a claim whose answer was lost ----------------------------------------------------------
@pytest.fixture
def claim_answer_lost(monkeypatch):
    """The catalog commits the first Tier 1 copy claim, then the connection drops: the call
    raises, so its caller never learns it holds the claim. Yields the tokens it committed."""
    from db.catalog import Catalog

    original, committed = Catalog.claim_copy, []

    def claim_copy(self, checkpoint_id, tier, part, url, **kwargs):
        claim = original(self, checkpoint_id, tier, part, url, **kwargs)
        if tier == 1 and not committed:
            committed.append(claim.replica.claim_token)
            raise CatalogUnavailable("server closed the connection unexpectedly (after COMMIT)")
        return claim

    monkeypatch.setattr(Catalog, "claim_copy", claim_copy)
    return committed


def test_a_promotion_whose_claim_answer_was_lost_is_finished_by_its_retry_at_once(settings_factory, db_url,
                                                                                  claim_answer_lost):
    settings = pipeline_settings(settings_factory, db_url)
    write_checkpoint(settings.tier0_url, RUN, 100, shards=3)
    with pytest.raises(CatalogUnavailable):
        promote(settings, RUN, 100, steps=plain_steps())
    assert replica_states(settings, RUN, 100)[(1, 0)] == "copying"  # committed, held by nobody

    promote(settings, RUN, 100, steps=plain_steps())  # the step's retry: no lease to wait out

    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    for src in shard_paths(settings.tier0_url, RUN, 100):
        assert same_bytes(src, ckpt_dir(settings.tier1_url, RUN, 100) / src.name)
    with open_catalog(settings) as cat:
        rep = next(r for r in cat.replicas(cat.get_checkpoint(RUN, 100).id) if r.tier == 1)
        reclaims = [e for e in cat.history(RUN, 100) if e.action == "reclaim"]
    assert [e.subject for e in reclaims] == [f"replica:{rep.id}"] and claim_answer_lost


def test_a_lost_claim_is_given_back_to_one_taker_at_a_time(settings_factory, db_url, claim_answer_lost):
    from tasks.claim import ClaimedCopy

    settings = pipeline_settings(settings_factory, db_url)
    write_checkpoint(settings.tier0_url, RUN, 100)
    register_stored_part(settings, RUN, 100)
    with open_catalog(settings) as cat:
        ck = cat.get_checkpoint(RUN, 100)
        with pytest.raises(CatalogUnavailable):
            ClaimedCopy.take(cat, ck.id, 1, 0, "file:///t1", node=None, actor="a")
        first, _ = ClaimedCopy.take(cat, ck.id, 1, 0, "file:///t1", node=None, actor="a")
        second, rep = ClaimedCopy.take(cat, ck.id, 1, 0, "file:///t1", node=None, actor="b")
        assert first is not None and first.token == claim_answer_lost[0]
        assert second is None and rep.state == "copying" and rep.claim_token == first.token
        with first:
            first.settle("missing", "test: given up")
        third, _ = ClaimedCopy.take(cat, ck.id, 1, 0, "file:///t1", node=None, actor="b")
        assert third is not None and third.token != first.token  # settled: a fresh claim, a fresh token


def test_a_promotion_whose_release_the_catalog_missed_is_finished_by_its_retry_at_once(settings_factory, db_url,
                                                                                      monkeypatch):
    from db.catalog import Catalog

    settings = pipeline_settings(settings_factory, db_url)
    write_checkpoint(settings.tier0_url, RUN, 100, shards=3)
    original = Catalog.transition

    def unreachable(self, *args, **kwargs):  # every state change fails: the verdicts and the releases
        raise CatalogUnavailable("could not connect to server")

    monkeypatch.setattr(Catalog, "transition", unreachable)
    with pytest.raises(CatalogUnavailable):
        promote(settings, RUN, 100, steps=plain_steps())
    monkeypatch.setattr(Catalog, "transition", original)
    assert replica_states(settings, RUN, 100) == {(0, 0): "copying", (1, 0): "copying"}  # held by nobody

    promote(settings, RUN, 100, steps=plain_steps())  # the step's retry: no lease to wait out

    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "verified"}
    for src in shard_paths(settings.tier0_url, RUN, 100):
        assert same_bytes(src, ckpt_dir(settings.tier1_url, RUN, 100) / src.name)
    with open_catalog(settings) as cat:
        assert sorted(e.action for e in cat.history(RUN, 100) if e.action == "reclaim") == ["reclaim", "reclaim"]


# --- a storage that stops answering -----------------------------------------------------------
def assert_promoted(settings, step: int) -> None:
    """Both copies verified, and Tier 1 holds Tier 0's bytes."""
    assert replica_states(settings, RUN, step) == {(0, 0): "verified", (1, 0): "verified"}
    for src in shard_paths(settings.tier0_url, RUN, step):
        assert same_bytes(src, ckpt_dir(settings.tier1_url, RUN, step) / src.name)


def test_a_copy_whose_storage_hangs_lets_its_claim_lapse_and_publishes_nothing_after_the_retry(
        settings_factory, db_url, monkeypatch):
    """Tier 1 stops answering in the middle of a promotion: the worker is alive but stuck. Its
    claims stop being renewed once no byte moved for copy_stall_seconds, so they lapse and the
    retry takes the part over at once; when the stuck call returns, the worker publishes nothing."""
    import threading
    import time

    from core.errors import StaleState
    from core.storage import local

    settings = pipeline_settings(settings_factory, db_url).model_copy(
        update={"claim_lease_seconds": 0.5, "copy_stall_seconds": 0.3})  # below the settings' floor: a test
    write_checkpoint(settings.tier0_url, RUN, 100, shards=3)
    hung, released, original = threading.Event(), threading.Event(), local._copy_range

    def copy_range(src_fd, dst_fd, count):
        if not hung.is_set():  # the first copy into Tier 1 hangs until the test lets it go
            hung.set()
            assert released.wait(60)
        return original(src_fd, dst_fd, count)

    monkeypatch.setattr(local, "_copy_range", copy_range)
    failed: list[BaseException] = []

    def stuck_promotion() -> None:
        try:
            promote(settings, RUN, 100, steps=plain_steps())
        except BaseException as exc:  # the test looks at it
            failed.append(exc)

    worker = threading.Thread(target=stuck_promotion)
    worker.start()
    try:
        assert hung.wait(60)
        deadline = time.monotonic() + 60
        while True:  # renewed every 0.1 s while it moved; not once it stalled: the lease lapses
            with open_catalog(settings) as cat:
                lapsed = [(r.tier, r.state) for r in cat.expired_claims() if r.run == RUN and r.step == 100]
            if sorted(lapsed) == [(0, "copying"), (1, "copying")]:
                break
            assert time.monotonic() < deadline, f"the stuck worker still holds its claims: {lapsed}"
            time.sleep(0.05)

        promote(settings, RUN, 100, steps=plain_steps())  # the retry (reconcile's, another worker's)
    finally:
        released.set()
        worker.join(60)

    assert_promoted(settings, 100)
    assert not [p for p in published_files(settings.tier1_url, RUN, 100) if ".ckpt-staging-" in p]
    assert len(failed) == 1 and isinstance(failed[0], StaleState) and "stalled" in str(failed[0]), failed
    with open_catalog(settings) as cat:
        takeovers = [e for e in cat.history(RUN, 100) if "stale claim taken over" in (e.reason or "")]
    assert len(takeovers) == 2  # the Tier 0 check's claim and the copy's


def test_a_copy_that_hangs_while_deleting_a_corrupt_copy_keeps_its_claim(settings_factory, db_url, monkeypatch):
    """Deleting published bytes is never cut short for a stall: a worker taken over mid-delete
    that then woke would go on deleting what the new holder published. So a promotion that hangs
    while it deletes the corrupt Tier 1 copy it is about to replace keeps renewing its claim (no
    takeover), and finishes once the storage answers."""
    import threading
    import time

    from core.storage.local import LocalStore
    from tasks.claim import Lease

    settings = pipeline_settings(settings_factory, db_url).model_copy(
        update={"claim_lease_seconds": 2.0, "copy_stall_seconds": 0.3})  # below the settings' floor: a test
    write_checkpoint(settings.tier0_url, RUN, 100, shards=3)
    promote(settings, RUN, 100, steps=plain_steps())
    with open_catalog(settings) as cat:
        rep = next(r for r in cat.replicas(cat.get_checkpoint(RUN, 100).id) if r.tier == 1)
        cat.transition(rep.id, "corrupt", expected="verified", actor="test", reason="test: found rotten")
    leases: list[Lease] = []
    original_start, original_delete = Lease.start, LocalStore.delete_tomb
    hung, released = threading.Event(), threading.Event()

    def start(self):
        leases.append(self)
        return original_start(self)

    def delete_tomb(self, tomb, check):  # the corrupt copy, set aside: the storage stops answering
        if self.tier == 1 and not hung.is_set():
            hung.set()
            assert released.wait(60)
        return original_delete(self, tomb, check)

    monkeypatch.setattr(Lease, "start", start)
    monkeypatch.setattr(LocalStore, "delete_tomb", delete_tomb)
    worker = threading.Thread(target=promote, args=(settings, RUN, 100), kwargs={"steps": plain_steps()})
    worker.start()
    try:
        assert hung.wait(60)
        held = next(lease for lease in leases if lease.replica_id == rep.id)
        beats, deadline = held.beats, time.monotonic() + 60
        while held.beats < beats + 2:  # two renewals (every 0.4 s) after the stall limit passed
            assert held._lost is None, f"taken for stalled mid-delete: {held._lost}"
            assert time.monotonic() < deadline, "no renewal while the delete hangs"
            time.sleep(0.05)
        held.check()  # still its holder
        with open_catalog(settings) as cat:
            assert not [r for r in cat.expired_claims() if r.id == rep.id]
    finally:
        released.set()
        worker.join(60)

    assert_promoted(settings, 100)


# --- S3 5xx --------------------------------------------------------------------------------
@pytest.fixture
def flaky_s3(s3_endpoint):
    proxy = FaultProxy(s3_endpoint)
    yield proxy
    proxy.close()


def test_s3_503s_that_stop_are_retried_and_the_upload_succeeds(settings_factory, db_url, s3_bucket, flaky_s3):
    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=flaky_s3.url)
    write_checkpoint(settings.tier0_url, RUN, 100, kind="milestone")
    flaky_s3.fail = 3

    result = promote(settings, RUN, 100, steps=plain_steps())

    assert flaky_s3.failed == 3
    assert result.archive.archived
    assert replica_states(settings, RUN, 100)[(2, 0)] == "verified"


def test_s3_503s_that_persist_fail_the_archive_and_keep_every_copy(settings_factory, db_url, s3_bucket,
                                                                     s3_endpoint, flaky_s3, monkeypatch):
    import functools

    import boto3

    from core.storage.s3 import S3Store

    # boto3 retries each request 5 times over ~15 s before giving up; 2 attempts keep this fast
    monkeypatch.setattr(S3Store, "__init__", functools.partialmethod(S3Store.__init__, max_attempts=2))
    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=flaky_s3.url)
    write_checkpoint(settings.tier0_url, RUN, 100, kind="milestone")
    flaky_s3.fail = -1

    with pytest.raises(StorageUnavailable) as err:
        promote(settings, RUN, 100, steps=plain_steps())

    assert is_transient(err.value)  # a Prefect task retries it; here the plain step just fails
    listing = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").list_objects_v2(Bucket=s3_bucket)
    assert not any(o["Key"].endswith("manifest.json") for o in listing.get("Contents", []))
    states = replica_states(settings, RUN, 100)
    assert states[(0, 0)] == "verified" and states[(1, 0)] == "verified" and states[(2, 0)] != "verified"
    assert shard_paths(settings.tier0_url, RUN, 100)  # Tier 0 not pruned

    flaky_s3.fail = 0  # S3 recovers; the next reconcile pass archives the milestone
    report = reconcile_once(settings, steps=plain_steps())
    assert report.archived == [f"{RUN}/100"]
    assert replica_states(settings, RUN, 100)[(2, 0)] == "verified"


# --- Tier 1 full ---------------------------------------------------------------------------
@pytest.fixture(params=["tmpfs-4MiB", "injected-ENOSPC"])
def full_tier1(request, tmp_path, monkeypatch):
    """A Tier 1 root that runs out of space after about 4 MiB."""
    root = tmp_path / "tier1-full"
    root.mkdir()
    if request.param == "tmpfs-4MiB":
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root)], capture_output=True)
        if done.returncode != 0:
            require(f"mount -t tmpfs failed: {done.stderr.decode().strip()}", "a 4 MiB tmpfs (root, or CAP_SYS_ADMIN)")
        yield str(root)
        subprocess.run(["umount", str(root)], check=False)
        return
    import core.storage.local as fs

    monkeypatch.setattr(fs, "os", FullDisk(os, str(root), 4 << 20))
    yield str(root)


class FullDisk:
    """``os`` as the storage module sees it, except that writes into files under ``root``
    (``write`` and in-kernel ``copy_file_range``) fail with ENOSPC past ``limit`` bytes."""

    def __init__(self, real, root: str, limit: int):
        self._real, self._root, self._left = real, root, limit

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _charge(self, fd: int, n: int) -> None:
        if self._real.readlink(f"/proc/self/fd/{fd}").startswith(self._root):
            self._left -= n
            if self._left < 0:
                raise OSError(errno.ENOSPC, "No space left on device")

    def write(self, fd, data):
        n = self._real.write(fd, data)
        self._charge(fd, n)
        return n

    def copy_file_range(self, src, dst, count, *args):
        n = self._real.copy_file_range(src, dst, count, *args)
        self._charge(dst, n)
        return n


def test_tier1_full_fails_cleanly_and_publishes_nothing(settings_factory, db_url, full_tier1):
    settings = pipeline_settings(settings_factory, db_url, tier1_url=full_tier1)
    write_checkpoint(settings.tier0_url, RUN, 100, shards=2, shard_bytes=3 << 20)

    with pytest.raises(StorageFull):
        promote(settings, RUN, 100, steps=plain_steps())

    assert_nothing_partial_published(settings, 100)
    assert not [p for p in published_files(full_tier1, RUN, 100) if ".ckpt-staging-" in p]
    states = replica_states(settings, RUN, 100)
    assert states[(0, 0)] == "verified" and states[(1, 0)] == "missing"
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2
