"""The local Prefect server's environment: its UI calls its own API whatever the port."""

import os
from pathlib import Path

import pytest

from ckpt.local_stack import server_env

API = "http://127.0.0.1:4301/api"


@pytest.mark.parametrize("inherited", [{}, {"PREFECT_API_URL": "http://elsewhere:4200/api",
                                            "PREFECT_UI_API_URL": "http://elsewhere:4200/api",
                                            "PREFECT_UI_URL": "http://elsewhere:4200"}])
def test_prefect_resolves_the_ui_api_url_to_this_server(monkeypatch, tmp_path, inherited):
    from prefect.settings.models.root import Settings

    env = server_env({"PATH": "/bin", **inherited}, home=tmp_path, api_url=API, ui=True)
    assert "PREFECT_API_URL" not in env and env["PATH"] == "/bin"
    for k in [k for k in os.environ if k.startswith("PREFECT_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()  # what `prefect server start` reads, and serves to the UI at /ui-settings
    assert s.server.ui.api_url == API
    assert s.ui_url == "http://127.0.0.1:4301"
    assert Path(s.home) == tmp_path


def test_a_deployment_counts_as_served_once_polled_since_its_registration():
    """``wait_deployments``' test: the server records polls late when busy and marks a deployment
    NOT_READY a minute after the last one it recorded, so a served node's deployment can read
    NOT_READY (a 64-agent burst waited on one for minutes); a poll from before the agent
    registered it (an earlier session's agent of that node) is not this agent's."""
    from ckpt.local_stack import served

    registered = "2026-12-06T07:24:00.000000Z"
    assert served({"paused": False, "status": "READY", "updated": registered, "last_polled": None})
    assert served({"paused": False, "status": "NOT_READY", "updated": registered,
                   "last_polled": "2026-12-06T07:24:13.186988Z"})
    assert not served({"paused": False, "status": "NOT_READY", "updated": registered,
                       "last_polled": "2026-12-06T07:10:02.000000Z"})
    assert not served({"paused": False, "status": "NOT_READY", "updated": registered, "last_polled": None})
    assert not served({"paused": True, "status": "READY", "updated": registered,
                       "last_polled": "2026-12-06T07:24:13.186988Z"})
