"""Events end to end: a training process announces, the served agent promotes (each part with
no run, one promote run per checkpoint), the catalog shows it. Real Prefect server (session),
real agent process, moto's S3 server over HTTP.

Latency figures (emit -> flow start, emit -> verified on Tier 1) are printed; run with -s.
"""

from __future__ import annotations

import signal
import time
import uuid

import httpx
import pytest

from core import events
from deployments import names
from tasks.prefect_events import emit
from tests.kit.agents import (
    Agents,
    finished,
    flow_runs,
    start_agents,
    tier_files,
    train,
    ts,
    wait_for,
)

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

NODE = f"ev-{uuid.uuid4().hex[:6]}"
RECONCILE_SECONDS = 20  # not the default, so the interval is seen to come from the settings


@pytest.fixture(scope="module")
def agents(prefect_server, s3_endpoint, tmp_path_factory):
    import boto3

    root = tmp_path_factory.mktemp("events")
    bucket = f"ev-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    a = start_agents(prefect_server, root, (NODE,), catalog_url=f"sqlite:///{root / 'catalog.db'}",
                     s3_url=s3_endpoint, bucket=bucket,
                     extra={"CKPT_RECONCILE_INTERVAL_SECONDS": str(RECONCILE_SECONDS)})
    yield a
    a.stop()


def _promotions(agents: Agents, run: str, step: int) -> list[dict]:
    return flow_runs(agents.api_url, name=f"promote/{run}/step-{step}")


def _triggered(agents: Agents, run: str, step: str) -> list[dict]:
    """Runs of this node's promote deployment for (run, step), whatever their state or name: the
    checkpoint's one run, started by the agent."""
    return [r for r in flow_runs(agents.api_url, deployment=names.promote_deployment(NODE))
            if r["parameters"].get("run") == run and str(r["parameters"].get("step", "")) == step]


def _tiers_verified(agents: Agents, run: str, step: int) -> set[int]:
    cat = agents.catalog()
    try:
        return {loc.tier for loc in cat.locations(run, step)}
    finally:
        cat.close()


def test_event_from_a_training_process_promotes_and_archives(agents):
    out = train(agents, f"""
        import time
        with CheckpointStager("run-ev", node="{NODE}", shard_bytes=1 << 20) as st:
            saved = st.save(8, tensors(), milestone=True, metrics={{"loss": 2.0}})
            t_commit = time.time()
        print(json.dumps({{"t": t_commit, "stall": saved.stall_seconds,
                           "delivered": st._announcer.delivered}}))
    """)
    assert out["delivered"] == [["run-ev", 8, 0, True]]
    tiers = wait_for("verified on tiers 0, 1 and 2", lambda: _tiers_verified(agents, "run-ev", 8) >= {0, 1, 2} and
                     _tiers_verified(agents, "run-ev", 8), timeout=120, agents=agents)
    assert tiers == {0, 1, 2}
    cat = agents.catalog()
    try:
        ck = cat.get_checkpoint("run-ev", 8)
        t1 = [r for r in cat.replicas(ck.id, tier=1) if r.state == "verified"]
    finally:
        cat.close()
    assert ck.kind == "milestone" and ck.writer_stall_seconds == pytest.approx(out["stall"], abs=1e-5)
    promote = wait_for("promote run finished", lambda: [r for r in _promotions(agents, "run-ev", 8) if finished(r)])
    assert [r["state_type"] for r in promote] == ["COMPLETED"], [(r["name"], r["state"]) for r in promote]
    start = ts(promote[0]["start_time"])
    durable = ts(t1[0].verified_at)
    print(f"\nLATENCY emit->flow start {start - out['t']:.2f} s; emit->verified on Tier 1 {durable - out['t']:.2f} s")
    assert start - out["t"] < 60


def test_duplicate_event_gives_one_promotion(agents):
    out = train(agents, f"""
        with CheckpointStager("run-dup", node="{NODE}", shard_bytes=1 << 20) as st:
            st.save(3, tensors(seed=3))
        print(json.dumps({{"delivered": st._announcer.delivered}}))
    """)
    assert out["delivered"] == [["run-dup", 3, 0, True]]
    for _ in range(3):  # the same fact announced again (a retry, a second watcher)
        assert emit(events.COMPLETED, "run-dup", 3, node=NODE, api_url=agents.api_url,
                           payload={"kind": "step"})
    wait_for("tier 1 copy", lambda: 1 in _tiers_verified(agents, "run-dup", 3), agents=agents)
    wait_for("the checkpoint's run finished", lambda: [r for r in _triggered(agents, "run-dup", "3") if finished(r)],
             agents=agents)
    time.sleep(4)  # room for a second run, were the repeats to make one
    runs = _triggered(agents, "run-dup", "3")
    assert len(runs) == 1, [(r["name"], r["state_type"]) for r in runs]
    cat = agents.catalog()
    try:
        ck = cat.get_checkpoint("run-dup", 3)
        assert len(cat.replicas(ck.id, tier=1)) == 1
    finally:
        cat.close()


