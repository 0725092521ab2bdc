"""Issue 9, items 3, 9 and 10: reconcile recovers claims whose worker died (a prune or a copy
killed mid-way, simulated by leaving the catalog as the killed worker left it and expiring its
lease in the database, never by waiting), and leases and retention ages use the catalog's clock."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from core.errors import CatalogUnavailable, NotFound
from core.layout import part_key
from core.settings import RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from flows.reconcile import reconcile_once
from tests.kit.checkpoints import (
    ckpt_dir,
    expire_claims,
    open_catalog as catalog,
    replica_states,
    shard_paths,
    write_checkpoint,
)
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    """Steps 100 and 200 on Tiers 0 and 1; Tier 0 keeps 3, so nothing was pruned yet."""
    s = pipeline_settings(settings_factory, db_url)
    for step in (100, 200):
        write_checkpoint(s.tier0_url, RUN, step)
        promote(s, RUN, step, steps=plain_steps())
    return s


def _tier0(settings, step):
    cat = catalog(settings)
    try:
        ck = cat.get_checkpoint(RUN, step)
        return next(r for r in cat.replicas(ck.id, 0) if r.part == 0)
    finally:
        cat.close()


def _history(settings, step):
    cat = catalog(settings)
    try:
        return cat.history(RUN, step)
    finally:
        cat.close()


def _killed_prune(settings, step, *, delete_manifest: bool) -> int:
    """A prune of step's Tier 0 copy whose worker died (after its manifest delete, or before)."""
    rid = _tier0(settings, step).id
    cat = catalog(settings)
    try:
        cat.begin_prune(rid, actor="killed-worker", reason="retention policy")
    finally:
        cat.close()
    if delete_manifest:
        (ckpt_dir(settings.tier0_url, RUN, step) / part_key(RUN, step, 0, 1).rsplit("/", 1)[-1]).unlink()
    return rid


def test_reconcile_finishes_a_prune_killed_after_its_manifest_delete(settings):
    _killed_prune(settings, 100, delete_manifest=True)
    assert expire_claims(settings) == 1

    report = reconcile_once(settings, steps=plain_steps())

    assert replica_states(settings, RUN, 100) == {(0, 0): "pruned", (1, 0): "verified"}
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()  # no orphan shards left on NVMe
    assert any("stalled prune finished" in r for r in report.recovered)
    cat = catalog(settings)
    try:
        actions = [(e.action, e.to_state) for e in cat.history(RUN, 100)]
    finally:
        cat.close()
    assert ("takeover", "pruning") in actions and actions[-1] == ("transition", "pruned")
    again = reconcile_once(settings, steps=plain_steps())  # idempotent
    assert again.recovered == [] and again.failed == []


def test_a_taken_over_prune_rechecks_the_evidence_and_gives_the_copy_back(settings):
    _killed_prune(settings, 100, delete_manifest=False)
    shutil.rmtree(ckpt_dir(settings.tier1_url, RUN, 100))  # the justifying copy vanished meanwhile
    expire_claims(settings)

    report = reconcile_once(settings, steps=plain_steps())

    assert replica_states(settings, RUN, 100)[(0, 0)] == "verified"
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2
    assert any("stalled prune given up" in r for r in report.recovered)
    # and reconcile's own sweeps then restore the Tier 1 copy from the intact Tier 0 one
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"


