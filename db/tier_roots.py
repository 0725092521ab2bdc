"""Tier root identities: the ``Catalog`` methods that record which identity marker each tier
root shows (``core.storage.identity``), mixed into ``db.catalog.Catalog``. Tiers 1 and 2 are
shared (node ''); Tier 0 is one root per node."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.engine import Row

from core.tiers import Tier
from db.clock import catalog_now as _now
from db.entities import TierRootInfo
from db.rows import add_audit, insert_ignore, tier_roots
from db.session import CatalogPart

SHARED = ""  # the node of a shared tier's root


def root_node(tier: int, node: str) -> str:
    """The node a tier root is recorded under: ``node`` for Tier 0, '' for the shared tiers."""
    return node if Tier(tier).node_local else SHARED


class TierRoots(CatalogPart):
    def tier_root(self, tier: int, node: str) -> TierRootInfo | None:
        """The identity recorded for ``tier``'s root (on ``node`` for Tier 0); None if none yet."""
        with self._tx(write=False) as conn:
            row = conn.execute(select(tier_roots).where(tier_roots.c.tier == tier,
                                                        tier_roots.c.node == root_node(tier, node))).first()
        return None if row is None else _to_info(row)

    def list_tier_roots(self) -> list[TierRootInfo]:
        with self._tx(write=False) as conn:
            rows = conn.execute(select(tier_roots).order_by(tier_roots.c.tier, tier_roots.c.node))
            return [_to_info(r) for r in rows]

    def record_tier_root(self, tier: int, node: str, url: str, identity: str, *, actor: str,
                         replace: bool = False) -> TierRootInfo:
        """Record ``identity`` for the root unless one is recorded already, and return what is
        recorded now: the earlier one when two recorders raced (the caller compares). With
        ``replace`` (an operator's word that the storage was replaced) it overwrites. Audited."""
        node = root_node(tier, node)
        subject = f"tier-root:{tier}" + (f"@{node}" if node else "")
        with self._tx() as conn:
            now = _now(conn)
            values = dict(tier=tier, node=node, url=url, identity=identity, recorded_at=now)
            if insert_ignore(conn, tier_roots, values, ["tier", "node"]):
                add_audit(conn, at=now, actor=actor, subject=subject, action="tier-root", to_state="recorded",
                          reason=f"identity {identity} of {url} recorded"[:500])
            elif replace:
                key = (tier_roots.c.tier == tier) & (tier_roots.c.node == node)
                before = conn.execute(select(tier_roots.c.identity).where(key)).scalar()
                if before != identity:
                    conn.execute(update(tier_roots).where(key).values(url=url, identity=identity, recorded_at=now))
                    add_audit(conn, at=now, actor=actor, subject=subject, action="tier-root", to_state="replaced",
                              reason=f"identity {identity} of {url} recorded in place of {before}"[:500])
            row = conn.execute(select(tier_roots).where(tier_roots.c.tier == tier, tier_roots.c.node == node)).one()
            return _to_info(row)


def _to_info(row: Row) -> TierRootInfo:
    return TierRootInfo(tier=row.tier, node=row.node, url=row.url, identity=row.identity,
                        recorded_at=row.recorded_at)
