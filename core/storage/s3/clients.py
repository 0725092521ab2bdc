"""The boto3 S3 clients a process shares (one per configuration and AWS environment)."""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

# Clients shared per process: building one costs noticeable CPU (botocore loads and resolves
# its service model), and every pipeline step opens its own store. boto3 clients are
# thread-safe; sessions are not, so a client is made under the lock. The key holds a digest of
# the AWS_* environment (where credentials, profiles and their files are named) so that
# different credentials never share a client and never appear in a key's repr.
_clients: dict[tuple[str | None, str, int, int, str], Any] = {}
_clients_lock = threading.Lock()


def new_client(endpoint_url: str | None, region: str, max_attempts: int, pool_connections: int) -> Any:
    """A boto3 S3 client of its own, configured as every store's is."""
    import boto3
    from botocore.config import Config

    cfg = Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        connect_timeout=10,
        read_timeout=120,
        max_pool_connections=pool_connections,
        tcp_keepalive=True,
        # We send the manifest's CRC32C ourselves; don't let botocore hash bodies again.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=cfg)


def shared_client(endpoint_url: str | None, region: str, max_attempts: int, pool_connections: int) -> Any:
    """This process's client for the configuration and the AWS environment in force now."""
    key = (endpoint_url, region, max_attempts, pool_connections, _aws_environment_digest())
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = new_client(endpoint_url, region, max_attempts, pool_connections)
        return client


def forget_clients() -> None:
    """The next store makes a new client (tests, benchmarks); stores holding one keep it."""
    with _clients_lock:
        _clients.clear()


def _aws_environment_digest() -> str:
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))
    return hashlib.sha256(repr(env).encode()).hexdigest()


def _after_fork_in_child() -> None:
    """A forked child makes its own clients: a parent's pooled connections are the parent's."""
    global _clients_lock  # noqa: PLW0603 - a lock some parent thread held at the fork is never released here
    _clients_lock = threading.Lock()
    _clients.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
