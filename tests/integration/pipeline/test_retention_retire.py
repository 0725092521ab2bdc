"""Retirement through the public surface (the real promotion and retention as plain functions,
real tiers, a real catalog on SQLite and PostgreSQL): what each tier keeps after a run, the two
cases issue 16 found broken, a retirement killed at every step and finished by reconcile, and two
retention workers at once."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from core.errors import NotFound
from core.settings import MilestonePolicy, RetentionPolicy
from db.catalog import Catalog
from flows.common import plain_steps
from flows.reconcile import reconcile_once
from flows.retention import run_retention
from tasks.retention import DONE_BY_ANOTHER, PRUNED, REFUSED, RETIRE, apply_retention, plan_retention
from tests.kit.catalog import manifest
from tests.kit.checkpoints import expire_claims
from tests.kit.restore import commit_folder, promote, scenario_settings, tier0_dir, tier1_dir

RUN = "run-r"


class Killed(BaseException):
    """The worker dies here (not an error any handler of ours catches)."""


def _settings(settings_factory, db_url, **kw):
    return scenario_settings(settings_factory, db_url, task_retries=0, **kw)


def save(settings, *steps: int, milestone: bool = False) -> None:
    for step in steps:
        commit_folder(settings, RUN, step, {"w.bin": os.urandom(2048)}, milestone=milestone)
        promote(settings, RUN, step)


def on_disk(settings, tier: int) -> set[int]:
    root = tier0_dir if tier == 0 else tier1_dir
    return {s for s in range(1, 1000) if root(settings, RUN, s).exists()}


def held(settings, tier: int) -> set[int]:
    with Catalog(settings.catalog_url) as cat:
        return {c.step for c in cat.list_checkpoints(RUN)
                if any(r.state == "verified" for r in cat.replicas(c.id, tier))}


def states(settings) -> dict[int, str]:
    with Catalog(settings.catalog_url) as cat:
        return {c.step: c.state for c in cat.list_checkpoints(RUN)}


def assert_retired_first(settings, step: int) -> None:
    """The retirement is in the audit log before the first deletion of the checkpoint's only
    durable copy, the Tier 1 one (its Tier 0 copy may have been demoted long before)."""
    with Catalog(settings.catalog_url) as cat:
        trail = cat.history(RUN, step)
    retire = [e.id for e in trail if e.action == "retire"]
    deletes = [e.id for e in trail if (e.action == "delete" and e.subject.endswith("@tier1"))
               or (e.to_state == "pruning" and (e.reason or "").startswith("tier 1"))]
    assert len(retire) == 1 and deletes and retire[0] < min(deletes), trail


# --- issue 16: the two broken cases ---------------------------------------------------------------
def test_tier1_keep_last_2_without_tier2_retires_the_older_checkpoints(settings_factory, db_url):
    settings = _settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1),
                         retention_tier1=RetentionPolicy(keep_last=2))
    save(settings, 100, 200, 300, 400, 500)  # retention runs after each promotion

    assert on_disk(settings, 1) == held(settings, 1) == {400, 500}
    assert on_disk(settings, 0) == held(settings, 0) == {500}
    assert states(settings) == {100: "retired", 200: "retired", 300: "retired", 400: "committed", 500: "committed"}
    for step in (100, 200, 300):
        assert_retired_first(settings, step)
    with Catalog(settings.catalog_url) as cat:
        assert cat.newest_verified(RUN).step == 500
    from tasks.restore import candidates

    with Catalog(settings.catalog_url) as cat, pytest.raises(NotFound, match="retired"):
        candidates(cat, RUN, 100, fallback=False)
    assert run_retention(settings, run=RUN, steps=plain_steps()) == []  # nothing left to do


def test_milestones_leave_tier0_once_durable_without_tier2(settings_factory, db_url):
    settings = _settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1),
                         retention_tier1=RetentionPolicy(keep_last=10))
    save(settings, 100)
    save(settings, 200, milestone=True)
    save(settings, 300)
    save(settings, 400, milestone=True)
    save(settings, 500)

    assert on_disk(settings, 0) == held(settings, 0) == {500}
    assert on_disk(settings, 1) == {100, 200, 300, 400, 500}


# --- a run of 50 steps ----------------------------------------------------------------------------
@pytest.mark.parametrize("tier2", [False, True], ids=["tier2-off", "tier2-on"])
def test_fifty_steps_leave_the_ten_newest_the_kept_milestones_and_the_parent_on_tier1(
        settings_factory, db_url, tier2, request):
    s3 = dict(s3_endpoint=request.getfixturevalue("s3_endpoint"),
              s3_bucket=request.getfixturevalue("s3_bucket")) if tier2 else {}
    settings = _settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=3),
                         retention_tier1=RetentionPolicy(keep_last=10), milestones=MilestonePolicy(every_steps=10),
                         **s3)
    save(settings, *range(1, 6))
    with Catalog(settings.catalog_url) as cat:  # another run fine-tuned from step 5
        cat.ensure_run("ft")
        cat.register_part(manifest("ft", 1, parent=(RUN, 5, "fine_tuned_from")), actor="test")
    save(settings, *range(6, 51))

    milestones = {10, 20, 30, 40, 50}
    kept_on_tier1 = set(range(41, 51)) | {5} | (set() if tier2 else milestones)
    assert held(settings, 1) == on_disk(settings, 1) == kept_on_tier1
    assert held(settings, 0) == on_disk(settings, 0) == {48, 49, 50}
    if tier2:
        assert held(settings, 2) == milestones
    retired = {s for s, st in states(settings).items() if st == "retired"}
    assert retired == set(range(1, 51)) - kept_on_tier1 - (milestones if tier2 else set())


# --- a retirement killed at every step, finished by reconcile -------------------------------------
def _hook_deletes(monkeypatch, kill_at: int, *, after: bool = False):
    """Every store the prune opens: the ``kill_at``-th step (from 1) of its fenced deletes (the
    move into the claim's tombstone, ``bury``, then the tombstone's delete) kills the worker,
    before it does anything or, with ``after``, once it has (before the prune records ``pruned``)."""
    import tasks.prune as prune_mod

    real_open, calls = prune_mod.open_tier, {"n": 0}

    @contextmanager
    def hooked(s, tier):
        with real_open(s, tier) as store:
            for name in ("bury", "delete_tomb"):
                real = getattr(store, name)

                def deleting(what, *args, _real=real, **kwargs):
                    calls["n"] += 1
                    if calls["n"] == kill_at and not after:
                        raise Killed(f"killed at delete {kill_at}: {what}")
                    out = _real(what, *args, **kwargs)
                    if calls["n"] == kill_at:
                        raise Killed(f"killed after delete {kill_at}: {what}")
                    return out
                setattr(store, name, deleting)
            yield store

    monkeypatch.setattr(prune_mod, "open_tier", hooked)
    return calls


# where the worker dies: after the record, before any prune began; at each of the 4 delete steps
# (per tier: the move into the claim's tombstone, the tombstone's delete), before it; after each
# move (the tombstone left behind); and after each tier's last step, before that copy is recorded
# ``pruned`` (Tier 1's: the retirement's last)
KILLS = (["recorded"] + [f"delete-{n}" for n in range(1, 5)]
         + ["after-delete-1", "after-delete-2", "after-delete-3", "after-delete-4"])


@pytest.mark.parametrize("kill", KILLS)
def test_a_retirement_killed_at_any_step_is_finished_by_reconcile(settings_factory, db_url, monkeypatch, kill):
    """Step 100 on Tiers 0 and 1: its retirement is recorded, then 6 deletes, then each copy
    recorded ``pruned``; a worker killed anywhere in between leaves it to reconcile, which
    finishes it on either catalog."""
    settings = _settings(settings_factory, db_url)
    save(settings, 100, 200)
    keep1 = settings.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1),
                                        "retention_tier1": RetentionPolicy(keep_last=1)})
    plan = [a for a in plan_retention(keep1, run=RUN) if a.step == 100]
    assert [(a.tier, a.action, a.reason) for a in plan] == [(0, RETIRE, "no tier keeps it"),
                                                            (1, RETIRE, "no tier keeps it")]
    if kill == "recorded":
        import tasks.retention as ret

        def killed(*_a, **_kw):
            raise Killed("killed after the retirement was recorded")
        monkeypatch.setattr(ret, "_prune", killed)
    else:
        calls = _hook_deletes(monkeypatch, int(kill.rsplit("-", 1)[1]), after=kill.startswith("after"))
    with pytest.raises(Killed):
        apply_retention(keep1, plan, prune=plain_steps().prune, actor="killed-worker")
    monkeypatch.undo()
    assert states(settings)[100] == "retired"
    if kill == "after-delete-4":  # every byte gone, the last copy not yet recorded pruned
        assert calls["n"] == 4
        assert not tier0_dir(settings, RUN, 100).exists() and not tier1_dir(settings, RUN, 100).exists()
        with Catalog(settings.catalog_url) as cat:
            ck = cat.get_checkpoint(RUN, 100)
            assert {r.tier: r.state for r in cat.replicas(ck.id)} == {0: "pruned", 1: "pruning"}

    expire_claims(settings)  # the dead worker's leases lapse
    report = reconcile_once(keep1, steps=plain_steps(), actor="reconcile")

    assert report.failed == []
    assert held(settings, 0) == held(settings, 1) == {200}
    assert not tier0_dir(settings, RUN, 100).exists() and not tier1_dir(settings, RUN, 100).exists()
    for tier_dir in (tier0_dir, tier1_dir):  # no tombstone of the dead worker's claims is left
        assert [p.name for p in tier_dir(settings, RUN, 100).parent.iterdir()] == [tier_dir(settings, RUN, 200).name]
    with Catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(RUN, 100)
        assert {r.state for r in cat.replicas(ck.id)} == {"pruned"}
    assert_retired_first(settings, 100)
    assert reconcile_once(keep1, steps=plain_steps(), actor="reconcile").retired == []  # nothing left


# --- two retention workers at once ----------------------------------------------------------------
def test_two_retention_workers_at_once_retire_each_checkpoint_once(settings_factory, db_url, monkeypatch):
    """Worker B applies its plan while worker A is deleting step 100's Tier 0 copy: B finds the
    retirement recorded, leaves A's copy to A and takes the Tier 1 copy; A then finds it gone:
    done by another, not a failure and not A's prune."""
    settings = _settings(settings_factory, db_url)
    save(settings, 100, 200)
    keep1 = settings.model_copy(update={"retention_tier0": RetentionPolicy(keep_last=1),
                                        "retention_tier1": RetentionPolicy(keep_last=1)})
    plan_b = plan_retention(keep1, run=RUN)
    inner: dict = {}
    import tasks.prune as prune_mod

    real_open = prune_mod.open_tier

    @contextmanager
    def racing(s, tier):
        with real_open(s, tier) as store:
            real = store.bury

            def bury(prefix, paths, *, token):
                if "b" not in inner:  # A's first delete: B runs now
                    inner["b"] = None
                    inner["b"] = apply_retention(keep1, plan_b, prune=plain_steps().prune, actor="retention-b")
                return real(prefix, paths, token=token)
            store.bury = bury
            yield store

    monkeypatch.setattr(prune_mod, "open_tier", racing)
    outer = apply_retention(keep1, plan_retention(keep1, run=RUN), prune=plain_steps().prune, actor="retention-a")

    assert {(a.tier, a.outcome) for a in outer} == {(0, PRUNED), (1, DONE_BY_ANOTHER)}  # B took Tier 1
    assert {(a.tier, a.outcome) for a in inner["b"]} == {(0, REFUSED), (1, PRUNED)}
    assert held(settings, 0) == held(settings, 1) == {200}
    assert states(settings) == {100: "retired", 200: "committed"}
    with Catalog(settings.catalog_url) as cat:
        trail = cat.history(RUN, 100)
    assert [e.actor for e in trail if e.action == "retire"] == ["retention-a"]
    assert sorted(e.actor for e in trail if e.to_state == "pruned") == ["retention-a", "retention-b"]


