"""A manifest the catalog cannot hold as written is refused once, with a recorded rejection,
and stops nothing; a diverged run's checkpoint (its loss NaN) is a checkpoint like any other.

Before, a NaN metric failed every promotion and reconcile pass on PostgreSQL (its ``json``
refuses ``NaN``), and a size of 2**63, two sizes whose sum passes 2**63-1, a 300-character
node or a 200-character checksum passed ``Manifest.validate`` and failed in the database
(``OverflowError``, ``DataError``) on every pass, with no rejection on record."""

from __future__ import annotations

import json
import math

import pytest

from core.errors import BadInput
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import ckpt_dir, open_catalog, replica_states, write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return pipeline_settings(settings_factory, db_url)


def test_a_diverged_checkpoint_is_promoted_with_its_nan_loss(settings):
    write_checkpoint(settings.tier0_url, RUN, 100, shard_bytes=256, metrics={"loss": math.nan, "lr": 0.5})

    promote(settings, RUN, 100, steps=plain_steps())

    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"
    cat = open_catalog(settings)
    try:
        metrics = cat.get_checkpoint(RUN, 100).metrics
    finally:
        cat.close()
    assert math.isnan(metrics["loss"]) and metrics["lr"] == 0.5


def _sizes_2_62(files: list[dict]) -> None:
    files[0]["size"] = files[1]["size"] = 2**62  # each fits; their sum does not


HOSTILE = {
    "a size of 2**63": lambda m: m["files"][0].update(size=2**63),
    "two sizes of 2**62": lambda m: _sizes_2_62(m["files"]),
    "a 300-character node": lambda m: m.update(node="n" * 300),
    "a 200-character checksum": lambda m: m["files"][0].update(checksum="a" * 200),
}


@pytest.mark.parametrize("what", HOSTILE)
def test_a_hostile_manifest_is_rejected_once_and_stops_nothing(settings, what):
    write_checkpoint(settings.tier0_url, RUN, 100, shard_bytes=256)
    write_checkpoint(settings.tier0_url, RUN, 200, shard_bytes=256)
    path = ckpt_dir(settings.tier0_url, RUN, 200) / "manifest.json"
    body = json.loads(path.read_text())
    HOSTILE[what](body)
    path.write_text(json.dumps(body))

    first = reconcile_once(settings, steps=plain_steps())
    later = reconcile_once(settings, steps=plain_steps())

    assert first.promoted == [f"{RUN}/100 part 0"]
    assert [f for f in first.failed if "BadInput" in f and f"{RUN}/200" in f], first.failed
    assert later.failed == [] and later.promoted == []  # judged once: not retried on every pass
    cat = open_catalog(settings)
    try:
        (rejection,) = cat.rejections(RUN)
    finally:
        cat.close()
    assert (rejection.step, rejection.part) == (200, 0) and "\n" not in rejection.reason
    with pytest.raises(BadInput, match="rejected at"):
        promote(settings, RUN, 200, steps=plain_steps())
