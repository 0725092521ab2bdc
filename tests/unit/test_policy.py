"""The milestone rule has one owner (core.policy): what the writer records, what the archive
uploads and what the restore drill picks agree."""

from __future__ import annotations

import pytest

from core.policy import checkpoint_kind, is_milestone
from core.settings import MilestonePolicy
from db.catalog import Catalog
from tasks.drill import newest_milestone


@pytest.mark.parametrize(("policy", "saved", "want"), [
    (MilestonePolicy(), dict(milestone=True, epoch_end=False), True),
    (MilestonePolicy(), dict(milestone=False, epoch_end=True), True),
    (MilestonePolicy(epoch_end=False), dict(milestone=False, epoch_end=True), False),
    (MilestonePolicy(tagged=False), dict(milestone=True, epoch_end=False), False),
    (MilestonePolicy(every_steps=100), dict(milestone=False, epoch_end=False), True),
])
def test_what_the_writer_records_is_what_the_pipeline_archives(policy, saved, want):
    kind = checkpoint_kind(300, policy=policy, **saved)
    assert is_milestone(kind, 300, {}, policy) is want


def test_a_tag_in_the_manifest_makes_a_milestone():
    assert is_milestone("step", 7, {"milestone": "yes"}, MilestonePolicy())
    assert not is_milestone("step", 7, {"milestone": "no"}, MilestonePolicy())


def test_the_drill_picks_an_epoch_end_milestone_the_archive_uploads(tmp_path):
    """An epoch end is archived by default; the drill used to look for kind == 'milestone' only."""
    from tests.kit.catalog import checkpoint

    cat = Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", auto_upgrade=True)
    try:
        checkpoint(cat, "r", 100, kind="milestone")
        checkpoint(cat, "r", 200, kind="epoch")
        checkpoint(cat, "r", 300, kind="step")
        assert newest_milestone(cat, "r", MilestonePolicy()).step == 200
        assert newest_milestone(cat, "r", MilestonePolicy(epoch_end=False)).step == 100
    finally:
        cat.close()