def test_a_prune_whose_claim_answer_was_lost_is_finished_by_its_retry_at_once(settings, monkeypatch):
    from db.catalog import Catalog
    from tasks.prune import prune_replica

    original, committed = Catalog.claim_prune, []

    def claim_prune(self, replica_id, **kwargs):  # commits, then the connection drops: once
        claim = original(self, replica_id, **kwargs)
        if not committed:
            committed.append(claim.replica.claim_token)
            raise CatalogUnavailable("server closed the connection unexpectedly (after COMMIT)")
        return claim

    monkeypatch.setattr(Catalog, "claim_prune", claim_prune)
    rid = _tier0(settings, 100).id
    with pytest.raises(CatalogUnavailable):
        prune_replica(settings, rid, actor="retention", reason="keep_last")
    assert replica_states(settings, RUN, 100)[(0, 0)] == "pruning"  # committed, held by nobody

    done = prune_replica(settings, rid, actor="retention", reason="keep_last")  # the task's retry: no lease to wait

    assert done.replica_id == rid and replica_states(settings, RUN, 100) == {(0, 0): "pruned", (1, 0): "verified"}
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()
    history = _history(settings, 100)
    assert [e.action for e in history if e.subject == f"replica:{rid}"][-2:] == ["reclaim", "transition"]
    assert any(e.action == "delete" and "taken back" in (e.reason or "") for e in history)


def test_a_prune_whose_end_the_catalog_missed_is_finished_by_its_retry_at_once(settings, monkeypatch):
    from db.catalog import Catalog
    from tasks.prune import prune_replica

    original, failed = Catalog.transition, []

    def transition(self, replica_id, to_state, **kwargs):  # the prune's end is not recorded: once
        if to_state == "pruned" and not failed:
            failed.append(replica_id)
            raise CatalogUnavailable("could not connect to server")
        return original(self, replica_id, to_state, **kwargs)

    monkeypatch.setattr(Catalog, "transition", transition)
    rid = _tier0(settings, 100).id
    with pytest.raises(CatalogUnavailable):
        prune_replica(settings, rid, actor="retention", reason="keep_last")
    assert replica_states(settings, RUN, 100)[(0, 0)] == "pruning"  # its files gone, held by nobody
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()

    done = prune_replica(settings, rid, actor="retention", reason="keep_last")  # the task's retry: no lease to wait

    assert done.replica_id == rid and replica_states(settings, RUN, 100) == {(0, 0): "pruned", (1, 0): "verified"}
    history = _history(settings, 100)
    assert [e.action for e in history if e.subject == f"replica:{rid}"][-2:] == ["reclaim", "transition"]


def test_reconcile_leaves_a_live_prune_alone(settings):
    rid = _killed_prune(settings, 100, delete_manifest=False)  # lease still live: a worker owns it

    report = reconcile_once(settings, steps=plain_steps())

    assert report.recovered == []
    assert _tier0(settings, 100).state == "pruning" and _tier0(settings, 100).id == rid
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2


def _kill_a_verify_after_its_claim(settings, step) -> int:
    """Scrub found the NVMe copy wanting; a verify re-claims it, then its process is killed."""
    rid = _tier0(settings, step).id
    cat = catalog(settings)
    try:
        cat.transition(rid, "missing", expected="verified", actor="scrub", reason="test")
        ck = cat.get_checkpoint(RUN, step)
        claim = cat.claim_copy(ck.id, 0, 0, _tier0(settings, step).url, node=settings.node, actor="verify")
        assert claim.acquired
    finally:
        cat.close()
    expire_claims(settings)
    return rid


def test_a_verify_killed_after_its_claim_is_re_checked_against_its_files(settings):
    rid = _kill_a_verify_after_its_claim(settings, 100)

    report = reconcile_once(settings, steps=plain_steps())

    assert _tier0(settings, 100).state == "verified"  # its files are whole: not assumed gone
    assert any("stalled copy -> verified" in r for r in report.recovered)
    cat = catalog(settings)
    try:
        moves = [(e.from_state, e.to_state) for e in cat.history(RUN, 100) if e.subject == f"replica:{rid}"]
    finally:
        cat.close()
    assert moves[-3:] == [("copying", "missing"), ("missing", "copying"), ("copying", "verified")]
    assert reconcile_once(settings, steps=plain_steps()).recovered == []


def test_a_lapsed_claim_on_a_copy_no_longer_whole_is_not_trusted(settings):
    _kill_a_verify_after_its_claim(settings, 100)
    shard_paths(settings.tier0_url, RUN, 100)[0].unlink()

    report = reconcile_once(settings, steps=plain_steps())

    assert _tier0(settings, 100).state in ("missing", "corrupt")
    assert any("stalled copy -> corrupt" in r or "stalled copy -> missing" in r for r in report.recovered)
    assert replica_states(settings, RUN, 100)[(1, 0)] == "verified"  # the good copy is untouched


