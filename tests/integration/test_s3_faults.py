"""Tier 2 against moto's real S3 server over HTTP, with a scripted proxy where the fault needs
one: an endpoint that echoes checksums without checking them, bytes flipped between client
and server, a multipart upload aborted under our feet, one part's retry next to another
part's upload, and an endpoint that does not implement the checksum or If-None-Match headers.
"""

from __future__ import annotations

import io
import logging
import os
import threading
from datetime import UTC, timedelta

import boto3
import pytest

from core import checksum
from core.errors import (
    ConfigError,
    CorruptCheckpoint,
    PathEscape,
    StorageUnavailable,
    is_transient,
)
from core.manifest import FileEntry, Manifest
from core.paths import safe_run_name
from core.storage.local import LocalStore
from core.storage.s3 import PROBE_KEY, S3Store
from core.transfer import copy_part, verify_part
from tests.kit.s3_proxy import S3Proxy

MiB = 1024 * 1024
PREFIX = "run-a/step-00000100"


def make_store(endpoint: str, bucket: str) -> S3Store:
    return S3Store(f"s3://{bucket}/vault", 2, endpoint_url=endpoint, multipart_threshold=5 * MiB,
                   chunk_bytes=5 * MiB, max_concurrency=4, max_attempts=2)


@pytest.fixture
def proxy(s3_endpoint):
    p = S3Proxy(s3_endpoint)
    yield p
    p.close()


@pytest.fixture
def via_proxy(proxy, s3_bucket):
    s = make_store(proxy.url, s3_bucket)
    yield s
    s.close()


@pytest.fixture
def direct(s3_endpoint, s3_bucket):
    s = make_store(s3_endpoint, s3_bucket)
    yield s
    s.close()


def put(store: S3Store, key: str, data: bytes) -> str:
    crc = checksum.hash_bytes(data)
    store.put_verified(key, io.BytesIO(data), len(data), crc)
    return crc


