"""Audit retention: entries older than ``audit_retain_days`` leave the catalog, exported first.

The audit log gets a row for every state change, so at scale it outgrows everything else in
the catalog. Entries older than the retention are written, page by page (``Catalog.expired_audit``),
as JSON lines into one gzip file under ``audit_export_dir``
(``audit-<cutoff>-<unique>.jsonl.gz``: staged under a temporary name, fsynced, renamed, the
folder fsynced), and only then deleted from the catalog (``Catalog.delete_audit``: exactly
the rows exported, one transaction, itself audited). A crash before the rename leaves the rows
in the catalog and a ``.tmp`` file behind; a crash between rename and delete leaves them in
both places, and the next run exports them again into a new file: never lost, at worst twice.
Everything younger than the retention stays in the catalog, rejections included (``ckpt audit``
lists them first).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from core.settings import Settings
from core.storage.local import fsync_dir
from db.catalog import Catalog
from db.entities import AuditEntry
from tasks.base import open_catalog
from tasks.retry import pipeline_task

PAGE = 5000


@dataclass(frozen=True)
class AuditExpiry:
    before: datetime | None  # the cutoff (None: retention off)
    exported: int
    deleted: int
    file: str | None  # the export, when anything expired


def expire_audit(settings: Settings, *, actor: str = "cli", now: datetime | None = None) -> AuditExpiry:
    """Export, then delete, the audit entries older than ``settings.audit_retain_days`` (by the
    catalog's clock unless ``now`` is given). Off when the retention is 0."""
    if not settings.audit_retain_days:
        return AuditExpiry(before=None, exported=0, deleted=0, file=None)
    with open_catalog(settings.catalog_url) as cat:
        before = (now or cat.clock()) - timedelta(days=settings.audit_retain_days)
        folder = Path(settings.audit_export_dir or ".")
        final = folder / f"audit-{before:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}.jsonl.gz"
        exported, last = _export(cat, before, final)
        if not exported:
            return AuditExpiry(before=before, exported=0, deleted=0, file=None)
        deleted = cat.delete_audit(before, upto_id=last, actor=actor, exported_to=str(final))
    return AuditExpiry(before=before, exported=exported, deleted=deleted, file=str(final))


def _export(cat: Catalog, before: datetime, final: Path) -> tuple[int, int]:
    """Write every entry before ``before`` into ``final`` durably; (how many, last id). Nothing
    is written when none expired."""
    page = cat.expired_audit(before, limit=PAGE)
    if not page:
        return 0, 0
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    count = last = 0
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb") as gz:
            while page:
                gz.write("".join(_line(e) for e in page).encode())
                count, last = count + len(page), page[-1].id
                page = cat.expired_audit(before, after_id=last, limit=PAGE)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return count, last


def _line(entry: AuditEntry) -> str:
    row = dataclasses.asdict(entry)
    row["at"] = entry.at.isoformat()
    return json.dumps(row, sort_keys=True) + "\n"


expire_audit_task = pipeline_task(expire_audit, name="expire-audit")
