"""restore drill: time how long a cold machine takes to get the newest milestone back.

Contract of ``restore_drill``: picks the newest committed milestone (of ``run``, or of all
runs) and, for each durable tier holding a verified copy of it (1, then 2), restores it with
that tier alone (no fallback: a drill measures one tier) into an empty scratch folder, reads
the result back in full against the catalog's manifest (bytes and format), records the
recovery time per tier (``Catalog.record_drill``: ok, seconds, bytes, what went wrong) and
removes the scratch folder. A tier without a verified copy is skipped and said so; a restore
or a check that fails is recorded ``ok=False`` (its bad replica is marked by the restore).
"""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import CkptError, NotFound
from core.layout import checkpoint_prefix
from core.policy import is_milestone
from core.settings import MilestonePolicy, Settings
from db.catalog import Catalog
from db.entities import CKPT_COMMITTED, CheckpointInfo, DrillResult
from tasks.base import log, open_catalog, registered_manifest
from tasks.retry import pipeline_task

DRILL_TIERS = (1, 2)


@dataclass
class DrillReport:
    run: str | None
    step: int | None
    results: list[DrillResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def rows(self) -> list[dict[str, Any]]:
        return [drill_row(r) for r in self.results]


def drill_row(r: DrillResult) -> dict[str, Any]:
    """One drill as a flat record (the artifact's table, ``ckpt drills --json``)."""
    return {"at": r.at.isoformat(), "run": r.run, "step": r.step, "tier": r.tier, "ok": r.ok,
            "seconds": round(r.seconds, 3), "bytes": r.bytes,
            "MB/s": round(r.bytes / 1e6 / r.seconds, 1) if r.seconds > 0 else 0.0, "detail": r.detail or ""}


def newest_milestone(cat: Catalog, run: str | None, policy: MilestonePolicy) -> CheckpointInfo | None:
    """The newest committed milestone of ``run`` (by step), or across runs (by commit time),
    by the same rule the archive uses (``core.policy.is_milestone``)."""
    found = [c for c in cat.list_checkpoints(run)
             if c.state == CKPT_COMMITTED and is_milestone(c.kind, c.step, c.tags, policy)]
    if not found:
        return None
    if run is not None:
        return max(found, key=lambda c: c.step)
    return max(found, key=lambda c: (c.committed_at or c.created_at, c.step))


def restore_drill(settings: Settings, *, run: str | None = None, scratch: str | Path | None = None,
                  tiers: tuple[int, ...] = DRILL_TIERS, actor: str = "cli") -> DrillReport:
    """Drill the newest milestone on each tier in ``tiers``; see the module contract."""
    base = Path(scratch) if scratch else Path(settings.data_dir).expanduser().absolute() / "drills"
    with open_catalog(settings.catalog_url) as cat:
        ck = newest_milestone(cat, run, settings.milestones)
        if ck is None:
            return DrillReport(run, None, skipped=[f"no committed milestone{' of ' + run if run else ''} to drill"])
        held = {loc.tier for loc in cat.locations(ck.run, ck.step)}
        report = DrillReport(ck.run, ck.step)
        for tier in tiers:
            if tier not in held or not settings.tier_url(tier):
                report.skipped.append(f"tier {tier}: no verified copy of {ck.run}/step-{ck.step}")
                continue
            ok, seconds, detail = _drill_one(cat, settings, ck, tier, base / f"drill-{uuid.uuid4().hex[:8]}", actor)
            report.results.append(cat.record_drill(ck.run, ck.step, tier, ok=ok, seconds=seconds,
                                                   bytes=ck.total_bytes if ok else 0, detail=detail, actor=actor))
            log.info("drill %s/step-%d tier %d: %s in %.2f s %s", ck.run, ck.step, tier,
                     "ok" if ok else "FAILED", seconds, detail or "")
    return report


def _drill_one(cat: Catalog, settings: Settings, ck: CheckpointInfo, tier: int, scratch: Path,
               actor: str) -> tuple[bool, float, str | None]:
    """Restore from ``tier`` alone into ``scratch`` (removed after), check it; (ok, seconds, detail)."""
    from core.storage.local import LocalStore
    from core.transfer import verify_part
    from tasks.restore import restore_checkpoint

    prefix = checkpoint_prefix(ck.run, ck.step)
    started = time.monotonic()
    try:
        restore_checkpoint(settings, ck.run, scratch / prefix, step=ck.step, preference=(tier,),
                           fallback=False, actor=actor)
        seconds = time.monotonic() - started
        restored = LocalStore(scratch, 0, buffer_bytes=settings.io_buffer_bytes)
        for part in range(ck.parts):
            manifest = registered_manifest(cat, restored, ck.id, ck.run, ck.step, part, ck.parts)
            verify_part(restored, prefix, manifest, parallelism=settings.copy_parallelism,
                        buffer_bytes=settings.io_buffer_bytes, deep=True)
        return True, seconds, None
    except (CkptError, NotFound) as exc:
        return False, time.monotonic() - started, f"{type(exc).__name__}: {exc}"[:500]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


restore_drill_task = pipeline_task(restore_drill, name="restore-drill", retries=0)
