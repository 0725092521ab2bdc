"""Reconcile costs what changed, not what exists: the same queries per pass at any catalog size,
and the check for vanished copies visits a bounded slice per pass in rotation, so a copy
deleted behind the catalog's back is still found, within ceil(copies / slice) passes."""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine

from core.settings import RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import ckpt_dir, replica_states, write_checkpoint
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"
OFF = RetentionPolicy(enabled=False)


@pytest.fixture
def settings(settings_factory, db_url):
    return pipeline_settings(settings_factory, db_url, retention_tier0=OFF, retention_tier1=OFF,
                             reconcile_check_limit=2)


def _save(settings, steps) -> None:
    for step in steps:
        write_checkpoint(settings.tier0_url, RUN, step, shards=1, shard_bytes=4096)
        promote(settings, RUN, step, steps=plain_steps())


@contextmanager
def _statements():
    seen: list[str] = []

    def count(_conn, _cursor, statement, *_args):
        seen.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", count)


def _pass_statements(settings) -> int:
    with _statements() as seen:
        report = reconcile_once(settings, steps=plain_steps(), actor="test")
    assert report.missing == report.promoted == report.failed == []  # nothing changed
    return len(seen)


def test_a_pass_with_nothing_changed_issues_as_many_queries_at_three_checkpoints_as_at_nine(settings):
    _save(settings, (100, 200, 300))
    reconcile_once(settings, steps=plain_steps(), actor="test")
    small = _pass_statements(settings)
    _save(settings, range(400, 1000, 100))

    assert _pass_statements(settings) == small


def test_a_copy_vanished_outside_the_first_slice_is_found_in_rotation(settings):
    _save(settings, (100, 200, 300, 400, 500))  # 5 copies per tier, 2 checked per pass
    shutil.rmtree(ckpt_dir(settings.tier1_url, RUN, 500))

    found_in = None
    for n in range(1, 4):  # ceil(5 / 2) passes cover every copy
        report = reconcile_once(settings, steps=plain_steps(), actor="test")
        if any(f"{RUN}/500" in m for m in report.missing):
            found_in = n
            break
    assert found_in == 3  # the first two passes checked steps 100-400 only
    assert f"{RUN}/500 part 0" in report.promoted  # and the same pass copied it again from Tier 0
    assert replica_states(settings, RUN, 500)[(1, 0)] == "verified"
