"""Room on this node's Tier 0 for the next save: the one way the training side asks for it.

``retain_tier0_here`` applies Tier 0 retention to this node's NVMe only, through the same
guarded prune as every other retention (a copy goes only while a verified copy at least as
durable protects it, checked on its tier at that moment), so asking for room can never lose a
checkpoint: what is not yet promoted stays. ``waiting_for_promotion`` says how much of this
node's Tier 0 is held for that reason, for the error a save raises when room did not come.
"""

from __future__ import annotations

from core.settings import Settings
from db.entities import PRUNED, PRUNING
from tasks.base import open_catalog
from tasks.prune import prune_replica
from tasks.retention import PruneAction, apply_retention, plan_retention

WAITING_LIMIT = 200  # unpromoted checkpoints looked at; a node with more is far behind anyway


def retain_tier0_here(settings: Settings, *, actor: str) -> list[PruneAction]:
    """Tier 0 retention of ``settings.node``, applied now; each action with its outcome."""
    if not settings.retention(0).enabled:
        return []
    plan = plan_retention(settings, tiers=(0,), node=settings.node)
    return apply_retention(settings, plan, prune=prune_replica, actor=actor)


def waiting_for_promotion(settings: Settings) -> tuple[int, int]:
    """(checkpoints, bytes) on this node's Tier 0 that the catalog has not seen promoted to
    Tier 1 yet (at most ``WAITING_LIMIT`` checkpoints looked at)."""
    count = total = 0
    with open_catalog(settings.catalog_url) as cat:
        for ck in cat.unpromoted(limit=WAITING_LIMIT):
            here = [r for r in cat.replicas(ck.id, tier=0)
                    if r.node == settings.node and r.state not in (PRUNING, PRUNED)]
            if here:
                count += 1
                total += sum(r.bytes or 0 for r in here)
    return count, total
