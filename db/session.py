"""Engines and the one managed transaction helper every catalog method goes through.

``transaction(engine, write=...)`` yields a Core connection inside one transaction; it commits
on success, rolls back on any error, and maps database failures onto the project's taxonomy:

- ``OperationalError`` / ``InterfaceError`` / an invalidated connection (connection refused,
  server gone, SQLite "database is locked", PostgreSQL lock timeout, serialization failure,
  deadlock) -> ``CatalogUnavailable`` (transient: a retry may succeed);
- ``IntegrityError`` (a unique or foreign key the caller's request contradicts) -> ``ConflictError``
  (permanent);
- a value the database or its driver refuses (``DataError``: too long, out of range, not valid
  JSON; an ``OverflowError`` from the driver; an error binding a value) -> ``ValueRefused``
  (permanent bad input: a registration records it as a rejection instead of retrying forever).

Because the whole method is one transaction, nothing is half-written after either.

Engines are shared per process (``lease_engine``): every pipeline step opens a ``Catalog`` and
closes it on the way out, and a new engine each time meant a new pool, new connections and a
new dialect set-up in every step. A lease is returned with ``release_engine``, which never
disposes an engine another lease still uses; the registry keeps the few most recently used
engines (``MAX_SHARED_ENGINES``) with their idle connections, disposes the others once no lease
holds them; a forked child keeps them with new, empty pools (a parent's pooled connections
must not be used by two processes). A SQLite file replaced under a shared engine (a catalog restored from a
backup, its ``-wal``/``-shm`` removed) is noticed at the next lease by its device and inode,
and a fresh engine opens the new file; the old one is disposed once its last lease is back.

SQLite: WAL (readers never block the writer), foreign keys on, a busy timeout, and write
transactions opened with ``BEGIN IMMEDIATE`` so that the compare-and-set checks of a writer
cannot be invalidated by another writer between its read and its write (PostgreSQL gets the
same guarantee from ``SELECT ... FOR UPDATE`` in ``db.catalog``).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DataError,
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    StatementError,
)

from core.errors import CatalogUnavailable, ConfigError, ConflictError, ValueRefused
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


MAX_SHARED_ENGINES = 8  # distinct catalogs (URL, options) whose engines a process keeps warm


class _Shared:
    """A shared engine, how many leases hold it, whether the registry still lists it, and for a
    SQLite file the identity (device, inode) of the file it opened."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.leases, self.listed = engine, 0, True
        self.path = _sqlite_file(engine)
        self.identity = _file_identity(self.path)

    def replaced(self) -> bool:
        """Whether the SQLite file at the engine's path is no longer the one it opened (restored
        from a backup, moved, deleted): its pooled connections write into the old inode, where
        no other process looks. A file that did not exist yet is recorded once it does."""
        if self.path is None:
            return False
        now = _file_identity(self.path)
        if self.identity is None:
            self.identity = now
            return False
        return now != self.identity


def _sqlite_file(engine: Engine) -> str | None:
    url = engine.url
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return str(Path(url.database).expanduser().absolute())


