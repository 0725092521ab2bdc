"""The retention rule as data: each golden case (facts + policies -> the whole expected plan,
with reasons) in ``tests/unit/retention_cases/`` through ``core.retention.plan``, no database."""

from __future__ import annotations

import pytest

from core.retention import plan
from tests.kit.retention_cases import case_files, facts_of, load, now_of, parts_of, rendered, rules_of

RULES = ("keep_last", "milestone", "milestone not yet archived", "top_k loss", "top_k acc", "max_age", "pinned",
         "alias best", "newest verified", "newer than newest durable", "newest durable", "parent of ft",
         "not yet durable", "locked until", "retention off", "last durable copy", "no tier keeps it", "retired",
         "not kept on tier 0", "not kept on tier 1", "not kept on tier 2", "archive of a milestone", "over budget")
# each tier's own keep rules, on every tier; the milestone rules are Tier 1's alone
TIER_RULES = {(t, r) for t in (0, 1, 2) for r in ("keep_last", "top_k", "max_age")} | {
    (1, "milestone"), (1, "milestone not yet archived"), (2, "locked until")}
# the holds and the ranking whose outcome must be shown with Tier 2 both on and off
SPLIT_RULES = ("pinned", "alias", "top_k", "parent of")
# the rules whose reason names what it is about (``top_k loss``, ``locked until DATE``, ``alias best``)
NAMED = ("top_k", "locked until", "alias", "parent of")


@pytest.mark.parametrize("path", case_files(), ids=lambda p: p.stem)
def test_golden_case(path):
    case = load(path)
    assert rendered(plan(facts_of(case), rules_of(case), now_of(case)), parts_of(case)) == case["expect"]


def _replica_lines(cases: list[dict]) -> list[tuple[bool, int, str, str]]:
    """(tier2_on, tier, action, one reason) for every reason of every replica line of the cases."""
    return [(c["tier2_on"], int(k.split(" tier ")[1][0]), v.split(": ", 1)[0], r)
            for c in cases for k, v in c["expect"].items() if " tier " in k
            for r in v.split(": ", 1)[1].split(", ")]


def _is(reason: str, rule: str) -> bool:
    """``reason`` is ``rule`` (with what it names, for the ``NAMED`` ones); ``milestone`` is not
    ``milestone not yet archived``."""
    return reason == rule or (rule in NAMED and reason.startswith(rule + " "))


def test_the_cases_cover_every_rule_on_every_tier_with_tier2_on_and_off():
    cases = [load(p) for p in case_files()]
    reasons = {r for c in cases for line in c["expect"].values() for r in line.split(": ", 1)[1].split(", ")}
    for rule in RULES:
        assert any(r.startswith(rule) for r in reasons), rule
    assert {c["tier2_on"] for c in cases} == {True, False}
    assert {c["keep_parents"] for c in cases} == {True, False}
    lines = _replica_lines(cases)
    kept = {(t, rule) for _, t, a, r in lines if a == "keep" for _, rule in TIER_RULES if _is(r, rule)}
    assert TIER_RULES - kept == set(), "rule x tier never shown keeping a copy"
    # a tier's rule keeps only that tier's copies: no milestone rule off Tier 1, no lock off Tier 2
    assert not {(t, r) for _, t, _, r in lines
                if (r.startswith("milestone") and t != 1) or (_is(r, "locked until") and t != 2)}
    split = {(on, rule) for on, _, a, r in lines if a == "keep" for rule in SPLIT_RULES if _is(r, rule)}
    assert {(on, rule) for on in (True, False) for rule in SPLIT_RULES} - split == set(), "tier2_on x rule missing"
    # Tier 1 holds a milestone as the archive with Tier 2 off, until archived with it on
    assert {on for on, _, _, r in lines if r == "milestone"} == {False}
    assert {on for on, _, _, r in lines if r == "milestone not yet archived"} == {True}
    # Object Lock beside a pin (one copy kept for both) and beside a milestone Tier 1 still holds
    both = [{r.split(" 20")[0] for r in v.split(": ", 1)[1].split(", ")} for c in cases for v in c["expect"].values()]
    for pair in ({"pinned", "locked until"}, {"locked until", "tier 1 milestone not yet archived"}):
        assert any(pair <= reasons for reasons in both), pair
    decided = {(t, a) for _, t, a, _ in lines}
    assert decided >= {(t, a) for t in (0, 1, 2) for a in ("keep", "demote", "retire")}


def test_the_plan_does_not_depend_on_the_order_of_the_facts():
    case = load(case_files()[4])
    facts = facts_of(case)
    assert plan(facts[::-1], rules_of(case), now_of(case)) == plan(facts, rules_of(case), now_of(case))
