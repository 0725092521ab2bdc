"""``ckpt tiers`` over what the real pipeline recorded: a promotion's hop into Tier 1 is timed
(duration and first-byte latency) on its replica and shows in the matrix; a Tier 1 mount gone
from this node is a row marked unavailable while the catalog's figures stand. Real files, the
real pipeline, a real catalog on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckpt.cli import app
from db.catalog import Catalog
from tests.kit.restore import commit_folder, on_node, promote, scenario_settings

RUN = "run-a"


def for_the_cli(s, monkeypatch):
    """``s`` as the CLI reads it (the environment)."""
    for name in ("catalog_url", "data_dir", "node", "tier0_url", "tier1_url", "tier2_url", "s3_endpoint_url"):
        if getattr(s, name):
            monkeypatch.setenv(f"CKPT_{name.upper()}", str(getattr(s, name)))
    monkeypatch.setenv("COLUMNS", "200")
    return s


@pytest.fixture
def settings(settings_factory, db_url, monkeypatch):
    return for_the_cli(scenario_settings(settings_factory, db_url), monkeypatch)


def tiers_json() -> dict[int, dict]:
    result = CliRunner().invoke(app, ["tiers", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return {r["tier"]: r for r in json.loads(result.output)["tiers"]}


def test_a_promotion_s_hop_is_timed_and_shows_in_the_matrix(settings):
    commit_folder(settings, RUN, 100, {"model.bin": os.urandom(3_000_000)})
    promote(settings, RUN, 100)
    with Catalog(settings.catalog_url) as cat:
        rep = cat.replicas(cat.get_checkpoint(RUN, 100).id, tier=1)[0]
        first = cat.hop_timings(86_400)[0]
    assert rep.state == "verified" and rep.copy_seconds > 0
    assert first.tier == 1 and 0 < first.first_byte_seconds <= rep.copy_seconds  # recorded where the hop is timed

    rows = tiers_json()
    t1 = rows[1]
    assert t1["identity"] == "proven" and (t1["checkpoints"], t1["stored_bytes"]) == (1, 3_000_000)
    assert t1["write_bytes_per_s"]["count"] == 1
    assert t1["write_bytes_per_s"]["median"] == pytest.approx(3_000_000 / rep.copy_seconds)
    assert t1["first_byte_seconds"]["median"] == pytest.approx(first.first_byte_seconds)
    assert rows[0]["checkpoints"] == 1 and rows[0]["write_bytes_per_s"] is None  # the job's write is no hop


def test_a_tier1_mount_gone_is_a_row_marked_unavailable(settings):
    commit_folder(settings, RUN, 100, {"model.bin": os.urandom(100_000)})
    promote(settings, RUN, 100)
    root = Path(settings.tier1_url)
    aside = root.with_name(root.name + "-mounted")
    root.rename(aside)
    root.mkdir()  # the node's own empty folder where the mount was
    try:
        rows = tiers_json()
        assert rows[1]["identity"] == "unavailable" and "identity marker" in rows[1]["detail"]
        assert rows[1]["checkpoints"] == 1  # the catalog's record stands
        assert list(root.iterdir()) == []  # nothing written on the node's own disk
        shown = CliRunner().invoke(app, ["tiers"], catch_exceptions=False)
        assert shown.exit_code == 0 and "unavailable" in shown.output
    finally:
        root.rmdir()
        aside.rename(root)
    assert tiers_json()[1]["identity"] == "proven"  # mounted again


def test_a_milestone_s_archive_is_timed_and_priced_on_tier2(settings_factory, db_url, s3_endpoint, s3_bucket,
                                                             monkeypatch):
    settings = for_the_cli(scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint,
                                             s3_bucket=s3_bucket), monkeypatch)
    monkeypatch.setenv("CKPT_TIER2_PRICE_GB_MONTH", "1000")
    commit_folder(settings, RUN, 100, {"model.bin": os.urandom(2_000_000)}, milestone=True)
    promote(settings, RUN, 100)
    t2 = tiers_json()[2]
    assert t2["identity"] == "proven" and t2["url"] == f"s3://{s3_bucket}/ckpt"
    assert (t2["checkpoints"], t2["stored_bytes"]) == (1, 2_000_000)
    assert t2["write_bytes_per_s"]["count"] == 1 and t2["first_byte_seconds"]["count"] == 1
    assert t2["monthly_cost"] == pytest.approx(2_000_000 / 1e9 * 1000)


def test_tier0_s_budget_is_each_node_s_and_shows_the_fullest_node(settings_factory, db_url, monkeypatch):
    """Tier 0 is each node's own disk and its budget is per node: the matrix shows the use of the
    node storing the most, not every node's bytes over one node's budget."""
    from core.settings import RetentionPolicy

    s = for_the_cli(scenario_settings(settings_factory, db_url,
                                      retention_tier0=RetentionPolicy(enabled=False, max_bytes=1_000_000)), monkeypatch)
    monkeypatch.setenv("CKPT_RETENTION_TIER0__MAX_BYTES", "1000000")
    other = on_node(s, "node-b")
    commit_folder(s, RUN, 100, {"part-00000/model.bin": os.urandom(300_000)}, part=0, parts=2)
    commit_folder(other, RUN, 100, {"part-00001/model.bin": os.urandom(600_000)}, part=1, parts=2)
    promote(s, RUN, 100, 0, 2)
    promote(other, RUN, 100, 1, 2)

    t0 = tiers_json()[0]
    assert t0["stored_bytes"] == 900_000 and t0["budget_bytes"] == 1_000_000
    assert t0["budget_node"] == "node-b" and t0["budget_used"] == pytest.approx(0.6)  # not 0.9
    shown = CliRunner().invoke(app, ["tiers"], catch_exceptions=False).output
    assert "60.0%" in shown and "the fullest node's, node-b" in shown, shown
