"""benchmarks/cluster_restore.py's round order: no contender always runs first, and none always
runs right after the same other one (the run itself needs servers and minutes: the smoke test
and a run by hand)."""

from __future__ import annotations

from itertools import pairwise

from benchmarks.cluster_restore import round_order

NAMES = ["t0", "t1", "cp", "resume t2", "boto3", "today", "raw", "boto3+fsync"]


def _follows(order: list[str]) -> set[tuple[str, str]]:
    return set(pairwise(order))


def test_every_round_runs_every_contender_once():
    for r in range(5):
        assert sorted(round_order(NAMES, r)) == sorted(NAMES)


def test_the_first_contender_changes_from_round_to_round():
    assert len({round_order(NAMES, r)[0] for r in range(3)}) == 3


def test_no_contender_follows_the_same_one_in_two_rounds_running():
    for r in range(4):
        assert not _follows(round_order(NAMES, r)) & _follows(round_order(NAMES, r + 1))
    # the pair that decided the Tier 2 comparison: the resume ran right before boto3 in every round
    before = [o.index("resume t2") < o.index("boto3") for o in (round_order(NAMES, r) for r in range(2))]
    assert before == [True, False]
