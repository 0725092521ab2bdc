"""Every number and string of a manifest is bounded by what the catalog holds: a manifest that
passes ``Manifest.validate`` is stored as written on every backend; one that does not is
refused with one short line naming the field."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from core.errors import BadInput
from core.layout import MAX_ATTEMPT
from core.manifest import MAX_NODE, MAX_PATH, FileEntry, Manifest, ParentRef
from db.models import Checkpoint, CheckpointFile, CheckpointPart, Run

GOOD = Manifest(run="run-a", step=100, files=(FileEntry("a.bin", 10, "0a0b0c0d"), FileEntry("b.bin", 5, "01020304")),
                node="node-0", metrics={"loss": 0.5}, created_at="2026-06-01T00:00:00.000+00:00")


def _files(**first) -> tuple[FileEntry, ...]:
    return (replace(GOOD.files[0], **first), GOOD.files[1])


HOSTILE = {
    "a size of 2**63": dict(files=_files(size=2**63)),
    "a negative size": dict(files=_files(size=-1)),
    "sizes whose sum passes 2**63-1": dict(files=(FileEntry("a.bin", 2**62, "0a0b0c0d"),
                                                  FileEntry("b.bin", 2**62, "01020304"))),
    "a 300-character node": dict(node="n" * 300),
    "a 200-character attempt": dict(attempt="a" * 200),
    "a 200-character checksum": dict(files=_files(checksum="a" * 200)),
    "a short checksum": dict(files=_files(checksum="abc")),
    "an upper-case checksum": dict(files=_files(checksum="0A0B0C0D")),
    "an unknown checksum algorithm": dict(algorithm="md5"),
    "a 2000-character path": dict(files=_files(path="d/" * 1000 + "x")),
    "a 300-character run": dict(run="r" * 300),
    "a 300-character metric name": dict(metrics={"m" * 300: 1.0}),
    "a metric that is text": dict(metrics={"loss": "0.5"}),
    "a 300-character tag name": dict(tags={"t" * 300: "x"}),
    "a tag value that is not text": dict(tags={"t": 5}),
    "a negative writer stall": dict(writer_stall_seconds=-1.0),
    "a NaN writer stall": dict(writer_stall_seconds=math.nan),
    "an infinite writer stall": dict(writer_stall_seconds=math.inf),
    "a created_at that is no time": dict(created_at="yesterday"),
    "a parent past 2**63-1": dict(parent=ParentRef("run-b", 2**63)),
    "a parent with an unknown relation": dict(parent=ParentRef("run-b", 5, "stolen_from")),
}


@pytest.mark.parametrize("what", HOSTILE)
def test_a_value_the_catalog_cannot_hold_is_refused_in_one_short_line(what):
    with pytest.raises(BadInput) as err:
        replace(GOOD, **HOSTILE[what]).validate()
    assert "\n" not in str(err.value) and len(str(err.value)) < 240


def test_non_finite_metrics_pass_and_round_trip_through_the_manifest_json():
    m = replace(GOOD, metrics={"loss": math.nan, "grad_norm": math.inf, "margin": -math.inf, "epoch": 3})
    m.validate()
    back = Manifest.from_json(m.to_json()).metrics
    assert math.isnan(back["loss"]) and back["grad_norm"] == math.inf and back["margin"] == -math.inf
    assert back["epoch"] == 3.0 and isinstance(back["epoch"], float)


def test_the_largest_values_pass():
    replace(GOOD, files=_files(size=2**63 - 1 - 5), node="n" * MAX_NODE, attempt="a" * MAX_ATTEMPT,
            writer_stall_seconds=0.0).validate()


@pytest.mark.parametrize("field, value", [("step", "100"), ("step", 100.0), ("part", True), ("size", "10")])
def test_a_number_written_as_something_else_is_refused_when_read(field, value):
    body = json.loads(GOOD.to_json())
    (body["files"][0] if field == "size" else body)[field] = value
    with pytest.raises(BadInput, match="not an integer"):
        Manifest.from_json(json.dumps(body))


def test_the_bounds_fit_the_catalog_columns():
    assert CheckpointPart.__table__.c.node.type.length >= MAX_NODE
    assert Checkpoint.__table__.c.attempt.type.length >= MAX_ATTEMPT
    assert CheckpointFile.__table__.c.path.type.length >= MAX_PATH
    assert CheckpointFile.__table__.c.checksum.type.length >= 8
    assert Run.__table__.c.name.type.length >= 128  # core.paths.safe_run_name
