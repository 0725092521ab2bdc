"""copy_part / verify_part against S3 over HTTP (moto, then LocalStack): multipart, server-side CRC32C,
objects replaced behind our back, and S3 5xx."""

from __future__ import annotations

import threading

import pytest

from core.errors import CorruptCheckpoint, StorageUnavailable
from core.layout import checkpoint_prefix
from core.storage.local import LocalStore
from core.storage.s3 import S3Store, new_client
from core.transfer import copy_part, find_committed, verify_part
from tests.kit.checkpoints import write_checkpoint
from tests.kit.servers import each_s3_endpoint  # noqa: F401 - every test here on moto, then LocalStack

MiB = 1024 * 1024
RUN, STEP = "run-a", 200
PREFIX = checkpoint_prefix(RUN, STEP)


@pytest.fixture
def s3_store(s3_endpoint, s3_bucket):
    s = S3Store(f"s3://{s3_bucket}/vault", 2, endpoint_url=s3_endpoint, multipart_threshold=5 * MiB,
                chunk_bytes=5 * MiB, max_concurrency=4, max_attempts=4)
    # a client of its own: inject_500 hooks into it, and the process's shared one must not see that
    s.client = new_client(s3_endpoint, "us-east-1", 4, s.pool_connections())
    yield s
    s.close()


def test_tier1_to_s3_and_restore_back(tiers, s3_store, tmp_path):
    t0, t1 = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=4, shard_bytes=8 * MiB)  # 8 MiB shards: multipart on S3
    copy_part(t0, PREFIX, t1, PREFIX, m)
    report = copy_part(t1, PREFIX, s3_store, PREFIX, m, parallelism=2)
    assert report.bytes == m.total_bytes
    assert list(find_committed(s3_store)) == [(RUN, STEP, 0, 1, "")]
    verify_part(s3_store, PREFIX, m, deep=False)  # server-side CRC32C, no download
    (tmp_path / "restore").mkdir()  # a store never creates its root
    restore = LocalStore(tmp_path / "restore", 0)
    copy_part(s3_store, PREFIX, restore, "ck", m)
    for f in m.files:
        assert (restore.root / "ck" / f.path).read_bytes() == (t0.root / PREFIX / f.path).read_bytes()


def test_s3_object_replaced_behind_our_back_is_found(tiers, s3_store):
    t0, _ = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=2, shard_bytes=64 * 1024)
    copy_part(t0, PREFIX, s3_store, PREFIX, m)
    victim = m.files[0]
    data = bytearray((t0.root / PREFIX / victim.path).read_bytes())
    data[-1] ^= 1
    s3_store.client.put_object(Bucket=s3_store.bucket, Key=s3_store._k(f"{PREFIX}/{victim.path}"), Body=bytes(data))
    for deep in (False, True):
        with pytest.raises(CorruptCheckpoint) as exc:
            verify_part(s3_store, PREFIX, m, deep=deep)
        assert exc.value.path == victim.path


class _Raw:
    def __init__(self, body: bytes):
        self.body = body

    def stream(self, **_):
        yield self.body


def inject_500(store: S3Store, ops: tuple[str, ...], times: int | None):
    """Answer the first ``times`` calls of ``ops`` with HTTP 500 (None: forever)."""
    from botocore.awsrequest import AWSResponse

    calls = {"n": 0}

    def hook(request, **_):
        calls["n"] += 1
        if times is None or calls["n"] <= times:
            body = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
            return AWSResponse(request.url, 500, {}, _Raw(body))
        return None

    for op in ops:
        store.client.meta.events.register(f"before-send.s3.{op}", hook)
    calls["stop"] = lambda: [store.client.meta.events.unregister(f"before-send.s3.{op}", hook) for op in ops]
    return calls


def test_s3_5xx_then_recovering_is_retried(tiers, s3_store):
    t0, _ = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=2, shard_bytes=8 * MiB)
    calls = inject_500(s3_store, ("UploadPart", "PutObject"), times=2)
    report = copy_part(t0, PREFIX, s3_store, PREFIX, m)
    assert calls["n"] > 2 and report.files == len(m.files)
    verify_part(s3_store, PREFIX, m, deep=False)


def test_s3_persistent_5xx_is_storage_unavailable_and_commits_nothing(tiers, s3_store):
    t0, _ = tiers
    m = write_checkpoint(t0.root, RUN, STEP, shards=2, shard_bytes=8 * MiB)
    calls = inject_500(s3_store, ("UploadPart", "PutObject"), times=None)
    with pytest.raises(StorageUnavailable):
        copy_part(t0, PREFIX, s3_store, PREFIX, m)
    assert list(find_committed(s3_store)) == []
    assert not s3_store.client.list_multipart_uploads(Bucket=s3_store.bucket).get("Uploads")
    calls["stop"]()  # the endpoint recovers: a retry with the same store completes
    retry = threading.Thread(target=copy_part, args=(t0, PREFIX, s3_store, PREFIX, m))
    retry.start()
    retry.join(timeout=60)
    assert not retry.is_alive(), "upload slots leaked by the failed attempt"
    verify_part(s3_store, PREFIX, m, deep=False)


