"""The golden retention cases through the catalog: each case's checkpoints registered, their
replicas verified, pinned, aliased, fine-tuned from and retired through the catalog's API, the
facts read back by ``catalog.retention_facts`` on SQLite and PostgreSQL: the same plan, with
the same reasons, as the pure rule's (``tests/unit/test_retention_rule.py``)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import update

from core.errors import PruneRefused
from core.retention import plan
from db.catalog import Catalog
from db.rows import checkpoints
from db.session import make_engine
from tests.kit.catalog import manifest, verified
from tests.kit.retention_cases import (
    case_files,
    load,
    lock_of,
    metrics_of,
    now_of,
    parts_of,
    rendered,
    replica_pairs,
    rules_of,
)


def _fill(cat: Catalog, url: str, case: dict) -> None:
    now, ages = now_of(case), {}
    for c in case["checkpoints"]:
        cat.ensure_run(c["run"])
        for p in range(c.get("parts", 1)):
            m = replace(manifest(c["run"], c["step"], part=p, parts=c.get("parts", 1), kind=c.get("kind", "step"),
                                 metrics=metrics_of(c)), tags=c.get("tags", {}))
            ck = cat.register_part(m, actor="test")
        for t, p in replica_pairs(c):
            verified(cat, ck.id, t, p)
        ages[ck.id] = now - timedelta(days=c.get("age_days", 30))
        if c.get("pinned"):
            cat.pin(c["run"], c["step"], actor="test")
        for name in c.get("aliases", ()):
            cat.set_alias(c["run"], name, c["step"], actor="test")
        for child in c.get("children", ()):
            cat.ensure_run(child)
            cat.register_part(manifest(child, 1, parent=(c["run"], c["step"], "fine_tuned_from")), actor="test")
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for cid, at in ages.items():
                conn.execute(update(checkpoints).where(checkpoints.c.id == cid).values(created_at=at, committed_at=at))
    finally:
        engine.dispose()
    for c in case["checkpoints"]:
        if c.get("state") == "retired":
            assert cat.retire(c["run"], c["step"], reason="a case", actor="test", keep_parents=False)


@pytest.mark.parametrize("path", case_files(), ids=lambda p: p.stem)
def test_golden_case_through_the_catalog(path, db_url):
    case = load(path)
    locks = {(c["run"], c["step"]): lock_of(c) for c in case["checkpoints"]}
    with Catalog.open(db_url, auto_upgrade=True) as cat:
        _fill(cat, db_url, case)
        facts = [replace(f, replicas=tuple(replace(r, locked_until=locks[(f.run, f.step)] if r.tier == 2 else None)
                                           for r in f.replicas))
                 for f in cat.retention_facts()]
    assert rendered(plan(facts, rules_of(case), now_of(case)), parts_of(case)) == case["expect"]


HOLDS = ("pinned", "alias ", "newest verified", "newer than newest durable", "newest durable", "parent of ")


@pytest.mark.parametrize("path", case_files(), ids=lambda p: p.stem)
def test_the_catalog_refuses_to_retire_what_the_rule_holds(path, db_url):
    """The catalog's own check under the checkpoint's lock (``Catalog.retire``) agrees with the
    rule: every checkpoint the plan keeps for a hold (pin, alias, newest verified, newer than
    the newest durable, the newest durable one, a parent) is refused; every one it retires is
    recorded retired."""
    case = load(path)
    rules = rules_of(case)
    with Catalog.open(db_url, auto_upgrade=True) as cat:
        _fill(cat, db_url, case)
        decided = plan(cat.retention_facts(), rules, now_of(case)).checkpoints
        held = [d for d in decided if d.action == "keep" and any(r.startswith(HOLDS) for r in d.reason.split(", "))]
        for d in held:
            with pytest.raises(PruneRefused, match="not retired"):
                cat.retire(d.run, d.step, reason="a test", actor="test", keep_parents=rules.keep_parents)
        for d in decided:
            if d.action == "retire" and d.reason != "retired":
                assert cat.retire(d.run, d.step, reason=d.reason, actor="test", keep_parents=rules.keep_parents)
