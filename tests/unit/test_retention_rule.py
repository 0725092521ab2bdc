"""The retention rule as data: each golden case (facts + policies -> the whole expected plan,
with reasons) in ``tests/unit/retention_cases/`` through ``core.retention.plan``, no database."""

from __future__ import annotations

import pytest

from core.retention import plan
from tests.kit.retention_cases import case_files, facts_of, load, now_of, parts_of, rendered, rules_of

RULES = ("keep_last", "milestone", "milestone not yet archived", "top_k loss", "top_k acc", "max_age", "pinned",
         "alias best", "newest verified", "newer than newest durable", "newest durable", "parent of ft",
         "not yet durable", "locked until", "retention off", "last durable copy", "no tier keeps it", "retired",
         "not kept on tier 0", "not kept on tier 1")


@pytest.mark.parametrize("path", case_files(), ids=lambda p: p.stem)
def test_golden_case(path):
    case = load(path)
    assert rendered(plan(facts_of(case), rules_of(case), now_of(case)), parts_of(case)) == case["expect"]


def test_the_cases_cover_every_rule_on_every_tier_with_tier2_on_and_off():
    cases = [load(p) for p in case_files()]
    reasons = {r for c in cases for line in c["expect"].values() for r in line.split(": ", 1)[1].split(", ")}
    for rule in RULES:
        assert any(r.startswith(rule) for r in reasons), rule
    assert {c["tier2_on"] for c in cases} == {True, False}
    assert {c["keep_parents"] for c in cases} == {True, False}
    decided = {(k.split(" tier ")[1][0], v.split(":")[0])
               for c in cases for k, v in c["expect"].items() if " tier " in k}
    assert decided >= {(t, a) for t in "012" for a in ("keep", "retire")} | {("0", "demote"), ("1", "demote")}


def test_the_plan_does_not_depend_on_the_order_of_the_facts():
    case = load(case_files()[4])
    facts = facts_of(case)
    assert plan(facts[::-1], rules_of(case), now_of(case)) == plan(facts, rules_of(case), now_of(case))
