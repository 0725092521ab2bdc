"""Tier 2: S3-compatible object storage through boto3 (never s3fs).

Uploads (``put_verified``):
- below ``multipart_threshold`` one PutObject; above it an explicit multipart upload
  (CreateMultipartUpload with ChecksumAlgorithm=CRC32C, ChecksumType=FULL_OBJECT), parts of
  ``chunk_bytes`` read in order from the reader, each sent with its own CRC32C by a thread
  pool shared by the store (at most ``max_concurrency`` parts in flight, so memory stays
  bounded at about ``(max_concurrency + readers) x chunk_bytes``);
- the client hashes every byte it sends; if size or CRC32C differ from the manifest the
  upload is aborted and nothing is published (this is what catches a flipped bit, since an
  endpoint such as moto stores whatever checksum it is sent without checking it);
- the publish (PutObject / CompleteMultipartUpload) carries the full-object
  ``ChecksumCRC32C`` (an endpoint that validates it rejects a mismatch: fail closed) and
  ``If-None-Match: *``, so an existing object is never replaced; if one is there, identical
  bytes are a no-op success and different bytes a ``ConflictError``;
- afterwards ``verify_object`` must find the manifest's CRC32C and size at the destination.

Downloads: ``open_read`` is one GET stream. Objects of ``ranged_threshold`` bytes or more can be
fetched with ``read_ranges_into``: equal ranged GETs of about ``range_bytes`` (AWS's guidance:
8-16 MiB; ``split_ranges``), one connection each, ``max_concurrency`` at once on the process's
one client, each written at its offset as it streams and hashed on the way, the ranges' CRC32Cs
combined into the object's (``core.checksum.combine``), so the bytes are read once. A range
whose bounds, length or object size differ from what was asked is ``CorruptCheckpoint``.

Verification (``verify_object``) trusts HeadObject's full-object CRC32C only where the endpoint
is known to check the checksums it is sent (AWS S3 does). An endpoint that stores whatever
checksum it receives (moto, some S3-compatible servers) merely echoes the client's value, so
there the bytes are read back and hashed. Which kind an endpoint is, is probed once per
endpoint and bucket per process (``validates_checksums``): a tiny object sent with a
deliberately wrong CRC32C under ``PROBE_KEY`` (outside every checkpoint), removed afterwards;
accepted means not validated. The mode in force is logged once.

Object Lock and versioned deletes: ``core.storage.s3.lock``; errors: ``core.storage.s3.errors``;
the shared clients: ``core.storage.s3.clients``; building a store from the settings:
``core.storage.s3.config``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO

from core import checksum as crc
from core.errors import (
    BadInput,
    ConfigError,
    ConflictError,
    CorruptCheckpoint,
    NotFound,
    StorageUnavailable,
)
from core.layout import is_manifest_name
from core.paths import safe_relpath
from core.storage.base import ObjectInfo, TierStore, Tomb, hash_object
from core.storage.content import CONTENT_DIR
from core.storage.local import local_fd
from core.storage.s3.clients import shared_client
from core.storage.s3.config import url_problem
from core.storage.s3.errors import (
    _DIGEST_CODES,
    CHECKSUM_MODE,
    COMPLETE_CRC32C,
    CREATE_CRC32C,
    IF_NONE_MATCH,
    SEND_CRC32C,
    _code,
    map_s3_error,
    s3_errors,
)
from core.storage.s3.lock import LOCK_MODES, ObjectLockMixin
from core.storage.s3.shared import SharedContentMixin
from core.storage.writeback import Writeback

log = logging.getLogger("core.storage.s3")


class _Body:
    """A GetObject body whose read errors are mapped to the taxonomy."""

    def __init__(self, body: Any, what: str) -> None:  # botocore's StreamingBody (untyped)
        self._body, self._what = body, what

    def read(self, n: int = -1) -> bytes:
        with s3_errors(self._what):
            return self._body.read(n) if n is not None and n >= 0 else self._body.read()

    def close(self) -> None:
        self._body.close()


def _read_up_to(reader: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes (fewer only at the end of the stream)."""
    chunks, got = [], 0
    while got < n:
        data = reader.read(n - got)
        if not data:
            break
        chunks.append(data)
        got += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


MAX_PARTS = 10_000  # S3's limit on parts per multipart upload

