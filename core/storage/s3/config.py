"""The S3 backend's entry in the registry: its URL check and its configuration, built from the
``Settings`` object (the ``s3_*`` settings and ``tier2_lock_*`` are this backend's alone)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from core.storage.content import SHARED_TIERS
from core.storage.registry import Backend, io_buffer, register
from core.tiers import Tier

if TYPE_CHECKING:
    from core.settings import Settings
    from core.storage.s3.store import S3Store

EXAMPLE = "s3://bucket/prefix"


def url_problem(url: str) -> str | None:
    """Why ``url`` may not be an S3 tier root (None when it may): credentials, a query or a
    fragment inside it would be carried into the store's URL, messages and events."""
    if not url.startswith("s3://"):
        return f"an S3 URL must look like {EXAMPLE}"
    body = url.removeprefix("s3://")
    if "@" in body.split("/", 1)[0] or ":" in body.split("/", 1)[0]:
        return ("tier2_url must not hold credentials (s3://KEY:SECRET@bucket): give the S3 client its keys "
                "through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role, and "
                f"set tier2_url to {EXAMPLE}")
    if "?" in body or "#" in body:
        return (f"tier2_url must be {EXAMPLE}, without a query or fragment (credentials go in the "
                "AWS environment)")
    return None


def store_options(settings: Settings, tier: int) -> dict[str, Any]:
    """``S3Store``'s keyword arguments from ``settings`` (Object Lock applies to Tier 2 only)."""
    return {
        "endpoint_url": settings.s3_endpoint_url,
        "region": settings.s3_region,
        "multipart_threshold": settings.s3_multipart_threshold,
        "chunk_bytes": settings.s3_multipart_chunksize,
        "max_concurrency": settings.s3_max_concurrency,
        "parallelism": max(settings.copy_parallelism, settings.s3_max_concurrency),
        "buffer_bytes": io_buffer(settings),
        "lock_days": settings.tier2_lock_days if Tier(tier).object_store else None,
        "lock_mode": settings.tier2_lock_mode,
        "range_bytes": settings.s3_range_bytes,
        "ranged_threshold": settings.s3_ranged_threshold,
    }


def open_s3(url: str, tier: int, settings: Settings | None) -> S3Store:
    from core.storage.s3.store import S3Store  # deferred: cycle — the store imports url_problem from here

    if settings is None:
        return S3Store(url, tier, buffer_bytes=io_buffer(None), shared_content=_shares(tier))
    return S3Store(url, tier, shared_content=_shares(tier), **store_options(settings, tier))


def _shares(tier: int) -> bool:
    """Whether an S3 store of ``tier`` shares content: the object tier only, the one whose contents
    the scheduled sweep frees (``tasks.contents``); an S3 Tier 1 stores each copy whole."""
    return tier in SHARED_TIERS and Tier(tier).object_store


register(Backend(name="s3", schemes=("s3",), factory=open_s3, object_store=True, example=EXAMPLE,
                 url_problem=url_problem))
