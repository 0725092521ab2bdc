"""Retention: fetch the facts (``catalog.retention_facts``), let the one rule decide
(``core.retention.plan``), and apply its plan through the guarded operations only.

Two operations, kept apart. *Demote* drops a copy from a tier through the claimed, guarded
prune (``tasks.prune``: the catalog's rows, then the justifying copy checked on its own tier),
so a stale plan, or a second retention run overlapping this one, can never delete the last
good copy. *Retire* first records the checkpoint ``retired`` in the catalog (refused again there
if a pin, an alias, a newer save or a child run appeared since the plan), then deletes every
copy under a claim, tier by tier; a crash in between leaves a retired checkpoint with copies,
which the next retention or reconcile finishes (``finish_retirements``).

Tier 0 replicas of other nodes are listed but left to their node. A plan of only some tiers
(a node's own Tier 0) never records a retirement: what it would retire there it demotes.

A tier over its byte budget once the plan is applied (what its rules keep exceeds it) is a line
of its own in a plan of every run (``OVER_BUDGET``: what it keeps, which rules hold the excess);
applying that plan announces it as ``ckpt.tier.over_budget``, once an hour per tier (and node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from core import events, retention as rule
from core.errors import CkptError, PruneRefused
from core.layout import part_key
from core.policy import is_milestone  # noqa: F401 - the milestone rule, re-exported for callers
from core.settings import RetentionPolicy, Settings
from core.storage.content import SHARED_TIERS
from core.tiers import ALL_TIERS, DURABLE_TIERS, Tier, readable_from
from db.catalog import Catalog
from tasks.base import log, open_catalog, open_tier
from tasks.retry import pipeline_task

PLANNED, PRUNED, REFUSED, KEPT, ELSEWHERE, FAILED = "planned", "pruned", "refused", "kept", "elsewhere", "failed"
DONE_BY_ANOTHER = "done by another"  # another worker reached this outcome first (a retention run beside this one)
LOCKED = "locked"  # under the store's retention (S3 Object Lock) until a date: planned for after it
DEMOTE, RETIRE, KEEP = rule.DEMOTE, rule.RETIRE, rule.KEEP
# a Tier 2 copy whose Object Lock date could not be read may be locked: kept this pass, and its
# checkpoint not retired (``_keep_unknown_locks``)
UNKNOWN_LOCK = "lock date unknown"
DEFERRED = "retirement deferred: a tier 2 copy's lock date is unknown"
UNKNOWN_LOCK_REASONS = (UNKNOWN_LOCK, DEFERRED)
OVER_BUDGET = "over budget"  # the action of a tier's line: its rules keep more than its max_bytes


@dataclass(frozen=True)
class PruneAction:
    """One replica's line of the plan: what the rule decided (``action``: demote, retire or
    keep, ``reason``: the rule that decided it) and what became of it (``outcome``, ``detail``)."""

    tier: int
    replica_id: int
    run: str
    step: int
    part: int
    node: str | None
    url: str
    bytes: int | None
    outcome: str = PLANNED  # planned | pruned | done by another | refused | kept | locked | elsewhere | failed
    detail: str = ""
    action: str = DEMOTE
    reason: str = ""
    attempt: str = ""
    budget: rule.Budget | None = None  # an OVER_BUDGET line's figures

    def row(self) -> dict[str, Any]:
        return {"tier": self.tier, "run": self.run, "step": self.step, "part": self.part,
                "node": self.node or "", "bytes": self.bytes or 0, "action": self.action, "reason": self.reason,
                "outcome": self.outcome, "detail": self.detail}


def retention_rules(settings: Settings) -> rule.Rules:
    """Each configured tier's policy (an unconfigured tier keeps what it holds) and the switches."""
    off = RetentionPolicy(enabled=False)
    return rule.Rules(policies={t: settings.retention(t) if settings.tier_url(t) else off for t in rule.TIERS},
                      milestones=settings.milestones, tier2_on=bool(settings.tier2_url),
                      keep_parents=settings.retention_keep_parents)


