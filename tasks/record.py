"""record: catalog facts the flows act on (a checkpoint becoming complete on a tier, and the
work that follows it being done)."""

from __future__ import annotations

from core.errors import CorruptCheckpoint
from core.formats import check_union_complete
from core.layout import checkpoint_prefix
from core.settings import Settings
from core.tiers import Tier
from db.catalog import Catalog
from db.entities import CKPT_CORRUPT, VERIFIED, CheckpointInfo
from tasks.base import open_catalog, open_tier, read_part_manifest
from tasks.retry import pipeline_task


def mark_complete(settings: Settings, run: str, step: int, tier: int, *, actor: str = "cli",
                  attempt: str | None = None) -> bool:
    """True exactly once per (checkpoint, tier): for the caller that first sees every part
    verified there. N part promotions thus start the checkpoint-level work once."""
    with open_catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(run, step, attempt)
        if ck.parts > 1 and Tier(tier).shared_fs and _all_parts_verified(cat, ck.id, ck.parts, tier):
            _check_parts_add_up(settings, cat, ck, tier, actor=actor)
        return cat.complete_on_tier(ck.id, tier, actor=actor)


def _all_parts_verified(cat: Catalog, checkpoint_id: int, parts: int, tier: int) -> bool:
    return {r.part for r in cat.replicas(checkpoint_id, tier) if r.state == VERIFIED} == set(range(parts))


def _check_parts_add_up(settings: Settings, cat: Catalog, ck: CheckpointInfo, tier: int, *, actor: str) -> None:
    """Each part was verified alone; before the checkpoint counts as complete, its parts
    together must form a whole HF/DCP checkpoint (``formats.check_union_complete``). One that
    does not is recorded ``corrupt`` (reconcile leaves it; its copies stay) and raised."""
    with open_tier(settings, tier) as store:
        prefix = checkpoint_prefix(ck.run, ck.step, ck.attempt)
        manifests = [read_part_manifest(store, ck.run, ck.step, p, ck.parts, attempt=ck.attempt)
                     for p in range(ck.parts)]
        try:
            check_union_complete(manifests, lambda rel: store.open_read(f"{prefix}/{rel}"))
        except CorruptCheckpoint as exc:
            cat.set_checkpoint_state(ck.id, CKPT_CORRUPT, reason=f"parts do not add up: {exc}", actor=actor)
            raise


def claim_followups(settings: Settings, checkpoint_id: int) -> bool:
    """Whether this caller should now do the checkpoint's follow-ups (archive, durable event,
    status page, retention): it is complete on Tier 1, they are not recorded done, and no live
    lease holds them (``Catalog.claim_followups``); taken for ``claim_lease_seconds``."""
    with open_catalog(settings.catalog_url) as cat:
        return cat.claim_followups(checkpoint_id, 1, lease_seconds=settings.claim_lease_seconds)


def followups_open(settings: Settings, checkpoint_id: int) -> bool:
    """Whether the checkpoint is complete on Tier 1 and its follow-ups are still to take (not
    done, not held: ``Catalog.followups_open``), whoever recorded the completion."""
    with open_catalog(settings.catalog_url) as cat:
        return cat.followups_open(checkpoint_id, 1)


def followups_done(settings: Settings, checkpoint_id: int, *, actor: str = "cli") -> None:
    with open_catalog(settings.catalog_url) as cat:
        cat.followups_done(checkpoint_id, 1, actor=actor)


mark_complete_task = pipeline_task(mark_complete, name="mark-complete")
