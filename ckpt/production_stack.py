"""Prefect in its production shape, the way Prefect's docs scale it: the API server started
with ``--no-services``, the background services (``prefect server services start``) as a
process of their own, PostgreSQL as the server's database and Redis as its messaging broker,
event cache, causal ordering, concurrency lease storage, worker cleanup queue and Docket.

What ``ckpt up --production``, the multi-node tests and ``benchmarks/burst.py`` run. The code
that starts the stack also creates its PostgreSQL databases (never drops one it did not
create fresh) and claims a Redis database of its own: Prefect's Redis keys have fixed names,
so two stacks on one Redis must not share a database number.

Turning on the API's auth is one more pair of variables in the server's and the clients'
environment (``PREFECT_SERVER_API_AUTH_STRING`` / ``PREFECT_API_AUTH_STRING``):
``ProductionStack.server_env_extra`` is where it goes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Self
from urllib.parse import urlsplit, urlunsplit

from ckpt.processes import LOOPBACK, Started, free_port, spawn, stop_process, wait_http
from core.errors import ConfigError
from core.space import process_alive

if TYPE_CHECKING:
    import redis

DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
PREFECT_DATABASE = "prefect"
CATALOG_DATABASE = "ckpt_catalog"
REDIS_OWNER_KEY = "ckpt:stack-owner"  # which process holds a Redis database number
REDIS_DATABASES = range(1, 16)        # Redis' default 16 databases; 0 is left to whoever uses Redis plainly


# --- PostgreSQL ------------------------------------------------------------------------------
def pg_url(server_url: str, database: str, driver: str = "") -> str:
    """``server_url`` (any database on the server) pointed at ``database``, with a SQLAlchemy
    ``driver`` (``asyncpg`` for Prefect, ``psycopg`` for the catalog) or none (libpq DSN)."""
    parts = urlsplit(server_url)
    scheme = "postgresql" + (f"+{driver}" if driver else "")
    return urlunsplit((scheme, parts.netloc, f"/{database}", parts.query, ""))


def create_database(server_url: str, database: str) -> bool:
    """Create ``database`` unless it exists; True when this call created it."""
    import psycopg

    with psycopg.connect(pg_url(server_url, "postgres"), autocommit=True, connect_timeout=5) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
            return False
        conn.execute(f'CREATE DATABASE "{database}"')
        return True


def drop_database(server_url: str, database: str) -> None:
    """Drop ``database`` after ending its sessions (for databases created fresh, e.g. in tests)."""
    import psycopg

    if database in ("postgres", "template0", "template1"):
        raise ConfigError(f"refusing to drop {database}")
    with psycopg.connect(pg_url(server_url, "postgres"), autocommit=True, connect_timeout=5) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))
        conn.execute(f'DROP DATABASE IF EXISTS "{database}"')


# --- Redis -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RedisDb:
    host: str
    port: int
    db: int
    password: str = ""

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/{self.db}"

    def client(self) -> redis.Redis:
        import redis

        return redis.Redis(host=self.host, port=self.port, db=self.db, password=self.password or None,
                           socket_connect_timeout=5)


def claim_redis_db(url: str, owner: int | None = None) -> RedisDb:
    """The Redis database this stack uses. ``redis://host:port/N`` asks for N; without a number
    the first of 1-15 that no live process holds. The claim is a key naming the owner's pid;
    a database whose owner died is taken over (and flushed: its keys are a dead stack's)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"expected a redis:// URL, got {url!r}")
    owner = owner or os.getpid()
    path = parts.path.strip("/")
    candidates = [int(path)] if path else list(REDIS_DATABASES)
    for n in candidates:
        db = RedisDb(parts.hostname or LOOPBACK, parts.port or 6379, n, parts.password or "")
        r = db.client()
        try:
            if r.set(REDIS_OWNER_KEY, owner, nx=True):
                if r.dbsize() > 1 and not path:  # keys without an owner: somebody else's, leave them
                    r.delete(REDIS_OWNER_KEY)
                    continue
                return db
            held = int(r.get(REDIS_OWNER_KEY) or 0)
            if held == owner:
                return db
            if held <= 0 or not process_alive(held):
                r.flushdb()
                r.set(REDIS_OWNER_KEY, owner)
                return db
        finally:
            r.close()
    raise ConfigError(f"no free Redis database at {url}: " + (
        f"database {path} is held by a live process" if path else "1-15 are all held by live ckpt stacks"))


def release_redis_db(db: RedisDb) -> None:
    """Give the database back, empty: what Prefect keeps there (event streams, leases, Docket's
    queues) belongs to the processes that just stopped; PostgreSQL holds what lasts."""
    r = db.client()
    try:
        r.flushdb()
    finally:
        r.close()


# --- the server's settings -------------------------------------------------------------------
def server_env(database_url: str, redis: RedisDb) -> dict[str, str]:
    """The PREFECT_* settings of every server process (API and services): PostgreSQL, and Redis
    for everything Prefect otherwise keeps in one process's memory (what its multi-worker mode
    checks for: broker, cache, causal ordering, lease storage; plus Docket and the cleanup queue)."""
    env = {
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
        "PREFECT_MESSAGING_BROKER": "prefect_redis.messaging",
        "PREFECT_MESSAGING_CACHE": "prefect_redis.messaging",
        "PREFECT_SERVER_EVENTS_CAUSAL_ORDERING": "prefect_redis.ordering",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect_redis.lease_storage",
        "PREFECT_SERVER_WORKER_CHANNEL_CLEANUP_QUEUE_STORAGE": "prefect_redis.cleanup_queue",
        "PREFECT_SERVER_DOCKET_URL": redis.url,
        "PREFECT_REDIS_MESSAGING_HOST": redis.host,
        "PREFECT_REDIS_MESSAGING_PORT": str(redis.port),
        "PREFECT_REDIS_MESSAGING_DB": str(redis.db),
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_HOST": redis.host,
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_PORT": str(redis.port),
        "PREFECT_REDIS_WORKER_CLEANUP_QUEUE_DB": str(redis.db),
        # one migration before the processes start, not one per process racing the others
        "PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false",
        # Prefect's default pool (5 + 10 overflow, 30 s wait) answered 500 (QueuePool limit
        # reached) to a 64-part burst in benchmarks/burst.py: runs crashed before they started
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": "15",
        "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_TIMEOUT": "60",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    if redis.password:
        env["PREFECT_REDIS_MESSAGING_PASSWORD"] = redis.password
        env["PREFECT_REDIS_WORKER_CLEANUP_QUEUE_PASSWORD"] = redis.password
    return env


EVENT_CONSUMERS = {"reactive-triggers", "event-persister"}  # Prefect services reading the `events` stream


def _groups(r: redis.Redis, stream: str) -> set[str]:
    import redis

    try:
        return {g["name"].decode() if isinstance(g["name"], bytes) else g["name"] for g in r.xinfo_groups(stream)}
    except redis.ResponseError:  # no such stream yet
        return set()


@dataclass
class ProductionStack(Started):
    """Prefect's API server (``--no-services``, ``workers`` uvicorn workers) and its services
    process on PostgreSQL + Redis, under ``home``. A context manager. The databases are created
    when missing; ``fresh`` (tests, benchmarks: give unique names) drops the ones it created when
    stopped. Redis is flushed and given back either way.
    The catalog database (``catalog_url``) is created beside it, the same way."""

    home: Path
    pg_server_url: str = DEFAULT_PG_URL
    redis_url: str = DEFAULT_REDIS_URL
    prefect_database: str = PREFECT_DATABASE
    catalog_database: str | None = CATALOG_DATABASE
    port: int | None = 4200
    port_required: bool = False  # on `port` or not at all (ckpt up --port P)
    ui: bool = True
    workers: int = 1
    fresh: bool = False
    timeout: float = 120.0
    # more PREFECT_* settings for the server processes, e.g. PREFECT_SERVER_API_AUTH_STRING
    server_env_extra: dict[str, str] = field(default_factory=dict)
    api_url: str = ""
    redis: RedisDb | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    start_seconds: float = 0.0

    @property
    def catalog_url(self) -> str | None:
        return pg_url(self.pg_server_url, self.catalog_database, "psycopg") if self.catalog_database else None

    @property
    def services(self) -> subprocess.Popen:
        return self.procs[-1]

    def describe(self) -> str:
        """Where the server's state lives, without credentials."""
        pg = urlsplit(self.pg_server_url)
        where = f"PostgreSQL {pg.hostname}:{pg.port or 5432}/{self.prefect_database}"
        if self.redis is not None:
            where += f", Redis {self.redis.host}:{self.redis.port}/{self.redis.db}"
        return where + f", API workers {self.workers}, services in their own process"

    def env(self) -> dict[str, str]:
        if self.redis is None:
            raise ConfigError("the stack is not started")
        env = dict(os.environ)
        env.pop("PREFECT_API_URL", None)
        env.update(PREFECT_HOME=str(self.home), PREFECT_LOGGING_LEVEL="WARNING",
                   PREFECT_UI_ENABLED="true" if self.ui else "false")
        env.update(server_env(pg_url(self.pg_server_url, self.prefect_database, "asyncpg"), self.redis))
        env.update(self.server_env_extra)
        return env

    def start(self) -> Self:
        t0 = time.monotonic()
        self.home = self.home.absolute()
        self.home.mkdir(parents=True, exist_ok=True)
        for db in (self.prefect_database, self.catalog_database):
            if db and create_database(self.pg_server_url, db):
                self.created.append(db)
        self.redis = claim_redis_db(self.redis_url)
        env = self.env()
        upgrade = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                                 env=env, capture_output=True, text=True, timeout=self.timeout, check=False)
        if upgrade.returncode:
            raise ConfigError(f"Prefect database upgrade failed: {upgrade.stdout[-1500:]}{upgrade.stderr[-1500:]}")
        port = free_port(self.port, required=self.port_required)
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--no-services",
               "--host", LOOPBACK, "--port", str(port)]
        if self.workers > 1:
            cmd += ["--workers", str(self.workers)]
        self.api_url = f"http://{LOOPBACK}:{port}/api"
        # the UI asks /ui-settings where its API is: this port's, not the default 4200 (local_stack.server_env)
        self.procs.append(spawn(cmd, self.home / "server.log", {
            **env, "PREFECT_SERVER_UI_API_URL": self.api_url, "PREFECT_UI_URL": self.api_url.removesuffix("/api")}))
        wait_http(f"{self.api_url}/health", timeout=self.timeout, proc=self.procs[0], what="Prefect API server")
        self.procs.append(spawn([sys.executable, "-m", "prefect", "server", "services", "start"],
                                 self.home / "services.log", env))
        self._wait_services()
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_services(self) -> None:
        """Until the services process has joined the event stream (the consumer groups of the
        triggers and the event persister exist): from then on an event starts a deployment."""
        if self.redis is None:
            raise ConfigError("the stack is not started")
        deadline = time.monotonic() + self.timeout
        r = self.redis.client()
        try:
            while not _groups(r, "events") >= EVENT_CONSUMERS:
                if self.services.poll() is not None:
                    log = (self.home / "services.log").read_text(errors="replace")[-2000:]
                    raise ConfigError(f"Prefect services exited with {self.services.returncode}: {log}")
                if time.monotonic() > deadline:
                    raise ConfigError(f"Prefect services not consuming events after {self.timeout:.0f}s")
                time.sleep(0.3)
        finally:
            r.close()

    def stop(self) -> None:
        """Stop the processes, give Redis back and drop what ``fresh`` created; each step runs
        even when an earlier one failed."""
        try:
            for p in reversed(self.procs):
                try:
                    stop_process(p, grace=20.0)
                except Exception:  # noqa: BLE001 - a stuck server must not keep its database alive
                    p.kill()
        finally:
            self.procs.clear()
            try:
                if self.redis is not None:
                    release_redis_db(self.redis)
            finally:
                self.redis = None
                if self.fresh:
                    for db in self.created:
                        drop_database(self.pg_server_url, db)
                self.created.clear()
