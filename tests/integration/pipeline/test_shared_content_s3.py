"""Each byte stored once on Tier 2 (``core.storage.s3.shared``), through the real promotion and
archive (plain functions, moto's S3 server, a real catalog on SQLite and PostgreSQL), and the
store's Object Lock on a locked bucket.

What a user checks: milestones of a fine-tune whose base does not change upload the base once
and every milestone restores whole from Tier 2 alone; a stored content whose recorded hash
differs from the source's is never pointed to; a shared object stays locked until the latest
lock date of the milestones that reference it."""

from __future__ import annotations

import io
import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3

from core import checksum
from core.layout import checkpoint_prefix
from core.storage.content import CONTENT_DIR
from core.storage.s3 import S3Store
from core.transfer import read_committed, verify_part
from db.catalog import Catalog
from tasks.restore import restore_checkpoint
from tests.kit.restore import commit_folder, promote, scenario_settings

RUN = "run-ft"
BASE = os.urandom(1 << 20)
SMALL = 64 << 10  # files this large are shared (the store's ranged threshold, lowered)


def _settings(settings_factory, db_url, s3_endpoint, s3_bucket, **kw):
    return scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket,
                             s3_ranged_threshold=SMALL, s3_range_bytes=SMALL, **kw)


def save(settings, step: int) -> bytes:
    adapter = os.urandom(SMALL)
    commit_folder(settings, RUN, step, {"base.bin": BASE, "adapter.bin": adapter}, milestone=True)
    result = promote(settings, RUN, step)
    assert result.durable and result.archive is not None
    return adapter


