"""``ckpt.tier.over_budget`` from the retention flow reaches the real Prefect server's event feed
(what the UI's event page lists) on the tier's resource, with the numbers; the flow run's
artifact names the tier over budget and its line says which rules hold the excess."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from core.events import auth_headers
from tests.kit.checkpoints import write_checkpoint
from tests.kit.pipeline import pipeline_settings

pytestmark = pytest.mark.prefect
RUN = "budget-run"


def over_budget_events(api: str) -> list[dict]:
    body = {"filter": {"event": {"name": ["ckpt.tier.over_budget"]}, "resource": {"id": ["ckpt.tier.1"]}},
            "limit": 10}
    r = httpx.post(f"{api}/events/filter", json=body, timeout=10, headers=auth_headers())
    r.raise_for_status()
    return r.json()["events"]


def test_a_tier_whose_rules_keep_more_than_its_budget_is_in_the_event_feed(prefect_server, settings_factory,
                                                                            sqlite_url, monkeypatch):
    from prefect.artifacts import Artifact

    from flows.common import plain_steps
    from flows.promote import promote
    from flows.retention import enforce_retention

    settings = pipeline_settings(settings_factory, sqlite_url, runs=(RUN,))
    for step in (1, 2, 3):
        write_checkpoint(Path(settings.tier0_url), RUN, step, shard_bytes=16 << 10)
        promote(settings, RUN, step, steps=plain_steps())
    for key, value in {"DATA_DIR": settings.data_dir, "NODE": settings.node, "CATALOG_URL": settings.catalog_url,
                       "TIER0_URL": settings.tier0_url, "TIER1_URL": settings.tier1_url,
                       "RETENTION_TIER1__KEEP_LAST": 10, "RETENTION_TIER1__MAX_BYTES": "1KB"}.items():
        monkeypatch.setenv(f"CKPT_{key}", str(value))

    rows = enforce_retention()

    [line] = [r for r in rows if r["action"] == "over budget"]
    assert line["tier"] == 1 and line["reason"].startswith("held by keep_last (")
    artifact = Artifact.get("retention-result-all")
    assert artifact is not None and artifact.description.endswith("; over budget: tier 1")
    deadline = time.monotonic() + 30
    while not (seen := over_budget_events(prefect_server)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(seen) == 1
    assert seen[0]["resource"]["ckpt.tier"] == "1"
    payload = seen[0]["payload"]
    assert payload["max_bytes"] == 1000 and payload["kept_bytes"] == line["bytes"] > 1000
    assert set(payload["held_by"]) == {"keep_last", "newest verified"}
