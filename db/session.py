"""Engines and the one managed transaction helper every catalog method goes through.

``transaction(engine, write=...)`` yields a Core connection inside one transaction; it commits
on success, rolls back on any error, and maps database failures onto the project's taxonomy:

- ``OperationalError`` / ``InterfaceError`` / an invalidated connection (connection refused,
  server gone, SQLite "database is locked", PostgreSQL lock timeout, serialization failure,
  deadlock) -> ``CatalogUnavailable`` (transient: a retry may succeed);
- ``IntegrityError`` (a unique or foreign key the caller's request contradicts) -> ``ConflictError``
  (permanent).

Because the whole method is one transaction, nothing is half-written after either.

SQLite: WAL (readers never block the writer), foreign keys on, a busy timeout, and write
transactions opened with ``BEGIN IMMEDIATE`` so that the compare-and-set checks of a writer
cannot be invalidated by another writer between its read and its write (PostgreSQL gets the
same guarantee from ``SELECT ... FOR UPDATE`` in ``db.catalog``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, InterfaceError, OperationalError

from core.errors import CatalogUnavailable, ConfigError, ConflictError
from core.settings import redact_url

DEFAULT_BUSY_TIMEOUT_S = 30.0
_WRITE = "ckpt_write"


def normalize_url(url: str) -> str:
    """Accept ``postgresql://`` / ``postgres://`` and use the psycopg 3 driver for them."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def make_engine(url: str, *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
                connect_timeout_s: int = 10) -> Engine:
    """An engine for a catalog URL (SQLite file or PostgreSQL). Creates the SQLite folder."""
    try:
        parsed = make_url(normalize_url(url))
    except ArgumentError as exc:
        # the URL may carry a password, and this message may reach a flow run's state and logs
        raise ConfigError(redact_url(f"invalid catalog URL {url!r}: {exc}")) from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(parsed, busy_timeout_s)
    if backend == "postgresql":
        # lock_timeout: a writer blocked on a row lock gives up like a SQLite busy timeout does.
        options = f"-c lock_timeout={int(busy_timeout_s * 1000)}"
        return create_engine(parsed, pool_pre_ping=True,
                             connect_args={"connect_timeout": connect_timeout_s, "options": options})
    raise ConfigError(f"unsupported catalog backend {backend!r}: use sqlite:/// or postgresql+psycopg://")


def _sqlite_engine(parsed: URL, busy_timeout_s: float) -> Engine:
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, connect_args={"timeout": busy_timeout_s, "check_same_thread": False})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        # Let SQLAlchemy's "begin" event below issue BEGIN itself (pysqlite's own is deferred).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

    return engine


@contextmanager
def transaction(engine: Engine, *, write: bool = True) -> Iterator[Connection]:
    """One transaction: commit on success, roll back on error, map database errors (see module)."""
    try:
        with engine.connect() as conn:
            if write:
                conn = conn.execution_options(**{_WRITE: True})
            with conn.begin():
                yield conn
    except IntegrityError as exc:
        raise ConflictError(f"the catalog refused a change that conflicts with recorded data: "
                            f"{_first_line(exc)}") from exc
    except (OperationalError, InterfaceError) as exc:
        raise CatalogUnavailable(f"catalog temporarily unavailable: {_first_line(exc)}") from exc
    except DBAPIError as exc:
        if exc.connection_invalidated:
            raise CatalogUnavailable(f"catalog connection lost: {_first_line(exc)}") from exc
        raise


def _first_line(exc: DBAPIError) -> str:
    text = str(exc.orig) if exc.orig is not None else str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
