"""The flows for real, against the session's Prefect server: names, artifacts, events, task
retries on transient errors and none on permanent ones (and the hops' own retries in the flow run
with their task runs off), and the CLI that starts them."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.kit.checkpoints import (
    ckpt_dir,
    committed_ago,
    open_catalog,
    replica_states,
    shard_paths,
    write_checkpoint,
)
from tests.kit.pipeline import pipeline_settings

pytestmark = pytest.mark.prefect
RUN = "run-a"


@pytest.fixture
def env_settings(settings_factory, db_url, monkeypatch, prefect_server):
    """Settings for this test, also in CKPT_* so that the flows (which read them at entry) agree."""
    def make(runs=(RUN,), **overrides):
        overrides.setdefault("task_retries", 2)
        overrides.setdefault("task_retry_delay_seconds", 0.2)
        settings = pipeline_settings(settings_factory, db_url, runs=runs, **overrides)
        monkeypatch.setenv("CKPT_DATA_DIR", str(settings.data_dir))
        monkeypatch.setenv("CKPT_NODE", settings.node)
        monkeypatch.setenv("CKPT_CATALOG_URL", settings.catalog_url)
        for key, value in overrides.items():
            monkeypatch.setenv(f"CKPT_{key.upper()}", str(value))
        return settings
    return make


def flow_run_of(state):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id)


def task_runs_of(flow_run_id):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r for r in runs}


def events_seen(api: str, run: str, since: datetime, want: set[str], timeout: float = 15) -> set[str]:
    """The ckpt.checkpoint.* event names the server recorded for ``run`` (polls: delivery is async)."""
    body = {"filter": {"event": {"prefix": ["ckpt.checkpoint."]},
                       "resource": {"labels": {"ckpt.run": [run]}},
                       "occurred": {"since": since.isoformat(), "until": (since + timedelta(hours=1)).isoformat()}},
            "limit": 50}
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.post(f"{api}/events/filter", json=body, timeout=10)
        resp.raise_for_status()
        got = resp.json()
        names = {e["event"] for e in got.get("events", []) if e["resource"].get("ckpt.run") == run}
        if want <= names or time.monotonic() > deadline:
            return names
        time.sleep(0.5)


def test_promote_flow_through_three_tiers(env_settings, s3_endpoint, s3_bucket, prefect_server):
    from prefect.artifacts import Artifact

    from flows.promote import promote_checkpoint

    run = f"run-{uuid.uuid4().hex[:8]}"  # event ids are deterministic per (run, step): keep them new
    settings = env_settings(tier2_url=f"s3://{s3_bucket}/vault", s3_endpoint_url=s3_endpoint, runs=(run,))
    write_checkpoint(settings.tier0_url, run, 100, kind="milestone")
    since = datetime.now(UTC) - timedelta(seconds=5)

    state = promote_checkpoint(run, 100, return_state=True)

    assert state.is_completed(), state.message
    result = state.result()
    assert result["durable"] and result["archive"]["archived"]
    assert flow_run_of(state).name == f"promote/{run}/step-100"
    # the hops of a part run in the run's body (no task run per part); the checkpoint's own steps are tasks
    tasks = sorted(task_runs_of(state.state_details.flow_run_id))
    assert tasks == ["mark-complete", "plan-retention"], tasks
    assert {(t, p): s for (t, p), s in replica_states(settings, run, 100).items()} == {
        (0, 0): "verified", (1, 0): "verified", (2, 0): "verified"}
    with open_catalog(settings) as cat:  # who acted: an event's run, and which one
        actors = {e.actor for e in cat.history(run, 100) if e.to_state == "verified"}
    assert actors == {f"event flow-run:{state.state_details.flow_run_id}"}
    table = Artifact.get(f"promote-{run}-100-0")
    assert table is not None and table.type == "table"
    hops = json.loads(table.data) if isinstance(table.data, str) else table.data
    (part,) = [h for h in hops if h["hop"] == "tier 0 -> tier 1"]  # every part's, here the one
    assert (part["part"], part["state"], part["attempts"], part["node"]) == (0, "verified", 1, settings.node)
    assert part["bytes"] > 0 and {h["hop"] for h in hops} >= {"tier 1 -> tier 2"}
    page = Artifact.get(f"run-{run}")  # the run's status page, republished when a checkpoint becomes durable
    assert page is not None and page.type == "markdown"
    for row in ("| Tier 0 (node NVMe) | 100 |", "| Tier 1 (shared FS) | 100 |", "| Tier 2 (object store) | 100 |"):
        assert row in page.data, page.data
    assert "newest durable, step 100:" in page.data and f"`{run}` step 100" in page.data
    want = {"ckpt.checkpoint.verified", "ckpt.checkpoint.promoted", "ckpt.checkpoint.durable",
            "ckpt.checkpoint.archived"}
    assert want <= events_seen(prefect_server, run, since, want)


def test_the_status_page_is_republished_by_the_part_that_makes_the_checkpoint_durable(env_settings):
    """Of a checkpoint's N part promotions, only the one that completes it republishes the run's
    status page (a 64-node burst posts 1 page, not 64); every part gets its hop table."""
    from prefect.artifacts import Artifact

    from flows.promote import promote_checkpoint

    run = f"run-{uuid.uuid4().hex[:8]}"
    settings = env_settings(runs=(run,))
    for part in (0, 1):
        write_checkpoint(settings.tier0_url, run, 100, part=part, parts=2, shard_bytes=64 << 10)

    first = promote_checkpoint(run, 100, 0, 2, return_state=True)
    assert first.is_completed(), first.message
    assert not first.result()["durable"]
    assert Artifact.get(f"promote-{run}-100-0") is not None
    assert Artifact.get(f"run-{run}") is None

    second = promote_checkpoint(run, 100, 1, 2, return_state=True)
    assert second.is_completed(), second.message
    assert second.result()["durable"]
    page = Artifact.get(f"run-{run}")
    assert page is not None and "| Tier 1 (shared FS) | 100 |" in page.data, page and page.data


def promote_once_the_claim_goes(run: str, cat, other, wait):
    """``promote_checkpoint(run, 100)`` while another worker holds the part's Tier 1 claim
    (``other``), released on a helper thread once ``wait()`` returns (the promotion seen waiting for
    its retry: no wall-clock race decides the outcome); the run's final state. ``cat`` is closed."""
    from db.entities import COPYING, MISSING
    from flows.promote import promote_checkpoint

    released = threading.Event()

    def release_once_a_retry_waits() -> None:
        try:
            wait()
        finally:
            cat.transition(other.replica.id, MISSING, expected=COPYING, claim_token=other.replica.claim_token,
                           actor="other", reason="the other worker gave up")
            released.set()

    helper = threading.Thread(target=release_once_a_retry_waits, daemon=True)
    helper.start()
    try:
        state = promote_checkpoint(run, 100, return_state=True)
    finally:
        helper.join(130)
        cat.close()
    assert released.is_set()
    return state


