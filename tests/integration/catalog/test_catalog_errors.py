"""Database failures map onto the error taxonomy, and nothing is half-written after them."""

from __future__ import annotations

import socket
import sqlite3

import psycopg
import pytest
from sqlalchemy import insert

from core.errors import CatalogUnavailable, ConflictError, NotFound, is_transient
from db.catalog import Catalog
from db.entities import CORRUPT, VERIFIED
from db.models import Run
from db.session import transaction
from tests.kit.catalog import checkpoint, manifest, verified


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_postgres_is_transient():
    url = f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/test"
    with pytest.raises(CatalogUnavailable) as info:
        Catalog(url)
    assert is_transient(info.value)


def test_locked_sqlite_is_transient_and_the_retry_succeeds(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    Catalog.open(url, auto_upgrade=True).close()
    cat = Catalog(url, busy_timeout_s=0.2)
    cat.ensure_run("r")
    holder = sqlite3.connect(tmp_path / "c.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(CatalogUnavailable, match="locked"):
            cat.register_part(manifest("r", 1), actor="t")
        assert cat.list_checkpoints("r") == []  # readers are not blocked (WAL), nothing written
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert cat.register_part(manifest("r", 1), actor="t").step == 1
    cat.close()


def test_postgres_row_lock_timeout_is_transient(pg_url):
    Catalog.open(pg_url, auto_upgrade=True).close()
    cat = Catalog(pg_url, busy_timeout_s=0.3)
    rep = verified(cat, checkpoint(cat, "r", 1).id, 1)
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as holder:
        holder.execute("SELECT * FROM replicas WHERE id = %s FOR UPDATE", (rep.id,))
        with pytest.raises(CatalogUnavailable, match="lock"):
            cat.transition(rep.id, CORRUPT, actor="scrub")
    assert cat.get_replica(rep.id).state == VERIFIED
    assert cat.transition(rep.id, CORRUPT, actor="scrub").state == CORRUPT
    cat.close()


def test_integrity_error_is_a_clear_permanent_conflict(catalog):
    catalog.ensure_run("r")
    with pytest.raises(ConflictError, match="conflicts with recorded data") as info:
        with transaction(catalog.engine) as conn:
            conn.execute(insert(Run).values(name="r", created_at=catalog.get_run("r").created_at, tags={}))
    assert not is_transient(info.value)


def test_failure_midway_leaves_nothing_half_written(catalog):
    catalog.ensure_run("r")
    bad = manifest("r", 1, parent=("no-such-run", 5, "resumed_from"))
    with pytest.raises(NotFound):
        catalog.register_part(bad, actor="t")
    assert catalog.list_checkpoints("r") == []
    assert catalog.history("r", 1) == []
    assert catalog.register_part(manifest("r", 1), actor="t").file_count == 2
