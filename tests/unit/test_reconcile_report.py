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
