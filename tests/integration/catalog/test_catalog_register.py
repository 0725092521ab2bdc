"""Runs and checkpoint registration: idempotent, conflicts refused, parts, lineage edges."""

from __future__ import annotations

import math
import threading

import pytest

from core.errors import BadInput, ConflictError, LineageCycle, PathEscape, UnknownRun
from db.catalog import Catalog
from db.entities import CKPT_COMMITTED, CKPT_CORRUPT, CKPT_PARTIAL
from tests.kit.catalog import checkpoint, manifest, verified


def test_ensure_run_is_idempotent_and_keeps_fields(catalog):
    a = catalog.ensure_run("llama-7b", project="p", config_digest="c1", tags={"team": "x"})
    b = catalog.ensure_run("llama-7b")
    assert a == b and b.project == "p" and b.tags == {"team": "x"}
    assert [r.name for r in catalog.list_runs()] == ["llama-7b"]


def test_unknown_run_and_hostile_run_names_are_refused(catalog):
    with pytest.raises(UnknownRun):
        catalog.register_part(manifest("ghost", 1), actor="t")
    with pytest.raises(UnknownRun):
        catalog.get_run("ghost")
    with pytest.raises(PathEscape):
        catalog.ensure_run("../etc")
    with pytest.raises(PathEscape):
        catalog.ensure_run("child", parent=("../etc", 5))
    # an origin not registered yet is recorded, pending: its edge comes when it is registered
    assert catalog.ensure_run("child", parent=("ghost", 5)).parent_run == "ghost"


def test_same_manifest_twice_returns_the_same_checkpoint(catalog):
    first = checkpoint(catalog, "r", 100)
    again = catalog.register_part(manifest("r", 100), actor="t")
    assert again == first
    assert first.state == CKPT_COMMITTED and first.file_count == 2 and first.total_bytes == 2000
    assert len(catalog.files(first.id)) == 2
    assert [e.action for e in catalog.history("r", 100)] == ["register"]


def test_different_manifest_for_a_registered_step_is_a_conflict(catalog):
    first = checkpoint(catalog, "r", 100)
    with pytest.raises(ConflictError, match="different manifest"):
        catalog.register_part(manifest("r", 100, salt="other bytes"), actor="t")
    with pytest.raises(ConflictError, match="part"):
        catalog.register_part(manifest("r", 100, part=1, parts=2), actor="t")
    assert catalog.get_checkpoint("r", 100) == first
    assert [f.checksum for f in catalog.files(first.id)] == [f.checksum for f in manifest("r", 100).files]


def test_multi_part_checkpoint_commits_when_the_last_part_arrives(catalog):
    catalog.ensure_run("r")
    states = [catalog.register_part(manifest("r", 5, part=part, parts=3, node=f"n{part}"), actor=f"agent:n{part}").state
              for part in (2, 0, 1)]
    assert states == [CKPT_PARTIAL, CKPT_PARTIAL, CKPT_COMMITTED]
    ck = catalog.get_checkpoint("r", 5)
    assert (ck.parts, ck.parts_registered, ck.file_count) == (3, 3, 6)
    assert ck.committed_at is not None
    assert {f.part for f in catalog.files(ck.id)} == {0, 1, 2}
    assert len(catalog.files(ck.id, part=1)) == 2


def test_complete_on_tier_fires_once_after_the_last_part_is_verified(catalog):
    catalog.ensure_run("r")
    for part in range(2):
        ck = catalog.register_part(manifest("r", 5, part=part, parts=2), actor="t")
    verified(catalog, ck.id, 1, part=0)
    assert catalog.complete_on_tier(ck.id, 1, actor="a") is False
    verified(catalog, ck.id, 1, part=1)
    assert [catalog.complete_on_tier(ck.id, 1, actor=a) for a in "abc"] == [True, False, False]
    assert catalog.complete_on_tier(ck.id, 2, actor="a") is False


def test_checkpoint_state_changes_are_validated_and_audited(catalog):
    ck = checkpoint(catalog, "r", 1)
    catalog.set_checkpoint_state(ck.id, CKPT_CORRUPT, reason="shard-0 crc mismatch", actor="flow-1")
    assert catalog.get_checkpoint("r", 1).state == CKPT_CORRUPT
    last = catalog.history("r", 1)[-1]
    assert (last.from_state, last.to_state, last.actor) == (CKPT_COMMITTED, CKPT_CORRUPT, "flow-1")
    with pytest.raises(BadInput):
        catalog.set_checkpoint_state(ck.id, "shiny", reason="", actor="t")


