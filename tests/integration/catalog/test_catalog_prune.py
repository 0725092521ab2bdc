"""The prune guard (checked in the same transaction as the state change) and its races."""

from __future__ import annotations

import multiprocessing
import queue
import threading

import pytest

from core.errors import IllegalTransition, PruneRefused, StaleState
from db.entities import PRUNED, PRUNING, VERIFIED
from tests.kit.catalog import checkpoint, prune_worker, verified


def _two_copies(cat, run="r", step=100, tiers=(1, 2)):
    """Checkpoint ``step`` verified on ``tiers`` plus a newer verified checkpoint."""
    ck = checkpoint(cat, run, step)
    reps = [verified(cat, ck.id, t) for t in tiers]
    verified(cat, checkpoint(cat, run, step + 1000).id, 1)
    return ck, reps


def test_prune_with_a_durable_copy_elsewhere_is_allowed_and_audited(catalog):
    _, (t1, _t2) = _two_copies(catalog)
    rep = catalog.begin_prune(t1.id, actor="retention", reason="keep_last=10")
    assert rep.state == PRUNING
    assert catalog.transition(rep.id, PRUNED, expected=PRUNING, actor="retention",
                              claim_token=rep.claim_token).state == PRUNED
    last = catalog.history("r", 100)[-1]
    assert (last.from_state, last.to_state, last.actor) == (PRUNING, PRUNED, "retention")


def test_the_last_verified_copy_is_never_pruned(catalog):
    _, (t1, t2) = _two_copies(catalog)
    catalog.begin_prune(t1.id, actor="a")
    with pytest.raises(PruneRefused, match="no other verified copy"):
        catalog.begin_prune(t2.id, actor="a")  # t1 is pruning, not verified: it does not count
    assert catalog.get_replica(t2.id).state == VERIFIED


def test_a_node_local_copy_does_not_protect_a_shared_one(catalog):
    _, (t0, t1) = _two_copies(catalog, tiers=(0, 1))
    with pytest.raises(PruneRefused, match="at least as durable"):
        catalog.begin_prune(t1.id, actor="a")
    assert catalog.begin_prune(t0.id, actor="a").state == PRUNING


def test_newest_verified_checkpoint_of_a_run_is_kept(catalog):
    ck = checkpoint(catalog, "r", 100)
    t1, _ = verified(catalog, ck.id, 1), verified(catalog, ck.id, 2)
    with pytest.raises(PruneRefused, match="newest verified"):
        catalog.begin_prune(t1.id, actor="a")
    verified(catalog, checkpoint(catalog, "r", 200).id, 0)
    assert catalog.begin_prune(t1.id, actor="a").state == PRUNING


def test_pins_and_aliases_keep_a_checkpoint(catalog):
    _, (t1, _) = _two_copies(catalog)
    catalog.pin("r", 100, reason="paper figure", actor="cli")
    with pytest.raises(PruneRefused, match="pinned"):
        catalog.begin_prune(t1.id, actor="a")
    catalog.unpin("r", 100, actor="cli")
    catalog.set_alias("r", "best", 100, actor="cli")
    with pytest.raises(PruneRefused, match="aliased as 'best'"):
        catalog.begin_prune(t1.id, actor="a")
    catalog.remove_alias("r", "best", actor="cli")
    assert catalog.begin_prune(t1.id, actor="a").state == PRUNING
    assert [e.action for e in catalog.history("r", 100)][-5:] == ["pin", "unpin", "alias", "unalias", "transition"]


def test_prune_of_a_replica_that_is_not_verified(catalog):
    _, (t1, _) = _two_copies(catalog)
    catalog.begin_prune(t1.id, actor="a")
    with pytest.raises(StaleState, match="already being pruned"):
        catalog.begin_prune(t1.id, actor="b")
    ck = checkpoint(catalog, "r", 5)
    claim = catalog.claim_copy(ck.id, 1, 0, "file:///x", node=None, actor="a")
    with pytest.raises(IllegalTransition):
        catalog.begin_prune(claim.replica.id, actor="a")


def test_abandoned_prune_returns_to_verified(catalog):
    _, (t1, t2) = _two_copies(catalog)
    owner = catalog.begin_prune(t1.id, actor="a")
    assert catalog.transition(t1.id, VERIFIED, expected=PRUNING, actor="a",
                              claim_token=owner.claim_token).state == VERIFIED
    assert catalog.begin_prune(t2.id, actor="a").state == PRUNING


# --- races: the last two copies, pruned at the same moment ---------------------------------
ROUNDS = 4


def _race_setup(cat):
    pairs = []
    for i in range(ROUNDS):
        _, (t1, t2) = _two_copies(cat, run=f"race-{i}")
        pairs.append((t1.id, t2.id))
    return pairs


def _check_exactly_one_won(cat, pairs, outcomes):
    for a, b in pairs:
        got = sorted([outcomes[a], outcomes[b]])
        assert got == ["PruneRefused", "won"], (a, b, got)
        states = sorted([cat.get_replica(a).state, cat.get_replica(b).state])
        assert states == [PRUNING, VERIFIED]


def test_a_prune_whose_answer_was_lost_is_given_back_to_its_token_only(catalog):
    _, (t1, _t2) = _two_copies(catalog)
    lost = catalog.claim_prune(t1.id, actor="retention", token="t-lost")  # committed; its caller never heard
    assert lost.replica.state == PRUNING and not lost.took_over
    with pytest.raises(StaleState):
        catalog.claim_prune(t1.id, actor="other", token="t-other")  # another worker: the live prune is not its
    again = catalog.claim_prune(t1.id, actor="retention", token="t-lost")
    assert again.reclaimed and again.took_over and again.refused is None
    assert again.replica.claim_token == "t-lost"
    assert [e.action for e in catalog.history("r", 100)][-1] == "reclaim"
    assert catalog.transition(t1.id, PRUNED, expected=PRUNING, actor="retention",
                              claim_token="t-lost").state == PRUNED


def test_a_reclaimed_prune_carries_the_guard_s_verdict_now(catalog):
    _, (t1, _t2) = _two_copies(catalog)
    catalog.claim_prune(t1.id, actor="retention", token="t-lost")
    catalog.pin("r", 100, actor="operator", reason="a user pinned it meanwhile")
    again = catalog.claim_prune(t1.id, actor="retention", token="t-lost")
    assert again.reclaimed and again.refused and "pinned" in again.refused  # the owner must abandon it


def test_two_threads_pruning_the_last_two_copies_exactly_one_wins(catalog, db_url):
    pairs = _race_setup(catalog)
    barrier, results = threading.Barrier(2), queue.Queue()
    workers = [threading.Thread(target=prune_worker, args=(db_url, [p[i] for p in pairs], barrier, results))
               for i in (0, 1)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    outcomes = dict(results.get_nowait() for _ in range(2 * ROUNDS))
    _check_exactly_one_won(catalog, pairs, outcomes)


def test_two_processes_pruning_the_last_two_copies_exactly_one_wins(catalog, db_url):
    pairs = _race_setup(catalog)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=prune_worker, args=(db_url, [p[i] for p in pairs], barrier, results))
             for i in (0, 1)]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=120) for _ in range(2 * ROUNDS))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    _check_exactly_one_won(catalog, pairs, outcomes)
