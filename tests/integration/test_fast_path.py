"""The agent's fast path on a real Prefect server: a promote run starts in the agent's warm
process the moment the deployment trigger schedules it; duplicates stay one run; a killed flow
process ends ``Crashed`` and reconcile finishes its checkpoint; a run the runner's poll takes
runs warm too.

The first agent's runner polls once an hour, so every run it starts in these tests was started
by the fast path. A second agent polls every second: a run due a little later, which the fast
path leaves to the poll, must run in a fork of the agent's fork server, not in a new interpreter.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import uuid

import psutil
import pytest

from core import events
from deployments import names
from deployments.fast_path import claim_message
from tasks.prefect_events import auth_headers, emit
from tests.kit.agents import Agents, finished, flow_runs, start_agents, train, wait_for

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

NODE = f"fp-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def agents(prefect_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("fast-path")
    a = start_agents(prefect_server, root, (NODE,), catalog_url=f"sqlite:///{root / 'catalog.db'}", s3_url=None,
                     bucket=None, extra={"PREFECT_RUNNER_POLL_FREQUENCY": "3600", "CKPT_TASK_RETRIES": "4"})
    yield a
    a.stop()


def _runs(agents: Agents, run: str, step: int) -> list[dict]:
    """Runs of the node's promote deployment for (run, step), whatever their name or state."""
    return [r for r in flow_runs(agents.api_url, deployment=names.promote_deployment(NODE))
            if r["parameters"].get("run") == run and str(r["parameters"].get("step")) == str(step)]


def _states(agents: Agents, flow_run_id: str) -> list[dict]:
    import httpx

    r = httpx.get(f"{agents.api_url}/flow_run_states/", params={"flow_run_id": flow_run_id}, timeout=10,
                  headers=auth_headers())
    r.raise_for_status()
    return sorted(r.json(), key=lambda s: s["timestamp"])


def _on_tier1(agents: Agents, run: str, step: int) -> bool:
    from core.errors import NotFound, UnknownRun

    cat = agents.catalog()
    try:
        return 1 in {loc.tier for loc in cat.locations(run, step)}
    except (NotFound, UnknownRun):  # not even registered
        return False
    finally:
        cat.close()


def _commit(agents: Agents, run: str, step: int) -> None:
    """A checkpoint committed on the node's Tier 0, not announced."""
    train(agents, f"""
        with CheckpointStager("{run}", node="{NODE}", shard_bytes=1 << 20, announce=False) as st:
            st.save({step}, tensors(seed={step}))
    """)


