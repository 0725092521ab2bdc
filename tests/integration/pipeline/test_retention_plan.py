"""Retention: the plan per tier, the dry run, and applying it through the guarded prune."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import CorruptCheckpoint
from core.events import announcing
from core.settings import MilestonePolicy, RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from flows.retention import run_retention
from tasks.retention import ELSEWHERE, KEPT, PLANNED, PRUNED, REFUSED, apply_retention, plan_retention
from tests.kit.checkpoints import ckpt_dir, open_catalog, replica_states, write_checkpoint
from tests.kit.pipeline import Recorder, pipeline_settings

RUN = "run-a"
OFF = RetentionPolicy(enabled=False)


@pytest.fixture
def settings(settings_factory, db_url):
    """Promotions that prune nothing by themselves, so the tests decide when retention runs."""
    return pipeline_settings(settings_factory, db_url, retention_tier0=OFF, retention_tier1=OFF)


def promote_steps(settings, steps, **kw):
    for s in steps:
        write_checkpoint(Path(settings.tier0_url), RUN, s, shard_bytes=64 << 10, **kw)
        promote(settings, RUN, s, steps=plain_steps())


def with_policy(settings, **update):
    return settings.model_copy(update=update)


def test_keep_last_plans_the_older_tier0_copies_and_a_dry_run_deletes_nothing(settings):
    promote_steps(settings, [10, 20, 30, 40])
    keep2 = with_policy(settings, retention_tier0=RetentionPolicy(keep_last=2))

    plan = run_retention(keep2, run=RUN, dry_run=True, steps=plain_steps())

    assert [(a.tier, a.step, a.outcome) for a in plan] == [(0, 10, PLANNED), (0, 20, PLANNED)]
    for s in (10, 20, 30, 40):
        assert ckpt_dir(settings.tier0_url, RUN, s).is_dir()
        assert replica_states(settings, RUN, s)[(0, 0)] == "verified"


def test_applying_the_plan_prunes_tier0_and_keeps_tier1(settings):
    promote_steps(settings, [10, 20, 30, 40])
    keep2 = with_policy(settings, retention_tier0=RetentionPolicy(keep_last=2))
    events = Recorder()

    with announcing(events):
        done = run_retention(keep2, run=RUN, steps=plain_steps())

    assert [(a.step, a.outcome) for a in done] == [(10, PRUNED), (20, PRUNED)]
    for s in (10, 20):
        assert not ckpt_dir(settings.tier0_url, RUN, s).exists()
        assert replica_states(settings, RUN, s) == {(0, 0): "pruned", (1, 0): "verified"}
        assert ckpt_dir(settings.tier1_url, RUN, s).is_dir()
    for s in (30, 40):
        assert ckpt_dir(settings.tier0_url, RUN, s).is_dir()
    assert events.names() == ["pruned", "pruned"]
    assert run_retention(keep2, run=RUN, steps=plain_steps()) == []  # nothing left to do


def test_tier1_copy_without_a_tier2_copy_is_not_planned(settings):
    promote_steps(settings, [10, 20, 30])
    keep1 = with_policy(settings, retention_tier1=RetentionPolicy(keep_last=1))

    assert run_retention(keep1, run=RUN, steps=plain_steps()) == []
    for s in (10, 20, 30):
        assert replica_states(settings, RUN, s)[(1, 0)] == "verified"
        assert ckpt_dir(settings.tier1_url, RUN, s).is_dir()


def test_a_stale_plan_cannot_delete_the_last_good_copy(settings):
    from tasks.verify import verify_replica
    from tests.kit.checkpoints import flip_bit, shard_paths

    promote_steps(settings, [10, 20, 30, 40])
    keep2 = with_policy(settings, retention_tier0=RetentionPolicy(keep_last=2))
    plan = plan_retention(keep2, run=RUN)
    assert [a.step for a in plan] == [10, 20]
    flip_bit(shard_paths(settings.tier1_url, RUN, 10)[0])  # Tier 1 copy of step 10 goes bad...
    with pytest.raises(CorruptCheckpoint):
        verify_replica(settings, RUN, 10, tier=1)  # ...and a scrub finds it

    done = apply_retention(keep2, plan, prune=plain_steps().prune)

    assert {a.step: a.outcome for a in done} == {10: REFUSED, 20: PRUNED}
    assert ckpt_dir(settings.tier0_url, RUN, 10).is_dir()
    assert replica_states(settings, RUN, 10) == {(0, 0): "verified", (1, 0): "corrupt"}


def test_pinned_and_newest_checkpoints_are_never_planned(settings):
    promote_steps(settings, [10, 20, 30])
    cat = open_catalog(settings)
    try:
        cat.pin(RUN, 10, reason="paper result", actor="test")
    finally:
        cat.close()
    keep1 = with_policy(settings, retention_tier0=RetentionPolicy(keep_last=1))

    plan = plan_retention(keep1, run=RUN)

    assert [(a.tier, a.step) for a in plan] == [(0, 20)]


def test_unarchived_milestone_leaves_tier0_once_durable_and_is_held_on_tier1(settings):
    promote_steps(settings, [10, 20, 30])
    policy = with_policy(settings, retention_tier0=RetentionPolicy(keep_last=1),
                         retention_tier1=RetentionPolicy(keep_last=1), tier2_url="s3://vault/ckpt",
                         milestones=MilestonePolicy(every_steps=20))

    plan = {(a.tier, a.step): a for a in plan_retention(policy, run=RUN, explain=True, tiers=(0, 1))}

    assert plan[(1, 20)].outcome == KEPT and plan[(1, 20)].detail == "milestone not yet archived"
    assert plan[(0, 20)].outcome == PLANNED and plan[(0, 10)].outcome == PLANNED
    done = run_retention(policy, run=RUN, steps=plain_steps())
    # step 10: no tier keeps it, so it is retired (both copies); step 20 leaves Tier 0 only
    assert {(a.tier, a.step) for a in done if a.outcome == PRUNED} == {(0, 10), (1, 10), (0, 20)}
    assert not ckpt_dir(settings.tier0_url, RUN, 20).exists()
    assert ckpt_dir(settings.tier1_url, RUN, 20).is_dir()


def test_tier0_copies_of_another_node_are_left_to_that_node(settings):
    promote_steps(settings, [10, 20])
    other = with_policy(settings, node="node-9", retention_tier0=RetentionPolicy(keep_last=1))

    done = run_retention(other, run=RUN, steps=plain_steps())

    assert [(a.step, a.outcome) for a in done] == [(10, ELSEWHERE)]
    assert ckpt_dir(settings.tier0_url, RUN, 10).is_dir()


def test_promotion_applies_the_default_retention_of_its_run(settings_factory, db_url):
    settings = pipeline_settings(settings_factory, db_url)  # Tier 0 keeps the last 3
    for s in range(1, 6):
        write_checkpoint(Path(settings.tier0_url), RUN, s, shard_bytes=64 << 10)
        promote(settings, RUN, s, steps=plain_steps())
    on_tier0 = sorted(int(p.name.split("-")[1]) for p in (Path(settings.tier0_url) / RUN).iterdir())
    assert on_tier0 == [3, 4, 5]
    assert all(replica_states(settings, RUN, s)[(1, 0)] == "verified" for s in range(1, 6))


def test_artifacts_show_a_dry_runs_plan_and_an_applied_result_and_nothing_when_nothing_was_to_do(settings,
                                                                                             monkeypatch):
    """What the Prefect UI gets: a dry run's plan; the result of applying it; after a durable
    checkpoint whose run had nothing to let go, no artifact (one per checkpoint would be noise
    and an orchestrator round trip per promotion); the catalog-wide run always reports."""
    import flows.retention

    shown: list[tuple[str, list]] = []
    monkeypatch.setattr(flows.retention, "publish_table", lambda key, rows, _description: shown.append((key, rows)))
    promote_steps(settings, [10, 20, 30])
    keep2 = with_policy(settings, retention_tier0=RetentionPolicy(keep_last=2))

    run_retention(settings, run=RUN, steps=plain_steps())  # Tier 0 retention off: nothing to do
    assert shown == []
    run_retention(keep2, run=RUN, dry_run=True, steps=plain_steps())
    assert [(k, [r["step"] for r in rows]) for k, rows in shown] == [(f"retention-plan-{RUN}", [10])]
    shown.clear()
    run_retention(keep2, run=RUN, steps=plain_steps())
    assert [(k, [(r["step"], r["outcome"]) for r in rows]) for k, rows in shown] == [
        (f"retention-result-{RUN}", [(10, PRUNED)])]
    shown.clear()
    run_retention(keep2, steps=plain_steps())  # catalog-wide: reports even an empty result
    assert [k for k, _ in shown] == ["retention-result-all"]
