"""Database failures map onto the error taxonomy (SQLite, and a PostgreSQL that is not there)."""

from __future__ import annotations

import socket
import sqlite3

import pytest

from core.errors import CatalogUnavailable, CkptError, is_transient
from db.catalog import Catalog
from tests.kit.catalog import manifest


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_postgres_is_transient():
    url = f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/test"
    with pytest.raises(CatalogUnavailable) as info:
        Catalog(url)
    assert is_transient(info.value)


@pytest.mark.parametrize("url", ["postgresql+psycopg//ckpt:hunter2-marker@db/ckpt",  # a typo: no ':'
                                 f"postgresql+psycopg://ckpt:hunter2-marker@127.0.0.1:{_closed_port()}/ckpt"],
                         ids=["malformed", "unreachable"])
def test_a_catalog_error_never_shows_the_password(url):
    """Such a message ends up in a flow run's state and logs, which the Prefect server keeps."""
    with pytest.raises(CkptError) as info:
        Catalog(url)
    assert "hunter2-marker" not in str(info.value)


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