def plan_retention(settings: Settings, *, run: str | None = None, now: datetime | None = None,
                   tiers: Sequence[int] = ALL_TIERS, node: str | None = None,
                   explain: bool = False) -> list[PruneAction]:
    """The replicas of ``tiers`` that the rule demotes or retires, each with its reason (with
    ``explain`` also every kept one, ``kept`` with what keeps it). ``node``: of Tier 0, only the
    replicas on that node's NVMe (what a run keeps is still decided over all of its copies).
    This is the call a node makes to free its own Tier 0:
    ``plan_retention(settings, tiers=(0,), node=settings.node)`` then ``apply_retention``."""
    whole = set(rule.TIERS) <= set(tiers)
    rules = retention_rules(settings)
    if run is not None:
        # a budget is the whole tier's (every run's bytes, the oldest copies first): the pass over
        # every run enforces it, never one run's plan (after each durable checkpoint: no
        # whole-catalog read on that path)
        rules = replace(rules, policies={t: p.model_copy(update={"max_bytes": None})
                                         for t, p in rules.policies.items()})
    with open_catalog(settings.catalog_url) as cat:
        # a budget of a tier that stores each content once counts contents, whichever tiers apply
        shared_budget = any(rules.policies[t].max_bytes is not None for t in SHARED_TIERS)
        facts = cat.retention_facts(run=run, node=node if not set(DURABLE_TIERS) & set(tiers) else None,
                                    contents=shared_budget)
        now = now or cat.clock()
        decided = rule.plan(facts, rules, now)
        unknown: dict[int, str] = {}
        if Tier.OBJECT in tiers and settings.tier2_url:
            facts, unknown = _with_locks(cat, settings, facts, decided)
            decided = _keep_unknown_locks(rule.plan(facts, rules, now), unknown)
    held = {d.replica_id for d in decided.replicas if d.action == KEEP and d.reason.startswith(UNKNOWN_LOCK_REASONS)}
    out: list[PruneAction] = []
    for d in decided.replicas:
        if d.tier not in tiers or (node is not None and not readable_from(d.tier, d.node, node)):
            continue
        if run is not None and d.run != run:
            continue
        action = PruneAction(tier=d.tier, replica_id=d.replica_id, run=d.run, step=d.step, part=d.part, node=d.node,
                             url=d.url, bytes=d.bytes, action=d.action, reason=d.reason, attempt=d.attempt)
        if d.action == KEEP:
            if d.reason.startswith("locked until"):
                until = d.reason.removeprefix("locked until ").split(",")[0]
                out.append(replace(action, outcome=LOCKED, detail=f"Object Lock until {until}; let go after that"))
            elif explain or d.replica_id in held:  # a lock not known is shown even unasked
                out.append(replace(action, outcome=KEPT, detail=d.reason))
            continue
        if d.action == RETIRE and not whole and d.reason != "retired":
            action = replace(action, action=DEMOTE, reason=f"{d.reason} (retired by a retention of every tier)")
        if not readable_from(d.tier, d.node, settings.node):
            action = replace(action, outcome=ELSEWHERE, detail=f"on node {d.node}; {action.action}d there")
        out.append(action)
    if run is None:
        out += [_over_budget(b) for b in decided.budgets
                if b.over and b.tier in tiers and (node is None or b.node in (None, node))]
    return out


def _over_budget(b: rule.Budget) -> PruneAction:
    """A tier's line: it keeps more than its budget, and the rules that hold the excess."""
    held = ", ".join(f"{r} ({n} bytes)" for r, n in b.held_by)
    return PruneAction(tier=b.tier, replica_id=0, run="", step=0, part=0, node=b.node, url="", bytes=b.kept_bytes,
                       outcome=KEPT, detail=f"{b.kept_bytes} of {b.max_bytes} bytes kept; nothing a rule keeps "
                       "goes for the budget", action=OVER_BUDGET, reason=f"held by {held}", budget=b)


