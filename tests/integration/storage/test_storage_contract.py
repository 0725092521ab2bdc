"""One contract suite for every tier backend: a local folder, fsspec ``memory://``, and S3 on
moto's real HTTP server (which stores whatever checksum it is sent) and on LocalStack's
(``validating_s3``: which checks it). Stored bytes are corrupted by hand, behind the store's back."""

from __future__ import annotations

import io
import os
import uuid

import pytest

from core import checksum
from core.errors import BadInput, ConflictError, CorruptCheckpoint, NotFound, PathEscape
from core.layout import is_staging
from core.storage import open_store
from core.storage.fsspec import FsspecStore
from core.storage.local import LocalStore
from core.storage.s3 import S3Store
from tests.kit.stores import all_names, put, read

MiB = 1024 * 1024


S3_SERVERS = {"s3": "moto", "s3-validating": "localstack"}  # store kind -> the server's fixture
VALIDATING = pytest.mark.validating_s3


def _s3_store(endpoint: str, *, versioned: bool) -> S3Store:
    """S3 on a fresh bucket; ``versioned``: created with Object Lock (so versioned), nothing
    locked: deletes must remove versions, not only hide them behind delete markers."""
    import boto3

    bucket = f"{'ver' if versioned else 'ckpt'}-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket=bucket, **({"ObjectLockEnabledForBucket": True} if versioned else {}))
    return S3Store(f"s3://{bucket}/root", 2, endpoint_url=endpoint, multipart_threshold=5 * MiB,
                   chunk_bytes=5 * MiB, max_concurrency=4, max_attempts=2)


@pytest.fixture(params=["s3", pytest.param("s3-validating", marks=VALIDATING)])
def s3_store(request):
    """S3 on moto (stores the checksums it is sent) and on LocalStack (checks them)."""
    s = _s3_store(request.getfixturevalue(f"{S3_SERVERS[request.param]}_endpoint"), versioned=False)
    yield s
    s.close()


@pytest.fixture(params=["local", "local-direct-io", "memory", "s3", "s3-versioned",
                        pytest.param("s3-validating", marks=VALIDATING),
                        pytest.param("s3-validating-versioned", marks=VALIDATING)])
def store(request, tmp_path):
    if request.param.startswith("local"):
        (tmp_path / "tier").mkdir()  # a store never creates its root
        yield LocalStore(tmp_path / "tier", tier=1, direct_io=request.param == "local-direct-io")
    elif request.param == "memory":
        s = FsspecStore(f"memory://t-{uuid.uuid4().hex[:8]}/root", tier=1)
        s.fs.makedirs(s.root, exist_ok=True)
        yield s
        if s.fs.exists(s.root):
            s.fs.rm(s.root, recursive=True)
    else:
        kind = request.param.removesuffix("-versioned")
        s3 = _s3_store(request.getfixturevalue(f"{S3_SERVERS[kind]}_endpoint"),
                       versioned=request.param.endswith("-versioned"))
        yield s3
        s3.close()


def corrupt(store, key: str, data: bytes) -> None:
    """Replace the stored bytes of ``key`` behind the store's back."""
    if isinstance(store, LocalStore):
        store.path(key).write_bytes(data)
    elif isinstance(store, FsspecStore):
        store.fs.pipe(store._p(key), data)
    else:
        store.client.put_object(Bucket=store.bucket, Key=store._k(key), Body=data)


@pytest.mark.parametrize("size", [0, 1000, 11 * MiB + 3])  # 11 MiB: a 3-part multipart on S3
def test_round_trip(store, size):
    data = os.urandom(size)
    info = put(store, "run/step-00000001/shard.bin", data)
    assert info.size == size
    assert store.stat("run/step-00000001/shard.bin").size == size
    assert read(store, "run/step-00000001/shard.bin") == data
    store.verify_object("run/step-00000001/shard.bin", size, checksum.hash_bytes(data))
    assert all_names(store) == ["run/step-00000001/shard.bin"]


