"""Tier storage: ``open_store(url, tier, settings)`` opens the backend registered for a tier
URL's scheme (``core.storage.registry``); each backend module registers itself:

- ``s3://bucket/prefix`` -> ``S3Store`` (``core.storage.s3``: boto3; endpoint, region, transfer
  tuning and Object Lock from the ``s3_*`` and ``tier2_lock_*`` settings)
- a plain path or ``file://`` URL -> ``LocalStore`` (os-level I/O, fsync, symlink confinement)
- any other protocol fsspec knows (``memory://``...) -> ``FsspecStore`` (the fallback)

An unregistered scheme is a ``ConfigError`` listing the registered ones. docs/backends.md
tells how to add a backend.
"""

from __future__ import annotations

# each backend module registers its schemes when imported (none imports its client library
# before a store is opened, so this stays cheap)
from core.storage import fsspec as _fsspec, local as _local, s3 as _s3  # noqa: F401
from core.storage.base import ObjectInfo, TierStore
from core.storage.registry import Backend, backend_for, open_store, register, schemes, tier2_url_problem

__all__ = ["Backend", "ObjectInfo", "TierStore", "backend_for", "open_store", "register", "schemes",
           "tier2_url_problem"]