def flipped(data: bytes, at: int | None = None) -> bytes:
    out = bytearray(data)
    out[len(out) // 2 if at is None else at] ^= 0x10
    return bytes(out)


def bucket_keys(endpoint: str, bucket: str) -> list[str]:
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", []))


def one_file_manifest(data: bytes, name: str = "shard.bin") -> Manifest:
    return Manifest(run="run-a", step=100, files=(FileEntry(name, len(data), checksum.hash_bytes(data)),))


# --- 6: an endpoint that echoes checksums is not trusted --------------------------------------
def test_bytes_changed_at_rest_are_not_verified_on_an_endpoint_that_echoes_checksums(direct):
    """moto keeps whatever CRC32C it is sent: overwrite the object with other bytes of the
    same size under the original checksum header, and HeadObject still reports a match."""
    data = os.urandom(MiB)
    key = f"{PREFIX}/shard.bin"
    crc = put(direct, key, data)
    direct.client.put_object(Bucket=direct.bucket, Key=direct._k(key), Body=flipped(data),
                             ChecksumAlgorithm="CRC32C", ChecksumCRC32C=checksum.hex_to_s3(crc))
    assert direct.stat(key).checksum == crc  # the echo that used to count as proof

    with pytest.raises(CorruptCheckpoint):
        direct.verify_object(key, len(data), crc)
    with pytest.raises(CorruptCheckpoint):
        verify_part(direct, PREFIX, one_file_manifest(data), deep=False)
    assert direct.validates_checksums() is False


@pytest.mark.parametrize("size", [MiB + 7, 11 * MiB + 3])  # one PutObject; a 3-part multipart upload
def test_a_byte_flipped_between_client_and_s3_is_never_published(proxy, via_proxy, s3_endpoint, s3_bucket, size):
    data = os.urandom(size)
    key = f"{PREFIX}/shard.bin"
    flips = []

    def flip_first_upload_of_the_shard(req):
        if req.method == "PUT" and req.key.endswith("shard.bin") and req.body and not flips:
            req.body = flipped(req.body)
            flips.append(req.path)

    proxy.on_request = flip_first_upload_of_the_shard
    with pytest.raises(StorageUnavailable) as err:  # the source was fine: a retry may succeed
        put(via_proxy, key, data)
    assert flips and is_transient(err.value)
    assert bucket_keys(s3_endpoint, s3_bucket) == []  # nothing published, no probe left behind

    crc = put(via_proxy, key, data)  # the retry (nothing flips now)
    via_proxy.verify_object(key, size, crc)
    with via_proxy.open_read(key) as fh:
        assert fh.read() == data


def test_the_probe_runs_once_per_endpoint_and_bucket_and_leaves_nothing(proxy, s3_endpoint, s3_bucket, caplog):
    stores = [make_store(proxy.url, s3_bucket) for _ in range(2)]
    caplog.set_level(logging.INFO, logger="core.storage.s3")
    try:
        for i, store in enumerate(stores):
            for j in range(3):
                data = os.urandom(1000 + j)
                crc = put(store, f"run-a/step-0000010{i}/f{j}", data)
                store.verify_object(f"run-a/step-0000010{i}/f{j}", len(data), crc)
    finally:
        for store in stores:
            store.close()

    probes = proxy.requests("PUT", PROBE_KEY)
    assert len(probes) == 1  # one probe for six uploads and six verifies through two stores
    assert probes[0].key == f"{s3_bucket}/vault/{PROBE_KEY}"
    with pytest.raises(PathEscape):  # no run can have that name: never inside a checkpoint
        safe_run_name(PROBE_KEY.split("/")[0])
    assert len(proxy.requests("DELETE", PROBE_KEY)) == 1
    assert not [k for k in bucket_keys(s3_endpoint, s3_bucket) if "probe" in k]
    modes = [r.getMessage() for r in caplog.records if "checksums it is sent" in r.getMessage()]
    assert len(modes) == 1 and "does NOT check" in modes[0] and "reading their bytes back" in modes[0]
    # and verification read the objects back (the bytes themselves, not HeadObject's echo)
    assert len(proxy.requests("GET", "run-a/step-")) >= 6


def test_an_endpoint_that_validates_checksums_is_verified_by_headobject(proxy, via_proxy):
    """An endpoint that rejects a wrong CRC32C (as AWS S3 does; here a proxy that checks them)
    is trusted: verification asks HeadObject and never downloads the object."""

    def validate(req):
        sent = req.headers.get("x-amz-checksum-crc32c")
        whole_object = req.method == "PUT" and sent and "partNumber" not in req.query
        if whole_object and checksum.hex_to_s3(checksum.hash_bytes(req.body)) != sent:
            return 400, "BadDigest"
        return None

    proxy.on_request = validate
    data = os.urandom(2 * MiB)
    crc = put(via_proxy, f"{PREFIX}/shard.bin", data)
    via_proxy.verify_object(f"{PREFIX}/shard.bin", len(data), crc)

    assert via_proxy.validates_checksums() is True
    assert proxy.requests("GET", "shard.bin") == []


# --- 12: an aborted multipart upload; one part's retry beside another part's upload ---------------
@pytest.mark.parametrize("aborted_at", ["UploadPart", "CompleteMultipartUpload"])
def test_an_aborted_multipart_upload_is_a_transient_destination_error(proxy, via_proxy, s3_endpoint, s3_bucket,
                                                                     tmp_path, aborted_at):
    """Real S3 answers 404 NoSuchUpload once an upload was aborted (a sweep, a lifecycle rule):
    the source is healthy, the destination lost its staging data, and a retry succeeds."""
    moto = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    data = os.urandom(11 * MiB)
    (tmp_path / "tier1").mkdir(exist_ok=True)  # a store never creates its root
    src = LocalStore(tmp_path / "tier1", 1)
    manifest = one_file_manifest(data)
    src.put_verified(f"{PREFIX}/shard.bin", io.BytesIO(data), len(data), manifest.files[0].checksum)
    aborted, once = [], threading.Lock()

    def abort_then_refuse(req):
        is_part = req.method == "PUT" and "partNumber" in req.query
        is_complete = req.method == "POST" and "uploadId" in req.query
        with once:  # parts arrive from several threads
            if req.query.get("uploadId") in aborted:  # as S3 answers for an aborted upload
                return 404, "NoSuchUpload"
            if aborted or not (is_part if aborted_at == "UploadPart" else is_complete):
                return None
            aborted.append(req.query["uploadId"])
            moto.abort_multipart_upload(Bucket=s3_bucket, Key=req.key.split("/", 1)[1], UploadId=aborted[0])
        return 404, "NoSuchUpload"

    proxy.on_request = abort_then_refuse
    with pytest.raises(StorageUnavailable) as err:
        copy_part(src, PREFIX, via_proxy, PREFIX, manifest, parallelism=1)
    assert aborted and is_transient(err.value)
    assert "aborted" in str(err.value) and "missing at the source" not in str(err.value)
    assert bucket_keys(s3_endpoint, s3_bucket) == []

    report = copy_part(src, PREFIX, via_proxy, PREFIX, manifest, parallelism=1)  # the retry
    assert report.files == 1
    verify_part(via_proxy, PREFIX, manifest, deep=True)


def test_sweeping_one_parts_staging_spares_the_uploads_of_other_keys(direct, tmp_path):
    """moto reports every upload as initiated in 2010, i.e. older than any lease: only the
    ``keys`` filter stands between a part's retry and another part's live upload."""
    c, mine, theirs = direct.client, f"{PREFIX}/model-p00-00000.safetensors", f"{PREFIX}/model-p01-00000.safetensors"
    c.create_multipart_upload(Bucket=direct.bucket, Key=direct._k(mine))
    c.create_multipart_upload(Bucket=direct.bucket, Key=direct._k(theirs))

    assert direct.sweep_staging(
        PREFIX, older_than_s=60, keys=[mine, f"{PREFIX}/manifest.part-00000-of-00002.json"]
    ) == 1
    left = c.list_multipart_uploads(Bucket=direct.bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == [direct._k(theirs)]
    assert direct.sweep_staging(PREFIX, older_than_s=60, keys=[mine]) == 0  # idempotent

    (tmp_path / "t1").mkdir(exist_ok=True)  # a store never creates its root
    local = LocalStore(tmp_path / "t1", 1)  # the same contract on a local tier
    d = local.path(PREFIX)
    d.mkdir(parents=True)
    (d / ".ckpt-staging-1-aaaaaaaa-model-p00-00000.safetensors").write_bytes(b"mine")
    (d / ".ckpt-staging-2-bbbbbbbb-model-p01-00000.safetensors").write_bytes(b"theirs")
    assert local.sweep_staging(PREFIX, older_than_s=0, keys=[mine]) == 1
    assert sorted(os.listdir(d)) == [".ckpt-staging-2-bbbbbbbb-model-p01-00000.safetensors"]


def test_staging_age_is_taken_on_the_servers_clock_not_on_the_workers(direct):
    """moto stamps every multipart upload with one fixed date in 2010: to this worker's clock
    (years ahead) it looks ancient. Told by the server (the listing's ``Date`` header, set
    here) that the upload began 10 s ago, a sweep of uploads older than a minute leaves it
    running; told two hours later, the sweep aborts it."""
    from email.utils import format_datetime

    c, key = direct.client, direct._k(f"{PREFIX}/model-00001.safetensors")
    c.create_multipart_upload(Bucket=direct.bucket, Key=key)
    (initiated,) = [u["Initiated"] for u in c.list_multipart_uploads(Bucket=direct.bucket)["Uploads"]]
    server_now = initiated

    def server_date(response_dict, **_):
        response_dict["headers"]["Date"] = format_datetime(server_now.astimezone(UTC), usegmt=True)

    c.meta.events.register("before-parse.s3.ListMultipartUploads", server_date, unique_id="server-date")
    try:
        server_now = initiated + timedelta(seconds=10)
        assert direct.sweep_staging(PREFIX, older_than_s=60) == 0
        assert [u["Key"] for u in c.list_multipart_uploads(Bucket=direct.bucket)["Uploads"]] == [key]
        server_now = initiated + timedelta(hours=2)
        assert direct.sweep_staging(PREFIX, older_than_s=60) == 1
    finally:
        c.meta.events.unregister("before-parse.s3.ListMultipartUploads", unique_id="server-date")
    assert c.list_multipart_uploads(Bucket=direct.bucket).get("Uploads", []) == []


def test_a_parts_retried_upload_leaves_another_parts_upload_running(settings_factory, db_url, s3_endpoint, s3_bucket,
                                                                   proxy):
    """Part 0's first upload to Tier 2 dies (its upload aborted); while part 1's upload is in
    flight, part 0's retry sweeps its own dead staging data and nothing of part 1's."""
    from tasks.copy import copy_to_tier1, upload_to_tier2
    from tasks.register import register_stored_part
    from tasks.verify import verify_replica
    from tests.kit.checkpoints import replica_states, write_checkpoint
    from tests.kit.pipeline import pipeline_settings

    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=proxy.url, s3_multipart_threshold=5 * MiB,
                                 s3_multipart_chunksize=5 * MiB)
    for part in (0, 1):
        write_checkpoint(settings.tier0_url, "run-a", 100, shards=1, shard_bytes=6 * MiB, part=part, parts=2,
                         kind="milestone")
        register_stored_part(settings, "run-a", 100, part, 2)
        verify_replica(settings, "run-a", 100, part, tier=0)
        copy_to_tier1(settings, "run-a", 100, part)
    moto = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    theirs = moto.create_multipart_upload(Bucket=s3_bucket, Key=f"vault/{PREFIX}/model-p01-00000.safetensors")

    def abort_part0_once(req):
        with once:  # parts arrive from several threads
            if req.query.get("uploadId") in done:  # as S3 answers for an aborted upload
                return 404, "NoSuchUpload"
            if done or not (req.method == "PUT" and "partNumber" in req.query and "model-p00" in req.key):
                return None
            done.append(req.query["uploadId"])
            moto.abort_multipart_upload(Bucket=s3_bucket, Key=req.key.split("/", 1)[1], UploadId=done[0])
        return 404, "NoSuchUpload"

    done, once = [], threading.Lock()
    proxy.on_request = abort_part0_once
    with pytest.raises(StorageUnavailable):
        upload_to_tier2(settings, "run-a", 100, 0)
    assert replica_states(settings, "run-a", 100)[(2, 0)] == "missing"

    upload_to_tier2(settings, "run-a", 100, 0)  # the retry

    assert replica_states(settings, "run-a", 100)[(2, 0)] == "verified"
    uploads = moto.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["UploadId"] for u in uploads] == [theirs["UploadId"]]  # part 1's upload still runs