def test_rejections_are_audited(catalog):
    catalog.record_rejection("event:abc", "path escapes tier root", actor="agent:n0", run="r", step=3)
    (entry,) = catalog.history("r", 3)
    assert (entry.action, entry.subject, entry.reason) == ("reject", "event:abc", "path escapes tier root")


# --- lineage ---------------------------------------------------------------------------
def _edges(edges):
    return [(e.child_run, e.child_step, e.parent_run, e.parent_step, e.relation, e.depth) for e in edges]


def test_checkpoints_follow_the_previous_one_even_out_of_order(catalog):
    for step in (100, 300, 200):
        checkpoint(catalog, "r", step)
    assert _edges(catalog.ancestors("r", 300)) == [("r", 300, "r", 200, "follows", 1),
                                                   ("r", 200, "r", 100, "follows", 2)]
    assert _edges(catalog.descendants("r", 100)) == [("r", 200, "r", 100, "follows", 1),
                                                     ("r", 300, "r", 200, "follows", 2)]


def test_resumed_run_links_its_first_checkpoint_to_its_origin(catalog):
    for step in (10, 20):
        checkpoint(catalog, "base", step)
    catalog.ensure_run("resume", parent=("base", 10))
    checkpoint(catalog, "resume", 15)
    checkpoint(catalog, "resume", 25)
    assert _edges(catalog.ancestors("resume", 25)) == [("resume", 25, "resume", 15, "follows", 1),
                                                       ("resume", 15, "base", 10, "resumed_from", 2)]
    assert ("resume", 15, "base", 10, "resumed_from", 1) in _edges(catalog.descendants("base", 10))
    assert catalog.get_run("resume").parent_run == "base"


def test_manifest_parent_adds_an_edge_and_cycles_are_refused(catalog):
    checkpoint(catalog, "base", 10)
    catalog.ensure_run("ft")
    catalog.register_part(manifest("ft", 1, parent=("base", 10, "fine_tuned_from")), actor="t")
    assert _edges(catalog.ancestors("ft", 1)) == [("ft", 1, "base", 10, "fine_tuned_from", 1)]
    with pytest.raises(LineageCycle):
        catalog.add_lineage(("base", 10), ("ft", 1), "branched_from", actor="t")
    with pytest.raises(LineageCycle):
        catalog.add_lineage(("ft", 1), ("ft", 1), "branched_from", actor="t")
    with pytest.raises(BadInput):
        catalog.add_lineage(("ft", 1), ("base", 10), "copied_from", actor="t")
    catalog.add_lineage(("ft", 1), ("base", 10), "fine_tuned_from", actor="t")  # idempotent
    assert len(catalog.ancestors("ft", 1)) == 1


def test_lineage_depth_is_bounded(catalog):
    for step in range(6):
        checkpoint(catalog, "r", step)
    assert [e.depth for e in catalog.ancestors("r", 5, max_depth=3)] == [1, 2, 3]


# --- bulk ------------------------------------------------------------------------------------
def test_register_many_follows_the_same_rules_as_one_by_one(catalog):
    checkpoint(catalog, "r", 10)
    catalog.ensure_run("s", parent=("r", 10))
    batch = [manifest("r", s) for s in (30, 20, 40)] + [manifest("s", 1), manifest("s", 2)]
    assert catalog.register_many(batch, actor="import") == 5
    assert [c.step for c in catalog.list_checkpoints("r")] == [10, 20, 30, 40]
    assert all(c.state == "committed" and c.file_count == 2 for c in catalog.list_checkpoints())
    assert _edges(catalog.ancestors("s", 2)) == [("s", 2, "s", 1, "follows", 1), ("s", 1, "r", 10, "resumed_from", 2)]
    assert [(e.parent_step, e.depth) for e in catalog.ancestors("r", 40)] == [(30, 1), (20, 2), (10, 3)]
    # again: idempotent; out of order and known steps take the one-by-one path
    catalog.register_many([*batch, manifest("r", 15)], actor="import")
    assert [(e.parent_step, e.depth) for e in catalog.ancestors("r", 20)] == [(15, 1), (10, 2)]
    assert len(catalog.files(catalog.get_checkpoint("r", 30).id)) == 2
    assert [e.action for e in catalog.history("r", 30)] == ["register"]


