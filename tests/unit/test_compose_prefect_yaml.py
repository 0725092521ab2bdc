"""deployments/prefect.yaml (work pools and workers) describes the same deployments as
`ckpt agent`: the same flows, names, triggers, templates and schedules (no trigger makes a
promote run: the node's agent starts a checkpoint's one run itself)."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import yaml

from core import events
from core.settings import Settings
from deployments import names

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-node-07"


@pytest.fixture
def deployments(monkeypatch):
    """The deployments as `prefect deploy` sees them after filling in the environment."""
    from prefect.utilities.templating import apply_values

    monkeypatch.setenv("CKPT_NODE", NODE)
    doc = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    return apply_values(doc["deployments"], os.environ, remove_notset=False)


def _flow(entrypoint: str):
    from prefect.flows import load_flow_from_entrypoint

    cwd = os.getcwd()
    os.chdir(ROOT)  # file-path entrypoints are relative to the project (the worker's /app)
    try:
        return load_flow_from_entrypoint(entrypoint)
    finally:
        os.chdir(cwd)


def _by_full_name(deployments) -> dict[str, dict]:
    return {f"{_flow(d['entrypoint']).name}/{d['name']}": d for d in deployments}


def test_names_match_the_served_agent(deployments):
    assert set(_by_full_name(deployments)) == {
        names.promote_deployment(NODE),
        names.ARCHIVE_DEPLOYMENT, names.RETENTION_DEPLOYMENT, names.SCRUB_DEPLOYMENT, names.DRILL_DEPLOYMENT,
    }


def test_triggers_validate_and_template_every_key_with_a_default(deployments):
    from prefect.events.schemas.deployment_triggers import DeploymentTriggerTypes
    from pydantic import TypeAdapter

    adapter = TypeAdapter(DeploymentTriggerTypes)
    by_name = _by_full_name(deployments)
    promote = by_name[names.promote_deployment(NODE)]
    archive = by_name[names.ARCHIVE_DEPLOYMENT]
    assert "triggers" not in promote  # an event is never a promote run of its own
    (at,) = archive["triggers"]
    trigger = adapter.validate_python(at)  # what `prefect deploy` does with it
    for key, template in trigger.parameters.items():
        if "event." in template:
            assert "| default(" in template, f"{key}: a missing key would silently drop the run"
    assert at["expect"] == [events.DURABLE] and at["parameters"] == names.ARCHIVE_PARAMETERS
    # raw values pass through; the flows validate them (a failed run, not a dropped one)
    assert promote["enforce_parameter_schema"] is False and archive["enforce_parameter_schema"] is False


def test_parameters_are_the_flows_own(deployments):
    for d in deployments:
        params = set(inspect.signature(_flow(d["entrypoint"]).fn).parameters)
        given = set(d.get("parameters") or {}) | {k for t in d.get("triggers", []) for k in t["parameters"]}
        assert given <= params, (d["entrypoint"], given - params)


def test_schedules_and_queues(deployments):
    by_name = _by_full_name(deployments)
    defaults = Settings(data_dir=Path("/tmp"))
    assert by_name[names.RETENTION_DEPLOYMENT]["schedules"] == [{"cron": defaults.retention_cron}]
    assert by_name[names.SCRUB_DEPLOYMENT]["schedules"] == [{"cron": defaults.scrub_cron}]
    assert by_name[names.DRILL_DEPLOYMENT]["schedules"] == [{"cron": defaults.drill_cron}]
    queues = {name: d["work_pool"]["work_queue_name"] for name, d in by_name.items()}
    assert queues[names.promote_deployment(NODE)] == NODE
    cluster_wide = (names.ARCHIVE_DEPLOYMENT, names.RETENTION_DEPLOYMENT,
                    names.SCRUB_DEPLOYMENT, names.DRILL_DEPLOYMENT)
    assert [queues[n] for n in cluster_wide] == [names.CLUSTER] * len(cluster_wide)


def test_schedules_equal_the_agents_with_default_settings(deployments, settings_factory):
    """Every schedule in the file is the one `ckpt agent` serves with default settings."""
    from deployments.agent import build_deployments

    def plain(schedule) -> dict:
        s = schedule.schedule
        return {"cron": s.cron} if hasattr(s, "cron") else {"interval": int(s.interval.total_seconds())}

    served = {f"{d.flow_name}/{d.name}": [plain(s) for s in d.schedules]
              for d in build_deployments(settings_factory(node=NODE))}
    in_file = {name: d.get("schedules", []) for name, d in _by_full_name(deployments).items()}
    assert in_file == served


def test_agent_builds_the_same_triggers(settings_factory):
    from deployments.agent import build_deployments

    built = {f"{d.flow_name}/{d.name}": d for d in build_deployments(settings_factory(node=NODE))}
    promote = built[names.promote_deployment(NODE)]
    assert promote.triggers == [] and promote.enforce_parameter_schema is False
    assert set(built) == {names.promote_deployment(NODE),
                          names.ARCHIVE_DEPLOYMENT, names.RETENTION_DEPLOYMENT,
                          names.SCRUB_DEPLOYMENT, names.DRILL_DEPLOYMENT}
    node_only = build_deployments(settings_factory(node=NODE), node_only=True)
    assert {f"{d.flow_name}/{d.name}" for d in node_only} == {names.promote_deployment(NODE)}
