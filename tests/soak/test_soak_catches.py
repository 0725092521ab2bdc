"""The soak's own test: it must fail when the pipeline is broken. With every copy failing
(``core.transfer.copy_part`` always raising ``StorageUnavailable``) a short soak reports an
error in an operation with no fault planned (and no progress); with a prune that skips the
evidence check (``tasks.prune.justification_refused`` saying yes unread), a Tier 1 copy rotted
behind the catalog's back justifies deleting the last good copy, and the soak's invariant
names the lost checkpoint; with the attempt rules off (a resume supersedes nothing, no part is
superseded at birth), a relaunch past a lost step leaves the older attempt's checkpoint offered;
with registration dropping a manifest's origin, or reconcile sweeping no staging, a killed
child run's origin or a killed save's staging is reported; with the tier identity proof off, a
root replaced by an empty folder is taken as the tier (its copies judged missing there, or written
onto it); with a promotion taking a full Tier 1 as a verdict on its Tier 0 source, that copy is
reported marked although its bytes match; with a prune's deletes unfenced (in place, by names listed
before its worker paused), the worker that wakes deletes the copy reconcile put back after the
checkpoint was pinned; with attempts ordered by their first record alone, a killed launch the
catalog hears of after its relaunch resumed counts as the newer one. The same scripted sequences
pass on the real pipeline."""

from __future__ import annotations

from datetime import timedelta

import pytest
from faults import Plan, S3Plan
from test_soak import STATS, Soak, _run, prepare

from core.errors import StorageUnavailable
from tests.kit.s3_proxy import S3Proxy

NO_SKEW = timedelta(0)


@pytest.fixture
def proxy(s3_endpoint):
    from test_soak import S3_FAULTS

    p = S3Proxy(s3_endpoint, on_request=S3_FAULTS)
    yield p
    p.close()


@pytest.mark.parametrize("caught_by", ["the error", "no progress"])
def test_a_soak_with_every_copy_failing_fails(caught_by, db_url, s3_endpoint, proxy, settings_factory, monkeypatch):
    """Caught twice over: by the first fault-free promotion's error, and (with errors only
    counted, as the soak used to) by the progress it lacks."""
    import test_soak

    import core.transfer

    def broken_copy(*args, **kwargs):
        raise StorageUnavailable("copy_part is broken")

    monkeypatch.setattr(core.transfer, "copy_part", broken_copy)
    if caught_by == "no progress":
        monkeypatch.setattr(test_soak, "UNPLANNED", "count")
    expected = (r"promote\(node-0,100\) raised StorageUnavailable: copy_part is broken with no fault planned"
                if caught_by == "the error" else r"too little progress: checkpoints_verified_tier1 0 < 1; "
                r"checkpoints_verified_tier2 0 < 1; restores_bytes_match 0 < 1")
    STATS.clear()
    with pytest.raises(AssertionError, match=expected):
        _run(db_url, s3_endpoint, proxy.url, settings_factory, monkeypatch, examples=1, steps=6, shrink=False)
    assert STATS["checkpoints_verified_tier1"] == 0


def _prune_past_rot(db_url, s3_endpoint, proxy, settings_factory, monkeypatch) -> list[int]:
    """Step 100 is promoted (Tier 0 and Tier 1 verified), its Tier 1 copy gets a bit flipped,
    step 200 is promoted: its inline retention wants step 100's Tier 0 copy gone (keep_last 1).
    Returns the steps on node-0's Tier 0 at the end."""
    prepare(db_url, s3_endpoint, proxy.url, settings_factory, monkeypatch)
    m = Soak()
    m.setup()
    try:
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.nothing_is_lost()
        assert m.committed("t1") == [100] and m.committed("t0:node-0") == [100]
        m.damage("t1", 0, "flip")
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.nothing_is_lost()
        return m.committed("t0:node-0")
    finally:
        m.teardown()


