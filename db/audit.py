"""The audit trail: a checkpoint's history, the newest entries, the catalog's clock, and the
audit retention's pages (mixed into ``db.catalog.Catalog``)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, select

from db.clock import catalog_now as _now
from db.entities import AuditEntry
from db.rows import add_audit, audit, to_audit
from db.session import CatalogPart


class Audit(CatalogPart):
    def history(self, run: str, step: int) -> list[AuditEntry]:
        """(8) The checkpoint's audit trail, oldest first."""
        with self._tx(write=False) as conn:
            rows = conn.execute(select(audit).where(audit.c.run == run, audit.c.step == step).order_by(audit.c.id))
            return [to_audit(r) for r in rows]

    def audit_log(self, *, run: str | None = None, limit: int = 100,
                  since: datetime | None = None) -> list[AuditEntry]:
        """The newest audit entries (of one run, or all; at or after ``since``), newest first."""
        stmt = select(audit).order_by(audit.c.id.desc()).limit(limit)
        if run is not None:
            stmt = stmt.where(audit.c.run == run)
        if since is not None:
            stmt = stmt.where(audit.c.at >= since)
        with self._tx(write=False) as conn:
            return [to_audit(r) for r in conn.execute(stmt)]

    def record_rejection_once(self, subject: str, reason: str, *, actor: str, run: str | None = None) -> bool:
        """Audit a rejected input that carries no step the catalog can hold (a folder named out of
        range, found again by every reconcile pass) once: True if recorded now, False if a
        rejection of ``subject`` is on record already (found through the (run, step) index)."""
        with self._tx() as conn:
            seen = conn.execute(select(audit.c.id).where(
                audit.c.run == run if run is not None else audit.c.run.is_(None), audit.c.step.is_(None),
                audit.c.action == "reject", audit.c.subject == subject).limit(1)).first()
            if seen is not None:
                return False
            add_audit(conn, at=_now(conn), actor=actor, subject=subject, action="reject", to_state="rejected",
                      reason=reason, run=run, step=None)
            return True

    def clock(self) -> datetime:
        """The catalog's clock (see ``_now``): what leases, ages and retentions compare against."""
        with self._tx(write=False) as conn:
            return _now(conn)

    def expired_audit(self, before: datetime, *, after_id: int = 0, limit: int = 5000) -> list[AuditEntry]:
        """Audit entries stamped before ``before``, by id after ``after_id``, at most ``limit``:
        pages of what the audit retention exports (``ix_audit_log_at``)."""
        stmt = (select(audit).where(audit.c.at < before, audit.c.id > after_id).order_by(audit.c.id).limit(limit))
        with self._tx(write=False) as conn:
            return [to_audit(r) for r in conn.execute(stmt)]

    def delete_audit(self, before: datetime, *, upto_id: int, actor: str, exported_to: str) -> int:
        """Delete the audit entries stamped before ``before`` with id <= ``upto_id``: exactly the
        pages ``expired_audit`` returned for the same ``before``, once they are exported (the
        caller's duty). Leaves one audit entry saying how many and where they went."""
        with self._tx() as conn:
            gone = conn.execute(delete(audit).where(audit.c.at < before, audit.c.id <= upto_id)).rowcount
            if gone:
                add_audit(conn, at=_now(conn), actor=actor, subject="audit", action="expire-audit",
                          reason=f"{gone} entries before {before.isoformat()} exported to {exported_to}")
            return gone
