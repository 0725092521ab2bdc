"""``ckpt tiers``: the storage matrix from a catalog with recorded hops, through the real CLI on
a real catalog (SQLite and PostgreSQL): what each tier holds, the last day's bandwidths and
first-byte latencies, and the monthly cost at the configured prices."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import update

from db.catalog import Catalog
from db.clock import host_now
from db.models import Replica
from tests.kit.catalog import catalog_cli, checkpoint, timed_hop

GB = 10**9
RUN = "base"


def story(cat: Catalog) -> None:
    """Two 5 GB checkpoints copied to Tier 1 today at 2.5 and 1 GB/s (first byte 10 and 50 ms),
    the newer one archived to Tier 2 at 100 MB/s and drilled from Tier 1 at 1.25 GB/s, and held
    on Tier 0 (its verify, no hop into Tier 0); a third copied to Tier 1 two days ago, at 50
    GB/s, which the last day's figures leave out but the holdings count."""
    size = 5 * GB // 2  # two files a checkpoint
    old = checkpoint(cat, RUN, 5, size=size)
    long_ago = timed_hop(cat, old.id, 1, seconds=0.1, first_byte=0.001)
    with cat.engine.begin() as conn:
        conn.execute(update(Replica.__table__).where(Replica.__table__.c.id == long_ago.id)
                     .values(verified_at=host_now() - timedelta(days=2)))
    a, b = checkpoint(cat, RUN, 10, size=size), checkpoint(cat, RUN, 20, size=size)
    timed_hop(cat, a.id, 1, seconds=2.0, first_byte=0.01)
    timed_hop(cat, b.id, 1, seconds=5.0, first_byte=0.05)
    timed_hop(cat, b.id, 2, seconds=50.0, first_byte=0.2)
    timed_hop(cat, b.id, 0, seconds=None)
    cat.record_drill(RUN, 20, 1, ok=True, seconds=4.0, bytes=5 * GB, actor="test")
    cat.record_drill(RUN, 20, 1, ok=False, seconds=0.1, bytes=5 * GB, actor="test")  # a failed one: no figure


@pytest.fixture
def cli(catalog, db_url, monkeypatch, tmp_path):
    return catalog_cli(monkeypatch, tmp_path, db_url, NODE="node-0", TIER1_PRICE_GB_MONTH="2.5",
                       TIER2_PRICE_GB_MONTH="0.01")


def test_matrix_rows_hold_the_catalog_s_numbers(cli, catalog):
    story(catalog)
    out = json.loads(cli("tiers", "--json"))
    assert out["window_seconds"] == 86400
    rows = {r["tier"]: r for r in out["tiers"]}
    assert sorted(rows) == [0, 1, 2]

    t1 = rows[1]
    assert (t1["checkpoints"], t1["logical_bytes"], t1["stored_bytes"], t1["dedup_ratio"]) == (3, 15 * GB, 15 * GB, 1.0)
    # 2.5 and 1 GB/s today; the p95 is what 95 % of the hops reached (the slower); two days ago left out
    assert t1["write_bytes_per_s"] == {"median": pytest.approx(1.75 * GB), "p95": pytest.approx(1 * GB), "count": 2}
    assert t1["first_byte_seconds"] == {"median": pytest.approx(0.03), "p95": pytest.approx(0.05), "count": 2}
    assert t1["read_bytes_per_s"] == {"median": pytest.approx(1.25 * GB), "p95": pytest.approx(1.25 * GB),
                                      "count": 1}
    assert t1["price_gb_month"] == 2.5 and t1["monthly_cost"] == pytest.approx(15 * 2.5)

    t2 = rows[2]
    assert (t2["checkpoints"], t2["stored_bytes"]) == (1, 5 * GB)
    assert t2["write_bytes_per_s"]["median"] == pytest.approx(0.1 * GB)
    assert t2["monthly_cost"] == pytest.approx(5 * 0.01)
    assert t2["identity"] == "not configured" and t2["url"] == ""

    t0 = rows[0]
    assert t0["checkpoints"] == 1 and t0["write_bytes_per_s"] is None and t0["first_byte_seconds"] is None
    assert t0["identity"] == "proven" and t0["monthly_cost"] == 0.0  # node NVMe is paid with the node
    assert t0["budget_bytes"] is None and t0["budget_used"] is None


