"""What a pipeline step opens is shared per process: the catalog's engine (one per URL and
options), its schema check (once per URL) and the S3 client (one per configuration and AWS
credentials), so a promotion's steps stop paying for new ones; closing one holder never takes
them from another, and a forked child never uses its parent's connections."""

from __future__ import annotations

import os

import pytest

import db.catalog
from core.storage.s3 import S3Store
from db.catalog import Catalog, upgrade

ENDPOINT = "http://127.0.0.1:9"  # never contacted: making a client sends nothing


@pytest.fixture
def url(tmp_path):
    u = f"sqlite:///{tmp_path / 'catalog.db'}"
    upgrade(u)
    return u


def test_catalogs_of_one_url_share_an_engine_and_closing_one_leaves_the_other_its_connections(url):
    a, b = Catalog(url), Catalog(url)
    assert a.engine is b.engine
    b.ensure_run("r")  # a pooled connection now waits for the next transaction
    a.close()
    a.close()  # twice: still only a's own lease
    assert b.engine.pool.checkedin() >= 1, "closing one catalog disposed the engine the other uses"
    assert [r.name for r in b.list_runs()] == ["r"]
    with Catalog(url) as c:
        assert c.engine is b.engine
    assert Catalog(url, busy_timeout_s=1.0).engine is not b.engine  # other options, other engine
    b.close()


def test_the_schema_is_checked_once_per_url_until_an_upgrade(url, tmp_path, monkeypatch):
    other = f"sqlite:///{tmp_path / 'other.db'}"
    upgrade(other)
    reads = []
    real = db.catalog.current_revision  # Alembic's read of the version table, in every check
    monkeypatch.setattr(db.catalog, "current_revision", lambda conn: reads.append(1) or real(conn))
    for _ in range(3):
        Catalog(url).close()
    assert len(reads) == 1
    Catalog(other).close()
    assert len(reads) == 2  # its own check
    upgrade(url)  # a migration in this process (it reads the revision once itself) ...
    Catalog(url).close()
    Catalog(url).close()
    assert len(reads) == 4  # ... and the next catalog checks again, once
    monkeypatch.setattr(db.catalog, "SCHEMA_RECHECK_S", 0.0)  # a long-lived worker looks again in time
    Catalog(url).close()
    assert len(reads) == 5


def test_s3_stores_share_a_client_per_configuration_and_credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key-a")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-a")
    a = S3Store("s3://bkt/one", endpoint_url=ENDPOINT, max_concurrency=4, max_attempts=3)
    b = S3Store("s3://bkt/two", endpoint_url=ENDPOINT, max_concurrency=4, max_attempts=3)
    assert a.client is b.client
    wide = S3Store("s3://bkt/one", endpoint_url=ENDPOINT, max_concurrency=32, max_attempts=3)
    assert wide.client is not a.client
    assert wide.client.meta.config.max_pool_connections == wide.pool_connections() > a.pool_connections()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-b")
    c = S3Store("s3://bkt/one", endpoint_url=ENDPOINT, max_concurrency=4, max_attempts=3)
    assert c.client is not a.client
    assert c.client._request_signer._credentials.secret_key == "secret-b"
    from core.storage import s3

    assert "secret-" not in repr(s3._clients) and "key-a" not in repr(s3._clients)


def test_a_forked_child_opens_its_own_connections_and_client(url):
    """The child keeps the engine (its dialect set up, its compiled statements: what the agent's
    zygote hands its children), never the parent's pooled connections."""
    from sqlalchemy import event

    parent_cat = Catalog(url)
    parent_cat.ensure_run("r")
    assert parent_cat.engine.pool.checkedin() >= 1  # a pooled connection the child must not take
    parent_client = S3Store("s3://bkt/p", endpoint_url=ENDPOINT).client
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            opened: list[object] = []
            event.listen(parent_cat.engine, "connect", lambda conn, _record: opened.append(conn))
            with Catalog(url) as cat:
                ok = (cat.engine is parent_cat.engine and [r.name for r in cat.list_runs()] == ["r"]
                      and len(opened) == 1
                      and S3Store("s3://bkt/p", endpoint_url=ENDPOINT).client is not parent_client)
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert answer == b"1", "the forked child used its parent's connections or S3 client, or made a new engine"
    assert [r.name for r in parent_cat.list_runs()] == ["r"]  # the parent's connections still work
    parent_cat.close()


def test_a_catalog_file_replaced_under_a_warm_engine_is_reopened(url, tmp_path):
    """A catalog restored from a backup (the file replaced, its -wal/-shm removed) while this
    process keeps a warm engine: the next step writes into the restored file, where every
    other process reads, not into the deleted inode."""
    import shutil
    import sqlite3

    path = tmp_path / "catalog.db"
    with Catalog(url) as cat:
        cat.ensure_run("before-backup")
        old_engine = cat.engine
    with sqlite3.connect(path) as raw:  # a consistent copy, as `sqlite3 .backup` makes
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    shutil.copy(path, tmp_path / "backup.db")
    with Catalog(url) as cat:
        cat.ensure_run("lost-in-the-restore")
    assert old_engine.pool.checkedin() >= 1  # warm: a pooled connection on the old inode

    os.replace(tmp_path / "backup.db", path)  # the restore
    for side in ("catalog.db-wal", "catalog.db-shm"):
        (tmp_path / side).unlink(missing_ok=True)

    with Catalog(url) as cat:
        cat.ensure_run("after-restore")
        new_engine = cat.engine
    with sqlite3.connect(path) as other_process:
        names = sorted(r[0] for r in other_process.execute("SELECT name FROM runs"))
    assert names == ["after-restore", "before-backup"]
    assert new_engine is not old_engine
