"""Scrub bookkeeping in the catalog: ``checked_at`` is stamped when a copy becomes verified and
by ``mark_checked``; ``scrub_candidates`` hands out verified replicas least recently read first,
so reading ``limit`` per round visits all of them within a cycle. Both backends."""

from __future__ import annotations

import math
from datetime import UTC

import pytest
from sqlalchemy import text

from core.errors import BadInput, NotFound, UnknownRun
from db.entities import CORRUPT, MISSING, VERIFIED
from tests.kit.catalog import checkpoint, replica_in_state, verified


def test_a_replica_is_checked_when_it_becomes_verified(catalog):
    rep = verified(catalog, checkpoint(catalog, "r", 1).id, 1)
    assert rep.checked_at is not None and rep.checked_at == rep.verified_at
    assert catalog.get_replica(rep.id).checked_at == rep.verified_at


def test_candidates_are_verified_replicas_on_the_tiers_oldest_checked_first(catalog):
    reps = [verified(catalog, checkpoint(catalog, "r", s).id, 1 if s % 2 else 2) for s in (1, 2, 3, 4)]
    verified(catalog, catalog.get_checkpoint("r", 1).id, 0)  # tier 0: not asked for
    replica_in_state(catalog, checkpoint(catalog, "r", 5).id, 1, CORRUPT)
    replica_in_state(catalog, checkpoint(catalog, "r", 6).id, 2, MISSING)

    assert [r.id for r in catalog.scrub_candidates((1, 2), None)] == [r.id for r in reps]
    assert [r.id for r in catalog.scrub_candidates([1], None)] == [reps[0].id, reps[2].id]
    assert [r.id for r in catalog.scrub_candidates((1, 2), 2)] == [reps[0].id, reps[1].id]
    assert catalog.count_verified((1, 2)) == 4 and catalog.count_verified([0]) == 1
    assert all(r.state == VERIFIED for r in catalog.scrub_candidates((0, 1, 2), None))

    assert catalog.mark_checked(reps[0].id, actor="scrub") is True
    assert [r.id for r in catalog.scrub_candidates((1, 2), 2)] == [reps[1].id, reps[2].id]
    assert catalog.scrub_candidates((1, 2), None)[-1].checked_at > reps[-1].checked_at


def test_reading_a_share_per_round_visits_every_replica_within_a_cycle(catalog):
    reps = [verified(catalog, checkpoint(catalog, "r", s).id, 1) for s in range(1, 8)]
    per_round = math.ceil(0.3 * len(reps))
    seen: list[int] = []
    for _ in range(math.ceil(len(reps) / per_round)):
        batch = catalog.scrub_candidates([1], per_round)
        for r in batch:
            catalog.mark_checked(r.id, actor="scrub")
        seen += [r.id for r in batch]
    ids = [r.id for r in reps]
    assert seen == ids + ids[:len(seen) - len(ids)]  # each once, oldest first; the last round wraps around


def test_never_checked_replicas_come_first_on_both_backends(catalog):
    reps = [verified(catalog, checkpoint(catalog, "r", s).id, 1) for s in (1, 2, 3)]
    with catalog.engine.begin() as conn:  # as a row stamped by nothing (e.g. written by an older ckpt)
        conn.execute(text("UPDATE replicas SET checked_at = NULL WHERE id = :i"), {"i": reps[2].id})
    assert [r.id for r in catalog.scrub_candidates([1], None)] == [reps[2].id, reps[0].id, reps[1].id]
    assert [r.id for r in catalog.scrub_candidates([1], 1)] == [reps[2].id]


def test_mark_checked_leaves_a_replica_that_is_no_longer_verified_alone(catalog):
    ck = checkpoint(catalog, "r", 1)
    bad = replica_in_state(catalog, ck.id, 1, CORRUPT)
    assert catalog.mark_checked(bad.id, actor="scrub") is False
    assert catalog.get_replica(bad.id).checked_at is None
    good = verified(catalog, ck.id, 2)
    assert catalog.mark_checked(good.id, actor="scrub") is True
    assert catalog.history("r", 1)[-1].to_state == VERIFIED  # a clean check writes no audit row
    with pytest.raises(NotFound):
        catalog.mark_checked(10_000, actor="scrub")


def test_candidates_of_one_run_and_argument_errors(catalog):
    a = verified(catalog, checkpoint(catalog, "a", 1).id, 1)
    verified(catalog, checkpoint(catalog, "b", 1).id, 1)
    assert [r.id for r in catalog.scrub_candidates([1], None, run="a")] == [a.id]
    assert catalog.count_verified([1], run="a") == 1
    assert catalog.scrub_candidates([1], 0) == [] and catalog.scrub_candidates([], 5) == []
    with pytest.raises(UnknownRun):
        catalog.scrub_candidates([1], 5, run="ghost")
    with pytest.raises(BadInput):
        catalog.scrub_candidates([7], 5)


def test_bad_replicas_are_the_corrupt_and_missing_ones_on_the_tiers(catalog):
    ok = verified(catalog, checkpoint(catalog, "r", 1).id, 1)
    corrupt = replica_in_state(catalog, checkpoint(catalog, "r", 2).id, 1, CORRUPT)
    missing = replica_in_state(catalog, checkpoint(catalog, "r", 3).id, 2, MISSING)
    assert [r.id for r in catalog.bad_replicas((1, 2))] == [corrupt.id, missing.id]
    assert [r.id for r in catalog.bad_replicas([2])] == [missing.id]
    assert ok.id not in [r.id for r in catalog.bad_replicas((0, 1, 2))]


def test_upgrading_a_0002_catalog_starts_verified_replicas_from_their_verified_at(db_url):
    from datetime import datetime

    from db.catalog import Catalog, upgrade
    from db.migrate import upgrade_connection
    from db.rows import checkpoints, replicas, runs
    from db.session import make_engine

    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    engine = make_engine(db_url)
    with engine.begin() as conn:  # a catalog written before 0003: only the columns it had
        upgrade_connection(conn, "0002")
        conn.execute(runs.insert().values(id=1, name="r", created_at=at, tags={}))
        conn.execute(checkpoints.insert().values(
            id=1, run_id=1, step=1, kind="step", state="committed", format="safetensors", parts=1,
            parts_registered=1, total_bytes=1, file_count=1, metrics={}, tags={}, created_at=at, verified_tiers=2))
        for rid, tier, state, verified_at in ((1, 1, "verified", at), (2, 2, "corrupt", at), (3, 0, "copying", None)):
            conn.execute(replicas.insert().values(id=rid, checkpoint_id=1, tier=tier, part=0, url="file:///x",
                                                  state=state, verified_at=verified_at, created_at=at,
                                                  updated_at=at))
    engine.dispose()
    upgrade(db_url)
    with Catalog(db_url) as cat:
        assert [cat.get_replica(i).checked_at for i in (1, 2, 3)] == [at, None, None]
        assert [r.id for r in cat.scrub_candidates((1, 2), 5)] == [1]


def test_an_abandoned_prune_does_not_count_as_a_read(catalog):
    from tests.kit.catalog import prunable_setup

    old = prunable_setup(catalog)
    rep = verified(catalog, old.id, 1)
    owner = catalog.begin_prune(rep.id, actor="retention")
    back = catalog.transition(rep.id, VERIFIED, actor="retention", reason="prune abandoned",
                              claim_token=owner.claim_token)
    assert back.checked_at == rep.checked_at  # nothing was read back: its turn in the scrub is kept
