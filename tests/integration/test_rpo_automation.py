"""The RPO automation on the session's real Prefect server: a checkpoint whose durable event
never comes (its node's agent is stopped: nothing promotes it) raises ``ckpt.checkpoint.late``
once the RPO has passed; one made durable in time does not; creating the automation twice
leaves one. The proactive evaluation runs on the server's own cadence (5 s): poll, generously."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from core import events

pytestmark = pytest.mark.prefect
RPO = 10  # Prefect's minimum for a proactive trigger


def _events(api: str, name: str, run: str, since: datetime) -> list[dict]:
    body = {"filter": {"event": {"name": [name]}, "resource": {"labels": {"ckpt.run": [run]}},
                       "occurred": {"since": since.isoformat(), "until": (since + timedelta(hours=1)).isoformat()}},
            "limit": 50}
    resp = httpx.post(f"{api}/events/filter", json=body, timeout=10)
    resp.raise_for_status()
    return [e for e in resp.json().get("events", []) if e["resource"].get("ckpt.run") == run]


def _wait_for(api: str, name: str, run: str, since: datetime, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = _events(api, name, run, since)
        if got or time.monotonic() > deadline:
            return got
        time.sleep(1.0)


def test_rpo_automation_fires_for_a_late_checkpoint_only(prefect_server):
    from prefect import get_client

    from deployments.automations import AUTOMATION_NAME, ensure_rpo_automation

    first = ensure_rpo_automation(RPO, prefect_server)
    assert ensure_rpo_automation(RPO, prefect_server) == first  # same name: updated, not duplicated
    with get_client(sync_client=True) as client:
        assert [a.id for a in client.read_automations_by_name(AUTOMATION_NAME)] == [first]
    time.sleep(2)  # the server's trigger service reloads automations on change

    since = datetime.now(UTC) - timedelta(seconds=5)
    late_run, ok_run = f"late-{uuid.uuid4().hex[:8]}", f"ok-{uuid.uuid4().hex[:8]}"
    # two parts of a checkpoint on a node whose agent is stopped: completed, never durable
    events.post_events(prefect_server, [events.build_event(events.COMPLETED, late_run, 7, part=p, parts=2,
                                                           node="node-stopped") for p in (0, 1)])
    # a checkpoint made durable in time
    events.post_events(prefect_server, [events.build_event(events.COMPLETED, ok_run, 7, node="node-up")])
    events.post_events(prefect_server, [events.build_event(events.DURABLE, ok_run, 7, node="node-up")])

    late = _wait_for(prefect_server, events.LATE, late_run, since, timeout=RPO + 60)
    assert len(late) == 1, late  # one window per checkpoint, not per part
    ev = late[0]
    assert ev["resource"]["prefect.resource.id"] == f"ckpt.checkpoint.{late_run}.7"
    assert ev["resource"]["ckpt.node"] == "node-stopped"
    assert ev["payload"]["rpo_seconds"] == RPO and ev["payload"]["step"] == 7
    assert any(r["prefect.resource.id"] == f"prefect.automation.{first}" for r in ev["related"])
    # the late one fired, so the durable one's window (opened earlier) has been evaluated too
    time.sleep(6)  # one more proactive evaluation
    assert _events(prefect_server, events.LATE, ok_run, since) == []


CLUSTER_START = """
import json, pickle, sys
from deployments.agent import set_up_cluster
from deployments.processes import agent_logging
agent_logging("INFO")
set_up_cluster(pickle.load(sys.stdin.buffer))
print(json.dumps({"automations_module": "deployments.automations" in sys.modules}))
"""


def test_the_cluster_agent_creates_the_automation_in_a_child(prefect_server, settings_factory):
    """The cluster agent's start creates the RPO automation from a child of its zygote, and says
    so: the agent itself never builds the client calls that create it."""
    import json
    import pickle
    import subprocess
    import sys

    from prefect import get_client

    from deployments.automations import AUTOMATION_NAME

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(AUTOMATION_NAME):
            client.delete_automation(old.id)
    settings = settings_factory(rpo_seconds=RPO + 1, prefect_api_url=prefect_server)
    done = subprocess.run([sys.executable, "-c", CLUSTER_START], input=pickle.dumps(settings),
                          capture_output=True, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 0, err[-2000:]
    assert not json.loads(done.stdout.decode().splitlines()[-1])["automations_module"]
    assert f"INFO    | ckpt.agent - RPO automation {AUTOMATION_NAME}" in err, err[-2000:]
    with get_client(sync_client=True) as client:
        made = client.read_automations_by_name(AUTOMATION_NAME)
    assert len(made) == 1
    assert made[0].trigger.within == timedelta(seconds=RPO + 1)
