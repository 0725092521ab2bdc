"""A tier's byte budget applied (``max_bytes``): the oldest copies a tier keeps only as
``retention off`` go, through the guarded prune, until the rest fits; a tier whose rules keep
more than its budget loses nothing to it, and says so: ``ckpt.tier.over_budget`` with the
numbers, a line of the plan that names the rules holding the excess (``ckpt retention --dry-run``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core import events
from core.events import announcing
from core.settings import RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from flows.retention import run_retention
from tasks.retention import KEPT, OVER_BUDGET, PRUNED
from tests.kit.checkpoints import ckpt_dir, open_catalog, replica_states, write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-b"
STEPS = (10, 20, 30, 40, 50)
OFF = RetentionPolicy(enabled=False)


@pytest.fixture
def settings(settings_factory, db_url):
    """Five durable checkpoints; the promotions prune nothing by themselves."""
    s = pipeline_settings(settings_factory, db_url, retention_tier0=OFF, retention_tier1=OFF)
    for step in STEPS:
        write_checkpoint(Path(s.tier0_url), RUN, step, shard_bytes=16 << 10)
        promote(s, RUN, step, steps=plain_steps())
    return s


def copy_bytes(settings) -> int:
    """What one checkpoint's Tier 1 copy holds, as the catalog recorded it (all are alike)."""
    with open_catalog(settings) as cat:
        sizes = {r.bytes for c in cat.retention_facts(run=RUN) for r in c.replicas if r.tier == 1}
    assert len(sizes) == 1 and None not in sizes
    return sizes.pop()


def held(settings, n: int) -> int:
    """What ``n`` of the fixture's checkpoints hold on Tier 1, which stores each content once:
    each its own shards, and the HF index, alike at every step, once for all of them."""
    index = (ckpt_dir(settings.tier1_url, RUN, STEPS[-1]) / "model.safetensors.index.json").stat().st_size
    return n * copy_bytes(settings) - (n - 1) * index


