"""S3 Object Lock and object versions: the part of ``S3Store`` that locks what it uploads and
removes every version of what it deletes.

Object Lock (``lock_days``, ``lock_mode``): every checkpoint object is uploaded with
``ObjectLockMode`` and ``ObjectLockRetainUntilDate`` (upload time + ``lock_days``), so nobody
holding this store's credentials can delete it before then (compliance: nobody at all). S3 turns
Object Lock on only when a bucket is created (``ObjectLockEnabledForBucket``); before the first
locked upload the bucket's lock configuration is checked once per process, and a bucket without
it is a ``ConfigError`` (never a silently unlocked copy). Object Lock implies versioning, where a
delete without a version id only adds a delete marker and keeps the bytes: on a versioned bucket
``delete`` and ``delete_prefix`` remove every version of the keys they delete, so a pruned copy
is really gone. A locked version refuses (AccessDenied): ``ObjectLocked``, nothing else deleted
in that call; ``locked_until`` tells beforehand (HeadObject's ``ObjectLockRetainUntilDate``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError, NotFound, ObjectLocked, StorageUnavailable
from core.storage.s3.errors import _code, s3_errors

# (endpoint URL, bucket) -> (Object Lock enabled, versioning on); per process.
_bucket_modes: dict[tuple[str, str], tuple[bool, bool]] = {}
LOCK_MODES = {"governance": "GOVERNANCE", "compliance": "COMPLIANCE"}


class ObjectLockMixin:
    """Object Lock and versioned deletes of an ``S3Store`` (its client, bucket and keys)."""

    client: Any
    bucket: str
    root_url: str
    lock_days: float | None
    lock_mode: str

    if TYPE_CHECKING:
        def _head(self, key: str) -> dict | None: ...
        def _k(self, key: str) -> str: ...
        def _rel(self, full: str) -> str: ...
        def url_for(self, key: str) -> str: ...

    # --- Object Lock and versions ---------------------------------------------------------
    def _lock_args(self) -> dict[str, Any]:
        if not self.lock_days:
            return {}
        until = datetime.now(UTC) + timedelta(days=self.lock_days)
        return {"ObjectLockMode": LOCK_MODES[self.lock_mode], "ObjectLockRetainUntilDate": until}

    def _modes(self) -> tuple[bool, bool]:
        """(Object Lock enabled, versioning on) for this bucket, asked once per process."""
        where = (str(self.client.meta.endpoint_url), self.bucket)
        if where not in _bucket_modes:
            from botocore.exceptions import ClientError

            def ask(what: str, call: Any) -> dict:
                """The answer; {} where the endpoint refuses the question (no lock configuration:
                ObjectLockConfigurationNotFoundError; not allowed to ask; not implemented)."""
                try:
                    with s3_errors(f"{what} of bucket {self.bucket}"):
                        return call(Bucket=self.bucket)
                except (ConfigError, NotFound) as exc:
                    if not isinstance(exc.__cause__, ClientError) or _code(exc.__cause__)[0] == "NoSuchBucket":
                        raise
                    return {}

            conf = ask("Object Lock configuration", self.client.get_object_lock_configuration)
            locked = conf.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"
            status = ask("versioning", self.client.get_bucket_versioning).get("Status")
            _bucket_modes[where] = (locked, locked or status in ("Enabled", "Suspended"))
        return _bucket_modes[where]

    def require_object_lock(self) -> None:
        """``ConfigError`` unless the bucket has Object Lock enabled (S3 turns it on only at bucket
        creation), so that a store asked to lock never writes an unlocked copy."""
        if not self._modes()[0]:
            raise ConfigError(
                f"CKPT_TIER2_LOCK_DAYS is set but bucket {self.bucket!r} does not have S3 Object Lock enabled; "
                "it can only be turned on when the bucket is created (CreateBucket with "
                "ObjectLockEnabledForBucket=true, `aws s3api create-bucket --object-lock-enabled-for-bucket`). "
                "Nothing was uploaded: use a bucket with Object Lock or unset CKPT_TIER2_LOCK_DAYS")

    def _ensure_locked(self, key: str) -> None:
        """The lock asked at upload is on the stored version; where an endpoint dropped it (moto
        ignores it on CreateMultipartUpload) it is set with PutObjectRetention; ``ConfigError``
        when that does not hold either: never a silently unlocked copy."""
        what = f"Object Lock of {self.url_for(key)}"
        head = self._head(key) or {}
        if head.get("ObjectLockRetainUntilDate"):
            return
        args = self._lock_args()
        with s3_errors(what):
            self.client.put_object_retention(
                Bucket=self.bucket, Key=self._k(key), VersionId=head.get("VersionId"),
                Retention={"Mode": args["ObjectLockMode"], "RetainUntilDate": args["ObjectLockRetainUntilDate"]})
        if not (self._head(key) or {}).get("ObjectLockRetainUntilDate"):
            raise ConfigError(f"{what}: the endpoint accepted the upload but keeps no retention on it")

    @property
    def retains(self) -> bool:
        return self._modes()[0]

    def locked_until(self, keys: Iterable[str]) -> datetime | None:
        """HeadObject's retain-until date of each key's current version (only on a bucket with
        Object Lock); the latest one still in the future."""
        if not self.retains:
            return None
        now, latest = datetime.now(UTC), None
        for key in keys:
            h = self._head(key)
            until = (h or {}).get("ObjectLockRetainUntilDate")
            if until is not None and until > now and (latest is None or until > latest):
                latest = until
        return latest

    def _versions(self, full_prefix: str) -> Iterator[dict]:
        with s3_errors(f"list versions {self.bucket}/{full_prefix}"):
            for page in self.client.get_paginator("list_object_versions").paginate(Bucket=self.bucket,
                                                                                   Prefix=full_prefix):
                for v in page.get("Versions", []):
                    yield {"Key": v["Key"], "VersionId": v["VersionId"], "data": True}
                for m in page.get("DeleteMarkers", []):
                    yield {"Key": m["Key"], "VersionId": m["VersionId"], "data": False}

    def _delete_versions(self, key_or_prefix: str, *, exact: bool) -> int:
        """Every version and delete marker of ``key_or_prefix`` (exactly that key, or that key and
        everything under it as a folder); returns how many keys had data. ``ObjectLocked`` when a
        version is under retention (the others in its batch may be gone; the locked one stays)."""
        full = self._k(key_or_prefix)
        found = [v for v in self._versions(full) if v["Key"] == full or (not exact and v["Key"].startswith(full + "/"))]
        for i in range(0, len(found), 1000):
            self._delete_listed(found[i:i + 1000], key_or_prefix)
        return len({v["Key"] for v in found if v["data"]})

    def _delete_listed(self, batch: list[dict], what: str) -> None:
        """One DeleteObjects of ``batch`` (``{"Key": full key, "VersionId": ...}``, the version id
        left out on an unversioned bucket). ``ObjectLocked`` for a version under retention."""
        with s3_errors(f"delete {self.root_url}/{what}"):
            r = self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{k: v[k] for k in ("Key", "VersionId") if k in v} for v in batch], "Quiet": True})
        errors = r.get("Errors") or []
        locked = [e for e in errors if e.get("Code") == "AccessDenied"]
        if locked:
            key = self._rel(locked[0]["Key"])
            raise ObjectLocked(f"{self.url_for(key)} is under S3 Object Lock (or this principal may not delete "
                               f"its versions): kept ({locked[0].get('Message', 'AccessDenied')})",
                               until=self.locked_until([key]))
        if errors:
            raise StorageUnavailable(f"S3 failed to delete {len(errors)} objects under {what}: {errors[0]}")

