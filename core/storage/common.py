"""What the storage backends share: mapping OS errors to the project's errors, and the
size/checksum comparison every read-back ends with."""

from __future__ import annotations

import errno

from core.errors import CorruptCheckpoint, StorageFull, StorageUnavailable

_TRANSIENT_ERRNOS = {errno.EIO, errno.ETIMEDOUT, errno.EAGAIN, errno.ESTALE, errno.EBUSY, errno.EINTR}


def map_os_error(exc: OSError, what: str) -> Exception:
    """ENOSPC/EDQUOT -> StorageFull; I/O timeouts and EIO -> StorageUnavailable; else unchanged."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(f"no space left writing {what}: {exc}")
    if exc.errno in _TRANSIENT_ERRNOS:
        return StorageUnavailable(f"I/O error on {what}: {exc}")
    return exc


def check_match(key: str, size: int, checksum_hex: str, got_size: int, got_hex: str, what: str) -> None:
    """``CorruptCheckpoint`` unless (got_size, got_hex) is (size, checksum_hex)."""
    if got_size != size:
        raise CorruptCheckpoint(f"{key}: {what} size {got_size} != expected {size}", path=key)
    if got_hex != checksum_hex:
        raise CorruptCheckpoint(f"{key}: {what} crc32c {got_hex} != expected {checksum_hex}", path=key)
