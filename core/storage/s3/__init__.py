"""Tier 2: S3-compatible object storage through boto3 (never s3fs), in modules:

- ``store``: ``S3Store`` (uploads, ranged reads, verification, the checksum probe);
- ``config``: the backend's registry entry, its URL check and its options from the settings;
- ``clients``: the boto3 clients a process shares;
- ``lock``: Object Lock and versioned deletes;
- ``errors``: botocore errors -> the project's taxonomy (``map_s3_error``).

Every name other modules import from ``core.storage.s3`` is re-exported here.
"""

from __future__ import annotations

from core.storage.s3 import config as config
from core.storage.s3.clients import _clients, forget_clients, new_client, shared_client
from core.storage.s3.errors import (
    _DIGEST_CODES,
    _NOT_FOUND_CODES,
    _PRECONDITION_CODES,
    _RETRYABLE_CODES,
    CHECKSUM_MODE,
    COMPLETE_CRC32C,
    CREATE_CRC32C,
    IF_NONE_MATCH,
    SEND_CRC32C,
    map_s3_error,
    s3_errors,
)
from core.storage.s3.lock import LOCK_MODES, ObjectLockMixin
from core.storage.s3.store import MAX_PARTS, PROBE_KEY, S3Store, part_size, server_clock

__all__ = [
    "CHECKSUM_MODE", "COMPLETE_CRC32C", "CREATE_CRC32C", "IF_NONE_MATCH", "LOCK_MODES", "MAX_PARTS", "PROBE_KEY",
    "SEND_CRC32C", "_DIGEST_CODES", "_NOT_FOUND_CODES", "_PRECONDITION_CODES", "_RETRYABLE_CODES", "ObjectLockMixin",
    "S3Store", "_clients", "config", "forget_clients", "map_s3_error", "new_client", "part_size", "s3_errors",
    "server_clock", "shared_client",
]
