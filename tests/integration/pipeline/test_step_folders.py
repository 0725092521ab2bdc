"""Checkpoint folder names: ``step-`` and at least 8 digits, parsed by one rule in core.layout.

Steps of 100,000,000 and above get a nine-digit folder; every reader of folder names must see
them, or a checkpoint whose event was lost is never recovered by reconcile.
"""

from __future__ import annotations

import pytest

from core import layout
from core.layout import checkpoint_dirname
from core.storage.local import LocalStore
from core.transfer import find_committed
from flows.common import plain_steps
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import replica_states, write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"
BIG = 123_456_789


@pytest.mark.parametrize("step", [0, 7, 99_999_999, 100_000_000, BIG, 12_345_678_901])
def test_every_written_folder_name_parses_back_to_its_step(step):
    assert layout.parse_step_dirname(checkpoint_dirname(step)) == step


def test_existing_eight_digit_layouts_keep_their_names():
    assert checkpoint_dirname(100) == "step-00000100"
    assert checkpoint_dirname(BIG) == "step-123456789"


@pytest.mark.parametrize("name", ["step-100", "step-012345678", "step-0000010a", "ckpt-00000100", "step-"])
def test_names_the_pipeline_never_writes_are_not_checkpoint_folders(name):
    assert layout.parse_step_dirname(name) is None


def test_find_committed_sees_nine_digit_steps(tmp_path):
    write_checkpoint(tmp_path, RUN, 100, shards=1, shard_bytes=64)
    write_checkpoint(tmp_path, RUN, BIG, shards=1, shard_bytes=64)

    found = list(find_committed(LocalStore(tmp_path, tier=0)))

    assert sorted(found) == [(RUN, 100, 0, 1, ""), (RUN, BIG, 0, 1, "")]


def test_reconcile_recovers_a_lost_event_of_a_nine_digit_step(settings_factory, db_url):
    settings = pipeline_settings(settings_factory, db_url)
    write_checkpoint(settings.tier0_url, RUN, BIG)

    report = reconcile_once(settings, steps=plain_steps())

    assert report.promoted == [f"{RUN}/{BIG} part 0"]
    assert replica_states(settings, RUN, BIG)[(1, 0)] == "verified"
