"""Tier roots proven before use: every store the pipeline opens (``tasks.base.tier_store``)
first shows the identity marker the catalog recorded for its root (``core.storage.identity``),
and ``init_tier`` writes and records that marker once (``ckpt tiers init``, ``ckpt db upgrade``,
agent start, the local stack).

A root that does not prove itself raises ``TierUnavailable`` (transient: the step is retried),
logged and announced as ``ckpt.tier.unavailable``; the step stops before it judges, writes or
prunes anything on the strength of that tier. The proof reads the marker every time a store is
opened (one small read); only the catalog's record is kept per process, for ``RECORD_TTL_S``,
and read again when a marker does not match it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from core import events
from core.errors import TierUnavailable
from core.settings import Settings, display_url
from core.storage import identity, open_store
from core.storage.base import TierStore
from db.catalog import Catalog
from db.tier_roots import root_node

log = logging.getLogger("ckpt.pipeline")

RECORD_TTL_S = 60.0  # how long a process trusts the record it read (a replacement shows within it)
_records: dict[tuple[str, int, str], tuple[float, str]] = {}
_records_lock = threading.Lock()

PROVEN, MARKED, RECORDED, UNAVAILABLE, NOT_CONFIGURED = "proven", "marked", "recorded", "unavailable", "not configured"


def _recorded(settings: Settings, tier: int, *, fresh: bool = False) -> str | None:
    """The identity the catalog records for ``tier``'s root on this node (cached briefly)."""
    key = (settings.catalog_url, tier, root_node(tier, settings.node))
    with _records_lock:
        hit = _records.get(key)
    if hit is not None and not fresh and time.monotonic() - hit[0] < RECORD_TTL_S:
        return hit[1]
    with Catalog(settings.catalog_url) as cat:
        info = cat.tier_root(tier, settings.node)
    with _records_lock:
        if info is None:
            _records.pop(key, None)
        else:
            _records[key] = (time.monotonic(), info.identity)
    return None if info is None else info.identity


def forget_records() -> None:
    """Drop what this process remembers of the catalog's records (after recording one)."""
    with _records_lock:
        _records.clear()


def prove_tier(settings: Settings, store: TierStore) -> None:
    """Return when ``store``'s root shows the identity the catalog recorded for it; else
    ``TierUnavailable``, logged and announced (``ckpt.tier.unavailable``). A root the catalog
    records nothing for yet is adopted on first use (``init_tier``), as an agent's start would."""
    try:
        recorded = _recorded(settings, store.tier)
        if recorded is None:  # first use: marked and recorded here, as an agent's start does (an
            # existing root only: a missing one stays unavailable, and a recorded one is proven)
            recorded = init_tier(settings, store.tier, actor=f"first use on {settings.node}").identity
            if recorded is None:
                raise TierUnavailable(store.tier, store.root_url, "the catalog records no identity for it")
        try:
            identity.prove(store, recorded)
        except TierUnavailable:
            fresh = _recorded(settings, store.tier, fresh=True)  # replaced meanwhile (`ckpt tiers init --replace`)?
            if fresh == recorded:
                raise
            if fresh is None:  # the record this process remembered is gone (a catalog made anew): first use
                fresh = init_tier(settings, store.tier, actor=f"first use on {settings.node}").identity
            identity.prove(store, fresh or "")
    except TierUnavailable as exc:
        alert(settings, exc)
        raise


def alert(settings: Settings, exc: TierUnavailable) -> None:
    """Log and announce an unavailable tier (labelled ``ckpt.tier`` and ``ckpt.node``)."""
    node = root_node(exc.tier, settings.node)
    log.warning("%s", exc)
    hour = datetime.now(UTC).strftime("%Y%m%dT%H")  # one event per tier and hour, not one ever (ids dedupe)
    events.announce(events.TIER_UNAVAILABLE, "", 0, node=settings.node, extra_id=f"tier{exc.tier}:{node}:{hour}",
                    payload={"tier": exc.tier, "url": exc.url, "reason": exc.reason},
                    labels={"tier": exc.tier}, resource_id=events.tier_resource_id(exc.tier, node))


@dataclass(frozen=True)
class RootState:
    """What ``init_tier`` found or did for one tier root."""

    tier: int
    node: str  # '' for a shared tier
    url: str
    state: str  # proven | marked | recorded | unavailable | not configured
    identity: str | None = None
    detail: str = ""

    def line(self) -> str:
        where = f"tier {self.tier}" + (f" (node {self.node})" if self.node else "")
        if self.state == NOT_CONFIGURED:
            return f"{where}: not configured"
        said = {PROVEN: "proven (shows the recorded identity)", MARKED: "marked and recorded",
                RECORDED: "its marker recorded", UNAVAILABLE: "UNAVAILABLE"}[self.state]
        return f"{where} at {self.url}: {said}" + (f" {self.identity}" if self.identity else "") + \
            (f": {self.detail}" if self.detail else "")


def init_tier(settings: Settings, tier: int, *, actor: str, replace: bool = False) -> RootState:
    """Make ``tier``'s root (this node's for Tier 0) one the pipeline trusts. Idempotent.

    Recorded already: proven, else ``TierUnavailable`` (a missing mount is never re-marked).
    Nothing recorded (or ``replace``, the operator's word that the storage was replaced): the
    marker at the root is recorded, written first when there is none. A configured root must
    exist: it is never created (only the embedded default folders are, ``Settings.embedded_root``)."""
    url = settings.tier_url(tier)
    node = root_node(tier, settings.node)
    if not url:
        return RootState(tier, node, "", NOT_CONFIGURED)
    with open_store(url, tier, settings) as store, Catalog(settings.catalog_url) as cat:
        if (own := settings.embedded_root(tier)) is not None and not store.root_exists():
            own.mkdir(parents=True, exist_ok=True)
        shown = display_url(store.root_url)
        recorded = cat.tier_root(tier, settings.node)
        if recorded is not None and not replace:
            identity.prove(store, recorded.identity)
            return RootState(tier, node, shown, PROVEN, recorded.identity)
        found = identity.read_marker(store)
        if found is not None and found.tier != tier:  # another tier's root configured here: never adopted
            raise TierUnavailable(tier, shown, f"its root holds the identity marker of tier {found.tier}")
        marked = found is None
        if found is None:
            found = identity.write_marker(store)
        info = cat.record_tier_root(tier, settings.node, shown, found.id, actor=actor, replace=replace)
        forget_records()
        identity.prove(store, info.identity)  # another recorder won the race with another root: unavailable
        return RootState(tier, node, shown, MARKED if marked else RECORDED, info.identity)


def init_tiers(settings: Settings, *, actor: str, replace: bool = False,
               tiers: tuple[int, ...] = (0, 1, 2)) -> list[RootState]:
    """``init_tier`` for each of ``tiers``; an unavailable one is reported (and alerted), not
    raised, so the others are still set up."""
    out = []
    for tier in tiers:
        try:
            out.append(init_tier(settings, tier, actor=actor, replace=replace))
        except TierUnavailable as exc:
            alert(settings, exc)
            out.append(RootState(tier, root_node(tier, settings.node), exc.url, UNAVAILABLE, detail=exc.reason))
    return out
