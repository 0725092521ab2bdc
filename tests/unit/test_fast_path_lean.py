"""What a promote run in a warm process leaves out with ``CKPT_PREFECT_REUSE`` (on by default):
Prefect's per-run round trips that a promote run never needs — the server's API version check
per client, the CSRF token request per client where the server has CSRF off, the server's
default result storage, and the suspension watch (its own client and events websocket, waited
for before the run starts). Each is a Prefect hook or setting this project relies on, so each
test fails when Prefect no longer has it (the end-to-end runs: tests/integration/test_fast_path.py,
the requests and CPU per promotion: benchmarks/agent_cpu.py).
"""

from __future__ import annotations

import http.server
import threading
from contextlib import contextmanager

import pytest

from deployments import fast_path


def test_lean_settings_skip_the_version_check_and_the_heartbeats():
    lean = fast_path.run_settings(lean=True)
    assert lean.client.server_version_check_enabled is False
    assert lean.flows.heartbeat_frequency is None
    plain = fast_path.run_settings(lean=False)  # CKPT_PREFECT_REUSE=false: as Prefect does it
    assert plain.client.server_version_check_enabled is True
    assert plain.flows.heartbeat_frequency is None


def test_the_lean_flow_never_asks_the_server_for_its_result_storage(monkeypatch):
    import prefect.results as results
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.promote import promote_checkpoint

    asked: list[str] = []

    def server_default():
        asked.append("GET /admin/storage")
        raise AssertionError("asked the server for its default result storage")

    monkeypatch.setattr(results, "_get_default_result_storage", server_default)
    lean = fast_path.lean_promote_flow()
    assert lean.name == promote_checkpoint.name and lean.fn is promote_checkpoint.fn
    assert lean.persist_result is False
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing listens: no request may go
        store = results.ResultStore().update_for_flow(lean)  # what the engine builds at each run
        assert store.result_storage is not None and asked == []
        with pytest.raises(AssertionError):  # the flow as declared asks, at every run
            results.ResultStore().update_for_flow(promote_checkpoint)
    assert asked == ["GET /admin/storage"]


def test_the_suspension_watch_is_replaced_in_prefects_engine(monkeypatch):
    import prefect.flow_engine as engine

    assert callable(getattr(engine, "observe_flow_run_suspension", None)), "Prefect's engine lost the hook"
    monkeypatch.setattr(engine, "observe_flow_run_suspension", engine.observe_flow_run_suspension)  # restored after
    assert fast_path.skip_suspension_watch() is True
    threads = threading.active_count()
    with engine.observe_flow_run_suspension(object(), object()):  # Prefect's starts a thread, a client, a websocket
        assert threading.active_count() == threads


@contextmanager
def answering(status: int, body: str):
    """A local HTTP server whose every GET answers ``status`` with ``body``; yields its API URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/api"
    finally:
        server.shutdown()
        server.server_close()


def test_csrf_is_left_out_only_where_the_server_says_it_is_off():
    with answering(422, '{"detail": "CSRF protection is disabled."}') as api:  # Prefect's answer, CSRF off
        assert fast_path.csrf_off_env(api) == {"PREFECT_CLIENT_CSRF_SUPPORT_ENABLED": "false"}
    with answering(200, '{"token": "t", "client": "c", "expiration": "2030-01-01T00:00:00Z"}') as api:  # CSRF on
        assert fast_path.csrf_off_env(api) == {}
    with answering(500, "boom") as api:
        assert fast_path.csrf_off_env(api) == {}
    with answering(200, "") as api:
        url = api
    assert fast_path.csrf_off_env(url) == {}  # nobody answers: Prefect's default kept
    assert fast_path.csrf_off_env(None) == {}
