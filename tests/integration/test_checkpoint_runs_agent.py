"""One flow run per checkpoint, end to end: an agent on a real Prefect server promotes its node's
parts on their completed events with no run of their own, and the checkpoint gets exactly one
promote run, which makes it durable and shows every part's hop.

The agent's runner polls once an hour, so the one run is started by the agent itself (not the
runner's poll), and a run per part would show up as a second run.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from core import events
from deployments import names
from tasks.prefect_events import auth_headers, emit
from tests.kit.agents import finished, flow_runs, recorded_events, start_agents, train, wait_for

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

NODE = f"cr-{uuid.uuid4().hex[:6]}"
RUN = f"run-cr-{uuid.uuid4().hex[:4]}"


@pytest.fixture(scope="module")
def agents(prefect_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoint-runs")
    a = start_agents(prefect_server, root, (NODE,), catalog_url=f"sqlite:///{root / 'catalog.db'}", s3_url=None,
                     bucket=None, extra={"PREFECT_RUNNER_POLL_FREQUENCY": "3600"})
    yield a
    a.stop()


def _runs(agents, step: int) -> list[dict]:
    return [r for r in flow_runs(agents.api_url, deployment=names.promote_deployment(NODE))
            if r["parameters"].get("run") == RUN and str(r["parameters"].get("step")) == str(step)]


def _commit(agents, step: int, parts: int) -> None:
    """The parts of a checkpoint committed on the node's Tier 0 (two ranks of one node), not announced."""
    train(agents, f"""
        for p in range({parts}):
            with CheckpointStager("{RUN}", node="{NODE}", part=p, parts={parts}, shard_bytes=1 << 20,
                                  announce=False) as st:
                st.save({step}, tensors(seed=p))
    """)


def _audits(agents, step: int, action: str) -> int:
    cat = agents.catalog()
    try:
        return sum(e.action == action for e in cat.history(RUN, step))
    finally:
        cat.close()


def test_a_checkpoint_of_parts_is_one_promote_run_and_its_parts_none(agents):
    d = httpx.get(f"{agents.api_url}/deployments/name/{names.promote_deployment(NODE)}", timeout=10,
                  headers=auth_headers()).json()
    r = httpx.post(f"{agents.api_url}/automations/filter", json={}, timeout=10, headers=auth_headers())
    owned = [a for a in r.json() if d["id"] in str(a.get("actions"))]
    assert owned == []  # no trigger: an event is never a run of its own
    _commit(agents, 1, parts=2)

    for part in (0, 1, 0):  # the last one a duplicate (a retried send)
        assert emit(events.COMPLETED, RUN, 1, part=part, parts=2, node=NODE, api_url=agents.api_url)

    wait_for("the checkpoint's follow-ups done", lambda: _audits(agents, 1, "followups-done") == 1, timeout=120,
             agents=agents)
    runs = wait_for("its run finished", lambda: (rs := _runs(agents, 1)) and all(finished(r) for r in rs) and rs,
                    agents=agents)
    assert [r["state_type"] for r in runs] == ["COMPLETED"]  # one run for the checkpoint, none per part
    # its hop table: each part's hop to Tier 1, with its copy attempts, under the checkpoint's run
    r = httpx.post(f"{agents.api_url}/artifacts/filter", headers=auth_headers(), timeout=10,
                   json={"artifacts": {"flow_run_id": {"any_": [runs[0]["id"]]}, "type": {"any_": ["table"]}}})
    (table,) = r.json()
    rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
    assert sorted((h["part"], h["state"], h["attempts"]) for h in rows if h["hop"] == "tier 0 -> tier 1") == [
        (0, "verified", 1), (1, "verified", 1)]
    cat = agents.catalog()
    try:
        ck = cat.get_checkpoint(RUN, 1)
        assert sorted(r.part for r in cat.replicas(ck.id, tier=1) if r.state == "verified") == [0, 1]
    finally:
        cat.close()
    assert _audits(agents, 1, "complete") == 1
    durable = wait_for("the durable event stored", lambda: recorded_events(agents.api_url, events.DURABLE, RUN))
    assert len(durable) == 1
    # the parts' facts still reach the event feed, from the agent (no flow run is related to them)
    promoted = wait_for("the promoted events stored",
                        lambda: len(ev := recorded_events(agents.api_url, events.PROMOTED, RUN)) >= 2 and ev)
    assert sorted({e["payload"]["part"] for e in promoted}) == [0, 1]
    # each part in a process forked for it, not in the agent (whose memory stays as at rest)
    cat = agents.catalog()
    try:
        actors = {e.actor for e in cat.history(RUN, 1) if e.action == "complete"}
    finally:
        cat.close()
    (actor,) = actors
    assert actor.startswith(f"event agent:{NODE} pid:") and actor != f"event agent:{NODE} pid:{agents.procs[0].pid}"
    # what the operator reads in the agent's log (INFO, the default CKPT_LOG_LEVEL)
    log = agents.logs()
    for part in (0, 1):
        assert f"promoted {RUN!r} step 1 part {part} on {NODE} in pid" in log, log


def test_a_malformed_event_is_recorded_and_the_next_checkpoint_still_promoted(agents):
    bad = events.build_event(events.COMPLETED, RUN, 2, node=NODE)
    bad["payload"]["run"] = "../../etc"
    events.post_events(agents.api_url, [bad], headers=auth_headers())
    _commit(agents, 3, parts=1)
    assert emit(events.COMPLETED, RUN, 3, node=NODE, api_url=agents.api_url)

    wait_for("step 3 durable", lambda: _audits(agents, 3, "followups-done") == 1, timeout=120, agents=agents)
    cat = agents.catalog()
    try:
        rejected = [e for e in cat.audit_log(limit=1000) if e.action == "reject" and "etc" in (e.reason or "")]
    finally:
        cat.close()
    assert len(rejected) == 1 and "malformed checkpoint reference" in (rejected[0].reason or "")
    assert _runs(agents, 2) == []  # the malformed event is no run
    assert "rejected event: malformed checkpoint reference" in agents.logs()


def test_a_checkpoint_run_whose_process_died_is_recorded_crashed(agents):
    """What the agent does when a checkpoint run's process ends before the run (killed when it
    stalled, out of memory): the run is ``Crashed`` with the reason, not left running for ever."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Pending

    from deployments.processes import crash_checkpoint_run
    from flows.promote import followups_key

    with temporary_settings(updates={PREFECT_API_URL: agents.api_url}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(names.promote_deployment(NODE))
        flow_run = client.create_flow_run_from_deployment(
            deployment.id, parameters={"run": RUN, "step": 9, "node": NODE}, state=Pending(),
            idempotency_key=followups_key(RUN, 9))
        crash_checkpoint_run(NODE, RUN, 9, "", "its process exited with code -9")
        state = client.read_flow_run(flow_run.id).state
    assert state is not None and state.is_crashed() and state.message == "its process exited with code -9"
