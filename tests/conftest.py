"""Shared fixtures: real SQLite and PostgreSQL catalogs, a real moto S3 server over HTTP.

PostgreSQL: ``CKPT_TEST_PG_URL`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``).
Each test that asks for ``pg_url`` gets a fresh database created from it and dropped after.
With ``CI=true`` an unreachable PostgreSQL fails those tests instead of skipping them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

PG_URL = os.environ.get("CKPT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
    why = _pg_available()
    if why:
        if IN_CI:
            pytest.fail(f"PostgreSQL is required with CI=true but unreachable: {why}")
        pytest.skip(f"PostgreSQL unreachable: {why}")
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server on loopback, real HTTP, once per session."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_port(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


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


@pytest.fixture
def settings_factory(tmp_path: Path, monkeypatch):
    """Build ``Settings`` rooted in a temp folder (env cleared of CKPT_*)."""
    for k in list(os.environ):
        if k.startswith("CKPT_"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)

    def make(**overrides):
        from ckpt.settings import load_settings

        overrides.setdefault("data_dir", tmp_path / "data")
        overrides.setdefault("node", "node-0")
        return load_settings(**overrides)

    return make


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real Prefect server (SQLite) started once per session on a free loopback port.

    Yields the API URL and points this process's Prefect client at it. Starting takes
    20-30 s here, so tests that need it are few; logic is tested through plain functions.
    """
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect")
    port = free_port()
    env = dict(os.environ)
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"Prefect server did not start; see {home / 'server.log'}")
        time.sleep(0.5)
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
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
