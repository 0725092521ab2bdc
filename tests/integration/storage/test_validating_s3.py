"""Tier 2 on an S3 that checks the checksums it is sent (LocalStack's, marker ``validating_s3``),
through a proxy that can change bytes on the way: the server refuses what changed in transit
(400 BadDigest), the pipeline treats that as a transient fault of the way there (retried from
the source, nothing trusted, the source never blamed), and verification trusts the server's
CRC32C instead of reading every object back."""

from __future__ import annotations

import io
import os
import threading

import boto3
import pytest

from core import checksum
from core.errors import StorageUnavailable, is_transient
from core.storage.s3 import S3Store
from tests.kit.s3_proxy import S3Proxy

pytestmark = pytest.mark.validating_s3

MiB = 1024 * 1024
RUN, STEP = "run-a", 100


@pytest.fixture
def bucket(localstack_endpoint):
    import uuid

    name = f"val-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=localstack_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def proxy(localstack_endpoint):
    p = S3Proxy(localstack_endpoint)
    yield p
    p.close()


def flip_once(where):
    """A proxy hook that flips one byte of the first request body ``where(req)`` picks."""
    flipped, lock = [], threading.Lock()

    def hook(req):
        with lock:
            if flipped or not req.body or not where(req):
                return None
            body = bytearray(req.body)
            body[len(body) // 2] ^= 0x04
            req.body = bytes(body)
            flipped.append(req)
        return None

    return hook, flipped


def is_part(number: int):
    return lambda req: req.method == "PUT" and req.query.get("partNumber") == str(number)


def refusals(proxy: S3Proxy, key_contains: str = "") -> list[tuple[str, int, str]]:
    """(method, status, S3 error code) of what the server refused (HEAD's 404s left out)."""
    return [(r.method, status, code) for r, status, code in proxy.refused
            if r.method != "HEAD" and key_contains in r.key]


def test_the_server_checks_checksums_so_verification_never_reads_back(proxy, bucket):
    store = S3Store(f"s3://{bucket}/vault", 2, endpoint_url=proxy.url, multipart_threshold=5 * MiB,
                    chunk_bytes=5 * MiB, max_concurrency=4, max_attempts=2)
    try:
        for name, size in (("small.bin", MiB + 7), ("big.bin", 11 * MiB + 3)):  # PutObject; 3 parts
            data = os.urandom(size)
            crc = checksum.hash_bytes(data)
            store.put_verified(f"r/step-00000001/{name}", io.BytesIO(data), size, crc)
            store.verify_object(f"r/step-00000001/{name}", size, crc)
        assert store.validates_checksums() is True
        assert refusals(proxy) == [("PUT", 400, "BadDigest")]  # the probe's wrong CRC32C
        assert proxy.requests("GET", "step-00000001") == []  # HeadObject's CRC32C, never the bytes
    finally:
        store.close()


@pytest.mark.parametrize(("size", "where"), [(MiB + 7, "PutObject"), (11 * MiB + 3, "UploadPart 2")])
def test_bytes_changed_in_transit_are_refused_by_the_server_and_never_published(proxy, bucket, size, where):
    """The client checks the bytes it reads against the manifest before they leave; one byte
    flipped after that, on the way, is caught by the server itself."""
    store = S3Store(f"s3://{bucket}/vault", 2, endpoint_url=proxy.url, multipart_threshold=5 * MiB,
                    chunk_bytes=5 * MiB, max_concurrency=4, max_attempts=1)
    store.validates_checksums()  # the probe first, so that only the shard's request is flipped
    hook, flipped = flip_once(is_part(2) if where.startswith("UploadPart") else
                              (lambda req: req.method == "PUT" and req.key.endswith("shard.bin")))
    proxy.on_request = hook
    data = os.urandom(size)
    crc = checksum.hash_bytes(data)
    try:
        with pytest.raises(StorageUnavailable) as err:
            store.put_verified(f"{RUN}/step-00000100/shard.bin", io.BytesIO(data), size, crc)
        assert flipped and is_transient(err.value) and "in transit" in str(err.value)
        assert refusals(proxy, "shard") == [("PUT", 400, "BadDigest")]
        s3 = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1")
        assert s3.list_objects_v2(Bucket=bucket, Prefix="vault/run-a").get("KeyCount") == 0
        assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # aborted

        store.put_verified(f"{RUN}/step-00000100/shard.bin", io.BytesIO(data), size, crc)  # the retry
        with store.open_read(f"{RUN}/step-00000100/shard.bin") as fh:
            assert fh.read() == data
    finally:
        store.close()


def test_a_part_corrupted_on_the_way_to_tier2_is_retried_from_the_source_and_never_blamed_on_it(
        settings_factory, db_url, bucket, proxy):
    """The pipeline's Tier 2 upload: the server refuses a part flipped in transit; the Tier 2
    replica is not trusted, the Tier 1 copy it was read from stays verified (no scrub, no
    repair, no rejection), and the retry, read from the same source, verifies on Tier 2."""
    from db.catalog import Catalog
    from tasks.copy import copy_to_tier1, upload_to_tier2
    from tasks.register import register_stored_part
    from tasks.verify import verify_replica
    from tests.kit.checkpoints import replica_states, write_checkpoint
    from tests.kit.pipeline import pipeline_settings

    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{bucket}/vault",
                                 s3_endpoint_url=proxy.url, s3_multipart_threshold=5 * MiB,
                                 s3_multipart_chunksize=5 * MiB)
    write_checkpoint(settings.tier0_url, RUN, STEP, shards=1, shard_bytes=11 * MiB, kind="milestone")
    register_stored_part(settings, RUN, STEP, 0, 1)
    verify_replica(settings, RUN, STEP, 0, tier=0)
    copy_to_tier1(settings, RUN, STEP, 0)
    hook, flipped = flip_once(lambda req: is_part(2)(req) and "safetensors" in req.key)
    proxy.on_request = hook

    with pytest.raises(StorageUnavailable):
        upload_to_tier2(settings, RUN, STEP, 0)
    assert flipped and refusals(proxy, "safetensors") == [("PUT", 400, "BadDigest")]
    states = replica_states(settings, RUN, STEP)
    assert states[(2, 0)] != "verified"
    assert (states[(0, 0)], states[(1, 0)]) == ("verified", "verified")  # the source is not blamed
    cat = Catalog(settings.catalog_url)
    try:
        assert cat.get_checkpoint(RUN, STEP).state != "corrupt"
        assert not [e for e in cat.history(RUN, STEP) if e.action == "reject" or e.to_state == "corrupt"]
    finally:
        cat.close()

    gets_before = len(proxy.requests("GET", "safetensors"))
    upload_to_tier2(settings, RUN, STEP, 0)  # the retry, from the same Tier 1 copy

    assert replica_states(settings, RUN, STEP)[(2, 0)] == "verified"
    assert len(proxy.requests("GET", "safetensors")) == gets_before  # verified by the server's CRC32C
