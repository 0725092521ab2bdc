"""Pins, aliases and lineage: the ``Catalog`` methods that keep a checkpoint whatever retention
says, name it, and link it to its parents (mixed into ``db.catalog.Catalog``)."""

from __future__ import annotations

from sqlalchemy import delete, select
from sqlalchemy.engine import Row

from core.errors import BadInput, NotFound
from db import lineage as _lineage
from db.clock import catalog_now as _now
from db.entities import CKPT_RETIRED
from db.rows import add_audit, aliases, checkpoint_row, checkpoints, insert_ignore, pins, run_row
from db.session import CatalogPart


class Pins(CatalogPart):
    def pin(self, run: str, step: int, *, reason: str | None = None, actor: str) -> None:
        """Keep this checkpoint on every tier whatever retention says (idempotent, audited)."""
        with self._tx() as conn:
            now = _now(conn)
            ck = _not_retired(checkpoint_row(conn, run, step, lock=True), "pinned")
            if insert_ignore(conn, pins, dict(checkpoint_id=ck.id, reason=reason, actor=actor, pinned_at=now),
                             ["checkpoint_id"]):
                add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{run}/{step}", action="pin",
                          reason=reason, run=run, step=step)

    def unpin(self, run: str, step: int, *, actor: str) -> None:
        """Idempotent, audited."""
        with self._tx() as conn:
            ck = checkpoint_row(conn, run, step, lock=True)
            if conn.execute(delete(pins).where(pins.c.checkpoint_id == ck.id)).rowcount:
                add_audit(conn, at=_now(conn), actor=actor, subject=f"checkpoint:{run}/{step}", action="unpin",
                          run=run, step=step)

    def is_pinned(self, run: str, step: int) -> bool:
        with self._tx(write=False) as conn:
            ck = checkpoint_row(conn, run, step)
            return conn.execute(select(pins.c.checkpoint_id).where(pins.c.checkpoint_id == ck.id)).first() is not None

    def set_alias(self, run: str, alias: str, step: int, *, actor: str) -> None:
        """Point ``alias`` (e.g. ``best``) of ``run`` at ``step``; moves an existing alias."""
        if not alias or len(alias) > 128:
            raise BadInput(f"invalid alias {alias!r}")
        with self._tx() as conn:
            now = _now(conn)
            ck = _not_retired(checkpoint_row(conn, run, step, lock=True), "aliased")
            key = (aliases.c.run_id == ck.run_id) & (aliases.c.name == alias)
            conn.execute(delete(aliases).where(key))
            conn.execute(aliases.insert().values(run_id=ck.run_id, name=alias, checkpoint_id=ck.id, set_at=now))
            add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{run}/{step}", action="alias",
                      to_state=alias, run=run, step=step)

    def remove_alias(self, run: str, alias: str, *, actor: str) -> None:
        """Idempotent, audited."""
        with self._tx() as conn:
            r = run_row(conn, run)
            key = (aliases.c.run_id == r.id) & (aliases.c.name == alias)
            step = conn.execute(select(checkpoints.c.step).join(aliases, aliases.c.checkpoint_id == checkpoints.c.id)
                                .where(key)).scalar()
            if step is not None:
                conn.execute(delete(aliases).where(key))
                add_audit(conn, at=_now(conn), actor=actor, subject=f"checkpoint:{run}/{step}", action="unalias",
                          from_state=alias, run=run, step=step)

    def resolve_alias(self, run: str, alias: str) -> int:
        """The step ``alias`` points at; ``NotFound`` if the run has no such alias."""
        with self._tx(write=False) as conn:
            r = run_row(conn, run)
            step = conn.execute(select(checkpoints.c.step).join(aliases, aliases.c.checkpoint_id == checkpoints.c.id)
                                .where(aliases.c.run_id == r.id, aliases.c.name == alias)).scalar()
        if step is None:
            raise NotFound(f"run {run!r} has no alias {alias!r}")
        return step

    def aliases(self, run: str) -> dict[str, int]:
        """alias -> step for one run."""
        with self._tx(write=False) as conn:
            r = run_row(conn, run)
            rows = conn.execute(select(aliases.c.name, checkpoints.c.step)
                                .join(checkpoints, aliases.c.checkpoint_id == checkpoints.c.id)
                                .where(aliases.c.run_id == r.id))
            return dict(rows.all())

    def add_lineage(self, child: tuple[str, int], parent: tuple[str, int], relation: str, *,
                    actor: str) -> None:
        """Raises ``LineageCycle`` if ``parent`` descends from ``child``; idempotent."""
        with self._tx() as conn:
            now = _now(conn)
            c, p = checkpoint_row(conn, *child), checkpoint_row(conn, *parent)
            if _lineage.add_edge(conn, c.id, p.id, relation, now=now):
                add_audit(conn, at=now, actor=actor, subject=f"checkpoint:{child[0]}/{child[1]}", action="lineage",
                          to_state=relation, reason=f"{relation} {parent[0]}/{parent[1]}", run=child[0], step=child[1])


def _not_retired(ck: Row, what: str) -> Row:
    """A retired checkpoint's copies are being deleted (its retirement is final): it cannot be
    pinned or aliased back, which would leave its deletion half done."""
    if ck.state == CKPT_RETIRED:
        raise BadInput(f"checkpoint {ck.run_name}/{ck.step} was retired by the retention policy and cannot be {what}")
    return ck
