"""What `ckpt agent` serves, read off the deployments it builds (no Prefect server): the
scheduled scrub and restore drill run cluster-wide on the configured crons; no event makes a
promote run."""

from __future__ import annotations

import importlib
import inspect

from deployments import names
from deployments.agent import build_deployments

NODE = "gpu-node-07"


def _by_full_name(deps) -> dict:
    return {f"{d.flow_name}/{d.name}": d for d in deps}


def _crons(deployment) -> list[str]:
    return [s.schedule.cron for s in deployment.schedules]


def test_scrub_and_drill_run_on_the_configured_crons(settings_factory):
    settings = settings_factory(node=NODE, scrub_cron="17 2 * * *", drill_cron="45 5 * * 6")
    built = _by_full_name(build_deployments(settings))
    scrub, drill = built[names.SCRUB_DEPLOYMENT], built[names.DRILL_DEPLOYMENT]
    assert _crons(scrub) == ["17 2 * * *"] and _crons(drill) == ["45 5 * * 6"]
    assert all(s.active for s in scrub.schedules + drill.schedules)
    # no fixed parameters: the flows' defaults (scrub_fraction, repair, newest milestone) apply
    assert scrub.parameters == {} and drill.parameters == {}
    assert scrub.triggers == [] and drill.triggers == []


def test_scrub_and_drill_entrypoints_are_the_flows_the_runner_imports(settings_factory):
    built = _by_full_name(build_deployments(settings_factory(node=NODE)))
    for full_name in (names.SCRUB_DEPLOYMENT, names.DRILL_DEPLOYMENT):
        module, attr = built[full_name].entrypoint.rsplit(".", 1)
        flow = getattr(importlib.import_module(module), attr)
        assert f"{flow.name}/{names.CLUSTER}" == full_name
        # a scheduled run passes nothing: every parameter must have a default
        assert all(p.default is not inspect.Parameter.empty for p in inspect.signature(flow.fn).parameters.values())


def test_node_only_agent_serves_no_scrub_and_no_drill(settings_factory):
    settings = settings_factory(node=NODE)
    built = _by_full_name(build_deployments(settings, node_only=True))
    assert names.SCRUB_DEPLOYMENT not in built and names.DRILL_DEPLOYMENT not in built
    assert set(built) == {names.promote_deployment(NODE)}  # reconcile runs in the agent: no deployment
    # and without --no-archive-trigger or with it, the cluster agent serves both
    for archive_trigger in (True, False):
        cluster = _by_full_name(build_deployments(settings, archive_trigger=archive_trigger))
        assert {names.SCRUB_DEPLOYMENT, names.DRILL_DEPLOYMENT} <= set(cluster)


def test_archive_trigger_fires_only_for_durable_milestones(settings_factory):
    from prefect.events.schemas.events import Resource

    from core import events

    built = _by_full_name(build_deployments(settings_factory(node=NODE)))
    (trigger,) = built[names.ARCHIVE_DEPLOYMENT].triggers
    assert trigger.expect == {events.DURABLE}

    def fires(milestone: bool) -> bool:
        ev = events.build_event(events.DURABLE, "run-a", 5, payload={"milestone": milestone},
                                labels={"milestone": str(milestone).lower()})
        return trigger.match.matches(Resource(ev["resource"]))

    assert fires(True) and not fires(False)


def test_malformed_events_name_their_promote_runs_readably():
    from flows.promote import run_name

    assert run_name({"run": "run-a", "step": "12", "part": "0", "parts": "1"}) == "promote/run-a/step-12"
    assert run_name({"run": "run-a", "step": 12, "part": 1, "parts": 2}) == "promote/run-a/step-12/part-1-of-2"
    bad = run_name({"run": "", "step": "", "part": 0, "parts": 1})
    assert bad.startswith("promote/malformed-event/") and "//" not in bad


def test_the_promote_deployment_has_no_trigger(settings_factory):
    """The agent takes its parts' events itself (deployments/part_events.py): an event is never
    also a run; a checkpoint's one run is the one the agent creates."""
    built = _by_full_name(build_deployments(settings_factory(node=NODE), node_only=True))
    assert built[names.promote_deployment(NODE)].triggers == []


def test_a_node_agent_polls_the_server_slowly_unless_told(monkeypatch):
    """A node's runner only finds runs asked for by hand, and every poll is server work from every
    node: a node's agent polls every 30 s; the cluster's keeps Prefect's default; the
    environment's ``PREFECT_RUNNER_POLL_FREQUENCY`` wins for both (the local stack's fast poll)."""
    from prefect.runner import Runner

    from deployments.agent import runner_poll

    monkeypatch.delenv("PREFECT_RUNNER_POLL_FREQUENCY", raising=False)
    assert Runner(**runner_poll(True)).query_seconds == 30
    assert Runner(**runner_poll(False)).query_seconds == Runner().query_seconds  # Prefect's own
    monkeypatch.setenv("PREFECT_RUNNER_POLL_FREQUENCY", "2")
    assert runner_poll(True) == {} and runner_poll(False) == {}


def test_each_deployment_is_versioned_by_its_flow_not_by_a_git_checkout(settings_factory):
    """The agent's deployments carry their flow's version (a hash of its source) as a simple
    version: registering them asks no git checkout the agent happens to start in."""
    from deployments.agent import serving_line

    deps = build_deployments(settings_factory(node=NODE))
    for d in deps:
        flow = getattr(importlib.import_module(d.entrypoint.rsplit(".", 1)[0]), d.entrypoint.rsplit(".", 1)[1])
        assert d.version_type == "prefect:simple" and d.version == flow.version and d.version
    said = serving_line(deps)  # the agent's one line once it serves, each deployment named
    assert all(name in said for name in _by_full_name(deps))
