"""Source: Tier 2 through a rehydrated Tier 1. A part whose only fetchable copy is on Tier 2 is
first published to Tier 1 as a claimed copy, so that of N nodes resuming at once one reads the
object store and the others read Tier 1."""

from __future__ import annotations

from core import events
from core.errors import CorruptCheckpoint, NotFound, StorageFull, StorageUnavailable, TierUnavailable
from core.tiers import Tier
from db.catalog import Catalog
from db.entities import CheckpointInfo
from tasks.base import log
from tasks.replicas import TierStores
from tasks.resume.check import mark
from tasks.resume.fetch import copy_when_free
from tasks.resume.plan import sources


def hydrate(cat: Catalog, stores: TierStores, ck: CheckpointInfo, part: int, actor: str,
            notes: list[str]) -> int:
    """When the part's only fetchable copy is on Tier 2 and Tier 1 is configured, publish a
    verified Tier 1 copy first (one claim per cluster; the others wait for it). Bytes read now."""
    if not stores.configured(1):
        return 0
    srcs = sources(cat, stores, ck, part)
    if not srcs or any(not Tier(s.tier).object_store for s in srcs):
        return 0
    tier2 = srcs[0]  # the only source there is: the object store's
    try:
        hop = copy_when_free(cat, stores.settings, ck, part, src_tier=2, dst_tier=1, actor=actor)
    except (CorruptCheckpoint, NotFound) as exc:
        mark(cat, tier2.replica, exc, actor, notes)
        return 0
    except TierUnavailable as exc:
        if exc.tier == 1:
            _not_rehydrated(ck, part, exc, stores.settings.node, notes)
        else:  # the source's root not proven: announced by its proof; no verdict, no rehydration alert
            notes.append(f"step {ck.step} part {part}: not rehydrated, {exc}")
        return 0
    except (StorageFull, StorageUnavailable, OSError) as exc:  # Tier 1's trouble, not the copy's
        _not_rehydrated(ck, part, exc, stores.settings.node, notes)
        return 0
    if hop.skipped:
        return 0
    notes.append(f"step {ck.step} part {part}: Tier 1 rehydrated from Tier 2 ({hop.bytes} bytes)")
    return hop.bytes


def _not_rehydrated(ck: CheckpointInfo, part: int, exc: BaseException, node: str, notes: list[str]) -> None:
    """A rehydration that failed for a reason of Tier 1's (full, unreachable): the part is "not
    rehydrated" (the claim released it, nothing published) and the resume goes on to fetch it
    into this node's folder; the operator is told (a warning, ``ckpt.resume.rehydrate_failed``)."""
    log.warning("resume %s/step-%d part %d: Tier 1 not rehydrated (%s: %s); fetching from Tier 2 into this "
                "node's folder instead", ck.run, ck.step, part, type(exc).__name__, exc)
    notes.append(f"step {ck.step} part {part}: Tier 1 not rehydrated ({exc})")
    events.announce(events.REHYDRATE_FAILED, ck.run, ck.step, part=part, parts=ck.parts, node=node,
                    extra_id="tier1", payload={"tier": 1, "error": f"{type(exc).__name__}: {exc}"[:500]})