def objects(settings) -> dict[str, int]:
    bucket = settings.tier2_url.removeprefix("s3://").split("/", 1)[0]
    client = boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name="us-east-1")
    return {o["Key"]: o["Size"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
            for o in page.get("Contents", [])}


def restored(settings, step: int, tmp: Path) -> dict[str, bytes]:
    dest = tmp / f"restored-{step}"
    restore_checkpoint(settings, RUN, dest, step=step, preference=(2,), fallback=False)
    return {p.name: p.read_bytes() for p in dest.iterdir() if p.name != "manifest.json"}


def test_milestones_upload_a_frozen_base_once_and_restore_whole_from_tier2(settings_factory, db_url, s3_endpoint,
                                                                            s3_bucket, tmp_path):
    settings = _settings(settings_factory, db_url, s3_endpoint, s3_bucket)
    adapters = {step: save(settings, step) for step in (100, 200, 300)}

    held = objects(settings)
    assert [size for key, size in held.items() if size == len(BASE)] == [len(BASE)]  # one copy of the base
    assert sum(held.values()) < len(BASE) + sum(map(len, adapters.values())) + 64 * 1024  # + manifests, hashes
    assert any(key.startswith(f"ckpt/{CONTENT_DIR}/") for key in held)
    with Catalog(settings.catalog_url) as cat:
        assert cat.stored_bytes(2) == len(BASE) + sum(map(len, adapters.values()))
    from tasks.base import tier_store

    store = tier_store(settings, 2)
    for step, adapter in adapters.items():  # each one whole, from Tier 2 alone
        verify_part(store, checkpoint_prefix(RUN, step), read_committed(store, RUN, step))
        assert restored(settings, step, tmp_path) == {"base.bin": BASE, "adapter.bin": adapter}


def test_a_content_whose_recorded_hash_differs_is_never_pointed_to(settings_factory, db_url, s3_endpoint, s3_bucket,
                                                                     tmp_path):
    settings = _settings(settings_factory, db_url, s3_endpoint, s3_bucket)
    save(settings, 100)
    assert not [k for k in objects(settings) if k.endswith(".sha256")]  # a content seen once is not hashed
    save(settings, 200)  # seen again: the stored bytes read back, equal to the source's, its hash recorded
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    recorded = next(k for k in objects(settings) if k.endswith(f"-{len(BASE)}.sha256"))
    assert objects(settings)[f"ckpt/{checkpoint_prefix(RUN, 200)}/base.bin"] == 0  # a pointer
    client.delete_object(Bucket=s3_bucket, Key=recorded)  # another content under the same CRC32C and size
    client.put_object(Bucket=s3_bucket, Key=recorded, Body=b"0" * 64)

    adapter = save(settings, 300)

    base_key = f"ckpt/{checkpoint_prefix(RUN, 300)}/base.bin"
    assert objects(settings)[base_key] == len(BASE)  # uploaded whole under its own key
    assert restored(settings, 300, tmp_path) == {"base.bin": BASE, "adapter.bin": adapter}


def test_a_shared_object_stays_locked_until_the_latest_milestone_that_references_it(s3_endpoint, tmp_path):
    bucket = f"lock-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket, ObjectLockEnabledForBucket=True)
    source = tmp_path / "base.bin"
    source.write_bytes(BASE)
    crc = checksum.hash_bytes(BASE)

    def archive(key: str, lock_days: float) -> S3Store:
        store = S3Store(f"s3://{bucket}/vault", 2, endpoint_url=s3_endpoint, lock_days=lock_days,
                        ranged_threshold=SMALL, range_bytes=SMALL, shared_content=True)
        with open(source, "rb", buffering=0) as fh:
            store.put_verified(key, fh, len(BASE), crc)
        return store

    archive("run/step-00000001/base.bin", 1)
    store = archive("run/step-00000002/base.bin", 3)  # a later milestone, locked longer

    content = [o["Key"] for o in store.client.list_objects_v2(Bucket=bucket)["Contents"]
               if o["Size"] == len(BASE)]
    assert len(content) == 1
    until = store.client.head_object(Bucket=bucket, Key=content[0])["ObjectLockRetainUntilDate"]
    assert until > datetime.now(UTC) + timedelta(days=2.9)
    with store.open_read("run/step-00000001/base.bin") as fh:
        assert fh.read() == BASE
    store.verify_object("run/step-00000002/base.bin", len(BASE), crc)
    store.close()


def test_a_pointer_is_listed_and_read_as_its_content(s3_endpoint, tmp_path):
    bucket = f"plain-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    source = tmp_path / "base.bin"
    source.write_bytes(BASE)
    crc = checksum.hash_bytes(BASE)
    writer = S3Store(f"s3://{bucket}/vault", 2, endpoint_url=s3_endpoint, ranged_threshold=SMALL, range_bytes=SMALL,
                     shared_content=True)
    for step in (1, 2):
        with open(source, "rb", buffering=0) as fh:
            writer.put_verified(f"run/step-0000000{step}/base.bin", fh, len(BASE), crc)
    writer.put_verified("run/step-00000002/empty.bin", io.BytesIO(b""), 0, checksum.hash_bytes(b""))

    reader = S3Store(f"s3://{bucket}/vault", 2, endpoint_url=s3_endpoint, ranged_threshold=SMALL, range_bytes=SMALL)
    assert {o.key: o.size for o in reader.list("run")} == {
        "run/step-00000001/base.bin": len(BASE), "run/step-00000002/base.bin": len(BASE),
        "run/step-00000002/empty.bin": 0}
    assert reader.folders() == ("run",)
    fd = os.open(tmp_path / "fetched", os.O_CREAT | os.O_WRONLY)
    try:
        assert reader.read_ranges_into("run/step-00000002/base.bin", fd, len(BASE)) == (len(BASE), crc)
    finally:
        os.close(fd)
    assert (tmp_path / "fetched").read_bytes() == BASE
    writer.close()
    reader.close()


def test_retired_milestones_free_the_contents_no_kept_one_references(settings_factory, db_url, s3_endpoint,
                                                                     s3_bucket, tmp_path):
    from core.settings import RetentionPolicy
    from flows.common import plain_steps
    from flows.retention import run_retention
    from tasks.contents import sweep_shared_contents

    last = RetentionPolicy(keep_last=1, keep_milestones=False)
    settings = _settings(settings_factory, db_url, s3_endpoint, s3_bucket, retention_tier0=last,
                         retention_tier1=last, retention_tier2=last)
    adapters = {step: save(settings, step) for step in (100, 200, 300)}  # retention runs after each one
    run_retention(settings, run=RUN, steps=plain_steps(), actor="test")
    assert not [k for k in objects(settings) if "step-00000100" in k or "step-00000200" in k]
    assert len([k for k, size in objects(settings).items() if size == SMALL]) == 3  # pointers went, contents stay

    assert sweep_shared_contents(settings, actor="test") == 0  # first pass: marked, nothing deleted yet
    kept = objects(settings)
    assert sweep_shared_contents(settings.model_copy(update={"claim_lease_seconds": 0}), actor="test") == 2

    held = objects(settings)
    assert sorted(size for size in held.values() if size >= SMALL) == [SMALL, len(BASE)]  # step 300's alone
    assert set(held) < set(kept)
    assert restored(settings, 300, tmp_path) == {"base.bin": BASE, "adapter.bin": adapters[300]}
    with Catalog(settings.catalog_url) as cat:
        assert cat.stored_bytes(2) == len(BASE) + SMALL
    save(settings, 400)  # the base is still shared after the sweep
    assert [size for size in objects(settings).values() if size == len(BASE)] == [len(BASE)]


def test_a_sweep_asks_the_catalog_twice_and_one_refused_delete_fails_alone(settings_factory, db_url, s3_endpoint,
                                                                           s3_bucket, tmp_path, monkeypatch):
    """S3 refusing one content's delete (here: the store's delete raising for that key, since
    moto refuses none) fails that content alone: the sweep deletes the others, then says how
    many failed; the next sweep finishes. The catalog is asked twice per sweep, not once per
    content."""
    import pytest

    from core.errors import StorageUnavailable
    from core.settings import RetentionPolicy
    from flows.common import plain_steps
    from flows.retention import run_retention
    from tasks.contents import sweep_shared_contents

    last = RetentionPolicy(keep_last=1, keep_milestones=False)
    settings = _settings(settings_factory, db_url, s3_endpoint, s3_bucket, retention_tier0=last,
                         retention_tier1=last, retention_tier2=last)
    for step in (100, 200, 300):
        save(settings, step)
    run_retention(settings, run=RUN, steps=plain_steps(), actor="test")
    assert sweep_shared_contents(settings, actor="test") == 0  # marked
    now = settings.model_copy(update={"claim_lease_seconds": 0})

    asked = []
    real_referenced = Catalog.referenced_contents
    monkeypatch.setattr(Catalog, "referenced_contents", lambda self, tier: asked.append(tier) or
                        real_referenced(self, tier))
    real_delete = S3Store.delete
    refused = []

    def delete(self, key):
        if key.startswith(CONTENT_DIR) and not key.endswith((".unreferenced", ".sha256")) and not refused:
            refused.append(key)
            raise StorageUnavailable(f"AccessDenied on {key}")
        return real_delete(self, key)

    monkeypatch.setattr(S3Store, "delete", delete)
    with pytest.raises(StorageUnavailable, match=r"1 of \d+ shared contents .* could not be swept \(1 were\)"):
        sweep_shared_contents(now, actor="test")
    assert asked == [2, 2]
    held = {k for k, size in objects(settings).items() if size == SMALL}
    assert f"ckpt/{refused[0]}" in held and len(held) == 2  # step 300's adapter and the refused one: the other went
    assert sweep_shared_contents(now, actor="test") == 1  # the next sweep finishes
    assert {k for k, size in objects(settings).items() if size == SMALL} == held - {f"ckpt/{refused[0]}"}


def content_of(settings, size: int) -> str:
    return next(k for k, n in objects(settings).items() if f"/{CONTENT_DIR}/" in k and n == size)


def _base_saved_once(settings_factory, db_url, s3_endpoint, s3_bucket):
    """A site whose first milestone stored the base as a content: (settings, an S3 client, the
    content's key)."""
    settings = _settings(settings_factory, db_url, s3_endpoint, s3_bucket)
    save(settings, 100)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    return settings, client, content_of(settings, len(BASE))


def test_a_content_stored_without_its_hash_is_read_back_by_the_next_copy_and_shared_again(
        settings_factory, db_url, s3_endpoint, s3_bucket, tmp_path):
    settings, client, base = _base_saved_once(settings_factory, db_url, s3_endpoint, s3_bucket)
    client.delete_object(Bucket=s3_bucket, Key=base + ".sha256")  # none: seen once, or its uploader died

    adapters = {step: save(settings, step) for step in (200, 300)}

    held = objects(settings)
    assert [k for k, n in held.items() if n == len(BASE)] == [base]  # no copy uploaded the base again
    assert base + ".sha256" in held
    for step, adapter in adapters.items():
        assert restored(settings, step, tmp_path) == {"base.bin": BASE, "adapter.bin": adapter}


def test_a_content_without_its_hash_whose_bytes_differ_is_never_pointed_to(settings_factory, db_url, s3_endpoint,
                                                                          s3_bucket, tmp_path):
    settings, client, base = _base_saved_once(settings_factory, db_url, s3_endpoint, s3_bucket)
    client.delete_object(Bucket=s3_bucket, Key=base + ".sha256")
    other = bytearray(BASE)
    other[7] ^= 1  # other bytes under the same name (in a test the CRC32C differs too: the name decides the read)
    client.put_object(Bucket=s3_bucket, Key=base, Body=bytes(other))

    adapter = save(settings, 200)

    assert objects(settings)[f"ckpt/{checkpoint_prefix(RUN, 200)}/base.bin"] == len(BASE)  # uploaded whole
    assert base + ".sha256" not in objects(settings)
    assert restored(settings, 200, tmp_path) == {"base.bin": BASE, "adapter.bin": adapter}


def test_a_content_a_sweep_marked_is_never_pointed_to_whatever_hash_it_has(settings_factory, db_url, s3_endpoint,
                                                                           s3_bucket, tmp_path):
    settings, client, base = _base_saved_once(settings_factory, db_url, s3_endpoint, s3_bucket)
    client.put_object(Bucket=s3_bucket, Key=base + ".unreferenced", Body=b"")  # a sweep's first pass, the hash
    # recorded again by a read-back after it took the hash away: the second pass may delete the content

    adapter = save(settings, 200)

    assert objects(settings)[f"ckpt/{checkpoint_prefix(RUN, 200)}/base.bin"] == len(BASE)  # uploaded whole
    assert restored(settings, 200, tmp_path) == {"base.bin": BASE, "adapter.bin": adapter}


def test_deleting_checkpoints_of_pointers_lists_them_without_resolving_each_pointer(s3_endpoint, tmp_path):
    """A listing returns no metadata, so ``list`` resolves each pointer with a HeadObject (its
    content's size); a delete needs only the keys: no request per pointer."""
    from tests.kit.s3_proxy import S3Proxy

    bucket = f"plain-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    source = tmp_path / "base.bin"
    source.write_bytes(BASE)
    crc = checksum.hash_bytes(BASE)
    proxy = S3Proxy(s3_endpoint)
    store = S3Store(f"s3://{bucket}/vault", 2, endpoint_url=proxy.url, ranged_threshold=SMALL, range_bytes=SMALL,
                    shared_content=True)
    try:
        for step in (1, 2):
            for name in ("a", "b", "c"):
                with open(source, "rb", buffering=0) as fh:
                    store.put_verified(f"run/step-0000000{step}/{name}.bin", fh, len(BASE), crc)
        proxy.seen.clear()

        store.delete_tomb(store.bury("run/step-00000001", None, token="t1"), lambda: None)  # a prune
        assert store.delete_prefix("run/step-00000002") == 3

        assert [r.path for r in proxy.seen if r.method == "HEAD" and ".bin" in r.path] == []
        assert store.list("run") == []
    finally:
        store.close()
        proxy.close()


def _shared_store(s3_endpoint: str, tmp_path: Path) -> tuple[S3Store, Path, str]:
    """A sharing store on a bucket of its own, and a local source of the base with its CRC32C."""
    bucket = f"plain-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    source = tmp_path / "base.bin"
    source.write_bytes(BASE)
    store = S3Store(f"s3://{bucket}/vault", 2, endpoint_url=s3_endpoint, ranged_threshold=SMALL, range_bytes=SMALL,
                    shared_content=True)
    return store, source, checksum.hash_bytes(BASE)


class _StoredContent:
    """A reader of a Tier 1 file that is its content store's own inode, as the transfer engine
    hands one to the S3 store (``TierStore.holds_content``)."""

    stored_content = True

    def __init__(self, fh):
        self.fh = fh

    def read(self, n: int = -1) -> bytes:
        return self.fh.read(n)

    def fileno(self) -> int:
        return self.fh.fileno()


def _counting_reads(monkeypatch, path: Path) -> list[int]:
    """Bytes read from ``path``'s inode by ``os.pread`` (how the shared upload reads a local
    source) while the test runs; the reads still happen."""
    inode, got, real = path.stat().st_ino, [], os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        data = real(fd, n, offset)
        if os.fstat(fd).st_ino == inode:
            got.append(len(data))
        return data

    monkeypatch.setattr(os, "pread", pread)
    return got


def test_a_source_whose_inode_carries_the_recorded_hash_is_shared_without_a_read(s3_endpoint, tmp_path,
                                                                                  monkeypatch):
    """A Tier 1 file linked to a content hashed before (a frozen base, after its second copy)
    costs its upload a few requests; once the file was written since, it is hashed again."""
    from core.storage.content import known_sha256

    store, source, crc = _shared_store(s3_endpoint, tmp_path)

    def put(step: int) -> None:
        with open(source, "rb", buffering=0) as fh:
            store.put_verified(f"run/step-0000000{step}/base.bin", _StoredContent(fh), len(BASE), crc)

    put(1)
    put(2)  # the second copy reads the stored bytes back and records the hash; the source's inode notes it
    with open(source, "rb", buffering=0) as fh:
        assert known_sha256(fh.fileno()) == store._recorded_hash(store.resolve("run/step-00000002/base.bin"))
    reads = _counting_reads(monkeypatch, source)
    put(3)
    assert sum(reads) == 0
    with store.open_read("run/step-00000003/base.bin") as fh:
        assert fh.read() == BASE

    st = source.stat()
    source.write_bytes(BASE)  # written again (same bytes, a new modification time): the note no longer holds
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    put(4)
    assert sum(reads) >= len(BASE)
    store.close()


def test_a_source_rotted_behind_its_hash_note_never_gives_tier2_other_bytes(s3_endpoint, tmp_path):
    """Bit rot changes neither size nor modification time, so the note still holds: the pointer
    names the stored content, whose bytes are the manifest's, never the rotted source's."""
    store, source, crc = _shared_store(s3_endpoint, tmp_path)
    for step in (1, 2):
        with open(source, "rb", buffering=0) as fh:
            store.put_verified(f"run/step-0000000{step}/base.bin", _StoredContent(fh), len(BASE), crc)
    st = source.stat()
    with open(source, "r+b") as fh:
        fh.seek(1000)
        fh.write(bytes([BASE[1000] ^ 0xFF]))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))

    with open(source, "rb", buffering=0) as fh:
        store.put_verified("run/step-00000003/base.bin", _StoredContent(fh), len(BASE), crc)

    store.verify_object("run/step-00000003/base.bin", len(BASE), crc)
    with store.open_read("run/step-00000003/base.bin") as fh:
        assert fh.read() == BASE
    store.close()


