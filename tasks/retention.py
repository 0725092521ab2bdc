"""Retention: which replicas each tier's policy lets go, and applying that through the guarded
prune. Milestone decisions live here too, because they decide both archive and retention.

The plan comes from ``catalog.prune_candidates`` (keep last N, top-k, max age, pins, aliases,
each run's newest verified checkpoint). On top of it a milestone that is not yet archived is
held on Tiers 0/1 while Tier 2 is configured (the catalog knows ``kind``, not the every-K-steps
rule), and Tier 0 replicas of other nodes are listed but left to their node. Every prune still
goes through the claimed, guarded prune (``tasks.prune``: the catalog's rows, then the justifying
copy checked on its tier), so a stale plan, or a second retention run overlapping this one, can
never delete the last good copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from core.errors import CkptError, PruneRefused
from core.layout import part_key
from core.policy import is_milestone
from core.settings import Settings
from db.catalog import Catalog
from tasks.base import log, open_catalog, open_tier
from tasks.retry import pipeline_task

PLANNED, PRUNED, REFUSED, KEPT, ELSEWHERE, FAILED = "planned", "pruned", "refused", "kept", "elsewhere", "failed"
LOCKED = "locked"  # under the store's retention (S3 Object Lock) until a date: planned for after it


@dataclass(frozen=True)
class PruneAction:
    tier: int
    replica_id: int
    run: str
    step: int
    part: int
    node: str | None
    url: str
    bytes: int | None
    outcome: str = PLANNED  # planned | pruned | refused | kept | locked | elsewhere | failed
    detail: str = ""

    def row(self) -> dict[str, Any]:
        return {"tier": self.tier, "run": self.run, "step": self.step, "part": self.part,
                "node": self.node or "", "bytes": self.bytes or 0, "outcome": self.outcome,
                "detail": self.detail}


def plan_retention(settings: Settings, *, run: str | None = None, now: datetime | None = None,
                   tiers: Sequence[int] = (0, 1, 2), node: str | None = None) -> list[PruneAction]:
    """Per tier (of ``tiers``), the replicas its policy no longer keeps, each with what will
    happen to it. ``node``: of Tier 0, only the replicas on that node's NVMe (the catalog
    selects them; what a run keeps is still decided over all of its Tier 0 replicas)."""
    plan: list[PruneAction] = []
    with open_catalog(settings.catalog_url) as cat:
        for tier in tiers:
            policy = settings.retention(tier)
            if not policy.enabled or not settings.tier_url(tier):
                continue
            for rep in cat.prune_candidates(tier, policy, run=run, now=now, node=node if tier == 0 else None):
                action = PruneAction(tier=tier, replica_id=rep.id, run=rep.run, step=rep.step,
                                     part=rep.part, node=rep.node, url=rep.url, bytes=rep.bytes)
                plan.append(_annotate(cat, settings, action, policy.keep_milestones))
        if any(a.tier == 2 and a.outcome == PLANNED for a in plan):
            plan = _mark_locked(cat, settings, plan)
    return plan


def _mark_locked(cat: Catalog, settings: Settings, plan: list[PruneAction]) -> list[PruneAction]:
    """Tier 2 actions whose part is under Object Lock become ``locked`` (with the date after
    which a retention pass prunes them), so no delete is tried and refused every pass. The
    manifest, written last, carries the latest retain-until date of its part."""
    with open_tier(settings, 2) as store:
        out = []
        for a in plan:
            until = None
            if a.tier == 2 and a.outcome == PLANNED:
                key = part_key(a.run, a.step, a.part, cat.get_checkpoint(a.run, a.step).parts)
                try:
                    until = store.locked_until([key])
                except CkptError as exc:  # left planned: the prune checks the lock again itself
                    log.warning("retention: Object Lock of %s not known: %s", store.url_for(key), exc)
            out.append(a if until is None else
                       replace(a, outcome=LOCKED, detail=f"Object Lock until {until.isoformat()}; pruned after that"))
        return out


def _annotate(cat: Catalog, settings: Settings, action: PruneAction, keep_milestones: bool) -> PruneAction:
    if action.tier < 2 and keep_milestones and settings.tier2_url:
        ck = cat.get_checkpoint(action.run, action.step)
        archived = any(loc.tier == 2 for loc in cat.locations(action.run, action.step))
        if not archived and is_milestone(ck.kind, ck.step, ck.tags, settings.milestones):
            return replace(action, outcome=KEPT, detail="milestone not yet archived")
    if action.tier == 0 and action.node and action.node != settings.node:
        return replace(action, outcome=ELSEWHERE, detail=f"on node {action.node}; pruned there")
    return action


def apply_retention(settings: Settings, plan: list[PruneAction], *, prune: Callable[..., Any],
                    actor: str = "cli") -> list[PruneAction]:
    """Prune every ``planned`` action through ``prune`` (the plain step or its task), Tier 0
    first; a refusal or failure is recorded on the action and the others still run."""
    done: list[PruneAction] = []
    for action in sorted(plan, key=lambda a: (a.tier, a.run, a.step, a.part)):
        if action.outcome != PLANNED:
            done.append(action)
            continue
        try:
            prune(settings, action.replica_id, actor=actor, reason="retention policy")
            done.append(replace(action, outcome=PRUNED))
        except PruneRefused as exc:
            log.info("retention: %s/%s tier %s kept: %s", action.run, action.step, action.tier, exc)
            done.append(replace(action, outcome=REFUSED, detail=str(exc)))
        except CkptError as exc:
            log.warning("retention: %s/%s tier %s not pruned: %s", action.run, action.step, action.tier, exc)
            done.append(replace(action, outcome=FAILED, detail=f"{type(exc).__name__}: {exc}"))
    return done


plan_retention_task = pipeline_task(plan_retention, name="plan-retention")
