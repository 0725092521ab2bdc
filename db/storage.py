"""What each tier holds and how its hops were timed: the ``Catalog`` methods behind ``ckpt
tiers`` and the storage section of a run's status page (mixed into ``db.catalog.Catalog``).

``stored_bytes`` says how many bytes a tier stores: on Tier 1 and Tier 2 a content the tier
already holds is stored once for every checkpoint that references it, so stored bytes may be
less than logical ones.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, func, select
from sqlalchemy.engine import Connection
from sqlalchemy.sql.selectable import Join

from core.storage.content import SHARED_TIERS
from db import queries as _q
from db.clock import catalog_now as _now
from db.entities import VERIFIED, HopTiming, TierHolding
from db.rows import checkpoints, drills, parts, replicas, run_row
from db.session import CatalogPart

HOP_LIMIT = 10_000  # the newest hops per tier and direction one read returns (a day of a large cluster)


def stored_bytes(conn: Connection, run_id: int | None) -> dict[int, int]:
    """tier -> bytes stored there (of ``run_id``'s checkpoints alone when given): on a tier that
    shares content (``core.storage.content.SHARED_TIERS``) each content once, however many
    checkpoints link it (``db.queries.stored_bytes``, what a budget counts too)."""
    return _q.stored_bytes(conn, shared=SHARED_TIERS, run_id=run_id)


def _held(run_id: int | None) -> Join:
    """Replicas with their part (its logical size), joined to the checkpoint where a run filters."""
    joined = replicas.outerjoin(parts, and_(parts.c.checkpoint_id == replicas.c.checkpoint_id,
                                            parts.c.part == replicas.c.part))
    return joined.join(checkpoints, checkpoints.c.id == replicas.c.checkpoint_id) if run_id is not None else joined


class Storage(CatalogPart):
    def tier_holdings(self, run: str | None = None, *, per_node: bool = False) -> list[TierHolding]:
        """Per tier with a verified copy (of ``run``'s checkpoints, or every run's): checkpoints
        held, logical bytes (the manifests' parts) and stored bytes (``stored_bytes``); with
        ``per_node``, Tier 0's fullest node and its bytes too (a budget per node needs them)."""
        with self._tx(write=False) as conn:
            run_id = run_row(conn, run).id if run is not None else None
            stmt = (select(replicas.c.tier, func.count(func.distinct(replicas.c.checkpoint_id)),
                           func.coalesce(func.sum(parts.c.bytes), 0))
                    .select_from(_held(run_id)).where(replicas.c.state == VERIFIED).group_by(replicas.c.tier))
            if run_id is not None:
                stmt = stmt.where(checkpoints.c.run_id == run_id)
            held = {tier: (count, int(logical)) for tier, count, logical in conn.execute(stmt)}
            stored = stored_bytes(conn, run_id)
            fullest = _q.node_stored_bytes(conn, tier=0, run_id=run_id) if per_node else {}
        node, most = max(fullest.items(), key=lambda kv: (kv[1], kv[0]), default=(None, 0))
        return [TierHolding(tier, held[tier][0], held[tier][1], stored.get(tier, 0),
                            *((node, most) if tier == 0 else (None, 0))) for tier in sorted(held)]

    def hop_timings(self, window_seconds: float, run: str | None = None) -> list[HopTiming]:
        """The timed transfers of the last ``window_seconds`` (catalog clock), newest first (at most
        ``HOP_LIMIT`` per tier and direction): each copy into a tier that moved bytes (its
        replica's ``copy_seconds``; a copy skipped as already there has none) and each successful
        restore drill from a tier."""
        with self._tx(write=False) as conn:
            run_id = run_row(conn, run).id if run is not None else None
            since = _now(conn) - timedelta(seconds=window_seconds)
            out: list[HopTiming] = []
            for tier in (0, 1, 2):
                out += _writes(conn, tier, since, run_id) + _reads(conn, tier, since, run_id)
        return out


def _of_run(run_id: int | None) -> list[ColumnElement[bool]]:
    return [] if run_id is None else [checkpoints.c.run_id == run_id]


def _writes(conn: Connection, tier: int, since: datetime, run_id: int | None) -> list[HopTiming]:
    stmt = (select(replicas.c.bytes, replicas.c.copy_seconds, replicas.c.first_byte_seconds, replicas.c.verified_at,
                   replicas.c.checkpoint_id)
            .select_from(replicas.join(checkpoints, checkpoints.c.id == replicas.c.checkpoint_id))
            .where(replicas.c.tier == tier, replicas.c.verified_at >= since, replicas.c.copy_seconds > 0,
                   replicas.c.bytes > 0, *_of_run(run_id))
            .order_by(replicas.c.verified_at.desc()).limit(HOP_LIMIT))
    return [HopTiming(tier, "write", int(b), float(s), f, at, ck) for b, s, f, at, ck in conn.execute(stmt)]


def _reads(conn: Connection, tier: int, since: datetime, run_id: int | None) -> list[HopTiming]:
    stmt = (select(drills.c.bytes, drills.c.seconds, drills.c.at)
            .select_from(drills.join(checkpoints, checkpoints.c.id == drills.c.checkpoint_id))
            .where(drills.c.tier == tier, drills.c.at >= since, drills.c.ok.is_(True), drills.c.seconds > 0,
                   drills.c.bytes > 0, *_of_run(run_id))
            .order_by(drills.c.at.desc()).limit(HOP_LIMIT))
    return [HopTiming(tier, "read", int(b), float(s), None, at) for b, s, at in conn.execute(stmt)]