def test_register_many_is_all_or_nothing(catalog):
    checkpoint(catalog, "r", 10)
    with pytest.raises(ConflictError):
        catalog.register_many([manifest("r", 20), manifest("r", 10, salt="changed")], actor="import")
    assert [c.step for c in catalog.list_checkpoints("r")] == [10]
    with pytest.raises(UnknownRun):
        catalog.register_many([manifest("r", 20), manifest("ghost", 1)], actor="import")
    assert [c.step for c in catalog.list_checkpoints("r")] == [10]


def test_checkpoints_registered_at_once_still_form_one_chain(catalog, db_url):
    checkpoint(catalog, "r", 0)
    steps = [10, 20, 30, 40]
    cats = [Catalog(db_url) for _ in steps]
    barrier = threading.Barrier(len(steps))

    def register(i):
        barrier.wait(timeout=30)
        cats[i].register_part(manifest("r", steps[i]), actor=f"n{i}")

    threads = [threading.Thread(target=register, args=(i,)) for i in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for c in cats:
        c.close()
    assert [(e.parent_step, e.depth) for e in catalog.ancestors("r", 40)] == [(30, 1), (20, 2), (10, 3), (0, 4)]


def test_a_new_part_is_two_statements_on_postgresql(catalog):
    """The run's row (locked, with the catalog's clock), then one statement for the checkpoint,
    its part, files, audit row, edge and the edges of runs waiting for it as their origin
    (PostgreSQL; before: 7, the files one executemany). SQLite (no round trips) keeps a
    statement per table, and the attempt rules' reads (``db.attempts.standing``: the attempt
    recorded, the run's other attempts, other attempts at the step)."""
    from sqlalchemy import event

    checkpoint(catalog, "r", 10)
    sent: list[str] = []
    listener = lambda _c, _cur, stmt, *_a: sent.append(stmt)  # noqa: E731
    event.listen(catalog.engine, "before_cursor_execute", listener)
    try:
        ck = catalog.register_part(manifest("r", 20, n_files=3), actor="t")
    finally:
        event.remove(catalog.engine, "before_cursor_execute", listener)
    writes = [s for s in sent if not s.startswith("BEGIN")]
    assert len(writes) == (2 if catalog.engine.dialect.name == "postgresql" else 13), writes
    assert [f.path for f in catalog.files(ck.id)] == [f"shard-0-{i}.safetensors" for i in range(3)]
    assert [(e.action, e.to_state, e.actor) for e in catalog.history("r", 20)] == [("register", CKPT_COMMITTED, "t")]
    assert [(e.parent_step, e.relation) for e in catalog.ancestors("r", 20, max_depth=1)] == [(10, "follows")]
    assert catalog.register_part(manifest("r", 20, n_files=3), actor="t") == ck  # idempotent
    with pytest.raises(ConflictError):
        catalog.register_part(manifest("r", 20, n_files=3, salt="other"), actor="t")
    assert len(catalog.files(ck.id)) == 3 and len(catalog.history("r", 20)) == 1


def test_non_finite_metrics_are_recorded_and_read_back_as_floats(catalog):
    """A diverged run's checkpoint (loss NaN) is recorded on every backend, whichever way it is
    registered (one part, a merged second part, a batch), and reads back NaN and inf, not text."""
    weird = {"loss": math.nan, "grad_norm": math.inf, "margin": -math.inf, "lr": 0.5}
    catalog.ensure_run("r")
    verified(catalog, catalog.register_part(manifest("r", 100, metrics=weird), actor="test").id, 1)
    catalog.register_part(manifest("r", 200, part=0, parts=2, metrics={"loss": 0.25}), actor="test")
    catalog.register_part(manifest("r", 200, part=1, parts=2, metrics={"acc": math.nan}), actor="test")
    catalog.register_many([manifest("r", 300, metrics=weird), manifest("r", 400, metrics=weird)], actor="test")

    def same(metrics: dict[str, float], expected: dict[str, float]) -> bool:
        return metrics.keys() == expected.keys() and all(
            isinstance(v, float) and (v == expected[k] or (math.isnan(v) and math.isnan(expected[k])))
            for k, v in metrics.items())

    for step in (100, 300, 400):
        assert same(catalog.get_checkpoint("r", step).metrics, weird), step
    assert same(catalog.get_checkpoint("r", 200).metrics, {"loss": 0.25, "acc": math.nan})
    assert same({f.step: f.metrics for f in catalog.retention_facts()}[100], weird)  # what retention ranks