def _file_identity(path: str | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@dataclass(eq=False)
class EngineLease:
    """One holder's use of a shared engine: give it back with ``release_engine``."""

    _entry: _Shared
    released: bool = False

    @property
    def engine(self) -> Engine:
        return self._entry.engine


_shared: OrderedDict[tuple[str, float, int], _Shared] = OrderedDict()
_shared_lock = threading.Lock()


def lease_engine(url: str, *, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
                 connect_timeout_s: int = 10) -> EngineLease:
    """The process's engine for this catalog URL and these options (made on first use)."""
    key = (normalize_url(url), float(busy_timeout_s), int(connect_timeout_s))
    with _shared_lock:
        entry = _shared.get(key)
        stale = _unlist(key) if entry is not None and entry.replaced() else None
        if stale is not None or (entry is not None and not entry.listed):
            entry = None
        if entry is None:
            entry = _shared[key] = _Shared(make_engine(url, busy_timeout_s=busy_timeout_s,
                                                       connect_timeout_s=connect_timeout_s))
        _shared.move_to_end(key)
        entry.leases += 1
        idle = [_unlist(k) for k in list(_shared)[:max(0, len(_shared) - MAX_SHARED_ENGINES)]]
    _dispose([*idle, stale])
    return EngineLease(entry)


def release_engine(lease: EngineLease) -> None:
    """Give a lease back (a second call does nothing). The engine stays for the next lease
    unless the registry dropped it meanwhile and this was its last lease: then it is disposed."""
    with _shared_lock:
        if lease.released:
            return
        lease.released = True
        entry = lease._entry
        entry.leases = max(0, entry.leases - 1)  # a lease taken before a fork, given back in the child
        done = [] if entry.listed or entry.leases else [entry]
    _dispose(done)


def forget_engines() -> None:
    """Drop every shared engine, so that the next lease makes a new one (tests, benchmarks);
    one still leased is disposed when its last lease comes back."""
    with _shared_lock:
        idle = [_unlist(k) for k in list(_shared)]
    _dispose(idle)


def close_connections() -> None:
    """Close the pooled connections of every shared engine; the engines stay, and their next
    lease connects again. For a process about to fork a long-lived child (the agent's zygote):
    a connection the child inherits is only dropped there, and a dropped SQLite connection is
    closed when it is collected, which in WAL mode may checkpoint and remove the ``-wal`` file
    that the parent's and every other process's connections still read."""
    with _shared_lock:
        engines = [entry.engine for entry in _shared.values()]
    for engine in engines:
        engine.dispose()


def _unlist(key: tuple[str, float, int]) -> _Shared | None:
    """Take ``key`` off the registry (lock held); the entry when nobody leases it (to dispose)."""
    entry = _shared.pop(key)
    entry.listed = False
    return None if entry.leases else entry


def _dispose(entries: Iterable[_Shared | None]) -> None:
    for entry in entries:
        if entry is not None:
            entry.engine.dispose()


def _after_fork_in_child() -> None:
    """A forked child keeps the shared engines, each with a new empty pool: the parent's pooled
    connections are dropped without being closed (``dispose(close=False)``: closing from here
    would end the parent's sessions), and its first statement opens a connection of its own.
    What the engine learned stays (its dialect set up at its first connection, its compiled
    statements), so a child forked from the agent's zygote does not pay for them again. No
    lease of the parent's is held here."""
    global _shared_lock  # noqa: PLW0603 - a lock some parent thread held at the fork is never released here
    _shared_lock = threading.Lock()
    for entry in _shared.values():
        entry.engine.dispose(close=False)
        entry.leases = 0


os.register_at_fork(after_in_child=_after_fork_in_child)


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
    except DataError as exc:
        raise ValueRefused(f"the catalog refused a value: {_first_line(exc)}") from exc
    except DBAPIError as exc:
        if exc.connection_invalidated:
            raise CatalogUnavailable(f"catalog connection lost: {_first_line(exc)}") from exc
        raise
    except StatementError as exc:  # raised while a value was bound, before the database saw it
        if isinstance(exc.orig, (ValueError, TypeError, OverflowError)):
            raise ValueRefused(f"the catalog refused a value: {_first_line(exc)}") from exc
        raise
    except OverflowError as exc:  # the driver's own (sqlite3: an int past 64 bits), not wrapped
        raise ValueRefused(f"the catalog refused a value: {exc}") from exc


def _first_line(exc: StatementError) -> str:
    text = str(exc.orig) if exc.orig is not None else str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class CatalogPart:
    """What the parts ``db.catalog.Catalog`` is made of share: its engine and one transaction on it."""

    engine: Engine

    def _tx(self, write: bool = True) -> AbstractContextManager[Connection]:
        return transaction(self.engine, write=write)
