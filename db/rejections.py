"""Rejected parts (inside the caller's transaction): each refusal recorded once per manifest.

A refused part of a checkpoint that has no accepted registration for that part makes the
checkpoint ``rejected`` (it cannot become whole from what was sent); a conflicting re-save of
a part already accepted leaves the accepted checkpoint as it stands. A later accepted
registration of the missing part moves a rejected checkpoint on (``db.register``).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.engine import Connection, Row

from db.entities import CKPT_COMMITTED, CKPT_PARTIAL, CKPT_REJECTED, RejectionInfo
from db.rows import add_audit, checkpoints, insert_ignore, parts, rejections, runs


def record(conn: Connection, run: str, step: int, part: int, *, digest: str, reason: str, node: str | None,
           now: datetime, actor: str) -> bool:
    """Record the refusal; True if it is new (then audited), False if this manifest was refused before."""
    values = dict(run=run, step=step, part=part, manifest_digest=digest, node=node or None, reason=reason,
                  rejected_at=now, actor=actor)
    if not insert_ignore(conn, rejections, values, ["run", "step", "part", "manifest_digest"]):
        return False
    add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{run}/{step}/part-{part}", action="reject",
              to_state=CKPT_REJECTED, reason=reason, run=run, step=step)
    ck = conn.execute(select(checkpoints.c.id, checkpoints.c.state).join(runs, runs.c.id == checkpoints.c.run_id)
                      .where(runs.c.name == run, checkpoints.c.step == step)).first()
    if ck is None or ck.state not in (CKPT_PARTIAL, CKPT_COMMITTED):
        return True
    accepted = conn.execute(select(parts.c.part).where(parts.c.checkpoint_id == ck.id, parts.c.part == part)).first()
    if accepted is None:
        conn.execute(update(checkpoints).where(checkpoints.c.id == ck.id).values(state=CKPT_REJECTED))
        add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{run}/{step}", action="set-state",
                  from_state=ck.state, to_state=CKPT_REJECTED, reason=f"part {part}: {reason}", run=run, step=step)
    return True


def find(conn: Connection, run: str, step: int, part: int, digest: str) -> RejectionInfo | None:
    row = conn.execute(select(rejections).where(rejections.c.run == run, rejections.c.step == step,
                                                rejections.c.part == part,
                                                rejections.c.manifest_digest == digest)).first()
    return _to_info(row) if row is not None else None


def listing(conn: Connection, run: str | None = None) -> list[RejectionInfo]:
    stmt = select(rejections).order_by(rejections.c.run, rejections.c.step, rejections.c.part,
                                       rejections.c.rejected_at)
    if run is not None:
        stmt = stmt.where(rejections.c.run == run)
    return [_to_info(r) for r in conn.execute(stmt)]


def _to_info(row: Row) -> RejectionInfo:
    return RejectionInfo(run=row.run, step=row.step, part=row.part, manifest_digest=row.manifest_digest,
                         node=row.node, reason=row.reason, rejected_at=row.rejected_at, actor=row.actor)
