"""Tier 2 under S3 Object Lock, on moto's S3 server over HTTP and on LocalStack's (both enforce Object Lock: a
locked version refuses DeleteObject with its VersionId, AccessDenied).

Uploads carry the lock; a store asked to lock refuses a bucket without Object Lock before
writing anything; deleting a locked object is ``ObjectLocked`` and leaves every byte; deleting
an unlocked object on a versioned bucket removes its versions, not just hides them."""

from __future__ import annotations

import io
import os
import uuid
from datetime import UTC, datetime, timedelta

import boto3
import pytest

from core import checksum
from core.errors import ConfigError, ObjectLocked
from core.storage.s3 import S3Store
from tests.kit.servers import each_s3_endpoint  # noqa: F401 - every test here on moto, then LocalStack

MiB = 1024 * 1024


def _bucket(endpoint: str, *, lock: bool) -> str:
    name = f"lock-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket=name, **({"ObjectLockEnabledForBucket": True} if lock else {}))
    return name


def _store(endpoint: str, bucket: str, **kw) -> S3Store:
    return S3Store(f"s3://{bucket}/vault", 2, endpoint_url=endpoint, multipart_threshold=5 * MiB,
                   chunk_bytes=5 * MiB, max_concurrency=2, max_attempts=2, **kw)


def _put(store: S3Store, key: str, data: bytes) -> None:
    store.put_verified(key, io.BytesIO(data), len(data), checksum.hash_bytes(data))


def _versions(store: S3Store, key: str) -> tuple[list, list]:
    r = store.client.list_object_versions(Bucket=store.bucket, Prefix=store._k(key))
    return r.get("Versions", []), r.get("DeleteMarkers", [])


@pytest.mark.parametrize(("mode", "size"), [("governance", 1000), ("compliance", 11 * MiB)])  # 11 MiB: multipart
def test_locked_upload_cannot_be_deleted_before_its_date(s3_endpoint, mode, size):
    store = _store(s3_endpoint, _bucket(s3_endpoint, lock=True), lock_days=2, lock_mode=mode)
    data = os.urandom(size)
    _put(store, "run/step-00000001/shard.bin", data)

    head = store.client.head_object(Bucket=store.bucket, Key=store._k("run/step-00000001/shard.bin"))
    assert head["ObjectLockMode"] == mode.upper()
    now = datetime.now(UTC)
    assert now + timedelta(days=1.9) < head["ObjectLockRetainUntilDate"] < now + timedelta(days=2.1)
    assert store.locked_until(["run/step-00000001/shard.bin"]) == head["ObjectLockRetainUntilDate"]

    # a compromised agent with the same credentials: the version itself refuses to go
    with pytest.raises(Exception, match="AccessDenied"):
        store.client.delete_object(Bucket=store.bucket, Key=store._k("run/step-00000001/shard.bin"),
                                   VersionId=head["VersionId"])
    with pytest.raises(ObjectLocked) as exc:
        store.delete("run/step-00000001/shard.bin")
    assert exc.value.until == head["ObjectLockRetainUntilDate"]
    with pytest.raises(ObjectLocked):
        store.delete_prefix("run/step-00000001")
    versions, markers = _versions(store, "run/step-00000001/shard.bin")
    assert (len(versions), markers) == (1, [])  # nothing hidden behind a delete marker either
    with store.open_read("run/step-00000001/shard.bin") as fh:
        assert fh.read() == data
    store.close()


def test_a_bucket_without_object_lock_is_refused_before_anything_is_written(s3_endpoint):
    store = _store(s3_endpoint, _bucket(s3_endpoint, lock=False), lock_days=1)
    with pytest.raises(ConfigError, match="ObjectLockEnabledForBucket"):
        _put(store, "run/step-00000001/shard.bin", b"x" * 100)
    assert store.list("run") == []
    store.close()


def test_delete_on_a_versioned_bucket_removes_the_bytes_not_just_the_name(s3_endpoint):
    bucket = _bucket(s3_endpoint, lock=True)  # Object Lock implies versioning
    store = _store(s3_endpoint, bucket)  # this store does not lock: its copies may be pruned
    for name in ("manifest.json", "a.bin", "sub/b.bin"):
        _put(store, f"run/step-00000002/{name}", os.urandom(1000))
    assert store.locked_until(["run/step-00000002/a.bin"]) is None
    assert store.delete("run/step-00000002/manifest.json") is True
    assert store.delete_prefix("run/step-00000002") == 2
    versions, markers = _versions(store, "run/step-00000002")
    assert (versions, markers) == ([], [])
    store.close()
