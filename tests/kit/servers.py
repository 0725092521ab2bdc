"""The servers the integration tests run against, as fixtures: PostgreSQL (``pg_server``,
``pg_url``), both catalog backends (``db_url``; ``sqlite_url`` for SQLite only), moto's S3 server
(``s3_endpoint``, ``s3_bucket``), LocalStack's S3, which checks the checksums it is sent
(``localstack_endpoint``; ``each_s3_endpoint``: a module's ``s3_endpoint`` on moto and then on
LocalStack), a real Prefect server (``prefect_server``, SQLite) and Prefect
in its production shape (``production_server``: API server and services processes on
PostgreSQL + Redis); and fake AWS credentials for every test (``_aws_env``).

PostgreSQL: ``CKPT_TEST_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``).
Each test that asks for ``pg_url`` gets a fresh database created from it and dropped after.
With ``CI=true`` an unreachable PostgreSQL fails those tests instead of skipping them.

LocalStack runs in host mode (no Docker) from a virtual environment of its own on Python 3.13,
which ``make localstack`` builds beside ``.venv`` (``.venv-localstack``); ``CKPT_LOCALSTACK_PYTHON``
names another interpreter. Without one its tests (marker ``validating_s3``) skip, and with
``CI=true`` they fail instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.kit.require import require

PG_URL = os.environ.get("CKPT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("CKPT_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def _pg_admin_dsn() -> str:
    return PG_URL.replace("postgresql+psycopg://", "postgresql://")


def _pg_available() -> str | None:
    try:
        import psycopg

        with psycopg.connect(_pg_admin_dsn(), connect_timeout=3, autocommit=True):
            return None
    except Exception as exc:  # pragma: no cover - depends on the machine
        return str(exc)


@pytest.fixture(scope="session")
def pg_server() -> str:
    require(_pg_available(), "PostgreSQL")
    return PG_URL


@pytest.fixture
def pg_url(pg_server: str):
    """A fresh, empty PostgreSQL database for one test."""
    import psycopg

    name = f"ckpt_t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_pg_admin_dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = pg_server.rsplit("/", 1)[0]
    yield f"{base}/{name}"
    with psycopg.connect(_pg_admin_dsn(), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'catalog.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request, tmp_path: Path) -> str:
    """Both catalog backends: every catalog test that takes this runs on SQLite and PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'catalog.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    """moto's S3 server on loopback, real HTTP, once per session (as ``ckpt up`` starts it)."""
    from ckpt.local_stack import start_moto
    from ckpt.processes import stop_process

    proc, url = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield url
    finally:
        stop_process(proc, grace=5.0)


@pytest.fixture(scope="session")
def s3_endpoint(moto_endpoint):
    """The S3 endpoint of a test: moto's (a module that imports ``each_s3_endpoint`` gets both)."""
    return moto_endpoint


def localstack_python() -> Path:
    """The interpreter of LocalStack's own virtual environment (see the module's docstring)."""
    named = os.environ.get("CKPT_LOCALSTACK_PYTHON")
    return Path(named) if named else Path(sys.prefix).parent / ".venv-localstack" / "bin" / "python"


def start_localstack(home: Path, *, timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """LocalStack's S3 alone, host mode, on a free loopback port; returns (process, endpoint URL)."""
    from ckpt.processes import LOOPBACK, free_port, spawn, stop_process, wait_http

    python = localstack_python()
    if not python.exists():
        require(f"its Python {python} does not exist (make localstack builds it)", "LocalStack's S3")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(SERVICES="s3", GATEWAY_LISTEN=f"{LOOPBACK}:{port}", SKIP_INFRA_DOWNLOADS="1",
               LOCALSTACK_VOLUME_DIR=str(home / "volume"), FILESYSTEM_ROOT=str(home / "fs"),
               TMPDIR=str(home), DISABLE_EVENTS="1", DNS_ADDRESS="0", LS_LOG="warn")
    proc = spawn([str(python), "-m", "localstack.runtime.main"], home / "localstack.log", env, cwd=home)
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_http(f"{url}/_localstack/health", timeout=timeout, proc=proc, what="LocalStack S3")
    except BaseException:
        stop_process(proc, grace=5.0)
        raise
    return proc, url


@pytest.fixture(scope="session")
def localstack_endpoint(tmp_path_factory):
    """LocalStack's S3 on loopback, once per session: an S3 that answers 400 BadDigest to a
    wrong CRC32C or Content-MD5 (PutObject, UploadPart, CompleteMultipartUpload), and enforces
    Object Lock and If-None-Match."""
    from ckpt.processes import stop_process

    proc, url = start_localstack(tmp_path_factory.mktemp("localstack"))
    try:
        yield url
    finally:
        stop_process(proc, grace=10.0)


@pytest.fixture(name="s3_endpoint", scope="module",
                params=["moto", pytest.param("localstack", marks=pytest.mark.validating_s3)])
def each_s3_endpoint(request):
    """``s3_endpoint`` for a whole module on moto (stores the checksums it is sent) and then on
    LocalStack (checks them): ``from tests.kit.servers import each_s3_endpoint`` in the module."""
    return request.getfixturevalue(f"{request.param}_endpoint")


@pytest.fixture(autouse=True)
def _aws_env(monkeypatch):
    """Fake credentials so boto3 never looks for real ones."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the moto server; returns its name."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real Prefect server (SQLite) started once per session on a free loopback port.

    Yields the API URL and points this process's Prefect client at it. Starting takes
    20-30 s here, so tests that need it are few; logic is tested through plain functions.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ckpt.local_stack import start_prefect_server
    from ckpt.processes import stop_process

    proc, url = start_prefect_server(tmp_path_factory.mktemp("prefect"), port=None, ui=False, timeout=90)
    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    try:
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old
        stop_process(proc, grace=20.0)


def _redis_available() -> str | None:
    try:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3).ping()
        return None
    except Exception as exc:  # pragma: no cover - depends on the machine
        return str(exc)


def _drop_orphaned_prefect_databases(server: str) -> None:
    """Databases ``ckpt_prefect_<pid>_*`` of test sessions that died without cleaning up."""
    import psycopg

    from ckpt.production_stack import drop_database
    from core.space import process_alive

    with psycopg.connect(_pg_admin_dsn(), autocommit=True) as conn:
        names = [r[0] for r in conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'ckpt_prefect_%'")]
    for name in names:
        pid = name.split("_")[2]
        if pid.isdigit() and not process_alive(int(pid)):
            drop_database(server, name)


@pytest.fixture(scope="session")
def production_server(pg_server, tmp_path_factory):
    """Prefect as in production, once per session: ``prefect server start --no-services`` and
    ``prefect server services start`` on a fresh PostgreSQL database and a Redis database of
    their own (claimed, flushed and given back at the end). Yields the ``ProductionStack``
    (``api_url``, ``start_seconds``); the database is dropped and the processes stopped even
    when a test fails. This process's Prefect client is left pointing where it was."""
    from ckpt.production_stack import ProductionStack

    require(_redis_available(), "Redis")
    server = pg_server.replace("postgresql+psycopg://", "postgresql://")
    _drop_orphaned_prefect_databases(server)
    stack = ProductionStack(tmp_path_factory.mktemp("prefect-prod"), pg_server_url=server, redis_url=REDIS_URL,
                            prefect_database=f"ckpt_prefect_{os.getpid()}_{uuid.uuid4().hex[:8]}",
                            catalog_database=None, port=None, ui=False, fresh=True, timeout=180)
    with stack:
        yield stack