# --- 13: an endpoint that does not implement the headers fails closed ------------------------------
REFUSALS = {
    "checksum": ("x-amz-checksum-", "x-amz-sdk-checksum-algorithm"),
    "if-none-match": ("if-none-match",),
}


@pytest.mark.parametrize("feature,methods,size", [
    ("checksum", ("HEAD", "GET", "PUT", "POST"), MiB),  # refused everywhere, checksum mode included
    ("checksum", ("PUT", "POST"), MiB),  # uploads refused: PutObject
    ("checksum", ("PUT", "POST"), 11 * MiB),  # uploads refused: CreateMultipartUpload
    ("if-none-match", ("PUT", "POST"), MiB),  # conditional PutObject
    ("if-none-match", ("PUT", "POST"), 11 * MiB),  # conditional CompleteMultipartUpload
])
def test_an_endpoint_without_the_headers_fails_closed_at_once(proxy, via_proxy, s3_endpoint, s3_bucket,
                                                               feature, methods, size):
    refused = []

    def not_implemented(req):
        header = req.has_header(*REFUSALS[feature])
        if req.method in methods and header:
            refused.append(header)
            return 501, "NotImplemented"
        return None

    proxy.on_request = not_implemented
    with pytest.raises(ConfigError) as err:
        put(via_proxy, f"{PREFIX}/shard.bin", os.urandom(size))

    assert not is_transient(err.value)
    assert len(refused) == 1  # no retry, by botocore or by us
    assert refused[0] in str(err.value).lower() and "NotImplemented" in str(err.value)
    assert not [k for k in bucket_keys(s3_endpoint, s3_bucket) if k.endswith("shard.bin")]
    assert not boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").list_multipart_uploads(
        Bucket=s3_bucket).get("Uploads")