def test_s3_multipart_stores_full_object_crc32c(s3_store):
    store = s3_store
    data = os.urandom(11 * MiB)
    put(store, "a/big", data)
    head = store.client.head_object(Bucket=store.bucket, Key=store._k("a/big"), ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == checksum.hex_to_s3(checksum.hash_bytes(data))
    assert head["ChecksumType"] == "FULL_OBJECT"
    assert head["ETag"].strip('"').endswith("-3")


@pytest.mark.parametrize("size", [1000, 11 * MiB])
def test_put_verified_mismatch_publishes_nothing(store, size):
    data = bytearray(os.urandom(size))
    expected = checksum.hash_bytes(bytes(data))
    data[size // 2] ^= 0x01  # one flipped bit between the manifest and the bytes
    with pytest.raises(CorruptCheckpoint):
        store.put_verified("r/s/x.bin", io.BytesIO(bytes(data)), size, expected)
    assert store.stat("r/s/x.bin") is None
    assert all_names(store) == []
    if isinstance(store, LocalStore):
        assert not any(os.scandir(store.path("r/s")))  # no staging file left behind
    if isinstance(store, S3Store):
        assert not store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads")


def test_put_verified_short_reader_publishes_nothing(store):
    data = os.urandom(4000)
    with pytest.raises(CorruptCheckpoint):
        store.put_verified("r/s/x.bin", io.BytesIO(data[:3000]), len(data), checksum.hash_bytes(data))
    assert store.stat("r/s/x.bin") is None


def test_different_bytes_at_existing_key_conflict(store):
    put(store, "r/s/x.bin", b"first version")
    with pytest.raises(ConflictError):
        put(store, "r/s/x.bin", b"second version")
    assert read(store, "r/s/x.bin") == b"first version"


def test_same_bytes_again_is_a_noop(store):
    put(store, "r/s/x.bin", b"same bytes")
    put(store, "r/s/x.bin", b"same bytes")
    assert all_names(store) == ["r/s/x.bin"]
    assert read(store, "r/s/x.bin") == b"same bytes"


def test_verify_object_detects_corrupted_stored_bytes(store):
    data = os.urandom(5000)
    put(store, "r/s/x.bin", data)
    bad = bytearray(data)
    bad[17] ^= 0x80
    corrupt(store, "r/s/x.bin", bytes(bad))
    with pytest.raises(CorruptCheckpoint):
        store.verify_object("r/s/x.bin", len(data), checksum.hash_bytes(data))
    corrupt(store, "r/s/x.bin", data[:-1])
    with pytest.raises(CorruptCheckpoint):
        store.verify_object("r/s/x.bin", len(data), checksum.hash_bytes(data))


def test_missing_object(store):
    assert store.stat("r/s/none") is None
    with pytest.raises(NotFound):
        store.verify_object("r/s/none", 1, "00000000")
    with pytest.raises(NotFound):
        read(store, "r/s/none")


@pytest.mark.parametrize("key", ["../x", "/etc/passwd", "a/../../b", "a//b", "a/./b", "a\\..\\b"])
def test_path_escape_rejected(store, key):
    with pytest.raises(PathEscape):
        put(store, key, b"x")
    with pytest.raises(PathEscape):
        store.stat(key)
    with pytest.raises(PathEscape):
        read(store, key)


def test_list_and_delete_prefix(store):
    for k in ["a/1", "a/sub/2", "ab/3", "b/4"]:
        put(store, k, k.encode())
    assert [o.key for o in store.list("a")] == ["a/1", "a/sub/2"]  # not "ab/3"
    assert [o.size for o in store.list("a")] == [3, 7]
    assert store.delete_prefix("a") == 2
    assert store.list("a") == []
    assert all_names(store) == ["ab/3", "b/4"]
    assert store.delete_prefix("a") == 0
    with pytest.raises(BadInput):
        store.delete_prefix("")
    assert all_names(store) == ["ab/3", "b/4"]
    assert store.delete_prefix("ab/3") == 1  # one object by its own key
    assert all_names(store) == ["b/4"]


@pytest.mark.parametrize("paths", [None, ["manifest.json", "w.bin", "gone.bin"]], ids=["whole", "paths"])
def test_a_fenced_delete_takes_only_what_it_set_aside(store, paths):
    """``bury`` then ``delete_tomb``: what was published under the prefix after the bury (a new
    holder's copy) stays, whatever the backend; with ``paths``, other names stay too."""
    for k in ("r/step-1/manifest.json", "r/step-1/w.bin", "r/step-1/other.bin"):
        put(store, k, k.encode())
    tomb = store.bury("r/step-1", paths, token="c0ffee")
    put(store, "r/step-1/new.bin", b"published by the next holder")
    deleted = store.delete_tomb(tomb, lambda: None)

    left = {"r/step-1/new.bin"} | ({"r/step-1/other.bin"} if paths else set())
    assert set(all_names(store)) == left and deleted == (2 if paths else 3)
    assert read(store, "r/step-1/new.bin") == b"published by the next holder"
    assert all(not is_staging(k.rsplit("/", 1)[-1]) and ".ckpt-tomb-" not in k for k in all_names(store))


def test_folders_are_the_top_level_names_only(store):
    assert store.folders() == ()
    for k in ["a/1", "a/sub/2", "ab/3", "b/4", "top"]:
        put(store, k, k.encode())
    assert store.folders() == ("a", "ab", "b")


def test_write_small_atomic_and_read_small(store):
    store.write_small_atomic("r/s/manifest.json", b'{"a": 1}')
    store.write_small_atomic("r/s/manifest.json", b'{"a": 1}')  # same bytes: fine
    with pytest.raises(ConflictError):
        store.write_small_atomic("r/s/manifest.json", b'{"a": 2}')
    assert store.read_small("r/s/manifest.json") == b'{"a": 1}'
    with pytest.raises(CorruptCheckpoint):
        store.read_small("r/s/manifest.json", limit=4)
    assert not any(is_staging(k.rsplit("/", 1)[-1]) for k in all_names(store))


def test_open_store_picks_the_backend(tmp_path, settings_factory, s3_endpoint):
    s = settings_factory(s3_endpoint_url=s3_endpoint, s3_multipart_chunksize=8 * MiB)
    assert isinstance(open_store(str(tmp_path), 0, s), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}", 1, s), LocalStore)
    assert isinstance(open_store("memory://x/y", 1, s), FsspecStore)
    s3 = open_store("s3://bkt/prefix", 2, s)
    assert isinstance(s3, S3Store) and s3.chunk_bytes == 8 * MiB and s3.prefix == "prefix"
    assert s3.url_for("r/step-00000001/x") == "s3://bkt/prefix/r/step-00000001/x"


def test_s3_unreachable_endpoint_is_transient_and_missing_bucket_is_config(s3_endpoint):
    from ckpt.processes import free_port
    from core.errors import ConfigError, StorageUnavailable, is_transient

    dead = S3Store("s3://bkt/p", 2, endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=2)
    with pytest.raises(StorageUnavailable) as exc:
        dead.list("r")
    assert is_transient(exc.value)
    nobucket = S3Store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p", 2, endpoint_url=s3_endpoint)
    with pytest.raises(ConfigError):
        nobucket.list("r")


def test_sweep_staging_removes_what_a_killed_upload_left(s3_store, tmp_path):
    s3_store.client.create_multipart_upload(Bucket=s3_store.bucket, Key=s3_store._k("r/s/big"))
    s3_store.client.create_multipart_upload(Bucket=s3_store.bucket, Key=s3_store._k("other/big"))
    # (moto reports a fixed 2010 'Initiated' time, so the age guard is tested locally below)
    assert s3_store.sweep_staging("r", older_than_s=0) == 1
    left = s3_store.client.list_multipart_uploads(Bucket=s3_store.bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == [s3_store._k("other/big")]
    (tmp_path / "t").mkdir()  # a store never creates its root
    local = LocalStore(tmp_path / "t", 1)
    put(local, "r/s/a", b"a")
    local.path("r/s/.ckpt-staging-1-abc-b").write_bytes(b"partial")
    assert local.sweep_staging("r", older_than_s=3600) == 0
    assert local.sweep_staging("r", older_than_s=0) == 1
    assert all_names(local) == ["r/s/a"] and os.listdir(local.path("r/s")) == ["a"]


def test_put_verified_from_a_local_file(store, tmp_path):
    """From a real file (kernel copy on local tiers) the same rules hold: a bit flip or
    extra bytes after the manifest's size publish nothing; a match publishes."""
    data = os.urandom(3 * MiB + 5)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    good = checksum.hash_bytes(data)
    flipped = bytearray(data)
    flipped[MiB] ^= 0x10
    src.write_bytes(bytes(flipped))
    with open(src, "rb") as fh, pytest.raises(CorruptCheckpoint):
        store.put_verified("r/s/f.bin", fh, len(data), good)
    src.write_bytes(data + b"extra")
    with open(src, "rb") as fh, pytest.raises(CorruptCheckpoint):
        store.put_verified("r/s/f.bin", fh, len(data), good)
    assert all_names(store) == []
    src.write_bytes(data)
    with open(src, "rb") as fh:
        store.put_verified("r/s/f.bin", fh, len(data), good)
    assert read(store, "r/s/f.bin") == data
