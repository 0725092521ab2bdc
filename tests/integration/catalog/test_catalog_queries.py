"""The ten catalog queries, each on the answer a user would check."""

from __future__ import annotations

from datetime import timedelta

import pytest

from core.errors import NotFound, UnknownRun
from core.retention import Rules, plan as rule_plan
from core.settings import RetentionPolicy
from db.entities import CORRUPT, MISSING, PRUNED, VERIFIED
from tests.kit.catalog import checkpoint, manifest, verified


def _steps(items):
    return [(c.run, c.step) for c in items]


# (1) ----------------------------------------------------------------------------------------
def test_newest_verified_skips_unverified_corrupt_and_partial(catalog):
    for step in (1, 2, 3, 4):
        checkpoint(catalog, "r", step)
    verified(catalog, catalog.get_checkpoint("r", 1).id, 1)
    verified(catalog, catalog.get_checkpoint("r", 2).id, 0)
    rep = verified(catalog, catalog.get_checkpoint("r", 3).id, 1)
    catalog.transition(rep.id, CORRUPT, actor="scrub")
    assert catalog.newest_verified("r").step == 2
    assert catalog.newest_verified("r", tier=1).step == 1
    assert catalog.newest_verified("r", durable_only=True).step == 1
    assert catalog.newest_verified("r", tier=2) is None
    catalog.ensure_run("multi")
    ck = catalog.register_part(manifest("multi", 9, part=0, parts=2), actor="t")
    verified(catalog, ck.id, 1, part=0)
    assert catalog.newest_verified("multi") is None  # part 1 never arrived
    with pytest.raises(UnknownRun):
        catalog.newest_verified("ghost")


def test_newest_verified_follows_resumed_from_into_the_parent_run(catalog):
    for step in (10, 20, 30):
        verified(catalog, checkpoint(catalog, "base", step).id, 1)
    catalog.ensure_run("resumed", parent=("base", 20))
    checkpoint(catalog, "resumed", 25)
    assert catalog.newest_verified("resumed") is None
    found = catalog.newest_verified("resumed", follow_resumed=True)
    assert (found.run, found.step) == ("base", 20)  # not 30: the resumed run never saw it
    catalog.ensure_run("tuned", parent=("base", 30), parent_relation="fine_tuned_from")
    assert catalog.newest_verified("tuned", follow_resumed=True) is None


# (2), (3) ------------------------------------------------------------------------------------
def test_locations_list_complete_verified_copies_only(catalog):
    catalog.ensure_run("r")
    for part in range(2):
        ck = catalog.register_part(manifest("r", 7, part=part, parts=2), actor="t")
    for part in range(2):
        verified(catalog, ck.id, 1, part=part)
    verified(catalog, ck.id, 2, part=0)  # tier 2 incomplete
    (loc,) = catalog.locations("r", 7)
    assert (loc.tier, loc.urls, loc.bytes) == (1, (f"file:///tier1/{ck.id}/0", f"file:///tier1/{ck.id}/1"), 4000)
    assert loc.verified_at is not None
    with pytest.raises(NotFound):
        catalog.locations("r", 8)


def test_nearest_copy_follows_the_preference_order(catalog):
    ck = checkpoint(catalog, "r", 1)
    for tier in (0, 1, 2):
        verified(catalog, ck.id, tier)
    assert catalog.nearest_copy("r", 1).tier == 0
    assert catalog.nearest_copy("r", 1, preference=(2, 1)).tier == 2
    catalog.transition(catalog.replicas(ck.id, tier=0)[0].id, MISSING, actor="scrub")
    assert catalog.nearest_copy("r", 1).tier == 1
    assert catalog.nearest_copy("r", 1, preference=(0,)) is None


# (4), (5) are in test_catalog_register.py (lineage) -------------------------------------------
# (6) -------------------------------------------------------------------------------------------
def test_under_replicated_finds_checkpoints_without_durable_or_enough_copies(catalog):
    for step in (1, 2, 3):
        checkpoint(catalog, "r", step)
    ids = {s: catalog.get_checkpoint("r", s).id for s in (1, 2, 3)}
    verified(catalog, ids[1], 0)
    verified(catalog, ids[2], 1)
    verified(catalog, ids[3], 1)
    verified(catalog, ids[3], 2)
    assert _steps(catalog.under_replicated()) == [("r", 1)]
    assert _steps(catalog.under_replicated(min_copies=2)) == [("r", 1), ("r", 2)]
    assert _steps(catalog.under_replicated(durable_tier=2)) == [("r", 1), ("r", 2)]
    assert _steps(catalog.under_replicated(durable_tier=2, run="r", limit=1)) == [("r", 1)]
    checkpoint(catalog, "other", 1)
    assert _steps(catalog.under_replicated(run="other")) == [("other", 1)]