# Where the checksum probe writes: no run name may start with '.', so this is never inside a
# checkpoint (nor seen by anything that looks for manifests), and it lives under the store's
# own prefix, where its credentials are allowed to write.
PROBE_KEY = ".ckpt-probe/checksum-validation"
_PROBE_BODY = b"ckpt-tiering probe: sent with a CRC32C that does not match these bytes\n"

# (endpoint URL, bucket) -> whether the endpoint checks the checksums it is sent; per process.
_validates: dict[tuple[str, str], bool] = {}
_validates_lock = threading.Lock()
# (endpoint URL, bucket) -> (Object Lock enabled, versioning on); per process.


# What one read of a GET's body asks for. 256 KiB (as boto3's own download reads), not
# ``buffer_bytes`` (a few MiB, best for file-to-file copies): each read of a body allocates a
# buffer of that size and copies it into ``bytes`` (the likely cost: fresh pages and cache
# misses at 4 MiB). Many nodes fetching at once on a shared core spend more CPU per byte with
# 4 MiB reads (benchmarks/cluster_restore.py --part-mib 32); one process with cores to spare
# loses nothing.
READ_CHUNK_BYTES = 256 * 1024


def split_ranges(size: int, range_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the ranged GETs of a ``size``-byte object: equal ranges (within a byte),
    as many as ``size / range_bytes`` rounded, at least one; so each is 2/3 to 3/2 of
    ``range_bytes`` and no GET is spent on a small tail (a 16 MiB shard plus its header is two
    8 MiB ranges, not three)."""
    if size <= 0:
        return []
    n = max(1, (2 * size + range_bytes) // (2 * range_bytes))  # size / range_bytes, rounded half up
    base, extra = divmod(size, n)
    out, off = [], 0
    for i in range(n):
        length = base + (1 if i < extra else 0)
        out.append((off, length))
        off += length
    return out


def part_size(size: int, chunk_bytes: int) -> int:
    """``chunk_bytes``, grown in whole MiB when ``size`` would need more than ``MAX_PARTS`` parts."""
    need = -(-size // MAX_PARTS)
    if need <= chunk_bytes:
        return chunk_bytes
    mib = 1024 * 1024
    return -(-need // mib) * mib



class S3Store(SharedContentMixin, ObjectLockMixin, TierStore):
    """A tier at ``s3://bucket/prefix`` on AWS S3, MinIO or moto (``endpoint_url``).
    ``shared_content``: a file whose bytes the tier holds is published as a pointer to them
    (``core.storage.s3.shared``); pointers are read as their content whatever this flag."""

    def __init__(
        self,
        url: str,
        tier: int = 2,
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        multipart_threshold: int = 64 * 1024 * 1024,
        chunk_bytes: int = 64 * 1024 * 1024,
        max_concurrency: int = 8,
        parallelism: int = 4,
        max_attempts: int = 5,
        buffer_bytes: int = crc.DEFAULT_BUFFER_BYTES,
        lock_days: float | None = None,
        lock_mode: str = "governance",
        range_bytes: int = 8 * 1024 * 1024,
        ranged_threshold: int = 16 * 1024 * 1024,
        client: Any = None,  # a boto3 S3 client (untyped: boto3-stubs are optional)
        shared_content: bool = False,
    ) -> None:
        if lock_mode not in LOCK_MODES:
            raise ConfigError(f"Object Lock mode must be governance or compliance, not {lock_mode!r}")
        if not url.startswith("s3://"):
            raise ConfigError(f"not an s3:// URL: {url!r}")
        if (problem := url_problem(url)) is not None:
            raise ConfigError(problem)  # the URL itself is not echoed: it may hold the secret
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ConfigError(f"no bucket in {url!r}")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.tier, self.root_url = tier, url.rstrip("/")
        self.multipart_threshold = max(multipart_threshold, chunk_bytes)
        self.chunk_bytes, self.max_concurrency = chunk_bytes, max_concurrency
        self.parallelism = parallelism
        self.buffer_bytes = buffer_bytes
        self.lock_days, self.lock_mode = lock_days, lock_mode
        self.range_bytes, self.ranged_threshold = range_bytes, max(ranged_threshold, range_bytes)
        self.client = client or self._make_client(endpoint_url, region, max_attempts)
        self._pool: ThreadPoolExecutor | None = None
        self._ranges: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._inflight = threading.BoundedSemaphore(max_concurrency)
        self.shared_content = shared_content

    def _make_client(self, endpoint_url: str | None, region: str, max_attempts: int) -> Any:
        return shared_client(endpoint_url, region, max_attempts, self.pool_connections())

    def pool_connections(self) -> int:
        """HTTP connections the client keeps: one per request that can be in flight at once,
        ``max_concurrency`` multipart parts plus ``parallelism`` files read, headed or published
        by the transfer engine's threads (a restore reads ``max(copy_parallelism,
        s3_max_concurrency)`` files at once). botocore's default of 10 is smaller than that:
        every request above it opened a fresh connection and urllib3 logged "Connection pool is
        full, discarding connection" when handing it back."""
        return max(10, self.max_concurrency + self.parallelism)

    @property
    def read_chunk_bytes(self) -> int:
        """One read of a GET's body: ``READ_CHUNK_BYTES`` at most."""
        return min(self.buffer_bytes, READ_CHUNK_BYTES)

    def _k(self, key: str) -> str:
        safe_relpath(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="s3-part")
            return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._ranges is not None:
            self._ranges.shutdown(wait=True)
            self._ranges = None

    # --- reads -------------------------------------------------------------------------
    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        what = self.url_for(key)
        with s3_errors(what):
            resp = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
            if (content := self.pointed(resp)) is not None:  # a pointer: its content's bytes
                resp["Body"].close()
                resp = self.client.get_object(Bucket=self.bucket, Key=self._k(content))
            body = resp["Body"]
        try:
            yield _Body(body, what)  # type: ignore[misc]
        finally:
            body.close()

    def reads_ranged(self, size: int) -> bool:
        """Whether an object of ``size`` bytes is fetched as parallel ranged GETs (``read_ranges_into``)."""
        return size >= self.ranged_threshold

    def read_ranges_into(self, key: str, fd: int, size: int, progress: Callable[[int], None] | None = None
                         ) -> tuple[int, str]:
        """Fetch ``key`` into the open file ``fd`` (written at offsets) as ranged GETs of about
        ``range_bytes`` (``split_ranges``), ``max_concurrency`` at once over the process's one
        client; return (size, CRC32C hex) of what was written, combined from each range's CRC32C as it arrived
        (no second read). Memory: one ``read_chunk_bytes`` chunk per range in flight. A range that
        comes back with other bounds or length is ``CorruptCheckpoint``; the caller compares
        the result with the manifest."""
        key = self.resolve(key)
        ranges = split_ranges(size, self.range_bytes)
        with self._pool_lock:
            if self._ranges is None:
                self._ranges = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="s3-range")
            pool = self._ranges
        futures = [pool.submit(self._read_range, key, fd, off, n, size, progress) for off, n in ranges]
        try:
            values = [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            wait(futures)
            raise
        value = values[0] if values else 0
        for (_off, n), v in zip(ranges[1:], values[1:], strict=True):
            value = crc.combine(value, v, n)
        return size, crc.to_hex(value)

    def _read_range(self, key: str, fd: int, offset: int, length: int, size: int,
                    progress: Callable[[int], None] | None) -> int:
        what = f"{self.url_for(key)} bytes {offset}-{offset + length - 1}"
        with s3_errors(what):
            resp = self.client.get_object(Bucket=self.bucket, Key=self._k(key),
                                          Range=f"bytes={offset}-{offset + length - 1}")
        total = str(resp.get("ContentRange") or "").rpartition("/")[2]
        if total.isdigit() and int(total) != size:
            resp["Body"].close()
            raise CorruptCheckpoint(f"{self.url_for(key)}: {total} bytes stored, {size} expected", path=key)
        body = _Body(resp["Body"], what)
        value, got = 0, 0
        wb = Writeback(fd, offset)
        try:
            while got < length:
                data = body.read(min(self.read_chunk_bytes, length - got + 1))
                if not data:
                    break
                value = crc.update(value, data)
                view, pos = memoryview(data), offset + got
                while view:
                    written = os.pwrite(fd, view, pos)
                    view, pos = view[written:], pos + written
                got += len(data)
                wb.wrote(len(data))
                if progress is not None:
                    progress(len(data))
        finally:
            body.close()
        if got != length or resp.get("ContentLength", length) != length:
            raise CorruptCheckpoint(f"{what}: the range came back with {got} bytes", path=key)
        return value

    def root_exists(self) -> bool:
        """Whether the bucket is there (HeadBucket); the prefix needs no folder."""
        try:
            with s3_errors(f"head bucket of {self.root_url}"):
                self.client.head_bucket(Bucket=self.bucket)
        except NotFound:  # 404: HeadBucket answers without a body, so no NoSuchBucket code
            return False
        return True

    def _head(self, key: str) -> dict | None:
        try:
            with s3_errors(self.url_for(key), CHECKSUM_MODE):
                return self.client.head_object(Bucket=self.bucket, Key=self._k(key), ChecksumMode="ENABLED")
        except NotFound:
            return None

    def stat(self, key: str) -> ObjectInfo | None:
        h = self._head(key)
        if h is None:
            return None
        if self.pointed(h) is not None:
            return self.resolved_info(key, h)
        return ObjectInfo(
            key=key,
            size=int(h["ContentLength"]),
            checksum=(crc.s3_to_hex(h.get("ChecksumCRC32C", ""))
                      if h.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT" else None),
            etag=h.get("ETag"),
            version_id=h.get("VersionId"),
        )

    def list(self, prefix: str) -> list[ObjectInfo]:
        # an empty object may be a pointer: listed with its content's size (a HeadObject each, as
        # ListObjectsV2 returns no metadata)
        return sorted((self.stat(o.key) or o if o.size == 0 and not o.key.startswith(CONTENT_DIR + "/") else o
                       for o in self._listed(prefix)), key=lambda o: o.key)

    def keys(self, prefix: str) -> tuple[str, ...]:
        """``list``'s keys from the listing alone: no pointer resolved (a pointer's key is its file's)."""
        return tuple(sorted(o.key for o in self._listed(prefix)))

    def _listed(self, prefix: str) -> tuple[ObjectInfo, ...]:
        """Every object under ``prefix`` as ListObjectsV2 gives it (a pointer with size 0)."""
        full = self._k(prefix) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        out: list[ObjectInfo] = []
        with s3_errors(f"list {self.root_url}/{prefix}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                out.extend(ObjectInfo(key=self._rel(o["Key"]), size=int(o["Size"]), etag=o.get("ETag"),
                                      modified=o["LastModified"].timestamp() if "LastModified" in o else None)
                           for o in page.get("Contents", []))
        return tuple(out)

    def folders(self) -> tuple[str, ...]:
        full = self.prefix + "/" if self.prefix else ""
        names: set[str] = set()
        with s3_errors(f"list {self.root_url}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full,
                                                                               Delimiter="/"):
                names.update(p["Prefix"][len(full):].rstrip("/") for p in page.get("CommonPrefixes", []))
        return tuple(sorted(names - {CONTENT_DIR}))

    def verify_object(self, key: str, size: int, checksum: str) -> None:
        """Size from HeadObject, then the CRC32C: the server's full-object value where the
        endpoint validates checksums (``validates_checksums``), else the bytes read back and
        hashed (streamed). Objects without a full-object CRC32C are always read back."""
        info = self.stat(key)
        if info is None:
            raise NotFound(f"{self.url_for(key)} does not exist")
        if info.size != size:
            raise CorruptCheckpoint(f"{key}: stored size {info.size} != expected {size}", path=key)
        if info.checksum is not None and self.validates_checksums():
            got_size, got = size, info.checksum
        else:
            got_size, got = hash_object(self, key, self.read_chunk_bytes)
        if got_size != size:
            raise CorruptCheckpoint(f"{key}: read back {got_size} bytes != expected {size}", path=key)
        if got != checksum:
            raise CorruptCheckpoint(f"{key}: stored crc32c {got} != expected {checksum}", path=key)

    def validates_checksums(self) -> bool:
        """Whether this endpoint rejects an upload whose CRC32C does not match its bytes.

        Learnt once per endpoint and bucket per process from a probe (see ``_probe``); until
        then, and where the probe cannot tell, HeadObject's checksum is not trusted."""
        where = (str(self.client.meta.endpoint_url), self.bucket)
        known = _validates.get(where)
        if known is not None:
            return known
        with _validates_lock:  # one probe per endpoint, however many threads verify at once
            if where not in _validates:
                validates = _validates[where] = self._probe()
                if validates:
                    log.info("S3 %s bucket %s checks the checksums it is sent: copies are verified by "
                             "the server's CRC32C (HeadObject)", where[0], self.bucket)
                else:
                    log.warning("S3 %s bucket %s does NOT check the checksums it is sent: copies are "
                                "verified by reading their bytes back", where[0], self.bucket)
            return _validates[where]

    def _probe(self) -> bool:
        """Upload ``PROBE_KEY`` with a wrong CRC32C: rejected (BadDigest) means the endpoint
        validates. The probe object is removed whatever the answer. A 5xx or a 501 raises
        (nothing is cached); a refusal of another kind (access denied) answers False."""
        from botocore.exceptions import BotoCoreError, ClientError

        full, what = self._k(PROBE_KEY), f"checksum probe {self.url_for(PROBE_KEY)}"
        wrong = crc.hex_to_s3(crc.hash_bytes(_PROBE_BODY + b"!"))
        try:
            put = self.client.put_object(Bucket=self.bucket, Key=full, Body=_PROBE_BODY,
                                         ChecksumAlgorithm="CRC32C", ChecksumCRC32C=wrong)
        except ClientError as exc:
            code, status = _code(exc)
            if code in _DIGEST_CODES:
                return True
            mapped = map_s3_error(exc, what, SEND_CRC32C)
            if isinstance(mapped, StorageUnavailable):
                self._drop_probe(full)
                raise mapped from exc
            if status == 501 or code == "NoSuchBucket":
                raise mapped from exc
            log.warning("%s refused (%s); taking the endpoint for one that does not check checksums", what, mapped)
            return False
        except BotoCoreError as exc:
            self._drop_probe(full)
            raise map_s3_error(exc, what, SEND_CRC32C) from exc
        with s3_errors(f"remove {what}"):  # accepted: it must go (a failure raises, nothing cached)
            try:  # on a versioned bucket, the version itself (a plain delete only hides it)
                if put.get("VersionId"):
                    self.client.delete_object(Bucket=self.bucket, Key=full, VersionId=put["VersionId"])
                    return False
            except ClientError:  # locked by a default retention rule of the bucket: hidden, then
                pass
            self.client.delete_object(Bucket=self.bucket, Key=full)
        return False

    def _drop_probe(self, full: str) -> None:
        """Best effort after a failed probe (a later probe writes and removes the same key)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=full)
        except (BotoCoreError, ClientError) as exc:  # the probe's own error is the one to report
            log.debug("could not remove the checksum probe %s: %s", full, exc)

    # --- writes ------------------------------------------------------------------------
    def _same_or_conflict(self, key: str, size: int, checksum: str) -> None:
        try:
            self.verify_object(key, size, checksum)
        except CorruptCheckpoint as exc:
            raise ConflictError(
                f"{self.url_for(key)} already exists with different bytes ({exc}); refusing to overwrite"
            ) from None

    def put_verified(self, key: str, reader: BinaryIO, size: int, checksum: str) -> ObjectInfo:
        """Upload (or, with ``shared_content``, point to bytes the tier holds: a local source of
        a shared size, ``core.storage.s3.shared``) and verify; the module doc says how."""
        if self.lock_days:
            self.require_object_lock()
        head = self._head(key)
        if head is not None:
            content = self.pointed(head)
            if content is None or self._head(content) is not None:
                self._same_or_conflict(key, size, checksum)
                return ObjectInfo(key=key, size=size, checksum=checksum)
            self.delete(key)  # a pointer to a content swept since (its copy lost its claim): replaced
        fd = local_fd(reader) if self.shared_content and self.shares(size) else None
        try:
            if fd is None or not self.put_shared(key, fd, getattr(reader, "note_copied", None), size, checksum,
                                                 noted=getattr(reader, "stored_content", False)):
                self._upload(key, reader, size, checksum)
        except ConflictError:
            self._same_or_conflict(key, size, checksum)  # someone published first: same bytes is fine
        return ObjectInfo(key=key, size=size, checksum=checksum)

    def _upload(self, key: str, reader: Any, size: int, checksum: str) -> None:
        """Upload ``key`` whole and verify it (``ConflictError``: published first by another)."""
        self._send(key, reader, size, checksum)
        try:
            self.verify_object(key, size, checksum)
        except CorruptCheckpoint as exc:
            self.delete(key)  # we created it (If-None-Match): take it back (ObjectLocked if it is locked)
            # the bytes sent matched the manifest, so the source is fine: they changed on the way
            # or at the endpoint, and a new upload may well succeed
            raise StorageUnavailable(f"{self.url_for(key)}: the stored bytes differ from the bytes sent "
                                     f"({exc}); removed, nothing published") from exc
        if self.lock_days:
            self._ensure_locked(key)

    def _send(self, key: str, reader: Any, size: int, checksum: str) -> None:
        """Upload ``key`` whole, not yet verified (``ConflictError``: published first by another)."""
        if size < self.multipart_threshold:
            self._put_single(key, _read_up_to(reader, self.multipart_threshold + 1), size, checksum)
        else:
            self._put_multipart(key, reader, size, checksum)

    def _put_single(self, key: str, data: bytes, size: int, checksum: str) -> None:
        got = crc.hash_bytes(data)
        if (len(data), got) != (size, checksum):
            raise CorruptCheckpoint(
                f"{key}: source size/crc32c {len(data)}/{got} != expected {size}/{checksum}", path=key
            )
        with s3_errors(self.url_for(key), SEND_CRC32C + IF_NONE_MATCH):
            self.client.put_object(
                Bucket=self.bucket, Key=self._k(key), Body=data, IfNoneMatch="*",
                ChecksumAlgorithm="CRC32C", ChecksumCRC32C=crc.hex_to_s3(checksum), **self._lock_args(),
            )

    def _upload_part(self, full: str, upload_id: str, number: int, data: bytes) -> dict:
        try:
            part_crc = crc.hex_to_s3(crc.hash_bytes(data))
            with s3_errors(f"{self.root_url}/{self._rel(full)} part {number}", SEND_CRC32C):
                r = self.client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                    Body=data, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=part_crc,
                )
            return {"PartNumber": number, "ETag": r["ETag"], "ChecksumCRC32C": part_crc}
        finally:
            self._inflight.release()

    def _put_multipart(self, key: str, reader: BinaryIO, size: int, checksum: str) -> None:
        full, what = self._k(key), self.url_for(key)
        with s3_errors(what, CREATE_CRC32C):
            upload_id = self.client.create_multipart_upload(
                Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32C", ChecksumType="FULL_OBJECT",
                **self._lock_args(),
            )["UploadId"]
        futures: list[Future] = []
        part_bytes = part_size(size, self.chunk_bytes)
        try:
            value, got, number = 0, 0, 0
            while True:
                data = _read_up_to(reader, part_bytes)
                if not data:
                    break
                value, got, number = crc.update(value, data), got + len(data), number + 1
                if got > size:
                    break
                if any(f.done() and f.exception() for f in futures):
                    break
                self._inflight.acquire()
                try:
                    futures.append(self._executor().submit(self._upload_part, full, upload_id, number, data))
                except BaseException:
                    self._inflight.release()
                    raise
            parts = [f.result() for f in futures]  # re-raises the first part failure
            if (got, crc.to_hex(value)) != (size, checksum):
                raise CorruptCheckpoint(
                    f"{key}: source size/crc32c {got}/{crc.to_hex(value)} != expected {size}/{checksum}", path=key
                )
            with s3_errors(what, COMPLETE_CRC32C + IF_NONE_MATCH):
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts},
                    ChecksumCRC32C=crc.hex_to_s3(checksum), ChecksumType="FULL_OBJECT", IfNoneMatch="*",
                )
        except BaseException:
            for f in futures:
                if f.cancel():  # never ran, so never released its in-flight slot
                    self._inflight.release()
            for f in futures:
                if not f.cancelled():
                    f.exception()  # wait, so no part lands after the abort
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except Exception:  # noqa: BLE001 - best effort; a lifecycle rule reaps what is left
                pass
            raise

    def write_small_atomic(self, key: str, data: bytes) -> ObjectInfo:
        """One PutObject (atomic on S3) with CRC32C and If-None-Match (never overwrites)."""
        import io

        return self.put_verified(key, io.BytesIO(data), len(data), crc.hash_bytes(data))

    def delete(self, key: str) -> bool:
        if self._modes()[1]:
            return bool(self._delete_versions(key, exact=True))
        if self._head(key) is None:  # a pointer goes even if its content is gone
            return False
        with s3_errors(f"delete {self.url_for(key)}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._k(key))
        return True

    def sweep_staging(self, prefix: str, older_than_s: float = 3600.0, *, keys: Iterable[str] | None = None) -> int:
        """Abort multipart uploads under ``prefix`` started more than ``older_than_s`` ago (a
        killed upload's parts are S3's staging data: invisible, but billed); returns how many.

        The age is taken on the server's clock (``Initiated`` against the ``Date`` of the listing
        that reported it, rounded down to the second, so an upload is never judged older than it
        is), never this worker's: a worker whose clock runs fast would abort live uploads.
        ``older_than_s <= 0`` aborts every upload found, whatever its age.
        ``keys`` (tier-relative, as everywhere) limits the sweep to uploads of those objects,
        so that one part's retry never aborts the uploads of another part still running under
        the same checkpoint prefix; None sweeps the whole prefix (an operator's clean-up)."""
        from botocore.exceptions import ClientError

        full = self._k(prefix) + "/" if prefix else (self.prefix + "/" if self.prefix else "")
        only = None if keys is None else {self._k(k) for k in keys}
        count = 0
        with s3_errors(f"sweep {self.root_url}/{prefix}"):
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=full):
                cutoff = server_clock(page) - timedelta(seconds=older_than_s)
                for up in page.get("Uploads", []):
                    if (older_than_s > 0 and up["Initiated"] > cutoff) or (only is not None and up["Key"] not in only):
                        continue
                    try:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                    except ClientError as exc:
                        if _code(exc)[0] != "NoSuchUpload":  # gone already: another sweep got there first
                            raise
                        continue
                    count += 1
        return count

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise BadInput("refusing to delete the whole tier (empty prefix)")
        if self._modes()[1]:
            return self._delete_versions(prefix, exact=False)
        keys = [self._k(k) for k in self.keys(prefix)]
        if self._head(prefix) is not None:  # a single object, as on a file system
            keys.append(self._k(prefix))
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            with s3_errors(f"delete {self.root_url}/{prefix}"):
                r = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            if r.get("Errors"):
                raise StorageUnavailable(
                    f"S3 failed to delete {len(r['Errors'])} objects under {prefix}: {r['Errors'][0]}"
                )
        return len(keys)

    def bury(self, prefix: str, paths: Sequence[str] | None, *, token: str) -> Tomb:
        """S3 has no rename: nothing moves, what the claim deletes is listed now and only that is
        deleted (``delete_tomb``). On a versioned bucket (Object Lock implies one) the listing is
        of versions, and exactly those go: an object a newer holder uploads under the same key
        afterwards is a new version, which a late worker cannot delete. On an unversioned bucket
        a key is all there is: the claim is checked before each batch, and a worker stopped
        between its check and its request may still delete an object uploaded under the same key
        since; versioning closes that window."""
        if not self._modes()[1]:
            return super().bury(prefix, paths, token=token)
        full = self._k(prefix)
        wanted = None if paths is None else {self._k(f"{prefix}/{p}") for p in paths}
        found = [v for v in self._versions(full) if (v["Key"] in wanted if wanted is not None
                                                     else v["Key"] == full or v["Key"].startswith(full + "/"))]
        found.sort(key=lambda v: not is_manifest_name(v["Key"].rsplit("/", 1)[-1]))  # uncommitted first
        keys = tuple(dict.fromkeys(self._rel(v["Key"]) for v in found if v["data"]))
        return Tomb(token, keys, versions=tuple((self._rel(v["Key"]), v["VersionId"]) for v in found))

    def delete_tomb(self, tomb: Tomb, check: Callable[[], None]) -> int:
        """Delete what ``bury`` listed, up to 1000 objects a request, ``check()`` before each."""
        listed = ([{"Key": self._k(k), "VersionId": v} for k, v in tomb.versions] if tomb.versions
                  else [{"Key": self._k(k)} for k in tomb.keys])
        for i in range(0, len(listed), 1000):
            check()
            self._delete_listed(listed[i:i + 1000], f"tombstone of claim {tomb.token}")
        return len(tomb.keys)


def server_clock(response: dict[str, Any]) -> datetime:
    """The S3 server's time when it answered ``response`` (a boto3 response): its ``Date``
    header, which has whole seconds; this machine's clock only where the header is missing or
    unreadable."""
    from email.utils import parsedate_to_datetime

    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        at = parsedate_to_datetime(date) if date else None
    except (TypeError, ValueError):
        at = None
    if at is None:
        return datetime.now(UTC)
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)