def test_undelivered_event_is_caught_by_reconcile(agents):
    # the job's events go to a port nothing listens on: the checkpoint is committed, not announced
    out = train(agents, f"""
        import socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        settings = load_settings(node="{NODE}", prefect_api_url=f"http://127.0.0.1:{{port}}/api")
        with CheckpointStager("run-lost", settings=settings, shard_bytes=1 << 20) as st:
            st.save(5, tensors(seed=5))
        print(json.dumps({{"delivered": st._announcer.delivered}}))
    """)
    assert out["delivered"] == [["run-lost", 5, 0, False]]
    # the agent's own reconcile pass, within its interval (the client registered the run; a
    # checkpoint the catalog has never seen is promoted without a grace period), or the agent's
    # Tier 0 scan, whichever comes first
    wait_for("tier 1 copy via reconcile", lambda: 1 in _tiers_verified(agents, "run-lost", 5),
             timeout=RECONCILE_SECONDS * 3 + 60, agents=agents)
    assert len(_triggered(agents, "run-lost", "5")) <= 1  # one copy, at most the checkpoint's one run
    cat = agents.catalog()
    try:
        assert len(cat.replicas(cat.get_checkpoint("run-lost", 5).id, tier=1)) == 1
    finally:
        cat.close()


MALFORMED = [
    ({"run": "run-bad-1"}, "step"),  # missing step
    ({"run": "../../etc", "step": 1}, "run name"),  # escapes the tier root
    ({"run": "run-bad-3", "step": "twelve"}, "step"),
]


def _rejections(agents: Agents) -> list:
    cat = agents.catalog()
    try:
        return [e for e in cat.audit_log(limit=1000) if e.action == "reject"]
    finally:
        cat.close()


def test_malformed_or_hostile_events_are_rejected_clearly_and_copy_nothing(agents):
    before = tier_files(agents.root / "data" / "tier1")
    batch = []
    for payload, _ in MALFORMED:
        ev = events.build_event(events.COMPLETED, str(payload["run"]), 0, node=NODE)
        ev["id"] = str(uuid.uuid4())
        ev["payload"] = {**payload, "node": NODE}
        batch.append(ev)
    assert httpx.post(f"{agents.api_url}/events", json=batch, timeout=10).status_code == 204
    for payload, reason in MALFORMED:
        (rejected,) = wait_for(f"the rejection of {payload}", lambda p=payload: [
            e for e in _rejections(agents) if repr(p["run"]) in e.subject], timeout=90, agents=agents)
        assert reason in (rejected.reason or "").lower(), rejected.reason
        assert _triggered(agents, payload["run"], str(payload.get("step", ""))) == []  # no run of its own
    assert "rejected event: " in agents.logs()
    assert tier_files(agents.root / "data" / "tier1") == before


def test_checkpoint_of_unknown_format_fails_clearly_and_copies_nothing(agents):
    """A well-formed event about a part whose manifest is hostile (a format no one validates)."""
    folder = agents.root / "data" / "tier0" / NODE / "run-fmt" / "step-00000001"
    folder.mkdir(parents=True)
    (folder / "weights.pkl").write_bytes(b"\x80\x04K\x01.")
    (folder / "manifest.json").write_text(
        '{"run": "run-fmt", "step": 1, "format": "pickle", "files": '
        '[{"path": "weights.pkl", "size": 5, "checksum": "00000000"}]}')
    assert emit(events.COMPLETED, "run-fmt", 1, node=NODE, api_url=agents.api_url)
    line = wait_for("the agent's line about it", lambda: [
        ln for ln in agents.logs().splitlines() if "promotion of 'run-fmt' step 1 part 0 failed" in ln],
        timeout=90, agents=agents)
    assert "unknown format 'pickle'" in line[0], line
    assert _triggered(agents, "run-fmt", "1") == []
    assert tier_files(agents.root / "data" / "tier1" / "run-fmt") == []


def test_agent_serves_its_schedules_and_no_promote_trigger(agents):
    promote = httpx.get(f"{agents.api_url}/deployments/name/{names.promote_deployment(NODE)}").json()
    autos = httpx.get(f"{agents.api_url}/automations/related-to/prefect.deployment.{promote['id']}").json()
    assert autos == []  # the agent takes its parts' events itself: an event is never a run
    # reconcile is no deployment: the agent runs it (deployments/reconcile_loop.py)
    assert httpx.get(f"{agents.api_url}/deployments/name/{names.RECONCILE_FLOW}/{NODE}").status_code == 404
    retention = httpx.get(f"{agents.api_url}/deployments/name/{names.RETENTION_DEPLOYMENT}").json()
    assert [s["schedule"]["cron"] for s in retention["schedules"]] == ["*/15 * * * *"]


def test_stopping_the_agent_is_clean_and_pauses_what_it_served(agents):
    """Last in the module: Ctrl-C stops the agent at once; Prefect pauses its schedules."""
    proc = agents.procs[0]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=30)
    assert time.monotonic() - t0 < 20
    assert rc in (0, 130, -signal.SIGINT), rc
    retention = httpx.get(f"{agents.api_url}/deployments/name/{names.RETENTION_DEPLOYMENT}").json()
    assert retention["paused"] is True
