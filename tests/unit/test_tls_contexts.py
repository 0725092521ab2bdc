"""The agent's Prefect clients share one verified TLS context per CA file (deployments/tls.py):
Prefect builds one per client otherwise (~15 ms of CPU each, about seven per promote run).
Real Prefect clients against an https URL (nothing is connected)."""

from __future__ import annotations

import importlib
import os
import ssl
from pathlib import Path

import certifi
import pytest
from prefect.client.orchestration import PrefectClient, SyncPrefectClient

from deployments.tls import PREFECT_MODULES, SharedVerifiedContexts, share_verified_contexts

URL = "https://prefect.example.invalid/api"


@pytest.fixture
def shared():
    modules = [importlib.import_module(m) for m in PREFECT_MODULES]
    assert all(m.ssl is ssl for m in modules)  # Prefect as it comes
    try:
        assert share_verified_contexts()
        yield modules
    finally:
        for m in modules:
            m.ssl = ssl


def context(client) -> ssl.SSLContext:
    return client._client._transport._pool._ssl_context


def test_prefect_clients_share_one_verified_context(shared):
    a, b, c = PrefectClient(URL), PrefectClient(URL), SyncPrefectClient(URL)
    assert context(a) is context(b) is context(c)
    assert context(a).verify_mode == ssl.CERT_REQUIRED and context(a).check_hostname
    assert share_verified_contexts() and context(PrefectClient(URL)) is context(a)  # idempotent


def test_without_it_each_client_builds_its_own():
    assert context(PrefectClient(URL)) is not context(PrefectClient(URL))


def test_only_prefect_s_modules_change_and_an_unverified_context_is_never_shared(shared):
    assert ssl.create_default_context(cafile=certifi.where()) is not ssl.create_default_context(cafile=certifi.where())
    proxy = shared[0].ssl
    assert isinstance(proxy, SharedVerifiedContexts) and proxy.SSLContext is ssl.SSLContext
    # Prefect's PREFECT_API_TLS_INSECURE_SKIP_VERIFY form: no CA file, then verification turned off on it
    assert proxy.create_default_context() is not proxy.create_default_context()


def test_a_replaced_ca_file_gets_a_new_context(shared, tmp_path):
    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(Path(certifi.where()).read_bytes())
    proxy = shared[0].ssl
    first = proxy.create_default_context(cafile=str(bundle))
    assert proxy.create_default_context(cafile=str(bundle)) is first
    st = bundle.stat()
    os.utime(bundle, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert proxy.create_default_context(cafile=str(bundle)) is not first
    with pytest.raises((OSError, ssl.SSLError)):
        proxy.create_default_context(cafile=str(tmp_path / "missing.pem"))


PREBUILD_PROBE = r"""
import json, os, sys
from deployments import fast_path
from deployments.tls import share_verified_contexts
import prefect.client.orchestration as orchestration
from prefect.client.schemas.responses import DeploymentResponse
from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY

share_verified_contexts()
before = DeploymentResponse.__pydantic_complete__
fast_path._prebuild()
built = fast_path.run_settings()
same = fast_path.run_settings() is built
os.environ["PREFECT_SERVER_EPHEMERAL_ENABLED"] = str(built.server.ephemeral.enabled)  # Prefect's own, same value
same = same and fast_path.run_settings() is built
os.environ["PREFECT_LOGGING_LEVEL"] = "DEBUG"  # the environment changed after the fork: built anew
fresh = fast_path.run_settings()
print(json.dumps({"models": [before, DeploymentResponse.__pydantic_complete__], "same": same,
                  "fresh": fresh is not built and fresh.logging.level == "DEBUG",
                  "heartbeat": [built.flows.heartbeat_frequency, fresh.flows.heartbeat_frequency],
                  "contexts": len(orchestration.ssl._made)}))
"""


def test_the_agent_builds_before_the_fork_what_each_warm_process_built_again():
    """deployments.fast_path._prebuild: a run's Prefect settings (heartbeats off), Prefect's
    deferred models and the shared TLS context, built once in the agent; a warm process whose
    environment changed since builds its own settings. In a fresh interpreter (module state)."""
    import json
    import subprocess
    import sys

    set_by_the_probe = ("PREFECT_LOGGING_LEVEL", "PREFECT_SERVER_EPHEMERAL_ENABLED")
    env = {k: v for k, v in os.environ.items() if k not in set_by_the_probe}
    out = subprocess.run([sys.executable, "-c", PREBUILD_PROBE], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["models"] == [False, True]  # pydantic defers it to first use: each warm process paid for it
    assert got["same"] and got["fresh"] and got["heartbeat"] == [None, None]
    assert got["contexts"] == 1