def test_a_retired_checkpoint_keeps_its_lineage_and_cannot_be_pinned_back(settings_factory, db_url):
    from core.errors import BadInput

    settings = _settings(settings_factory, db_url, retention_tier0=RetentionPolicy(keep_last=1),
                         retention_tier1=RetentionPolicy(keep_last=1))
    save(settings, 100, 200, 300)

    with Catalog(settings.catalog_url) as cat:
        assert cat.get_checkpoint(RUN, 200).state == "retired"
        edges = cat.ancestors(RUN, 300)
        assert [(e.parent_run, e.parent_step) for e in edges] == [(RUN, 200), (RUN, 100)]
        assert cat.checkpoint_states([(RUN, 100), (RUN, 300)]) == {(RUN, 100): "retired", (RUN, 300): "committed"}
        with pytest.raises(BadInput, match="retired"):
            cat.pin(RUN, 200, actor="test")
        with pytest.raises(BadInput, match="retired"):
            cat.set_alias(RUN, "best", 200, actor="test")
    from rich.console import Console

    from ckpt.commands.catalog import lineage_tree

    console = Console(width=120, record=True)
    console.print(lineage_tree(RUN, 300, edges, descendants=False,
                               states={(RUN, 100): "retired", (RUN, 200): "retired"}))
    assert f"{RUN}/200 (follows) (retired)" in console.export_text()