def awaiting_retry(api: str, task_name: str) -> bool:
    """Whether a task run of ``task_name`` is waiting for its retry (state AwaitingRetry)."""
    body = {"task_runs": {"name": {"like_": task_name}, "state": {"name": {"any_": ["AwaitingRetry"]}}}}
    r = httpx.post(f"{api}/task_runs/filter", json=body, timeout=10)
    r.raise_for_status()
    return bool(r.json())


@pytest.fixture
def retry_waits(monkeypatch):
    """The waits before the inline retries of a step (``tasks.retry.retrying``), as they begin."""
    import tasks.retry

    waits: list[float] = []
    waiting = threading.Event()

    def watched(seconds: float) -> None:
        waits.append(seconds)
        waiting.set()
        time.sleep(seconds)

    monkeypatch.setattr(tasks.retry, "_sleep", watched)
    return waits, waiting


def run_log(api: str, flow_run_id) -> list[str]:
    """The flow run's log lines as the UI shows them (the API), once the run's logs are sent."""
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    body = {"logs": {"flow_run_id": {"any_": [str(flow_run_id)]}}, "limit": 200}
    r = httpx.post(f"{api}/logs/filter", json=body, timeout=10)
    r.raise_for_status()
    return [log["message"] for log in r.json()]


def test_the_hops_run_in_the_flow_run_and_a_transient_failure_retries_there(env_settings, s3_endpoint, s3_bucket,
                                                                             prefect_server, retry_waits):
    """A milestone's Tier 1 hop and Tier 2 upload run in the promote run's body, no task run of
    their own; another worker's live claim (CopyInProgress) makes the hop retry there (the claim
    released only once a retry waits, so no wall-clock race decides the outcome), the retry
    copies, the run's log says it retried and its hop table counts the part's copy attempts."""
    from prefect.artifacts import Artifact

    from tasks.register import register_stored_part

    run = f"run-{uuid.uuid4().hex[:8]}"
    settings = env_settings(runs=(run,), task_retries=6, task_retry_delay_seconds=1.0,
                            tier2_url=f"s3://{s3_bucket}/inline", s3_endpoint_url=s3_endpoint)
    write_checkpoint(settings.tier0_url, run, 100, kind="milestone")
    register_stored_part(settings, run, 100)
    cat = open_catalog(settings)
    other = cat.claim_copy(cat.get_checkpoint(run, 100).id, 1, 0, "elsewhere", node=None, actor="other",
                           lease_seconds=3600)
    assert other.acquired
    waits, waiting = retry_waits

    state = promote_once_the_claim_goes(run, cat, other, lambda: waiting.wait(120))

    assert state.is_completed(), state.message
    assert state.result()["archive"]["archived"]
    assert replica_states(settings, run, 100) == {(0, 0): "verified", (1, 0): "verified", (2, 0): "verified"}
    assert sorted(task_runs_of(state.state_details.flow_run_id)) == ["mark-complete", "plan-retention"]
    assert waits and 0.5 <= waits[0] <= 1.5  # the first delay (1 s) with its jitter
    retried = [line for line in run_log(prefect_server, state.state_details.flow_run_id) if "; retry " in line]
    assert len(retried) == len(waits), retried
    assert retried[0].startswith("tier0-to-tier1: CopyInProgress: ") and "retry 1 of 6 in " in retried[0], retried
    table = Artifact.get(f"promote-{run}-100-0")
    hops = json.loads(table.data) if isinstance(table.data, str) else table.data
    (part,) = [h for h in hops if h["hop"] == "tier 0 -> tier 1"]
    assert part["attempts"] == 2  # the other worker's claim, then this run's retry's


