"""`ckpt plan` reports each run's measured ΔMFU from the stall times in the catalog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from core.manifest import FileEntry, Manifest
from db.catalog import Catalog, upgrade


def _register(cat: Catalog, run: str, saves: list[tuple[datetime, float]]) -> None:
    cat.ensure_run(run, actor="test")
    for i, (at, stall) in enumerate(saves):
        m = Manifest(run=run, step=100 * (i + 1), files=(FileEntry(f"f{i}.bin", 10, "00000000"),),
                     writer_stall_seconds=stall, created_at=at.isoformat())
        cat.register_part(m, actor="test")


def test_plan_shows_each_runs_measured_delta_mfu(db_url, tmp_path):
    upgrade(db_url)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    cat = Catalog(db_url)
    try:
        # a save every 100 s stalling 5 s; another run saving every 1800 s stalling 19.6 s
        _register(cat, "fast-writer", [(t0 + timedelta(seconds=100 * i), 5.0) for i in range(3)])
        _register(cat, "big-model", [(t0 + timedelta(seconds=1800 * i), 19.6) for i in range(2)])
    finally:
        cat.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(CKPT_CATALOG_URL=db_url, CKPT_DATA_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "ckpt.cli", "plan", "--params", "70B", "--json"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    runs = {r["run"]: r for r in json.loads(out.stdout)["runs"]}
    assert runs["fast-writer"]["delta_mfu"] == pytest.approx(15 / 205)
    assert runs["fast-writer"]["median_stall_seconds"] == 5.0
    assert runs["big-model"]["delta_mfu"] == pytest.approx(39.2 / 1819.6)
    table = subprocess.run([sys.executable, "-m", "ckpt.cli", "plan", "--params", "70B"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=60).stdout
    assert "fast-writer" in table and "7.32 %" in table and "2.15 %" in table


def test_plan_uses_the_bandwidths_this_cluster_measured_and_says_so(catalog, db_url, monkeypatch, tmp_path):
    """With no --bandwidth, the write bandwidth is the median of the last day's checkpoints copied
    into Tier 1 and the Tier 1 read that of its restore drills; the output says they were measured."""
    from core import sizing
    from tests.kit.catalog import catalog_cli, checkpoint, timed_hop

    gb = 10**9
    a, b = checkpoint(catalog, "run-a", 10, size=gb), checkpoint(catalog, "run-a", 20, size=gb)
    timed_hop(catalog, a.id, 1, seconds=1.0, bytes=2 * gb)  # 2 GB/s
    timed_hop(catalog, b.id, 1, seconds=4.0, bytes=2 * gb)  # 0.5 GB/s
    catalog.record_drill("run-a", 20, 1, ok=True, seconds=0.5, bytes=2 * gb, actor="test")  # 4 GB/s
    cli = catalog_cli(monkeypatch, tmp_path, db_url)

    out = json.loads(cli("plan", "--size", "100GB", "--no-runs", "--json"))
    assert out["model"][0]["bandwidth_bytes_per_s"] == pytest.approx(1.25 * gb)
    assert [(s["what"], s["source"], s["hops"]) for s in out["bandwidths"]] == [("write", "measured", 2),
                                                                                ("Tier 1 read", "measured", 1)]
    tier1 = next(t for t in out["recovery"][0]["tiers"] if t["tier"] == 1)
    expected = sizing.recovery_times(100 * gb, 1, 1.25 * gb, sizing.RecoveryModel(tier1_bytes_per_s=4 * gb))[1]
    assert tier1["node_seconds"] == pytest.approx(expected.node_seconds)
    text = cli("plan", "--size", "100GB", "--no-runs")
    assert ("write bandwidth: 1.25 GB/s, measured: the median of 2 checkpoints copied into Tier 1 (all parts) "
            "over the last day") in text
    assert "Tier 1 read bandwidth: 4.00 GB/s, measured" in text

    given = json.loads(cli("plan", "--size", "100GB", "--bandwidth", "10GB/s", "--tier1-read", "20GB/s", "--json"))
    assert given["model"][0]["bandwidth_bytes_per_s"] == 10 * gb and given["bandwidths"] == []


def test_plan_counts_a_multi_node_checkpoints_parts_together(catalog, db_url, monkeypatch, tmp_path):
    """Four nodes each copy their 100 GB part into Tier 1 in 100 s, side by side: the checkpoint
    was written at 4 GB/s, not at one hop's 1 GB/s."""
    from tests.kit.catalog import catalog_cli, manifest, timed_hop

    gb = 10**9
    catalog.ensure_run("run-a")
    for part in range(4):
        ck = catalog.register_part(manifest("run-a", 10, part=part, parts=4, size=gb // 2, node=f"node-{part}"),
                                   actor="test")
    for part in range(4):
        timed_hop(catalog, ck.id, 1, seconds=100.0, bytes=100 * gb, part=part)
    cli = catalog_cli(monkeypatch, tmp_path, db_url)

    out = json.loads(cli("plan", "--size", "100GB", "--no-runs", "--json"))

    # the four copies were recorded moments apart: the span is 100 s and those moments
    assert 3 * gb < out["model"][0]["bandwidth_bytes_per_s"] <= 4 * gb
    assert out["bandwidths"][0]["hops"] == 1  # one checkpoint


def test_plan_falls_back_to_its_defaults_without_measured_hops_and_says_so(catalog, db_url, monkeypatch, tmp_path):
    from tests.kit.catalog import catalog_cli

    cli = catalog_cli(monkeypatch, tmp_path, db_url)
    out = json.loads(cli("plan", "--size", "100GB", "--json"))
    assert out["model"][0]["bandwidth_bytes_per_s"] == 2e9
    assert [(s["what"], s["source"]) for s in out["bandwidths"]] == [("write", "default"), ("Tier 1 read", "default")]
    text = cli("plan", "--size", "100GB")
    assert ("write bandwidth: 2.00 GB/s, the model's default: no checkpoints copied into Tier 1 (all parts) "
            "recorded over the last day") in text
