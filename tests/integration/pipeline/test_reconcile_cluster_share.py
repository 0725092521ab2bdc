"""The object store is the cluster's: the reconcile pass of a node's agent (``ckpt agent
--node-only``, ``cluster=False``) leaves the object store's vanished copies, the archive backlog
and the follow-ups nobody finished to the cluster agent's pass, which covers them once for every
node; the node's pass never loads the S3 client, and the cluster agent sets up Tier 2's root in
a child, so no agent holds the S3 client at rest (its memory)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import boto3

from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import replica_states, write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"
NO_SERVER = "http://127.0.0.1:9/api"  # nothing listens on the discard port: refused at once

AGENT_START = textwrap.dedent("""
    import json, pickle, sys
    from deployments.agent import set_up_cluster
    from deployments.processes import agent_logging
    agent_logging("INFO")
    set_up_cluster(pickle.load(sys.stdin.buffer))
    print(json.dumps({"s3_client": "boto3" in sys.modules}))
""")
NODE_PASS = textwrap.dedent("""
    import json, pickle, sys
    from flows.common import plain_steps
    from flows.reconcile import reconcile_once
    report = reconcile_once(pickle.load(sys.stdin.buffer), steps=plain_steps(), cluster=False)
    print(json.dumps({"report": vars(report), "s3_client": "boto3" in sys.modules}))
""")


def test_the_object_store_is_swept_by_the_cluster_pass_not_by_each_node(settings_factory, db_url, s3_bucket,
                                                                           s3_endpoint):
    from db.catalog import Catalog

    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=s3_endpoint)
    for step in (50, 100):
        write_checkpoint(settings.tier0_url, RUN, step, kind="milestone", shards=1, shard_bytes=4096)
        promote(settings, RUN, step, steps=plain_steps())  # archived inline
        assert replica_states(settings, RUN, step)[(2, 0)] == "verified"
    write_checkpoint(settings.tier0_url, RUN, 200, kind="milestone", shards=1, shard_bytes=4096)
    promote(settings.model_copy(update={"tier2_url": None}), RUN, 200, steps=plain_steps())  # not archived
    with Catalog(settings.catalog_url) as cat:  # a retirement recorded, its worker killed before any delete
        cat.retire(RUN, 50, reason="no tier keeps it", actor="killed-worker")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    for key in [k for k in keys if k.endswith(".safetensors") and "100" in k]:
        s3.delete_object(Bucket=s3_bucket, Key=key)  # step 100's shard, gone behind the catalog's back

    node = _in_process(NODE_PASS, settings)
    assert node["report"]["archived"] == [] and node["report"]["failed"] == []
    assert not [m for m in node["report"]["missing"] if m.startswith("tier 2")]
    assert not [m for m in node["report"]["retired"] if not m.startswith("tier 0")]  # its own NVMe only
    assert not node["s3_client"]
    assert replica_states(settings, RUN, 50)[(2, 0)] == "verified"
    assert replica_states(settings, RUN, 100)[(2, 0)] == "verified"  # not judged by the node
    assert (2, 0) not in replica_states(settings, RUN, 200)

    cluster = reconcile_once(settings, steps=plain_steps())  # found gone, then archived again
    assert f"tier 2 {RUN}/50 part 0" in cluster.retired and replica_states(settings, RUN, 50)[(2, 0)] == "pruned"
    assert [m for m in cluster.missing if m.startswith(f"tier 2 {RUN}/100 part 0")]
    assert sorted(cluster.archived) == [f"{RUN}/100", f"{RUN}/200"]
    assert replica_states(settings, RUN, 100)[(2, 0)] == "verified"
    assert replica_states(settings, RUN, 200)[(2, 0)] == "verified"


def _in_process(code: str, settings, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(settings), capture_output=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return {**json.loads(done.stdout.decode().splitlines()[-1]), "stderr": done.stderr.decode()}


def test_the_cluster_agent_sets_up_tier2_in_a_child_and_never_loads_the_s3_client(settings_factory, db_url,
                                                                                   s3_bucket, s3_endpoint):
    from db.catalog import Catalog

    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=s3_endpoint, prefect_api_url=NO_SERVER)
    started = _in_process(AGENT_START, settings, env={"PREFECT_API_URL": NO_SERVER})
    assert not started["s3_client"]
    # no Prefect server answering: the automation is a warning, Tier 2's root is set up all the same
    assert "WARNING | ckpt.agent - RPO automation not created" in started["stderr"], started["stderr"][-2000:]
    with Catalog(settings.catalog_url) as cat:
        assert cat.tier_root(2, settings.node) is not None  # marked and recorded, by the child
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    assert s3.list_objects_v2(Bucket=s3_bucket, Prefix="vault/")["KeyCount"] >= 1  # the root's marker


def test_the_agent_start_says_an_unavailable_tier_as_a_warning(settings_factory, db_url, tmp_path):
    import logging

    from deployments.agent import set_up_tiers

    settings = pipeline_settings(settings_factory, db_url)
    missing = settings.model_copy(update={"tier1_url": str(tmp_path / "not-mounted")})
    said = set_up_tiers(missing, (0, 1))
    assert [level for level, _ in said] == [logging.INFO, logging.WARNING]
    assert "UNAVAILABLE" in said[1][1]