def test_the_soak_passes_the_real_prune_past_a_rotted_copy(db_url, s3_endpoint, proxy, settings_factory,
                                                           monkeypatch):
    on_tier0 = _prune_past_rot(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    assert 100 in on_tier0  # the guard read the rotted copy back and kept this one


def test_a_prune_that_skips_the_evidence_check_fails_the_soak(db_url, s3_endpoint, proxy, settings_factory,
                                                              monkeypatch):
    import tasks.prune

    monkeypatch.setattr(tasks.prune, "justification_refused", lambda *args, **kwargs: None)
    with pytest.raises(AssertionError, match="step 100 reached verified and has no good copy left"):
        _prune_past_rot(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)


# --- a checkpoint that leaves the catalog, a retirement ----------------------------------------
def _two_checkpoints(db_url, s3_endpoint, proxy, settings_factory, monkeypatch) -> Soak:
    prepare(db_url, s3_endpoint, proxy.url, settings_factory, monkeypatch)
    m = Soak()
    m.setup()
    m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
    m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
    m.nothing_is_lost()
    assert {100, 200} <= m.ever_verified
    return m


def _sql(m: Soak, stmt) -> None:
    from db.catalog import Catalog

    cat = Catalog(m.settings["node-0"].catalog_url)
    try:
        with cat.engine.begin() as conn:
            conn.execute(stmt)
    finally:
        cat.close()


def _audit(m: Soak, step: int, action: str, to_state: str | None, *, subject: str | None = None,
           from_state: str | None = None) -> None:
    from datetime import UTC, datetime

    from sqlalchemy import insert

    from db.models import AuditLog
    _sql(m, insert(AuditLog.__table__).values(at=datetime.now(UTC), actor="retention", action=action,
                                              subject=subject or f"checkpoint:run-a/{step}", from_state=from_state,
                                              to_state=to_state, reason="test", run="run-a", step=step))


def m_catalog(m: Soak):
    from db.catalog import Catalog

    return Catalog(m.settings["node-0"].catalog_url)


def _retire(m: Soak, step: int) -> None:
    from sqlalchemy import update

    from db.models import Checkpoint
    ck = Checkpoint.__table__
    _sql(m, update(ck).where(ck.c.step == step).values(state="retired"))
    _audit(m, step, "transition", "retired")


def _delete_files(m: Soak, step: int) -> None:
    """What a retirement's deletes do: each verified replica to ``pruning`` (audited, as a prune
    audits it) then ``pruned``, a ``delete`` row, the files gone."""
    import shutil

    from sqlalchemy import select, update

    from db.models import Checkpoint, Replica
    ck, reps = Checkpoint.__table__, Replica.__table__
    cat = m_catalog(m)
    try:
        ids = [r.id for r in cat.replicas(cat.get_checkpoint("run-a", step).id) if r.state == "verified"]
    finally:
        cat.close()
    for rid in ids:
        _audit(m, step, "transition", "pruning", subject=f"replica:{rid}", from_state="verified")
    _sql(m, update(reps).where(reps.c.checkpoint_id.in_(select(ck.c.id).where(ck.c.step == step)))
         .values(state="pruned"))
    _audit(m, step, "delete", None)
    for loc in ("t0:node-0", "t0:node-1", "t1"):
        shutil.rmtree(m.folder(loc, step), ignore_errors=True)


def test_a_verified_checkpoint_that_leaves_the_catalog_is_lost(db_url, s3_endpoint, proxy, settings_factory,
                                                               monkeypatch):
    from sqlalchemy import update

    from db.models import Checkpoint
    m = _two_checkpoints(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        ck = Checkpoint.__table__
        _sql(m, update(ck).where(ck.c.step == 100).values(step=99_999))  # its rows are gone from step 100
        with pytest.raises(AssertionError, match="step 100 reached verified and is no longer in the catalog"):
            m.nothing_is_lost()
    finally:
        m.teardown()


def test_a_retirement_recorded_before_the_deletes_loses_nothing(db_url, s3_endpoint, proxy, settings_factory,
                                                                monkeypatch):
    m = _two_checkpoints(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _retire(m, 100)
        _delete_files(m, 100)
        m.nothing_is_lost()
        assert m.good_now(100) == set() and m.retired == {100}
    finally:
        m.teardown()


def test_a_retirement_recorded_after_the_deletes_is_a_loss(db_url, s3_endpoint, proxy, settings_factory,
                                                           monkeypatch):
    m = _two_checkpoints(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _delete_files(m, 100)
        _retire(m, 100)
        with pytest.raises(AssertionError, match="step 100 is retired, but its copies went before the retirement"):
            m.nothing_is_lost()
    finally:
        m.teardown()


def test_retiring_the_newest_verified_checkpoint_fails_the_soak(db_url, s3_endpoint, proxy, settings_factory,
                                                                  monkeypatch):
    """Recorded first or not, a retirement of what retention never retires is a violation."""
    m = _two_checkpoints(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _retire(m, 200)
        with pytest.raises(AssertionError, match="step 200 was retired although it is the newest that reached"):
            m.nothing_is_lost()
    finally:
        m.teardown()


def test_a_restore_that_fails_past_a_verified_copy_fails_the_soak(db_url, s3_endpoint, proxy, settings_factory,
                                                                  monkeypatch):
    import tasks.restore
    from core.errors import NotFound

    def broken_restore(*args, **kwargs):
        raise NotFound("restore is broken")

    prepare(db_url, s3_endpoint, proxy.url, settings_factory, monkeypatch)
    m = Soak()
    m.setup()
    try:
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.nothing_is_lost()
        m.restore("node-0", 0, False, S3Plan(), NO_SKEW)  # the real restore returns the saved bytes
        assert STATS["restores_bytes_match"] >= 1
        monkeypatch.setattr(tasks.restore, "restore_checkpoint", broken_restore)
        with pytest.raises(AssertionError, match=r"restore\(node-1,100\) failed \(NotFound: restore is broken\) "
                                                 r"although the catalog holds a verified copy"):
            m.restore("node-1", 0, False, S3Plan(), NO_SKEW)
    finally:
        m.teardown()


# --- attempts: a relaunch supersedes what it did not resume from -------------------------------
def _restart_past_a_lost_step(m: Soak) -> None:
    """Steps 100, 200 and 300 are promoted on node-0; every copy of 300 is destroyed; the job
    relaunches (attempt a1): both nodes resume from 200, so 300 of the unnamed attempt is
    superseded, and a1 saves 300 again with other bytes and promotes it."""
    for _ in range(3):
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.nothing_is_lost()
    for loc in ("t0:node-0", "t1"):
        m.damage(loc, m.committed(loc).index(300), "delete")
    m.nothing_is_lost()
    m.restart()
    m.nothing_is_lost()
    m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
    m.nothing_is_lost()


def _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch) -> Soak:
    prepare(db_url, s3_endpoint, proxy.url, settings_factory, monkeypatch)
    m = Soak()
    m.setup()
    return m


def _soak_fails(expected: str, scenario, db_url, s3_endpoint, proxy, settings_factory, monkeypatch) -> None:
    """``scenario`` on a fresh machine fails the soak with a violation matching ``expected``."""
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        with pytest.raises(AssertionError, match=expected):
            scenario(m)
    finally:
        m.teardown()


def test_the_soak_passes_a_real_relaunch(db_url, s3_endpoint, proxy, settings_factory, monkeypatch):
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _restart_past_a_lost_step(m)
        assert m.attempt == "a1" and m.live[300] == "a1" and (300, "") in m.superseded
        cat = m_catalog(m)
        try:
            assert cat.get_checkpoint("run-a", 300).attempt == "a1"
            assert cat.get_checkpoint("run-a", 300, "").state == "superseded"
        finally:
            cat.close()
        m.restore("node-1", 0, True, S3Plan(), NO_SKEW)  # the newest: a1's 300, with a1's bytes
        m.check_pass()
        m.nothing_is_lost()
    finally:
        m.teardown()


def test_a_relaunch_that_supersedes_nothing_fails_the_soak(db_url, s3_endpoint, proxy, settings_factory,
                                                            monkeypatch):
    """With the attempt rules off (a resume supersedes nothing, a part is never superseded at
    birth), the older attempt's step 300 stays offered beside the relaunch's own."""
    import db.attempts
    import db.register

    def supersede_nothing(conn, run, attempt, step, *, now, actor):
        db.attempts.attempt_row(conn, run.id, attempt, now=now)
        return []

    monkeypatch.setattr(db.register, "standing", lambda *args, **kwargs: None)
    monkeypatch.setattr(db.attempts, "record_resume", supersede_nothing)
    _soak_fails(r"step 300 of attempt \(unnamed\) is 'committed' \(offered again\)|offered step 300 of attempt "
                r"\(unnamed\)|mixing two", _restart_past_a_lost_step, db_url, s3_endpoint, proxy, settings_factory,
                monkeypatch)


def test_a_relaunched_attempts_archive_restores_from_tier2(db_url, s3_endpoint, proxy, settings_factory,
                                                           monkeypatch):
    """Found by the soak: a named attempt's milestone whose nearer copies are gone restores from
    its Tier 2 archive (the restore reads the attempt's own manifest there, and never marks a copy
    it read under another name missing)."""
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.restart()
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)  # 200@a1, a milestone: archived
        m.nothing_is_lost()
        assert m.live[200] == "a1" and "t2" in m.good_now(200)
        for loc in ("t0:node-0", "t1"):
            m.damage(loc, m.committed(loc).index(200), "delete")
        m.nothing_is_lost()
        before = STATS["restores_when_only_tier2_was_good"]
        m.restore("node-1", 0, False, S3Plan(), NO_SKEW)  # aimed at 200, which only Tier 2 holds
        m.nothing_is_lost()
        assert STATS["restores_when_only_tier2_was_good"] == before + 1
    finally:
        m.teardown()


def test_a_step_saved_again_restores_the_live_attempt_past_a_late_retired_one(db_url, s3_endpoint, proxy,
                                                                           settings_factory, monkeypatch):
    """Found by the soak (seed 3344277743): a save of the unnamed attempt that no event announced,
    found by reconcile after the relaunch saved its step again, is recorded superseded, then
    retired; a restore of that step must still find the relaunch's live checkpoint, not the
    retired one registered after it."""
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)  # 100
        m.restart("node-1", unannounced=1)  # 200 on node-1, never announced; a1 resumes from 100
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)  # 200@a1: durable
        m.reconcile("node-1", Plan(), S3Plan(), NO_SKEW)  # finds 200 of the unnamed attempt: superseded
        m.retention("node-1", Plan(), S3Plan(), NO_SKEW)  # retires it: a1 has a durable checkpoint
        m.nothing_is_lost()
        before = STATS["restores_bytes_match"]
        m.restore("node-1", 2, False, S3Plan(), NO_SKEW)  # aimed at 200
        assert STATS["restores_bytes_match"] == before + 1
        cat = m_catalog(m)
        try:
            assert cat.get_checkpoint("run-a", 200, "").state == "retired"
            assert cat.get_checkpoint("run-a", 200).attempt == "a1"
        finally:
            cat.close()
    finally:
        m.teardown()


# --- a run's origin, a dead writer's staging --------------------------------------------------
def _origin_and_staging(m: Soak) -> None:
    """Step 100 is promoted; a second run fine-tuned from it saves on node-1 and dies before its
    registration; a save on node-0 is killed mid-write; reconcile runs on both nodes."""
    m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
    m.child_save_lost("node-1", 0, "fine_tuned_from", False)
    m.killed_mid_save("node-0")
    for node in ("node-0", "node-1"):
        m.reconcile(node, Plan(), S3Plan(), NO_SKEW)
    m.nothing_is_lost()


def test_the_soak_passes_a_real_origin_and_staging_sweep(db_url, s3_endpoint, proxy, settings_factory, monkeypatch):
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _origin_and_staging(m)
        cat = m_catalog(m)
        try:
            edges = cat.ancestors("child-0", 100, max_depth=1)
        finally:
            cat.close()
        assert [(e.parent_run, e.parent_step, e.relation) for e in edges] == [("run-a", 100, "fine_tuned_from")]
        assert not any(m.dead_staging.values())
    finally:
        m.teardown()


@pytest.mark.parametrize("broken", ["origin ignored", "no staging sweep"])
def test_a_lost_origin_or_a_staging_left_fails_the_soak(broken, db_url, s3_endpoint, proxy, settings_factory,
                                                        monkeypatch):
    import db.register
    import flows.reconcile

    if broken == "origin ignored":  # registration drops the origin a manifest declares
        monkeypatch.setattr(db.register, "_learn_origin", lambda conn, run, m, **kwargs: run)
        expected = r"run child-0 declared fine_tuned_from run-a/100; the catalog records None None/None"
    else:
        monkeypatch.setattr(flows.reconcile, "sweep_writer_staging", lambda *args, **kwargs: None)
        expected = r"reconcile\(node-0\) left a dead writer's staging on Tier 0"
    _soak_fails(expected, _origin_and_staging, db_url, s3_endpoint, proxy, settings_factory, monkeypatch)


# --- a tier root that disappears and comes back; a Tier 1 that fills -------------------------
UNMOUNTED_OPS = ["scrub", "reconcile", "retention", "save_and_promote", "restore"]


def _root_unmounted(m: Soak, which: str) -> None:
    """Steps 100 and 200 are promoted on node-0 (200, a milestone, archived); Tier 1's root or
    node-0's Tier 0 root is replaced by an empty folder while scrub, reconcile, retention, a
    save (node-1's, when node-0's Tier 0 is gone) and a restore run on node-0; then it comes
    back and a check pass runs."""
    for _ in range(2):
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.nothing_is_lost()
    m.tier_root_unmounted("node-0", which, UNMOUNTED_OPS, 0)
    m.nothing_is_lost()
    m.check_pass()
    m.nothing_is_lost()


@pytest.mark.parametrize("which", ["t1", "t0"])
def test_the_soak_passes_a_real_root_that_comes_back(which, db_url, s3_endpoint, proxy, settings_factory,
                                                     monkeypatch):
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _root_unmounted(m, which)
        assert STATS["tier_unavailable_raised"] >= 1  # the stand-in was refused, not used
        # after the root came back the pipeline carried on: the save made meanwhile reached Tier 1
        assert m.committed("t1") == [200, 300] and "t1" in m.good_now(300)
    finally:
        m.teardown()


@pytest.mark.parametrize("which", ["t1", "t0"])
def test_a_tier_root_taken_unproven_fails_the_soak(which, db_url, s3_endpoint, proxy, settings_factory, monkeypatch):
    """With the identity proof off (``core.storage.identity.prove`` accepts any root; a root is
    still marked and recorded on first use), the empty stand-in is taken as the tier: its copies
    are judged missing there, or the pipeline writes onto it."""
    from core.storage import identity

    monkeypatch.setattr(identity, "prove", lambda store, recorded: None)
    _soak_fails(r"was marked (missing|corrupt) although t\S+ root was an empty stand-in|wrote onto the empty "
                r"stand-in", lambda m: _root_unmounted(m, which), db_url, s3_endpoint, proxy, settings_factory,
                monkeypatch)


def _tier1_full(m: Soak) -> None:
    """Step 100 is promoted; step 200's promotion finds Tier 1 full at its first write; then
    reconcile runs on node-0 with room again."""
    m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
    m.nothing_is_lost()
    m.save_while_tier1_is_full("node-0", "put_verified", 0)
    m.nothing_is_lost()
    m.reconcile("node-0", Plan(), S3Plan(), NO_SKEW)
    m.nothing_is_lost()


def test_the_soak_passes_a_real_promotion_into_a_full_tier1(db_url, s3_endpoint, proxy, settings_factory,
                                                           monkeypatch):
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _tier1_full(m)
        assert STATS["fault_kind:tier1_full"] >= 1 and STATS["error:StorageFull"] >= 1
        assert {"t0:node-0", "t1"} <= m.good_now(200)  # reconcile carried it on once there was room
    finally:
        m.teardown()


def test_a_full_tier1_taken_as_a_verdict_on_the_source_fails_the_soak(db_url, s3_endpoint, proxy, settings_factory,
                                                                      monkeypatch):
    """With the fused promotion taking the destination's ``StorageFull`` as a verdict on its Tier
    0 source (recorded corrupt), the soak names the Tier 0 copy marked although its bytes match."""
    import tasks.copy
    from core.errors import CorruptCheckpoint, StorageFull

    real = tasks.copy._Tier0Source._verdict

    def full_is_corrupt(self, exc):
        if isinstance(exc, StorageFull):
            self.in_copy = False
            exc = CorruptCheckpoint(f"tier 1 is full: {exc}")
        return real(self, exc)

    monkeypatch.setattr(tasks.copy._Tier0Source, "_verdict", full_is_corrupt)
    _soak_fails(r"step 200: Tier 1 was full, and the catalog marked its Tier 0 copy on node-0 corrupt although its "
                r"bytes match", _tier1_full, db_url, s3_endpoint, proxy, settings_factory, monkeypatch)


def test_a_failed_repair_of_a_superseded_step_is_judged_by_its_own_copies(db_url, s3_endpoint, proxy,
                                                                          settings_factory, monkeypatch):
    """Found by the soak once a full Tier 1 was among its faults: step 300's promotion finds Tier
    1 full (its only copy: node-0's Tier 0), the job relaunches (node-1 cannot read that copy, so
    both resume from 200 and 300 is superseded), and scrub on node-1 cannot repair 300's Tier 1
    copy from there. The error names step 300 without its attempt; the soak judged it by the live
    checkpoint's copies, which 300 no longer has, and took the superseded checkpoint's registered
    files for a checkpoint mixing two attempts."""
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        for _ in range(2):
            m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.save_while_tier1_is_full("node-0", "put_verified", 0)
        m.nothing_is_lost()
        m.restart("node-0")
        assert (300, "") in m.superseded and 300 not in m.live
        m.scrub("node-1", Plan(), S3Plan(), NO_SKEW)
        m.nothing_is_lost()
        assert STATS["expected_error:repair_source_on_another_node"] >= 1
    finally:
        m.teardown()


# --- a prune worker paused past its lease while its checkpoint is pinned and copied back --------
def _paused_prune(m: Soak) -> None:
    """Steps 100 to 300 are promoted on node-0 (each promotion's retention prunes what its rules
    let go). Step 400's promotion prunes an older Tier 1 copy and its worker stops inside the
    delete, after setting the copy aside: its lease lapses, the checkpoint is pinned, reconcile
    takes the prune over, gives it up and copies the part to Tier 1 again. Then the worker goes
    on with its delete; a check pass and the invariants read every verified copy's bytes."""
    from test_soak import INJECTOR

    for _ in range(3):
        m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
        m.nothing_is_lost()
    INJECTOR.hold = lambda: m._takeover("node-0", pin=True)
    step, m.next_step = m.next_step, m.next_step + 100
    m._save("node-0", step, 0)
    m._promote("node-0", step, Plan(kind="pause", target="store", method="delete_tomb", tier=1),
               label="promote_paused")
    m.nothing_is_lost()
    m.check_pass()
    m.nothing_is_lost()


def test_the_soak_passes_a_real_prune_paused_past_its_lease(db_url, s3_endpoint, proxy, settings_factory,
                                                             monkeypatch):
    STATS.clear()
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _paused_prune(m)
        assert STATS["pinned_while_its_prune_was_paused"] == 1 and STATS["takeovers_while_a_worker_was_paused"] == 1
        [pinned] = m.pinned
        assert "t1" in m.good_now(pinned)  # given up and copied back; the late worker deleted only its tombstone
    finally:
        m.teardown()


def test_a_paused_prune_that_deletes_in_place_fails_the_soak(db_url, s3_endpoint, proxy, settings_factory,
                                                            monkeypatch):
    """With the deletes unfenced, as before issue 39 (a folder's files deleted in place, by the
    names listed before the pause, with no claim check), the worker that wakes deletes what the
    new copy published: Tier 1 is left recorded verified without its bytes."""
    from core.storage.base import TierStore
    from core.storage.local import LocalStore

    monkeypatch.setattr(LocalStore, "bury", TierStore.bury)
    monkeypatch.setattr(LocalStore, "exhume", TierStore.exhume)
    monkeypatch.setattr(LocalStore, "delete_tomb",
                        lambda self, tomb, check: sum(int(self.delete(k)) for k in tomb.keys))
    _soak_fails(r"Tier 1 is verified with bytes other than the registered ones", _paused_prune, db_url, s3_endpoint,
                proxy, settings_factory, monkeypatch)


# --- a launch the catalog hears of only after its relaunch resumed ------------------------------
def _relaunch_before_any_registration(m: Soak) -> None:
    """Steps 100 to 300 are saved on node-0 and never announced (the agents were down); the job
    relaunches (attempt a1) and both nodes resume from scratch, the catalog knowing nothing.
    Then reconcile finds the killed launch's folders, and a1 saves and promotes its own 100."""
    for _ in range(3):
        m.save_event_lost("node-0", NO_SKEW)
    m.restart()
    m.nothing_is_lost()
    m.reconcile("node-0", Plan(), S3Plan(), NO_SKEW)
    m.nothing_is_lost()
    m.save_and_promote("node-0", Plan(), S3Plan(), NO_SKEW)
    m.nothing_is_lost()


def test_the_soak_passes_a_launch_heard_of_after_its_relaunch(db_url, s3_endpoint, proxy, settings_factory,
                                                              monkeypatch):
    m = _machine(db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
    try:
        _relaunch_before_any_registration(m)
        cat = m_catalog(m)
        try:
            old = [ck for ck in cat.list_checkpoints("run-a") if ck.attempt == ""]
            assert sorted(ck.step for ck in old) == [100, 200, 300]
            # history from birth; retired since, once a1 had a durable checkpoint
            assert {(ck.state in ("superseded", "retired"), ck.superseded_by) for ck in old} == {(True, "a1")}
            assert cat.newest_verified("run-a").attempt == "a1"
        finally:
            cat.close()
    finally:
        m.teardown()


def test_attempts_ordered_by_first_record_fail_the_soak(db_url, s3_endpoint, proxy, settings_factory, monkeypatch):
    """With attempts ordered only by when the catalog first heard of them, and no refusal of a
    launch that never resumed (as before), the killed launch's parts, heard of after a1 resumed,
    count as the newer attempt's: offered again."""
    import db.attempts

    monkeypatch.setattr(db.attempts, "_launched_after", lambda x, me, written: me is not None and x.id > me.id)
    monkeypatch.setattr(db.attempts, "_reused", lambda *args, **kwargs: None)  # nor refused as a reused name
    _soak_fails(r"step \d00 of attempt \(unnamed\) (is 'committed' \(offered again\)|was retired before attempt a1)",
                _relaunch_before_any_registration, db_url, s3_endpoint, proxy, settings_factory, monkeypatch)
