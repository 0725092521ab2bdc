"""The catalog's clocks: the worker's own (``host_now``) and the catalog's (``catalog_now``), the
one leases, claims and retention ages compare against."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import text
from sqlalchemy.engine import Connection


def host_now() -> datetime:
    """The worker's own UTC clock: the one place Python's time is read for catalog stamps."""
    return datetime.now(UTC)


def catalog_now(conn: Connection) -> datetime:
    """The catalog's clock, read inside the caller's transaction, so leases, claims and
    retention ages compare times of one clock whatever the workers' clocks say (a node five
    minutes fast must not steal live claims). PostgreSQL: the server's ``now()`` (the
    transaction's start). SQLite is a file on the worker's own host: its clock is the host's."""
    if conn.dialect.name == "postgresql":
        return conn.execute(text("SELECT now()")).scalar_one().astimezone(UTC)
    return host_now()
