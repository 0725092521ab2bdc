"""Which reconcile passes leave a flow run (``ReconcileReport.acted``): the agent runs a pass
every minute on every node, and only one that did or found something wrong may show on the Runs
page."""

from __future__ import annotations

import pytest

from tasks.reconcile import ReconcileReport


def test_a_pass_that_found_nothing_or_only_skipped_did_not_act():
    assert not ReconcileReport().acted()
    # taken by another caller, a bad checkpoint left alone: the same on every pass
    assert not ReconcileReport(skipped=["run-a/10 part 0: CopyInProgress: held"]).acted()


@pytest.mark.parametrize("action", ["recovered", "missing", "promoted", "adopted", "followed_up", "archived",
                                    "pruned", "retired", "failed"])
def test_a_pass_that_changed_or_failed_on_anything_acted(action):
    assert ReconcileReport(**{action: ["tier 1 run-a/10 part 0"]}).acted()


# --- which of an agent's passes that failed leave a run (``flows.reconcile.decide``, issue 40) -------
HOUR = 3600.0
T0 = 1_800_000_000.0  # a pass's clock, time.time()
TIER2_DOWN = ["tier 2 run-a/10: EndpointConnectionError: could not connect",
              "tier 2 run-b/20: EndpointConnectionError: could not connect"]


def passes(*failures_each_pass: list[str], every: float = 60.0, acted: bool = False):
    """The verdicts of passes ``every`` seconds apart failing as given, the state handed on as the
    agent hands it on."""
    from flows.reconcile import Shown, decide

    shown, verdicts = Shown(), []
    for i, failed in enumerate(failures_each_pass):
        verdict = decide(failed, acted, shown, now=T0 + i * every)
        verdicts.append(verdict)
        shown = verdict.shown
    return verdicts


def test_a_pass_that_found_nothing_leaves_no_run():
    assert [v.run for v in passes([], [], [])] == [False, False, False]


def test_the_same_failures_again_leave_no_new_run_whatever_their_order():
    first, again, reordered = passes(TIER2_DOWN, TIER2_DOWN, TIER2_DOWN[::-1])
    assert first.run and first.note == ""
    assert not again.run and not reordered.run
    assert reordered.shown == first.shown  # still the run that showed them


def test_failures_that_change_leave_a_run_each_time():
    other = ["tier 1 run-c/30 part 0: TierUnavailable: its root does not exist"]
    verdicts = passes(TIER2_DOWN, TIER2_DOWN[:1], TIER2_DOWN[:1] + other, other)
    assert [v.run for v in verdicts] == [True, True, True, True]


def test_failures_that_cleared_leave_a_run_that_says_so_then_nothing():
    failing, cleared, quiet = passes(TIER2_DOWN, [], [])
    assert failing.run and cleared.run and not quiet.run
    assert cleared.note == "cleared: the 2 failure(s) shown at 2027-01-15 08:00:00 UTC no longer fail"


def test_the_same_failures_for_an_hour_leave_a_run_again_that_says_since_when():
    verdicts = passes(*[TIER2_DOWN] * 62)  # a pass a minute
    assert [i for i, v in enumerate(verdicts) if v.run] == [0, 60]
    assert verdicts[60].note == "failing the same way since 2027-01-15 08:00:00 UTC"
    assert verdicts[61].shown.at == T0 + 60 * 60.0  # the hour counts again from that run


def test_a_pass_that_acted_leaves_its_run_whatever_it_failed_on():
    assert [v.run for v in passes(TIER2_DOWN, TIER2_DOWN, [], acted=True)] == [True, True, True]
