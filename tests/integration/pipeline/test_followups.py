"""A promotion killed right after it recorded the checkpoint complete on Tier 1 does not lose
what follows: the milestone's archive, the durable event, the status page and retention are
driven by the catalog (a completion whose follow-ups are not recorded done), so the retry, a
duplicate event or reconcile finishes them, once."""

from __future__ import annotations

import dataclasses

import pytest

from core.events import announcing
from core.settings import RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import ckpt_dir, expire_claims, open_catalog, replica_states, write_checkpoint
from tests.kit.pipeline import Recorder, pipeline_settings

RUN = "run-a"


class Killed(BaseException):
    """The worker's process dies (not an error any code handles)."""


def _killed_after_completion(settings, step: int, **kw) -> None:
    """Promote ``step`` with the hop's process killed right after mark_complete committed."""
    steps = plain_steps()

    def hop_then_die(*args, **kwargs):
        steps.tier1_hop(*args, **kwargs)
        raise Killed

    with pytest.raises(Killed):
        promote(settings, RUN, step, steps=dataclasses.replace(steps, tier1_hop=hop_then_die), **kw)


@pytest.fixture
def settings(settings_factory, db_url):
    """Step 100 promoted; Tier 0 keeps 1, so step 200's retention must prune step 100 there."""
    s = pipeline_settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1))
    write_checkpoint(s.tier0_url, RUN, 100, shard_bytes=1024)
    promote(s, RUN, 100, steps=plain_steps())
    write_checkpoint(s.tier0_url, RUN, 200, shard_bytes=1024)
    return s


def _done_audits(settings, step: int) -> int:
    cat = open_catalog(settings)
    try:
        return len([e for e in cat.history(RUN, step) if e.action == "followups-done"])
    finally:
        cat.close()


def test_the_retry_of_a_promotion_killed_after_completion_finishes_its_follow_ups(settings):
    _killed_after_completion(settings, 200)
    assert replica_states(settings, RUN, 200)[(1, 0)] == "verified"
    assert replica_states(settings, RUN, 100)[(0, 0)] == "verified"  # retention never ran

    events = Recorder()
    with announcing(events):
        retry = promote(settings, RUN, 200, steps=plain_steps())

    assert retry.durable and "durable" in events.names()
    assert replica_states(settings, RUN, 100)[(0, 0)] == "pruned"
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()
    assert _done_audits(settings, 200) == 1
    again = Recorder()
    with announcing(again):
        duplicate = promote(settings, RUN, 200, steps=plain_steps())  # done now: nothing re-runs
    assert not duplicate.durable and "durable" not in again.names()


def test_reconcile_finishes_the_follow_ups_a_killed_promotion_left(settings):
    _killed_after_completion(settings, 200)
    seen = []

    events = Recorder()
    with announcing(events):
        report = reconcile_once(settings, steps=plain_steps(), on_durable=lambda r: seen.append((r.run, r.step)))

    assert report.followed_up == [f"{RUN}/200"] and report.failed == []
    assert "durable" in events.names() and seen == [(RUN, 200)]  # the status page hook ran
    assert replica_states(settings, RUN, 100)[(0, 0)] == "pruned"
    assert reconcile_once(settings, steps=plain_steps()).followed_up == []
    assert _done_audits(settings, 200) == 1


def test_follow_ups_killed_half_way_are_taken_over_once_their_lease_lapses(settings):
    """Killed inside the follow-ups (here: in the status page hook): a duplicate under the live
    lease leaves them to their holder; after the lapse reconcile finishes them."""
    def die(_result):
        raise Killed

    with pytest.raises(Killed):
        promote(settings, RUN, 200, steps=plain_steps(), on_durable=die)
    duplicate = promote(settings, RUN, 200, steps=plain_steps())
    assert not duplicate.durable  # the lease is live: not two callers at once
    assert reconcile_once(settings, steps=plain_steps()).followed_up == []

    _lapse_followups(settings)
    report = reconcile_once(settings, steps=plain_steps())
    assert report.followed_up == [f"{RUN}/200"]
    assert _done_audits(settings, 200) == 1


def _lapse_followups(settings) -> None:
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from db.models import TierCompletion

    cat = open_catalog(settings)
    try:
        with cat.engine.begin() as conn:
            conn.execute(update(TierCompletion.__table__).where(TierCompletion.__table__.c.followups_done_at.is_(None))
                         .values(followups_lease_until=datetime.now(UTC) - timedelta(days=1)))
    finally:
        cat.close()
    expire_claims(settings)


def test_a_milestone_s_archive_is_finished_by_the_retry(settings_factory, db_url, s3_endpoint, s3_bucket):
    settings = pipeline_settings(settings_factory, db_url, tier2_url=f"s3://{s3_bucket}/vault",
                                 s3_endpoint_url=s3_endpoint)
    write_checkpoint(settings.tier0_url, RUN, 200, kind="milestone", shard_bytes=1024)
    _killed_after_completion(settings, 200)
    assert (2, 0) not in replica_states(settings, RUN, 200)

    retry = promote(settings, RUN, 200, steps=plain_steps())

    assert retry.archive is not None and retry.archive.archived
    assert replica_states(settings, RUN, 200)[(2, 0)] == "verified"


def test_a_checkpoint_reconcile_promotes_gets_its_follow_ups_there(settings):
    seen = []
    report = reconcile_once(settings, steps=plain_steps(), on_durable=lambda r: seen.append((r.run, r.step)))
    assert report.promoted == [f"{RUN}/200 part 0"] and seen == [(RUN, 200)]  # the status page hook ran
    assert report.followed_up == [] and _done_audits(settings, 200) == 1
