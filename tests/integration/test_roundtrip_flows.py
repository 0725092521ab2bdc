"""The restore, scrub and drill flows on the session's real Prefect server: they run, publish
their figures as artifacts, and a failure that needs a human fails the run (shown red)."""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid

import pytest

from tests.kit.checkpoints import flip_bit
from tests.kit.restore import commit_folder, promote, scenario_settings, tier0_dir, tier1_dir

pytestmark = [pytest.mark.prefect, pytest.mark.slow]


def events_named(api_url: str, name: str, run: str, timeout: float = 15.0) -> list[dict]:
    """Events of ``name`` about ``run`` as the server stored them (delivery is asynchronous)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(f"{api_url}/events/filter", json={"filter": {"event": {"name": [name]}}, "limit": 50})
        r.raise_for_status()
        found = [e for e in r.json()["events"] if e["resource"].get("ckpt.run") == run]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def artifacts(key: str) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async def read():
        async with get_client() as c:
            return await c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    return asyncio.run(read())


def export_settings(monkeypatch, settings) -> None:
    """Flows read their settings from the environment (never a flow parameter): export these."""
    import json

    for name, value in settings.model_dump(mode="json").items():
        if value is not None:
            monkeypatch.setenv(f"CKPT_{name.upper()}",
                               json.dumps(value) if isinstance(value, (dict, list)) else str(value))


def stored_flow_run_parameters() -> list[dict]:
    """Every flow run's parameters as the Prefect server stored them."""
    from prefect import get_client

    async def read():
        async with get_client() as c:
            return [fr.parameters for fr in await c.read_flow_runs(limit=200)]

    return asyncio.run(read())


@pytest.fixture
def settings(prefect_server, settings_factory, db_url, s3_endpoint, s3_bucket, monkeypatch):
    built = scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket)
    export_settings(monkeypatch, built)
    return built


def test_restore_scrub_and_drill_flows_run_and_publish_their_figures(settings, tmp_path, prefect_server):
    from flows.drill import drill_flow
    from flows.restore import restore_flow
    from flows.scrub import scrub_flow

    run = f"flow-{uuid.uuid4().hex[:8]}"
    files = {"w.bin": os.urandom(300_000)}
    commit_folder(settings, run, 100, files, milestone=True)
    promote(settings, run, 100)
    shutil.rmtree(tier0_dir(settings, run, 100))

    out = restore_flow(run, str(tmp_path / "r"))
    assert (out["step"], out["tiers"]) == (100, [1])
    assert (tmp_path / "r" / "w.bin").read_bytes() == files["w.bin"]
    assert artifacts(f"restore-{run}")
    [restored] = events_named(prefect_server, "ckpt.checkpoint.restored", run)
    assert restored["payload"]["tiers"] == [1] and restored["payload"]["bytes"] == 300_000
    [missing] = events_named(prefect_server, "ckpt.checkpoint.corrupt", run)
    assert (missing["payload"]["tier"], missing["payload"]["state"]) == (0, "missing")

    drills = drill_flow(scratch=str(tmp_path / "scratch"))
    assert [(d["tier"], d["ok"]) for d in drills] == [(1, True), (2, True)]
    assert [a for a in artifacts("restore-drill") if run in str(a.data)]

    flip_bit(tier1_dir(settings, run, 100) / "w.bin", -1)
    found = scrub_flow(fraction=1.0)
    assert (found["bad"], found["repaired"]) == (1, 1)  # repaired from Tier 2
    assert (tier1_dir(settings, run, 100) / "w.bin").read_bytes() == files["w.bin"]
    assert artifacts("scrub")

    # what Prefect stored for these runs holds no catalog URL or credential
    stored = str(stored_flow_run_parameters())
    for secret in (settings.catalog_url, os.environ["AWS_SECRET_ACCESS_KEY"], "catalog_url"):
        assert secret not in stored


def test_scrub_flow_fails_when_a_bad_copy_cannot_be_repaired(settings):
    from prefect.states import State

    from flows.scrub import scrub_flow

    run = f"flow-{uuid.uuid4().hex[:8]}"
    commit_folder(settings, run, 100, {"w.bin": os.urandom(1000)})
    promote(settings, run, 100)
    shutil.rmtree(tier0_dir(settings, run, 100))
    flip_bit(tier1_dir(settings, run, 100) / "w.bin", -1)

    state: State = scrub_flow(fraction=1.0, return_state=True)

    assert state.is_failed()
    assert "could not be repaired" in state.message


def test_drill_flow_fails_when_nothing_could_be_drilled(settings):
    from prefect.states import State

    from flows.drill import drill_flow

    state: State = drill_flow(scratch="unused", return_state=True)  # no milestone in this catalog

    assert state.is_failed()
    assert "nothing was drilled" in state.message and "no committed milestone" in state.message