def test_matrix_table_shows_each_column(cli, catalog, monkeypatch):
    story(catalog)
    monkeypatch.setenv("COLUMNS", "80")  # each table read whole on a terminal of common width
    table = cli("tiers")
    for shown in ("15.0 GB", "1.75 GB/s / 1.00 GB/s (2)", "30 ms / 50 ms (2)", "1.25 GB/s / 1.25 GB/s (1)",
                  "37.50", "1.00×", "not configured", "2.5 "):
        assert shown in table, (shown, table)


def test_per_run_matrix_counts_that_run_alone(cli, catalog):
    story(catalog)
    checkpoint(catalog, "other", 1)
    timed_hop(catalog, checkpoint(catalog, "other", 2).id, 1, seconds=0.001, bytes=GB)
    rows = {r["tier"]: r for r in json.loads(cli("tiers", "--run", RUN, "--json"))["tiers"]}
    assert rows[1]["checkpoints"] == 3 and rows[1]["write_bytes_per_s"]["count"] == 2
    everyone = {r["tier"]: r for r in json.loads(cli("tiers", "--json"))["tiers"]}
    assert everyone[1]["checkpoints"] == 4 and everyone[1]["write_bytes_per_s"]["count"] == 3


def test_a_missing_mount_is_shown_unavailable_not_an_error(catalog, db_url, monkeypatch, tmp_path):
    story(catalog)
    cli = catalog_cli(monkeypatch, tmp_path, db_url, NODE="node-0", TIER1_URL=str(tmp_path / "lustre-not-mounted"))
    rows = {r["tier"]: r for r in json.loads(cli("tiers", "--json"))["tiers"]}
    assert rows[1]["identity"] == "unavailable" and rows[1]["detail"]
    assert rows[1]["checkpoints"] == 3  # the catalog's figures stand without the mount
    assert not (tmp_path / "lustre-not-mounted").exists()  # nothing created there
    monkeypatch.setenv("COLUMNS", "80")
    shown = cli("tiers")
    assert "unavailable" in shown and "its root does not exist" in shown


@pytest.mark.parametrize("price", ["-1", "nan", "inf"])
def test_a_price_must_be_finite_and_not_negative(catalog, db_url, monkeypatch, tmp_path, price):
    from typer.testing import CliRunner

    from ckpt.cli import app
    from core.errors import ConfigError

    catalog_cli(monkeypatch, tmp_path, db_url, TIER2_PRICE_GB_MONTH=price)
    with pytest.raises(ConfigError, match="tier2_price_gb_month"):
        CliRunner().invoke(app, ["tiers"], catch_exceptions=False)


def test_a_tier_budget_shows_its_use(catalog, db_url, settings_factory):
    """A retention policy with a byte budget (``max_bytes``, where the settings have one) gives
    the row its budget and the share in use; without one, neither."""
    from core.settings import RetentionPolicy
    from tasks.tier_matrix import tier_rows

    class Budgeted(RetentionPolicy):
        max_bytes: int | None = None

    story(catalog)
    settings = settings_factory(catalog_url=db_url)
    budgeted = settings.model_copy(update={"retention_tier1": Budgeted(keep_last=10, max_bytes=20 * GB)})
    rows = {r.tier: r for r in tier_rows(budgeted, catalog)}
    assert (rows[1].budget_bytes, rows[1].budget_used) == (20 * GB, pytest.approx(0.75))
    assert rows[0].budget_bytes is None and rows[0].budget_used is None
    assert {r.tier: r.budget_bytes for r in tier_rows(settings, catalog)} == {0: None, 1: None, 2: None}


def test_tiers_init_still_marks_and_records_the_roots(cli):
    out = cli("tiers", "init")
    assert "tier 0 (node node-0) at" in out and "tier 1 at" in out and "tier 2: not configured" in out
    assert "proven (shows the recorded identity)" in cli("tiers", "init")  # idempotent