def test_a_note_on_a_file_that_is_not_a_stored_content_is_never_read(s3_endpoint, tmp_path, monkeypatch):
    """A trainer's file (Tier 0, or any file not its tier's stored content) with a note naming
    the recorded hash (copied along with its extended attributes, or forged) is hashed whole:
    only the content store's own inodes are trusted to carry one."""
    from core.storage.content import noted_sha256

    store, source, crc = _shared_store(s3_endpoint, tmp_path)
    for step in (1, 2):
        with open(source, "rb", buffering=0) as fh:
            store.put_verified(f"run/step-0000000{step}/base.bin", fh, len(BASE), crc)
    recorded = store._recorded_hash(store.resolve("run/step-00000002/base.bin"))
    other = tmp_path / "trainer.bin"
    other.write_bytes(BASE)
    with open(other, "rb", buffering=0) as fh:
        noted_sha256(fh.fileno(), recorded)
    reads = _counting_reads(monkeypatch, other)

    with open(other, "rb", buffering=0) as fh:
        store.put_verified("run/step-00000003/base.bin", fh, len(BASE), crc)

    assert sum(reads) >= len(BASE)
    store.close()


def test_milestones_of_a_frozen_base_note_its_hash_on_the_tier1_content(settings_factory, db_url, s3_endpoint,
                                                                        s3_bucket):
    """Through the pipeline: the Tier 1 content of the base carries the hash Tier 2 recorded, so
    every archive after the second shares the base with no read of it."""
    from core.storage.content import known_sha256

    settings = _settings(settings_factory, db_url, s3_endpoint, s3_bucket)
    for step in (100, 200, 300):
        save(settings, step)
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    recorded = client.get_object(Bucket=s3_bucket, Key=content_of(settings, len(BASE)) + ".sha256")["Body"].read()
    fd = os.open(Path(settings.tier1_url) / checkpoint_prefix(RUN, 300) / "base.bin", os.O_RDONLY)
    try:
        assert known_sha256(fd) == recorded.decode()
    finally:
        os.close(fd)
