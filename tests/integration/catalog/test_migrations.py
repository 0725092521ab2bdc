"""Alembic migrations: `upgrade head` builds exactly the models' schema, and an old schema is
refused with a message that names `ckpt db upgrade`."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from typer.testing import CliRunner

from ckpt.cli import app
from core.errors import SchemaOutdated
from db.catalog import Catalog, upgrade
from db.migrate import head_revision, upgrade_connection
from db.models import Base
from db.session import make_engine


def _diff(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def test_upgrade_head_yields_exactly_the_models_schema(db_url):
    assert upgrade(db_url) == head_revision()
    assert _diff(db_url) == []


def test_upgrade_is_repeatable(db_url):
    assert upgrade(db_url) == upgrade(db_url) == head_revision()


def test_empty_database_is_refused_naming_the_upgrade_command(db_url):
    with pytest.raises(SchemaOutdated, match="ckpt db upgrade"):
        Catalog(db_url)


def test_schema_behind_head_is_refused_then_upgraded(db_url):
    engine = make_engine(db_url)
    with engine.begin() as conn:
        upgrade_connection(conn, "0001")
    engine.dispose()
    with pytest.raises(SchemaOutdated, match=r"revision 0001.*ckpt db upgrade"):
        Catalog(db_url)
    Catalog(db_url, check_schema=False).close()  # opt-out for tools that inspect old catalogs
    upgrade(db_url)
    Catalog(db_url).close()


def test_ckpt_db_upgrade_command(db_url):
    result = CliRunner().invoke(app, ["db", "upgrade", "--url", db_url])
    assert result.exit_code == 0, result.output
    assert f"revision {head_revision()}" in result.output
    Catalog(db_url).close()


def test_concurrent_upgrades_of_a_fresh_catalog_all_succeed(db_url):
    results, errors = [], []

    def go():
        try:
            results.append(upgrade(db_url))
        except Exception as exc:  # the outcome under test
            errors.append(exc)

    threads = [threading.Thread(target=go) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and results == [head_revision()] * 3
    assert _diff(db_url) == []