# (7) -------------------------------------------------------------------------------------------
def _retention_fixture(cat):
    """Run r: steps 1..6 on tiers 0 and 1; step 2 a milestone, step 3 the best loss."""
    losses = {1: 0.9, 2: 0.8, 3: 0.1, 4: 0.7, 5: 0.6, 6: 0.5}
    cat.ensure_run("r")
    for step, loss in losses.items():
        ck = cat.register_part(manifest("r", step, kind="milestone" if step == 2 else "step",
                                        metrics={"loss": loss}), actor="t")
        verified(cat, ck.id, 0)
        verified(cat, ck.id, 1)


def _plan(cat, tier0: RetentionPolicy, *, tier1=None, now=None, run=None, node=None):
    """Tier 0 and 1 decisions of the one rule over the facts the catalog fetched."""
    rules = Rules(policies={0: tier0, 1: tier1 or RetentionPolicy(enabled=False), 2: RetentionPolicy(enabled=False)})
    return rule_plan(cat.retention_facts(run=run, node=node), rules, now or cat.clock())


def _going(p, tier=0):
    return sorted(d.step for d in p.replicas if d.tier == tier and d.action != "keep")


def test_retention_facts_keep_last_milestones_top_k_newest_pins_aliases(catalog):
    _retention_fixture(catalog)
    # Tier 2 off: milestone 2 leaves Tier 0 too, it is durable on Tier 1 (kept there as the archive)
    assert _going(_plan(catalog, RetentionPolicy(keep_last=3))) == [1, 2, 3]
    assert _going(_plan(catalog, RetentionPolicy(keep_last=3, top_k=1, metric="loss"))) == [1, 2]
    assert _going(_plan(catalog, RetentionPolicy(keep_last=1, keep_milestones=False))) == [1, 2, 3, 4, 5]
    assert _going(_plan(catalog, RetentionPolicy(enabled=False))) == []
    catalog.pin("r", 1, actor="cli")
    catalog.set_alias("r", "best", 3, actor="cli")
    facts = {f.step: f for f in catalog.retention_facts()}
    assert facts[1].pinned and facts[3].aliases == ("best",) and facts[2].kind == "milestone"
    assert facts[3].metrics == {"loss": 0.1} and {r.tier for r in facts[6].replicas} == {0, 1}
    assert _going(_plan(catalog, RetentionPolicy(keep_last=3))) == [2]
    # tier 1, Tier 2 off: 1 pinned, 2 a milestone (kept as the archive), 3 aliased, 4-6 the last three
    assert _going(_plan(catalog, RetentionPolicy(enabled=False), tier1=RetentionPolicy(keep_last=3)), tier=1) == []


def test_retention_facts_age_rule_and_lineage_children(catalog):
    _retention_fixture(catalog)
    young = RetentionPolicy(max_age_days=1)
    assert _going(_plan(catalog, young)) == []
    later = catalog.get_checkpoint("r", 6).created_at + timedelta(days=2)
    assert _going(_plan(catalog, young, now=later)) == [1, 2, 3, 4, 5]
    catalog.ensure_run("ft")
    catalog.register_part(manifest("ft", 1, parent=("r", 2, "fine_tuned_from")), actor="t")
    assert {f.step: f.children for f in catalog.retention_facts(run="r")}[2] == ("ft",)


