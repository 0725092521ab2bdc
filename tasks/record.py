"""record: catalog facts the flows act on (a checkpoint becoming complete on a tier)."""

from __future__ import annotations

from core.settings import Settings
from tasks.base import open_catalog
from tasks.retry import pipeline_task


def mark_complete(settings: Settings, run: str, step: int, tier: int, *, actor: str = "cli") -> bool:
    """True exactly once per (checkpoint, tier): for the caller that first sees every part
    verified there. N part promotions thus start the checkpoint-level work once."""
    with open_catalog(settings.catalog_url) as cat:
        ck = cat.get_checkpoint(run, step)
        return cat.complete_on_tier(ck.id, tier, actor=actor)


mark_complete_task = pipeline_task(mark_complete, name="mark-complete")