class Heard:
    """The events the steps announce, with their payloads and labels."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, name: str, run: str, step: int, **kw: Any) -> bool:
        self.seen.append({"event": name, **kw})
        return True

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["event"] == name]


def test_the_oldest_copies_kept_only_as_retention_off_go_until_the_tier_fits(settings):
    size = copy_bytes(settings)
    budget = 2 * size + size // 2
    tight = settings.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1),
                                        "retention_tier1": RetentionPolicy(enabled=False, max_bytes=budget)})
    heard = Heard()

    with announcing(heard):
        done = run_retention(tight, steps=plain_steps())

    gone = {(a.tier, a.step): (a.action, a.reason, a.outcome) for a in done}
    over = f"over budget ({held(settings, 5)} of {budget} bytes)"
    assert {k for k, (action, _, _) in gone.items() if action == "retire"} == {(t, s) for t in (0, 1)
                                                                                for s in (10, 20, 30)}
    assert all(reason == over and outcome == PRUNED for action, reason, outcome in gone.values() if action == "retire")
    for s in (10, 20, 30):
        assert not ckpt_dir(settings.tier1_url, RUN, s).exists()
        assert set(replica_states(settings, RUN, s).values()) == {"pruned"}
    for s in (40, 50):
        assert ckpt_dir(settings.tier1_url, RUN, s).is_dir()
        assert replica_states(settings, RUN, s)[(1, 0)] == "verified"
    assert heard.named(events.TIER_OVER_BUDGET) == []  # it fits now
    assert run_retention(tight, steps=plain_steps()) == []  # and the next pass has nothing to do


def test_rules_that_keep_more_than_the_budget_keep_it_all_and_raise_the_alert(settings, monkeypatch):
    import flows.retention

    shown: list[tuple[str, str]] = []
    monkeypatch.setattr(flows.retention, "publish_table", lambda key, _rows, text: shown.append((key, text)))
    size, three = copy_bytes(settings), held(settings, 3)
    tight = settings.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1),
                                        "retention_tier1": RetentionPolicy(keep_last=3, max_bytes=size)})
    heard = Heard()

    with announcing(heard):
        done = run_retention(tight, steps=plain_steps())

    assert {(a.step, a.reason) for a in done if a.tier == 1 and a.action != OVER_BUDGET} == {
        (10, "no tier keeps it"), (20, "no tier keeps it")}  # keep_last's own, not the budget's
    line = [a for a in done if a.action == OVER_BUDGET]
    assert [(a.tier, a.outcome, a.reason) for a in line] == [
        (1, KEPT, f"held by keep_last ({three} bytes), newest verified ({size} bytes)")]
    for s in (30, 40, 50):
        assert replica_states(settings, RUN, s)[(1, 0)] == "verified"
    [alert] = heard.named(events.TIER_OVER_BUDGET)
    assert alert["payload"] | {"held_by": None} == {"tier": 1, "tier_node": "", "max_bytes": size,
                                                    "kept_bytes": three, "wanted_bytes": three,
                                                    "held_by": None}
    assert alert["payload"]["held_by"] == {"keep_last": three, "newest verified": size}
    assert alert["labels"] == {"tier": 1} and alert["resource_id"] == "ckpt.tier.1"
    assert shown == [("retention-result-all", "retention applied to all runs; over budget: tier 1")]  # the UI's


def test_the_dry_run_explains_what_goes_for_the_budget_and_what_holds_the_excess(settings, monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from ckpt.cli import app

    size = copy_bytes(settings)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    env = {"CKPT_DATA_DIR": str(settings.data_dir), "CKPT_NODE": settings.node,
           "CKPT_CATALOG_URL": settings.catalog_url, "CKPT_TIER0_URL": settings.tier0_url,
           "CKPT_TIER1_URL": settings.tier1_url, "CKPT_RETENTION_TIER0__KEEP_LAST": "1", "COLUMNS": "200"}
    off = {**env, "CKPT_RETENTION_TIER1__ENABLED": "false", "CKPT_RETENTION_TIER1__MAX_BYTES": str(3 * size)}
    rules = {**env, "CKPT_RETENTION_TIER1__KEEP_LAST": "4", "CKPT_RETENTION_TIER1__MAX_BYTES": f"{size / 1000}KB"}

    def dry_run(env: dict[str, str], *args: str) -> str:
        with temporary_settings(updates={PREFECT_API_URL: None}):
            out = CliRunner().invoke(app, ["retention", "--dry-run", *args], env=env)
        assert out.exit_code == 0, out.output
        return out.stdout

    five, four = held(settings, 5), held(settings, 4)
    over = f"over budget ({five} of {3 * size} bytes)"
    explained = {(r["tier"], r["step"]): (r["action"], r["reason"])
                 for r in json.loads(dry_run(off, "--explain", "--json"))}
    assert explained == {(0, s): ("retire", over) for s in (10, 20)} | {(1, s): ("retire", over) for s in (10, 20)} | {
        (0, 30): ("demote", "not kept on tier 0"), (1, 30): ("keep", "retention off"),
        (1, 40): ("keep", "retention off"), (0, 40): ("demote", "not kept on tier 0"),
        (0, 50): ("keep", "newest verified, keep_last"), (1, 50): ("keep", "newest verified, retention off")}
    assert over in dry_run(off, "--explain")

    rows = json.loads(dry_run(rules, "--json"))
    holding = f"held by keep_last ({four} bytes), newest verified ({size} bytes)"
    assert [(r["tier"], r["reason"], r["detail"]) for r in rows if r["action"] == OVER_BUDGET] == [
        (1, holding, f"{four} of {size} bytes kept; nothing a rule keeps goes for the budget")]
    assert "held by keep_last" in dry_run(rules)
    assert all(replica_states(settings, RUN, s)[(1, 0)] == "verified" for s in STEPS)  # dry runs