def test_retention_facts_of_one_node_are_of_the_runs_on_its_nvme(catalog):
    """Run r's Tier 0 copies: steps 1-3 on node-a, 4-6 on node-b (all also on Tier 1); run q
    only on node-b. Keep the last 3 counts every node's copies: node-a's three all go."""
    def on_node(ck, node):
        claim = catalog.claim_copy(ck.id, 0, 0, f"file:///t0/{ck.id}", node=node, actor="t")
        catalog.transition(claim.replica.id, VERIFIED, expected="copying", claim_token=claim.replica.claim_token,
                           actor="t", bytes=2000)
        verified(catalog, ck.id, 1)

    for run in ("r", "q"):
        catalog.ensure_run(run)
        for step in range(1, 7):
            on_node(catalog.register_part(manifest(run, step), actor="t"), "node-a" if run == "r" and step < 4
                    else "node-b")
    policy = RetentionPolicy(keep_last=3)
    assert sorted({f.run for f in catalog.retention_facts(node="node-a")}) == ["r"]
    assert sorted({f.run for f in catalog.retention_facts(node="node-b")}) == ["q", "r"]
    assert catalog.retention_facts(node="node-c") == []
    going = [(d.run, d.step, d.node) for d in _plan(catalog, policy, node="node-a").replicas
             if d.tier == 0 and d.action != "keep"]
    assert going == [("r", 1, "node-a"), ("r", 2, "node-a"), ("r", 3, "node-a")]


# (8) -------------------------------------------------------------------------------------------
def test_history_is_the_checkpoints_audit_trail_oldest_first(catalog):
    ck = checkpoint(catalog, "r", 1)
    verified(catalog, ck.id, 1)
    catalog.pin("r", 1, reason="keep", actor="cli")
    trail = catalog.history("r", 1)
    assert [(e.action, e.to_state) for e in trail] == [
        ("register", "committed"), ("transition", "copying"), ("transition", "verified"), ("pin", None)]
    assert trail == sorted(trail, key=lambda e: e.at)
    assert catalog.history("r", 2) == []


# (9) -------------------------------------------------------------------------------------------
def test_usage_counts_verified_bytes_per_run_and_tier(catalog):
    for step in (1, 2):
        ck = checkpoint(catalog, "r", step)
        verified(catalog, ck.id, 0)
    claim = catalog.claim_copy(ck.id, 1, 0, "file:///t1", node=None, actor="t")  # copying: not counted
    assert claim.acquired
    checkpoint(catalog, "s", 1)
    verified(catalog, catalog.get_checkpoint("s", 1).id, 2)
    got = [(u.run, u.tier, u.checkpoints, u.bytes) for u in catalog.usage()]
    assert got == [("r", 0, 2, 4000), ("s", 2, 1, 2000)]
    assert [(u.run, u.tier) for u in catalog.usage("s")] == [("s", 2)]


# (10) ------------------------------------------------------------------------------------------
def test_unpromoted_lists_committed_checkpoints_never_copied_to_tier_1(catalog):
    for step in (1, 2, 3, 4, 5):
        checkpoint(catalog, "r", step)
    ids = {s: catalog.get_checkpoint("r", s).id for s in (1, 2, 3, 4, 5)}
    verified(catalog, ids[1], 1)
    catalog.claim_copy(ids[2], 1, 0, "file:///t1", node=None, actor="t")  # live claim
    catalog.claim_copy(ids[3], 1, 0, "file:///t1", node=None, actor="t", lease_seconds=0)  # stale
    rep = verified(catalog, ids[4], 1)
    verified(catalog, ids[4], 2)
    verified(catalog, ids[5], 0)  # newest verified now 5, so 4 may be pruned
    owner = catalog.begin_prune(rep.id, actor="t")
    # promoted once, then pruned by retention
    catalog.transition(rep.id, PRUNED, actor="t", claim_token=owner.claim_token)
    assert _steps(catalog.unpromoted()) == [("r", 3), ("r", 5)]
    assert catalog.unpromoted(older_than_seconds=3600) == []
    assert _steps(catalog.unpromoted(run="r", limit=1)) == [("r", 3)]


# drills ----------------------------------------------------------------------------------------
def test_drills_are_recorded_and_listed_newest_first(catalog):
    checkpoint(catalog, "r", 1)
    catalog.record_drill("r", 1, 2, ok=True, seconds=12.5, bytes=2000, actor="drill")
    catalog.record_drill("r", 1, 1, ok=False, seconds=1.0, bytes=0, detail="crc mismatch", actor="drill")
    got = [(d.tier, d.ok, d.detail) for d in catalog.drills("r")]
    assert got == [(1, False, "crc mismatch"), (2, True, None)]
    assert catalog.history("r", 1)[-1].action == "drill"
