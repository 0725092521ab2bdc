"""Restore drills: recording one and reading them back (mixed into ``db.catalog.Catalog``)."""

from __future__ import annotations

from sqlalchemy import Select, select

from db import state as _state
from db.clock import catalog_now as _now
from db.entities import DrillResult
from db.rows import add_audit, checkpoint_row, checkpoints, drills as drills_table, run_row, runs, to_drill
from db.session import CatalogPart


class Drills(CatalogPart):
    def record_drill(self, run: str, step: int, tier: int, *, ok: bool, seconds: float, bytes: int,
                     detail: str | None = None, actor: str, nodes: int = 1, bound_seconds: float | None = None,
                     tier_bytes: dict[str, int] | None = None,
                     node_seconds: list[float] | None = None) -> DrillResult:
        """One drill of ``run``/``step`` from ``tier``: ``seconds`` is the recovery time (for a
        cluster drill of ``nodes``, first start to last part loaded)."""
        with self._tx() as conn:
            now = _now(conn)
            ck = checkpoint_row(conn, run, step)
            did = conn.execute(drills_table.insert().values(
                checkpoint_id=ck.id, tier=_state.check_tier(tier), ok=ok, seconds=seconds, bytes=bytes, at=now,
                detail=detail, actor=actor, nodes=nodes, bound_seconds=bound_seconds, tier_bytes=tier_bytes,
                node_seconds=node_seconds).returning(drills_table.c.id)).scalar_one()
            add_audit(conn, at=now, actor=actor, subject=f"drill:{did}", action="drill",
                      to_state="ok" if ok else "failed", reason=f"tier {tier}, {nodes} node(s), {seconds:.3f} s" +
                      (f": {detail}" if detail else ""), run=run, step=step)
            return to_drill(conn.execute(_drill_select().where(drills_table.c.id == did)).one())

    def drills(self, run: str | None = None, limit: int = 50) -> list[DrillResult]:
        """Newest first."""
        stmt = _drill_select().order_by(drills_table.c.id.desc()).limit(limit)
        with self._tx(write=False) as conn:
            if run is not None:
                stmt = stmt.where(checkpoints.c.run_id == run_row(conn, run).id)
            return [to_drill(r) for r in conn.execute(stmt)]


def _drill_select() -> Select:
    return select(drills_table, checkpoints.c.step, runs.c.name.label("run_name")).select_from(
        drills_table.join(checkpoints, checkpoints.c.id == drills_table.c.checkpoint_id)
        .join(runs, runs.c.id == checkpoints.c.run_id))
