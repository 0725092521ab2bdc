"""The replica state machine: legal moves only, compare-and-set, claims with leases."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import insert

from core.errors import BadInput, IllegalTransition, NotFound, PruneRefused, StaleState
from db.catalog import Catalog
from db.entities import COPYING, CORRUPT, MISSING, PENDING, PRUNED, PRUNING, TRANSITIONS, VERIFIED
from db.models import Replica
from tests.kit.catalog import PATHS, checkpoint, manifest, prunable_setup, replica_in_state, verified

ALL = sorted(TRANSITIONS)


def test_every_illegal_move_raises_and_changes_nothing(catalog):
    for state in PATHS:
        ck = prunable_setup(catalog, run=f"r-{state}")
        rep = replica_in_state(catalog, ck.id, 1, state)
        assert rep.state == state
        for to in ALL:
            if to in TRANSITIONS[state]:
                continue
            with pytest.raises(IllegalTransition, match=f"{state} -> {to}"):
                catalog.transition(rep.id, to, actor="test")
            assert catalog.get_replica(rep.id).state == state


def test_pending_row_moves_only_to_copying_corrupt_missing(catalog):
    ck = checkpoint(catalog, "r", 1)
    with catalog.engine.begin() as conn:
        rid = conn.execute(insert(Replica).values(
            checkpoint_id=ck.id, tier=1, part=0, url="file:///x", state=PENDING,
            created_at=ck.created_at, updated_at=ck.created_at).returning(Replica.id)).scalar_one()
    for to in (VERIFIED, PRUNING, PRUNED):
        with pytest.raises(IllegalTransition):
            catalog.transition(rid, to, actor="test")
    assert catalog.transition(rid, MISSING, actor="test").state == MISSING


def test_every_legal_move_is_audited_with_actor_and_reason(catalog):
    ck = prunable_setup(catalog)
    rep = replica_in_state(catalog, ck.id, 1, VERIFIED)
    catalog.transition(rep.id, CORRUPT, actor="flow-run-7", reason="crc mismatch in shard-0")
    moves = [(e.from_state, e.to_state, e.actor) for e in catalog.history("r", 100) if e.subject == f"replica:{rep.id}"]
    assert moves == [(PENDING, COPYING, "test"), (COPYING, VERIFIED, "test"), (VERIFIED, CORRUPT, "flow-run-7")]
    assert "crc mismatch" in catalog.history("r", 100)[-1].reason


def test_entering_verified_stamps_time_and_records_copy_facts(catalog):
    ck = checkpoint(catalog, "r", 1)
    claim = catalog.claim_copy(ck.id, 2, 0, "s3://b/r/step-1", node=None, actor="test")
    assert claim.replica.verified_at is None
    rep = catalog.transition(claim.replica.id, VERIFIED, expected=COPYING, claim_token=claim.replica.claim_token,
                             actor="test", bytes=2000, copy_seconds=1.5, etag="abc", version_id="v1")
    assert rep.verified_at is not None and rep.verified_at.tzinfo is not None
    assert (rep.bytes, rep.copy_seconds, rep.etag, rep.version_id) == (2000, 1.5, "abc", "v1")
    assert rep.claim_token is None


def test_expected_state_is_compare_and_set(catalog):
    ck = checkpoint(catalog, "r", 1)
    rep = replica_in_state(catalog, ck.id, 1, VERIFIED)
    with pytest.raises(StaleState, match="expected copying"):
        catalog.transition(rep.id, CORRUPT, expected=COPYING, actor="test")
    assert catalog.transition(rep.id, CORRUPT, expected=[COPYING, VERIFIED], actor="test").state == CORRUPT


def test_foreign_claim_token_is_stale(catalog):
    ck = checkpoint(catalog, "r", 1)
    claim = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="test")
    with pytest.raises(StaleState):
        catalog.transition(claim.replica.id, VERIFIED, claim_token="not-mine", actor="test")
    assert catalog.get_replica(claim.replica.id).state == COPYING


def test_claim_is_exclusive_while_live_and_nothing_to_do_once_verified(catalog):
    ck = checkpoint(catalog, "r", 1)
    first = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a")
    second = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="b")
    assert first.acquired and not second.acquired
    assert second.replica.state == COPYING and second.replica.id == first.replica.id
    catalog.transition(first.replica.id, VERIFIED, claim_token=first.replica.claim_token, actor="a")
    again = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="b")
    assert not again.acquired and again.replica.state == VERIFIED


def test_stale_claim_is_taken_over_and_old_owner_loses(catalog):
    ck = checkpoint(catalog, "r", 1)
    old = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", lease_seconds=0.2)
    time.sleep(0.3)
    new = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="b")
    assert new.acquired and new.replica.claim_token != old.replica.claim_token
    with pytest.raises(StaleState):
        catalog.heartbeat(old.replica.id, old.replica.claim_token)
    with pytest.raises(StaleState):
        catalog.transition(old.replica.id, VERIFIED, claim_token=old.replica.claim_token, actor="a")
    assert catalog.transition(new.replica.id, VERIFIED, claim_token=new.replica.claim_token, actor="b").node == "n1"


def test_a_claim_whose_answer_was_lost_is_given_back_to_its_token_only(catalog):
    ck = checkpoint(catalog, "r", 1)
    lost = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", lease_seconds=60, token="t-lost")
    assert lost.acquired and lost.replica.claim_token == "t-lost"  # committed; say its caller never heard
    assert not catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="b", token="t-other").acquired
    again = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", lease_seconds=60, token="t-lost")
    assert again.acquired and again.replica.id == lost.replica.id and again.replica.claim_token == "t-lost"
    assert again.replica.updated_at >= lost.replica.updated_at
    reclaims = [e for e in catalog.history("r", 1) if e.action == "reclaim"]
    assert len(reclaims) == 1 and "answer was lost" in reclaims[0].reason and reclaims[0].actor == "a"
    assert catalog.transition(again.replica.id, VERIFIED, claim_token="t-lost", actor="a").state == VERIFIED
    # once settled, the token claims nothing: a verified replica has nothing to copy
    assert not catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", token="t-lost").acquired


def test_a_lost_claim_whose_lease_lapsed_is_given_back_with_a_fresh_lease(catalog):
    ck = checkpoint(catalog, "r", 1)
    catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", lease_seconds=0.2, token="t-lost")
    time.sleep(0.3)
    assert [r.claim_token for r in catalog.expired_claims()] == ["t-lost"]
    again = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", lease_seconds=60, token="t-lost")
    assert again.acquired and again.replica.claim_token == "t-lost" and catalog.expired_claims() == []
    assert not catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="b").acquired


def test_a_lost_claim_taken_over_by_another_worker_is_not_given_back(catalog):
    ck = checkpoint(catalog, "r", 1)
    catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", lease_seconds=0.2, token="t-lost")
    time.sleep(0.3)  # its lease lapses (the catalog's clock: only ever later than this)
    other = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="b", token="t-b")
    assert other.acquired and other.replica.claim_token == "t-b"
    late = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", token="t-lost")
    assert not late.acquired and late.replica.claim_token == "t-b" and late.replica.node == "n1"


def test_heartbeat_keeps_a_claim_alive(catalog):
    ck = checkpoint(catalog, "r", 1)
    claim = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a", lease_seconds=0.5)
    for _ in range(3):
        time.sleep(0.25)
        catalog.heartbeat(claim.replica.id, claim.replica.claim_token)
    assert not catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n1", actor="b").acquired


def test_recopy_after_corrupt_is_a_new_claim(catalog):
    ck = checkpoint(catalog, "r", 1)
    rep = replica_in_state(catalog, ck.id, 1, CORRUPT)
    claim = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node="n0", actor="a")
    assert claim.acquired and claim.replica.id == rep.id and claim.replica.state == COPYING


def test_bad_inputs_are_clear_errors(catalog):
    ck = checkpoint(catalog, "r", 1)
    with pytest.raises(BadInput, match="part 3 out of range"):
        catalog.claim_copy(ck.id, 1, 3, "file:///t1", node=None, actor="a")
    with pytest.raises(BadInput, match="unknown tier"):
        catalog.claim_copy(ck.id, 7, 0, "file:///t1", node=None, actor="a")
    with pytest.raises(NotFound):
        catalog.claim_copy(ck.id + 99, 1, 0, "file:///t1", node=None, actor="a")
    with pytest.raises(NotFound):
        catalog.transition(12345, VERIFIED, actor="a")
    rep = replica_in_state(catalog, ck.id, 1, COPYING)
    with pytest.raises(BadInput, match="unknown replica state"):
        catalog.transition(rep.id, "gone", actor="a")


def test_transition_into_pruning_goes_through_the_guard(catalog):
    ck = checkpoint(catalog, "r", 1)
    rep = replica_in_state(catalog, ck.id, 1, VERIFIED)
    with pytest.raises(PruneRefused):
        catalog.transition(rep.id, PRUNING, actor="a")


def _race(n: int, fn):
    """Run ``fn(i)`` in ``n`` threads released together; return their results."""
    barrier, results = threading.Barrier(n), [None] * n

    def worker(i):
        barrier.wait(timeout=30)
        results[i] = fn(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_racing_claims_on_a_new_replica_exactly_one_acquires(catalog, db_url):
    ck = checkpoint(catalog, "r", 1)
    cats = [Catalog(db_url) for _ in range(4)]
    try:
        claims = _race(4, lambda i: cats[i].claim_copy(ck.id, 1, 0, "file:///t1", node=f"n{i}", actor=f"a{i}"))
    finally:
        for c in cats:
            c.close()
    assert sorted(c.acquired for c in claims) == [False, False, False, True]
    assert len(catalog.replicas(ck.id)) == 1


def test_racing_completion_checks_exactly_one_sees_it(catalog, db_url):
    ck = checkpoint(catalog, "r", 1)
    verified(catalog, ck.id, 1)
    cats = [Catalog(db_url) for _ in range(4)]
    try:
        seen = _race(4, lambda i: cats[i].complete_on_tier(ck.id, 1, actor=f"a{i}"))
    finally:
        for c in cats:
            c.close()
    assert sorted(seen) == [False, False, False, True]


def test_parts_verified_at_the_same_moment_make_the_checkpoint_complete(catalog, db_url):
    """N nodes verify their parts concurrently: the last one must see the others (the
    complete-on-tier mark and complete_on_tier depend on it)."""
    n = 4
    catalog.ensure_run("r")
    for part in range(n):
        ck = catalog.register_part(manifest("r", 1, part=part, parts=n), actor="t")
    claims = [catalog.claim_copy(ck.id, 1, p, f"file:///t1/{p}", node=f"n{p}", actor="t") for p in range(n)]
    cats = [Catalog(db_url) for _ in range(n)]
    try:
        _race(n, lambda i: cats[i].transition(claims[i].replica.id, VERIFIED, claim_token=claims[i].replica.claim_token,
                                              actor=f"agent:n{i}"))
        done = _race(n, lambda i: cats[i].complete_on_tier(ck.id, 1, actor=f"agent:n{i}"))
    finally:
        for c in cats:
            c.close()
    assert [loc.tier for loc in catalog.locations("r", 1)] == [1]
    assert sorted(done) == [False] * (n - 1) + [True]