def test_a_corrupt_source_fails_the_flow_at_once_and_keeps_tier0(env_settings):
    from flows.promote import promote_checkpoint
    from tests.kit.checkpoints import flip_bit

    settings = env_settings(task_retries=3, task_retry_delay_seconds=5)
    write_checkpoint(settings.tier0_url, RUN, 100)
    flip_bit(shard_paths(settings.tier0_url, RUN, 100)[0])
    started = time.monotonic()

    state = promote_checkpoint(RUN, 100, return_state=True)

    assert state.is_failed()
    assert time.monotonic() - started < 5  # no retry delay was waited
    assert "tier0-to-tier1" not in task_runs_of(state.state_details.flow_run_id)  # run in its body, tried once
    assert "crc32c" in (state.message or "") or "CorruptCheckpoint" in (state.message or "")
    assert ckpt_dir(settings.tier0_url, RUN, 100).is_dir()
    assert not ckpt_dir(settings.tier1_url, RUN, 100).exists()


def test_cli_promote_here_then_retention_and_reconcile(env_settings):
    from typer.testing import CliRunner

    from ckpt.cli import app

    settings = env_settings()
    for step in (1, 2, 3, 4):
        lost_event(settings, RUN, step)
    runner = CliRunner()

    out = runner.invoke(app, ["promote", "--run", RUN, "--step", "1", "--here", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["durable"] is True

    out = runner.invoke(app, ["reconcile", "--json"])  # steps 2-4 never had an event
    assert out.exit_code == 0, out.output
    assert sorted(json.loads(out.stdout)["promoted"]) == [f"{RUN}/{s} part 0" for s in (2, 3, 4)]
    assert not ckpt_dir(settings.tier0_url, RUN, 1).exists()  # Tier 0 keeps the last 3 by default

    out = runner.invoke(app, ["retention", "--dry-run", "--json"], env={"CKPT_RETENTION_TIER0__KEEP_LAST": "1"})
    assert out.exit_code == 0, out.output
    plan = json.loads(out.stdout)
    assert [(a["tier"], a["step"], a["outcome"]) for a in plan] == [(0, 2, "planned"), (0, 3, "planned")]
    assert ckpt_dir(settings.tier0_url, RUN, 2).is_dir()  # a dry run deletes nothing


def test_reconcile_publishes_what_it_promoted_as_an_artifact(env_settings, s3_endpoint, s3_bucket):
    """Checkpoints committed whose event was lost (the catalog never heard of them) are promoted
    by reconcile, and its run says so in the UI: a ``reconcile-promotions-<node>`` table with a
    row per promotion, naming the run, step and the tiers it reached (a milestone archived inline
    reaches Tier 2)."""
    from prefect.artifacts import Artifact

    from flows.artifacts import artifact_key
    from flows.reconcile import reconcile

    run = f"run-{uuid.uuid4().hex[:8]}"
    settings = env_settings(tier2_url=f"s3://{s3_bucket}/reconciled", s3_endpoint_url=s3_endpoint, runs=(run,))
    lost_event(settings, run, 10)
    lost_event(settings, run, 20, kind="milestone")

    state = reconcile(return_state=True)

    assert state.is_completed(), state.message
    assert sorted(state.result()["promoted"]) == [f"{run}/10 part 0", f"{run}/20 part 0"]
    table = Artifact.get(artifact_key("reconcile-promotions", settings.node))
    assert table is not None and table.type == "table"
    assert table.flow_run_id == state.state_details.flow_run_id  # this pass's, not an earlier test's
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert sorted((r["run"], r["step"], r["part"], r["tiers"], r["durable"]) for r in rows) == [
        (run, 10, 0, "0 -> 1", True), (run, 20, 0, "0 -> 1 -> 2", True)]
    assert all(r["files"] > 0 and r["bytes"] > 0 for r in rows)


def reconcile_runs(node: str) -> list:
    """The flow runs ``reconcile/<node>`` the server holds."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["reconcile"])),
                                     flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"reconcile/{node}"])))


def lost_event(settings, run: str, step: int, kind: str = "step") -> None:
    """A part committed on the node's Tier 0 whose event never came: committed longer ago than
    reconcile's grace (within it, the part is its event's)."""
    write_checkpoint(settings.tier0_url, run, step, shard_bytes=64 << 10, node=settings.node, kind=kind)
    committed_ago(settings.tier0_url, run, step, settings.reconcile_interval_seconds + 1)


def test_agent_reconcile_leaves_a_flow_run_only_when_it_acted(env_settings):
    """The agent's pass (``reconcile_pass``) that finds nothing leaves no flow run on the server;
    one that promotes leaves one, ``reconcile/<node>``, completed, holding the promotions table."""
    from prefect.artifacts import Artifact

    from flows.artifacts import artifact_key
    from flows.reconcile import reconcile_pass

    node = f"node-{uuid.uuid4().hex[:8]}"  # the server is the session's: this test's runs only
    settings = env_settings(node=node)
    assert not reconcile_pass(settings)[0].acted()
    assert not reconcile_pass(settings)[0].acted()
    assert reconcile_runs(node) == []

    write_checkpoint(settings.tier0_url, RUN, 10, shard_bytes=64 << 10, node=node)
    assert not reconcile_pass(settings)[0].acted()  # just committed: its event's, where an agent listens
    # `ckpt reconcile --every` (a node with no agent: nothing promotes on events) takes it at once
    assert reconcile_pass(settings, events=False)[0].promoted == [f"{RUN}/10 part 0"]
    (fr,) = reconcile_runs(node)
    assert fr.state_type.value == "COMPLETED", fr.state
    table = Artifact.get(artifact_key("reconcile-promotions", node))
    assert table is not None and table.flow_run_id == fr.id
    assert not reconcile_pass(settings)[0].acted()  # done: the next pass again leaves nothing
    assert len(reconcile_runs(node)) == 1


@pytest.fixture
def zygote():
    """The agent's zygote in this process for the test (``one_pass`` starts it), ended after."""
    from deployments.processes import Zygote, start_fork_server

    start_fork_server()
    yield
    Zygote.stop()


def test_an_agent_pass_whose_tier_hangs_is_stopped_and_the_next_pass_runs(env_settings, caplog, zygote):
    """The agent's pass runs in a child (``reconcile_loop.one_pass``): one whose Tier 1 stopped
    answering (reading its root's marker never returns, as on a hung mount) moves no byte, is
    stopped past ``copy_stall_seconds`` and leaves no run; the next pass runs and promotes."""
    import logging
    import os
    from pathlib import Path

    from deployments.processes import child_context
    from deployments.reconcile_loop import one_pass

    node = f"node-{uuid.uuid4().hex[:8]}"
    settings = env_settings(node=node)
    marker = Path(settings.tier1_url) / ".ckpt-tier.json"
    saved = marker.read_bytes()
    marker.unlink()
    os.mkfifo(marker)  # opened for reading, it waits for a writer that never comes
    lost_event(settings, RUN, 10)
    env = child_context()
    with caplog.at_level(logging.ERROR, logger="ckpt.agent.parts"):
        shown = one_pass(settings.model_copy(update={"copy_stall_seconds": 1.0}), env, {})
    assert f"reconcile pass on {node}: stalled, no byte moved" in caplog.text
    assert shown == {} and reconcile_runs(node) == []
    marker.unlink()
    marker.write_bytes(saved)
    one_pass(settings, env, shown)
    (fr,) = reconcile_runs(node)
    assert fr.state_type.value == "COMPLETED", fr.state
    assert replica_states(settings, RUN, 10)[(1, 0)] == "verified"


def test_an_agent_pass_failing_as_the_last_one_leaves_no_new_run_and_one_that_cleared_says_so(env_settings,
                                                                                               zygote):
    """Issue 40: passes in the agent's children (``one_pass``), the failures the last run showed
    kept by the agent: a tier unreachable leaves one red run, not one a pass; another failure
    leaves another; once it works again one run says the failures cleared; then nothing."""
    from pathlib import Path

    from deployments.processes import child_context
    from deployments.reconcile_loop import one_pass

    node = f"node-{uuid.uuid4().hex[:8]}"
    settings = env_settings(node=node)
    env, shown = child_context(), {}
    tier0, tier1 = Path(settings.tier0_url), Path(settings.tier1_url)

    def passes(n: int) -> None:
        nonlocal shown
        for _ in range(n):
            shown = one_pass(settings, env, shown)

    tier1.rename(tier1.with_name("tier1-away"))  # unmounted
    passes(3)
    assert [r.state_type.value for r in reconcile_runs(node)] == ["FAILED"]
    tier1.with_name("tier1-away").rename(tier1)
    tier0.rename(tier0.with_name("tier0-away"))
    passes(2)
    tier0.with_name("tier0-away").rename(tier0)
    passes(3)
    runs = sorted(reconcile_runs(node), key=lambda r: r.created)
    assert [r.state_type.value for r in runs] == ["FAILED", "FAILED", "COMPLETED"]
    assert "tier 1" in runs[0].state.message and "tier 0" in runs[1].state.message
    assert runs[0].state.message.startswith("1 item(s) failed: the pass: TierUnavailable: ")
    assert runs[2].state.message.startswith("cleared: the 1 failure(s) shown at ")


def test_an_item_failing_as_the_last_run_showed_is_one_line_of_the_log_and_no_run(env_settings):
    """A part that cannot be copied (its run's folder on Tier 1 is a file) fails every pass the
    same way: the first pass's run is red and its line (with the traceback) in the log; the next
    pass leaves no run and one line instead of the item's."""
    import logging
    from pathlib import Path

    from flows.reconcile import reconcile_pass

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(self.format(record))

    node = f"node-{uuid.uuid4().hex[:8]}"
    settings = env_settings(node=node)
    lost_event(settings, RUN, 10)
    (Path(settings.tier1_url) / RUN).write_text("a file where the run's folder goes")
    first, second = Lines(), Lines()
    pipeline = logging.getLogger("ckpt.pipeline")  # the pass's lines
    pipeline.addHandler(first)
    try:
        report, shown = reconcile_pass(settings)
        pipeline.removeHandler(first)
        pipeline.addHandler(second)
        again, kept = reconcile_pass(settings, shown)
    finally:
        pipeline.removeHandler(first)
        pipeline.removeHandler(second)
    assert [r.state_type.value for r in reconcile_runs(node)] == ["FAILED"]  # the first pass's only
    assert again.failed == report.failed and kept == shown
    (item,) = [line for line in first.lines if line.startswith(f"reconcile: {RUN}/10 part 0 failed: ")]
    assert "Traceback" in item
    (line,) = second.lines
    assert line.startswith(f"reconcile on {node}: the same 1 failure(s) as the run at "), line


class Killed(BaseException):
    """A process dies (not an error any code handles)."""


def test_a_checkpoint_run_its_dead_process_left_pending_is_crashed_once_reconcile_finishes_it(env_settings):
    """The agent's child that ran a checkpoint's promote run died after the part was complete on
    Tier 1 (the agent itself down too: nobody recorded the run's end): the run stays ``Pending``
    until reconcile finishes the checkpoint's follow-ups, then reads ``Crashed``, saying so."""
    import dataclasses

    from prefect.client.orchestration import get_client
    from prefect.states import Pending

    from deployments.agent import node_deployments
    from flows.common import plain_steps
    from flows.promote import followups_key, promote
    from flows.reconcile import reconcile_once

    run, node = f"run-{uuid.uuid4().hex[:8]}", f"node-{uuid.uuid4().hex[:8]}"  # keys are the server's
    settings = env_settings(node=node, runs=(run,))
    write_checkpoint(settings.tier0_url, run, 10, shard_bytes=64 << 10, node=node)
    steps = plain_steps()

    def hop_then_die(*args, **kwargs):
        steps.tier1_hop(*args, **kwargs)
        raise Killed

    with pytest.raises(Killed):
        promote(settings, run, 10, steps=dataclasses.replace(steps, tier1_hop=hop_then_die), node=node)
    with get_client(sync_client=True) as client:
        flow_run = client.create_flow_run_from_deployment(
            node_deployments(settings)[0].apply(), parameters={"run": run, "step": 10, "node": node},
            state=Pending(message="started by the agent"), idempotency_key=followups_key(run, 10))

        report = reconcile_once(settings, steps=plain_steps(), actor=f"reconcile/{node}")

        assert report.followed_up == [f"{run}/10"]
        state = client.read_flow_run(flow_run.id).state
    assert state is not None and state.is_crashed(), state
    assert f"reconcile/{node} finished the checkpoint's follow-ups at " in (state.message or "")


def test_a_failed_promote_run_that_reconcile_repaired_reads_repaired_on_the_status_page(env_settings):
    """A promote run that failed (its event came before the part was on Tier 0) stays red, and
    the run's status page, republished by the reconcile pass that then promoted the part, lists it
    as failed and repaired by ``reconcile/<node>``, with when; the checkpoint reads durable; the
    failed run's own Artifacts tab holds a note saying it was repaired, by which run."""
    from prefect.artifacts import Artifact

    from flows.artifacts import artifact_key
    from flows.promote import promote_checkpoint
    from flows.reconcile import reconcile_pass

    run, node = f"run-{uuid.uuid4().hex[:8]}", f"node-{uuid.uuid4().hex[:8]}"
    settings = env_settings(node=node, runs=(run,))
    state = promote_checkpoint(run=run, step=10, node=node, return_state=True)
    assert state.is_failed()
    lost_event(settings, run, 10)
    assert reconcile_pass(settings)[0].promoted == [f"{run}/10 part 0"]
    (fr,) = reconcile_runs(node)
    page = Artifact.get(artifact_key("run", run))
    assert page is not None and page.flow_run_id == fr.id  # republished by the pass's run
    text = str(page.data)
    assert "(every part verified on Tier 1): step **10**" in text
    row = next(line for line in text.splitlines() if f"`promote/{run}/step-10`" in line)
    assert f"failed, repaired by `reconcile/{node}` at " in row, text
    assert "**Late past the RPO** (" in text and "): none" in text
    # and the failed run itself, still red, says so in its Artifacts tab
    note = Artifact.get(artifact_key("repaired", run, 10))
    assert note is not None and note.flow_run_id == state.state_details.flow_run_id
    assert f"recorded by `reconcile/{node}`" in str(note.data) and f"in flow run `reconcile/{node}`" in str(note.data)
    assert flow_run_of(state).state_type.value == "FAILED"


def test_persistent_s3_failure_fails_the_flow_after_retries_and_keeps_tier0(env_settings, s3_endpoint, s3_bucket,
                                                                           monkeypatch, prefect_server):
    import functools

    from core.storage.s3 import S3Store
    from flows.promote import promote_checkpoint
    from tests.kit.s3 import FaultProxy

    monkeypatch.setattr(S3Store, "__init__", functools.partialmethod(S3Store.__init__, max_attempts=1))
    proxy = FaultProxy(s3_endpoint)
    try:
        settings = env_settings(tier2_url=f"s3://{s3_bucket}/vault", s3_endpoint_url=proxy.url,
                                task_retries=2, task_retry_delay_seconds=0.1)  # roots marked while S3 answers
        proxy.fail = -1
        write_checkpoint(settings.tier0_url, RUN, 100, kind="milestone")

        state = promote_checkpoint(RUN, 100, return_state=True)
    finally:
        proxy.close()

    assert state.is_failed()
    retried = [line for line in run_log(prefect_server, state.state_details.flow_run_id) if "; retry " in line]
    assert [line.split(":")[0] for line in retried] == ["tier1-to-tier2"] * 2, retried  # the first try, 2 retries
    states = replica_states(settings, RUN, 100)
    assert states[(0, 0)] == "verified" and states[(1, 0)] == "verified" and states[(2, 0)] != "verified"
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2  # Tier 0 not pruned


def test_event_parameters_arrive_as_strings_and_malformed_ones_fail_with_a_rejection(env_settings):
    """Deployment triggers render the event's values as strings and enforce no schema."""
    from core.errors import BadEvent
    from flows.promote import promote_checkpoint

    settings = env_settings()
    write_checkpoint(settings.tier0_url, RUN, 100)

    good = promote_checkpoint(RUN, "100", "0", "1", return_state=True)
    bad = promote_checkpoint(RUN, "", return_state=True)

    assert good.is_completed(), good.message
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    assert bad.is_failed()
    with pytest.raises(BadEvent):
        bad.result()
    # both named on the server by the flow's body, the failed one too
    assert flow_run_of(good).name == f"promote/{RUN}/step-100"
    assert flow_run_of(bad).name.startswith("promote/malformed-event/run=")
    cat = open_catalog(settings)
    try:
        assert any(e.action == "reject" and e.subject.startswith("event:promote") for e in cat.audit_log(limit=20))
    finally:
        cat.close()


def test_an_artifact_the_server_refuses_does_not_fail_a_promotion_that_succeeded(env_settings, monkeypatch):
    """Under a burst the orchestrator may answer 5xx to an artifact POST: the promotion is done and
    recorded in the catalog, so the run completes with a warning, not Failed."""
    import prefect.artifacts

    from flows.promote import promote_checkpoint

    def refused(*a, **k):
        raise httpx.HTTPStatusError("500 Internal Server Error", request=httpx.Request("POST", "http://x/artifacts/"),
                                    response=httpx.Response(500))

    settings = env_settings()
    write_checkpoint(settings.tier0_url, RUN, 100)
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact", refused)
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", refused)
    state = promote_checkpoint(RUN, 100, return_state=True)
    assert state.is_completed(), state.message
    assert set(replica_states(settings, RUN, 100).items()) >= {((0, 0), "verified"), ((1, 0), "verified")}


def test_an_unmounted_tier_is_in_the_servers_event_feed(env_settings, prefect_server):
    """A promotion on a node whose Tier 0 mount is missing (an empty folder in its place) fails
    with nothing judged, and ``ckpt.tier.unavailable`` reaches the server's event feed, what the
    UI's event page lists, on the tier's resource with its labels."""
    import shutil
    from pathlib import Path

    from core import events
    from flows.promote import promote_checkpoint

    node = f"node-{uuid.uuid4().hex[:8]}"  # the event's id is per tier, node and hour: keep it new
    settings = env_settings(node=node)
    write_checkpoint(settings.tier0_url, RUN, 100)
    root = Path(settings.tier0_url)
    shutil.move(str(root), str(root.with_name(root.name + "-mounted")))
    root.mkdir()  # the mount point as the node shows it without its NVMe

    state = promote_checkpoint(RUN, 100, return_state=True)

    assert not state.is_completed()
    with open_catalog(settings) as cat:  # nothing was read on the stand-in, so nothing registered or judged
        assert [ck.step for ck in cat.list_checkpoints(RUN)] == []
    body = {"filter": {"event": {"name": [events.TIER_UNAVAILABLE]},
                       "resource": {"id": [events.tier_resource_id(0, node)]}}, "limit": 5}
    deadline = time.monotonic() + 30
    while True:
        resp = httpx.post(f"{prefect_server}/events/filter", json=body, timeout=10)
        resp.raise_for_status()
        seen = resp.json()["events"]
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(seen) == 1, seen
    assert seen[0]["resource"]["ckpt.tier"] == "0" and seen[0]["resource"]["ckpt.node"] == node
    assert "no identity marker" in seen[0]["payload"]["reason"]


def test_a_deployment_registered_in_a_git_checkout_keeps_its_flows_version(settings_factory, prefect_server,
                                                                          tmp_path, monkeypatch):
    """An agent started in a git checkout registers its deployments with their flow's version
    (a hash of its source), not the checkout's commit: the version says what code runs."""
    import subprocess

    from prefect.client.orchestration import get_client

    from deployments.agent import node_deployments
    from flows.promote import promote_checkpoint

    repo = tmp_path / "checkout"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "a commit"], check=True)
    subprocess.run([*git, "remote", "add", "origin", "https://git.example.com/team/train.git"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(repo)
    deployment = node_deployments(settings_factory(node=f"node-{uuid.uuid4().hex[:8]}"))[0]
    with get_client(sync_client=True) as client:
        registered = client.read_deployment(deployment.apply())
    assert registered.version == promote_checkpoint.version
    assert commit[:8] not in (registered.version or "")
