"""Database failures map onto the error taxonomy, and nothing is half-written after them."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import insert

from core.errors import CatalogUnavailable, ConflictError, LineageCycle, ValueRefused, is_transient
from db.catalog import Catalog
from db.entities import CORRUPT, VERIFIED
from db.models import Run
from db.session import transaction
from tests.kit.catalog import checkpoint, manifest, verified


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
    with (
        pytest.raises(ConflictError, match="conflicts with recorded data") as info,
        transaction(catalog.engine) as conn,
    ):
        conn.execute(insert(Run).values(name="r", created_at=catalog.get_run("r").created_at, tags={}))
    assert not is_transient(info.value)


def test_failure_midway_leaves_nothing_half_written(catalog):
    catalog.ensure_run("r")
    bad = manifest("r", 1, parent=("r", 1, "resumed_from"))  # its own parent: refused after the inserts
    with pytest.raises(LineageCycle):
        catalog.register_part(bad, actor="t")
    assert catalog.list_checkpoints("r") == []
    assert catalog.history("r", 1) == []
    assert catalog.register_part(manifest("r", 1), actor="t").file_count == 2



@pytest.mark.parametrize("values", [dict(step=2**63), dict(run="r" * 300)], ids=["bigint", "varchar"])
def test_a_value_the_database_refuses_is_permanent_bad_input(catalog, values):
    """An out-of-range number (OverflowError on SQLite, DataError on PostgreSQL) or a string past
    its column (PostgreSQL; SQLite keeps it) is ``ValueRefused``: bad input, never retried."""
    if catalog.engine.dialect.name == "sqlite" and "run" in values:
        pytest.skip("SQLite does not bound text")
    with pytest.raises(ValueRefused, match="the catalog refused a value") as err:
        catalog.record_rejection("event:hostile", "a test", actor="test", **values)
    assert not is_transient(err.value) and "\n" not in str(err.value)
    assert not [a for a in catalog.audit_log(limit=10) if a.subject == "event:hostile"]
