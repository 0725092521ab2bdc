"""Numbers no catalog can hold are bad input wherever they enter, and one bad item never stops
a reconcile pass.

A step is 0..2**63-1 (the catalog's BIGINT), a checkpoint has 1..99999 parts (five digits in a
manifest's name). A folder, manifest, event or CLI argument past those bounds gets a one-line
error (and an audit row where a request named it); the folder is left alone, and every other
checkpoint of the node goes on being promoted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.errors import BadEvent, BadInput
from core.layout import MAX_STEP, checkpoint_dirname, is_manifest_name, parse_manifest_key, parse_step_dirname
from core.manifest import Manifest
from db.catalog import Catalog
from flows.common import plain_steps
from flows.reconcile import reconcile_once
from tasks.register import checkpoint_args, register_stored_part
from tests.kit.checkpoints import ckpt_dir, published_files, replica_states, write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"
HUGE = 2**63


@pytest.mark.parametrize("step, part, parts", [(HUGE, 0, 1), (-1, 0, 1), (10**30, 0, 1), (5, 2, 2),
                                               (5, 0, 100_000), (5, -1, 1), (5, 0, 0)])
def test_an_event_naming_an_out_of_range_checkpoint_is_a_bad_event(step, part, parts):
    with pytest.raises(BadEvent) as err:
        checkpoint_args(RUN, str(step), str(part), str(parts))
    assert "out of range" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["100\n", " 100", "1_00", "\uff11\uff10\uff10", "\u0661\u0660\u0660", "+100", "1e2",
                                  "100.0", "", "9" * 5000])
def test_an_event_step_that_is_not_ascii_digits_is_a_bad_event(text):
    """``int()`` takes all but the last three of these as 100 (full-width, Arabic-Indic digits);
    a step, part or part count arriving as text is ASCII digits only."""
    for ref in ((text, "0", "1"), ("100", text, "1"), ("100", "0", text)):
        with pytest.raises(BadEvent) as err:
            checkpoint_args(RUN, *ref)
        assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_a_name_with_non_ascii_digits_is_no_checkpoint_name():
    full = "\uff10\uff10\uff10\uff10\uff11"  # full-width 00001, which int() reads as 1
    assert parse_step_dirname(f"step-000{full}") is None
    assert not is_manifest_name(f"manifest.part-{full}-of-00002.json")
    assert parse_manifest_key(f"{RUN}/step-00000100/manifest.part-00000-of-{full}.json") is None


def test_the_largest_step_is_accepted():
    assert checkpoint_args(RUN, str(MAX_STEP))[1] == MAX_STEP


def test_a_manifest_with_a_step_past_bigint_is_refused_when_read():
    good = Manifest(run=RUN, step=1, files=())
    body = json.loads(good.to_json())
    body["step"] = HUGE
    with pytest.raises(BadInput, match="out of range"):
        Manifest.from_json(json.dumps(body))


def test_the_schema_bounds_step_and_parts():
    schema = json.loads((Path(__file__).parents[3] / "core" / "manifest.schema.json").read_text())["properties"]
    assert schema["step"]["maximum"] == MAX_STEP
    assert schema["parts"]["maximum"] == 99999


def _plant_huge_step(tier0_root, good_step: int) -> str:
    """A copy of a committed checkpoint in a folder ``step-<2**63>`` whose manifest says so."""
    src = ckpt_dir(tier0_root, RUN, good_step)
    dst = src.parent / checkpoint_dirname(HUGE)
    shutil.copytree(src, dst)
    body = json.loads((dst / "manifest.json").read_text())
    body["step"] = HUGE
    (dst / "manifest.json").write_text(json.dumps(body))
    return dst.name


def test_a_step_past_bigint_among_good_checkpoints_stops_nothing(settings_factory, db_url):
    settings = pipeline_settings(settings_factory, db_url)
    write_checkpoint(settings.tier0_url, RUN, 100, shard_bytes=256)
    write_checkpoint(settings.tier0_url, RUN, 200, shard_bytes=256)
    _plant_huge_step(settings.tier0_url, 100)
    before = published_files(settings.tier0_url, RUN, HUGE)

    report = reconcile_once(settings, steps=plain_steps())

    assert sorted(report.promoted) == [f"{RUN}/100 part 0", f"{RUN}/200 part 0"]
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    assert replica_states(settings, RUN, 200)[(1, 0)] == "verified"
    assert [s for s in report.skipped if str(HUGE) in s and "out of range" in s]
    assert report.failed == []
    assert published_files(settings.tier0_url, RUN, HUGE) == before  # left alone
    again = reconcile_once(settings, steps=plain_steps())  # and again next pass, still listed
    assert [s for s in again.skipped if str(HUGE) in s] and again.failed == []
    with Catalog(settings.catalog_url) as cat:  # a rejection on record, once however many passes find it
        rows = [a for a in cat.audit_log(limit=50) if a.action == "reject"]
    assert len(rows) == 1 and str(HUGE) in rows[0].subject and "out of range" in rows[0].reason


def test_registering_a_step_past_bigint_is_refused_with_an_audit_row(settings_factory, db_url):
    settings = pipeline_settings(settings_factory, db_url)
    write_checkpoint(settings.tier0_url, RUN, 100, shard_bytes=256)
    _plant_huge_step(settings.tier0_url, 100)

    with pytest.raises(BadInput, match="out of range"):
        register_stored_part(settings, RUN, HUGE)

    with Catalog(settings.catalog_url) as cat:
        rows = [a for a in cat.audit_log(limit=20) if a.action == "reject"]
        assert rows and "out of range" in rows[0].reason and str(HUGE) in rows[0].subject


def test_one_item_whose_catalog_read_fails_fails_only_itself(settings_factory, db_url, monkeypatch):
    """A pair the set-based status read cannot take (whatever the cause) is read on its own:
    it alone is reported failed, the others are promoted."""
    settings = pipeline_settings(settings_factory, db_url, runs=("run-a", "run-b"))
    write_checkpoint(settings.tier0_url, "run-a", 100, shard_bytes=256)
    write_checkpoint(settings.tier0_url, "run-b", 5, shard_bytes=256)
    write_checkpoint(settings.tier0_url, "run-a", 300, shard_bytes=256)
    real = Catalog.promotion_status

    def poisoned(self, pairs, **kw):
        if ("run-b", 5, "") in pairs:
            raise OverflowError("Python int too large to convert to SQLite INTEGER")
        return real(self, pairs, **kw)

    monkeypatch.setattr(Catalog, "promotion_status", poisoned)
    report = reconcile_once(settings, steps=plain_steps())

    assert sorted(report.promoted) == ["run-a/100 part 0", "run-a/300 part 0"]
    assert len(report.failed) == 1 and "run-b/5" in report.failed[0] and "OverflowError" in report.failed[0]
    assert published_files(settings.tier1_url, "run-b", 5) == []  # not touched this pass


def test_a_catalog_lookup_of_a_step_past_bigint_is_bad_input(settings_factory, db_url):
    """``ckpt restore --step``, ``ckpt pin``, ``ckpt show``: one clear error, not the driver's."""
    settings = pipeline_settings(settings_factory, db_url)
    with Catalog(settings.catalog_url) as cat, pytest.raises(BadInput, match="out of range"):
        cat.get_checkpoint(RUN, HUGE)
