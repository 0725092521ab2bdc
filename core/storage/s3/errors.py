"""S3 errors -> this project's taxonomy (``map_s3_error``, ``s3_errors``), with the error-code sets
it and the checksum probe read, and the optional request headers each call names in a 501.

Errors: 5xx, throttling, timeouts and connection failures become ``StorageUnavailable``
after botocore's own retries (``standard`` mode, ``max_attempts``); a multipart upload aborted
under our feet (``NoSuchUpload``) is ``StorageUnavailable`` too (the destination lost staging
data; the source is fine and a retry starts over), and so is an endpoint's 400 BadDigest (the
bytes changed on the way: what was sent had been checked against the manifest); 404 is
``NotFound``; 501 NotImplemented to the checksum or If-None-Match headers is ``ConfigError``
naming the header (fail closed: this store cannot keep its promises on such an endpoint, and
no retry changes that); other client errors (access denied, missing bucket) are ``ConfigError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from core.errors import ConfigError, ConflictError, CorruptCheckpoint, NotFound, StorageUnavailable

_RETRYABLE_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests",
}
_NOT_FOUND_CODES = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION_CODES = {"412", "PreconditionFailed", "ConditionalRequestConflict"}
_DIGEST_CODES = {"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch"}  # the checksums we send
_IN_TRANSIT_CODES = _DIGEST_CODES | {"XAmzContentSHA256Mismatch"}  # and the signature's payload hash

# The optional request headers each call relies on, named in the ConfigError of an endpoint
# that answers 501 NotImplemented (when its error does not name the header itself).
SEND_CRC32C = ("x-amz-checksum-crc32c", "x-amz-sdk-checksum-algorithm")
IF_NONE_MATCH = ("If-None-Match",)
CREATE_CRC32C = ("x-amz-checksum-algorithm", "x-amz-checksum-type")
COMPLETE_CRC32C = ("x-amz-checksum-crc32c", "x-amz-checksum-type")
CHECKSUM_MODE = ("x-amz-checksum-mode",)


def _code(exc: BaseException) -> tuple[str, int]:
    err = getattr(exc, "response", {}) or {}
    return str(err.get("Error", {}).get("Code", "")), int(err.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def map_s3_error(exc: Exception, what: str, headers: tuple[str, ...] = ()) -> Exception:
    """botocore exception -> this project's taxonomy (the caller raises the result).

    ``headers`` are the optional headers the request carried (checksums, If-None-Match): a 501
    NotImplemented names them when the endpoint's error does not say which one it refused."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectionError as BotoConnError,
        HTTPClientError,
        NoCredentialsError,
        ParamValidationError,
    )

    if isinstance(exc, ClientError):
        code, status = _code(exc)
        if code == "NotImplemented" or status == 501:
            named = exc.response.get("Error", {}).get("Header") or " / ".join(headers) or "a header of this request"
            return ConfigError(
                f"the S3 endpoint does not implement {named} (501 NotImplemented to {what}); this store "
                "needs it to publish and verify safely, so it stops here instead of retrying"
            )
        if code == "NoSuchUpload":
            return StorageUnavailable(
                f"{what}: the multipart upload at the destination was aborted before it completed "
                "(NoSuchUpload: a staging sweep, a lifecycle rule or another worker); nothing was "
                "published and the source is untouched, a retry starts a new upload"
            )
        if status >= 500 or code in _RETRYABLE_CODES or status == 429:
            return StorageUnavailable(f"S3 unavailable for {what}: {code or status}")
        if code == "NoSuchBucket":
            return ConfigError(f"S3 bucket of {what} does not exist")
        if code in _NOT_FOUND_CODES or status == 404:
            return NotFound(f"{what} does not exist")
        if code in _PRECONDITION_CODES or status == 412:
            return ConflictError(f"{what}: precondition failed ({code})")
        if code == "InvalidRange" or status == 416:  # a ranged read past the end: shorter than the manifest says
            return CorruptCheckpoint(f"{what}: the object is shorter than the range asked for ({code or status})")
        if code in _IN_TRANSIT_CODES:
            # Every upload sends the checksum of the bytes it read, and those bytes matched the
            # manifest before anything was published: the endpoint received other bytes than were
            # sent. The source is fine (never blame it); a retry sends them again.
            return StorageUnavailable(f"{what}: the endpoint received bytes that differ from those sent "
                                      f"({code}): changed in transit, nothing published; a retry sends them again")
        return ConfigError(f"S3 refused {what}: {code or status}: {exc}")
    if isinstance(exc, (NoCredentialsError, ParamValidationError)):
        return ConfigError(f"S3 {what}: {exc}")
    if isinstance(exc, (BotoConnError, HTTPClientError, BotoCoreError)):
        return StorageUnavailable(f"S3 unreachable for {what}: {exc}")
    return exc


@contextmanager
def s3_errors(what: str, headers: tuple[str, ...] = ()) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise map_s3_error(exc, what, headers) from exc
