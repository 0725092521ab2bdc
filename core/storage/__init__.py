"""Tier storage: ``open_store(url, tier, settings)`` picks the backend for a tier URL.

- ``s3://bucket/prefix`` -> ``S3Store`` (boto3; endpoint, region and transfer tuning from settings)
- a plain path or ``file://`` URL -> ``LocalStore`` (os-level I/O, fsync, symlink confinement)
- any other fsspec URL (``memory://``...) -> ``FsspecStore``
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.storage.base import ObjectInfo, TierStore

if TYPE_CHECKING:
    from core.settings import Settings

__all__ = ["ObjectInfo", "TierStore", "open_store"]


def open_store(url: str, tier: int, settings: Settings | None = None) -> TierStore:
    """The store for ``url``; ``settings`` supplies buffers, S3 endpoint and tuning (defaults if None)."""
    buffer_bytes = settings.io_buffer_bytes if settings else 4 * 1024 * 1024
    if url.startswith("s3://"):
        from core.storage.s3 import S3Store

        if settings is None:
            return S3Store(url, tier, buffer_bytes=buffer_bytes)
        return S3Store(
            url, tier,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            multipart_threshold=settings.s3_multipart_threshold,
            chunk_bytes=settings.s3_multipart_chunksize,
            max_concurrency=settings.s3_max_concurrency,
            parallelism=max(settings.copy_parallelism, settings.s3_max_concurrency),
            buffer_bytes=buffer_bytes,
            lock_days=settings.tier2_lock_days if tier == 2 else None,
            lock_mode=settings.tier2_lock_mode,
            range_bytes=settings.s3_range_bytes,
            ranged_threshold=settings.s3_ranged_threshold,
        )
    if url.startswith("file://") or "://" not in url:
        from core.storage.local import LocalStore

        return LocalStore(url, tier, buffer_bytes=buffer_bytes)
    from core.storage.fsspec import FsspecStore

    return FsspecStore(url, tier, buffer_bytes=buffer_bytes)