def announce_over_budget(settings: Settings, plan: Sequence[PruneAction]) -> None:
    """Log and announce (``ckpt.tier.over_budget``, labelled ``ckpt.tier``, on the tier's
    resource) each tier the plan leaves over its budget: once an hour, not once a pass (ids dedupe)."""
    hour = datetime.now(UTC).strftime("%Y%m%dT%H")
    for a in plan:
        if a.budget is None:
            continue
        b = a.budget
        log.warning("retention: tier %s%s keeps %s bytes, over its budget of %s: %s", b.tier,
                    f" on {b.node}" if b.node else "", b.kept_bytes, b.max_bytes, a.reason)
        events.announce(events.TIER_OVER_BUDGET, "", 0, node=settings.node, extra_id=f"tier{b.tier}:{b.node}:{hour}",
                        payload={"tier": b.tier, "tier_node": b.node or "", "max_bytes": b.max_bytes,
                                 "kept_bytes": b.kept_bytes, "wanted_bytes": b.wanted_bytes,
                                 "held_by": dict(b.held_by)},
                        labels={"tier": b.tier}, resource_id=events.tier_resource_id(b.tier, b.node or ""))


def _with_locks(cat: Catalog, settings: Settings, facts: list[rule.CheckpointFacts],
                decided: rule.Plan) -> tuple[list[rule.CheckpointFacts], dict[int, str]]:
    """``facts`` with the Object Lock date of each Tier 2 copy the first plan lets go (asked of
    the store: the manifest, written last, carries the latest retain-until date of its part),
    and the copies whose date could not be read (replica id -> the error): those may be locked,
    so they are kept this pass (``_keep_unknown_locks``)."""
    going = {d.replica_id for d in decided.replicas if Tier(d.tier).object_store and d.action != KEEP}
    unknown: dict[int, str] = {}
    if not going:
        return facts, unknown
    out = []
    with open_tier(settings, 2) as store:
        for c in facts:
            reps = []
            for r in c.replicas:
                if r.replica_id in going:
                    try:
                        key = part_key(c.run, c.step, r.part, c.parts, c.attempt)
                        r = replace(r, locked_until=store.locked_until([key]))
                    except CkptError as exc:  # not known: maybe locked, so kept this pass
                        log.warning("retention: Object Lock of %s/%s not known, kept: %s", c.run, c.step, exc)
                        unknown[r.replica_id] = f"{type(exc).__name__}: {exc}"
                reps.append(r)
            out.append(replace(c, replicas=tuple(reps)))
    return out, unknown


def _keep_unknown_locks(plan: rule.Plan, unknown: dict[int, str]) -> rule.Plan:
    """``plan`` with every copy whose Object Lock date could not be read kept (``lock date
    unknown: ERROR``), and the checkpoints the plan would retire with such a copy not retired this
    pass: their other copies kept too (a retirement is recorded before any copy goes; one that
    left a locked copy behind could not be finished). Demotions of other copies stand, and a
    checkpoint already recorded retired still loses its other copies."""
    if not unknown:
        return plan
    stuck = {(d.run, d.step) for d in plan.replicas if d.replica_id in unknown and d.action != KEEP}
    deferred = {(d.run, d.step) for d in plan.checkpoints if d.action == RETIRE and d.reason != "retired"} & stuck
    reps = []
    for d in plan.replicas:
        if d.replica_id in unknown and d.action != KEEP:
            d = replace(d, action=KEEP, reason=f"{UNKNOWN_LOCK}: {unknown[d.replica_id]}")
        elif d.action == RETIRE and (d.run, d.step) in deferred:
            d = replace(d, action=KEEP, reason=DEFERRED)
        reps.append(d)
    cks = [replace(d, action=KEEP, reason=DEFERRED) if (d.run, d.step) in deferred else d for d in plan.checkpoints]
    return rule.Plan(checkpoints=tuple(cks), replicas=tuple(reps))


