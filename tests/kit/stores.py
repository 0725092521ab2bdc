"""Tier stores by hand: a pair of local tiers (the ``tiers`` fixture: Tier 0 and Tier 1 in
the test's temp folder) and the three calls the storage tests make on any store."""

from __future__ import annotations

import io

import pytest

from core import checksum
from core.storage.local import LocalStore


@pytest.fixture
def tiers(tmp_path):
    for name in ("t0", "t1"):
        (tmp_path / name).mkdir()  # a store never creates its root
    return LocalStore(tmp_path / "t0", 0), LocalStore(tmp_path / "t1", 1)


def put(store, key: str, data: bytes):
    """Store ``data`` at ``key`` through the verified write (checksum computed here)."""
    return store.put_verified(key, io.BytesIO(data), len(data), checksum.hash_bytes(data))


def read(store, key: str) -> bytes:
    with store.open_read(key) as fh:
        return fh.read()


def all_names(store) -> list[str]:
    return [o.key for o in store.list("")]