def test_event_is_promoted_at_once_by_the_fast_path_and_duplicates_are_one_run(agents):
    _commit(agents, "run-fp", 1)
    for _ in range(3):  # the same fact announced three times (a retry, a second watcher)
        assert emit(events.COMPLETED, "run-fp", 1, node=NODE, api_url=agents.api_url)
    _commit(agents, "run-fp", 2)  # a later event: once its run is done, the duplicates were seen
    assert emit(events.COMPLETED, "run-fp", 2, node=NODE, api_url=agents.api_url)
    later = wait_for("the later run finished", lambda: [r for r in _runs(agents, "run-fp", 2) if finished(r)],
                     timeout=120, agents=agents)
    assert [r["state_type"] for r in later] == ["COMPLETED"]

    runs = wait_for("the runs of step 1 finished", lambda: (rs := _runs(agents, "run-fp", 1)) and
                    all(finished(r) for r in rs) and rs, agents=agents)  # it may end after the later one
    assert [(r["name"], r["state_type"]) for r in runs] == [("promote/run-fp/step-1", "COMPLETED")]
    assert _on_tier1(agents, "run-fp", 1)
    states = _states(agents, runs[0]["id"])
    pending = [s for s in states if s["type"] == "PENDING"]
    assert [s["message"] for s in pending] == [claim_message(NODE)], states  # taken by the fast path alone
    assert [s["type"] for s in states][-2:] == ["RUNNING", "COMPLETED"]
    assert runs[0]["infrastructure_pid"]  # host:pid of the warm process, shown in the UI


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def test_killed_flow_process_ends_crashed_and_reconcile_finishes_it(agents):
    from flows.common import plain_steps
    from flows.reconcile import reconcile_once

    _commit(agents, "run-kill", 3)
    lock = sqlite3.connect(agents.env["CKPT_CATALOG_URL"].removeprefix("sqlite:///"), isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")  # the run's first catalog write waits on it: the run stays running
        assert emit(events.COMPLETED, "run-kill", 3, node=NODE, api_url=agents.api_url)
        run = wait_for("the promote run running", lambda: [r for r in _runs(agents, "run-kill", 3)
                                                           if r["state_type"] == "RUNNING"], agents=agents)[0]
        pid = int(run["infrastructure_pid"].rsplit(":", 1)[1])
        # a process forked by the agent's fork server (itself a fork of the agent), not the agent
        assert pid != agents.procs[0].pid and _parent(_parent(pid)) == agents.procs[0].pid
        # forked when the run came: no idle warm process beside it (CKPT_WARM_SPARE off by default),
        # and no resource tracker interpreter among the agent's processes (a sink instead)
        assert [c.pid for c in psutil.Process(_parent(pid)).children()] == [pid]
        assert [c.pid for c in psutil.Process(agents.procs[0].pid).children()] == [_parent(pid)]
        os.kill(pid, signal.SIGKILL)
        crashed = wait_for("the run crashed", lambda: [r for r in _runs(agents, "run-kill", 3) if finished(r)],
                           timeout=60, agents=agents)
    finally:
        lock.rollback()
        lock.close()
    assert [r["state_type"] for r in crashed] == ["CRASHED"]
    assert "exited with code -9" in crashed[0]["state"]["message"]
    assert agents.procs[0].poll() is None  # the agent lives on
    assert not _on_tier1(agents, "run-kill", 3)

    reconcile_once(agents.settings(NODE), steps=plain_steps(), actor="test")  # what its schedule does

    assert _on_tier1(agents, "run-kill", 3)


POLL_NODE = f"fp-poll-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def polling_agent(prefect_server, tmp_path_factory):
    """An agent whose runner polls every second: the path that starts most runs of a burst; it
    keeps a spare warm process (``CKPT_WARM_SPARE``)."""
    root = tmp_path_factory.mktemp("fast-path-poll")
    a = start_agents(prefect_server, root, (POLL_NODE,), catalog_url=f"sqlite:///{root / 'catalog.db'}",
                     s3_url=None, bucket=None, extra={"PREFECT_RUNNER_POLL_FREQUENCY": "1", "CKPT_WARM_SPARE": "true",
                                                      "CKPT_RECONCILE_INTERVAL_SECONDS": "3600"})
    yield a
    a.stop()


def _schedule_later(agents: Agents, run: str, step: int, seconds: float) -> str:
    """A promote run of the node's deployment due ``seconds`` from now: later than the fast path
    takes a run, so the runner's poll starts it."""
    from datetime import UTC, datetime, timedelta

    import httpx

    headers = auth_headers()
    dep = httpx.get(f"{agents.api_url}/deployments/name/{names.promote_deployment(POLL_NODE)}", headers=headers,
                    timeout=10)
    dep.raise_for_status()
    due = (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()
    r = httpx.post(f"{agents.api_url}/deployments/{dep.json()['id']}/create_flow_run", headers=headers, timeout=10,
                   json={"parameters": {"run": run, "step": step, "part": 0, "parts": 1, "node": POLL_NODE},
                         "state": {"type": "SCHEDULED", "state_details": {"scheduled_time": due}}})
    r.raise_for_status()
    return r.json()["id"]


def test_run_taken_by_the_runners_poll_runs_in_a_fork_of_the_warm_server_not_a_new_interpreter(polling_agent):
    agents = polling_agent
    train(agents, f"""
        with CheckpointStager("run-poll", node="{POLL_NODE}", shard_bytes=1 << 20, announce=False) as st:
            st.save(5, tensors(seed=5))
    """)
    lock = sqlite3.connect(agents.env["CKPT_CATALOG_URL"].removeprefix("sqlite:///"), isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")  # the run stays running while its process is looked at
        flow_run_id = _schedule_later(agents, "run-poll", 5, seconds=3)
        wait_for("the run running", lambda: _by_id(agents, flow_run_id)["state_type"] == "RUNNING", timeout=60,
                 agents=agents)
        agent = psutil.Process(agents.procs[0].pid)
        # not in a new interpreter (Prefect's runner starts one with the run's id in its environment)
        assert not [c.cmdline() for c in agent.children() if _environ(c).get("PREFECT__FLOW_RUN_ID") == flow_run_id]
        # but in a fork of the fork server, beside the spare warm process waiting for the next run
        server = psutil.Process(_fork_server_pid(agents.procs[0].pid))
        assert len(server.children()) == 2, [c.pid for c in server.children()]
    finally:
        lock.rollback()
        lock.close()
    done = wait_for("the run finished", lambda: (r := _by_id(agents, flow_run_id)) and finished(r) and r,
                    timeout=120, agents=agents)
    assert done["state_type"] == "COMPLETED"
    pending = [s for s in _states(agents, flow_run_id) if s["type"] == "PENDING"]
    assert pending and claim_message(POLL_NODE) not in [s["message"] for s in pending]  # the runner's claim
    assert _on_tier1(agents, "run-poll", 5)


def _environ(p: psutil.Process) -> dict[str, str]:
    try:
        return p.environ()
    except psutil.Error:  # exited meanwhile
        return {}


def _fork_server_pid(agent_pid: int) -> int:
    """The agent's child that forks the warm processes (the one with children of its own)."""
    return next(c.pid for c in psutil.Process(agent_pid).children() if c.children())


def _by_id(agents: Agents, flow_run_id: str) -> dict:
    import httpx

    r = httpx.get(f"{agents.api_url}/flow_runs/{flow_run_id}", headers=auth_headers(), timeout=10)
    r.raise_for_status()
    return r.json()
