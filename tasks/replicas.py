"""Reading stored replicas back: which copies this machine can read, the manifest each holds,
and what a failed read means for the catalog. Shared by restore, scrub and the drills.

A replica is read from ``<tier root>/<run>/step-<step>/`` of its tier and checked against the
manifest the catalog registered (``tasks.base.registered_manifest``). Tier 0 is node-local, so
only Tier 0 replicas recorded for this node (``Settings.node``) are readable here.

What a failure means (``classify_failure``): bytes or a manifest that do not match the
catalog's record make the replica ``corrupt``; files that are not there make it ``missing``;
a transient error (timeout, 5xx) says nothing about the replica and changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from core.errors import BadInput, CorruptCheckpoint, NotFound, StaleState
from core.settings import Settings
from core.storage import open_store
from core.storage.base import TierStore
from core.tiers import readable_from
from db.catalog import Catalog
from db.entities import CORRUPT, MISSING, VERIFIED, ReplicaInfo
from tasks.base import tier_store

DEFAULT_PREFERENCE = (0, 1, 2)


class TierStores:
    """Opens each configured tier's store once, on first use. Tiers without a URL are absent."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._open: dict[int, TierStore] = {}

    def configured(self, tier: int) -> bool:
        return bool(self.settings.tier_url(tier))

    def get(self, tier: int) -> TierStore:
        if tier not in self._open:
            self._open[tier] = tier_store(self.settings, tier)
        return self._open[tier]

    def in_place(self, tier: int, key: str) -> Path | None:
        """Where a trainer here reads ``key`` of ``tier`` as it lies (``TierStore.in_place``;
        None: it must be fetched), from the tier's URL alone: a path is no verdict, so the tier
        is not proven (opened) for it, and a tier that is unavailable never stops a resume that
        reads another."""
        if tier in self._open:
            return self._open[tier].in_place(key)
        url = self.settings.tier_url(tier)
        if not url:
            return None
        with open_store(url, tier, self.settings) as store:  # nothing read: the URL's shape
            return store.in_place(key)

    def close(self) -> None:
        """Release what the stores hold (S3 transfer threads); they reopen on the next ``get``."""
        for store in self._open.values():
            store.close()
        self._open.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def readable_here(replica: ReplicaInfo, settings: Settings) -> bool:
    """True when this machine can read ``replica``: its tier is configured and, for Tier 0,
    it is on this node's NVMe."""
    if not settings.tier_url(replica.tier):
        return False
    return readable_from(replica.tier, replica.node, settings.node)


def verified_sources(replicas: Iterable[ReplicaInfo], part: int, settings: Settings,
                     preference: Sequence[int] = DEFAULT_PREFERENCE, *,
                     states: Collection[str] = (VERIFIED,)) -> list[ReplicaInfo]:
    """The verified replicas of ``part`` readable here, nearest tier first (``preference``);
    ``states``: others to read from as well (scrub's repair also reads a copy being pruned)."""
    rank = {tier: i for i, tier in enumerate(preference)}
    found = [r for r in replicas
             if r.part == part and r.state in states and r.tier in rank and readable_here(r, settings)]
    return sorted(found, key=lambda r: rank[r.tier])


def classify_failure(exc: BaseException) -> str | None:
    """The replica state a read failure proves (``corrupt`` / ``missing``), or None when the
    failure says nothing about the stored bytes (transient, or a problem on our side)."""
    if isinstance(exc, (NotFound, FileNotFoundError)):
        return MISSING
    if isinstance(exc, (CorruptCheckpoint, BadInput)):  # BadInput: a stored manifest that fails validation
        return CORRUPT
    return None


@dataclass(frozen=True)
class BadReplica:
    """A replica that a read proved bad, and what the catalog now says about it."""

    replica_id: int
    run: str
    step: int
    tier: int
    part: int
    state: str  # corrupt | missing
    reason: str
    marked: bool = True  # False: the row had moved on since it was read (left as it is now)


def mark_bad(catalog: Catalog, replica: ReplicaInfo, state: str, reason: str, *, actor: str) -> BadReplica:
    """Record that ``replica`` failed a read (verified -> corrupt/missing), as a compare-and-set
    on the row as the caller read it (its ``updated_at``): a copy another worker re-verified
    since (a sibling finishing a fresh fetch while this one read the old or half-made files) is
    never marked bad. Losing that race, or to any other writer, is fine: the row moved on."""
    try:
        catalog.transition(replica.id, state, expected=VERIFIED, actor=actor, reason=reason[:500],
                           seen_updated_at=replica.updated_at)
        marked = True
    except StaleState:
        marked = False
    return BadReplica(replica.id, replica.run, replica.step, replica.tier, replica.part, state, reason, marked)
