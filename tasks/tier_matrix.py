"""What every tier holds and costs: one row per tier from this cluster's own records (``ckpt
tiers``; per run on the run's status page, ``flows.status``).

A row joins what the catalog holds (``Catalog.tier_holdings``: checkpoints, logical and stored
bytes), the hops it timed over the last day (``Catalog.hop_timings``: write and read
bandwidth, first-byte latency; ``core.tier_figures`` does the arithmetic), the tier's budget
(its retention policy's ``max_bytes`` where the settings have one) and price, and whether its
root proves its identity now (``tasks.tier_roots.prove_tier`` through ``open_tier``): a
missing mount or an unreachable store is a row marked unavailable, never an error, since the
catalog's figures stand without it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from core.errors import ConfigError, StorageUnavailable
from core.settings import Settings, display_url
from core.tier_figures import (
    WINDOW_SECONDS,
    Spread,
    bandwidths,
    budget_used,
    checkpoint_bandwidths,
    dedup_ratio,
    monthly_cost,
    spread,
)
from db.catalog import Catalog
from db.entities import HopTiming
from tasks.base import open_catalog, open_tier
from tasks.tier_roots import NOT_CONFIGURED, PROVEN, UNAVAILABLE

TIERS = (0, 1, 2)
NOT_CHECKED = "not checked"  # the identity was not asked for (a run's status page)


@dataclass(frozen=True)
class TierRow:
    tier: int
    url: str
    identity: str  # proven | unavailable | not configured | not checked
    detail: str  # why unavailable
    checkpoints: int
    logical_bytes: int
    stored_bytes: int
    dedup_ratio: float | None
    budget_bytes: int | None  # Tier 0: each node's
    budget_used: float | None  # Tier 0: of the node storing the most (``budget_node``)
    budget_node: str | None
    write: Spread | None  # bytes/s of the hops into the tier
    read: Spread | None  # bytes/s of the restore drills from it
    first_byte: Spread | None  # seconds from a hop's start to its first byte
    price_gb_month: float
    monthly_cost: float

    def as_json(self) -> dict:
        """The row as ``ckpt tiers --json`` gives it: units in the names, a spread as ``{median,
        p95, count}`` (null: no hop measured it over the window)."""
        out = asdict(self)
        for name, key in (("write", "write_bytes_per_s"), ("read", "read_bytes_per_s"),
                          ("first_byte", "first_byte_seconds")):
            out[key] = out.pop(name)
        return out


def budget_of(settings: Settings, tier: int) -> int | None:
    """The tier's byte budget: its retention policy's ``max_bytes`` where the settings have it."""
    return settings.retention(tier).max_bytes


def tier_rows(settings: Settings, cat: Catalog, *, run: str | None = None,
              identities: dict[int, tuple[str, str]] | None = None) -> list[TierRow]:
    """One ``TierRow`` per tier (an unconfigured one too: its copies may outlive its setting);
    ``identities``: tier -> (state, detail) as proven (default: not checked)."""
    held = {h.tier: h for h in cat.tier_holdings(run, per_node=budget_of(settings, 0) is not None)}
    timings = cat.hop_timings(WINDOW_SECONDS, run)
    rows = []
    for tier in TIERS:
        url = settings.tier_url(tier)
        h = held.get(tier)
        logical, stored = (h.logical_bytes, h.stored_bytes) if h else (0, 0)
        budget = budget_of(settings, tier)
        # Tier 0's budget is each node's disk: the fullest node's use is the one that matters
        node, counted = (h.fullest_node, h.fullest_node_bytes) if h and tier == 0 else (None, stored)
        state, detail = (identities or {}).get(tier, (NOT_CHECKED, ""))
        rows.append(TierRow(
            tier=tier, url=display_url(url) if url else "", identity=state, detail=detail,
            checkpoints=h.checkpoints if h else 0, logical_bytes=logical, stored_bytes=stored,
            dedup_ratio=dedup_ratio(logical, stored), budget_bytes=budget, budget_used=budget_used(counted, budget),
            budget_node=node if budget else None,
            write=bandwidths(_hops(timings, tier, "write")), read=bandwidths(_hops(timings, tier, "read")),
            first_byte=spread([t.first_byte_seconds for t in timings if t.tier == tier and t.direction == "write"
                               and t.first_byte_seconds is not None], slow_is_low=False),
            price_gb_month=settings.price_gb_month(tier),
            monthly_cost=monthly_cost(stored, settings.price_gb_month(tier))))
    return rows


def _hops(timings: list[HopTiming], tier: int, direction: str) -> list[tuple[int, float]]:
    return [(t.bytes, t.seconds) for t in timings if t.tier == tier and t.direction == direction]


def identity_now(settings: Settings, tier: int) -> tuple[str, str]:
    """(state, detail) of ``tier``'s root now: proven, unavailable (a missing mount, a foreign
    root, an unreachable store) or not configured. As every step that opens a tier, it adopts a
    root the catalog records nothing for yet (first use, ``prove_tier``)."""
    if not settings.tier_url(tier):
        return NOT_CONFIGURED, ""
    try:
        with open_tier(settings, tier):
            return PROVEN, ""
    except StorageUnavailable as exc:  # TierUnavailable among them: transient, never a verdict
        return UNAVAILABLE, getattr(exc, "reason", None) or str(exc)
    except ConfigError as exc:
        return UNAVAILABLE, str(exc)


def tier_matrix(settings: Settings, *, run: str | None = None) -> list[TierRow]:
    """The storage matrix of this cluster (of ``run`` alone when given), each tier's identity
    proven now (``identity_now``)."""
    identities = {tier: identity_now(settings, tier) for tier in TIERS}
    with open_catalog(settings.catalog_url) as cat:
        return tier_rows(settings, cat, run=run, identities=identities)


def measured_bandwidths(settings: Settings) -> dict[tuple[int, str], Spread]:
    """(tier, 'write' | 'read') -> the spread of the last day's bandwidths, where any hop measured
    it (``ckpt plan``'s bandwidths): a write is a whole checkpoint's, its parts together
    (``checkpoint_bandwidths``), a read one restore drill's."""
    with open_catalog(settings.catalog_url) as cat:
        timings = cat.hop_timings(WINDOW_SECONDS)
    out = {}
    for tier in TIERS:
        writes = [(t.checkpoint_id, t.bytes, t.seconds, t.at.timestamp()) for t in timings
                  if t.tier == tier and t.direction == "write"]
        for direction, found in (("write", checkpoint_bandwidths(writes)),
                                 ("read", bandwidths(_hops(timings, tier, "read")))):
            if found is not None:
                out[tier, direction] = found
    return out
