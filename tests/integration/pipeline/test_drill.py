"""Restoration drills: the newest milestone restored from Tier 1 and from Tier 2 into an empty
scratch folder, checked, timed, recorded per tier in the catalog, scratch removed. Real files,
moto's S3 server, catalogs on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os

import pytest

from db.catalog import Catalog
from tasks.drill import restore_drill
from tests.kit.checkpoints import replica_states
from tests.kit.restore import commit_folder, promote, scenario_settings
from tests.kit.s3 import corrupt_s3_object

RUN = "llm-d"


@pytest.fixture
def settings(settings_factory, db_url, s3_endpoint, s3_bucket):
    return scenario_settings(settings_factory, db_url, s3_endpoint=s3_endpoint, s3_bucket=s3_bucket)


def save(settings, step: int, milestone: bool) -> int:
    files = {"model.bin": os.urandom(400_000), "rng/state.bin": os.urandom(1000)}
    commit_folder(settings, RUN, step, files, milestone=milestone)
    promote(settings, RUN, step)
    return sum(map(len, files.values()))


def test_drill_restores_the_newest_milestone_from_tier1_and_tier2_and_records_it(settings, tmp_path):
    save(settings, 100, milestone=True)
    size = save(settings, 200, milestone=True)
    save(settings, 300, milestone=False)  # newer, but not a milestone
    scratch = tmp_path / "scratch"

    report = restore_drill(settings, scratch=scratch)

    assert (report.run, report.step, report.ok, report.skipped) == (RUN, 200, True, [])
    assert [(r.tier, r.ok, r.bytes) for r in report.results] == [(1, True, size), (2, True, size)]
    assert all(r.seconds > 0 for r in report.results)
    assert not scratch.exists() or list(scratch.iterdir()) == []  # cleaned up
    with Catalog(settings.catalog_url) as cat:
        recorded = cat.drills(RUN)
    assert sorted((d.step, d.tier, d.ok) for d in recorded) == [(200, 1, True), (200, 2, True)]


def test_a_drill_that_meets_rot_fails_on_that_tier_and_marks_the_copy(settings, tmp_path):
    save(settings, 100, milestone=True)
    corrupt_s3_object(settings, RUN, 100, "model.bin")

    report = restore_drill(settings, scratch=tmp_path / "s")

    assert not report.ok
    assert [(r.tier, r.ok) for r in report.results] == [(1, True), (2, False)]
    assert "model.bin" in report.results[1].detail
    assert replica_states(settings, RUN, 100)[(2, 0)] == "corrupt"


def test_a_tier_without_a_copy_is_skipped_and_no_milestone_means_no_drill(settings, tmp_path):
    report = restore_drill(settings, scratch=tmp_path / "s")
    assert report.results == [] and "no committed milestone" in report.skipped[0]

    save(settings, 100, milestone=False)
    settings_no_t2 = settings.model_copy(update={"tier2_url": None})
    commit_folder(settings_no_t2, RUN, 200, {"m.bin": b"x" * 1000}, milestone=True)
    promote(settings_no_t2, RUN, 200)  # Tier 2 off: the milestone lives on tiers 0 and 1 only

    report = restore_drill(settings, scratch=tmp_path / "s")

    assert [(r.step, r.tier, r.ok) for r in report.results] == [(200, 1, True)]
    assert report.skipped == [f"tier 2: no verified copy of {RUN}/step-200"]


def test_cli_drill_then_drills_lists_the_history(settings, monkeypatch):
    from typer.testing import CliRunner

    from ckpt.cli import app

    size = save(settings, 100, milestone=True)
    for k, v in (("DATA_DIR", str(settings.data_dir)), ("CATALOG_URL", settings.catalog_url),
                 ("NODE", settings.node), ("TIER2_URL", settings.tier2_url),
                 ("S3_ENDPOINT_URL", settings.s3_endpoint_url)):
        monkeypatch.setenv(f"CKPT_{k}", v)

    ran = CliRunner().invoke(app, ["drill"])
    assert ran.exit_code == 0, ran.output

    listed = CliRunner().invoke(app, ["drills", "--json"])
    rows = json.loads(listed.stdout)
    assert sorted((r["run"], r["step"], r["tier"], r["ok"], r["bytes"]) for r in rows) == [
        (RUN, 100, 1, True, size), (RUN, 100, 2, True, size)]
    assert all(r["seconds"] > 0 and r["MB/s"] > 0 for r in rows)
    table = CliRunner().invoke(app, ["drills"])
    assert "restoration drills" in table.output and RUN in table.output


def test_cli_drill_that_drilled_nothing_fails(settings, monkeypatch):
    """A drill run from cron or CI that found nothing to drill must not report success."""
    from typer.testing import CliRunner

    from ckpt.cli import app
    from core.errors import NotFound

    save(settings, 100, milestone=False)  # no milestone: nothing for the default drill
    for k, v in (("DATA_DIR", str(settings.data_dir)), ("CATALOG_URL", settings.catalog_url),
                 ("NODE", settings.node), ("TIER2_URL", settings.tier2_url),
                 ("S3_ENDPOINT_URL", settings.s3_endpoint_url)):
        monkeypatch.setenv(f"CKPT_{k}", v)

    ran = CliRunner().invoke(app, ["drill"])
    assert ran.exit_code != 0 and isinstance(ran.exception, NotFound), ran.output
    assert "nothing was drilled" in str(ran.exception) and "no committed milestone" in str(ran.exception)

    ran = CliRunner().invoke(app, ["drill", "--run", RUN, "--tier", "2"])  # a run with no copy there
    assert ran.exit_code != 0 and "held whole there" in str(ran.exception), ran.output