def test_a_re_check_that_breaks_fails_only_its_own_item(settings):
    """A lapsed claim whose re-check raises something unexpected is that item's failure: the
    pass goes on and promotes the node's next checkpoint."""
    _kill_a_verify_after_its_claim(settings, 100)
    write_checkpoint(settings.tier0_url, RUN, 300)
    steps = plain_steps()
    real_verify = steps.verify

    def verify(s, run, step, *a, **kw):
        if step == 100:
            raise RuntimeError("a driver bug")
        return real_verify(s, run, step, *a, **kw)

    report = reconcile_once(settings, steps=replace(steps, verify=verify))

    assert len(report.failed) == 1 and "RuntimeError: a driver bug" in report.failed[0]
    assert f"{RUN}/300 part 0" in report.promoted
    assert replica_states(settings, RUN, 300)[(1, 0)] == "verified"


def test_a_killed_tier0_verify_does_not_leak_the_node_s_disk(settings):
    """The sequence of issue 17 c: the Tier 0 verify of step 300 is killed after its claim; the
    retried promotion finds the live claim, reads the copy but records nothing, and copies to
    Tier 1; once the lease lapses, reconcile re-checks the NVMe copy, and retention can prune it."""
    from tasks.register import register_stored_part

    write_checkpoint(settings.tier0_url, RUN, 300)
    register_stored_part(settings, RUN, 300)
    cat = catalog(settings)
    try:  # the killed verify's claim
        ck = cat.get_checkpoint(RUN, 300)
        assert cat.claim_copy(ck.id, 0, 0, "file:///nvme", node=settings.node, actor="verify").acquired
    finally:
        cat.close()
    promote(settings, RUN, 300, steps=plain_steps())  # the retried hop: copied under the live claim
    assert replica_states(settings, RUN, 300) == {(0, 0): "copying", (1, 0): "verified"}
    expire_claims(settings)

    reconcile_once(settings, steps=plain_steps())
    assert replica_states(settings, RUN, 300)[(0, 0)] == "verified"

    keep_one = settings.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1)})
    write_checkpoint(settings.tier0_url, RUN, 400)
    promote(keep_one, RUN, 400, steps=plain_steps())
    assert replica_states(settings, RUN, 300)[(0, 0)] == "pruned"
    assert not ckpt_dir(settings.tier0_url, RUN, 300).exists()  # the NVMe space came back


# --- item 10: the catalog's clock ---------------------------------------------------------------
def _skew(monkeypatch, delta: timedelta) -> None:
    """The worker's clock (what the catalog module reads from Python) runs ``delta`` off."""
    import db.clock

    real = datetime

    class Skewed(real):
        @classmethod
        def now(cls, tz=None):
            return real.now(tz) + delta

    monkeypatch.setattr(db.clock, "datetime", Skewed)


@pytest.mark.postgres
def test_a_worker_five_minutes_fast_cannot_steal_a_live_claim(pg_url, monkeypatch):
    from db.catalog import Catalog
    from tests.kit.catalog import checkpoint

    cat = Catalog.open(pg_url, auto_upgrade=True)
    try:
        ck = checkpoint(cat, "r", 1)
        first = cat.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="honest", lease_seconds=120)
        assert first.acquired
        _skew(monkeypatch, timedelta(minutes=5))
        second = cat.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="fast-clock", lease_seconds=120)
        assert not second.acquired
        assert cat.get_replica(first.replica.id).claim_token == first.replica.claim_token
    finally:
        cat.close()


