"""Four simulated nodes, one agent each (three with --node-only), on the production shape:
Prefect's API server and services processes on PostgreSQL + Redis, the catalog on PostgreSQL.
Each node's agent promotes the part on its own Tier 0; the checkpoint becomes complete on Tier 1
once, gets one promote run, is archived once (inline, by that run: no archive run follows),
and the cluster-wide deployments are served once."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from core import events
from deployments import names
from tests.kit.agents import finished, flow_runs, recorded_events, start_agents, train, wait_for

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.postgres]

TAG = uuid.uuid4().hex[:6]
NODES = tuple(f"mn{i}-{TAG}" for i in range(4))


@pytest.fixture(scope="module")
def pg_catalog(pg_server):
    admin = pg_server.replace("postgresql+psycopg://", "postgresql://")
    name = f"ckpt_mn_{TAG}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_server.rsplit("/", 1)[0] + "/" + name
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture(scope="module")
def agents(production_server, s3_endpoint, pg_catalog, tmp_path_factory):
    import boto3

    root = tmp_path_factory.mktemp("multinode")
    bucket = f"mn-{TAG}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    # reconcile's first scheduled pass would come a minute in, in the middle of the test: this
    # test is about events, so its agents reconcile hourly
    a = start_agents(production_server.api_url, root, NODES, catalog_url=pg_catalog, s3_url=s3_endpoint, bucket=bucket,
                     extra={"CKPT_RECONCILE_INTERVAL_SECONDS": "3600"})
    a.bucket = bucket
    yield a
    a.stop()


def test_four_nodes_one_checkpoint_complete_and_archived_once(agents, s3_endpoint):
    train(agents, f"""
        nodes = {list(NODES)!r}
        stagers = [CheckpointStager("run-mn", node=n, part=i, parts=len(nodes), shard_bytes=1 << 20)
                   for i, n in enumerate(nodes)]
        for i, st in enumerate(stagers):  # each rank commits its part on its node's Tier 0
            st.save(100, tensors(seed=i), milestone=True)
        for st in stagers:
            st.close()
        print(json.dumps({{"delivered": [d for st in stagers for d in st._announcer.delivered]}}))
    """)

    def on_tier2():  # what the user waits for: the catalog lists the checkpoint on Tier 2 (`ckpt ls`)
        cat = agents.catalog()
        try:
            tiers = cat.checkpoint_tiers("run-mn").get(("run-mn", 100), ())
            done = {h.to_state for h in cat.history("run-mn", 100) if h.action == "complete"}
        finally:
            cat.close()
        return 2 in tiers and "tier2" in done

    wait_for("verified on Tier 2", on_tier2, timeout=180, agents=agents)
    cat = agents.catalog()
    try:
        ck = cat.get_checkpoint("run-mn", 100)
        t1 = cat.replicas(ck.id, tier=1)
        t2 = cat.replicas(ck.id, tier=2)
        t0 = cat.replicas(ck.id, tier=0)
        history = cat.history("run-mn", 100)
    finally:
        cat.close()
    assert ck.parts == 4 and ck.parts_registered == 4
    assert sorted((r.part, r.state) for r in t1) == [(p, "verified") for p in range(4)]
    assert sorted((r.part, r.state) for r in t2) == [(p, "verified") for p in range(4)]
    assert sorted((r.part, r.node) for r in t0) == list(enumerate(NODES))  # each part verified where it lives
    completions = [(h.action, h.to_state) for h in history if h.action == "complete"]
    assert completions.count(("complete", "tier1")) == 1
    assert completions.count(("complete", "tier2")) == 1

    # each part was promoted by its own node's agent (the actor records node and process), and the
    # checkpoint has one promote run, on the node whose part completed it
    assert {h.actor.split(" pid:")[0] for h in history if h.to_state == "verified" and h.subject.startswith(
        "replica:")} >= {f"event agent:{n}" for n in NODES}
    runs = wait_for("the checkpoint's run finished", lambda: (rs := [r for n in NODES for r in flow_runs(
        agents.api_url, deployment=names.promote_deployment(n))]) and all(finished(r) for r in rs) and rs)
    assert [r["state_type"] for r in runs] == ["COMPLETED"]
    assert runs[0]["parameters"]["node"] in NODES

    # Tier 2 holds each file once, and every part's manifest
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=agents.bucket)["Contents"]]
    manifests = [k for k in keys if k.rsplit("/", 1)[-1].startswith("manifest.part-")]
    assert len(manifests) == 4 and len(keys) == len(set(keys))

    # archived inline by the promotion that completed it: the durable event, once the server
    # stored it, does not ask for an archive run (its label is what the trigger matches), and
    # there is none
    durable = wait_for("the durable event stored", lambda: recorded_events(agents.api_url, events.DURABLE, "run-mn"))
    assert [e["resource"]["ckpt.milestone"] for e in durable] == ["false"]
    assert flow_runs(agents.api_url, name="archive/run-mn/step-100") == []


def test_cluster_wide_deployments_are_served_by_one_agent(agents):
    """--node-only agents serve their node's promote (and run its reconcile), nothing cluster-wide."""
    for i, node in enumerate(NODES):
        served = (agents.root / "logs" / f"agent-{node}.log").read_text()
        assert names.promote_deployment(node) in served
        assert (names.ARCHIVE_DEPLOYMENT in served) == (i == 0)
        assert (names.RETENTION_DEPLOYMENT in served) == (i == 0)
        assert not any(names.promote_deployment(other) in served for other in NODES if other != node)
