"""Issue 9, items 1, 2 and 9: the prune guard checks evidence on the tiers, a prune is a
claimed operation with one owner and a renewed lease. Real catalogs (SQLite, PostgreSQL),
real local tier folders; interleavings are driven by a store wrapper, never by wall-clock races."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
from sqlalchemy import select

from core.errors import PruneRefused, StaleState, StorageUnavailable
from core.settings import RetentionPolicy
from flows.common import plain_steps
from flows.promote import promote
from tests.kit.checkpoints import (
    ckpt_dir,
    flip_bit,
    open_catalog as catalog,
    published_files,
    replica_states,
    shard_paths,
    truncate,
    write_checkpoint,
)
from tests.kit.pipeline import pipeline_settings

RUN = "run-a"


@pytest.fixture
def settings(settings_factory, db_url):
    return pipeline_settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1))


def _replica(settings, step, tier):
    cat = catalog(settings)
    try:
        ck = cat.get_checkpoint(RUN, step)
        return next(r for r in cat.replicas(ck.id, tier) if r.part == 0)
    finally:
        cat.close()


def _lease_expiry(settings, replica_id):
    from db.models import Replica

    cat = catalog(settings)
    try:
        with cat.engine.connect() as conn:
            return conn.execute(select(Replica.lease_expires_at).where(Replica.id == replica_id)).scalar_one()
    finally:
        cat.close()


def _hook_tier0_deletes(monkeypatch, settings, on_delete):
    """Wrap the Tier 0 store the prune step opens: ``on_delete(prefix, n)`` runs before the n-th
    (from 1) fenced delete sets its objects aside (``TierStore.bury``, where a delete's first
    byte goes) and may raise to fail it."""
    import tasks.prune as prune_mod

    real_open = prune_mod.open_tier
    calls = {"n": 0}

    @contextmanager
    def hooked(s, tier):
        with real_open(s, tier) as store:
            if tier == 0:
                real_bury = store.bury

                def bury(prefix, paths, *, token):
                    calls["n"] += 1
                    on_delete(prefix, calls["n"])
                    return real_bury(prefix, paths, token=token)
                store.bury = bury
            yield store

    monkeypatch.setattr(prune_mod, "open_tier", hooked)
    return calls


# --- item 1: the guard checks evidence, not only rows ----------------------------------------
def test_a_tier1_copy_deleted_behind_the_catalog_does_not_justify_pruning_tier0(settings):
    import shutil

    write_checkpoint(settings.tier0_url, RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    shutil.rmtree(ckpt_dir(settings.tier1_url, RUN, 100))  # an operator's rm, a scratch purge

    write_checkpoint(settings.tier0_url, RUN, 200)
    result = promote(settings, RUN, 200, steps=plain_steps())  # its retention wants step 100 off Tier 0

    assert [a.outcome for a in result.retention if a.step == 100] == ["refused"]
    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "missing"}
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2  # the only copy left is intact
    cat = catalog(settings)
    try:
        reasons = [e.reason for e in cat.history(RUN, 100) if e.to_state == "missing"]
    finally:
        cat.close()
    assert reasons and "evidence check" in reasons[0] and "vanished" in reasons[0]


def test_a_truncated_tier1_file_does_not_justify_pruning_tier0(settings):
    write_checkpoint(settings.tier0_url, RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    truncate(shard_paths(settings.tier1_url, RUN, 100)[0])  # rot scrub has not reached yet

    write_checkpoint(settings.tier0_url, RUN, 200)
    promote(settings, RUN, 200, steps=plain_steps())

    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "corrupt"}
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2


@pytest.mark.parametrize("evidence", ["read", "stat"])
def test_a_same_size_bit_flip_on_tier1_does_not_justify_pruning_tier0(settings, evidence):
    """Rot that keeps the size (found by the fault soak): only reading the justifying copy's
    bytes back finds it, so the prune does that before deleting the Tier 0 copy, even with
    ``prune_evidence=stat``: a stat check never justifies deleting the last other good copy."""
    settings = settings.model_copy(update={"prune_evidence": evidence})
    write_checkpoint(settings.tier0_url, RUN, 100)
    promote(settings, RUN, 100, steps=plain_steps())
    flip_bit(shard_paths(settings.tier1_url, RUN, 100)[0])  # same size, wrong bytes, scrub not there yet

    write_checkpoint(settings.tier0_url, RUN, 200)
    promote(settings, RUN, 200, steps=plain_steps())

    assert replica_states(settings, RUN, 100) == {(0, 0): "verified", (1, 0): "corrupt"}
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2


def test_a_good_tier1_copy_still_lets_tier0_go(settings):
    for step in (100, 200):
        write_checkpoint(settings.tier0_url, RUN, step)
        promote(settings, RUN, step, steps=plain_steps())
    assert replica_states(settings, RUN, 100) == {(0, 0): "pruned", (1, 0): "verified"}
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()


# --- item 2: a prune is a claimed operation with an owner ------------------------------------
@pytest.fixture
def two_steps(settings_factory, db_url):
    """Steps 100 and 200 promoted with Tier 0 retention off, so the test decides when to prune."""
    s = pipeline_settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1, enabled=False))
    for step in (100, 200):
        write_checkpoint(s.tier0_url, RUN, step)
        promote(s, RUN, step, steps=plain_steps())
    return s.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1)})


def test_a_second_prune_never_takes_over_a_live_prune_whose_delete_failed(two_steps, monkeypatch):
    from tasks.prune import prune_replica

    settings = two_steps
    rid = _replica(settings, 100, 0).id
    seen = {}

    def on_delete(key, n):
        if n == 1:  # prune A, inside its first delete: prune B arrives, then A's delete fails
            with pytest.raises(PruneRefused, match="another worker owns the prune") as refused:
                prune_replica(settings, rid, actor="prune-b")
            seen["b"] = str(refused.value)
            raise StorageUnavailable("NVMe hiccup")

    _hook_tier0_deletes(monkeypatch, settings, on_delete)
    with pytest.raises(StorageUnavailable):
        prune_replica(settings, rid, actor="prune-a")

    assert "b" in seen
    # A gave the copy back because it is provably whole; B deleted nothing
    assert replica_states(settings, RUN, 100)[(0, 0)] == "verified"
    assert len(shard_paths(settings.tier0_url, RUN, 100)) == 2
    assert "manifest.json" in published_files(settings.tier0_url, RUN, 100)


def test_two_overlapping_retention_runs_prune_once(two_steps, monkeypatch):
    """cron retention and post-promotion retention both planned step 100's Tier 0 copy; the
    second applies its plan while the first is deleting it."""
    from flows.retention import run_retention
    from tasks.prune import prune_replica
    from tasks.retention import apply_retention, plan_retention

    settings = two_steps
    plan_b = plan_retention(settings, run=RUN)
    assert [(a.tier, a.step) for a in plan_b] == [(0, 100)]
    inner = {}

    def on_delete(key, n):
        if n == 1:  # retention A is deleting step 100's Tier 0 copy: retention B applies now
            inner["b"] = apply_retention(settings, plan_b, prune=prune_replica, actor="retention-b")

    _hook_tier0_deletes(monkeypatch, settings, on_delete)
    outer = run_retention(settings, run=RUN, steps=plain_steps(), actor="retention-a")

    assert [(a.step, a.outcome) for a in outer if a.tier == 0] == [(100, "pruned")]
    assert [(a.step, a.outcome) for a in inner["b"] if a.tier == 0] == [(100, "refused")]
    assert replica_states(settings, RUN, 100) == {(0, 0): "pruned", (1, 0): "verified"}
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()
    cat = catalog(settings)
    try:
        moves = [(e.actor, e.from_state, e.to_state) for e in cat.history(RUN, 100)
                 if e.subject == f"replica:{_replica(settings, 100, 0).id}" and e.from_state == "pruning"]
    finally:
        cat.close()
    assert moves == [("retention-a", "pruning", "pruned")]


def test_a_prune_another_retention_run_finished_is_done_by_another_not_failed(two_steps, monkeypatch):
    """Retention B tries step 100's Tier 0 copy while retention A is deleting it (B's claim is
    refused: "already being pruned"), and A finishes before B looks at the row again: B reports
    the copy ``done by another``, not a failure. The interleaving is held by events: A waits in
    its first delete until B's claim was refused; B waits until A's run has returned."""
    import threading

    from db.catalog import Catalog
    from flows.retention import run_retention
    from tasks.prune import prune_replica
    from tasks.retention import DONE_BY_ANOTHER, apply_retention, plan_retention

    settings = two_steps
    plan_b = plan_retention(settings, run=RUN)
    b_refused, a_done, inner = threading.Event(), threading.Event(), {}
    real_claim = Catalog.claim_prune

    def claim_prune(self, replica_id, *, actor, **kw):
        try:
            return real_claim(self, replica_id, actor=actor, **kw)
        except StaleState:
            if actor == "retention-b":
                b_refused.set()
                assert a_done.wait(60)
            raise

    def retention_b():
        inner["b"] = apply_retention(settings, plan_b, prune=prune_replica, actor="retention-b")

    b = threading.Thread(target=retention_b)

    def on_delete(key, n):
        if n == 1:  # A owns the prune and deletes: B applies its plan now
            b.start()
            assert b_refused.wait(60)

    monkeypatch.setattr(Catalog, "claim_prune", claim_prune)
    _hook_tier0_deletes(monkeypatch, settings, on_delete)
    outer = run_retention(settings, run=RUN, steps=plain_steps(), actor="retention-a")
    a_done.set()
    b.join(60)

    assert [(a.step, a.outcome) for a in outer if a.tier == 0] == [(100, "pruned")]
    assert [(a.step, a.outcome) for a in inner["b"] if a.tier == 0] == [(100, DONE_BY_ANOTHER)]
    assert "pruned by another worker" in inner["b"][0].detail
    assert replica_states(settings, RUN, 100) == {(0, 0): "pruned", (1, 0): "verified"}


def test_only_the_owner_settles_a_prune(two_steps):
    settings = two_steps
    rid = _replica(settings, 100, 0).id
    cat = catalog(settings)
    try:
        owner = cat.begin_prune(rid, actor="a")
        with pytest.raises(StaleState):
            cat.transition(rid, "verified", expected="pruning", actor="intruder")
        with pytest.raises(StaleState):
            cat.transition(rid, "pruned", expected="pruning", actor="intruder", claim_token="not-the-owner")
        assert cat.transition(rid, "verified", expected="pruning", actor="a",
                              claim_token=owner.claim_token).state == "verified"
    finally:
        cat.close()


# --- item 9: long operations renew their lease -----------------------------------------------
def test_a_prune_longer_than_its_lease_is_not_taken_over_while_its_worker_lives(two_steps, monkeypatch):
    from tasks.prune import prune_replica

    settings = two_steps.model_copy(update={"claim_lease_seconds": 2.0})
    rid = _replica(settings, 100, 0).id
    seen = {}

    def on_delete(key, n):
        if n != 1:
            return
        first = _lease_expiry(settings, rid)
        deadline = time.monotonic() + 60
        # hold the claim until the lease was renewed well past the first lease's end
        while (_lease_expiry(settings, rid) - first).total_seconds() < 3.0:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
        cat = catalog(settings)
        try:
            with pytest.raises(StaleState, match="already being pruned"):
                cat.claim_prune(rid, actor="competitor", lease_seconds=2.0)
        finally:
            cat.close()
        seen["renewed_by_s"] = (_lease_expiry(settings, rid) - first).total_seconds()

    _hook_tier0_deletes(monkeypatch, settings, on_delete)
    prune_replica(settings, rid, actor="slow-prune")

    assert seen["renewed_by_s"] >= 3.0
    assert replica_states(settings, RUN, 100)[(0, 0)] == "pruned"
    assert not ckpt_dir(settings.tier0_url, RUN, 100).exists()