def test_the_client_pool_holds_every_request_a_parallel_transfer_makes(s3_endpoint, s3_bucket, tiers, tmp_path,
                                                                       settings_factory, caplog):
    """Without a connection per concurrent request urllib3 opens extra ones, logs "Connection
    pool is full, discarding connection" and throws each away after one request."""
    from core.storage import open_store

    settings = settings_factory(tier2_url=f"s3://{s3_bucket}/pool", s3_endpoint_url=s3_endpoint,
                                copy_parallelism=24, s3_max_concurrency=2)
    store = open_store(settings.tier2_url, 2, settings)
    try:
        assert store.client.meta.config.max_pool_connections >= settings.copy_parallelism + 2
        t0, _ = tiers
        m = write_checkpoint(t0.root, RUN, STEP, shards=24, shard_bytes=256 * 1024)
        caplog.set_level("WARNING", logger="urllib3.connectionpool")
        copy_part(t0, PREFIX, store, PREFIX, m, parallelism=settings.copy_parallelism)
        (tmp_path / "back").mkdir()  # a store never creates its root
        copy_part(store, PREFIX, LocalStore(tmp_path / "back", 0), "ck", m, parallelism=settings.copy_parallelism)
    finally:
        store.close()
    assert [r.getMessage() for r in caplog.records if "pool is full" in r.getMessage()] == []


@pytest.mark.parametrize("stored", [100_000, 250_000, 200_000])
def test_ranged_read_of_an_object_of_the_wrong_size_or_bytes_is_corrupt(s3_endpoint, s3_bucket, tmp_path, stored):
    """Ranged reads check each range's bounds and the object's size, and the combined CRC32C."""
    import os

    from core import checksum

    store = S3Store(f"s3://{s3_bucket}/ranged", 2, endpoint_url=s3_endpoint, range_bytes=64 * 1024,
                    ranged_threshold=64 * 1024)
    expected = os.urandom(200_000)
    data = expected[:stored] if stored < len(expected) else expected + os.urandom(stored - len(expected))
    if stored == len(expected):
        data = data[:1000] + bytes([data[1000] ^ 1]) + data[1001:]  # same size, one bit flipped
    store.client.put_object(Bucket=s3_bucket, Key="ranged/obj", Body=data)
    (tmp_path / "t0").mkdir()  # a store never creates its root
    dst = LocalStore(tmp_path / "t0", 0)
    try:
        with pytest.raises(CorruptCheckpoint):
            dst.put_written("obj", lambda fd: store.read_ranges_into("obj", fd, len(expected)), len(expected),
                            checksum.hash_bytes(expected))
        assert not list((tmp_path / "t0").iterdir())  # nothing published, no staging left
        dst.put_written("good", lambda fd: store.read_ranges_into("obj", fd, stored), stored, checksum.hash_bytes(data))
        assert (tmp_path / "t0" / "good").read_bytes() == data
    finally:
        store.close()


def test_a_ranged_fetch_reads_the_body_in_small_chunks(s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    """Each read of a GET's body asks for at most READ_CHUNK_BYTES (256 KiB), whatever the
    store's copy buffer (4 MiB reads cost 16 fetching nodes twice the CPU per byte), and the
    bytes land whole."""
    import os

    from core.storage.s3 import store as s3store

    asked: list[int] = []
    read = s3store._Body.read

    def spying(self, n=-1):
        asked.append(n)
        return read(self, n)

    monkeypatch.setattr(s3store._Body, "read", spying)
    store = S3Store(f"s3://{s3_bucket}/chunks", 2, endpoint_url=s3_endpoint, buffer_bytes=4 * 1024 * 1024,
                    range_bytes=1024 * 1024, ranged_threshold=1024 * 1024)
    fetch_ranged_whole(store, os.urandom(3 * 1024 * 1024 + 5), tmp_path)
    assert store.read_chunk_bytes == s3store.READ_CHUNK_BYTES == 256 * 1024
    assert asked and max(asked) <= s3store.READ_CHUNK_BYTES + 1  # +1: the probe past a range's end


def test_a_ranged_fetch_starts_writeback_of_each_range_as_it_lands(s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    """Each range's bytes are handed to the kernel to write while the rest still arrive (each
    byte at most once, inside its own range, at most WRITEBACK_BYTES left per range for the
    fsync), and the file lands whole (core/storage/writeback.py)."""
    import itertools
    import os

    from core.storage import writeback

    seen: list[tuple[int, int]] = []
    real = writeback._sync_file_range

    def spy(fd, offset, length, flags):
        seen.append((offset, offset + length))
        return real(fd, offset, length, flags) if real is not None else 0

    monkeypatch.setattr(writeback, "_sync_file_range", spy)
    store = S3Store(f"s3://{s3_bucket}/wb", 2, endpoint_url=s3_endpoint, range_bytes=3 * MiB,
                    ranged_threshold=3 * MiB)
    data = os.urandom(9 * MiB + 7)
    fetch_ranged_whole(store, data, tmp_path)
    from core.storage.s3.store import split_ranges

    for off, n in split_ranges(len(data), 3 * MiB):
        mine = sorted(s for s in seen if off <= s[0] < off + n)
        assert mine and mine[0][0] == off and mine[-1][1] <= off + n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))  # contiguous, no byte twice
        assert off + n - mine[-1][1] < writeback.WRITEBACK_BYTES


def fetch_ranged_whole(store: S3Store, data: bytes, tmp_path) -> None:
    """``data`` stored as ``obj`` under the store, fetched back with ranged GETs into a Tier 0
    store under ``tmp_path`` (the store closed after); the fetched file holds exactly ``data``."""
    from core import checksum

    store.client.put_object(Bucket=store.bucket, Key=store._k("obj"), Body=data)
    (tmp_path / "t0").mkdir()  # a store never creates its root
    dst = LocalStore(tmp_path / "t0", 0)
    try:
        dst.put_written("obj", lambda fd: store.read_ranges_into("obj", fd, len(data)), len(data),
                        checksum.hash_bytes(data))
    finally:
        store.close()
    assert (tmp_path / "t0" / "obj").read_bytes() == data
