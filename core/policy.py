"""The milestone rule, in one place: which checkpoints are milestones (archived to Tier 2 and
drilled), by the job's tag, by epoch end, or every K steps (``Settings.milestones``).

The writer records a ``kind`` (``checkpoint_kind``) and the pipeline decides again from the
recorded kind, step and tags (``is_milestone``), so a policy changed after a save still
applies, and the archive, reconcile, retention and the restore drill agree on the answer.
"""

from __future__ import annotations

from collections.abc import Mapping

from core.settings import MilestonePolicy

TRUE_WORDS = ("1", "true", "yes", "milestone")
# What a checkpoint says of itself, whatever the policy (``milestone_marks``): the catalog keeps
# these bits per checkpoint (``checkpoints.milestone_marks``) so that the archive backlog reads
# the few marked checkpoints through an index instead of testing every one.
MARK_TAGGED, MARK_EPOCH = 1, 2


def checkpoint_kind(step: int, *, milestone: bool, epoch_end: bool, policy: MilestonePolicy) -> str:
    """The kind a writer records: ``milestone`` when tagged (and the policy honours tags) or on
    the every-K-steps rule; ``epoch`` at an epoch end; else ``step``."""
    if (milestone and policy.tagged) or (policy.every_steps and step % policy.every_steps == 0):
        return "milestone"
    return "epoch" if epoch_end else "step"


def milestone_marks(kind: str, tags: Mapping[str, str]) -> int:
    """``MARK_TAGGED`` if the job marked it a milestone (its kind or its tag), ``MARK_EPOCH`` if
    it ends an epoch: the policy-free half of ``is_milestone``."""
    tagged = kind == "milestone" or str(tags.get("milestone", "")).lower() in TRUE_WORDS
    return (MARK_TAGGED if tagged else 0) | (MARK_EPOCH if kind == "epoch" else 0)


def marks_wanted(policy: MilestonePolicy) -> int:
    """The ``milestone_marks`` bits that make a milestone under ``policy`` (any one suffices)."""
    return (MARK_TAGGED if policy.tagged else 0) | (MARK_EPOCH if policy.epoch_end else 0)


def is_milestone(kind: str, step: int, tags: Mapping[str, str], policy: MilestonePolicy) -> bool:
    """A milestone is archived to Tier 2: tagged by the job, an epoch end, or every K steps."""
    if milestone_marks(kind, tags) & marks_wanted(policy):
        return True
    every = policy.every_steps
    return every is not None and every != 0 and step % every == 0