def apply_retention(settings: Settings, plan: list[PruneAction], *, prune: Callable[..., Any],
                    actor: str = "cli") -> list[PruneAction]:
    """Demote every ``planned`` demotion through ``prune`` (the plain step or its task), Tier 0
    first; then each retirement: recorded in the catalog, then its copies pruned tier by tier.
    A refusal or failure is recorded on the action and the others still run."""
    announce_over_budget(settings, plan)
    done = [a for a in plan if a.outcome != PLANNED]
    demotes = sorted((a for a in plan if a.outcome == PLANNED and a.action == DEMOTE),
                     key=lambda a: (a.tier, a.run, a.step, a.part))
    done += [_prune(settings, a, prune, actor, reason=f"retention policy: demoted, {a.reason}") for a in demotes]
    retiring: dict[tuple[str, int, str], list[PruneAction]] = {}
    for a in plan:
        if a.outcome == PLANNED and a.action == RETIRE:
            retiring.setdefault((a.run, a.step, a.attempt), []).append(a)
    for (run, step, _attempt), actions in sorted(retiring.items()):
        done += retire_checkpoint(settings, run, step, actions, prune=prune, actor=actor)
    return done


def retire_checkpoint(settings: Settings, run: str, step: int, actions: list[PruneAction], *,
                      prune: Callable[..., Any], actor: str) -> list[PruneAction]:
    """Record the retirement (nothing deleted when the catalog refuses it), then prune each
    copy, Tier 0 first."""
    reason = actions[0].reason
    try:
        with open_catalog(settings.catalog_url) as cat:
            cat.retire(run, step, reason=f"retention policy: {reason}", actor=actor,
                       keep_parents=settings.retention_keep_parents, attempt=actions[0].attempt)
    except PruneRefused as exc:
        log.info("retention: %s/%s kept: %s", run, step, exc)
        return [replace(a, outcome=REFUSED, detail=str(exc)) for a in actions]
    except CkptError as exc:
        log.warning("retention: %s/%s not retired: %s", run, step, exc)
        return [replace(a, outcome=FAILED, detail=f"{type(exc).__name__}: {exc}") for a in actions]
    ordered = sorted(actions, key=lambda a: (a.tier, a.part))
    return [_prune(settings, a, prune, actor, reason=f"retired: {reason}") for a in ordered]


def _prune(settings: Settings, action: PruneAction, prune: Callable[..., Any], actor: str, *,
           reason: str) -> PruneAction:
    try:
        done = prune(settings, action.replica_id, actor=actor, reason=reason)
        if done.by_another:  # a retention run beside this one got there first: the same end state
            return replace(action, outcome=DONE_BY_ANOTHER, detail="pruned by another worker")
        return replace(action, outcome=PRUNED)
    except PruneRefused as exc:
        log.info("retention: %s/%s tier %s kept: %s", action.run, action.step, action.tier, exc)
        return replace(action, outcome=REFUSED, detail=str(exc))
    except CkptError as exc:
        log.warning("retention: %s/%s tier %s not pruned: %s", action.run, action.step, action.tier, exc)
        return replace(action, outcome=FAILED, detail=f"{type(exc).__name__}: {exc}")


def finish_retirements(settings: Settings, *, prune: Callable[..., Any], actor: str,
                       node: str | None = None) -> list[PruneAction]:
    """Delete the copies left by interrupted retirements (retired checkpoints that still have a
    verified replica): of every tier, or with ``node`` only that node's Tier 0 ones (another
    node's NVMe is its own reconcile's). Idempotent."""
    with open_catalog(settings.catalog_url) as cat:
        pending = cat.retired_with_copies()
    out: list[PruneAction] = []
    for run in sorted({r for r, _ in pending}):
        steps = {s for r, s in pending if r == run}
        tiers = (Tier.NODE,) if node else ALL_TIERS  # a node's own: never the object store's locks
        plan = [a for a in plan_retention(settings, run=run, tiers=tiers, node=node)
                if a.step in steps and a.action == RETIRE]
        out += apply_retention(settings, plan, prune=prune, actor=actor)
    return out


plan_retention_task = pipeline_task(plan_retention, name="plan-retention")
