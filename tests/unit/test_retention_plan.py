"""The milestone rule of retention, as a pure function."""

from __future__ import annotations

import pytest

from core.settings import MilestonePolicy, RetentionPolicy
from tasks.retention import is_milestone

RUN = "run-a"
OFF = RetentionPolicy(enabled=False)


@pytest.mark.parametrize("kind,step,tags,policy,expected", [
    ("milestone", 7, {}, MilestonePolicy(), True),
    ("milestone", 7, {}, MilestonePolicy(tagged=False), False),
    ("step", 7, {"milestone": "true"}, MilestonePolicy(), True),
    ("epoch", 7, {}, MilestonePolicy(), True),
    ("epoch", 7, {}, MilestonePolicy(epoch_end=False), False),
    ("step", 3000, {}, MilestonePolicy(every_steps=1000), True),
    ("step", 3001, {}, MilestonePolicy(every_steps=1000), False),
    ("step", 3000, {}, MilestonePolicy(), False),
])
def test_milestone_rule(kind, step, tags, policy, expected):
    assert is_milestone(kind, step, tags, policy) is expected
