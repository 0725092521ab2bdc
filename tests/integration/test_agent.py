"""`ckpt agent` on the real Prefect server: what it serves, and a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from e2e import start_agents

from deployments import names

NODE = f"ag-{uuid.uuid4().hex[:6]}"


@pytest.mark.prefect
@pytest.mark.slow
def test_agent_serves_triggers_and_schedules_then_stops_cleanly(prefect_server, tmp_path):
    agents = start_agents(prefect_server, tmp_path, (NODE,), catalog_url=f"sqlite:///{tmp_path / 'c.db'}",
                          s3_url=None, bucket=None, extra={"CKPT_RECONCILE_INTERVAL_SECONDS": "45"})
    try:
        promote = httpx.get(f"{prefect_server}/deployments/name/{names.promote_deployment(NODE)}").json()
        autos = httpx.get(f"{prefect_server}/automations/related-to/prefect.deployment.{promote['id']}").json()
        assert len(autos) == 1
        trig = autos[0]["trigger"]
        assert trig["expect"] == ["ckpt.checkpoint.completed"] and trig["match"] == {"ckpt.node": NODE}
        action = autos[0]["actions"][0]
        assert action["type"] == "run-deployment" and action["parameters"]["node"] == NODE
        assert all("| default(" in v for k, v in action["parameters"].items() if k != "node")
        reconcile = httpx.get(f"{prefect_server}/deployments/name/{names.reconcile_deployment(NODE)}").json()
        assert [s["schedule"]["interval"] for s in reconcile["schedules"]] == [45.0]
        retention = httpx.get(f"{prefect_server}/deployments/name/{names.RETENTION_DEPLOYMENT}").json()
        assert [s["schedule"]["cron"] for s in retention["schedules"]] == ["*/15 * * * *"]
    finally:
        proc = agents.procs[0]
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)
    assert time.monotonic() - t0 < 20
    assert rc in (0, 130, -signal.SIGINT), rc
    # Prefect pauses what a stopped serve() served: nothing is scheduled for a dead agent
    reconcile = httpx.get(f"{prefect_server}/deployments/name/{names.reconcile_deployment(NODE)}").json()
    assert reconcile["paused"] is True


def test_agent_with_bad_settings_says_so_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(CKPT_TIER2_URL="http://not-s3/bucket", CKPT_DATA_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "ckpt.cli", "agent", "--node", "n"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert "tier2_url must look like s3://bucket/prefix" in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