def test_a_lagging_writer_s_fresh_checkpoint_is_not_pruned_at_once_by_max_age(db_url, monkeypatch):
    from core.retention import Rules, plan
    from db.catalog import Catalog
    from tests.kit.catalog import checkpoint, manifest, verified

    cat = Catalog.open(db_url, auto_upgrade=True)
    try:
        cat.ensure_run("r")
        lagging = (datetime.now(UTC) - timedelta(days=3)).isoformat()
        ck = cat.register_part(replace(manifest("r", 100), created_at=lagging), actor="writer")
        verified(cat, ck.id, 0), verified(cat, ck.id, 1)
        verified(cat, checkpoint(cat, "r", 200).id, 1)  # a newer one, so 100 is not the newest
        policy = RetentionPolicy(max_age_days=1)
        decided = plan(cat.retention_facts(), Rules(policies={0: policy, 1: policy}), cat.clock())
        assert [(d.tier, d.reason) for d in decided.replicas if d.step == 100] == [(0, "max_age"), (1, "max_age")]
    finally:
        cat.close()


def test_scrub_repairs_tier1_rot_from_a_tier0_copy_under_a_live_prune_claim(settings):
    """A dead pruner's lease is still live on the Tier 0 copy of step 100 when its Tier 1 copy
    rots: reading that copy deletes nothing, so scrub repairs Tier 1 from it, and after the
    lapse reconcile finishes the prune on the strength of the repaired copy."""
    from tasks.scrub import scrub
    from tests.kit.checkpoints import flip_bit, same_bytes

    rid = _killed_prune(settings, 100, delete_manifest=False)
    flip_bit(shard_paths(settings.tier1_url, RUN, 100)[0])  # same size, wrong bytes

    report = scrub(settings, fraction=1.0)

    assert [(r.tier, r.source_tier, r.ok) for r in report.repairs if r.step == 100] == [(1, 0, True)], report.repairs
    assert replica_states(settings, RUN, 100) == {(0, 0): "pruning", (1, 0): "verified"}
    for src in shard_paths(settings.tier0_url, RUN, 100):
        assert same_bytes(src, ckpt_dir(settings.tier1_url, RUN, 100) / src.name)
    assert _tier0(settings, 100).id == rid

    expire_claims(settings)
    reconcile_once(settings, steps=plain_steps())
    assert replica_states(settings, RUN, 100) == {(0, 0): "pruned", (1, 0): "verified"}


def test_a_part_just_committed_is_left_to_its_event_until_the_grace_has_passed(settings):
    """The job commits a part a moment before it announces it: the agent promotes it on the
    event, and the checkpoint's one promote run carries its follow-ups. Reconcile's pass on the
    same node must not race it into a second route (the follow-ups would then run in the
    reconcile run and the checkpoint would have no promote run); once the manifest is older
    than the grace, the part is reconcile's (its event was lost)."""
    write_checkpoint(settings.tier0_url, RUN, 300)
    manifest = ckpt_dir(settings.tier0_url, RUN, 300) / part_key(RUN, 300, 0, 1).rsplit("/", 1)[-1]

    report = reconcile_once(settings, steps=plain_steps(), event_seconds=600)
    assert report.promoted == [] and report.failed == []
    with catalog(settings) as cat, pytest.raises(NotFound):
        cat.get_checkpoint(RUN, 300)  # not registered: the event's promotion does that

    old = manifest.stat().st_mtime - 601
    os.utime(manifest, (old, old))
    report = reconcile_once(settings, steps=plain_steps(), event_seconds=600)
    assert report.promoted == [f"{RUN}/300 part 0"]
    assert replica_states(settings, RUN, 300)[(1, 0)] == "verified"


def test_only_a_recent_commit_is_young_never_one_dated_in_the_future():
    from tasks.reconcile import young_parts

    committed = [(("r", 1, 0, 1, ""), 1000.0), (("r", 2, 0, 1, "a1"), 1095.0), (("r", 3, 0, 1, ""), 1200.0),
                 (("r", 4, 0, 1, ""), None)]
    # step 1: past the grace; step 3: written "after now" (a clock set back); step 4: no time known
    assert young_parts(committed, 60, now=1100.0) == {("r", 2, 0, "a1")}
    assert young_parts(committed, 0, now=1100.0) == set()
