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
